#!/usr/bin/env python3
"""Import cycles among llmc's modules, from the imports that run at import time, and the count of imports inside
functions (overall and for the modules named).

Usage: python scripts/import_cycles.py [REPO] [MODULE...]     e.g. python scripts/import_cycles.py . llmc.planning.plan

The graph: one edge per module-level `import` / `from ... import` of an llmc module (imports under
`if TYPE_CHECKING:` and inside functions never run at import time and are left out; importing `a.b` also imports
package `a`, so that edge is added too). Every strongly connected component of more than one module is printed.
Needs no llmc import (reads the source with `ast`), so it also runs on a checkout whose imports fail."""
import ast, sys
from pathlib import Path

args = sys.argv[1:]
root = Path(args.pop(0)) if args and Path(args[0]).is_dir() else Path(__file__).resolve().parents[1]
mods = {}
for f in (root / "llmc").rglob("*.py"):
    name = ".".join(f.relative_to(root).with_suffix("").parts)
    if name.endswith(".__init__"):
        name = name[: -len(".__init__")]
    mods[name] = f

def resolve(name):
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None

edges, inner = {m: set() for m in mods}, {}
for m, f in mods.items():
    tree = ast.parse(f.read_text())
    def targets(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}".strip(".")
        return [f"{base}.{a.name}" for a in node.names] + [base]
    top = set()
    for node in tree.body:  # module level, including under `if TYPE_CHECKING:`? no: those never run
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not isinstance(n, ast.ClassDef):
                continue
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                top |= {t for t in targets(n) if t.startswith("llmc")}
            stack.extend(ast.iter_child_nodes(n))
    inner[m] = sum(isinstance(n, (ast.Import, ast.ImportFrom)) for fn in ast.walk(tree)
                   if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(fn))
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

# Tarjan SCC
index, low, on, stack, out, i = {}, {}, set(), [], [], [0]
sys.setrecursionlimit(10000)
def strong(v):
    index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in index:
            strong(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1:
            out.append(sorted(comp))
for v in mods:
    if v not in index:
        strong(v)
print(f"{len(mods)} modules; cycles of module-level imports: {len(out)}")
for c in out:
    print("  cycle:", ", ".join(c))
print(f"imports inside functions: {sum(inner.values())}")
for m in args:
    print(f"  {m}: {inner.get(m)}")
