#!/usr/bin/env python3
"""Import cycles among llmc's modules, counting every import outside a function (those under `if TYPE_CHECKING:`
too), and the imports inside functions (overall, the unexplained ones per module, and for the modules named).

Usage: python scripts/import_cycles.py [REPO] [MODULE...]     e.g. python scripts/import_cycles.py . llmc.planning.plan

The graph: one edge per `import` / `from ... import` of an llmc module outside a function, the ones under
`if TYPE_CHECKING:` included: a type-level import never runs, but it still says that the importing module needs the
other's types, so a circle through one is a layering circle all the same (issue 44). Importing `a.b` also imports
package `a`, so that edge is added too. Every strongly connected component of more than one module is printed, with
the count of circles and of the modules in them. The same count with the imports inside functions added is printed
for information (those are lazy on purpose, `# lazy: <why>`; some name a cycle they avoid).

An import inside a function is explained when it says why it is not at module level: a `# lazy: <why>` comment on
one of its lines, or on a comment line right above it or above the run of adjacent imports it belongs to (a heavy
or optional dependency, a cycle with a named module). The unexplained ones are the number to drive down.
Needs no llmc import (reads the source with `ast`), so it also runs on a checkout whose imports fail."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

LAZY = "# lazy:"

# The layers (docs/architecture.md, "Layers"), top first: a module imports only from its own layer or the ones below
# it (the longest prefix names a module's layer). An edge into a package whose `__init__` imports nothing is not
# judged: it carries no dependency (`llmc.pipeline.ids` imports package `llmc.pipeline`, a docstring).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("llmc.__main__", "llmc.cli", "llmc.build", "llmc.hook", "llmc.planning.plan"),  # entry points, the plan walk
    ("llmc.pipeline",),  # the stages, their runner and cost models
    ("llmc.eval", "llmc.publish"),  # what reads a BuildResult
    ("llmc.result",),  # the build's typed result
    ("llmc.recipe",),  # the recipe: its choices name the plugins
    ("llmc.runtimes", "llmc.formats", "llmc.engines", "llmc.quant", "llmc.model", "llmc.data", "llmc.calibration",
     "llmc.planning.shapes"),  # the plugins and the numerics
    ("llmc.planning", "llmc.pipeline.ids", "llmc.storage", "llmc.inputs", "llmc.telemetry", "llmc.registry",
     "llmc.errors", "llmc.distributed"),  # foundations, the cost model's primitives among them
)


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module under root/llmc."""
    mods = {}
    for f in sorted((root / "llmc").rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}".strip(".")
    return [f"{base}.{a.name}" for a in node.names] + [base]


def _graph_imports(tree: ast.Module, in_functions: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The imports the graph counts: every one outside a function, under `if TYPE_CHECKING:` too (and, with
    `in_functions`, those inside functions as well)."""
    found, stack = [], list(tree.body)
    while stack:
        n = stack.pop()
        if not in_functions and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            found.append(n)
        stack.extend(ast.iter_child_nodes(n))
    return found


def in_function_imports(tree: ast.Module, source: str) -> list[tuple[int, bool]]:
    """(line, explained) for every import statement inside a function (nested functions' counted once)."""
    lines = source.splitlines()
    inner = {n for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    import_lines = {i for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for i in range(n.lineno, n.end_lineno + 1)}
    out = []
    for n in sorted(inner, key=lambda n: n.lineno):
        explained = any(LAZY in lines[i - 1] for i in range(n.lineno, n.end_lineno + 1))
        above = n.lineno - 1
        while not explained and above >= 1:
            text = lines[above - 1].strip()
            if above in import_lines:
                above -= 1
            else:
                explained = text.startswith(LAZY)
                break
        out.append((n.lineno, explained))
    return out


def import_graph(mods: dict[str, Path], in_functions: bool = False
                 ) -> tuple[dict[str, set[str]], dict[str, list[tuple[int, bool]]]]:
    """(module -> the llmc modules it imports outside functions, type-level ones included (with `in_functions`:
    inside functions too), module -> its in-function imports)."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges, inner = {m: set() for m in mods}, {}
    for m, f in mods.items():
        source = f.read_text()
        tree = ast.parse(source)
        top = {t for n in _graph_imports(tree, in_functions) for t in _targets(n, m, f.name == "__init__.py")
               if t.startswith("llmc")}
        inner[m] = in_function_imports(tree, source)
        for t in top:
            r = resolve(t)
            if r and r != m:
                edges[m].add(r)
        # a package's __init__ runs before its submodules: importing a.b imports a
        for t in list(edges[m]):
            p = t.rpartition(".")[0]
            while p:
                if p in mods and p != m:
                    edges[m].add(p)
                p = p.rpartition(".")[0]
    return edges, inner


def layer(module: str) -> int | None:
    """The index in LAYERS (0: top) of the longest prefix that names the module; None for one no layer names."""
    named = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(named)[1] if named else None


def layer_violations(mods: dict[str, Path], edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every edge that goes up the LAYERS, or from or to a module no layer names."""
    empty_packages = {m for m, f in mods.items() if f.name == "__init__.py" and not any(
        isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(f.read_text())))}
    out = []
    for m, targets in edges.items():
        if m == "llmc":
            continue
        for t in targets:
            if t == "llmc" or t in empty_packages:
                continue
            a, b = layer(m), layer(t)
            if a is None or b is None or b < a:
                out.append((m, t))
    return sorted(out)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            strong(v)
    return out


def unexplained(root: Path, prefixes: tuple[str, ...] = ("llmc",)) -> dict[str, list[int]]:
    """Module -> lines of its in-function imports without a `# lazy:` reason, for modules under the prefixes."""
    _, inner = import_graph(modules(root))
    return {m: [line for line, ok in rows if not ok] for m, rows in inner.items()
            if any(m == p or m.startswith(p + ".") for p in prefixes) and not all(ok for _, ok in rows)}


def main(argv: list[str]) -> None:
    root = Path(argv.pop(0)) if argv and Path(argv[0]).is_dir() else Path(__file__).resolve().parents[1]
    mods = modules(root)
    edges, inner = import_graph(mods)
    found = cycles(edges)
    print(f"{len(mods)} modules, {sum(map(len, edges.values()))} import edges (outside functions, "
          f"`if TYPE_CHECKING:` included); circles: {len(found)}, of {sum(map(len, found))} modules")
    for c in found:
        print("  cycle:", ", ".join(c))
    against = layer_violations(mods, edges)
    print(f"imports that go up the layers (LAYERS; docs/architecture.md, \"Layers\"): {len(against)}")
    for m, t in against:
        print(f"  {m} -> {t}")
    lazy = cycles(import_graph(mods, in_functions=True)[0])
    print(f"with the imports inside functions too (not enforced): circles: {len(lazy)}, "
          f"of {sum(map(len, lazy))} modules")
    total = sum(len(rows) for rows in inner.values())
    bad = {m: [line for line, ok in rows if not ok] for m, rows in inner.items()}
    print(f"imports inside functions: {total}; without a `{LAZY} <why>` comment: {sum(map(len, bad.values()))}")
    for m, lines in sorted(bad.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if lines:
            print(f"  {m}: {len(lines)} (lines {', '.join(map(str, lines))})")
    for m in argv:
        print(f"  {m}: {len(inner.get(m, []))} inside functions")


if __name__ == "__main__":
    main(sys.argv[1:])
