"""vLLM's FP8 W8A8 rules for Mixture-of-Experts models as llmc plans them (issue 45; llmc.runtimes.vllm,
`_VLLM_MOE_FP8_LAYOUTS`).

Read in vLLM's compressed-tensors fused MoE (compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py,
CompressedTensorsW8A8Fp8MoEMethod.__init__ @045d7575): per-tensor weights with per-tensor activations (static or
dynamic) or per-channel weights with dynamic per-token activations; any other non-block layout fails at load. Dense
Linears (schemes/compressed_tensors_w8a8_fp8.py) take every layout, so the rule stops at models with routed experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmc.errors import IncompatibleTargetError
from tests.unit.families import make_tiny
from tests.unit.test_sglang_moe_fp8 import ACCEPTED, REFUSED, _recipe

BLOCK = {"weights": {"format": "fp8_e4m3", "strategy": "block"},
         "activations": {"format": "fp8_e4m3", "strategy": "group", "group_size": 128, "dynamic": True}}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("vllm-moe") / "model")


@pytest.mark.parametrize("layout", REFUSED)
def test_the_plan_refuses_fp8_moe_layouts_vllm_does_not_load(layout, tiny_moe: Path) -> None:
    """exit 3, naming vLLM's file and the layouts it loads, in recipe terms."""
    from llmc.planning.plan import make_plan

    with pytest.raises(IncompatibleTargetError) as refused:
        make_plan(_recipe(tiny_moe, layout, runtime="vllm"), tiny_moe, check_time=False)
    e = refused.value
    assert e.exit_code == 3
    assert "compressed_tensors_moe_w8a8_fp8.py" in e.message and "vllm-project/vllm" in e.message
    assert "vllm's fused Mixture-of-Experts" in e.message
    assert f"{layout[0]} weights" in e.message and "qwen3_moe" in e.message
    assert "strategy: token, dynamic: true" in e.fix and "weights: {format: fp8_e4m3, strategy: tensor}" in e.fix


@pytest.mark.parametrize("layout", ACCEPTED)
def test_the_plan_accepts_the_fp8_moe_layouts_vllm_loads(layout, tiny_moe: Path) -> None:
    from llmc.planning.plan import make_plan

    plan = make_plan(_recipe(tiny_moe, layout, runtime="vllm"), tiny_moe, check_time=False)
    assert [t["label"] for t in plan.targets] == ["vllm-sm90-tp1"]


def test_block_wise_fp8_stays_accepted_for_a_vllm_moe_target(tmp_path: Path) -> None:
    """vLLM's fused MoE takes block-wise weights with dynamic activations (the `BLOCK` branch of the same method)."""
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    # 1x128 activation groups need input dims that 128 divides: hidden 128, 8 heads x 16, expert width 128
    wide = make_tiny("qwen3_moe", tmp_path / "wide", hidden_size=128, num_attention_heads=8,
                      moe_intermediate_size=128)
    recipe = parse_recipe(yaml.safe_dump({
        "name": "t", "model": {"source": str(wide)}, "quantization": BLOCK,
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}]}))
    plan = make_plan(recipe, wide, check_time=False)
    assert [t["label"] for t in plan.targets] == ["vllm-sm90-tp1"]


def test_a_dense_model_keeps_every_fp8_layout_for_vllm(tmp_path: Path) -> None:
    """vLLM's dense FP8 scheme takes per-channel weights with static per-tensor activations (smollm2-fp8's layout):
    the MoE rule does not reach a model without routed experts."""
    from llmc.planning.plan import make_plan

    llama = make_tiny("llama", tmp_path / "llama")
    for layout in REFUSED + ACCEPTED:
        plan = make_plan(_recipe(llama, layout, runtime="vllm"), llama, check_time=False)
        assert [t["label"] for t in plan.targets] == ["vllm-sm90-tp1"]
