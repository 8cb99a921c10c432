"""TensorRT-LLM (ModelOpt unified HF) export of NVFP4 (W4A4) and block-wise FP8: quant_algo, tensors in ModelOpt's
layout and global-scale convention (against the compressed-tensors export of the same canonical form, both ways),
config keys, mixed precision, and what `llmc plan` accepts or refuses for TensorRT-LLM. Layout conformance with
ModelOpt's own export: tests/integration/test_modelopt_conformance.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmc.errors import IncompatibleTargetError
from llmc.formats.modelopt_hf import (
    FP8_PB_WO,
    HF_QUANT_CONFIG,
    MIXED_QUANT_CONFIG,
    export_modelopt_hf,
    quant_algo,
)
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import e2m1_decode, global_scale_from_modelopt, unpack_e2m1
from llmc.quant.spec import ModuleGroup, ModuleTargets, Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model

NVFP4 = TensorSpec("nvfp4", "group", group_size=16)
W4A4_NVFP4 = Scheme(NVFP4, NVFP4)
FP8_BLOCK = Scheme(TensorSpec("fp8_e4m3", "block"), TensorSpec("fp8_e4m3", "group", group_size=128, dynamic=True))
ULP = 2.0 ** -23  # float32's relative rounding: ModelOpt's weight_scale_2 is 1 / global scale rounded once


def test_nvfp4_and_block_fp8_map_to_modelopt_algorithms() -> None:
    assert quant_algo(W4A4_NVFP4) == "NVFP4"
    assert quant_algo(FP8_BLOCK) == FP8_PB_WO == "fp8_pb_wo"  # as ModelOpt 0.47 writes it; TensorRT-LLM: FP8_BLOCK_SCALES


@pytest.mark.parametrize("scheme, says", [
    (Scheme(NVFP4), "W4A16_NVFP4"),  # weight-only NVFP4: no TensorRT-LLM QuantAlgo
    (Scheme(NVFP4, TensorSpec("nvfp4", "group", group_size=16, dynamic=True)), "input_scale"),
    (Scheme(TensorSpec("fp8_e4m3", "block"), TensorSpec("fp8_e4m3", "tensor")), "1 x 128"),
])
def test_fp4_and_block_layouts_tensorrt_llm_cannot_load_are_refused_with_a_fix(scheme: Scheme, says: str) -> None:
    with pytest.raises(IncompatibleTargetError, match=says) as e:
        quant_algo(scheme)
    assert e.value.fix


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("fp4") / "m", hidden=128, intermediate=256, tie=False)


def _quantize(model: Path, scheme: Scheme, out: Path) -> QuantizedModel:
    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(ModelSource(model, "t", "t"), scheme, out, Calibration(calib))
    return QuantizedModel.open(out)


def _written(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def nvfp4(model: Path, tmp_path_factory) -> tuple[QuantizedModel, Path, Path]:
    """W4A4-NVFP4 canonical form and its two exports: (qm, ModelOpt folder, compressed-tensors folder)."""
    from llmc.formats.compressed_tensors import export_compressed_tensors

    root = tmp_path_factory.mktemp("nvfp4")
    qm = _quantize(model, W4A4_NVFP4, root / "q")
    export_modelopt_hf(qm, root / "modelopt")
    export_compressed_tensors(qm, root / "ct")
    return qm, root / "modelopt", root / "ct"


def _modelopt_decode(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """ModelOpt's NVFP4 dequantization (NVFP4QTensor.dequantize): code × weight_scale × weight_scale_2."""
    codes = e2m1_decode(unpack_e2m1(t[f"{name}.weight"]))
    return codes * t[f"{name}.weight_scale"].float().repeat_interleave(16, dim=1) * t[f"{name}.weight_scale_2"]


def test_nvfp4_exports_decode_to_the_canonical_weights_modelopts_way(nvfp4) -> None:
    qm, mo, _ = nvfp4
    written, canonical = _written(mo), {k: v for t in qm.iter_files() for k, v in t.items()}
    assert set(qm.quantized_modules) and all(n.startswith("model.layers.") for n in qm.quantized_modules)
    for name in qm.quantized_modules:
        out, inp = qm.quantized_modules[name]["shape"]
        w, s, s2, a = (written[f"{name}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
        assert (w.dtype, tuple(w.shape)) == (torch.uint8, (out, inp // 2))
        assert (s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (out, inp // 16))
        assert (s2.dtype, s2.shape, a.dtype, a.shape) == (torch.float32, (), torch.float32, ())
        assert f"{name}.weight_global_scale" not in written and f"{name}.input_global_scale" not in written
        # the codes and block scales are the canonical ones; only the per-tensor scale's rounding differs
        assert torch.equal(unpack_e2m1(w), canonical[f"{name}.weight"])
        assert torch.equal(s.view(torch.uint8), canonical[f"{name}.weight_scale"].view(torch.uint8))
        torch.testing.assert_close(_modelopt_decode(written, name), qm.dequantized_weight(canonical, name),
                                   rtol=2 * ULP, atol=0)


def test_nvfp4_global_scale_is_compressed_tensors_reciprocal_both_ways(nvfp4) -> None:
    """ModelOpt stores the multipliers amax / (448 · 6) where compressed-tensors stores the divisors 448 · 6 / amax:
    same bytes and block scales in both exports, each per-tensor scale the other's reciprocal, and each tool's decode
    of the other's scale giving the same weights."""
    from llmc.formats.microscaling_export import nvfp4_from_compressed_tensors

    qm, mo, ct = nvfp4
    m, c = _written(mo), _written(ct)
    for name in qm.quantized_modules:
        assert torch.equal(m[f"{name}.weight"], c[f"{name}.weight_packed"])
        assert torch.equal(m[f"{name}.weight_scale"].view(torch.uint8), c[f"{name}.weight_scale"].view(torch.uint8))
        g, ig = c[f"{name}.weight_global_scale"].reshape(()), c[f"{name}.input_global_scale"].reshape(())
        s2, a = m[f"{name}.weight_scale_2"], m[f"{name}.input_scale"]
        assert s2 < 1 < g and a < 1 < ig  # a multiplier and a divisor, not the same convention twice
        assert torch.equal(s2, 1.0 / g) and torch.equal(a, 1.0 / ig)  # ModelOpt's from compressed-tensors'
        torch.testing.assert_close(global_scale_from_modelopt(s2), g, rtol=2 * ULP, atol=0)  # and back
        torch.testing.assert_close(global_scale_from_modelopt(a), ig, rtol=2 * ULP, atol=0)
        # compressed-tensors' decode (code × block / global) of ModelOpt's tensors, the global scale taken back
        # from weight_scale_2, and ModelOpt's decode, agree within that rounding
        from_modelopt = nvfp4_from_compressed_tensors({"weight_packed": m[f"{name}.weight"],
                                                      "weight_scale": m[f"{name}.weight_scale"],
                                                      "weight_global_scale": global_scale_from_modelopt(s2)})
        from_ct = nvfp4_from_compressed_tensors({k: c[f"{name}.{k}"]
                                                 for k in ("weight_packed", "weight_scale", "weight_global_scale")})
        torch.testing.assert_close(from_modelopt, from_ct, rtol=2 * ULP, atol=0)
        torch.testing.assert_close(_modelopt_decode(m, name), from_ct, rtol=2 * ULP, atol=0)


def test_nvfp4_fused_siblings_share_the_scales_tensorrt_llm_asserts_equal(nvfp4) -> None:
    """TensorRT-LLM's NVFP4 loader asserts q/k/v (and gate/up) have one weight_scale_2 and one input_scale."""
    qm, mo, _ = nvfp4
    m = _written(mo)
    for layer in (0, 1):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            for kind in ("weight_scale_2", "input_scale"):
                values = {float(m[f"model.layers.{layer}.{p}.{kind}"]) for p in group}
                assert len(values) == 1, (layer, group, kind, values)


def test_nvfp4_config_keys_are_modelopts(nvfp4) -> None:
    _, mo, _ = nvfp4
    hq = json.loads((mo / HF_QUANT_CONFIG).read_text())
    assert hq["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qc = json.loads((mo / "config.json").read_text())["quantization_config"]
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert qc["config_groups"] == {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}}
    assert (qc["quant_algo"], qc["quant_method"]) == ("NVFP4", "modelopt")


def test_block_fp8_exports_modelopts_tile_scales_and_decodes_exactly(model: Path, tmp_path: Path) -> None:
    qm = _quantize(model, FP8_BLOCK, tmp_path / "q")
    export_modelopt_hf(qm, tmp_path / "mo")
    written, canonical = _written(tmp_path / "mo"), {k: v for t in qm.iter_files() for k, v in t.items()}
    for name in qm.quantized_modules:
        out, inp = qm.quantized_modules[name]["shape"]
        w, s = written[f"{name}.weight"], written[f"{name}.weight_scale"]
        tiles = (-(-out // 128), -(-inp // 128))
        assert w.dtype == torch.float8_e4m3fn and torch.equal(w.view(torch.uint8),
                                                              canonical[f"{name}.weight"].view(torch.uint8))
        assert s.dtype == torch.float32
        assert tuple(s.shape) == ((tiles[0], 1, tiles[1], 1) if tiles != (1, 1) else ())
        tile = s.reshape(tiles)  # what TensorRT-LLM loads (squeeze(1).squeeze(-1))
        expanded = tile.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
        assert torch.equal(w.float() * expanded, qm.dequantized_weight(canonical, name))
    assert any(written[f"{n}.weight_scale"].dim() == 4 for n in qm.quantized_modules)  # gate/up: 2 x 1 tiles
    hq = json.loads((tmp_path / "mo" / HF_QUANT_CONFIG).read_text())["quantization"]
    assert hq == {"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo": None,
                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qc = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert "config_groups" not in qc and qc["quant_algo"] == "fp8_pb_wo"


def test_mixed_precision_writes_an_nvfp4_group_as_modelopt_does(model: Path, tmp_path: Path) -> None:
    attention = ModuleGroup("attention", ModuleTargets(roles=("attention",)),
                            TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"))
    mlp = ModuleGroup("mlp", ModuleTargets(roles=("mlp",)), NVFP4, NVFP4)
    qm = _quantize(model, Scheme(NVFP4, NVFP4, groups=(attention, mlp)), tmp_path / "q")
    export_modelopt_hf(qm, tmp_path / "mo")
    hq = json.loads((tmp_path / "mo" / HF_QUANT_CONFIG).read_text())["quantization"]
    layers = hq["quantized_layers"]
    # TensorRT-LLM's loader reads kv_cache_quant_algo and quantized_layers of a MIXED_PRECISION checkpoint here
    assert json.loads((tmp_path / "mo" / MIXED_QUANT_CONFIG).read_text()) == hq
    assert layers["model.layers.0.mlp.up_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    written, canonical = _written(tmp_path / "mo"), {k: v for t in qm.iter_files() for k, v in t.items()}
    d = "model.layers.1.mlp.down_proj"
    torch.testing.assert_close(_modelopt_decode(written, d), qm.dequantized_weight(canonical, d),
                               rtol=2 * ULP, atol=0)
    assert written["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn


def test_a_plain_scheme_writes_no_mixed_layer_table(nvfp4) -> None:
    assert not (nvfp4[1] / MIXED_QUANT_CONFIG).exists()


@pytest.mark.parametrize("scheme, arch, version, refused", [
    ("W4A4-NVFP4", "sm100", None, None),
    ("W4A4-NVFP4", "sm90", None, "needs sm100"),
    ("W8A8-FP8-BLOCK", "sm90", ">=1.0", None),
    ("W8A8-FP8-BLOCK", "sm89", None, "needs sm90"),
    ("W8A8-FP8-BLOCK", "sm90", "<1.0,>=0.17", "from 1.0.0"),
    ("W4A16-NVFP4", "sm100", None, "does not run W4A16-NVFP4"),
])
def test_tensorrt_llm_targets_accept_and_refuse_by_arch_and_version(scheme: str, arch: str, version: str | None,
                                                                     refused: str | None) -> None:
    from llmc.planning.plan import check_target
    from llmc.recipe.schema import SCHEME_SETTINGS, QuantizationSection, Target

    s = QuantizationSection.model_validate(SCHEME_SETTINGS[scheme]).to_scheme()
    target = Target(runtime="tensorrt-llm", gpu_arch=arch, version=version)
    if refused is None:
        assert check_target(s, target)[0] == "native"
        return
    with pytest.raises(IncompatibleTargetError, match=refused) as e:
        check_target(s, target)
    assert e.value.fix
