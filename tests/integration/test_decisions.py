"""Decide once: the layer loop a build executes is the one its plan printed and costed. For every shipped SmolLM2 and
Gemma-3 recipe, at small calibration settings, the quantize stages' decisions recorded in the build's result (and in
report.json) equal the plan's rows' decisions (`llmc plan --json`: each stage's "decision")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmc.build import build_until
from llmc.pipeline.ids import Kind
from llmc.recipe.load import load_recipe
from llmc.storage.store import Store

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml") if p.name.startswith(("smollm2-", "gemma3-")))
# the default run: statistics recorded then used by a later variant, data-free variants, GPTQ in one forward
DEFAULT = {"smollm2-fp8.yaml", "smollm2-variants.yaml", "smollm2-w4a16-gptqmodel.yaml"}
SMALL = ["calibration.samples=2", "calibration.seq_len=64", "gates.allow_unevaluated=true"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("decisions") / "cache")  # one unpacked demo source for every recipe


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in RECIPES])
def test_the_build_executes_the_layer_loop_its_plan_decided(store: Store, name: str) -> None:
    # statistics an earlier recipe's build recorded on the same data are a fact `llmc plan` cannot see (the shared
    # folder is keyed by the calibration tokens): the stream would reuse them and say so (test_loop_plan)
    shutil.rmtree(store.root / "shared-stats", ignore_errors=True)
    # so is a quantized form an earlier recipe's build left under the same key (gemma3-int8-runtimes' W8A8-INT8 for
    # gemma3-variants' second variant): found cached, that stage does not run, and its record carries the decision
    # its output was made with, not this plan's; every quantize stage here runs
    shutil.rmtree(store.root / "stages" / "quantize", ignore_errors=True)
    recipe = load_recipe(REPO / "recipes" / name, SMALL)
    result = build_until(recipe, store, Kind.QUANTIZE)
    rows = [r for r in result.plan.rows if r.id.kind is Kind.QUANTIZE]
    planned = [r.decision.as_dict() for r in rows]
    # a search's measuring pass is costed inside the quantize row it precedes ("the search's measurement first") and
    # recorded as a stage of its own, 'quantize:<variant>:sensitivity', without a layer-loop decision
    row_names = {r.id.record_name for r in rows}
    quantize_records = [s for s in result.stages if s.name.startswith("quantize:")]
    executed = [s.decision for s in quantize_records if s.name in row_names]
    assert all(s.name.endswith(":sensitivity") for s in quantize_records if s.name not in row_names)
    assert planned and all(planned), result.plan.render()
    assert executed == planned
    row = result.plan.as_dict()["estimates"]["stages"][0]
    assert row["stage"].startswith("quantize") and row["decision"] == planned[0]  # what `llmc plan --json` prints
