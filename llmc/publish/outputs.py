"""Per-build outputs kept in the cache, whether or not the build published:
report.json, report.md, report.html (with the quality-vs-speed plot), quality_vs_speed.png, junit.xml."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from llmc.eval.ci import junit_xml, quality_speed_png, report_html
from llmc.eval.report import render_markdown, report_dict
from llmc.storage.paths import confined
from llmc.storage.store import Store, atomic_write_bytes, atomic_write_json, atomic_write_text, fsync_dir

if TYPE_CHECKING:
    from llmc.result import BuildResult


def write_report_files(result: "BuildResult", out: Path) -> None:
    markdown = render_markdown(result)
    png = quality_speed_png(result)
    atomic_write_json(out / "report.json", report_dict(result))
    atomic_write_text(out / "report.md", markdown)
    if png:
        atomic_write_bytes(out / "quality_vs_speed.png", png)
    atomic_write_text(out / "report.html", report_html(result, markdown, png))
    atomic_write_text(out / "junit.xml", junit_xml(result.recipe.name, result.verdicts))


def write_build_outputs(result: "BuildResult", store: Store) -> Path:
    """The build's report files in the cache, replaced as one folder (a disk that fills halfway through leaves
    the previous set or none, never a report.md beside a stale report.json)."""
    out = confined(store.root, f"builds/{result.build_id}", what="build folder")
    tmp, old = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_report_files(result, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # on a full disk, give the space back
        raise
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
    return out
