"""What CI systems read: JUnit XML (one test case per gate) and an HTML page with a quality-vs-speed plot."""

from __future__ import annotations

import base64
import html
import io
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from llmc.eval.report import HEADER, summary_rows

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
        cases.append(case)
    if error is not None:
        case = ET.Element("testcase", classname=f"llmc.{recipe_name}", name="build")
        e = ET.SubElement(case, "error", type=error[0], message=error[1].splitlines()[0][:500])
        e.text = error[1]
        cases.append(case)
    failures = sum(1 for c in cases if c.find("failure") is not None)
    errors = sum(1 for c in cases if c.find("error") is not None)
    suite = ET.Element("testsuite", name=f"llmc.{recipe_name}", tests=str(len(cases)),
                       failures=str(failures), errors=str(errors))
    suite.extend(cases)
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def quality_speed_png(result: "BuildResult") -> bytes | None:
    """Perplexity change (with its 95% CI) against decode tokens/s, one point per artifact x engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for label in result.artifacts:
        for engine in result.recipe.eval.runtimes:
            m = result.evals.get(f"{engine}:{label}")
            ch = m.ppl_change if m else None
            tput = ((m.throughput if m else None) or {}).get("decode_tokens_per_s")
            if ch and tput:
                points.append((f"{label} ({engine})", tput["median"], ch))
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, x, ch in points:
        err = [[ch["delta_pct"] - ch["ci_low_pct"]], [ch["ci_high_pct"] - ch["delta_pct"]]]
        ax.errorbar([x], [ch["delta_pct"]], yerr=err, fmt="o", capsize=4, label=name)
    limit = result.recipe.gates.max_ppl_increase_pct
    if limit is not None:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"gate: +{limit}%")
    ax.axhline(0, color="gray", linewidth=0.5)
    ax.set_xlabel("decode tokens/s (median; the evaluating engine on this machine — CPU emulation is not GPU speed)")
    ax.set_ylabel("perplexity change vs baseline, % (95% CI)")
    ax.set_title(f"{result.recipe.name}: quality vs speed")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def report_html(result: "BuildResult", markdown: str, png: bytes | None) -> str:
    rows = summary_rows(result)
    table = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in HEADER) + "</tr>"
    for r in rows:
        cls = ' class="fail"' if r[-1] == "FAIL" or str(r[-1]).startswith("ERROR") else ""
        table += f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
    table += "</table>"
    img = (f'<img alt="quality vs speed" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
           if png else "<p>(no throughput measured: no plot)</p>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>llmc report: {html.escape(result.recipe.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}tr.fail td{{background:#fdd}}pre{{background:#f6f6f6;padding:1em;white-space:pre-wrap}}</style>
</head><body><h1>{html.escape(result.recipe.name)} — {'all gates passed' if result.passed else 'GATES FAILED'}</h1>
{table}<h2>Quality vs speed</h2>{img}<h2>Full report</h2><pre>{html.escape(markdown)}</pre></body></html>
"""
