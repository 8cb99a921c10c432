"""A benchmark script (benchmarks/<name>.py) imported as a module, for tests of its row-building functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/<name>.py loaded as `bench_<name>`, with the benchmarks folder on the path while it imports (the
    benchmarks import their siblings, as when run as scripts)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
