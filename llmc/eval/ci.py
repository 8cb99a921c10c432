"""What CI systems read: JUnit XML (one test case per gate) and an HTML page with a quality-vs-speed plot."""

from __future__ import annotations

import base64
import html
import io
import math
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from llmc.eval.gates import effective_gates
from llmc.eval.report import footnotes, header, speed_kind, summary_rows
from llmc.result import parse_eval_id

if TYPE_CHECKING:
    from llmc.result import BuildResult


def junit_xml(recipe_name: str, verdicts: list, error: tuple[str, str] | None = None) -> str:
    """A <testsuite> with a <testcase> per gate verdict; `error` = (kind, message) of a crashed build."""
    cases = []
    for v in verdicts:
        case = ET.Element("testcase", classname=f"llmc.{recipe_name}.{v.target}", name=v.gate)
        if not v.passed:
            f = ET.SubElement(case, "failure", type=f"{v.kind} gate",
                              message=f"{v.gate}: measured {v.measured}, threshold {v.threshold}")
            f.text = f"target {v.target}\nmeasured: {v.measured}\nthreshold: {v.threshold}"
        elif not getattr(v, "evaluated", True):  # passed only under allow_unevaluated: CI shows it as skipped
            ET.SubElement(case, "skipped", message=f"{v.gate}: {v.measured}")
        cases.append(case)
    if error is not None:
        case = ET.Element("testcase", classname=f"llmc.{recipe_name}", name="build")
        e = ET.SubElement(case, "error", type=error[0], message=error[1].splitlines()[0][:500])
        e.text = error[1]
        cases.append(case)
    failures = sum(1 for c in cases if c.find("failure") is not None)
    errors = sum(1 for c in cases if c.find("error") is not None)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    suite = ET.Element("testsuite", name=f"llmc.{recipe_name}", tests=str(len(cases)),
                       failures=str(failures), errors=str(errors), skipped=str(skipped))
    suite.extend(cases)
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def quality_speed_png(result: "BuildResult") -> bytes | None:
    """Perplexity change (with its 95% CI) against decode tokens/s, one point per artifact x engine whose tokens/s
    is a runtime's own speed. Evaluations whose tokens/s is llmc's emulation are never put on the speed axis: when
    no runtime measured speed, the plot shows quality alone, one point per artifact x engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed_points, quality_points = plot_points(result)
    if not speed_points and not quality_points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    if speed_points:
        for name, x, ch in speed_points:
            ax.errorbar([x], [ch["delta_pct"]], yerr=_yerr(ch), fmt="o", capsize=4, label=name)
        ax.set_xlabel("decode tokens/s (median; the runtime's own speed on this machine)")
        title = f"{result.recipe.name}: quality vs speed"
        if quality_points:
            title += f" ({len(quality_points)} without a runtime speed: not plotted)"
    else:
        for i, (name, ch) in enumerate(quality_points):
            ax.errorbar([i], [ch["delta_pct"]], yerr=_yerr(ch), fmt="o", capsize=4, label=name)
        ax.set_xticks(range(len(quality_points)), [n for n, _ in quality_points], rotation=20, ha="right", fontsize=7)
        ax.set_xlabel("artifact (engine)")
        title = f"{result.recipe.name}: quality (no runtime speed measured; emulation timings are not speed)"
    limits = {effective_gates(result.recipe.gates, s).max_ppl_increase_pct for s in result.plan.schemes.values()}
    for limit in sorted(x for x in limits if x is not None):
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"gate: +{limit}%")
    ax.axhline(0, color="gray", linewidth=0.5)
    ax.set_ylabel("perplexity change vs baseline, % (95% CI)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def plot_points(result: "BuildResult") -> tuple[list[tuple[str, float, dict]], list[tuple[str, dict]]]:
    """(points on the speed axis: name, runtime decode tok/s, perplexity change; points without a runtime speed:
    name, perplexity change). Emulation timings never become a speed point; non-finite numbers are not plotted."""
    speed_points, quality_points = [], []
    for label in result.artifacts:
        for eval_id in result.target_evals.get(label, []):
            engine, _, corpus = parse_eval_id(eval_id)
            m = result.evals.get(eval_id)
            ch = m.ppl_change if m else None
            if not ch or not all(math.isfinite(ch[k]) for k in ("delta_pct", "ci_low_pct", "ci_high_pct")):
                continue
            tput = (m.throughput or {}).get("decode_tokens_per_s")
            name = f"{label} ({engine})" if corpus is None else f"{label} ({engine}, {corpus})"
            if tput and speed_kind(result, eval_id) == "runtime" and math.isfinite(tput["median"]):
                speed_points.append((name, tput["median"], ch))
            else:
                quality_points.append((name, ch))
    return speed_points, quality_points


def _yerr(ch: dict) -> list[list[float]]:
    return [[max(ch["delta_pct"] - ch["ci_low_pct"], 0.0)], [max(ch["ci_high_pct"] - ch["delta_pct"], 0.0)]]


def report_html(result: "BuildResult", markdown: str, png: bytes | None) -> str:
    rows = summary_rows(result)
    table = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header(result)) + "</tr>"
    for r in rows:
        cls = ' class="fail"' if "FAIL" in str(r[-1]) or str(r[-1]).startswith("ERROR") else ""
        table += f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
    table += "</table>" + "".join(f"<p><small>{html.escape(n)}</small></p>" for n in footnotes(result))
    img = (f'<img alt="quality vs speed" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
           if png else "<p>(nothing measured: no plot)</p>")
    status, summary = result.gates_status
    heading = {"passed": "all gates passed", "none": "no gates"}.get(status, "GATES FAILED" if status == "failed"
                                                                     else "gates passed, some not measured")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>llmc report: {html.escape(result.recipe.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}tr.fail td{{background:#fdd}}pre{{background:#f6f6f6;padding:1em;white-space:pre-wrap}}</style>
</head><body><h1>{html.escape(result.recipe.name)} — {heading}</h1><p>{html.escape(summary)}</p>
{table}<h2>Quality vs speed</h2>{img}<h2>Full report</h2><pre>{html.escape(markdown)}</pre></body></html>
"""
