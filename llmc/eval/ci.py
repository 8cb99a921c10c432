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

if TYPE_CHECKING:
    from llmc.result import BuildResult, Evaluation


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


# the panels of the quality plot: (title, the Evaluation field, the factor to the number shown)
_PANELS = (
    ("perplexity change vs baseline, % (95% CI)", "ppl_change", 1.0),
    ("mean KL divergence from the baseline (95% CI)", "kld", 1.0),
    ("top-1 agreement with the baseline, % (95% CI)", "top1_agreement", 100.0),
)


def quality_speed_png(result: "BuildResult") -> bytes | None:
    """Perplexity change, mean KLD and top-1 agreement (each with its 95% CI), one panel each, against decode
    tokens/s where a runtime measured its own speed, else one point per artifact x engine. Evaluations whose
    tokens/s is llmc's emulation are never put on the speed axis (with speed points, they are counted in the
    title, not plotted)."""
    import matplotlib  # lazy: matplotlib (~0.6 s), only when a report's plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib (~0.6 s), only when a report's plot is drawn

    speed_points, quality_points = plot_points(result)
    if not speed_points and not quality_points:
        return None
    # a point without a runtime speed has no place on a speed axis: with speed points, those are left out (named)
    points = speed_points or quality_points
    panels = [p for p in _PANELS if any(_interval(m, p[1], p[2]) for _, _, m in points)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), dpi=110, squeeze=False)
    for ax, (title, measure, unit) in zip(axes[0], panels):
        for i, (name, x, m) in enumerate(points):
            interval = _interval(m, measure, unit)
            if interval is None:
                continue
            y, lo, hi = interval
            ax.errorbar([i if x is None else x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=4, label=name)
        if measure == "ppl_change":
            limits = {effective_gates(result.recipe.gates, s).max_ppl_increase_pct for s in result.plan.schemes.values()}
            for limit in sorted(x for x in limits if x is not None):
                ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"gate: +{limit}%")
            ax.axhline(0, color="gray", linewidth=0.5)
        ax.set_title(title, fontsize=9)
        if speed_points:
            ax.set_xlabel("decode tokens/s (median; the runtime's own speed on this machine)", fontsize=8)
        else:
            ax.set_xticks(range(len(quality_points)), [n for n, _, _ in quality_points], rotation=20, ha="right",
                          fontsize=7)
            ax.set_xlabel("artifact (engine): no runtime measured speed; emulation timings are not speed", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="best")
    suffix = f" ({len(quality_points)} without a runtime speed: not plotted)" if speed_points and quality_points else ""
    fig.suptitle(f"{result.recipe.name}: quality" + (" vs speed" if speed_points else "") + suffix, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def plot_points(result: "BuildResult") -> tuple[list[tuple[str, float, "Evaluation"]], list[tuple[str, None, "Evaluation"]]]:
    """(points on the speed axis: name, runtime decode tok/s, evaluation; points without a runtime speed: name,
    None, evaluation). Emulation timings never become a speed point; an evaluation with no finite perplexity change
    is not plotted."""
    speed_points, quality_points = [], []
    for label in result.artifacts:
        for eval_id in result.target_evals.get(label, []):
            engine, corpus = eval_id.engine, eval_id.corpus
            m = result.evals.get(eval_id)
            if m is None or _interval(m, "ppl_change", 1.0) is None:
                continue
            tput = (m.throughput or {}).get("decode_tokens_per_s")
            name = f"{label} ({engine})" if corpus is None else f"{label} ({engine}, {corpus})"
            if tput and speed_kind(result, eval_id) == "runtime" and math.isfinite(tput["median"]):
                speed_points.append((name, tput["median"], m))
            else:
                quality_points.append((name, None, m))
    return speed_points, quality_points


def _interval(m: "Evaluation", measure: str, unit: float) -> tuple[float, float, float] | None:
    """(value, low, high) of one measure of an evaluation, in the panel's unit; None when unmeasured or not finite."""
    d = getattr(m, measure, None)
    if not d:
        return None
    keys = ("delta_pct", "ci_low_pct", "ci_high_pct") if measure == "ppl_change" else ("mean", "ci_low", "ci_high")
    values = tuple(d.get(k) for k in keys)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    return tuple(v * unit for v in values)


def report_html(result: "BuildResult", markdown: str, png: bytes | None) -> str:
    """A page a browser shows as a report: the verdict, the summary table, the plot, then the markdown report
    rendered (its headings, tables and lists as HTML, not as raw text)."""
    from markdown_it import MarkdownIt  # lazy: ~0.15 s cold, only for report.html; llmc plan imports this module

    rows = summary_rows(result)
    table = "<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header(result)) + "</tr></thead><tbody>"
    for r in rows:
        cls = ' class="fail"' if "FAIL" in str(r[-1]) or str(r[-1]).startswith("ERROR") else ""
        table += f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
    table += "</tbody></table>" + "".join(f"<p class=\"note\">{html.escape(n)}</p>" for n in footnotes(result))
    img = (f'<img alt="quality (perplexity change, KLD, top-1 agreement) vs speed" '
           f'src="data:image/png;base64,{base64.b64encode(png).decode()}">' if png else "<p>(nothing measured: no plot)</p>")
    status, summary = result.gates_status
    heading = {"passed": "all gates passed", "none": "no gates"}.get(status, "GATES FAILED" if status == "failed"
                                                                     else "gates passed, some not measured")
    # html off: text from the recipe or a model's files reaches the markdown and must stay text
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown.split("\n", 1)[1]
                                                                            if markdown.startswith("# ") else markdown)
    verdict = "fail" if status == "failed" else "pass"
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>llmc report: {html.escape(result.recipe.name)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:left}}
th{{background:#f3f3f3}}tr.fail td{{background:#fdd}}p.note{{font-size:12px;color:#555}}img{{max-width:100%}}
h1.pass{{color:#1a7f37}}h1.fail{{color:#b00020}}code{{background:#f6f6f6;padding:0 3px}}pre{{background:#f6f6f6;padding:1em;overflow-x:auto}}</style>
</head><body><h1 class="{verdict}">{html.escape(result.recipe.name)} — {heading}</h1><p>{html.escape(summary)}</p>
{table}<h2>Quality{" and speed" if png else ""}</h2>{img}<h2>Full report</h2>
{body}</body></html>
"""
