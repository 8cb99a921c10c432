"""The fuzz harnesses' per-case record (tests/unit/fuzz_limits.py): each case's own peak RSS, the 60 s / 4 GB bounds
failing a case that passes them, the log, and a class's rate cache starting empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit import fuzz_limits
from tests.unit.fuzz_limits import ClassRates, measured_case


# In a fresh process: one that has run other tests has threads of theirs (thread pools, servers) whose allocations
# land between the two cases' high-water marks (this check failed once inside the full default run).
_TWO_CASES = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.unit.fuzz_limits import measured_case, reset_peak
if not reset_peak():
    sys.exit(3)
with measured_case("big") as record:
    block = bytearray(96 << 20)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident
    record["outcome"] = "ok"
del block
with measured_case("small") as record:
    record["outcome"] = "ok"
"""


def test_each_case_reports_its_own_peak_rss(tmp_path: Path) -> None:
    log = tmp_path / "cases.jsonl"
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, "-c", _TWO_CASES, root], env={**os.environ, "LLMC_FUZZ_LOG": str(log)},
                       capture_output=True, text=True, timeout=120, check=False)
    if r.returncode == 3:
        pytest.skip("this kernel does not reset VmHWM (/proc/self/clear_refs)")
    assert r.returncode == 0, r.stderr[-2000:]
    big, small = (json.loads(line) for line in log.read_text().splitlines())
    assert big["peak_rss_mb"] - small["peak_rss_mb"] >= 80, (big, small)
    assert big["rss_per_case"] and small["outcome"] == "ok"


def test_a_case_over_the_bounds_fails_and_is_logged(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "cases.jsonl"
    monkeypatch.setenv("LLMC_FUZZ_LOG", str(log))
    monkeypatch.setattr(fuzz_limits, "MAX_CASE_S", 0.05)
    with pytest.raises(AssertionError, match="slow case took"):
        with measured_case("slow") as record:
            time.sleep(0.1)
            record["outcome"] = "exit 0"
    monkeypatch.setattr(fuzz_limits, "MAX_CASE_S", 60.0)
    monkeypatch.setattr(fuzz_limits, "MAX_RSS_BYTES", 1 << 20)  # 1 MB: every process is over it
    with pytest.raises(AssertionError, match="fat case peaked at"):
        with measured_case("fat") as record:
            record["outcome"] = "exit 0"
    with pytest.raises(ZeroDivisionError), measured_case("broken"):
        1 / 0
    slow, fat, broken = (json.loads(line) for line in log.read_text().splitlines())
    assert slow["wall_s"] >= 0.1 and fat["outcome"] == "exit 0"
    assert broken["outcome"] == "failed: ZeroDivisionError"


def test_a_class_rate_cache_starts_empty_and_carries_rates_to_later_cases(tmp_path: Path) -> None:
    rates = ClassRates(tmp_path / "class")
    first, second = tmp_path / "case1", tmp_path / "case2"
    rates.lend(first)
    assert not (first / rates.file.name).exists()  # the class's first case probes for real
    first.mkdir()
    (first / rates.file.name).write_text('{"rates": {"matmul x": 1}}')
    rates.file.parent.mkdir()
    rates.keep(first)
    rates.lend(second)
    assert (second / rates.file.name).read_text() == '{"rates": {"matmul x": 1}}'
    with pytest.raises(AssertionError, match="empty rate cache"):
        ClassRates(tmp_path / "class")  # a class whose cache already holds rates is not cold
