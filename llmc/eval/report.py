"""Reports: the summary table printed by `llmc build`, report.json and report.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmc.data.sources import corpora_of, corpus_part
from llmc.result import EvalId
from llmc.engines import engine_spec

if TYPE_CHECKING:
    from llmc.engines.registry import SpeedKind
    from llmc.result import BuildResult


def report_dict(result: BuildResult) -> dict:
    r = result.recipe
    status, summary = result.gates_status
    return {
        "build_id": result.build_id,
        "recipe": r.name,
        "scheme": ", ".join(s.name for s in result.plan.schemes.values()),
        "variants": {n or s.name: s.to_dict() for n, s in result.plan.schemes.items()},
        "passed": result.passed,
        "gates_status": status,  # "passed" only when every gate was measured; see llmc.result.gates_summary
        "gates_summary": summary,
        "evals": {str(k): {**v.to_dict(), "speed": speed_label(result, k)} for k, v in result.evals.items()},
        "targets": {label: {"artifact": str(art.dir), "exporter": art.format, "scheme": art.scheme,
                            "evals": [str(i) for i in result.target_evals.get(label, [])]}
                    for label, art in result.artifacts.items()},
        "verdicts": [v.to_dict() for v in result.verdicts],
        "warnings": result.plan.warnings,
        "bos": result.bos,  # the protocol's BOS: used or not, and why
        **({"search": result.search} if result.search else {}),  # quantization.search's chosen mixes
        "suspicious_improvements": suspicious_improvements(result),
        "stages": [s.__dict__ for s in result.stages],
    }


# --------------------------------------------------------------------------- what a tokens/s figure is


_SPEED_WORDS = {
    "runtime": "the runtime's own speed on this machine",
    "reference": "plain framework speed of the unquantized model (not a serving runtime)",
    "emulated": "llmc's emulation of the quantized arithmetic: not the artifact's speed",
}


def speed_kind(result: BuildResult, eval_id: EvalId) -> SpeedKind:
    """What the tokens/s of evaluation `eval_id` is: the engine registry says whether the engine runs the format
    or emulates it (EngineSpec.speed_kind)."""
    from llmc.quant.canonical import scheme_from_dict  # lazy: torch; reading a report stays torch-free

    art = result.artifacts.get(eval_id.label)
    return engine_spec(eval_id.engine).speed_kind(scheme_from_dict(art.scheme_detail) if art else None)


def speed_label(result: BuildResult, eval_id: EvalId) -> dict:
    """report.json's account of a throughput figure: which engine measured it and what it is."""
    kind = speed_kind(result, eval_id)
    spec = engine_spec(eval_id.engine)
    out = {"engine": spec.name, "kind": kind, "meaning": _SPEED_WORDS[kind]}
    if kind == "emulated" and spec.emulation_note:
        out["note"] = spec.emulation_note
    return out


def _fmt_tput(throughput: dict | None, key: str) -> str:
    s = (throughput or {}).get(key)
    return f"{s['median']:.1f}" if s else "-"


def _speed_cell(result: BuildResult, eval_id: EvalId, base_id: EvalId | None, key: str) -> str:
    """'base -> artifact' tokens/s where both are the runtime's own; emulation timings are not shown as speed."""
    m = result.evals[eval_id]
    if speed_kind(result, eval_id) != "runtime":
        return "emulated (not speed)"
    base = result.evals.get(base_id) if base_id else None
    base_txt = _fmt_tput(base.throughput, key) if base is not None and speed_kind(result, base_id) == "runtime" else "-"
    return f"{base_txt} -> {_fmt_tput(m.throughput, key)}"


# --------------------------------------------------------------------------- suspicious improvements


def suspicious_improvements(result: BuildResult) -> list[dict]:
    """Artifacts whose perplexity is significantly *better* than the baseline's (paired interval below zero)."""
    # lazy: llmc.eval.gates pulls torch (recipe.schema -> quant.algorithms); reports stay torch-free
    from llmc.eval.gates import SUSPICIOUS_IMPROVEMENT

    out = []
    for label, ids in result.target_evals.items():
        for eval_id in ids:
            ch = result.evals[eval_id].ppl_change
            if ch and ch["ci_high_pct"] < 0:
                out.append({"eval": str(eval_id), "target": label, "delta_pct": ch["delta_pct"],
                            "ci_low_pct": ch["ci_low_pct"], "ci_high_pct": ch["ci_high_pct"],
                            "message": f"{eval_id}: {ch['delta_pct']:+.2f}% (95% CI {ch['ci_low_pct']:+.2f}% .. "
                                       f"{ch['ci_high_pct']:+.2f}%): {SUSPICIOUS_IMPROVEMENT}"})
    return out


# --------------------------------------------------------------------------- the summary table


def corpus_labels(result: BuildResult) -> list[str | None]:
    """The evaluation corpora's labels in recipe order; [None] when the recipe has one corpus."""
    return list(corpora_of(result.recipe.eval.corpus))


def header(result: BuildResult) -> list[str]:
    """The summary table's columns: a corpus column when eval.corpus names several."""
    return HEADER if corpus_labels(result) == [None] else [*HEADER[:2], "corpus", *HEADER[2:]]


def summary_rows(result: BuildResult) -> list[list[str]]:
    """One row per (artifact, engine) — per (artifact, engine, corpus) when eval.corpus names several corpora."""
    rows = []
    for corpus in corpus_labels(result):
        rows += [row if corpus is None else [*row[:2], corpus, *row[2:]] for row in _corpus_rows(result, corpus)]
    several = corpus_labels(result) != [None]
    for row in _unevaluated_rows(result):
        rows.append(row if not several else [*row[:2], "-", *row[2:]])
    return rows


def _corpus_rows(result: BuildResult, corpus: str | None) -> list[list[str]]:
    suspicious = {s["eval"] for s in suspicious_improvements(result)}
    rows = []
    for engine in result.recipe.eval.runtimes:
        for label in result.artifacts:
            eval_id = EvalId(engine, label, corpus)
            if eval_id not in result.target_evals.get(label, []):
                continue  # this engine does not load this artifact's format
            m = result.evals[eval_id]
            base_engine = m.baseline_engine or engine
            base = result.evals.get(eval_id.baseline(base_engine))
            if m.skipped is not None:
                rows.append([label, engine, "-", "-", "-", "-", "-", "-", "-", "skipped: " + m.skipped[:70]])
                continue
            if m.error is not None or base is None:
                rows.append([label, engine, "-", "-", "-", "-", "-", "-", "-", "ERROR: " + str(m.error or "baseline failed")[:60]])
                continue
            ch = m.ppl_change
            verdicts = [v for v in result.verdicts if v.target == eval_id]
            verdict = "pass" if all(v.passed for v in verdicts) else "FAIL"
            kld, top1 = m.kld, m.top1_agreement
            # an engine paired with another engine's baseline has no baseline speed of its own
            base_id = eval_id.baseline() if base_engine == engine else None
            rows.append([
                label,
                engine if base_engine == engine else f"{engine} (vs {base_engine} baseline)",
                f"{base.perplexity:.3f}",
                f"{m.perplexity:.3f}",
                f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]"
                + (" (!)" if str(eval_id) in suspicious else ""),
                (">=" if m.kld_kind == "topk_lower_bound" else "")
                + f"{kld['mean']:.4f} [{kld['ci_low']:.4f}, {kld['ci_high']:.4f}]" if kld else "-",
                f"{top1['mean'] * 100:.1f}% [{top1['ci_low'] * 100:.1f}, {top1['ci_high'] * 100:.1f}]" if top1 else "-",
                _speed_cell(result, eval_id, base_id, "prefill_tokens_per_s"),
                _speed_cell(result, eval_id, base_id, "decode_tokens_per_s"),
                verdict if verdicts else "no gates",
            ])
    return rows


def _unevaluated_rows(result: BuildResult) -> list[list[str]]:
    """Artifacts no engine loaded, and gates no engine measured (their verdicts name the artifact, with its
    corpus when there are several)."""
    rows = []
    for label, art in result.artifacts.items():
        unmeasured = [v for v in result.verdicts if v.target.engine is None and v.target.label == label]
        if not result.target_evals.get(label):
            # lazy: the catalog imports every format module (torch); a report without such a row stays torch-free
            from llmc.runtimes.catalog import artifact_format

            fmt = artifact_format(art.format)
            reason = fmt.unevaluated or f"not evaluated: no engine in eval.runtimes loads {art.format}"
            rows.append([label, "-", "-", "-", "-", "-", "-", "-", "-", _with_unmeasured(reason, unmeasured)])
        elif unmeasured:
            rows.append([label, "(any)", "-", "-", "-", "-", "-", "-", "-", _with_unmeasured("", unmeasured)])
    return rows


def _with_unmeasured(reason: str, unmeasured: list) -> str:
    if not unmeasured:
        return reason
    gates = ", ".join(v.gate for v in unmeasured)
    state = "pass unmeasured (allow_unevaluated)" if all(v.passed for v in unmeasured) else "FAIL"
    return (f"{reason}; " if reason else "") + f"{state}: {gates} not measured on any engine"


def footnotes(result: BuildResult) -> list[str]:
    """What the summary table's marks mean, and the gates' overall state."""
    notes = []
    emulating = sorted({eid.engine for ids in result.target_evals.values() for eid in ids
                        if result.evals[eid].succeeded and speed_kind(result, eid) == "emulated"})
    if emulating:
        notes.append("tok/s: measured by the row's engine; 'emulated (not speed)': "
                     + "; ".join(f"{engine_spec(e).display}: {engine_spec(e).emulation_note}" for e in emulating)
                     + " (report.md lists those timings as emulation timings)")
    for s in suspicious_improvements(result):
        notes.append(f"(!) suspicious improvement: {s['message']}")
    _, summary = result.gates_status
    notes.append(f"gates: {summary}")
    return notes


def render_summary(result: BuildResult) -> str:
    """The table `llmc build` prints, with its footnotes."""
    return render_table(summary_rows(result), header(result)) + "\n\n" + "\n".join(footnotes(result))


HEADER = ["target", "engine", "ppl base", "ppl quant", "delta (95% CI)", "KLD (95% CI)", "top-1 (95% CI)",
          "prefill tok/s", "decode tok/s", "gates"]


def render_table(rows: list[list[str]], header: list[str] = HEADER) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _bos_words(bos: dict | None, seq_len: int) -> str:
    if bos is None:
        return f"BOS + {seq_len - 1}"
    return (f"BOS id {bos['token_id']} + {seq_len - 1}" if bos["used"] else "no BOS") + f": {bos['reason']}"


def _damage_meaning(proxy: str) -> str:
    """What a searched mix's predicted damage is, by the search's proxy (llmc.quant.search.layer_damages)."""
    return {"fisher": "the sum of each unit's estimated end-to-end KL divergence per token, 1/2 sum g^2 dy^2 with g "
                      "the loss gradient at its layer's output",
            "update": "the sum of each unit's layer-output squared error relative to the layer's update",
            "token": "the sum of each unit's per-token layer-output relative error"}.get(
        proxy, "the sum of each unit's layer-output relative error")


def _search_section(variant: str, chosen: dict) -> list[str]:
    """quantization.search's chosen mix: each group's bytes and predicted damage, and the Pareto front."""
    out = ["", f"## Mixed precision search{' (' + variant + ')' if variant else ''}", "",
           f"Budget {chosen['budget_bytes'] / 1e6:,.2f} MB ({chosen['budget_effective_bits']:.2f} effective bits) for "
           f"the decoder layers' Linears; chosen mix {chosen['bytes'] / 1e6:,.2f} MB "
           f"({chosen['effective_bits']:.2f} effective bits), predicted damage {chosen['predicted_damage']:.4g} "
           f"({_damage_meaning(chosen.get('proxy', 'output'))}, measured on the calibration windows), "
           f"by {chosen['granularity']}; {len(chosen['protected'])} Linears protected.", "",
           "| group | scheme | units | Linears | MB | predicted damage |", "|---|---|---|---|---|---|"]
    out += [f"| {g['group']} | {g['scheme']} | {g['units']} | {g['linears']} | {g['bytes'] / 1e6:,.2f} | "
            f"{g['damage']:.4g} |" for g in chosen["groups"]]
    out += [f"- candidate {r['candidate']} removed: {r['why']}" for r in chosen["removed"]]
    out += ["", "Pareto front (MB -> least predicted damage): "
            + ", ".join(f"{p['bytes'] / 1e6:,.2f} -> {p['damage']:.4g}" for p in chosen["front"])]
    return out


def render_markdown(result: BuildResult) -> str:
    r = result.recipe
    ev = r.eval
    schemes = result.plan.schemes
    out = [f"# {r.name}: {', '.join(s.name for s in schemes.values())}", ""]
    out.append(f"- build id: `{result.build_id}`")
    out.append(f"- model: `{r.model.source}` ({result.dtype}), source content key `{result.source.sha256}` (llmc's key over its config, weights and tokenizer files)"
               + (f", Hub commit `{result.source.hub['commit']}`" if result.source.hub else ""))
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
    corpora = corpora_of(ev.corpus)
    part = (corpus_part(ev.corpus) if list(corpora) == [None] else
            f"{len(corpora)} corpora, each scored and gated on its own (" +
            "; ".join(f"{name}: {corpus_part(source)}" for name, source in corpora.items()) + ")")
    out.append(f"- evaluation protocol: {part}, documents joined with blank lines, "
               f"tokenized once, {ev.windows} non-overlapping windows of {ev.seq_len} tokens "
               f"({_bos_words(result.bos, ev.seq_len)}), "
               f"stride {ev.seq_len}, dtype {result.dtype}, ppl = exp(mean token NLL); "
               f"95% CIs by bootstrap over windows ({ev.bootstrap_samples} resamples), the change paired per window; "
               f"KLD = mean per-token KL(baseline || quantized) over the full vocabulary (the baseline's output head "
               f"re-applied to its recorded inputs); a KLD marked >= is the top-{ev.kl_top_k} lower bound (the "
               f"baseline's top-{ev.kl_top_k} tokens plus one bucket for the rest), where the baseline's head could not "
               f"be re-applied; top-1 = argmax agreement with the baseline")
    out.append(f"- gates: {result.gates_status[1]}")
    for eval_id, m in result.evals.items():  # a baseline whose head was not re-applied: why its KLDs are bounds
        if m.output_head and not m.output_head.get("reproduced"):
            out.append(f"- {eval_id}: KLD against it is the top-{ev.kl_top_k} lower bound: {m.output_head['reason']}")
    out += ["", "| " + " | ".join(header(result)) + " |", "|" + "---|" * len(header(result))]
    out += ["| " + " | ".join(row) + " |" for row in summary_rows(result)]
    out += [""] + [f"{n}  " for n in footnotes(result)]
    speeds = {eval_id: speed_kind(result, eval_id) for eval_id, m in result.evals.items() if m.throughput}
    if len(ev.throughput_batch_sizes) > 1:
        # only engines that measure several batch sizes report them (the others measure batch 1); emulation
        # timings are not speed and are listed apart, below
        out += ["", "## Throughput by batch size (median tokens/s: prefill / decode)", "",
                "| engine:model | what it is | " + " | ".join(f"batch {b}" for b in ev.throughput_batch_sizes) + " |",
                "|---|---|" + "---|" * len(ev.throughput_batch_sizes)]
        for eval_id, m in result.evals.items():
            by = (m.throughput or {}).get("by_batch_size") or {}
            if speeds.get(eval_id) != "emulated" and all(str(b) in by for b in ev.throughput_batch_sizes):
                cells = [f"{_fmt_tput(by[str(b)], 'prefill_tokens_per_s')} / "
                         f"{_fmt_tput(by[str(b)], 'decode_tokens_per_s')}" for b in ev.throughput_batch_sizes]
                out.append(f"| {eval_id} | {_SPEED_WORDS[speeds[eval_id]]} | " + " | ".join(cells) + " |")
    emulated = [eval_id for eval_id, kind in speeds.items() if kind == "emulated"]
    if emulated:
        out += ["", "## Emulation timings (not speed)", "",
                "The engine computed the quantized arithmetic in float; these times say how long llmc's emulation "
                "took on this machine, not how fast the artifact runs in a serving runtime. Performance gates never "
                "read them.", "", "| engine:model | prefill tok/s (emulation) | decode tok/s (emulation) | why |",
                "|---|---|---|---|"]
        for eval_id in emulated:
            m = result.evals[eval_id]
            note = engine_spec(eval_id.engine).emulation_note
            out.append(f"| {eval_id} | {_fmt_tput(m.throughput, 'prefill_tokens_per_s')} | "
                       f"{_fmt_tput(m.throughput, 'decode_tokens_per_s')} | {note} |")
    for variant, chosen in result.search.items():
        out += _search_section(variant, chosen)
    task_rows = [(eid, name, t) for eid, m in result.evals.items() for name, t in (m.tasks or {}).items()]
    if task_rows:  # eval.tasks: lm-evaluation-harness accuracy, 95% interval = acc ± 1.96 · harness stderr
        out += ["", "## Tasks (lm-evaluation-harness, torch engine)", "", "| engine:model | task | accuracy (95% CI) | n |",
                "|---|---|---|---|"]
        out += [f"| {eid} | {name} | {t['metric']} {t['acc']:.4f} [{t['ci_low']:.4f}, {t['ci_high']:.4f}] | {t['n']} |"
                for eid, name, t in task_rows]
    out += ["", "## Gates", "", f"{result.gates_status[1]}.", "",
            "| target | gate | measured | threshold | verdict |", "|---|---|---|---|---|"]
    out += [f"| {v.target} | {v.gate} | {v.measured} | {v.threshold} | "
            f"{('pass' if v.evaluated else 'pass (not measured)') if v.passed else 'FAIL'} |"
            for v in result.verdicts] or ["| - | (no gates in the recipe) | | | |"]
    suspicious = suspicious_improvements(result)
    if suspicious:
        out += ["", "## Suspicious improvements", ""] + [f"- {s['message']}" for s in suspicious]
    if result.plan.warnings:
        out += ["", "## Warnings", ""] + [f"- {w}" for w in result.plan.warnings]
    out += ["", "## Artifacts", ""]
    for label, art in result.artifacts.items():
        out.append(f"- `{label}`: {art.format} — " + ", ".join(f"`{f}`" for f in art.files))
    out += ["", "## Stages", "", "| stage | cached | seconds |", "|---|---|---|"]
    out += [f"| {s.name} | {'yes' if s.cached else 'no'} | {s.seconds:.1f} |" for s in result.stages]
    return "\n".join(out) + "\n"
