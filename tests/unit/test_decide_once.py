"""Issue 44's structural checks ("Decide once"), read from the source with `ast`: every choice the plan prints and the
build executes is made in one place, so nothing outside a `decide` function can make it a second time.

- the four deciders (`should_spill`, `stays_on_device`, `flow_for`, `choose_streamed`) are called only from functions
  whose name starts with `decide`;
- `quantize_cost` takes no `bool` parameter (the decision is one typed `LayerLoopPlan`, not seven flags);
- no stage's `cost` writes into the plan-in-progress (`Costing`) but its rows: stages do not talk through scratch
  fields;
- `quantize_model` is at most 80 lines (it executes the plan; the choices live in `llmc.quant.loop_plan`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmc

ROOT = Path(llmc.__file__).parent
DECIDERS = {"should_spill", "stays_on_device", "flow_for", "choose_streamed"}


def _modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def calls_outside_decide(tree: ast.Module, names: set[str]) -> list[tuple[str, int, str]]:
    """(callee, line, enclosing function) of each call to one of `names` made outside a function named decide*."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, enclosing: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and _callee(child) in names and not enclosing.startswith("decide"):
                found.append((_callee(child), child.lineno, enclosing or "<module>"))
            visit(child, enclosing)

    visit(tree, "")
    return found


def test_the_four_deciders_are_called_only_from_decide() -> None:
    offenders = [f"{path.relative_to(ROOT.parent)}:{line} {name}() in {where}"
                 for path, tree in _modules().items() for name, line, where in calls_outside_decide(tree, DECIDERS)]
    assert offenders == []


def test_the_check_sees_a_decider_called_outside_decide() -> None:
    tree = ast.parse("def decide_x():\n    flow_for(1)\n\ndef run():\n    choose_streamed(1, 2)\n"
                     "    def decide_inner():\n        should_spill(1)\n")
    assert calls_outside_decide(tree, DECIDERS) == [("choose_streamed", 5, "run")]


def _function(name: str, path: Path) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_quantize_cost_takes_no_boolean_flag() -> None:
    fn = _function("quantize_cost", ROOT / "pipeline" / "quantize.py")
    params = fn.args.args + fn.args.kwonlyargs
    flags = [a.arg for a in params if a.annotation is not None and "bool" in ast.unparse(a.annotation)]
    assert flags == []


def test_quantize_model_executes_the_plan_in_at_most_80_lines() -> None:
    fn = _function("quantize_model", ROOT / "quant" / "stream.py")
    assert fn.end_lineno - fn.lineno + 1 <= 80


def costing_writes(tree: ast.Module) -> list[tuple[str, int]]:
    """Attributes a `cost(self, c)` method assigns on its Costing `c` (appending to `c.rows` is the output)."""
    writes = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "cost"):
        names = [a.arg for a in fn.args.args]
        if len(names) < 2:
            continue
        costing = names[1]
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                while isinstance(t, (ast.Subscript, ast.Attribute)) and not (
                        isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)):
                    t = t.value
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == costing:
                    writes.append((t.attr, node.lineno))
    return writes


def test_no_stage_cost_writes_into_the_plan_in_progress() -> None:
    offenders = [f"{path.name}:{line} c.{attr}" for path in sorted((ROOT / "pipeline").glob("*.py"))
                 for attr, line in costing_writes(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_check_sees_a_scratch_write() -> None:
    tree = ast.parse("class S:\n    def cost(self, c):\n        c.rows.append(1)\n        c.seen = 2\n"
                     "        c.bytes_of['x'] = 3\n")
    assert costing_writes(tree) == [("seen", 4), ("bytes_of", 5)]
