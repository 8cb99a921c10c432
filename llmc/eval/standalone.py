"""`llmc eval`: evaluate an existing artifact (folder or registry entry) against a baseline, on any data source
(`--corpus`, the schema of `eval.corpus`; repeat it for several corpora), with the build's quality gates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from pydantic import TypeAdapter, ValidationError

from llmc.data.sources import EvalCorpora, corpora_of, corpus_part
from llmc.data.stages import eval_tokens
from llmc.engines import engine_spec, open_engine
from llmc.engines.registry import REFERENCE_ENGINE
from llmc.engines.torch_stream import decide_torch_loading_of
from llmc.errors import InputError, RecipeError
from llmc.eval.gates import SUSPICIOUS_IMPROVEMENT, evaluate_gates, non_finite
from llmc.eval.metrics import perplexity
from llmc.eval.protocol import evaluation_of
from llmc.eval.report import render_table
from llmc.model.source import resolve_source
from llmc.quant.device import cpu_threads
from llmc.storage.store import Store
from llmc.runtimes.catalog import recognize
from llmc.model.tokenizer_files import load_tokenizer
from llmc.recipe.schema import EvalSection, Gates

BOOTSTRAP_SAMPLES = EvalSection.model_fields["bootstrap_samples"].default  # a recipe's, unless it sets one


def artifact_folders(path: Path, engine: str) -> list[tuple[str, Path]]:
    """(label, folder) of each artifact at `path` — an artifact folder, or a registry entry's artifacts — that
    `engine` loads, by the format the target registry recognises (an unquantized Hugging Face folder counts
    for the engines that load source models)."""
    entry = (path / "manifest.json").is_file()
    if not entry and not path.is_dir():
        raise InputError(f"{path} is neither an artifact folder nor a registry entry",
                         fix="pass an exported artifact's folder or a registry entry")
    candidates = sorted(p for p in (path / "artifacts").iterdir() if p.is_dir()) if entry else [path]
    found, readable = [], []
    for folder in candidates:
        fmt = recognize(folder)
        found.append(fmt.name if fmt else "unquantized" if (folder / "config.json").is_file() else None)
        loads = engine in fmt.read_by if fmt else found[-1] == "unquantized" and engine_spec(engine).loads_source
        if loads:
            readable.append((folder.name, folder))
    if not readable:
        kinds = ", ".join(sorted({k for k in found if k})) or "none llmc recognises"
        raise InputError(f"{path} holds no artifact the {engine} engine loads (found: {kinds})",
                         fix="choose --engine among the engines that read that format (llmc inspect names them)")
    return readable


def torch_streamed(engine: str, folder: Path) -> bool | None:
    """How the torch reference loads `folder` here, decided once (`decide_torch_loading_of`: no plan to take it
    from); None for every other engine, which loads as it loads."""
    return decide_torch_loading_of(folder, "float32").streamed if engine == REFERENCE_ENGINE else None


def parse_corpora(values: tuple[str, ...] | list[str]) -> EvalCorpora:
    """`--corpus` values as eval.corpus: each a data source in the recipe's form (`brown`, `hf:<id>`, a YAML
    mapping such as `{kind: jsonl, path: x.jsonl, field: text}`) or the path of a text file or folder (a
    `text` source). One value is one corpus; several are labelled as an eval.corpus list is (file stem, ...)."""
    sources = []
    for value in values or ("brown",):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, str) and parsed != "brown" and not parsed.startswith("hf:") and Path(parsed).exists():
            parsed = {"kind": "text", "path": parsed}
        sources.append(parsed)
    try:
        return TypeAdapter(EvalCorpora).validate_python(sources[0] if len(sources) == 1 else sources)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:3])
        raise RecipeError(f"--corpus {' '.join(values)!r} is not a data source ({problems})",
                          fix="brown, hf:<dataset id>, a .txt file or folder, or a mapping such as "
                          "'{kind: jsonl, path: x.jsonl, field: text}' (docs/data.md)") from None


@dataclass(frozen=True)
class _Protocol:  # what data.stages.eval_tokens reads of an eval section
    corpus: object
    windows: int
    seq_len: int


def evaluate_artifact(
    artifact: Path, baseline: str, store: Store, *, engine: str, windows: int, seq_len: int,
    max_ppl_increase_pct: float | None, threads: int | None, corpus: tuple[str, ...] = (),
    max_mean_kld: float | None = None, min_top1_agreement_pct: float | None = None,
) -> tuple[str, str | None]:
    """Table text, and a failure message when a gate fails. One row per artifact and corpus. Engines that cannot
    load the source model are compared with the torch reference's baseline, as in a build; gates read the 95%
    intervals as in a build (llmc.eval.gates). `threads`: torch's CPU threads while it runs."""
    gates = Gates(max_ppl_increase_pct=max_ppl_increase_pct, max_mean_kld=max_mean_kld,
                  min_top1_agreement_pct=min_top1_agreement_pct)
    with cpu_threads(threads):
        return _evaluate(artifact, baseline, store, engine, windows, seq_len, gates, parse_corpora(corpus))


def _evaluate(artifact: Path, baseline: str, store: Store, engine: str, windows: int, seq_len: int, gates: Gates,
              corpora: EvalCorpora) -> tuple[str, str | None]:
    src = resolve_source(baseline, store)
    tok = load_tokenizer(src.folder)
    token_sets = eval_tokens(_Protocol(corpora, windows, seq_len), tok)
    folders = artifact_folders(Path(artifact), engine)
    several = list(token_sets) != [None]
    rows, failures, suspicious = [], [], []
    for name, tokens in token_sets.items():
        ids = tokens.input_ids
        base_engine = engine_spec(engine).baseline_engine
        with open_engine(base_engine, src.folder, dtype="float32",
                         streamed=torch_streamed(base_engine, src.folder)) as base:
            reference = base.score(ids)
        base_nll = reference["nll"]
        for label, folder in folders:
            with open_engine(engine, folder, dtype="float32", streamed=torch_streamed(engine, folder)) as eng:
                scores = eng.score(ids, reference=reference)
            # the build's protocol (llmc.eval.protocol)
            m = evaluation_of(engine, scores, bootstrap_samples=BOOTSTRAP_SAMPLES, baseline_nll=base_nll)
            target = label + (f"@{name}" if several else "")
            bad = non_finite(m) + ([f"baseline perplexity {perplexity(base_nll)}"]
                                   if not torch.isfinite(base_nll.double().mean()) else [])
            verdicts = [] if bad else evaluate_gates(gates, target, m, speed="emulated")
            if bad:  # a non-finite metric always fails, gate or not
                failures.append(f"{target}: non-finite {', '.join(bad)}")
            failures += [f"{target}: {v.gate} measured {v.measured}, threshold {v.threshold}"
                         for v in verdicts if not v.passed]
            ch, kld, top1 = m.ppl_change, m.kld, m.top1_agreement
            if not bad and ch["ci_high_pct"] < 0:
                suspicious.append(f"(!) {target}: {ch['delta_pct']:+.2f}% (95% CI up to {ch['ci_high_pct']:+.2f}%): "
                                  f"{SUSPICIOUS_IMPROVEMENT}")
            lo, hi = m.ppl_ci95
            verdict = "FAIL" if bad or not all(v.passed for v in verdicts) else "pass" if verdicts else "-"
            rows.append([label, engine, *([name] if several else []), f"{perplexity(base_nll):.3f}",
                         f"{m.perplexity:.3f} [{lo:.2f}, {hi:.2f}]",
                         f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]"
                         + (" (!)" if not bad and ch["ci_high_pct"] < 0 else ""),
                         (">=" if m.kld_kind == "topk_lower_bound" else "")
                         + f"{kld['mean']:.4f} [{kld['ci_low']:.4f}, {kld['ci_high']:.4f}]" if kld else "-",
                         f"{top1['mean'] * 100:.1f}% [{top1['ci_low'] * 100:.1f}, {top1['ci_high'] * 100:.1f}]"
                         if top1 else "-", verdict])
    text = render_table(rows, ["artifact", "engine", *(["corpus"] if several else []), "ppl base", "ppl (95% CI)",
                               "delta (95% CI)", "KLD (95% CI)", "top-1 (95% CI)", "gate"])
    parts = "; ".join((f"{n}: " if several else "") + corpus_part(c) for n, c in corpora_of(corpora).items())
    text += (f"\nprotocol: {parts}, {windows} windows x {seq_len} tokens, paired bootstrap over windows; "
             "KLD = full-vocabulary KL(baseline || artifact), or where marked >= its top-256 lower bound; "
             "gates read the 95% interval's unfavourable end")
    text += "".join(f"\n{n}" for n in suspicious)
    return text, "; ".join(failures) or None

