"""`llmc eval`: evaluate an existing artifact (folder or registry entry) against a baseline."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from llmc.calibration.corpora import load_corpus
from llmc.calibration.windows import make_windows
from llmc.engines import engine_spec, open_engine
from llmc.engines.agreement import TOPK_BOUND, kld_kind
from llmc.errors import InputError
from llmc.eval.gates import SUSPICIOUS_IMPROVEMENT
from llmc.eval.metrics import mean_interval, paired_ppl_change, perplexity, perplexity_interval
from llmc.eval.report import render_table
from llmc.model.source import resolve_source
from llmc.store import Store


def artifact_folders(path: Path, engine: str) -> list[tuple[str, Path]]:
    """(label, folder) of each artifact at `path` — an artifact folder, or a registry entry's artifacts — that
    `engine` loads, by the format the target registry recognises (an unquantized Hugging Face folder counts
    for the engines that load source models)."""
    from llmc.targets import recognize

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


def evaluate_artifact(
    artifact: Path, baseline: str, store: Store, *, engine: str, windows: int, seq_len: int,
    max_ppl_increase_pct: float | None, threads: int | None,
) -> tuple[str, str | None]:
    """Table text, and a failure message when the gate fails. Engines that cannot load the source model
    are compared with the torch reference's baseline, as in a build."""
    from transformers import AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    src = resolve_source(baseline, store)
    tok = AutoTokenizer.from_pretrained(src.folder)
    ids = make_windows(tok, load_corpus("brown", "eval"), seq_len, windows, seed=None).ids
    with open_engine(engine_spec(engine).baseline_engine, src.folder, dtype="float32") as base:
        reference = base.score(ids)
    base_nll = reference["nll"]
    rows, failures, suspicious = [], [], []
    for label, folder in artifact_folders(Path(artifact), engine):
        with open_engine(engine, folder, dtype="float32") as eng:
            scores = eng.score(ids, reference=reference)
        nll = scores["nll"]
        ch = paired_ppl_change(base_nll, nll)
        kld = mean_interval(scores["kl"]) if "kl" in scores else None
        top1 = mean_interval(scores["top1"]) if "top1" in scores else None
        lo, hi = perplexity_interval(nll)
        verdict = "-"
        bad = [name for name, x in (("perplexity", perplexity(nll)), ("baseline perplexity", perplexity(base_nll)),
                                    ("perplexity change", ch["ci_high_pct"]), ("KLD", (kld or {}).get("mean", 0.0)),
                                    ("top-1", (top1 or {}).get("mean", 0.0))) if not math.isfinite(x)]
        if bad:  # a non-finite metric always fails, gate or not
            verdict = "FAIL"
            failures.append(f"{label}: non-finite {', '.join(bad)}")
        elif ch["ci_high_pct"] < 0:
            suspicious.append(f"(!) {label}: {ch['delta_pct']:+.2f}% (95% CI up to {ch['ci_high_pct']:+.2f}%): "
                              f"{SUSPICIOUS_IMPROVEMENT}")
        if max_ppl_increase_pct is not None and not bad:
            ok = ch["ci_high_pct"] <= max_ppl_increase_pct
            verdict = "pass" if ok else "FAIL"
            if not ok:
                failures.append(f"{label}: perplexity change {ch['delta_pct']:+.2f}% (95% CI up to "
                                f"{ch['ci_high_pct']:+.2f}%) exceeds {max_ppl_increase_pct}%")
        rows.append([label, engine, f"{perplexity(base_nll):.3f}", f"{perplexity(nll):.3f} [{lo:.2f}, {hi:.2f}]",
                     f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]"
                     + (" (!)" if not bad and ch["ci_high_pct"] < 0 else ""),
                     (">=" if kld_kind(scores) == TOPK_BOUND else "")
                     + f"{kld['mean']:.4f} [{kld['ci_low']:.4f}, {kld['ci_high']:.4f}]" if kld else "-",
                     f"{top1['mean'] * 100:.1f}%" if top1 else "-", verdict])
    text = render_table(rows, ["artifact", "engine", "ppl base", "ppl (95% CI)", "delta (95% CI)", "KLD (95% CI)",
                               "top-1", "gate"])
    text += (f"\nprotocol: brown eval split, {windows} windows x {seq_len} tokens, paired bootstrap over windows; "
             "KLD = full-vocabulary KL(baseline || artifact), or where marked >= its top-256 lower bound")
    text += "".join(f"\n{n}" for n in suspicious)
    return text, "; ".join(failures) or None
