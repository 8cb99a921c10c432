"""Human progress (tqdm bars, log lines on stderr) plus one machine-readable line per step.

Lines starting with `llmc-progress ` carry JSON ({stage, done, total, elapsed_s}) so CI logs can be
parsed; set LLMC_PROGRESS_JSON=0 to silence them. Bars show only on a terminal.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
_QUIET = False


def set_quiet(quiet: bool) -> None:
    global _QUIET
    _QUIET = quiet


def log(message: str) -> None:
    if not _QUIET:
        print(f"[llmc {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def steps(items: Iterable[T], stage: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a bar on a terminal and a JSON progress line per item for logs."""
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    emit_json = os.environ.get("LLMC_PROGRESS_JSON", "1") != "0" and not _QUIET
    show_bar = sys.stderr.isatty() and not _QUIET
    start = time.monotonic()
    bar = tqdm(total=total, desc=stage, file=sys.stderr, leave=False, disable=not show_bar)
    try:
        for i, item in enumerate(items, 1):
            yield item
            bar.update(1)
            if emit_json and not show_bar:
                line = {"stage": stage, "done": i, "total": total, "elapsed_s": round(time.monotonic() - start, 2)}
                print("llmc-progress " + json.dumps(line), file=sys.stderr, flush=True)
    finally:
        bar.close()
