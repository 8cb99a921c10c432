"""Reports: the summary table printed by `llmc build`, report.json and report.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmc.data.sources import corpus_part

if TYPE_CHECKING:
    from llmc.result import BuildResult


def report_dict(result: BuildResult) -> dict:
    r = result.recipe
    return {
        "build_id": result.build_id,
        "recipe": r.name,
        "scheme": ", ".join(s.name for s in result.plan.schemes.values()),
        "variants": {n or s.name: s.to_dict() for n, s in result.plan.schemes.items()},
        "passed": result.passed,
        "evals": {k: v.to_dict() for k, v in result.evals.items()},
        "targets": {label: {"artifact": str(art.dir), "exporter": art.format, "scheme": art.scheme,
                            "evals": result.target_evals.get(label, [])}
                    for label, art in result.artifacts.items()},
        "verdicts": [v.to_dict() for v in result.verdicts],
        "warnings": result.plan.warnings,
        "stages": [s.__dict__ for s in result.stages],
    }


def _fmt_tput(throughput: dict | None, key: str) -> str:
    s = (throughput or {}).get(key)
    return f"{s['median']:.1f}" if s else "-"


def summary_rows(result: BuildResult) -> list[list[str]]:
    from llmc.targets import artifact_format

    rows = []
    for engine in result.recipe.eval.runtimes:
        for label in result.artifacts:
            if f"{engine}:{label}" not in result.target_evals.get(label, []):
                continue  # this engine does not load this artifact's format
            m = result.evals[f"{engine}:{label}"]
            base_engine = m.baseline_engine or engine
            base = result.evals.get(f"{base_engine}:baseline")
            if m.skipped is not None:
                rows.append([label, engine, "-", "-", "-", "-", "-", "-", "-", "skipped: " + m.skipped[:70]])
                continue
            if m.error is not None or base is None:
                rows.append([label, engine, "-", "-", "-", "-", "-", "-", "-", "ERROR: " + str(m.error or "baseline failed")[:60]])
                continue
            ch = m.ppl_change
            verdicts = [v for v in result.verdicts if v.target == f"{engine}:{label}"]
            verdict = "pass" if all(v.passed for v in verdicts) else "FAIL"
            kld, top1 = m.kld, m.top1_agreement
            # an engine paired with another engine's baseline has no baseline speed of its own
            base_tput = base.throughput if base_engine == engine else None
            rows.append([
                label,
                engine if base_engine == engine else f"{engine} (vs {base_engine} baseline)",
                f"{base.perplexity:.3f}",
                f"{m.perplexity:.3f}",
                f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]",
                f"{kld['mean']:.4f} [{kld['ci_low']:.4f}, {kld['ci_high']:.4f}]" if kld else "-",
                f"{top1['mean'] * 100:.1f}% [{top1['ci_low'] * 100:.1f}, {top1['ci_high'] * 100:.1f}]" if top1 else "-",
                f"{_fmt_tput(base_tput, 'prefill_tokens_per_s')} -> {_fmt_tput(m.throughput, 'prefill_tokens_per_s')}",
                f"{_fmt_tput(base_tput, 'decode_tokens_per_s')} -> {_fmt_tput(m.throughput, 'decode_tokens_per_s')}",
                verdict if verdicts else "no gates",
            ])
    for label, art in result.artifacts.items():
        if not result.target_evals.get(label):
            fmt = artifact_format(art.format)
            reason = fmt.unevaluated or f"not evaluated: no engine in eval.runtimes loads {art.format}"
            rows.append([label, "-", "-", "-", "-", "-", "-", "-", "-", reason])
    return rows


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
        out.append(f"- calibration: {c['samples']} {c.get('packing', 'windows')} x {c['seq_len']} tokens, "
                   f"{c.get('dataset_label', c['dataset'])} calibration split, seed {c['seed']}"
                   + (f", tokens sha256 {c['tokens_sha256'][:16]}" if c.get("tokens_sha256") else "")
                   + "".join(f", chat template {k}: {v}" for k, v in (c.get("chat_templates") or {}).items()))
    out.append(f"- evaluation protocol: {corpus_part(ev.corpus)}, documents joined with blank lines, "
               f"tokenized once, {ev.windows} non-overlapping windows of {ev.seq_len} tokens (BOS + {ev.seq_len - 1}), "
               f"stride {ev.seq_len}, dtype {r.model.dtype}, ppl = exp(mean token NLL); "
               f"95% CIs by bootstrap over windows ({ev.bootstrap_samples} resamples), the change paired per window; "
               f"KLD = mean per-token KL(baseline || quantized) over the baseline's top-{ev.kl_top_k} tokens plus one "
               f"bucket for the rest (a lower bound of full-vocabulary KL); top-1 = argmax agreement with the baseline")
    out += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(row) + " |" for row in summary_rows(result)]
    if len(ev.throughput_batch_sizes) > 1:
        # only engines that measure several batch sizes report them (the others measure batch 1)
        out += ["", "## Throughput by batch size (median tokens/s: prefill / decode)", "",
                "| engine:model | " + " | ".join(f"batch {b}" for b in ev.throughput_batch_sizes) + " |",
                "|---|" + "---|" * len(ev.throughput_batch_sizes)]
        for eval_id, m in result.evals.items():
            by = (m.throughput or {}).get("by_batch_size") or {}
            if all(str(b) in by for b in ev.throughput_batch_sizes):
                cells = [f"{_fmt_tput(by[str(b)], 'prefill_tokens_per_s')} / "
                         f"{_fmt_tput(by[str(b)], 'decode_tokens_per_s')}" for b in ev.throughput_batch_sizes]
                out.append(f"| {eval_id} | " + " | ".join(cells) + " |")
    task_rows = [(eid, name, t) for eid, m in result.evals.items() for name, t in (m.tasks or {}).items()]
    if task_rows:  # eval.tasks: lm-evaluation-harness accuracy, 95% interval = acc ± 1.96 · harness stderr
        out += ["", "## Tasks (lm-evaluation-harness, torch engine)", "", "| engine:model | task | accuracy (95% CI) | n |",
                "|---|---|---|---|"]
        out += [f"| {eid} | {name} | {t['metric']} {t['acc']:.4f} [{t['ci_low']:.4f}, {t['ci_high']:.4f}] | {t['n']} |"
                for eid, name, t in task_rows]
    out += ["", "## Gates", "", "| target | gate | measured | threshold | verdict |", "|---|---|---|---|---|"]
    out += [f"| {v.target} | {v.gate} | {v.measured} | {v.threshold} | {'pass' if v.passed else 'FAIL'} |"
            for v in result.verdicts] or ["| - | (no gates in the recipe) | | | |"]
    if result.plan.warnings:
        out += ["", "## Warnings", ""] + [f"- {w}" for w in result.plan.warnings]
    out += ["", "## Artifacts", ""]
    for label, art in result.artifacts.items():
        out.append(f"- `{label}`: {art.format} — " + ", ".join(f"`{f}`" for f in art.files))
    out += ["", "## Stages", "", "| stage | cached | seconds |", "|---|---|---|"]
    out += [f"| {s.name} | {'yes' if s.cached else 'no'} | {s.seconds:.1f} |" for s in result.stages]
    return "\n".join(out) + "\n"
