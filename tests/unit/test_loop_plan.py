"""The layer loop's decision (llmc.quant.loop_plan): made by one pure function from stated facts, obeyed by the
stream as given, and made again only when a fact moved materially since the plan (and said so)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import llmc.quant.stream as stream
from llmc.model.source import ModelSource
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.loop_plan import RESIDENT_RESUME_EVERY_S, LoopFacts, decide_layer_loop, redecided
from llmc.quant.spec import Scheme, TensorSpec

GB = 10**9
FP8_STATIC = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))
GPTQ = Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq")
SQ_STATIC = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), algorithm="smoothquant")
WEIGHT_ONLY = Scheme(TensorSpec("int4", "group", group_size=32))
# 64 windows x 512 tokens x 4096 wide x 2 bytes: 0.27 GB a copy of the activations
FACTS = LoopFacts(calibrates=True, windows=64, seq_len=512, masked=False, batch_size=4, spill_mode="auto",
                  hidden=4096, intermediate=14336, heads=32, elem=2, moe=False, device="cpu", host_available=64 * GB,
                  device_free=None, shared_stats=True, shared_covered=False)


def decide(scheme: Scheme, **facts):
    return decide_layer_loop(AlgorithmSteps.of(scheme), replace(FACTS, calibrates=scheme.needs_calibration, **facts))


def test_where_the_activations_live_follows_the_memory_the_facts_state() -> None:
    assert decide(FP8_STATIC).activations == "memory"
    spilled = decide(FP8_STATIC, host_available=1 * GB)  # two copies (0.54 GB) > a quarter of 1 GB
    assert spilled.activations == "disk" and spilled.resume_every_s == 0.0
    assert decide(FP8_STATIC, spill_mode="always").activations == "disk"
    on_gpu = decide(FP8_STATIC, device="cuda:0", device_free=80 * GB)
    assert on_gpu.activations == "device" and on_gpu.resume_every_s == RESIDENT_RESUME_EVERY_S
    assert decide(FP8_STATIC, device="cuda:0", device_free=80 * GB, resume_every_s=5.0).resume_every_s == 5.0
    assert decide(FP8_STATIC, device="cuda:0", device_free=1 * GB).activations == "memory"
    data_free = decide(WEIGHT_ONLY)
    assert (data_free.flow, data_free.activations, data_free.runs_forwards) == ("data-free", "none", False)


def test_gptq_runs_in_one_forward_only_where_every_window_fits_and_nothing_is_masked() -> None:
    one = decide(GPTQ)
    assert one.flow == "true-sequential" and one.one_forward and one.traces_structure
    staged = decide(GPTQ, host_available=8 * GB)  # the whole batch's forward needs more than a quarter of 8 GB
    assert staged.flow == "true-sequential" and not staged.one_forward and "staged" in staged.describe()
    assert not decide(GPTQ, masked=True).one_forward
    assert decide(GPTQ, moe=True, host_available=8 * GB).flow == "sequential"  # MoE staged: the two-forward order


def test_statistics_are_recorded_for_later_schemes_and_reused_when_they_cover_the_scheme() -> None:
    first = decide(FP8_STATIC)
    assert (first.shared, first.flow) == ("record", "sequential")
    later = decide(FP8_STATIC, shared_covered=True)
    assert (later.shared, later.flow, later.activations) == ("reuse", "shared-statistics", "none")
    # SmoothQuant with static activation scales observes again after its transform: it records but cannot skip its
    # own forward
    assert decide(SQ_STATIC, shared_covered=True).shared == "record"
    assert decide(FP8_STATIC, moe=True, shared_covered=True).shared == "none"  # routed tokens are not recorded
    assert decide(GPTQ, shared_covered=True).shared == "none"  # Hessians depend on the scheme


def test_the_plan_stands_unless_a_fact_moved_materially_and_then_the_change_is_named() -> None:
    pipe = AlgorithmSteps.of(FP8_STATIC)
    planned = decide_layer_loop(pipe, FACTS)
    assert redecided(planned, replace(FACTS, host_available=int(60.5 * GB)), pipe) == (planned, [])
    again, changes = redecided(planned, replace(FACTS, host_available=1 * GB), pipe)
    assert again.activations == "disk" and changes and "host available 64.0 GB at plan time, 1.0 GB now" in changes[0]
    # a moved fact that leaves the decision as it was changes nothing
    assert redecided(planned, replace(FACTS, host_available=32 * GB), pipe) == (planned, [])


def test_the_stream_obeys_the_decision_it_is_given(tiny_model: Path, tmp_path: Path, capsys) -> None:
    """A decision to spill, made where memory is plenty, is executed as given (the facts the stream sees now are
    those it was made on); the same decision made on another machine's memory is made again, and the stream says
    why."""
    calibration = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    cal = stream.Calibration(calibration, batch_size=2)
    source = ModelSource(tiny_model, "t", "t")
    pipe = AlgorithmSteps.of(FP8_STATIC)
    # the facts exactly as this stream sees them, then a decision to spill (as spill_activations: always would make)
    seen = stream.quantize_model(source, FP8_STATIC, tmp_path / "auto", cal).loop
    assert seen.activations == "memory"
    forced = decide_layer_loop(pipe, replace(seen.facts, spill_mode="always"))
    forced = replace(forced, facts=seen.facts)  # as if planned on these very facts
    out = stream.quantize_model(source, FP8_STATIC, tmp_path / "forced", cal, stream.StreamOptions(loop=forced))
    assert out.loop == forced and out.loop.activations == "disk"
    assert "decided again" not in capsys.readouterr().err
    elsewhere = replace(forced, facts=replace(seen.facts, host_available=(seen.facts.host_available or GB) * 4))
    out = stream.quantize_model(source, FP8_STATIC, tmp_path / "elsewhere", cal, stream.StreamOptions(loop=elsewhere))
    assert out.loop.activations == "memory" and "decided again" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", [FP8_STATIC, GPTQ])
def test_quantized_json_records_the_decision_the_loop_obeyed(tiny_model: Path, tmp_path: Path, scheme) -> None:
    import json

    calibration = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    out = stream.quantize_model(ModelSource(tiny_model, "t", "t"), scheme, tmp_path / "q",
                                stream.Calibration(calibration, batch_size=2))
    assert json.loads((tmp_path / "q" / "quantized.json").read_text())["layer_loop"] == out.loop.as_dict()


def test_llmc_plan_json_prints_the_decision_the_build_then_executes(tiny_model: Path, tmp_path: Path) -> None:
    """`llmc plan --json`: the quantize row's decision (here: spill_activations always, so the activations live on
    disk and every layer is a resume point); the build's stage record carries the same decision."""
    import json

    from click.testing import CliRunner

    from llmc.build import build_until
    from llmc.cli import main
    from llmc.pipeline.ids import Kind
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store
    from tests.unit.build_helpers import every_stage_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(every_stage_recipe(tiny_model, tmp_path / "registry"))
    printed = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--json", "--cache-dir", str(tmp_path / "c")])
    assert printed.exit_code == 0, printed.output
    rows = json.loads(printed.output[printed.output.index("{"):])["estimates"]["stages"]
    planned = next(r["decision"] for r in rows if r["stage"].startswith("quantize"))
    assert planned["activations"] == "disk" and planned["resume_every_s"] == 0.0 and planned["flow"] == "sequential"
    result = build_until(load_recipe(recipe), Store(tmp_path / "c"), Kind.QUANTIZE)
    assert [s.decision for s in result.stages if s.name.startswith("quantize")] == [planned]


def test_the_resume_interval_is_the_recipes_to_set(tiny_model: Path, tmp_path: Path) -> None:
    """`calibration.resume_every_s` reaches the plan's decision (and so the stream), changes no stage key, and is
    dropped from the recipe's dump when unset (earlier build ids stay)."""
    import yaml

    from llmc.data.stages import calibration_config
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe
    from tests.unit.build_helpers import every_stage_recipe

    def recipe(**calibration):
        r = yaml.safe_load(every_stage_recipe(tiny_model, tmp_path / "registry"))
        r["calibration"].update(spill_activations="auto", **calibration)
        return parse_recipe(yaml.safe_dump(r))

    def decision(r):
        return next(row.decision for row in make_plan(r, tiny_model).rows if row.decision is not None)

    assert decision(recipe()).resume_every_s == 0.0  # in memory on the CPU: every layer
    assert decision(recipe(resume_every_s=120)).resume_every_s == 120.0
    assert "resume_every_s" not in recipe().model_dump(mode="json")["calibration"]

    class Tokens:  # what calibration_config reads of the windows (the legacy Brown case does not apply here)
        row_ids, texts, bos_decision = [], [], None

    assert calibration_config(recipe(resume_every_s=120).calibration, Tokens) == \
        calibration_config(recipe().calibration, Tokens)


def test_resume_every_sets_the_interval_and_the_plan_says_what_a_kill_loses(tiny_model: Path, tmp_path: Path) -> None:
    """`--resume-every` is `calibration.resume_every_s` on the command line; the quantize row says the most a kill
    loses: the layer running without an interval, the interval plus that layer with one (never more than the loop)."""
    import json
    import re

    import yaml
    from click.testing import CliRunner

    from llmc.cli import main
    from tests.unit.build_helpers import every_stage_recipe

    r = yaml.safe_load(every_stage_recipe(tiny_model, tmp_path / "registry"))
    r["calibration"]["spill_activations"] = "never"  # spilled inputs make every layer a resume point
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(r))
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]

    def quantize_row(*extra: str) -> dict:
        printed = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--json", "--cache-dir",
                                            str(tmp_path / "c"), *extra])
        assert printed.exit_code == 0, printed.output
        rows = json.loads(printed.output[printed.output.index("{"):])["estimates"]["stages"]
        return next(row for row in rows if row["stage"].startswith("quantize"))

    def lost(row: dict) -> float:
        return float(re.search(r"a kill loses at most ~([0-9.]+) s of quantization", row["why"]).group(1))

    every_layer, timed = quantize_row(), quantize_row("--resume-every", "0.5")
    assert every_layer["decision"]["resume_every_s"] == 0.0 and timed["decision"]["resume_every_s"] == 0.5
    assert "(the layer running;" in every_layer["why"] and "(the interval plus the layer running;" in timed["why"]
    per_layer = timed["layer_seconds"]
    assert lost(every_layer) == pytest.approx(every_layer["layer_seconds"], abs=0.051)
    assert lost(timed) == pytest.approx(min(0.5 + per_layer, per_layer * layers), abs=0.051)
    bad = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--resume-every", "-1"])
    assert bad.exit_code != 0 and "--resume-every" in bad.output
