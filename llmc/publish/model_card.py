"""The model card every published artifact carries: `artifacts/<target>/README.md` in the Hugging Face convention.

YAML metadata first (`base_model`, `base_model_relation: quantized`, `library_name`, `license` inherited from the
source, `tags`, `model-index` with the measured results), then the scheme, the calibration data, the evaluation
protocol and results with their 95% intervals, the gates, how to serve it (the target's own command) and the build's
provenance (build id, llmc version, source and file hashes). A pure function of the build result: the same build
writes the same bytes (no dates; speed only where the engine ran the format itself, emulation timings never).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from llmc import __version__
from llmc.model.card import CARD_FILE, source_metadata  # CARD_FILE: also the published card's name
from llmc.eval.report import speed_kind
from llmc.data.sources import corpora_of
from llmc.data.sources import label as data_label

if TYPE_CHECKING:
    from llmc.result import BuildResult

# Where the demo models come from on the Hub, and their licenses (the GGUF packages carry neither as metadata).
DEMO_ORIGINS = {
    "demo:smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    "demo:gemma3-270m": ("google/gemma-3-270m", "gemma"),
}
# library_name by artifact format family: what loads the files (Hub's convention).
_LIBRARIES = {"gguf": "gguf", "onnx": "onnxruntime"}


def base_model_and_license(result: "BuildResult") -> tuple[str | None, str]:
    """The card's base_model (a Hub id or the recipe's model name; None for an unnamed local folder, whose path is
    this machine's business) and license (a local source's own card's; `llmc.model.source` hashes it)."""
    origin = result.recipe.model.source
    if origin in DEMO_ORIGINS:
        return DEMO_ORIGINS[origin]
    if result.source.hub:  # its README is not fetched (llmc.model.source._card_identity)
        return result.recipe.model.name or result.source.hub["repo_id"], "unknown"
    license_ = source_metadata(result.source.folder).get("license")  # inherited from the source's own card
    return result.recipe.model.name, license_ if isinstance(license_, str) else "unknown"


def serve_command(artifact_dir: Path) -> str | None:
    """The target's own serve command from llmc-serve.json (top level, else the first runtime section's)."""
    from llmc.formats.files import SERVE_FILE  # lazy: llmc.formats.files pulls torch; model_card stays torch-free

    path = Path(artifact_dir) / SERVE_FILE
    try:
        serve = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(serve.get("command"), str):
        return serve["command"]
    return next((v["command"] for v in serve.values() if isinstance(v, dict) and isinstance(v.get("command"), str)),
                None)


def variant_metrics(result: "BuildResult", label: str) -> list[dict]:
    """One row per engine (and eval corpus, when there are several) that measured artifact `label`: the numbers
    llmc reports, with intervals."""
    rows = []
    for eval_id in result.target_evals.get(label, []):
        m = result.evals[eval_id]
        if not m.succeeded:
            continue
        base = result.evals.get(eval_id.baseline(m.baseline_engine or m.engine))
        row = {"engine": m.engine, "corpus": m.corpus, "ppl": m.perplexity, "ppl_base": base.perplexity if base else None,
               "ppl_change": m.ppl_change, "kld": m.kld, "kld_kind": m.kld_kind, "top1": m.top1_agreement}
        if speed_kind(result, eval_id) == "runtime" and m.throughput:
            row["tokens_per_s"] = {k: m.throughput[k]["median"] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")
                                   if isinstance(m.throughput.get(k), dict)}
        rows.append(row)
    return rows


def _measured_by(row: dict) -> str:
    """Which engine measured a row, and on which corpus when eval.corpus names several."""
    return row["engine"] + (f" on {row['corpus']}" if row["corpus"] is not None else "")


def _model_index(result: "BuildResult", label: str, rows: list[dict]) -> list[dict]:
    """The card's model-index: one result per eval corpus that has rows, named after that corpus."""
    results = []
    for corpus, source in corpora_of(result.recipe.eval.corpus).items():
        metrics = []
        for r in (r for r in rows if r["corpus"] == corpus):
            metrics.append({"type": "perplexity", "name": f"perplexity ({r['engine']})", "value": round(r["ppl"], 4)})
            if r["kld"]:
                metrics.append({"type": "kl_divergence", "name": f"KL divergence from the baseline ({r['engine']})",
                                "value": round(r["kld"]["mean"], 6)})
            if r["top1"]:
                metrics.append({"type": "accuracy", "name": f"top-1 agreement with the baseline ({r['engine']})",
                                "value": round(r["top1"]["mean"] * 100, 2)})
        if metrics:
            name = data_label(source)
            results.append({"task": {"type": "text-generation", "name": "Causal language modeling"},
                            "dataset": {"name": f"{name} (eval split)", "type": name}, "metrics": metrics})
    return [{"name": f"{result.recipe.name}-{label.replace('/', '-')}", "results": results}]


def _ci(d: dict | None, scale: float = 1.0, fmt: str = ".4f") -> str:
    if not d:
        return "-"
    return f"{d['mean'] * scale:{fmt}} [{d['ci_low'] * scale:{fmt}}, {d['ci_high'] * scale:{fmt}}]"


def model_card(result: "BuildResult", label: str) -> str:
    """README.md for artifact `label` of `result`."""
    art = result.artifacts[label]
    base_model, license_ = base_model_and_license(result)
    rows = variant_metrics(result, label)
    meta = {
        **({"base_model": base_model} if base_model else {}),
        "base_model_relation": "quantized",
        "library_name": _LIBRARIES.get(art.format.split("-")[0], "transformers"),
        "license": license_,
        "pipeline_tag": "text-generation",
        "tags": ["llmc", art.scheme, art.format, str(art.target.get("runtime", ""))],
        "model-index": _model_index(result, label, rows),
    }
    scheme = art.scheme_detail
    cal = result.calibration or {}
    ev = result.recipe.eval
    of = base_model or Path(result.recipe.model.source).name  # an unnamed local folder: its name, not its path
    out = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
           f"# {result.recipe.name} / {label}: {art.scheme} of {of}", "",
           f"Quantized by llmc {__version__} from `{result.recipe.model.source}` for `{art.target.get('runtime')}` "
           f"({art.format}).", "", "## Scheme", "", "```json", json.dumps(scheme, indent=1, sort_keys=True), "```", ""]
    out += ["## Calibration", ""]
    if cal:
        out.append(f"{cal.get('samples')} {cal.get('packing', 'windows')} x {cal.get('seq_len')} tokens of "
                   f"{cal.get('dataset_label', cal.get('dataset'))} (calibration split), seed {cal.get('seed')}"
                   + (f", tokens sha256 `{cal['tokens_sha256']}`" if cal.get("tokens_sha256") else "") + ".")
    else:
        out.append("None: this scheme needs no calibration data.")
    evaluated_on = ", ".join(r["dataset"]["type"] for r in meta["model-index"][0]["results"]) or "the corpus"
    out += ["", "## Evaluation", "",
            f"Perplexity on {ev.windows} windows of {ev.seq_len} tokens of the evaluation split of "
            f"{evaluated_on}, the artifact loaded from disk; 95% intervals by bootstrap over windows, the change "
            "paired per window; KL divergence from the baseline's token distribution; top-1 agreement with the "
            "baseline's argmax. The long form is the build's report.md.", "",
            "| engine | ppl base | ppl | change (95% CI) | KLD (95% CI) | top-1 % (95% CI) | tokens/s (prefill, decode) |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        ch = r["ppl_change"]
        speed = r.get("tokens_per_s")
        out.append(f"| {_measured_by(r)} | {r['ppl_base']:.3f} | {r['ppl']:.3f} | "
                   + (f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]" if ch else "-")
                   + f" | {'>=' if r['kld_kind'] == 'topk_lower_bound' else ''}{_ci(r['kld'])} | "
                   f"{_ci(r['top1'], 100, '.1f')} | "
                   + (", ".join(f"{v:.1f}" for v in speed.values()) if speed else "not measured by a serving runtime")
                   + " |")
    if not rows:
        out.append("| - | - | - | - | - | - | not evaluated here |")
    verdicts = [v for v in result.verdicts if v.target.label == label]
    out += ["", "## Gates", "", f"{result.gates_status[1]}", ""]
    out += [f"- {'pass' if v.passed else 'FAIL'}: {v.gate} on {v.target}: {v.measured} (threshold {v.threshold})"
            for v in verdicts]
    command = serve_command(art.dir)
    out += ["", "## Serve", ""] + ([f"```\n{command}\n```"] if command else ["See the target runtime's documentation."])
    out += ["", "## Provenance", "",
            f"- build id: `{result.build_id}`", f"- llmc version: {__version__}",
            f"- source: `{result.recipe.model.source}`, content key `{result.source.sha256}` (llmc's key over the "
            "source's config, weights and tokenizer files; the files' own sha256 are in the manifest)",
            f"- export stage key: `{art.key}`"]
    out += [f"- `{name}`: sha256 `{digest}`" for name, digest in sorted(art.files.items())]
    return "\n".join(out) + "\n"
