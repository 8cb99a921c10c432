"""`llmc eval`: evaluate an existing artifact (folder or registry entry) against a baseline."""

from __future__ import annotations

from pathlib import Path

import torch

from llmc.calibration.corpora import load_corpus
from llmc.calibration.windows import make_windows
from llmc.engines import engine_spec, open_engine
from llmc.errors import InputError
from llmc.eval.metrics import mean_interval, paired_ppl_change, perplexity, perplexity_interval
from llmc.eval.report import render_table
from llmc.model.source import resolve_source
from llmc.store import Store


def _artifact_folder(path: Path) -> list[tuple[str, Path]]:
    if (path / "manifest.json").is_file():
        return [(p.name, p) for p in sorted((path / "artifacts").iterdir()) if (p / "config.json").is_file()]
    if (path / "config.json").is_file():
        return [(path.name, path)]
    raise InputError(f"{path} is neither an artifact folder nor a registry entry")


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
    rows, failures = [], []
    for label, folder in _artifact_folder(Path(artifact)):
        with open_engine(engine, folder, dtype="float32") as eng:
            scores = eng.score(ids, reference=reference)
        nll = scores["nll"]
        ch = paired_ppl_change(base_nll, nll)
        kld = mean_interval(scores["kl"]) if "kl" in scores else None
        top1 = mean_interval(scores["top1"]) if "top1" in scores else None
        lo, hi = perplexity_interval(nll)
        verdict = "-"
        if max_ppl_increase_pct is not None:
            ok = ch["ci_high_pct"] <= max_ppl_increase_pct
            verdict = "pass" if ok else "FAIL"
            if not ok:
                failures.append(f"{label}: perplexity change {ch['delta_pct']:+.2f}% (95% CI up to "
                                f"{ch['ci_high_pct']:+.2f}%) exceeds {max_ppl_increase_pct}%")
        rows.append([label, engine, f"{perplexity(base_nll):.3f}", f"{perplexity(nll):.3f} [{lo:.2f}, {hi:.2f}]",
                     f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]",
                     f"{kld['mean']:.4f} [{kld['ci_low']:.4f}, {kld['ci_high']:.4f}]" if kld else "-",
                     f"{top1['mean'] * 100:.1f}%" if top1 else "-", verdict])
    text = render_table(rows, ["artifact", "engine", "ppl base", "ppl (95% CI)", "delta (95% CI)", "KLD (95% CI)",
                               "top-1", "gate"])
    text += f"\nprotocol: brown eval split, {windows} windows x {seq_len} tokens, paired bootstrap over windows"
    return text, "; ".join(failures) or None
