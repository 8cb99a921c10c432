"""No import circle among llmc's modules, counting `if TYPE_CHECKING:` imports (issue 44), every import keeps to the
layers of docs/architecture.md, and imports inside functions say why they are not at module level (issue 32); read
from the source by scripts/import_cycles.py: no llmc module is imported, so this is fast."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the folders whose in-function imports were moved to module level or explained; the others are being cleaned
CLEANED = ("llmc.engines", "llmc.eval", "llmc.publish", "llmc.hook", "llmc.data", "llmc.model", "llmc.storage",
           "llmc.inputs", "llmc.telemetry", "llmc.calibration", "llmc.cli", "llmc.result", "llmc.errors",
           "llmc.distributed")


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", REPO / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_in_function_import_of_the_cleaned_folders_says_why() -> None:
    assert _checker().unexplained(REPO, CLEANED) == {}


def test_no_llmc_module_is_in_an_import_cycle_type_level_imports_included() -> None:
    checker = _checker()
    edges, _ = checker.import_graph(checker.modules(REPO))
    assert len(edges) > 100 and checker.cycles(edges) == []


def test_every_import_keeps_to_the_layers() -> None:
    """docs/architecture.md, "Layers": a module imports from its own layer or the ones below, type-level imports
    included; `llmc.result` names no planner, gate or publisher type."""
    checker = _checker()
    mods = checker.modules(REPO)
    edges, _ = checker.import_graph(mods)
    assert checker.layer_violations(mods, edges) == []
    assert not {t for t in edges["llmc.result"] if t.startswith(("llmc.planning", "llmc.eval", "llmc.publish"))}


def test_a_circle_closed_by_a_type_level_import_is_counted(tmp_path: Path) -> None:
    """An import under `if TYPE_CHECKING:` never runs, but it names a module whose types this one needs: a circle
    through it is a layering circle. Imports inside functions stay out of the enforced graph."""
    checker = _checker()
    pkg = tmp_path / "llmc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmc.high import H\n")
    (pkg / "high.py").write_text("from llmc.low import L\n")
    (pkg / "lazy.py").write_text("def f():\n    from llmc.high import H\n")
    edges, _ = checker.import_graph(checker.modules(tmp_path))
    assert checker.cycles(edges) == [["llmc.high", "llmc.low"]] and "llmc.high" not in edges["llmc.lazy"]
    everything, _ = checker.import_graph(checker.modules(tmp_path), in_functions=True)
    assert "llmc.high" in everything["llmc.lazy"]


def test_a_module_takes_the_layer_of_its_longest_prefix() -> None:
    """`llmc.planning.plan` walks the stages (top layer); the rest of `llmc.planning` is the cost model's primitives,
    which the stages import (bottom layer)."""
    checker = _checker()
    top, bottom = 0, len(checker.LAYERS) - 1
    assert checker.layer("llmc.planning.plan") == top and checker.layer("llmc.planning.machine") == bottom
    assert checker.layer("llmc.pipeline.ids") == bottom and checker.layer("llmc.pipeline.stages") == 1
    assert checker.layer("llmc.result") < checker.layer("llmc.recipe.schema") < checker.layer("llmc.errors")


def test_a_package_that_imports_its_plugins_is_a_cycle_and_a_catalog_is_not(tmp_path: Path) -> None:
    """The layout of llmc.runtimes and llmc.quant.algorithms: a plugin imports its package's registry, so an
    `__init__` importing the plugins is a cycle (importing a.b imports a); a catalog module beside them is not."""
    checker = _checker()
    pkg = tmp_path / "llmc" / "plugins"
    pkg.mkdir(parents=True)
    (pkg / "registry.py").write_text("REGISTRY = {}\n")
    (pkg / "one.py").write_text("from llmc.plugins.registry import REGISTRY\n")
    (pkg / "__init__.py").write_text("from llmc.plugins import one\n")
    edges, _ = checker.import_graph(checker.modules(tmp_path))
    assert checker.cycles(edges) == [["llmc.plugins", "llmc.plugins.one"]]

    (pkg / "__init__.py").write_text('"""Imports nothing."""\n')
    (pkg / "catalog.py").write_text("from llmc.plugins import one\nfrom llmc.plugins.registry import REGISTRY\n")
    edges, _ = checker.import_graph(checker.modules(tmp_path))
    assert checker.cycles(edges) == [] and "llmc.plugins.one" in edges["llmc.plugins.catalog"]


def test_the_check_counts_an_unexplained_import_and_accepts_a_reason() -> None:
    checker = _checker()
    source = ("def a():\n"
              "    import json\n"
              "def b():\n"
              "    # lazy: heavy\n"
              "    import torch\n"
              "    from torch import nn\n"
              "def c():\n"
              "    import onnx  # lazy: optional\n"
              "    import yaml\n")
    found = checker.in_function_imports(ast.parse(source), source)
    assert found == [(2, False), (5, True), (6, True), (8, True), (9, False)]
