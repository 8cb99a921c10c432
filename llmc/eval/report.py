"""Reports: the summary table printed by `llmc build`, report.json and report.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmc.build import BuildResult


def _public(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("_")}


def report_dict(result: BuildResult) -> dict:
    r = result.recipe
    return {
        "build_id": result.build_id,
        "recipe": r.name,
        "scheme": ", ".join(s.name for s in result.plan.schemes.values()),
        "variants": {n or s.name: s.to_dict() for n, s in result.plan.schemes.items()},
        "passed": result.passed,
        "evals": {k: _public(v) for k, v in result.evals.items()},
        "targets": {label: {"artifact": art["dir"], "exporter": art["exporter"], "scheme": art["scheme"],
                            "evals": result.target_evals.get(label, [])}
                    for label, art in result.artifacts.items()},
        "verdicts": [v.to_dict() for v in result.verdicts],
        "warnings": result.plan.warnings,
        "stages": [s.__dict__ for s in result.stages],
    }


def _fmt_tput(m: dict, key: str) -> str:
    s = (m.get("throughput") or {}).get(key)
    return f"{s['median']:.1f}" if s else "-"


def summary_rows(result: BuildResult) -> list[list[str]]:
    rows = []
    for engine in result.recipe.eval.runtimes:
        for label in result.artifacts:
            if f"{engine}:{label}" not in result.target_evals.get(label, []):
                continue  # this engine does not load this artifact's format
            m = result.evals.get(f"{engine}:{label}", {})
            base_engine = m.get("baseline_engine", engine)
            base = result.evals.get(f"{base_engine}:baseline")
            if "skipped" in m:
                rows.append([label, engine, "-", "-", "-", "-", "-", "-", "-", "skipped: " + m["skipped"][:70]])
                continue
            if "error" in m or base is None:
                rows.append([label, engine, "-", "-", "-", "-", "-", "-", "-", "ERROR: " + str(m.get("error", "baseline failed"))[:60]])
                continue
            ch = m["ppl_change"]
            verdicts = [v for v in result.verdicts if v.target == f"{engine}:{label}"]
            verdict = "pass" if all(v.passed for v in verdicts) else "FAIL"
            kld, top1 = m.get("kld"), m.get("top1_agreement")
            # an engine paired with another engine's baseline has no baseline speed of its own
            tput_base = base if base_engine == engine else {}
            rows.append([
                label,
                engine if base_engine == engine else f"{engine} (vs {base_engine} baseline)",
                f"{base['perplexity']:.3f}",
                f"{m['perplexity']:.3f}",
                f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]",
                f"{kld['mean']:.4f} [{kld['ci_low']:.4f}, {kld['ci_high']:.4f}]" if kld else "-",
                f"{top1['mean'] * 100:.1f}% [{top1['ci_low'] * 100:.1f}, {top1['ci_high'] * 100:.1f}]" if top1 else "-",
                f"{_fmt_tput(tput_base, 'prefill_tokens_per_s')} -> {_fmt_tput(m, 'prefill_tokens_per_s')}",
                f"{_fmt_tput(tput_base, 'decode_tokens_per_s')} -> {_fmt_tput(m, 'decode_tokens_per_s')}",
                verdict if verdicts else "no gates",
            ])
    for label, art in result.artifacts.items():
        if not result.target_evals.get(label):
            rows.append([label, "-", "-", "-", "-", "-", "-", "-", "-", unevaluated_reason(art["exporter"])])
    return rows


def unevaluated_reason(exporter: str) -> str:
    """Why an artifact has no evaluation row: no engine in eval.runtimes loads its format."""
    if exporter in ("modelopt-hf", "trtllm-checkpoint"):
        return ("not evaluated here: TensorRT-LLM needs an NVIDIA GPU (layout conformance-tested against ModelOpt; "
                "on a GPU machine add tensorrt-llm to eval.runtimes)")
    if exporter == "gguf":
        return "not evaluated: add llama.cpp to eval.runtimes (bash scripts/setup-llama.sh)"
    if exporter == "onnx":
        return "not evaluated: add onnxruntime to eval.runtimes"
    if exporter == "onnx-qdq":
        return "not evaluated: add onnxruntime to eval.runtimes (or tensorrt, on a GPU machine with TensorRT)"
    if exporter in ("awq", "gptq"):
        return "not evaluated here: LMDeploy / ExLlamaV2 need an NVIDIA GPU (layout conformance-tested)"
    return f"not evaluated: no engine in eval.runtimes loads {exporter}"


HEADER = ["target", "engine", "ppl base", "ppl quant", "delta (95% CI)", "KLD (95% CI)", "top-1 (95% CI)",
          "prefill tok/s", "decode tok/s", "gates"]


def render_table(rows: list[list[str]], header: list[str] = HEADER) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def render_markdown(result: BuildResult) -> str:
    r = result.recipe
    ev = r.eval
    schemes = result.plan.schemes
    out = [f"# {r.name}: {', '.join(s.name for s in schemes.values())}", ""]
    out.append(f"- build id: `{result.build_id}`")
    out.append(f"- model: `{r.model.source}` ({r.model.dtype}), source sha256 `{result.source.sha256}`")
    for name, s in schemes.items():
        out.append(f"- {'variant ' + name + ': ' if name else ''}scheme {s.name}, algorithm {s.algorithm}; "
                   f"weights {s.weights.describe()}"
                   + (f", activations {s.activations.describe()}" if s.activations else "")
                   + (f", KV cache {s.kv_cache.format}" if s.kv_cache else "")
                   + f"; ignored: {', '.join(s.ignore) or 'none'}")
    if result.calibration:
        c = result.calibration
        out.append(f"- calibration: {c['samples']} windows x {c['seq_len']} tokens, {c['dataset']} calibration split, seed {c['seed']}")
    out.append(f"- evaluation protocol: {ev.corpus} eval split (every 10th file), documents joined with blank lines, "
               f"tokenized once, {ev.windows} non-overlapping windows of {ev.seq_len} tokens (BOS + {ev.seq_len - 1}), "
               f"stride {ev.seq_len}, dtype {r.model.dtype}, ppl = exp(mean token NLL); "
               f"95% CIs by bootstrap over windows ({ev.bootstrap_samples} resamples), the change paired per window; "
               f"KLD = mean per-token KL(baseline || quantized) over the baseline's top-{ev.kl_top_k} tokens plus one "
               f"bucket for the rest (a lower bound of full-vocabulary KL); top-1 = argmax agreement with the baseline")
    out += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(row) + " |" for row in summary_rows(result)]
    if len(ev.throughput_batch_sizes) > 1:
        out += ["", "## Throughput by batch size (torch engine, median tokens/s: prefill / decode)", "",
                "| model | " + " | ".join(f"batch {b}" for b in ev.throughput_batch_sizes) + " |",
                "|---|" + "---|" * len(ev.throughput_batch_sizes)]
        for eval_id, m in result.evals.items():
            by = (m.get("throughput") or {}).get("by_batch_size")
            if eval_id.startswith("torch:") and by:
                cells = [f"{_fmt_tput({'throughput': by[str(b)]}, 'prefill_tokens_per_s')} / "
                         f"{_fmt_tput({'throughput': by[str(b)]}, 'decode_tokens_per_s')}" for b in ev.throughput_batch_sizes]
                out.append(f"| {eval_id.removeprefix('torch:')} | " + " | ".join(cells) + " |")
    out += ["", "## Gates", "", "| target | gate | measured | threshold | verdict |", "|---|---|---|---|---|"]
    out += [f"| {v.target} | {v.gate} | {v.measured} | {v.threshold} | {'pass' if v.passed else 'FAIL'} |"
            for v in result.verdicts] or ["| - | (no gates in the recipe) | | | |"]
    if result.plan.warnings:
        out += ["", "## Warnings", ""] + [f"- {w}" for w in result.plan.warnings]
    out += ["", "## Artifacts", ""]
    for label, art in result.artifacts.items():
        out.append(f"- `{label}`: {art['exporter']} — " + ", ".join(f"`{f}`" for f in art["files"]))
    out += ["", "## Stages", "", "| stage | cached | seconds |", "|---|---|---|"]
    out += [f"| {s.name} | {'yes' if s.cached else 'no'} | {s.seconds:.1f} |" for s in result.stages]
    return "\n".join(out) + "\n"
