"""The evaluate stage: each engine in eval.runtimes scores the baseline and every artifact whose format it loads,
on the same windows of each evaluation corpus; each scoring is cached on its own.

Key of one scoring: the engine, the evaluation protocol (corpus, windows, lengths, throughput settings, dtype,
tokenizer), the scored model's content key and the baseline's scoring key. Cost: every other engine's scorings by
the engine's own module (`EngineSpec.scoring_cost`); the torch engine's (llmc.engines.torch_cost.eval_cost: the
baseline, then each variant), per corpus: the whole dense model, or (streamed,
llmc.engines.torch_stream) the outer weights, one dense layer (an artifact's: + its codes and the float32
decompression of one block of rows, or of one Linear for packed int4), the hidden states of every window and one
batch's logits; the baseline's output head an artifact is scored with is mapped."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc.runtimes import catalog as targets
from llmc.formats.files import MAX_SHARD_BYTES, SERVE_FILE
from llmc.data import stages as data
from llmc.data.sources import corpora_of
from llmc.engines import engine_spec, open_engine, split
from llmc.engines.base import Scoring
from llmc.engines.registry import REFERENCE_ENGINE
from llmc.engines.torch_stream import TorchLoading, decide_torch_loading, decide_torch_loading_of
from llmc.engines.torch_cost import emulated_elements, eval_cost
from llmc.engines.agreement import HEAD_FILE, kld_kind, load_reference, split_head
from llmc.errors import EngineFailed, EngineUnavailable, LlmcError, ResourceError
from llmc.eval.protocol import evaluation_of
from llmc import distributed
from llmc.pipeline.stage import Stage
from llmc.pipeline import ranks
from llmc.model.dtype import BYTES
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.runner import Runner, read_json
from llmc.planning.machine import file_write_seconds, verify_seconds
from llmc.planning.rows import CostRow
from llmc.planning.target import active as target_machine
from llmc.telemetry.progress import log
from llmc.pipeline.export import Export
from llmc.pipeline.quantize import Quantize
from llmc.quant.canonical import scheme_from_dict
from llmc.quant.device import resolve_device
from llmc.result import BASELINE, EvalId, Evaluation
from llmc.storage.store import CorruptOutput, atomic_save_safetensors, atomic_write_json, stage_key



class Evaluate(Stage):
    id = StageId(Kind.EVAL)
    share = ranks.Share.HELPED

    def __init__(self, quantizes: list[Quantize], exports: list[Export] = ()) -> None:
        self.quantizes = quantizes  # the variants whose artifacts it scores (their plan rows)
        self.exports = list(exports)  # the artifacts

    def pending(self, b: Build) -> bool:
        return True  # evaluations always count in the disk check: they are small

    def pending_parts(self, b: Build) -> list[StageId]:
        """The plan's scorings (`scorings`) whose outputs are not all in the cache yet, for every corpus. An
        artifact's scorings are keyed by its recorded files: cached exports give their keys (from the store's record
        of their files) and a pending export makes its scoring pending."""
        ev, runner = b.recipe.eval, b.runner
        if b.evaluation is None:
            return [self.id]
        pending: list[StageId] = []
        for corpus, tokens in b.evaluation.items():
            source, windows = corpora_of(ev.corpus)[corpus], tokens.input_ids
            for engine, label, exports in self.scorings(ev.runtimes):
                base = score_key(b, engine_spec(engine).baseline_engine, b.result.source.sha256, windows, None,
                                 source)
                if label == BASELINE_SCORING:
                    done = runner.is_done(self.id, base)
                else:
                    contents = [e.cached_content_key(b) for e in exports]
                    done = all(k is not None and runner.is_done(self.id, score_key(b, engine, k, windows, base, source))
                               for k in contents)
                part = StageId(Kind.EVAL, (engine, label))
                if not done and part not in pending:
                    pending.append(part)
        return pending

    def scorings(self, runtimes: Sequence[str]) -> list[tuple[str, str, list[Export]]]:
        """The scorings the plan has a row for, as (engine, label, the exports it scores), in the build's order: the
        torch reference's baseline (also where only another engine is paired with it) and each variant; then each
        other engine's: its own baseline where it loads the source, and each artifact it reads and can run (one
        per set of files)."""
        out: list[tuple[str, str, list[Export]]] = []
        if any(engine_spec(e).baseline_engine == REFERENCE_ENGINE for e in runtimes):
            out.append((REFERENCE_ENGINE, BASELINE_SCORING, []))
        if REFERENCE_ENGINE in runtimes:
            torch_spec = engine_spec(REFERENCE_ENGINE)
            for q in self.quantizes:
                read = [] if torch_spec.cannot_run(q.scheme) else [
                    e for e in self.exports if e.quantize is q and REFERENCE_ENGINE in e.format.read_by]
                out.append((REFERENCE_ENGINE, q.id.of[0], read))
        for engine in runtimes:
            spec = engine_spec(engine)
            if engine == REFERENCE_ENGINE:
                continue
            if spec.loads_source:
                out.append((engine, BASELINE_SCORING, []))
            seen: set[tuple] = set()
            for e in self.exports:
                if engine in e.format.read_by and not spec.cannot_run(e.scheme) and e.same_files() not in seen:
                    seen.add(e.same_files())
                    out.append((engine, e.label, [e]))
        return out

    def run(self, b: Build) -> None:
        ranks.log_scoring(b.recipe.eval.runtimes)
        for corpus, tokens in b.evaluation.items():  # one corpus (None), or each of eval.corpus's, in recipe order
            _evaluate(b, tokens.input_ids, corpus)

    def decide(self, c: Costing) -> TorchLoading:
        """Whether the torch reference scores one decoder layer at a time: the dense model against the memory of the
        machine `c` plans for (`decide_torch_loading`; LLMC_TORCH_EVAL forces either). The build's torch scorings
        obey it (`_score`), and so do its tasks (llmc.pipeline.tasks)."""
        return decide_torch_loading(c.shape.params * BYTES[c.compute], c.machine.available)

    def cost(self, c: Costing) -> None:
        """A row per scoring (`scorings`): the torch reference's (`eval_cost`), then every other engine's (its own
        module's `scoring_cost`)."""
        scorings = self.scorings(c.recipe.eval.runtimes)
        if scorings and scorings[0][0] == REFERENCE_ENGINE:
            self._cost_torch(c, REFERENCE_ENGINE in c.recipe.eval.runtimes)
        for engine, label, exports in scorings:
            if engine != REFERENCE_ENGINE:
                c.rows.append(self._cost_engine(c, engine, label, exports))

    def _cost_engine(self, c: Costing, engine: str, label: str, exports: list[Export]) -> CostRow:
        """One scoring in an engine other than the torch reference, per corpus: the engine's own cost of it, its
        scores written, and (an artifact's) the artifact's and the baseline's scores verified first."""
        ev, shape, spec = c.recipe.eval, c.shape, engine_spec(engine)
        model_bytes = exports[0].artifact_bytes(c) if exports else float(shape.stored_bytes)
        scoring = Scoring(shape, c.machine, ev.windows, ev.seq_len, ev.decode_tokens, ev.throughput_repeats,
                          ev.kl_top_k, model_bytes, reference=bool(exports))
        row = spec.scoring_cost(scoring)
        if row is None:  # a GPU engine: no cost model (its time is not in the plan's total)
            row = CostRow(engine, "cpu", 0.0, strategy="not planned",
                          why=f"{spec.display} has no cost model here: its time is not in the plan's total "
                              "or resources.max_hours")
        row.named(StageId(Kind.EVAL, (engine, label)))
        row.decision = EngineScoring(engine, spec.baseline_engine, bool(exports))
        if row.strategy == "not planned":
            return row
        row.disk_bytes = scoring.tokens * (ev.kl_top_k * 8 + 16)
        row.seconds += file_write_seconds(row.disk_bytes)
        if exports:  # the artifact's files (read from the disk: written around the page cache) and the baseline's
            row.seconds += verify_seconds(model_bytes, files=max(1, math.ceil(model_bytes / MAX_SHARD_BYTES)))
        n_corpora = len(corpora_of(ev.corpus))
        if n_corpora > 1:  # each corpus is its own evaluation, the engine started again for it
            row.seconds *= n_corpora
            row.disk_bytes *= n_corpora
            row.strategy += f"; {n_corpora} corpora, one after another (time and disk x {n_corpora})"
        return row

    def _cost_torch(self, c: Costing, scores_variants: bool) -> None:
        """The torch reference's rows: its baseline, and (`scores_variants`: torch is in eval.runtimes) each
        variant."""
        ev, shape = c.recipe.eval, c.shape
        decision = self.decide(c)
        streamed = decision.streamed
        throughput = (ev.throughput_repeats + 1) * ev.seq_len + ev.throughput_repeats * ev.decode_tokens
        kwargs = dict(compute=c.compute, windows=ev.windows, seq_len=ev.seq_len, batch=ev.batch_size,
                      top_k=ev.kl_top_k, throughput_tokens=throughput, machine=c.machine, stored_elem=c.stored_elem,
                      device=eval_device(ev.device, "torch"))
        n_corpora = len(corpora_of(ev.corpus))
        # an artifact's codes per weight as the torch engine reads them: packed int4 half a byte, 8-bit one
        scorings = [("baseline", False, 0.0, 0.0, 0, ())]
        for q in self.quantizes if scores_variants else ():
            sizes = q.sizes(c)
            scorings.append((q.id.of[0], True, q.scheme.weights.bits / 8, sizes.artifact, sizes.quantized_params,
                             emulated_elements(q.scheme, c.linears, c.config)))
        baseline_disk = 0.0
        for label, reference, code_bytes, artifact_size, quantized_params, emulated in scorings:
            row = eval_cost(shape, label=f"torch {label}", streamed=streamed, reference=reference,
                            artifact_code_bytes=code_bytes, quantized_params=quantized_params, emulated=emulated,
                            **kwargs)
            row.named(StageId(Kind.EVAL, ("torch", label)))
            row.decision = decision
            # per token: top-k log-probs and ids, NLL; the baseline also keeps its head's inputs and the head itself
            row.disk_bytes = ev.windows * ev.seq_len * (ev.kl_top_k * 8 + 16 + (0 if reference else shape.hidden * 4))
            row.disk_bytes += 0 if reference else shape.vocab * shape.hidden * c.elem
            # its scores (the baseline's: + the head) written with fsync and hashed; an artifact's evaluation first
            # checks every byte of the artifact and of the baseline's scores (Store.require_intact)
            row.seconds += file_write_seconds(row.disk_bytes)
            if reference:  # (read from the disk: both were written around the page cache where large)
                row.seconds += (verify_seconds(baseline_disk)
                                + verify_seconds(artifact_size, files=max(1, math.ceil(artifact_size / MAX_SHARD_BYTES))))
            else:
                baseline_disk = row.disk_bytes
            if n_corpora > 1:  # each corpus is its own evaluation of ev.windows windows, one after another
                row.seconds *= n_corpora
                row.disk_bytes *= n_corpora
                row.strategy += f"; {n_corpora} corpora, one after another (time and disk x {n_corpora})"
            c.rows.append(row)
            if not streamed:
                lean = eval_cost(shape, label=label, streamed=True, reference=reference,
                                 artifact_code_bytes=code_bytes, quantized_params=quantized_params, **kwargs)
                lean = lean.host_bytes + lean.mapped_bytes
                if lean < 0.95 * (row.host_bytes + row.mapped_bytes):
                    row.cheaper = ("set LLMC_TORCH_EVAL=streamed to evaluate one decoder layer at a time",
                                   lean / 1e9)


TorchEvaluation = TorchLoading  # the evaluate stage's decision for the torch reference (its former name)
BASELINE_SCORING = "baseline"  # the label of an engine's scoring of the unquantized source


@dataclass(frozen=True)
class EngineScoring:
    """The evaluate stage's decision for one scoring in an engine other than the torch reference: the engine, the
    baseline it is compared with (its own, or the torch reference's where it cannot load the source), and whether
    it scores an artifact (else the source)."""

    engine: str
    paired_with: str
    artifact: bool

    def as_dict(self) -> dict:
        return {"engine": self.engine, "paired_with": self.paired_with, "artifact": self.artifact}


def _evaluate(b: Build, windows: torch.Tensor, corpus: str | None) -> None:
    """Each engine scores the baseline and every artifact whose format it loads on one corpus's windows (`corpus`:
    its label when eval.corpus names several, else None). An engine that cannot load the unquantized source is
    paired with the torch reference's baseline (its change then includes the engine's own arithmetic); an artifact
    whose content another target already had is scored once."""
    result, ev = b.result, b.recipe.eval
    prompt = windows[:1]
    source = corpora_of(ev.corpus)[corpus]
    for engine in ev.runtimes:
        spec = engine_spec(engine)
        readable = {label: art for label, art in result.artifacts.items()
                    if engine in targets.artifact_format(art.format).read_by}
        base_engine = spec.baseline_engine
        try:
            base = _score(b, base_engine, result.source.folder, result.source.sha256, windows, prompt, corpus=source)
        except (EngineUnavailable, EngineFailed) as e:
            where = f" on {corpus}" if corpus is not None else ""
            log(f"warning: baseline could not be evaluated in {base_engine}{where}: {e}")
            for label in readable:
                this = EvalId(engine, label, corpus)
                result.target_evals.setdefault(label, []).append(this)
                result.evals[this] = Evaluation(engine, corpus=corpus, error=str(e))
            continue
        base.corpus = corpus
        result.evals[EvalId(base_engine, BASELINE, corpus)] = base
        by_content: dict[str, Evaluation] = {}
        for label, art in readable.items():
            this = EvalId(engine, label, corpus)
            result.target_evals.setdefault(label, []).append(this)
            reason = spec.cannot_run(scheme_from_dict(art.scheme_detail))
            if reason:
                log(f"eval: {engine} skips {label}: {reason}")
                result.evals[this] = Evaluation(engine, corpus=corpus, skipped=reason)
                continue
            try:
                if art.content_key not in by_content:
                    m = _score(b, engine, art.dir, art.content_key, windows, prompt, reference=base, corpus=source)
                    m.baseline_engine = base_engine
                    m.corpus = corpus
                    by_content[art.content_key] = m
                result.evals[this] = by_content[art.content_key]
            except ResourceError:
                raise  # the machine, not the artifact, failed: stop the build (exit 4) instead of failing a gate
            except CorruptOutput:
                raise  # not this engine's failure: the cached artifact changed; `build` rebuilds it
            except LlmcError as e:
                result.evals[this] = Evaluation(engine, corpus=corpus, error=str(e))


def eval_device(requested: str, engine: str) -> str:
    """Where `engine` scores: the recipe's eval.device for an engine that places itself on one (the torch
    reference), resolved as calibration.device is; the host under torchrun (each rank scores its share there) and
    for every other engine."""
    if not engine_spec(engine).places_on_device or distributed.active():
        return "cpu"
    planned_for = target_machine()  # `llmc plan --machine`: that machine's devices (a build never sets one)
    if planned_for is not None:
        return planned_for.device_for(requested, "eval.device")
    return str(resolve_device(requested, "eval.device"))


def score_key(b: Build, engine: str, content_key: str, windows: torch.Tensor, reference_key: str | None, corpus, *,
              config: bool = False):
    """The cache key of one scoring (and, with `config`, its protocol as metrics.json records it): the engine, the
    evaluation protocol, the scored model's content key and the baseline scoring's key (None: the baseline)."""
    ev, runner = b.recipe.eval, b.runner
    batch_sizes = engine_spec(engine).batch_sizes(tuple(ev.throughput_batch_sizes))
    device = eval_device(ev.device, engine)
    cfg = {
        "engine": engine,
        "corpus": data.eval_corpus_config(corpus),
        "split": "eval",
        "seq_len": ev.seq_len,
        "windows": ev.windows,
        "decode_tokens": ev.decode_tokens,
        "repeats": ev.throughput_repeats,
        "throughput_batch_sizes": list(batch_sizes),
        "dtype": b.result.dtype,
        "top_k": ev.kl_top_k,
        "kl": "exact, top-k bound as fallback",  # the baseline records its output head (llmc.engines.agreement)
        "tokenizer_sha256": tokenizer_hash(runner, b.result.source.folder),
        "windows_sha256": stage_key("windows", windows.tolist()),
    }
    if device != "cpu":  # float rounding differs by device; CPU keys stay as they were
        cfg["device"] = torch.device(device).type
    key = stage_key("eval", cfg, [content_key, reference_key or ""])
    return (key, cfg) if config else key


def _score(b: Build, engine: str, folder: Path, content_key: str, windows, prompt,
           reference: Evaluation | None = None, *, corpus) -> Evaluation:
    """One model folder scored in one engine on one corpus's windows. The baseline (no reference) also stores its
    top-k log-probs; an artifact is scored against the baseline's, giving KL and top-1 agreement."""
    ev, dtype, runner = b.recipe.eval, b.result.dtype, b.runner
    batch_sizes = engine_spec(engine).batch_sizes(tuple(ev.throughput_batch_sizes))
    device = eval_device(ev.device, engine)
    key, cfg = score_key(b, engine, content_key, windows, reference.key if reference else None, corpus, config=True)
    # the plan's decision for the torch reference (None elsewhere: the engine runs as it runs)
    streamed = torch_loading(b, StageId(Kind.EVAL, ("torch", "baseline")), folder).streamed \
        if engine == "torch" else None
    # an artifact's evaluation records the sha256 of the files it measured; other bytes invalidate it
    measured = None
    if reference is not None:  # the files content_key covers: the serve file differs between targets sharing weights
        measured = {k: v for k, v in runner.recorded_files(folder).items() if k != SERVE_FILE}

    def outdated(done: Path) -> list[str]:
        if measured is not None and read_json(done, "metrics.json").get("measured_files") != measured:
            return ["it measured other bytes than the artifact now records"]
        return []

    reference_dir = runner.output(StageId(Kind.EVAL), reference.key) if reference is not None else None

    def produce(out: Path) -> None:
        ref_scores = load_reference(reference_dir) if reference_dir is not None else None
        t = time.monotonic()
        with split.scoring_ranks(engine, folder, dtype=dtype, windows=windows, top_k=ev.kl_top_k,
                                 batch_size=ev.batch_size, reference_dir=reference_dir), \
                open_engine(engine, folder, dtype=dtype, device=device, streamed=streamed) as eng:
            load_s = time.monotonic() - t
            t = time.monotonic()
            scores, tput = eng.measure(windows, prompt, decode_tokens=ev.decode_tokens,
                                       repeats=ev.throughput_repeats, batch_size=ev.batch_size,
                                       reference=ref_scores, top_k=ev.kl_top_k, throughput_batch_sizes=batch_sizes)
            score_s = time.monotonic() - t
        per_token, head = split_head(scores)
        atomic_save_safetensors(out / "scores.safetensors", per_token)
        if head:
            atomic_save_safetensors(out / HEAD_FILE, head)
        atomic_write_json(out / "metrics.json", {
            "engine": engine, "protocol": cfg, "load_s": load_s, "score_s": score_s,
            "throughput": tput, "hardware": {**_hardware(), "ranks": split.ranks_scoring(engine)},
            "kld_kind": kld_kind(scores),
            "output_head": getattr(eng, "output_head", None) if reference is None else None,
            **({"measured_files": measured} if measured is not None else {}),
        })

    label = "baseline" if reference is None else Path(folder).name[:8]
    # measure exactly the bytes the export recorded, against the baseline's scores as recorded
    done = runner.run(StageId(Kind.EVAL, (engine, label)), key, produce, outdated=outdated,
                      inputs=[folder, reference_dir] if reference_dir is not None else [],
                      announce=f"eval: {engine} on {label} ({ev.windows} windows of {ev.seq_len} tokens)")
    stored = read_json(done, "metrics.json")
    return evaluation_of(stored.pop("engine"), load_file(str(done / "scores.safetensors")),
                         bootstrap_samples=ev.bootstrap_samples, measures_speed=True, key=key, **stored,
                         baseline_nll=reference.nll if reference is not None else None)


def torch_loading(b: Build, planned: StageId, folder: Path) -> TorchLoading:
    """The torch reference's loading for a scoring of `folder`: the plan's decision in row `planned`, or, where the
    plan has no such row (planned without the model's shapes), decided for `folder` on this machine."""
    decision = b.result.plan.decision_of(planned)
    return decision if decision is not None else decide_torch_loading_of(folder, b.result.dtype)


def tokenizer_hash(runner: Runner, folder: Path) -> str | None:
    f = Path(folder) / "tokenizer.json"
    return runner.file_hash(f) if f.is_file() else None


def _hardware() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
