#!/usr/bin/env python3
"""Does `llmc plan` still print the same numbers? Records every shipped recipe's plan with this machine's probes
pinned, and compares two such records.

Usage (repository root, llmc's venv; PYTHONPATH must name the tree to record: the venv's editable llmc may point
elsewhere):

    PYTHONPATH=$PWD .venv/bin/python scripts/compare_plans.py record /tmp/plans-before   # on the old tree
    PYTHONPATH=$PWD .venv/bin/python scripts/compare_plans.py record /tmp/plans-after    # on the new tree
    python scripts/compare_plans.py diff /tmp/plans-before /tmp/plans-after

    record OUT [--recipes R...] [--nproc 1 2] [--cache DIR]
        one file per recipe and --nproc, OUT/<recipe>.nproc<N>.txt: the rendered plan, then every number of its
        estimates and typed rows as JSON (full precision, not the table's rounding), or the error it raised.
        --cache: the llmc cache the demo sources are materialized in (default: /tmp/llmc-compare-plans-cache, so
        both records read the same files and the user's cache is not written)
    diff A B
        prints `identical` or a unified diff per file; exit status 0 only if every file is identical.

What is pinned, so that two runs (and two trees) see the same machine: the probes (`matmul_rate`, the quantizer's
`quantize_rate`) return a fixed function of their arguments (so a probe called with other arguments still shows as
a difference), MemAvailable is 64 GB, the disk has 10 TB free, `os.cpu_count()` is 2, and the calibration device is
whatever the recipe names on a machine without a GPU. The pins replace the probe functions wherever a module of
llmc holds them (by identity, after importing the planner and every stage), so they follow a probe that moves to
another module as long as its name stays; a renamed probe is added to PROBES.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEMORY = 64 * 10**9
CPUS = 2
MATMUL = {"float32": 60e9, "bfloat16": 25e9, "float16": 20e9}  # FLOP/s at width 1024, 64 rows


def pinned_matmul_rate(dtype_name: str, device: str = "cpu", width: int = 1024, rows: int = 64) -> float:
    """A fixed rate that still depends on every argument the planner passes."""
    rows = max(1, min(rows, 512))
    return MATMUL[dtype_name] * (1 + width / 65536) * (1 + rows / 4096) * (1.0 if device == "cpu" else 20.0)


def pinned_quantize_rate(*args, **kwargs) -> float:
    """A fixed rate per (dtype, weight format, strategy, group size, probe elements), whatever the probe's
    signature: the old `quantize_rate(dtype_name, weight_format, strategy, group_size, elements=...)` or one that
    takes the weights' TensorSpec (`quantize_rate(spec, dtype_name, elements=...)`)."""
    args = list(args)
    if args and not isinstance(args[0], str):  # a TensorSpec first
        spec = args.pop(0)
        dtype = args.pop(0) if args else kwargs.pop("dtype_name")
        fmt, strategy, group = spec.format, spec.strategy, spec.group_size
    else:
        dtype = args.pop(0) if args else kwargs.pop("dtype_name")
        fmt = args.pop(0) if args else kwargs.pop("weight_format", "fp8_e4m3")
        strategy = args.pop(0) if args else kwargs.pop("strategy", "tensor")
        group = args.pop(0) if args else kwargs.pop("group_size", None)
    elements = args.pop(0) if args else kwargs.pop("elements", 3072 * 4096)
    elements = min(elements, 3072 * 4096)  # the probe's cap
    salt = zlib.crc32(repr((dtype, fmt, strategy, group or None)).encode()) % 1000
    return 1e8 * (1 + salt / 1000) * (1 + elements / 1e9)


PROBES = {"matmul_rate": pinned_matmul_rate, "quantize_rate": pinned_quantize_rate,
          "memory_available": lambda: MEMORY,
          # a VM that hands its free pages to its host plans the wait for memory beyond MemFree, which moves between
          # two records: planned as on a machine without such a host
          "memory_from_host": lambda: False,
          # torch.onnx's export of a tiny model of the family with `layers` layers (llmc.formats.onnx_qdq): exports/s
          "graph_export_rate": lambda config, layers: 1.0 / (1.0 + 0.5 * layers),
          # the meta skeleton an export's config check builds (llmc.formats.described): calls/s
          "skeleton_rate": lambda config, layers: 1.0 / (0.05 + 0.02 * layers)}


def _pin() -> None:
    import llmc.pipeline.stages  # noqa: F401  (every stage module, so their imports of the probes are pinned too)
    import llmc.planning.plan  # noqa: F401

    originals = {}
    for name in list(sys.modules):
        module = sys.modules[name]
        if name.startswith("llmc") and module is not None:
            for probe in PROBES:
                if callable(getattr(module, probe, None)) and getattr(module, probe) is not PROBES[probe]:
                    originals.setdefault(probe, getattr(module, probe))
    for name in list(sys.modules):
        module = sys.modules[name]
        if name.startswith("llmc") and module is not None:
            for probe, original in originals.items():
                if getattr(module, probe, None) is original:
                    setattr(module, probe, PROBES[probe])
    missing = set(PROBES) - set(originals)
    if missing:
        sys.exit(f"no llmc module holds the probe(s) {sorted(missing)}: add their new names to PROBES")
    usage = shutil.disk_usage("/")
    shutil.disk_usage = lambda _p: type(usage)(10**13, 0, 10**13)
    os.cpu_count = lambda: CPUS


def record(out: Path, recipes: list[Path], nprocs: list[int], cache: Path) -> None:
    os.environ["LLMC_CACHE"] = str(cache)
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("LLMC_TORCH_EVAL", None)
    _pin()
    from llmc.errors import LlmcError
    from llmc.planning.plan import make_plan, plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    out.mkdir(parents=True, exist_ok=True)
    for path in recipes:
        for nproc in nprocs:
            try:
                recipe = load_recipe(path)
                make_plan(recipe)
                plan = plan_recipe(recipe, Store.default(), path, nproc=nproc)
                numbers = {"estimates": plan.as_dict()["estimates"], "distributed": plan.distributed,
                           "rows": [{"id": str(r.id), **r.as_dict(), "parts": r.parts} for r in plan.rows]}
                text = plan.render() + "\n" + json.dumps(numbers, indent=1, sort_keys=True, default=str) + "\n"
            except LlmcError as e:
                text = f"error {type(e).__name__}: {e}\n"
            (out / f"{path.stem}.nproc{nproc}.txt").write_text(text)
            print(f"{path.stem} nproc {nproc}: {text.splitlines()[0][:100]}", flush=True)


def diff(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.txt")} | {p.name for p in b.glob("*.txt")})
    differ = 0
    for name in names:
        left = (a / name).read_text().splitlines() if (a / name).exists() else ["(missing)"]
        right = (b / name).read_text().splitlines() if (b / name).exists() else ["(missing)"]
        if left == right:
            print(f"{name}: identical")
            continue
        differ += 1
        print(f"{name}: differs")
        sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(left, right, str(a / name), str(b / name),
                                                                           lineterm="", n=1))
    print(f"{len(names) - differ} of {len(names)} identical")
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--recipes", nargs="*", type=Path, default=sorted((REPO / "recipes").glob("*.yaml")))
    r.add_argument("--nproc", nargs="*", type=int, default=[1, 2])
    r.add_argument("--cache", type=Path, default=Path("/tmp/llmc-compare-plans-cache"))
    d = sub.add_parser("diff")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        importlib.import_module("llmc")
        record(args.out, args.recipes, args.nproc, args.cache)
        return 0
    return diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
