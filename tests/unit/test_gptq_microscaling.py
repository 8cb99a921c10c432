"""GPTQ (and AWQ) with the microscaling formats' own quantizer: NVFP4, MXFP4 and MXFP8 codes and block scales from
GPTQ's column loop (`gptq.gptq_microscaling_rows`), in round-to-nearest's layout, on the formats' grids, with fused
siblings under one NVFP4 global scale, and exported as compressed-tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.model.source import ModelSource
from llmc.quant.algorithms.gptq import GptqOptions, accumulate_hessian, gptq_quantize_shared
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import E8M0_NAN, MICROSCALING_FORMATS, quantize_with_scales
from llmc.quant.numerics import QuantizedWeight, dequantize_weight, quantize_weights
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model

SPECS = {"nvfp4": TensorSpec("nvfp4", "group", group_size=16), "mxfp4": TensorSpec("mxfp4", "group", group_size=32),
         "mxfp8": TensorSpec("mxfp8", "group", group_size=32)}


def _layer(seed: int = 0, n_out: int = 48, n_in: int = 128, tokens: int = 512):
    """A random weight and calibration inputs with correlated channels (what GPTQ's error feedback exploits)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    mix = torch.eye(n_in) + 0.3 * torch.randn(n_in, n_in, generator=g)
    x = torch.randn(tokens, n_in, generator=g) @ mix * torch.linspace(0.2, 3.0, n_in)  # uneven channel scales
    return w, x


def _output_error(x: torch.Tensor, w: torch.Tensor, q: QuantizedWeight, spec: TensorSpec) -> float:
    return float(((x @ (dequantize_weight(q, spec) - w).T) ** 2).mean())


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_scales", ["absmax", "search"])
@pytest.mark.parametrize("fmt", list(SPECS))
def test_gptq_reproduces_the_layers_output_better_than_rounding(fmt: str, block_scales: str, act_order: bool) -> None:
    spec = SPECS[fmt]
    for seed in range(3):
        w, x = _layer(seed)
        hessian, _ = accumulate_hessian(None, 0, x)
        options = GptqOptions(block_scales=block_scales, act_order=act_order)
        (gptq,), _ = gptq_quantize_shared([w], hessian, spec, options, ["layer.down_proj"])
        rtn = quantize_weights({"layer.down_proj": w}, spec)["layer.down_proj"]
        assert _output_error(x, w, gptq, spec) < 0.8 * _output_error(x, w, rtn, spec), (fmt, seed)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_scales", ["absmax", "search"])
@pytest.mark.parametrize("fmt", list(SPECS))
def test_gptq_codes_and_scales_have_round_to_nearests_layout_and_sit_on_the_grid(fmt: str, block_scales: str,
                                                                                 act_order: bool) -> None:
    spec, block = SPECS[fmt], MICROSCALING_FORMATS[fmt]
    w, x = _layer(1, n_out=40, n_in=96)
    w[3, :32] = 0.0  # all-zero blocks keep zero codes
    hessian, _ = accumulate_hessian(None, 0, x)
    # 40 columns: rounded to whole blocks (in activation order, any number of columns)
    options = GptqOptions(block_size=40, block_scales=block_scales, act_order=act_order)
    (gptq,), _ = gptq_quantize_shared([w], hessian, spec, options, ["m"])
    rtn = quantize_weights({"m": w}, spec)["m"]
    for field in ("codes", "scale", "global_scale"):
        a, b = getattr(gptq, field), getattr(rtn, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert (a.dtype, a.shape) == (b.dtype, b.shape), field
    assert gptq.zero_point is None
    if block.element == "e2m1":
        assert int(gptq.codes.max()) <= 15
    if block.scale == "e8m0":
        assert (gptq.scale != E8M0_NAN).all()
    else:
        assert torch.isfinite(gptq.scale.float()).all() and (gptq.scale.float() >= 0).all()
        torch.testing.assert_close(gptq.global_scale, rtn.global_scale, rtol=0, atol=0)  # from the weight's amax
    values = dequantize_weight(gptq, spec)
    assert torch.isfinite(values).all()
    # on the grid: the values re-encoded under their own block scales give back the same codes
    again = quantize_with_scales(values, gptq.scale, block, gptq.global_scale)
    assert torch.equal(again.codes.view(torch.uint8), gptq.codes.view(torch.uint8))
    assert (values[3, :32] == 0).all()


@pytest.mark.parametrize("fmt", list(SPECS))
def test_in_activation_order_the_block_scales_are_fixed_from_the_original_weight(fmt: str) -> None:
    """llm-compressor's static activation order: the scales are round-to-nearest's of the weight before any column is
    quantized, so scattering the columns never changes which share a scale. With a diagonal Hessian no error moves
    to another column, and the codes are round-to-nearest's too."""
    spec = SPECS[fmt]
    w, x = _layer(3)
    rtn = quantize_weights({"m": w}, spec)["m"]
    hessian, _ = accumulate_hessian(None, 0, x)
    (ordered,), _ = gptq_quantize_shared([w], hessian, spec, GptqOptions(act_order=True), ["m"])
    assert torch.equal(ordered.scale.view(torch.uint8), rtn.scale.view(torch.uint8))
    assert not torch.equal(ordered.codes.view(torch.uint8), rtn.codes.view(torch.uint8))  # the errors moved
    diagonal = torch.diag(torch.linspace(0.5, 4.0, w.shape[1]).flip(0))  # columns visited in a new order
    (alone,), _ = gptq_quantize_shared([w], diagonal, spec, GptqOptions(act_order=True), ["m"])
    assert torch.equal(alone.codes.view(torch.uint8), rtn.codes.view(torch.uint8))
    assert torch.equal(alone.scale.view(torch.uint8), rtn.scale.view(torch.uint8))


@pytest.mark.parametrize("block_scales", ["absmax", "search"])
def test_stacked_fused_siblings_share_the_nvfp4_global_scale_and_others_keep_their_own(block_scales: str) -> None:
    spec = SPECS["nvfp4"]
    w, x = _layer(2, n_out=96)
    q, k, v = w[:32] * 4, w[32:64], w[64:] * 0.5  # different ranges: different global scales of their own
    hessian, _ = accumulate_hessian(None, 0, x)
    names = ["l.self_attn.q_proj", "l.self_attn.k_proj", "l.self_attn.v_proj"]
    fused, _ = gptq_quantize_shared([q, k, v], hessian, spec, GptqOptions(block_scales=block_scales), names)
    rtn = quantize_weights(dict(zip(names, (q, k, v))), spec)
    for got, name in zip(fused, names):
        torch.testing.assert_close(got.global_scale, fused[0].global_scale, rtol=0, atol=0)
        torch.testing.assert_close(got.global_scale, rtn[name].global_scale, rtol=0, atol=0)
    alone, _ = gptq_quantize_shared([q, k], hessian, spec, GptqOptions(), ["a.up", "b.up"])  # not siblings
    assert not torch.equal(alone[0].global_scale, alone[1].global_scale)
    # the stacked loop quantizes each row as its own Linear would under the same global scale
    (k_alone,), _ = gptq_quantize_shared([k], hessian, spec, GptqOptions(block_scales=block_scales), ["x"])
    if torch.equal(k_alone.global_scale, fused[1].global_scale):
        assert torch.equal(k_alone.codes, fused[1].codes)


def _tiny_quantized(tiny_model: Path, tmp_path: Path, weights: TensorSpec, algorithm: str) -> QuantizedModel:
    calibration = Calibration(torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(0)),
                              batch_size=2)
    quantize_model(ModelSource(tiny_model, "t", "t"), Scheme(weights, algorithm=algorithm), tmp_path / "q",
                   calibration)
    return QuantizedModel.open(tmp_path / "q")


@pytest.mark.parametrize(("fmt", "algorithm", "config_format"), [
    ("nvfp4", "gptq", "nvfp4-pack-quantized"), ("mxfp4", "gptq", "mxfp4-pack-quantized"),
    ("nvfp4", "awq", "nvfp4-pack-quantized")])
def test_the_stream_quantizes_and_compressed_tensors_exports_the_result(fmt: str, algorithm: str,
                                                                       config_format: str, tiny_model: Path,
                                                                       tmp_path: Path) -> None:
    qm = _tiny_quantized(tiny_model, tmp_path, SPECS[fmt], algorithm)
    export_compressed_tensors(qm, tmp_path / "artifact")
    config = json.loads((tmp_path / "artifact" / "config.json").read_text())["quantization_config"]
    assert config["format"] == config_format
    canonical = next(qm.iter_files())
    module = "model.layers.0.mlp.down_proj"
    codes = canonical[f"{module}.weight"]
    with safe_open(str(next((tmp_path / "artifact").glob("*.safetensors"))), "pt") as h:
        packed = h.get_tensor(f"{module}.weight_packed")
        assert torch.equal(h.get_tensor(f"{module}.weight_scale").view(torch.uint8),
                           canonical[f"{module}.weight_scale"].view(torch.uint8))
    assert torch.equal(packed & 0x0F, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])


def test_the_torch_engine_scores_the_gptq_nvfp4_export_as_llmcs_values(tiny_model: Path, tmp_path: Path) -> None:
    """The exported artifact reloads to the canonical form's values, every quantized weight bit for bit."""
    from llmc.engines.torch_ref import TorchEngine

    qm = _tiny_quantized(tiny_model, tmp_path, SPECS["nvfp4"], "gptq")
    export_compressed_tensors(qm, tmp_path / "artifact")
    model = TorchEngine(tmp_path / "artifact", streamed=False).model
    canonical = next(qm.iter_files())
    modules = [m for m in qm.quantized_modules if f"{m}.weight" in canonical]
    assert modules
    for module in modules:
        assert torch.equal(model.get_submodule(module).weight.data.float(), qm.dequantized_weight(canonical, module))
