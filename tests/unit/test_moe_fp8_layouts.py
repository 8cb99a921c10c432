"""The W8A8-FP8 layouts vLLM's and SGLang's fused Mixture-of-Experts FP8 methods load, as llmc plans them (issue 45;
llmc.runtimes.vllm, `_VLLM_MOE_FP8_LAYOUTS` and `_SGLANG_MOE_FP8_LAYOUTS`, checked by
llmc.runtimes.registry._check_moe_fp8_layout).

Both were read in the runtime's compressed-tensors loader and take the same three layouts: per-tensor weights with
per-tensor activations (static or dynamic) or per-channel weights with dynamic per-token activations; any other pair
must be block-wise, so per-channel weights with static per-tensor activations (llmc's smollm2-fp8 layout) fail at load.
- vLLM: compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py, CompressedTensorsW8A8Fp8MoEMethod.__init__
  @045d7575; block-wise FP8 (W8A8-FP8-BLOCK) stays accepted.
- SGLang: schemes/compressed_tensors_w8a8_fp8_moe.py, CompressedTensorsW8A8Fp8MoE.__init__ @02d5e1b5; it keeps one
  static input scale per MoE layer and operand and one w13 weight scale per expert, which llmc's canonical form
  already holds for every target (llmc.quant.runtime_scales).
Dense Linears take every layout in both, so the rule stops at models with routed experts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from llmc.errors import IncompatibleTargetError
from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.quant.spec import Scheme, TensorSpec
from tests.unit.families import make_tiny
from tests.unit.test_moe import _quantize

STATIC, DYNAMIC = False, True
ACCEPTED = [("tensor", "tensor", STATIC), ("tensor", "tensor", DYNAMIC), ("channel", "token", DYNAMIC)]
REFUSED = [("channel", "tensor", STATIC), ("channel", "tensor", DYNAMIC), ("tensor", "token", DYNAMIC)]
# runtime -> (the loader file its refusal names, the repository it was read in)
READ_IN = {"vllm": ("compressed_tensors_moe_w8a8_fp8.py", "vllm-project/vllm"),
           "sglang": ("compressed_tensors_w8a8_fp8_moe.py", "sgl-project/sglang")}
RUNTIMES = sorted(READ_IN)


def _id(layout: tuple[str, str, bool]) -> str:
    weights, acts, dynamic = layout
    return f"{weights}-{acts}-{'dynamic' if dynamic else 'static'}"


def _recipe(folder: Path, layout: tuple[str, str, bool], runtime: str):
    from llmc.recipe.load import parse_recipe

    weights, acts, dynamic = layout
    return parse_recipe(yaml.safe_dump({
        "name": "t", "model": {"source": str(folder)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": weights},
                         "activations": {"format": "fp8_e4m3", "strategy": acts, "dynamic": dynamic}},
        "targets": [{"runtime": runtime, "gpu_arch": "sm90"}]}))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("moe-fp8") / "model")


@pytest.mark.parametrize("layout", REFUSED, ids=_id)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_plan_refuses_fp8_moe_layouts_the_runtime_does_not_load(runtime: str, layout, tiny_moe: Path) -> None:
    """exit 3, naming the runtime's loader file and the layouts it loads, in recipe terms."""
    from llmc.planning.plan import make_plan

    with pytest.raises(IncompatibleTargetError) as refused:
        make_plan(_recipe(tiny_moe, layout, runtime), tiny_moe, check_time=False)
    e = refused.value
    loader, repo = READ_IN[runtime]
    assert e.exit_code == 3
    assert loader in e.message and repo in e.message
    assert f"{runtime}'s fused Mixture-of-Experts" in e.message
    assert f"{layout[0]} weights" in e.message and "qwen3_moe" in e.message
    assert "strategy: token, dynamic: true" in e.fix and "weights: {format: fp8_e4m3, strategy: tensor}" in e.fix


@pytest.mark.parametrize("layout", ACCEPTED, ids=_id)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_plan_accepts_the_fp8_moe_layouts_the_runtime_loads(runtime: str, layout, tiny_moe: Path) -> None:
    from llmc.planning.plan import make_plan

    plan = make_plan(_recipe(tiny_moe, layout, runtime), tiny_moe, check_time=False)
    assert [t["label"] for t in plan.targets] == [f"{runtime}-sm90-tp1"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_dense_model_keeps_every_fp8_layout(runtime: str, tmp_path: Path) -> None:
    """Both runtimes' dense FP8 schemes take per-channel weights with static per-tensor activations (smollm2-fp8's
    layout): the MoE rule does not reach a model without routed experts."""
    from llmc.planning.plan import make_plan

    llama = make_tiny("llama", tmp_path / "llama")
    for layout in REFUSED + ACCEPTED:
        plan = make_plan(_recipe(llama, layout, runtime), llama, check_time=False)
        assert [t["label"] for t in plan.targets] == [f"{runtime}-sm90-tp1"], layout


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_cli_plan_exits_3_with_the_runtimes_reason(runtime: str, tiny_moe: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmc.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t", "model": {"source": str(tiny_moe)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
        "targets": [{"runtime": runtime, "gpu_arch": "sm90"}]}))
    result = CliRunner().invoke(main, ["plan", str(path), "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 3, result.output
    assert READ_IN[runtime][0] in result.output and "Traceback" not in result.output


def test_block_wise_fp8_stays_accepted_for_a_vllm_moe_target(tmp_path: Path) -> None:
    """vLLM's fused MoE takes block-wise weights with dynamic activations (the `BLOCK` branch of the same method)."""
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    block = {"weights": {"format": "fp8_e4m3", "strategy": "block"},
             "activations": {"format": "fp8_e4m3", "strategy": "group", "group_size": 128, "dynamic": True}}
    # 1x128 activation groups need input dims that 128 divides: hidden 128, 8 heads x 16, expert width 128
    wide = make_tiny("qwen3_moe", tmp_path / "wide", hidden_size=128, num_attention_heads=8,
                      moe_intermediate_size=128)
    recipe = parse_recipe(yaml.safe_dump({
        "name": "t", "model": {"source": str(wide)}, "quantization": block,
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}]}))
    plan = make_plan(recipe, wide, check_time=False)
    assert [t["label"] for t in plan.targets] == ["vllm-sm90-tp1"]


def test_a_tiny_moe_artifact_for_sglang_holds_the_scales_sglang_computes_with(tiny_moe: Path, tmp_path: Path) -> None:
    """The layouts SGLang loads, quantized and exported: with static per-tensor activations every routed expert's
    input scale is its layer's one for its operand (the max, as SGLang's `.max()` keeps) and each expert's gate/up
    share one weight scale (SGLang requantizes w13 to the max); dynamic activations write no input scale, and
    per-channel weights keep one scale per row (SGLang requantizes only per-tensor weights)."""
    from safetensors.torch import load_file

    from llmc.planning.plan import make_plan

    expert = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(input_scale|weight_scale)$")
    for i, (weights, acts, dynamic) in enumerate(ACCEPTED):
        make_plan(_recipe(tiny_moe, (weights, acts, dynamic), "sglang"), tiny_moe, check_time=False)  # accepted
        scheme = Scheme(TensorSpec("fp8_e4m3", weights), TensorSpec("fp8_e4m3", acts, dynamic=dynamic),
                        ignore=("lm_head",))
        out = tmp_path / f"export-{i}"
        export_compressed_tensors(_quantize(tiny_moe, scheme, tmp_path / f"q-{i}"), out)
        t = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        inputs: dict[tuple[str, str], set[float]] = {}
        w13: dict[tuple[str, str], list[torch.Tensor]] = {}
        for k, v in t.items():
            m = expert.match(k)
            if m is None:
                continue
            if m[4] == "input_scale":
                inputs.setdefault((m[1], "w2" if m[3] == "down_proj" else "w13"), set()).add(v.item())
            elif m[3] != "down_proj":
                w13.setdefault((m[1], m[2]), []).append(v)
        if dynamic:
            assert inputs == {}
        else:
            assert len(inputs) == 4 and all(len(s) == 1 for s in inputs.values()), inputs  # 2 layers x (w13, w2)
        assert len(w13) == 2 * 4  # 2 layers x 4 experts, gate and up each
        for gate, up in w13.values():
            if weights == "tensor":
                assert torch.equal(gate, up)
            else:
                assert gate.numel() > 1 and not torch.equal(gate, up)
