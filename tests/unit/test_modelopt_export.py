"""TensorRT-LLM (ModelOpt unified HF) export: packing, scheme mapping, files, and `llmc inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmc.formats.modelopt_hf import (
    export_modelopt_hf,
    pack_int4_rows,
    quant_algo,
    unpack_int4_rows,
)
from llmc.errors import IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model
from llmc.publish.inspect import describe


def test_int4_row_packing_round_trips_and_matches_modelopts_nibble_order() -> None:
    codes = torch.randint(-8, 8, (6, 10), dtype=torch.int8)
    packed = pack_int4_rows(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 10)
    assert torch.equal(unpack_int4_rows(packed), codes)
    # row 0 in the low nibble, row 1 in the high nibble, two's complement
    assert int(packed[0, 0]) == (int(codes[0, 0]) & 0xF) | ((int(codes[1, 0]) & 0xF) << 4)


@pytest.mark.parametrize("scheme,algo", [
    (Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor")), "FP8"),
    (Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor")), "W8A8_SQ_PER_CHANNEL"),
    (Scheme(TensorSpec("int4", "group", group_size=64)), "W4A16_AWQ"),
])
def test_schemes_map_to_modelopt_algorithms(scheme: Scheme, algo: str) -> None:
    assert quant_algo(scheme) == algo


@pytest.mark.parametrize("scheme", [
    Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),  # per-channel FP8 weights
    Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True)),  # dynamic per-token
    Scheme(TensorSpec("int4", "group", group_size=64, symmetric=False)),  # zero points
])
def test_layouts_modelopt_lacks_are_refused_with_a_fix(scheme: Scheme) -> None:
    with pytest.raises(IncompatibleTargetError) as e:
        quant_algo(scheme)
    assert e.value.fix


def test_export_writes_a_loadable_layout_and_inspect_names_it(tmp_path: Path, tiny_model_session: Path) -> None:
    scheme = Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"))
    calib = torch.randint(3, 200, (2, 16))
    quantize_model(ModelSource(tiny_model_session, "t", "t"), scheme, tmp_path / "q", Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "q")
    export_modelopt_hf(qm, tmp_path / "trt", tensor_parallel=2)
    t = load_file(str(tmp_path / "trt" / "model.safetensors"))
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    assert "model.layers.0.self_attn.k_proj.k_scale" in t and "model.layers.0.self_attn.k_scale" not in t
    hq = json.loads((tmp_path / "trt" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] == "FP8"
    assert "tensor_parallel_size: 2" in (tmp_path / "trt" / "llmc-trtllm.yaml").read_text()
    text = describe(tmp_path / "trt")
    assert "TensorRT-LLM" in text and "quant_algo FP8" in text


def test_int8_kv_cache_exports_as_modelopt_int8_kv(tmp_path: Path, tiny_model_session: Path) -> None:
    scheme = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), TensorSpec("int8", "tensor"))
    calib = torch.randint(3, 200, (2, 16))
    quantize_model(ModelSource(tiny_model_session, "t", "t"), scheme, tmp_path / "q", Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "q")
    export_modelopt_hf(qm, tmp_path / "trt", tensor_parallel=1)
    t = load_file(str(tmp_path / "trt" / "model.safetensors"))
    hq = json.loads((tmp_path / "trt" / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["kv_cache_quant_algo"]) == ("W8A8_SQ_PER_CHANNEL", "INT8")
    assert t["model.layers.0.self_attn.k_proj.k_scale"].item() > 0
    assert "dtype: int8" in (tmp_path / "trt" / "llmc-trtllm.yaml").read_text()


def test_legacy_tp_shards_remerge_exactly(tmp_path: Path, tiny_model_session: Path) -> None:
    from safetensors.torch import load_file

    from llmc.formats.trtllm_legacy import export_trtllm_legacy

    scheme = Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"))
    quantize_model(ModelSource(tiny_model_session, "t", "t"), scheme, tmp_path / "q",
                   Calibration(torch.randint(3, 200, (2, 16))))
    qm = QuantizedModel.open(tmp_path / "q")
    one = export_trtllm_legacy(qm, tmp_path / "tp1", tensor_parallel=1)
    export_trtllm_legacy(qm, tmp_path / "tp2", tensor_parallel=2)
    whole = load_file(str(tmp_path / "tp1" / "rank0.safetensors"))
    shards = [load_file(str(tmp_path / "tp2" / f"rank{r}.safetensors")) for r in (0, 1)]
    assert whole.keys() == shards[0].keys() == shards[1].keys()
    q, kv = 64, 32  # tiny model: 4 heads x 16, 2 KV heads x 16
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    for k, t in whole.items():
        if k.endswith(("attention.dense.weight", "mlp.proj.weight")):
            merged = torch.cat([s[k] for s in shards], dim=1)
        elif k.endswith("attention.qkv.weight"):
            cuts = (q // 2, q // 2 + kv // 2)
            parts = [(s[k][: cuts[0]], s[k][cuts[0] : cuts[1]], s[k][cuts[1] :]) for s in shards]
            merged = torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
        elif t.dim() == 2:
            merged = torch.cat([s[k] for s in shards], dim=0)
        else:
            merged = shards[0][k]
            assert torch.equal(shards[1][k], merged), k
        assert torch.equal(bits(merged), bits(t)), k
    # the canonical form holds q/k/v at one scale already, with the codes the runtimes' requantization gives
    # (issue 45, llmc.quant.runtime_scales): the exporter's own requantization changes nothing
    assert one.qkv_requantization_error == 0.0
    cfg = json.loads((tmp_path / "tp2" / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert "TensorRT-LLM checkpoint (legacy" in describe(tmp_path / "tp2") and "tp_size 2" in describe(tmp_path / "tp2")
    assert cfg["quantization"]["kv_cache_quant_algo"] == "FP8"
