"""Per-case measurements of the fuzz harnesses (issue 50): exit code or outcome, wall time and peak RSS, asserted
against the bounds every case must keep (MAX_CASE_S, MAX_RSS_BYTES) and, with LLMC_FUZZ_LOG=<file>, appended to
that file as one JSON line per case (`scripts/fuzz_table.py` summarizes it for docs/reliability.md).

Peak RSS is the process's high-water mark (VmHWM), reset to the current RSS before each case through
/proc/self/clear_refs where the kernel allows it, so each case reports its own peak; where it does not, the
process's lifetime peak (getrusage), which is an upper bound of every case's, is what is checked and recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

MAX_CASE_S = 60.0  # issue 50's bound: no case over 60 s
MAX_RSS_BYTES = 4 << 30  # issue 50's bound: no case over 4 GB


def _hwm_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_peak() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark: since the last `reset_peak`, or its lifetime's."""
    hwm = _hwm_bytes()
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def measured_case(case_class: str) -> Iterator[dict]:
    """Time one case and take its peak RSS; the caller fills in `record["outcome"]` (an exit code or a word).
    Asserts the bounds after the case, and logs the record when LLMC_FUZZ_LOG names a file."""
    record: dict = {"class": case_class, "outcome": None}
    per_case = reset_peak()
    start = time.monotonic()
    try:
        yield record
    except BaseException as e:  # the property failed: logged too, so a long run's log shows every case
        record["outcome"] = f"failed: {type(e).__name__}"
        _finish(record, start, per_case)
        raise
    _finish(record, start, per_case)
    assert record["wall_s"] <= MAX_CASE_S, f"{case_class} case took {record['wall_s']} s (bound {MAX_CASE_S} s)"
    assert record["peak_rss_mb"] * 2**20 <= MAX_RSS_BYTES, (
        f"{case_class} case peaked at {record['peak_rss_mb']} MB RSS (bound {MAX_RSS_BYTES >> 20} MB)")


def _finish(record: dict, start: float, per_case: bool) -> None:
    record["wall_s"] = round(time.monotonic() - start, 3)
    record["peak_rss_mb"] = round(peak_rss_bytes() / 2**20, 1)
    record["rss_per_case"] = per_case
    log = os.environ.get("LLMC_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


class ClassRates:
    """One rate cache per class of cases (issue 50: each class starts from an empty rate cache and real probes).
    Every case still gets its own empty LLMC_CACHE; `lend` copies the rates the class's earlier cases measured into
    it and `keep` copies them back, so that the first cases of a class probe for real and the later ones read
    those rates instead of probing every plan (about 10 s of timed runs each), as one machine's plans do."""

    def __init__(self, folder: Path) -> None:
        from llmc.planning.probes import RATES_FILE

        self.file = Path(folder) / RATES_FILE
        assert not self.file.exists(), f"{self.file} exists: a class starts from an empty rate cache"

    def lend(self, cache: Path) -> None:
        if self.file.exists():
            Path(cache).mkdir(parents=True, exist_ok=True)
            (Path(cache) / self.file.name).write_bytes(self.file.read_bytes())

    def keep(self, cache: Path) -> None:
        measured = Path(cache) / self.file.name
        with contextlib.suppress(OSError):
            self.file.write_bytes(measured.read_bytes())

    @staticmethod
    def used(cache: Path) -> tuple[int, int] | None:
        """(rates probed by this case, rates it read from the class's cache), None when it planned nothing."""
        from llmc.planning import probes

        book = probes.book()
        if book.path is None or not book.path.is_relative_to(Path(cache)):
            return None  # refused before the planner chose its cache
        now = sum(1 for p in book.used.values() if p.probed_now)
        return now, len(book.used) - now
