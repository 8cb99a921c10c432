"""Human progress (tqdm bars, log lines on stderr) plus one machine-readable line per step.

Lines starting with `llmc-progress ` carry JSON ({stage, done, total, elapsed_s}) so CI logs can be
parsed; set LLMC_PROGRESS_JSON=0 to silence them. Bars show only on a terminal.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No progress or log line inside (work the user did not ask for, such as a planner's probe)."""
    previous = _QUIET
    set_quiet(True)
    try:
        yield
    finally:
        set_quiet(previous)


def log(message: str) -> None:
    if not _QUIET:
        print(f"[llmc {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Meter:
    """Progress of one long step counted in `unit`s (layers, batches, bytes): a tqdm bar with its ETA on a
    terminal; elsewhere an `llmc-progress` JSON line ({stage, done, total, unit, elapsed_s, eta_s}) at most every
    `every_s` seconds, and one when the step ends."""

    def __init__(self, stage: str, total: int | None, *, unit: str = "it", every_s: float = 0.0) -> None:
        self.stage, self.total, self.unit, self.every_s = stage, total, unit, every_s
        self.done = 0
        self._emit_json = os.environ.get("LLMC_PROGRESS_JSON", "1") != "0" and not _QUIET
        show_bar = sys.stderr.isatty() and not _QUIET
        self._emit_json = self._emit_json and not show_bar
        self._start = self._last = time.monotonic()
        self._bar = tqdm(total=total, desc=stage, file=sys.stderr, leave=False, disable=not show_bar,
                         unit=unit, unit_scale=unit == "B")

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._bar.update(n)
        now = time.monotonic()
        if self._emit_json and (now - self._last >= self.every_s or self.done == self.total):
            self._last = now
            self._print(now)

    def _print(self, now: float) -> None:
        elapsed = now - self._start
        line = {"stage": self.stage, "done": self.done, "total": self.total, "elapsed_s": round(elapsed, 2)}
        if self.unit != "it":
            line["unit"] = self.unit
        if self.total and self.done:
            line["eta_s"] = round(elapsed / self.done * (self.total - self.done), 1)
        print("llmc-progress " + json.dumps(line), file=sys.stderr, flush=True)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def steps(items: Iterable[T], stage: str, total: int | None = None, *, unit: str = "it") -> Iterator[T]:
    """Iterate with a bar (and ETA) on a terminal and a JSON progress line per item for logs."""
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    with Meter(stage, total, unit=unit) as meter:
        for item in items:
            yield item
            meter.advance()
