"""The best of a few timed runs: what the speed benchmarks report (layer_time.py, forward_efficiency.py,
awq_search.py). Imported as a sibling module (each benchmark runs as a script from this folder)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int, warmup: bool = False) -> float:
    """The shortest of `repeats` timed calls of `fn`, after one untimed call when `warmup`."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
