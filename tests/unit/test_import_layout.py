"""Imports inside functions say why they are not at module level (issue 32), read from the source by
scripts/import_cycles.py: no llmc module is imported, so this is fast."""
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


def test_no_module_of_the_cleaned_folders_is_in_an_import_cycle() -> None:
    checker = _checker()
    edges, _ = checker.import_graph(checker.modules(REPO))
    cleaned = [m for cycle in checker.cycles(edges) for m in cycle
               if any(m == p or m.startswith(p + ".") for p in CLEANED)]
    assert cleaned == []


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
