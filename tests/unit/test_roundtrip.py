"""Every format: stream-quantize a tiny model -> export compressed-tensors -> reload from disk ->
logits match a fake-quantized model computed independently on the whole (unstreamed) model."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.engines.torch_ref import TorchEngine
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.numerics import dequantize_weight, fake_quantize, quantize_weight, static_scale, weight_global_scales
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model

SCHEMES = {
    "fp8-static": Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor")),
    "fp8-dynamic": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "token", dynamic=True)),
    "w8a8-int8": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True)),
    "w8a8-int8-static": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor")),
    "w8a16-int8": Scheme(TensorSpec("int8", "channel")),
    "w4a16-g32": Scheme(TensorSpec("int4", "group", group_size=32)),
    "w4a16-g32-asym": Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False)),
    "w4afp8": Scheme(TensorSpec("int4", "group", group_size=32), TensorSpec("fp8_e4m3", "token", dynamic=True)),
    "w4afp8-fp8-row-scales": Scheme(TensorSpec("int4", "group", group_size=32, scale_grid="fp8_row"),
                                    TensorSpec("fp8_e4m3", "token", dynamic=True)),
    "w4afp8-static": Scheme(TensorSpec("int4", "group", group_size=32), TensorSpec("fp8_e4m3", "tensor")),
    "fp8-kv": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                     kv_cache=TensorSpec("fp8_e4m3", "tensor")),
    "w4a16-nvfp4": Scheme(TensorSpec("nvfp4", "group", group_size=16)),
    "w4a4-nvfp4": Scheme(TensorSpec("nvfp4", "group", group_size=16), TensorSpec("nvfp4", "group", group_size=16)),
    "w4a16-mxfp4": Scheme(TensorSpec("mxfp4", "group", group_size=32)),
    "w8a8-mxfp8": Scheme(TensorSpec("mxfp8", "group", group_size=32),
                         TensorSpec("mxfp8", "group", group_size=32, dynamic=True)),
    "w8a8-fp8-block": Scheme(TensorSpec("fp8_e4m3", "block"),
                             TensorSpec("fp8_e4m3", "group", group_size=128, dynamic=True)),
}


def _calibration(vocab: int, n: int = 6, seq: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, seq), generator=g)
    ids[:, 0] = 1
    return ids


def _reference(folder: Path, scheme: Scheme, calib: torch.Tensor) -> nn.Module:
    """The whole float model, fake-quantized directly with llmc.quant.numerics (no streaming)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    absmax: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, a, n=n: absmax.__setitem__(n, torch.maximum(absmax.get(n, torch.tensor(0.0)), a[0].abs().max()))
        )
        for n, m in linears.items()
    ]
    with torch.no_grad():
        for b in calib.split(4):  # same batching as quantize_model's default
            model(input_ids=b, use_cache=False)
    for h in hooks:
        h.remove()
    act = scheme.activations
    # NVFP4: fused siblings (q/k/v, gate/up) share one global scale, as the runtimes load them
    global_scales = weight_global_scales({n: m.weight.data for n, m in linears.items()}, scheme.weights)
    quantized = {n: quantize_weight(m.weight.data, scheme.weights, global_scale=global_scales.get(n))
                 for n, m in linears.items()}
    if scheme.weights.format == "fp8_e4m3" and scheme.weights.strategy == "tensor":
        # vLLM / SGLang run q/k/v and gate/up as one GEMM with one per-tensor scale, the max, each member's codes
        # dequantized in float16 and quantized again with it (issue 45: the canonical form holds exactly that)
        for siblings in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            for n in [n for n in quantized if n.endswith(f".{siblings[0]}")]:
                names = [n.rsplit(".", 1)[0] + "." + s for s in siblings]
                top = max(quantized[m].scale.max() for m in names)
                for m in names:
                    q = quantized[m]
                    dq = q.codes.to(torch.float16) * q.scale.float().reshape(())
                    codes = (dq.float() * (1.0 / top)).clamp(-448, 448).to(torch.float8_e4m3fn)
                    quantized[m] = dataclasses.replace(q, codes=codes, scale=top.reshape(q.scale.shape).clone())
    for n, m in linears.items():
        m.weight.data = dequantize_weight(quantized[n], scheme.weights)
        if act is not None:
            s = None if act.dynamic else static_scale(absmax[n], act)
            m.register_forward_pre_hook(lambda _m, a, s=s: (fake_quantize(a[0], act, s),))
    return model


@pytest.mark.parametrize("name", SCHEMES)
def test_export_reload_matches_fake_quantized_model(name: str, tiny_model: Path, tiny_model_factory,
                                                    tmp_path: Path) -> None:
    scheme = SCHEMES[name]
    if scheme.activations is not None and scheme.activations.group_size == 128:  # block FP8's 1x128 groups
        tiny_model = tiny_model_factory(tmp_path / "wide", hidden=128, intermediate=256)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    calib = _calibration(vocab)
    src = ModelSource(folder=tiny_model, sha256="test", origin=str(tiny_model))
    quantize_model(src, scheme, tmp_path / "q", Calibration(calib) if scheme.needs_calibration else None)
    qm = QuantizedModel.open(tmp_path / "q")
    export_compressed_tensors(qm, tmp_path / "artifact")

    engine = TorchEngine(tmp_path / "artifact", streamed=False)
    reference = _reference(tiny_model, scheme, calib)
    ids = _calibration(vocab, n=3, seq=48)
    with torch.no_grad():
        got = engine.model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)(input_ids=ids).logits

    # the decompressed weights are exactly the canonical dequantized weights
    for tensors in qm.iter_files():
        for module in qm.quantized_modules:
            if f"{module}.weight" in tensors:
                assert torch.equal(engine.model.get_submodule(module).weight.data, qm.dequantized_weight(tensors, module))
    quant_effect = (want - base).abs().max().item()
    assert quant_effect > 1e-4  # quantization changed something
    if scheme.kv_cache is None:
        assert (got - want).abs().max().item() < 1e-4
    else:  # the reference has no KV quantization: the engine adds a small further change
        assert (got - want).abs().max().item() < quant_effect


# KV format -> the code range a scale maps absmax onto (FP8 e4m3's max; compressed-tensors' symmetric int8 range / 2)
KV_RANGE = {"fp8_e4m3": 448.0, "int8": 127.5}


@pytest.mark.parametrize("kv_format", sorted(KV_RANGE))
def test_kv_scales_match_the_cache_a_runtime_fills(kv_format: str, tiny_model: Path, tmp_path: Path) -> None:
    """k_scale/v_scale come from post-RoPE keys and values: exactly what a KV cache stores (FP8 for
    vLLM/TensorRT-LLM, INT8 for TensorRT-LLM)."""
    scheme = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                    kv_cache=TensorSpec(kv_format, "tensor"))
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    calib = _calibration(vocab)
    src = ModelSource(folder=tiny_model, sha256="test", origin=str(tiny_model))
    quantize_model(src, scheme, tmp_path / "q", Calibration(calib))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    kmax = [torch.tensor(0.0)] * model.config.num_hidden_layers
    vmax = list(kmax)
    with torch.no_grad():
        for b in calib.split(4):
            cache = model(input_ids=b, use_cache=True).past_key_values
            for i in range(model.config.num_hidden_layers):
                k, v = cache.layers[i].keys, cache.layers[i].values
                kmax[i], vmax[i] = torch.maximum(kmax[i], k.abs().max()), torch.maximum(vmax[i], v.abs().max())
    for i in range(model.config.num_hidden_layers):
        with safe_open(str(tmp_path / "q" / "layers" / f"{i:05d}.safetensors"), "pt") as h:
            k_scale = h.get_tensor(f"model.layers.{i}.self_attn.k_scale")
            v_scale = h.get_tensor(f"model.layers.{i}.self_attn.v_scale")
        assert k_scale.item() == pytest.approx(kmax[i].item() / KV_RANGE[kv_format], rel=1e-5)
        assert v_scale.item() == pytest.approx(vmax[i].item() / KV_RANGE[kv_format], rel=1e-5)


def test_pack_quantized_layout(tiny_model: Path, tmp_path: Path) -> None:
    """int4 is stored as compressed-tensors pack-quantized: int32 words, 8 codes each, plus shape."""
    scheme = SCHEMES["w4a16-g32-asym"]
    src = ModelSource(folder=tiny_model, sha256="test", origin=str(tiny_model))
    quantize_model(src, scheme, tmp_path / "q", None)
    export_compressed_tensors(QuantizedModel.open(tmp_path / "q"), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized"
    assert cfg["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False, "dynamic": False,
    }
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as h:
        name = "model.layers.0.mlp.down_proj"
        packed = h.get_tensor(f"{name}.weight_packed")
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (64, 128 // 8)
        assert h.get_tensor(f"{name}.weight_shape").tolist() == [64, 128]
        assert tuple(h.get_tensor(f"{name}.weight_scale").shape) == (64, 128 // 32)
        assert h.get_tensor(f"{name}.weight_zero_point").dtype == torch.int32
        assert f"{name}.weight" not in h.keys()


def test_w4afp8_config_is_the_compressed_tensors_preset_vllm_loads() -> None:
    """W4AFP8's config carries compressed-tensors' own W4AFP8 preset arguments (what vLLM's
    `_is_fp8_w4a8` matches) in the pack-quantized layout (CompressedTensorsW4A8Fp8 loads `weight_packed`)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from llmc.formats.compressed_tensors import quantization_config

    scheme = Scheme(TensorSpec("int4", "group", group_size=128), TensorSpec("fp8_e4m3", "token", dynamic=True))
    cfg = quantization_config(scheme)
    assert cfg["format"] == "pack-quantized"
    group = cfg["config_groups"]["group_0"]
    preset = PRESET_SCHEMES["W4AFP8"]
    fields = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")
    for ours, theirs in ((group["weights"], preset["weights"]), (group["input_activations"], preset["input_activations"])):
        assert {f: ours.get(f) for f in fields} == {f: (v.value if hasattr(v, "value") else v)
                                                    for f, v in theirs.model_dump(include=set(fields)).items()}
