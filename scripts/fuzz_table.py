#!/usr/bin/env python3
"""Summarize the per-case log of a fuzz run (LLMC_FUZZ_LOG=<file>, written by tests/unit/fuzz_limits.py) as the
numbers docs/reliability.md's table records: cases per class, the outcome distribution, wall time (median, 99th
percentile, max), peak RSS (max), cases over the bounds, failed cases, and how many cases probed rates (cold).

Usage: python scripts/fuzz_table.py LOG.jsonl [LOG.jsonl ...]"""
from __future__ import annotations

import collections
import json
import statistics
import sys

MAX_CASE_S = 60.0
MAX_RSS_MB = 4096.0


def summarize(records: list[dict]) -> list[str]:
    """One paragraph per case class."""
    lines = []
    by_class: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        by_class[r["class"]].append(r)
    for name, cases in sorted(by_class.items()):
        walls = sorted(c["wall_s"] for c in cases)
        outcomes = collections.Counter(str(c["outcome"]) for c in cases)
        share = ", ".join(f"{o} {n} ({100 * n / len(cases):.1f}%)" for o, n in outcomes.most_common())
        p99 = walls[min(len(walls) - 1, int(0.99 * len(walls)))]
        probed = sum(1 for c in cases if c.get("probed"))
        lines += [f"{name}: {len(cases)} cases",
                  f"  outcomes: {share}",
                  f"  wall s: median {statistics.median(walls):.3f}, p99 {p99:.2f}, max {walls[-1]:.2f}; "
                  f"over {MAX_CASE_S:.0f} s: {sum(w > MAX_CASE_S for w in walls)}",
                  f"  peak RSS MB: max {max(c['peak_rss_mb'] for c in cases):.0f} "
                  f"(per case: {all(c.get('rss_per_case') for c in cases)}); "
                  f"over {MAX_RSS_MB:.0f} MB: {sum(c['peak_rss_mb'] > MAX_RSS_MB for c in cases)}",
                  f"  exit 70: {outcomes.get('exit 70', 0)}; failed: "
                  f"{sum(n for o, n in outcomes.items() if o.startswith('failed'))}; "
                  f"cases that probed rates on their own empty cache: {probed}"]
    return lines


def main(paths: list[str]) -> None:
    records = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print("\n".join(summarize(records)))


if __name__ == "__main__":
    main(sys.argv[1:])
