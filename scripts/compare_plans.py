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
        estimates and typed rows as JSON (12 significant digits, not the table's rounding: the order of a sum moves
        only the last bits of a float), or the error it raised.
        --cache: the llmc cache the demo sources are materialized in (default: /tmp/llmc-compare-plans-cache, so
        both records read the same files and the user's cache is not written)
    diff A B
        prints `identical` or a unified diff per file; exit status 0 only if every file is identical.

What is pinned, so that two runs (and two trees) see the same machine: every probe returns a fixed function of its
arguments (so a probe called with other arguments still shows as a difference), MemAvailable is 64 GB, the disk has
10 TB free, none of the source is in the page cache, `os.cpu_count()` is 2, and the calibration device is whatever
the recipe names on a machine without a GPU.
Two layers of pins: PROBES replaces a few rate functions (`matmul_rate`, the quantizer's `quantize_rate`, the
export's skeleton and graph rates, the memory) wherever a module of llmc holds them (by identity, after importing the
planner and every stage); TIMERS replaces every timed probe, the function each `probes.rate(key, timer(...))` or
`probes.measured(...)` call in llmc times (`_*_timer` factories, or a function a lambda calls), and the rate book
neither reads nor writes a cache file (`PinnedBook`), so no rate measured under another load enters a record.
Before pinning, every such call in llmc is found in the source (`probe_sites`; also under another name the module
gives `probes`, `rate` or `measured`, and the rate book's own `probes.book().probe(...)`): one whose timer TIMERS
lacks, or whose timer cannot be named, stops the record naming it (a new probe cannot go unpinned); a renamed rate
function is added to PROBES.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
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
          # how much of the source the page cache holds moves between two records: planned as read from the disk
          "resident_share": lambda paths: 0.0,
          # torch.onnx's export of a tiny model of the family with `layers` layers (llmc.formats.onnx_qdq): exports/s
          "graph_export_rate": lambda config, layers: 1.0 / (1.0 + 0.5 * layers),
          # the meta skeleton an export's config check builds (llmc.formats.described): calls/s
          "skeleton_rate": lambda config, layers: 1.0 / (0.05 + 0.02 * layers)}


# pins of functions added since records were first compared: a tree from before them has none to pin
NEWER_PROBES = {"resident_share"}


def _text(x: object) -> str:
    """A canonical text of a probe's argument: a dataclass by the fields that differ from their defaults (a field
    added with a default changes no pin), a dict sorted, a function by its name; else repr."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        def default(f: dataclasses.Field) -> object:
            if f.default is not dataclasses.MISSING:
                return f.default
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
        fields = [f"{f.name}={_text(getattr(x, f.name))}" for f in dataclasses.fields(x)
                  if getattr(x, f.name) != default(f)]
        return f"{type(x).__name__}({', '.join(fields)})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in x) + "]"
    if callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', '')}.{x.__qualname__}"
    return repr(x)


def _salt(*args: object, **kwargs: object) -> float:
    """1 to 1.25, a fixed function of the arguments: two probes called differently get different rates."""
    text = ", ".join([_text(a) for a in args] + [f"{k}={_text(v)}" for k, v in sorted(kwargs.items())])
    return 1 + 0.25 * (zlib.crc32(text.encode()) % 1000) / 1000


def _spec_rate(base: float, microscaling: float):
    """A per-element rate of a probe whose first argument is a TensorSpec: `microscaling` for the microscaling formats
    (an order slower on this CPU), `base` for the others."""
    def rate(spec, *args, **kwargs) -> float:
        slow = getattr(getattr(spec, "info", None), "microscaling", False)
        return (microscaling if slow else base) * _salt(spec, *args, **kwargs)
    return rate


def _convert_rate(kind) -> float:
    if kind.method == "copy":
        return (4.9e8 if kind.qtype == "F32" else 3.3e7) * _salt(kind)
    return 3.5e6 * _salt(kind)


# Every timed probe of llmc ("module:function", as `probe_sites` names the function a probe's call times) -> its rate
# as a fixed function of the timer's arguments, in the probe's unit. The magnitudes are about this 2-core VM's medians
# (December 2026), so a record reads like a plan; they are pins, not measurements.
TIMERS = {
    "llmc.planning.machine:_matmul_timer":  # FLOP/s (matmul_rate itself is pinned in PROBES)
        lambda dtype_name, device, width, rows, outputs=128: pinned_matmul_rate(dtype_name, device, width, rows),
    "llmc.quant.numerics:_quantize_timer":  # weight elements/s (quantize_rate itself is pinned in PROBES)
        lambda spec, dtype_name, elements, device="cpu": pinned_quantize_rate(spec, dtype_name, elements=elements),
    "llmc.quant.numerics:_fake_quantize_timer": _spec_rate(1.5e7, 2.4e6),  # activation elements/s
    "llmc.planning.machine:_hash_timer": lambda: 2.7e8,  # bytes/s
    # bytes/s of new memory from the host (only probed where memory_from_host, pinned False in PROBES)
    "llmc.planning.machine:_new_memory_timer": lambda: 5.8e8,
    "llmc.planning.machine:_write_timer": lambda: 1.0e8,  # bytes/s written and hashed
    "llmc.planning.disk:_timer": lambda which: {"write": 4.7e8, "read": 6.5e8}[which],  # bytes/s
    "llmc.planning.disk:_cached_timer": lambda: 2.1e9,  # bytes/s copied out of the page cache
    "llmc.engines.agreement:_scoring_timer":  # logit elements/s
        lambda vocab, top_k, reference, device="cpu": (9.4e6 if reference else 2.4e7) * _salt(vocab, top_k, device),
    "llmc.formats.described:_skeleton_timer":  # skeletons/s (skeleton_rate itself is pinned in PROBES)
        lambda cut: 1.0 / (0.05 + 0.02 * int(cut.get("num_hidden_layers") or 1)),
    "llmc.formats.onnx_qdq:_graph_timer":  # exports/s (graph_export_rate itself is pinned in PROBES)
        lambda tiny: 1.0 / (1.0 + 0.5 * int(tiny.get("num_hidden_layers") or 1)),
    "llmc.formats.onnx_qdq:_insert_timer": _spec_rate(2.5e6, 2.5e6),  # quantized weight elements/s
    "llmc.formats.gguf:_convert_timer": _convert_rate,  # elements/s
    "llmc.formats.gguf:_vocabulary_timer": lambda: 2.1e4,  # tokens/s
    "llmc.formats.files:_repack_timer": _spec_rate(3.4e6, 3.4e6),  # quantized weight elements/s, per codec
    "llmc.formats.onnx_genai:_builder_timer":  # builder exports/s (one process's start and one run)
        lambda config, layers: 1.0 / ((37 + 14 * layers) * _salt(config)),
    "llmc.formats.onnx_genai:_builder_repack_timer": _spec_rate(3.5e6, 3.5e6),  # quantized weight elements/s
    "llmc.quant.stream_probe:_stream_timer":  # decoder layers/s
        lambda calibrated, dtype_name: (12.0 if calibrated else 17.0) * _salt(dtype_name),
    "llmc.quant.forward_probe:_forward_timer":  # layer forwards/s at the model's widths (observed: the stream's hooks)
        lambda widths, batch, seq_len, compute, observed: (
            (3.5e10 if observed else 5.0e10) / (2 * batch * seq_len * widths.params) / _salt(widths, compute)),
    "llmc.model.source_formats:_decode_probe": lambda fmt: 3.0e7 * _salt(fmt),  # decoded elements/s
    "llmc.quant.mxfp4_source:_kept_codes_probe": lambda fmt: 2.0e7 * _salt(fmt),  # weights/s
    "llmc.quant.mxfp4_source:_passed_through_probe": lambda: 3.0e8,  # weights/s
}
RATE_CALLS = ("rate", "measured")  # llmc.planning.probes' functions that time a probe


@dataclasses.dataclass(frozen=True)
class ProbeSite:
    where: str  # file:line of the probes.rate / probes.measured call
    timer: str  # "module:function" the call times, or "" when it cannot be named
    direct: bool  # the call passes `lambda: timer(...)` (the timer returns the rate), not `timer(...)` (a run_once)
    function: object = None  # the timer itself, when named


def probe_sites(root: Path | None = None, package: str = "llmc") -> list[ProbeSite]:
    """Every `probes.rate(key, ...)` / `probes.measured(key, ...)` call in the package's source under `root` (default:
    the llmc imported), with the function it times: `timer(...)` or `lambda: timer(...)`, named by importing its
    module and looking the name up there."""
    if root is None:
        root = Path(importlib.import_module(package).__file__).parent
    sites = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        module_name = ".".join([package, *rel.parts]).removesuffix(".__init__")
        if module_name == f"{package}.planning.probes":
            continue  # the rate book itself
        text = path.read_text()
        if "probes" not in text:
            continue  # no probe here (and parsing all of llmc takes seconds)
        tree = ast.parse(text, str(path))
        modules, functions = _probe_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _reaches_the_rate_book(node.func, modules, functions)):
                continue
            where = f"{path}:{node.lineno}"
            arg = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "run_once"),
                                                               None)
            direct = isinstance(arg, ast.Lambda)
            call = arg.body if direct else arg
            target = call.func if isinstance(call, ast.Call) else None
            function = _resolve(module_name, target) if target is not None else None
            name = f"{function.__module__}:{function.__qualname__}" if callable(function) else ""
            sites.append(ProbeSite(where, name, direct, function))
    return sites


def _probe_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names a module binds to llmc.planning.probes (`from llmc.planning import probes [as p]`, `import
    llmc.planning.probes as p`) and to its timing functions (`from llmc.planning.probes import rate [as r]`)."""
    modules, functions = {"probes"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "llmc.planning":
            modules |= {a.asname or a.name for a in node.names if a.name == "probes"}
        elif isinstance(node, ast.ImportFrom) and node.module == "llmc.planning.probes":
            functions |= {a.asname or a.name for a in node.names if a.name in RATE_CALLS}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "llmc.planning.probes" and a.asname}
    return modules, functions


def _reaches_the_rate_book(func: ast.expr, modules: set[str], functions: set[str]) -> bool:
    """Whether a call of `func` times a probe: probes.rate / probes.measured under any name the module gives them,
    or the rate book's own probe (`probes.book().probe(key, run_once)`), which a pinned book would run unpinned."""
    if isinstance(func, ast.Name):
        return func.id in functions
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in RATE_CALLS and isinstance(func.value, ast.Name):
        return func.value.id in modules
    book = func.value.func if func.attr == "probe" and isinstance(func.value, ast.Call) else None
    return (isinstance(book, ast.Attribute) and book.attr == "book" and isinstance(book.value, ast.Name)
            and book.value.id in modules) or (isinstance(book, ast.Name) and book.id == "book")


def _resolve(module_name: str, expr: ast.expr) -> object:
    """The object a name or dotted name (`_timer`, `files._repack_timer`) is in the module's globals, or None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    obj = vars(importlib.import_module(module_name)).get(expr.id)
    for attr in reversed(parts):
        obj = getattr(obj, attr, None)
    return obj


def unpinned(sites: list[ProbeSite]) -> list[str]:
    """Why each probe of `sites` is not pinned (empty: every one is)."""
    out = []
    for s in sites:
        if not s.timer:
            out.append(f"{s.where}: the probe's timer cannot be named (pass `timer(...)` or `lambda: timer(...)` with "
                       "a module-level timer), so scripts/compare_plans.py cannot pin it")
        elif s.timer not in TIMERS:
            out.append(f"{s.where}: {s.timer} is not pinned: add it to TIMERS in scripts/compare_plans.py (a fixed "
                       "function of its arguments)")
    kinds: dict[str, set[bool]] = {}
    for s in sites:
        kinds.setdefault(s.timer, set()).add(s.direct)
    out += [f"{t}: called both as a timer factory and directly; TIMERS cannot pin both" for t, k in kinds.items()
            if t and len(k) > 1]
    return out


def pins(sites: list[ProbeSite]) -> list[tuple[object, str, object]]:
    """(module, attribute, pinned value) for every llmc module attribute holding one of the timers of `sites`, by
    identity (a timer imported into another module is pinned there too)."""
    pinned = {}
    for s in sites:
        fixed = TIMERS[s.timer]
        pinned[id(s.function)] = fixed if s.direct else (
            lambda fixed: lambda *a, **k: (lambda: fixed(*a, **k)))(fixed)
    out = []
    for name in list(sys.modules):
        module = sys.modules[name]
        if name.startswith("llmc") and module is not None:
            for attr, value in list(vars(module).items()):
                if callable(value) and id(value) in pinned:
                    out.append((module, attr, pinned[id(value)]))
    return out


def pinned_book():
    """A rate book that times every probe anew (the pinned timers: a fixed function of their arguments, no cache
    file, no memory of an earlier recipe's call under the same key) and says the rates are pinned."""
    from llmc.planning import probes

    class PinnedBook(probes.RateBook):
        def probe(self, key: str, run_once, repeats: int = probes.REPEATS, max_age_s=None) -> probes.Probe:
            found = self.probes[key] = self.used[key] = probes.Probe((run_once(),), 0.0, probed_now=True)
            return found

        def describe(self) -> str:
            return f"rates pinned by scripts/compare_plans.py: {len(self.used)} probes" if self.used else ""

    return PinnedBook()


def _pin() -> None:
    import llmc.pipeline.stages  # noqa: F401  (every stage module, so their imports of the probes are pinned too)
    import llmc.planning.plan  # noqa: F401
    from llmc.planning import probes

    sites = probe_sites()  # imports every module with a probe
    problems = unpinned(sites)
    stale = sorted(set(TIMERS) - {s.timer for s in sites})
    if stale:  # a timer renamed or gone (or an older tree recorded with this script): its pin does nothing
        print(f"compare_plans.py: no probe of this llmc times {stale}; their pins are unused", file=sys.stderr)
    if problems:
        sys.exit("compare_plans.py: not every probe of llmc is pinned, so a record would measure this machine:\n  "
                 + "\n  ".join(problems))
    for module, attr, value in pins(sites):
        setattr(module, attr, value)
    book = pinned_book()
    probes._book = book
    # a plan asks for the cache's rates (and a rank for another process's): the pinned book stays
    probes.use_cache = lambda folder, *, reprobe=False: book
    probes.reread = lambda: book

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
    missing = set(PROBES) - set(originals) - NEWER_PROBES
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
    from llmc.planning import probes
    from llmc.planning.plan import make_plan, plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    out.mkdir(parents=True, exist_ok=True)
    for path in recipes:
        for nproc in nprocs:
            probes.book().used.clear()  # the plan's rates line counts this recipe's probes only
            try:
                recipe = load_recipe(path)
                make_plan(recipe)
                plan = plan_recipe(recipe, Store.default(), path, nproc=nproc)
                numbers = {"estimates": plan.as_dict()["estimates"], "distributed": plan.distributed,
                           "rows": [{"id": str(r.id), **r.as_dict(), "parts": r.parts} for r in plan.rows]}
                text = (plan.render() + "\n" + json.dumps(_significant(numbers), indent=1, sort_keys=True, default=str)
                        + "\n")
            except LlmcError as e:
                text = f"error {type(e).__name__}: {e}\n"
            (out / f"{path.stem}.nproc{nproc}.txt").write_text(text)
            print(f"{path.stem} nproc {nproc}: {text.splitlines()[0][:100]}", flush=True)


def _significant(value, digits: int = 12):
    """`value` with every float rounded to `digits` significant digits (two sums of the same terms in another order
    differ in their last bits, e.g. 4e-12 s in a 2e3 s row: not a change of the plan)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _significant(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_significant(v, digits) for v in value]
    return value


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
