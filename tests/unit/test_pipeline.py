"""The pipeline as stage objects: one list walked by `llmc plan` (costs) and `llmc build` (runs), one runner for the
cache protocol, data flows chosen by the scheme (llmc.pipeline, llmc.quant.flows)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmc.pipeline import ranks
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.runner import Runner
from llmc.pipeline.stages import stages
from llmc.planning.plan import make_plan
from llmc.quant.flows import FLOWS, FlowNeeds, flow_for
from llmc.recipe.load import parse_recipe
from llmc.storage.store import CorruptOutput, Store

REPO = Path(__file__).resolve().parents[2]


def _recipe(model: str = "/nonexistent") -> str:
    return yaml.safe_dump({
        "name": "two-variants",
        "model": {"source": model},
        "variants": [
            {"name": "fp8", "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                                             "activations": {"format": "fp8_e4m3", "strategy": "tensor"}}},
            {"name": "w4", "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 32},
                                            "algorithm": "gptq"}},
        ],
        "calibration": {"samples": 4, "seq_len": 32},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}, {"runtime": "tensorrt-llm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 32, "windows": 2},
    })


def test_one_stage_list_in_pipeline_order_up_to_the_last_asked() -> None:
    recipe = parse_recipe(_recipe())
    schemes = make_plan(recipe).schemes
    walk = stages(recipe, schemes)
    assert [str(s.id) for s in walk] == [
        "calibrate", "quantize fp8", "quantize w4", "export fp8/vllm-sm90-tp1", "export fp8/tensorrt-llm-sm90-tp1",
        "export w4/vllm-sm90-tp1", "export w4/tensorrt-llm-sm90-tp1", "eval", "tasks", "gate", "publish"]
    assert [s.id.kind for s in stages(recipe, schemes, Kind.EXPORT)][-1] is Kind.EXPORT
    assert {s.id.kind for s in stages(recipe, schemes, Kind.QUANTIZE)} == {Kind.CALIBRATE, Kind.QUANTIZE}
    # every export names the quantize stage it reads (a typed dependency, not a label)
    exports = [s for s in walk if s.id.kind is Kind.EXPORT]
    assert {e.quantize.id for e in exports} == {StageId(Kind.QUANTIZE, ("fp8",)), StageId(Kind.QUANTIZE, ("w4",))}


def test_every_row_of_the_plan_is_a_stage_of_the_list(tiny_model_session: Path) -> None:
    """`llmc plan` sums what the stages' costs return, nothing else: each row belongs to one stage of the list the
    build walks, and the quantize and export stages each return exactly one."""
    recipe = parse_recipe(_recipe(str(tiny_model_session)))
    plan = make_plan(recipe, tiny_model_session)
    walk = stages(recipe, plan.schemes)
    owners = [[s for s in walk if s.id.covers(row.id)] for row in plan.rows]
    assert all(len(o) == 1 for o in owners), [str(r.id) for r in plan.rows]
    for stage in walk:
        if stage.id.kind in (Kind.QUANTIZE, Kind.EXPORT):
            assert [str(r.id) for r in plan.rows if stage.id.covers(r.id)] == [str(stage.id)]
    assert [s["stage"] for s in plan.as_dict()["estimates"]["stages"]] == [str(r.id) for r in plan.rows]


def test_the_runner_produces_once_records_and_checks_inputs(tmp_path: Path) -> None:
    store, records = Store(tmp_path / "cache"), []
    runner = Runner(store, records)
    made = []

    def produce(out: Path) -> None:
        made.append(out)
        (out / "a.txt").write_text("a")

    first = runner.run(StageId(Kind.CALIBRATE), "k1", produce, announce="calibrate")
    again = runner.run(StageId(Kind.CALIBRATE), "k1", produce, announce="calibrate")
    assert first == again and len(made) == 1 and (first / "a.txt").read_text() == "a"
    assert [(r.name, r.key, r.cached) for r in records] == [("calibrate", "k1", False), ("calibrate", "k1", True)]
    assert runner.is_done(StageId(Kind.CALIBRATE), "k1") and not runner.is_done(StageId(Kind.CALIBRATE), "k2")

    # a cached output a stage says no longer stands is discarded and produced again
    redone = runner.run(StageId(Kind.CALIBRATE), "k1", produce, announce="calibrate", outdated=lambda d: ["stale"])
    assert len(made) == 2 and (redone / "a.txt").is_file()

    # an input changed since it was recorded stops the stage before it writes anything
    (first / "a.txt").write_text("b")
    with pytest.raises(CorruptOutput):
        runner.run(StageId(Kind.EXPORT, ("t",)), "k3", produce, announce="export", inputs=[first])
    assert len(made) == 2 and not runner.is_done(StageId(Kind.EXPORT, ("t",)), "k3")


def test_one_process_runs_every_stage_in_order() -> None:
    class Stage:
        def __init__(self, name: str, share: ranks.Share) -> None:
            self.name, self.share = name, share

    walk = [Stage("c", ranks.Share.MAIN_FIRST), Stage("q", ranks.Share.ALL), Stage("x", ranks.Share.MAIN),
            Stage("e", ranks.Share.HELPED), Stage("g", ranks.Share.MAIN)]
    ran: list[str] = []
    ranks.run_stages(walk, lambda s: ran.append(s.name))
    assert ran == ["c", "q", "x", "e", "g"]


@pytest.mark.parametrize("needs, flow", [
    (FlowNeeds(False, False, False, False, False), "data-free"),
    (FlowNeeds(True, True, False, False, False), "shared-statistics"),
    (FlowNeeds(True, False, True, False, False), "true-sequential"),
    (FlowNeeds(True, False, True, True, True), "true-sequential"),  # MoE: every window in one forward
    (FlowNeeds(True, False, True, True, False), "sequential"),  # MoE, staged passes: two-forward order
    (FlowNeeds(True, False, False, True, False), "sequential"),
])
def test_the_data_flow_follows_the_scheme_and_what_fits(needs: FlowNeeds, flow: str) -> None:
    assert flow_for(needs).name == flow
    assert list(FLOWS) == ["data-free", "shared-statistics", "true-sequential", "sequential"]


def test_the_store_is_looked_up_by_the_runner_only() -> None:
    """The cache protocol has one home: no stage, planner, engine or model source looks the store up itself (the
    outputs made before the stage walk go through `Store.materialized`)."""
    found = subprocess.run(["git", "grep", "-l", r"\.lookup(", "--", "llmc"], cwd=REPO, capture_output=True,
                           text=True).stdout.split()
    if not found and not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert sorted(found) == ["llmc/pipeline/runner.py", "llmc/storage/store.py"]


def test_the_planner_and_the_stream_name_no_algorithm_or_format() -> None:
    """Every module of the planner and the pipeline, the stream and the build: what a format or an algorithm costs
    or needs, it states itself (no quoted name outside comments)."""
    names = ("gptq", "awq", "smoothquant", "compressed-tensors", "modelopt-hf", "gguf", "nvfp4")
    modules = sorted(str(p.relative_to(REPO)) for folder in ("llmc/planning", "llmc/pipeline")
                     for p in (REPO / folder).glob("*.py"))
    assert "llmc/planning/plan.py" in modules and "llmc/pipeline/quantize.py" in modules
    for module in modules + ["llmc/quant/stream.py", "llmc/build.py"]:
        code = [line.split("#")[0] for line in (REPO / module).read_text().splitlines()]
        quoted = [line for line in code if any(f'"{n}' in line.lower() or f"'{n}" in line.lower() for n in names)]
        assert not quoted, (module, quoted)


@pytest.mark.slow  # a fresh interpreter per module: ~30 s on an idle 2-core machine
def test_no_import_cycle_through_the_pipeline() -> None:
    """Each pipeline module imports on its own, in a fresh interpreter (a cycle fails one of them)."""
    modules = ["llmc.pipeline.stages", "llmc.pipeline.runner", "llmc.pipeline.evaluate", "llmc.build", "llmc.planning.plan",
               "llmc.quant.flows", "llmc.quant.stream", "llmc.model.skeleton", "llmc.runtimes.catalog",
               "llmc.quant.algorithms.catalog", "llmc.recipe.load"]
    for m in modules:
        done = subprocess.run([sys.executable, "-c", f"import {m}"], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, (m, done.stderr[-2000:])


def test_variants_of_one_scheme_name_plan_their_own_export_files(tiny_model_session: Path) -> None:
    """Two variants of the same scheme (W4A16-INT) by different algorithms write different weights: each export
    counts its own files; two targets of one variant in the same format share them."""
    r = yaml.safe_load(_recipe(str(tiny_model_session)))
    w4 = {"weights": {"format": "int4", "strategy": "group", "group_size": 32}}
    r["variants"] = [{"name": "rtn", "quantization": w4}, {"name": "gptq", "quantization": {**w4, "algorithm": "gptq"}}]
    r["targets"] = [{"runtime": "vllm", "gpu_arch": "sm90"}, {"runtime": "sglang", "gpu_arch": "sm90"}]
    plan = make_plan(parse_recipe(yaml.safe_dump(r)), tiny_model_session)
    disk = {str(row.id): row.disk_bytes for row in plan.rows if row.id.kind is Kind.EXPORT}
    assert disk["export rtn/vllm-sm90-tp1"] > 0 and disk["export gptq/vllm-sm90-tp1"] == disk["export rtn/vllm-sm90-tp1"]
    assert disk["export rtn/sglang-sm90-tp1"] == 0 and disk["export gptq/sglang-sm90-tp1"] == 0
