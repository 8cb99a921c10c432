"""What the plans of `benchmarks/plan_under_load.py` runs would have said with new memory planned at the host's pace.

    python benchmarks/host_pace_what_if.py --pace 0.58 --pools 0 1 2 -- \\
        benchmarks/results/plan_under_load_*_2026-12-04_xeon_*_reads_without_copies*.jsonl

A computation over recorded rows, not a run of the planner: each plan's point for each stage plus
`max(0, host bytes - PROCESS_BYTES - pool) / pace` (the stage's new memory past the `pool` of recently freed pages it
gets first, at the `pace` in GB/s that `benchmarks/new_memory_pace.py` measured around the runs), against the median
of the builds, as plan_under_load judges. Prints, per pool and run, each stage's lowest / highest error of the plans.
Only host memory counts: an export's new page cache (the bytes it writes) is not in the rows.
(docs/planner-constants.md#reclaim_rate)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from llmc.planning.machine import PROCESS_BYTES


def errors_with_pace(row: dict, pace_gb_s: float, pool_gb: float) -> dict[str, tuple[float, float]]:
    """stage -> (lowest, highest) error of the row's plans with new memory past `pool_gb` at `pace_gb_s`."""
    out = {}
    for stage, built in row["build"]["stages"].items():
        measured = statistics.median(built["each_s"])
        errs = []
        for plan in row["plans"]:
            planned = plan["stages"][stage]
            new_gb = max(0.0, planned["host_gb"] - PROCESS_BYTES / 1e9 - pool_gb)
            errs.append((planned["seconds"] + new_gb / pace_gb_s - measured) / measured)
        out[stage] = (min(errs), max(errs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", type=Path)
    ap.add_argument("--pace", type=float, required=True, help="GB/s of new memory past the pool")
    ap.add_argument("--pools", type=float, nargs="+", default=[0.0, 1.0, 2.0], help="GB")
    args = ap.parse_args()
    for pool in args.pools:
        print(f"pool {pool:g} GB, pace {args.pace:g} GB/s")
        for path in args.rows:
            row = json.loads(path.read_text().splitlines()[0])
            cells = [f"{stage}: {lo * 100:+.0f}% / {hi * 100:+.0f}%"
                     for stage, (lo, hi) in errors_with_pace(row, args.pace, pool).items()]
            print(f"  {path.name}\n    " + "\n    ".join(cells))


if __name__ == "__main__":
    main()
