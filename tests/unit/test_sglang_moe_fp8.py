"""SGLang's FP8 W8A8 rules as llmc plans them (issue 45; llmc.runtimes.vllm, `_SGLANG_MOE_FP8_LAYOUTS`).

Read in SGLang's compressed-tensors loader: dense Linears take every W8A8-FP8 layout llmc writes; the fused-MoE FP8
method (schemes/compressed_tensors_w8a8_fp8_moe.py, CompressedTensorsW8A8Fp8MoE.__init__) takes per-tensor weights
with per-tensor activations (static or dynamic) or per-channel weights with dynamic per-token activations, and fails at
load on anything else that is not block-wise; it keeps one static input scale per MoE layer and operand and one w13
weight scale per expert, which llmc's canonical form already holds for every target (llmc.quant.runtime_scales)."""

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


def _recipe(folder: Path, layout: tuple[str, str, bool], runtime: str = "sglang"):
    from llmc.recipe.load import parse_recipe

    weights, acts, dynamic = layout
    return parse_recipe(yaml.safe_dump({
        "name": "t", "model": {"source": str(folder)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": weights},
                         "activations": {"format": "fp8_e4m3", "strategy": acts, "dynamic": dynamic}},
        "targets": [{"runtime": runtime, "gpu_arch": "sm90"}]}))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("sglang-moe") / "model")


@pytest.mark.parametrize("layout", REFUSED)
def test_the_plan_refuses_fp8_moe_layouts_sglang_does_not_load(layout, tiny_moe: Path) -> None:
    """exit 3, naming SGLang's file and a layout it does load, in recipe terms."""
    from llmc.planning.plan import make_plan

    with pytest.raises(IncompatibleTargetError) as refused:
        make_plan(_recipe(tiny_moe, layout), tiny_moe, check_time=False)
    e = refused.value
    assert e.exit_code == 3
    assert "compressed_tensors_w8a8_fp8_moe.py" in e.message and "sgl-project/sglang" in e.message
    assert f"{layout[0]} weights" in e.message and "qwen3_moe" in e.message
    assert "strategy: token, dynamic: true" in e.fix and "weights: {format: fp8_e4m3, strategy: tensor}" in e.fix


@pytest.mark.parametrize("layout", ACCEPTED)
def test_the_plan_accepts_the_fp8_moe_layouts_sglang_loads(layout, tiny_moe: Path) -> None:
    from llmc.planning.plan import make_plan

    plan = make_plan(_recipe(tiny_moe, layout), tiny_moe, check_time=False)
    assert [t["label"] for t in plan.targets] == ["sglang-sm90-tp1"]


def test_a_dense_model_keeps_every_fp8_layout_for_sglang(tmp_path: Path) -> None:
    """SGLang's dense FP8 scheme takes per-channel weights with static per-tensor activations: the MoE rule does not
    reach a model without routed experts."""
    from llmc.planning.plan import make_plan

    llama = make_tiny("llama", tmp_path / "llama")
    for layout in REFUSED[:1] + ACCEPTED:
        make_plan(_recipe(llama, layout), llama, check_time=False)


def test_the_cli_plan_exits_3_with_sglangs_reason(tiny_moe: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmc.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t", "model": {"source": str(tiny_moe)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
        "targets": [{"runtime": "sglang", "gpu_arch": "sm90"}]}))
    result = CliRunner().invoke(main, ["plan", str(path), "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 3, result.output
    assert "compressed_tensors_w8a8_fp8_moe.py" in result.output and "Traceback" not in result.output


def test_a_tiny_moe_artifact_for_sglang_holds_the_scales_sglang_computes_with(tiny_moe: Path, tmp_path: Path) -> None:
    """The layouts SGLang loads, quantized and exported: with static per-tensor activations every routed expert's
    input scale is its layer's one for its operand (the max, as SGLang's `.max()` keeps) and each expert's gate/up
    share one weight scale (SGLang requantizes w13 to the max); dynamic activations write no input scale, and
    per-channel weights keep one scale per row (SGLang requantizes only per-tensor weights)."""
    from llmc.planning.plan import make_plan

    expert = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(input_scale|weight_scale)$")
    for i, (weights, acts, dynamic) in enumerate(ACCEPTED):
        make_plan(_recipe(tiny_moe, (weights, acts, dynamic)), tiny_moe, check_time=False)  # accepted
        scheme = Scheme(TensorSpec("fp8_e4m3", weights), TensorSpec("fp8_e4m3", acts, dynamic=dynamic),
                        ignore=("lm_head",))
        out = tmp_path / f"export-{i}"
        export_compressed_tensors(_quantize(tiny_moe, scheme, tmp_path / f"q-{i}"), out)
        from safetensors.torch import load_file

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
