"""Per-build outputs kept in the cache, whether or not the build published: report.json and report.md."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmc.eval.report import render_markdown, report_dict
from llmc.store import Store, atomic_write_json, atomic_write_text

if TYPE_CHECKING:
    from llmc.build import BuildResult


def write_build_outputs(result: "BuildResult", store: Store) -> Path:
    out = store.root / "builds" / result.build_id
    atomic_write_json(out / "report.json", report_dict(result))
    atomic_write_text(out / "report.md", render_markdown(result))
    return out
