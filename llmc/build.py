"""`llmc build`: recipe -> plan -> calibrate -> quantize -> export -> evaluate -> gate -> publish.

Each stage is a function of its inputs, stored under a key that hashes its config, its inputs' keys and the llmc
version (`llmc.store`). Rerunning an unchanged recipe finds every stage done; changing a field recomputes exactly
the stages whose keys it enters (gates enter none: they are re-applied on every run from cached evaluations).
What varies by runtime, engine or algorithm comes from their registries (`llmc.targets`, `llmc.engines`,
`llmc.quant.algorithms`); this module names none of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc import distributed, events
from llmc.compiler.files import SERVE_FILE
from llmc.data import stages as data
from llmc.data.bos import bos_decision
from llmc.data.sources import corpora_of, label
from llmc.engines import engine_spec, open_engine, split
from llmc.engines.agreement import HEAD_FILE, KL_BOUND, kld_kind, load_reference, split_head
from llmc.errors import (EngineFailed, EngineUnavailable, LlmcError, PerformanceGateError, QualityGateError,
                         ResourceError)
from llmc.eval.gates import gate_build
from llmc.eval.metrics import mean_interval, paired_ppl_change, perplexity, perplexity_interval
from llmc.model.dtype import resolve_dtype, source_dtype
from llmc.model.source import resolve_source
from llmc.model.tokenizer_files import load_tokenizer
from llmc.plan import check_disk, make_plan
from llmc.progress import log
from llmc.quant.algorithms import quantize_stage_config
from llmc.quant.canonical import QuantizedModel, scheme_from_dict
from llmc.quant.device import resolve_device
from llmc.quant.stream import CALIBRATION_BATCH_SIZE, quantize_model
from llmc.recipe.schema import Recipe, Target
from llmc.result import Artifact, BuildResult, Evaluation, StageRecord, eval_id
from llmc.store import COMPLETE_MARKER, CorruptOutput, Store, atomic_save_safetensors, atomic_write_json, resource_errors, stage_key
from llmc.targets import ExportRequest, artifact_format, format_for, target_key, triton_backend


def build(recipe: Recipe, store: Store, *, publish: bool = True, threads: int | None = None,
          overrides: tuple[str, ...] = ()) -> BuildResult:
    """The whole pipeline. A cached output found changed when a later stage reads it or when it is published is
    discarded (CorruptOutput) and the build runs once more, rebuilding exactly that output and what depends on
    its bytes: exports are deterministic, so the rebuilt bytes are the recorded ones and their evaluations stand."""
    from llmc.registry.local import publish_build

    for attempt in (1, 2):
        try:
            result = build_until(recipe, store, "gate", threads=threads)
            result.overrides = tuple(overrides)  # the manifest records them beside the resolved recipe
            if publish and result.passed:
                with resource_errors("the registry entry", Path(recipe.publish.registry).expanduser() / recipe.name):
                    result.published, result.publish_noop = publish_build(result, store)
                events.emit("publish:done")
                if recipe.publish.hub:  # after the local entry is complete: the Hub gets its verified bytes
                    from llmc.registry.hub import publish_to_hub

                    log(f"published to the Hub: {publish_to_hub(result.published, recipe.publish.hub)}")
            return result
        except CorruptOutput as e:
            if attempt == 2:
                raise
            log(f"warning: {e.message}; rebuilding it")
    raise AssertionError("unreachable")


def build_until(recipe: Recipe, store: Store, last: str, *, threads: int | None = None) -> BuildResult:
    """Run the stages up to and including `last` ('quantize', 'export' or 'gate')."""
    if threads:
        torch.set_num_threads(threads)
    make_plan(recipe)  # recipe + capability checks fail here, before anything is loaded
    if distributed.launched():  # torchrun: every rank calibrates and quantizes its block of windows
        distributed.init(resolve_device(recipe.calibration.device))
    if distributed.is_main():
        store.sweep()  # leftovers of processes that are gone
    source = _main_first(lambda: resolve_source(recipe.model.source, store, source_dtype(recipe.model.dtype)))
    plan = make_plan(recipe, source.folder)  # + model shape checks and memory, from headers only
    log(plan.render())
    build_id = build_id_for(recipe, source)
    result = BuildResult(recipe=recipe, build_id=build_id, plan=plan, source=source,
                         dtype=resolve_dtype(recipe.model.dtype, source.folder))

    tokenizer = load_tokenizer(source.folder)  # size-capped files; a refused tokenizer is exit 7
    needs_calibration = any(s.needs_calibration for s in plan.schemes.values())
    # Both token sets first: a source that is missing, too small or shared with the other fails before any work.
    calib_tokens = data.calibration_tokens(recipe.calibration, tokenizer) if needs_calibration else None
    eval_tokens = data.eval_tokens(recipe.eval, tokenizer) if last == "gate" else None
    if calib_tokens is not None and eval_tokens is not None:
        data.check_calibration_eval_overlap(calib_tokens, eval_tokens, recipe.eval)
    result.bos = bos_decision(tokenizer).record()
    # shared by all variants; under torchrun rank 0 calibrates first and the other ranks reuse its stage
    calib_key = _main_first(lambda: _calibrate(result, store, calib_tokens)) if needs_calibration else None
    check_disk(plan, store.root, _pending_stages(result, store, calib_key))  # what is cached needs no new disk
    quantized = {}
    for name, scheme in plan.schemes.items():
        quantized[name] = _quantize(result, store, scheme, calib_key if scheme.needs_calibration else None)
        result.quantized_dirs[name] = quantized[name][0]
    if distributed.active():  # rank 0 alone exports, evaluates, gates and publishes; the others help it score
        distributed.barrier()
        if last != "gate":
            distributed.destroy()
            if distributed.world_from_env().rank != 0:
                return result
        elif _follow_or_lead() == "followed":
            return result
    if last == "quantize":
        return result
    try:  # under torchrun the other ranks wait for rank 0's scoring commands until it releases them (finally)
        for name, (quant_dir, quant_key) in quantized.items():
            qm = QuantizedModel.open(quant_dir)
            for target in recipe.targets:
                _export(result, store, qm, quant_key, target, f"{name}/{target.label}" if name else target.label)
        if last == "export":
            return result
        _log_ranks(recipe.eval.runtimes)
        for corpus, tokens in eval_tokens.items():  # one corpus (None), or each of eval.corpus's, in recipe order
            _evaluate(result, store, tokens.input_ids, corpus)
    finally:
        distributed.release()
    if recipe.eval.tasks:
        _evaluate_tasks(result, store, tokenizer)
    _gate(result)
    return result


def _follow_or_lead() -> str:
    """After a torchrun job's quantize stage: rank 0 'leads' the evaluation (llmc.engines.split); the other ranks
    score when it asks, until it releases them, and have then 'followed'."""
    from llmc.engines.split import follow_scoring

    distributed.open_commands()
    if distributed.is_main():
        return "leads"
    follow_scoring()
    distributed.destroy()
    return "followed"


def _log_ranks(runtimes: list[str]) -> None:
    """Under torchrun, once: which evaluation engines split the windows over the ranks and which run on rank 0."""
    if not distributed.active():
        return
    used = list(dict.fromkeys(e for r in runtimes for e in (engine_spec(r).baseline_engine, r)))
    splitting = [e for e in used if engine_spec(e).splits_over_ranks]
    alone = [e for e in used if e not in splitting]
    if splitting:
        log(f"eval: {', '.join(splitting)} scores the windows split over {distributed.size()} ranks")
    if alone:
        log(f"eval: {', '.join(alone)} runs on rank 0 alone (its own process); the other ranks wait")


def build_id_for(recipe: Recipe, source) -> str:
    """The build id: the recipe (less where it publishes) and the model source's hash (a Hub commit included)."""
    return stage_key("build", recipe.model_dump(mode="json", exclude={"publish"}), [source.sha256])


class _Timer:
    """Records a stage's wall time in the result when its block completes."""

    def __init__(self, result: BuildResult, name: str, key: str, cached: bool) -> None:
        self.result, self.name, self.key, self.cached = result, name, key, cached

    def __enter__(self):
        self.t = time.monotonic()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.result.stages.append(StageRecord(self.name, self.key, self.cached, round(time.monotonic() - self.t, 3)))


# --------------------------------------------------------------------------- calibrate, quantize


def _calibrate(result: BuildResult, store: Store, tokens) -> str:
    c = result.recipe.calibration
    cfg = data.calibration_config(c, tokens)
    key = stage_key("calibrate", cfg, [result.source.sha256])
    done = store.lookup("calibrate", key)
    with _Timer(result, "calibrate", key, done is not None):
        if done is None:
            log(f"calibration: {c.samples} {c.packing} of {c.seq_len} tokens from {label(c.dataset)} (seed {c.seed})")
            with store.produce("calibrate", key) as out:
                saved = {"input_ids": tokens.input_ids}
                if tokens.attention_mask is not None:
                    saved["attention_mask"] = tokens.attention_mask
                atomic_save_safetensors(out / "tokens.safetensors", saved)
                atomic_write_json(out / "samples.json", {**cfg, **data.provenance(c, tokens)})
                events.emit("calibrate:written")
            done = store.lookup("calibrate", key)
    result.calibration = json.loads((done / "samples.json").read_text())
    return key


def _quantize_key(result: BuildResult, scheme, calib_key: str | None) -> str:
    device = resolve_device(result.recipe.calibration.device)
    cfg = {"scheme": scheme.to_dict(), "dtype": result.dtype, **quantize_stage_config(scheme)}
    if device.type != "cpu":  # float rounding differs by device; CPU keys stay as they were
        cfg["device"] = device.type
    if result.recipe.calibration.moe_calibrate_all_experts:  # MoE statistics from every token (keys without: as were)
        cfg["moe_calibrate_all_experts"] = True
    ranks = distributed.world_from_env().size
    if ranks > 1 and _sums_over_windows(scheme):  # sums over windows associate differently on N ranks (maxima do not)
        cfg["ranks"] = ranks
    return stage_key("quantize", cfg, [result.source.sha256, calib_key or ""])


def _pending_stages(result: BuildResult, store: Store, calib_key: str | None) -> set[str]:
    """The plan's stage names whose outputs are not in the cache yet (evaluations always count: they are small)."""
    pending = {s["stage"] for s in result.plan.estimates.get("stages", []) if s["stage"].startswith("eval")}
    for name, scheme in result.plan.schemes.items():
        target_labels = [f"{name}/{t.label}" if name else t.label for t in result.recipe.targets]
        quant_key = _quantize_key(result, scheme, calib_key if scheme.needs_calibration else None)
        quant_dir = store.stage_dir("quantize", quant_key)
        if not (quant_dir / COMPLETE_MARKER).is_file():
            pending |= {f"quantize {name or scheme.name}"} | {f"export {t}" for t in target_labels}
            continue
        qm = QuantizedModel.open(quant_dir)
        for target, target_label in zip(result.recipe.targets, target_labels):
            if not (store.stage_dir("export", _export_key(result, qm, quant_key, target)[0]) / COMPLETE_MARKER).is_file():
                pending.add(f"export {target_label}")
    return pending


def _quantize(result: BuildResult, store: Store, scheme, calib_key: str | None) -> tuple[Path, str]:
    device = resolve_device(result.recipe.calibration.device)
    key = _quantize_key(result, scheme, calib_key)
    done = store.lookup("quantize", key)
    if distributed.active() and distributed.broadcast_object(done is not None) != (done is not None):
        raise ResourceError(f"rank {distributed.rank()} and rank 0 see different contents in the cache {store.root}",
                            fix="under torchrun every rank needs the same cache folder: a filesystem shared by all "
                                "nodes (--cache-dir / $LLMC_CACHE)")
    with _Timer(result, f"quantize:{scheme.name}", key, done is not None):
        if done is None:
            tokens = mask = None
            if calib_key:
                calibration = store.stage_dir("calibrate", calib_key)
                store.require_intact(calibration)
                saved = load_file(str(calibration / "tokens.safetensors"))
                tokens, mask = saved["input_ids"], saved.get("attention_mask")
            log(f"quantize: {scheme.name} with {scheme.algorithm}, one decoder layer at a time on {device}")
            with _producing(store, "quantize", key) as out:
                quantize_model(
                    result.source,
                    scheme,
                    out,
                    calibration=tokens,
                    calibration_mask=mask,
                    dtype=getattr(torch, result.dtype),
                    extra_meta={"calibration_key": calib_key, "device": device.type},
                    on_layer_done=lambda i: events.emit(f"quantize:layer:{i}"),
                    spill_activations=result.recipe.calibration.spill_activations,
                    shared_stats=_shared_stats_dir(result, store, calib_key, device),
                    device=device,
                    moe_calibrate_all_experts=result.recipe.calibration.moe_calibrate_all_experts,
                    moe_min_tokens=result.recipe.calibration.moe_min_tokens,
                )
            done = store.lookup("quantize", key)
    return done, key


def _sums_over_windows(scheme) -> bool:
    """Whether the scheme's result depends on sums over the calibration windows (Hessians, AWQ's search), whose last
    bits may depend on how many ranks added them (llmc.distributed); ranges are maxima and do not."""
    from llmc.quant.algorithms import Pipeline

    pipeline = Pipeline.of(scheme)
    return pipeline.observes_hessians or pipeline.replays_module_calls


def _main_first(produce):
    """`produce()` on rank 0 first (it writes the stage), then on the other ranks, which find it in the cache."""
    if distributed.is_main():
        out = produce()
        distributed.barrier()
        return out
    distributed.barrier()
    return produce()


@contextlib.contextmanager
def _producing(store: Store, stage: str, key: str):
    """A resumable stage's work folder (`Store.produce`). Under torchrun rank 0 holds the stage's lock and the
    others work in the same folder; rank 0 commits it after every rank is done (the stream writes files on rank 0
    only)."""
    if not distributed.active():
        with store.produce(stage, key, resumable=True) as out:
            yield out
        return
    if distributed.is_main():
        with store.produce(stage, key, resumable=True) as out:
            distributed.broadcast_object(str(out))
            yield out
            distributed.barrier()
        distributed.barrier()  # committed: the others may look it up
        return
    out = Path(distributed.broadcast_object(None))
    yield out
    distributed.barrier()
    distributed.barrier()


def _shared_stats_dir(result: BuildResult, store: Store, calib_key: str | None, device: torch.device) -> Path | None:
    """Where schemes calibrated on original outputs share statistics: one folder per model, data and dtype
    (and the stream's batch size, which fixes the exact arithmetic of the calibration forwards)."""
    if calib_key is None:
        return None
    cfg = {"dtype": result.dtype, "batch_size": CALIBRATION_BATCH_SIZE}
    if device.type != "cpu":
        cfg["device"] = device.type
    key = stage_key("shared-stats", cfg, [result.source.sha256, calib_key])
    return store.root / "shared-stats" / key


# --------------------------------------------------------------------------- export


def _export_key(result: BuildResult, qm: QuantizedModel, quant_key: str, target: Target):
    """(stage key, stage config, format, request) of one target's export."""
    fmt = format_for(target)
    ev = result.recipe.eval
    request = ExportRequest(quantized=qm, target=target, max_model_len=ev.seq_len, max_batch_size=ev.batch_size)
    cfg = {"exporter": fmt.name, **fmt.stage_config(request)}
    if target.triton:
        cfg.setdefault("target", target_key(target))  # the repository is named after the target
    return stage_key("export", cfg, [quant_key]), cfg, fmt, request


def _export(result: BuildResult, store: Store, qm: QuantizedModel, quant_key: str, target: Target, label: str) -> None:
    key, cfg, fmt, request = _export_key(result, qm, quant_key, target)
    done = store.lookup("export", key)
    with _Timer(result, f"export:{label}", key, done is not None):
        if done is None:
            log(f"export: {fmt.name} for {label}")
            store.require_intact(qm.root)  # the export is made from these bytes: every one as recorded
            with store.produce("export", key) as out:
                fmt.write(request, out)
                if target.triton:
                    from llmc.compiler.triton_repo import model_name, write_triton_repo

                    write_triton_repo(out, triton_backend(target), name=model_name(f"{result.recipe.name}-{label}"),
                                      serve=cfg.get("serve"))
                events.emit("export:written")
            done = store.lookup("export", key)
    # the sha256 recorded when the export was written (reuse checked the sizes; publish checks every byte)
    files = _top_level(store.recorded(done))
    result.artifacts[label] = Artifact(
        label=label, dir=done, key=key, files=files,
        content_key=stage_key("artifact-content", {k: v for k, v in files.items() if k != SERVE_FILE}),
        format=fmt.name, target=target_key(target), scheme=qm.scheme.name, scheme_detail=qm.scheme.to_dict())


# --------------------------------------------------------------------------- evaluate, gate


def _evaluate(result: BuildResult, store: Store, windows: torch.Tensor, corpus: str | None = None) -> None:
    """Each engine in eval.runtimes scores the baseline and every artifact whose format it loads, on the same
    windows of one evaluation corpus (`corpus`: its label when eval.corpus names several, else None). An engine
    that cannot load the unquantized source is paired with the torch reference's baseline (its change then
    includes the engine's own arithmetic); an artifact whose content another target already had is scored once."""
    ev = result.recipe.eval
    prompt = windows[:1]
    source = corpora_of(ev.corpus)[corpus]
    for engine in ev.runtimes:
        spec = engine_spec(engine)
        readable = {label: art for label, art in result.artifacts.items()
                    if engine in artifact_format(art.format).read_by}
        base_engine = spec.baseline_engine
        try:
            base = _eval_one(result, store, base_engine, result.source.folder, result.source.sha256, windows, prompt,
                             corpus=source)
        except (EngineUnavailable, EngineFailed) as e:
            log(f"warning: baseline could not be evaluated in {base_engine}"
                + (f" on {corpus}" if corpus is not None else "") + f": {e}")
            for label in readable:
                result.target_evals.setdefault(label, []).append(eval_id(engine, label, corpus))
                result.evals[eval_id(engine, label, corpus)] = Evaluation(engine, corpus=corpus, error=str(e))
            continue
        base.corpus = corpus
        result.evals[eval_id(base_engine, "baseline", corpus)] = base
        by_content: dict[str, Evaluation] = {}
        for label, art in readable.items():
            this = eval_id(engine, label, corpus)
            result.target_evals.setdefault(label, []).append(this)
            reason = spec.cannot_run(scheme_from_dict(art.scheme_detail))
            if reason:
                log(f"eval: {engine} skips {label}: {reason}")
                result.evals[this] = Evaluation(engine, corpus=corpus, skipped=reason)
                continue
            try:
                if art.content_key not in by_content:
                    m = _eval_one(result, store, engine, art.dir, art.content_key, windows, prompt, reference=base,
                                  corpus=source)
                    m.ppl_change = paired_ppl_change(base.nll, m.nll, ev.bootstrap_samples)
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


def _eval_one(result: BuildResult, store: Store, engine: str, folder: Path, content_key: str, windows, prompt,
              reference: Evaluation | None = None, *, corpus) -> Evaluation:
    """Evaluate one model folder in one engine on one corpus's windows. The baseline (no reference) also stores its
    top-k log-probs; an artifact is scored against the baseline's, giving KL and top-1 agreement."""
    ev = result.recipe.eval
    batch_sizes = engine_spec(engine).batch_sizes(tuple(ev.throughput_batch_sizes))
    cfg = {
        "engine": engine,
        "corpus": data.eval_corpus_config(corpus),
        "split": "eval",
        "seq_len": ev.seq_len,
        "windows": ev.windows,
        "decode_tokens": ev.decode_tokens,
        "repeats": ev.throughput_repeats,
        "throughput_batch_sizes": list(batch_sizes),
        "dtype": result.dtype,
        "top_k": ev.kl_top_k,
        "kl": "exact, top-k bound as fallback",  # the baseline records its output head (llmc.engines.agreement)
        "tokenizer_sha256": _tokenizer_hash(store, result.source.folder),
        "windows_sha256": stage_key("windows", windows.tolist()),
    }
    key = stage_key("eval", cfg, [content_key, reference.key if reference else ""])
    # an artifact's evaluation records the sha256 of the files it measured; other bytes invalidate it
    measured = None
    if reference is not None:  # the files content_key covers: the serve file differs between targets sharing weights
        measured = {k: v for k, v in _top_level(store.recorded(folder)).items() if k != SERVE_FILE}
    done = store.lookup("eval", key)
    if done is not None and measured is not None:
        recorded = json.loads((done / "metrics.json").read_text()).get("measured_files")
        if recorded != measured:
            store.discard(done, ["it measured other bytes than the artifact now records"])
            done = None
    label = "baseline" if reference is None else Path(folder).name[:8]
    with _Timer(result, f"eval:{engine}:{label}", key, done is not None):
        if done is None:
            log(f"eval: {engine} on {label} ({ev.windows} windows of {ev.seq_len} tokens)")
            ref_scores = reference_dir = None
            if reference is not None:
                store.require_intact(folder)  # measure exactly the bytes the export recorded
                reference_dir = store.stage_dir("eval", reference.key)
                store.require_intact(reference_dir)
                ref_scores = load_reference(reference_dir)
            with store.produce("eval", key) as out:
                t = time.monotonic()
                with split.scoring_ranks(engine, folder, dtype=result.dtype, windows=windows, top_k=ev.kl_top_k,
                                         batch_size=ev.batch_size, reference_dir=reference_dir), \
                        open_engine(engine, folder, dtype=result.dtype) as eng:
                    load_s = time.monotonic() - t
                    t = time.monotonic()
                    scores, tput = eng.measure(windows, prompt, decode_tokens=ev.decode_tokens,
                                               repeats=ev.throughput_repeats, batch_size=ev.batch_size,
                                               reference=ref_scores, top_k=ev.kl_top_k,
                                               throughput_batch_sizes=batch_sizes)
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
                events.emit("eval:written")
            done = store.lookup("eval", key)
    stored = json.loads((done / "metrics.json").read_text())
    scores = load_file(str(done / "scores.safetensors"))
    nll = scores["nll"]
    m = Evaluation(**stored, key=key, perplexity=perplexity(nll),
                   ppl_ci95=list(perplexity_interval(nll, ev.bootstrap_samples)), nll=nll,
                   # what this engine measures: vLLM returns only the actual tokens' log-probs, so no KL / top-1
                   measures=["perplexity", "throughput"] + (["kld", "top1_agreement"] if "kl" in scores else []))
    if "kl" in scores:
        m.kld = mean_interval(scores["kl"], ev.bootstrap_samples)
        if KL_BOUND in scores:
            m.kld_bound = mean_interval(scores[KL_BOUND], ev.bootstrap_samples)
        m.top1_agreement = mean_interval(scores["top1"], ev.bootstrap_samples)
    return m


def _evaluate_tasks(result: BuildResult, store: Store, tokenizer) -> None:
    """eval.tasks through lm-evaluation-harness on the torch reference engine: the baseline and every artifact the
    torch engine reads, each result cached under its model's content key."""
    from llmc.eval import harness

    ev, dtype = result.recipe.eval, result.dtype
    cfg = {"tasks": harness.tasks_fingerprint(ev.tasks), "limit": ev.task_limit, "dtype": dtype,
           "tokenizer_sha256": _tokenizer_hash(store, result.source.folder)}

    def run(folder: Path, content_key: str, label: str) -> dict:
        key = stage_key("tasks", cfg, [content_key])
        done = store.lookup("tasks", key)
        with _Timer(result, f"tasks:{label}", key, done is not None):
            if done is None:
                log(f"tasks: {', '.join(ev.tasks)} on {label} (lm-evaluation-harness, torch engine)")
                with store.produce("tasks", key) as out, open_engine("torch", folder, dtype=dtype) as eng:
                    atomic_write_json(out / "tasks.json", harness.run_tasks(eng, tokenizer, ev.tasks,
                                                                            limit=ev.task_limit))
                done = store.lookup("tasks", key)
        return json.loads((done / "tasks.json").read_text())

    first = next(iter(corpora_of(ev.corpus)))  # tasks read no corpus: their results sit on the first corpus's rows
    base = result.evals.get(eval_id("torch", "baseline", first))
    if base is not None:
        base.tasks = run(result.source.folder, result.source.sha256, "baseline")
    for target_label, art in result.artifacts.items():
        m = result.evals.get(eval_id("torch", target_label, first))
        if m is not None and m.succeeded:
            m.tasks = run(art.dir, art.content_key, target_label)


def _top_level(recorded: dict[str, dict]) -> dict[str, str]:
    """sha256 of a stage output's top-level files, as recorded when it was written."""
    return {rel: f["sha256"] for rel, f in sorted(recorded.items())
            if "/" not in rel and not rel.startswith(".") and "sha256" in f}


def _tokenizer_hash(store: Store, folder: Path) -> str | None:
    f = Path(folder) / "tokenizer.json"
    return store.file_hash(f) if f.is_file() else None


def _hardware() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def _gate(result: BuildResult) -> None:
    result.verdicts += gate_build(result)  # per artifact; fails closed on what no engine measured
    if result.recipe.eval.tasks:  # lm-evaluation-harness accuracy against the baseline's (llmc.eval.harness)
        from llmc.eval.harness import task_verdicts

        first = next(iter(corpora_of(result.recipe.eval.corpus)))  # where _evaluate_tasks put the results
        base_id = eval_id("torch", "baseline", first)
        base = result.evals.get(base_id)
        for this, m in result.evals.items():
            if m.engine == "torch" and m.corpus == first and this != base_id and m.succeeded:
                result.verdicts += task_verdicts(result.recipe.gates.min_task_accuracy_ratio, this,
                                                 base.tasks if base else None, m.tasks)


def raise_for_gates(result: BuildResult) -> None:
    failed = [v for v in result.verdicts if not v.passed]
    if not failed:
        return
    msg = "; ".join(f"{v.target} {v.gate}: measured {v.measured}, threshold {v.threshold}" for v in failed)
    fix = "inspect report.md; relax the gate only if the loss is acceptable"
    if any(not v.evaluated for v in failed):
        fix = ("add an engine that measures the gate for that artifact to eval.runtimes (see the reason), or set "
               "gates.allow_unevaluated: true to publish it unmeasured; " + fix)
    if any(v.kind in ("quality", "availability") for v in failed):
        raise QualityGateError(f"gate failed, build not published: {msg}", fix=fix)
    raise PerformanceGateError(f"gate failed, build not published: {msg}", fix=fix)
