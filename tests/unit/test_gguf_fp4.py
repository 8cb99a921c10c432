"""GGUF export of MXFP4 and NVFP4 weights (llama.cpp's GGML_TYPE_MXFP4 / GGML_TYPE_NVFP4): a tiny llama quantized
into llmc's canonical form, written as GGUF, read back with the gguf package's GGUFReader and decoded with its
`quants.dequantize` (its MXFP4 and NVFP4 decoders follow ggml-common.h's blocks) against llmc's canonical values:
MXFP4 exactly; NVFP4's blocks exactly code x block scale, times the `.scale` tensor within float32 rounding of the
product (llmc divides by the global scale, llama.cpp multiplies by its float32 reciprocal)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize

from llmc.errors import IncompatibleTargetError, InputError
from llmc.formats import gguf as G
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import NVFP4, BlockQuantized, dequantize_blocks
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model

SCHEMES = {
    "mxfp4": Scheme(TensorSpec("mxfp4", "group", group_size=32)),
    "nvfp4": Scheme(TensorSpec("nvfp4", "group", group_size=16)),
}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
FLOAT32_EPS = 2.0**-23


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_session: Path) -> dict[str, tuple[QuantizedModel, G.GGUFExport]]:
    root = tmp_path_factory.mktemp("gguf-fp4")
    out = {}
    for name, scheme in SCHEMES.items():
        quantize_model(ModelSource(tiny_model_session, "test", str(tiny_model_session)), scheme, root / f"q-{name}",
                       None)
        qm = QuantizedModel.open(root / f"q-{name}")
        out[name] = (qm, G.export_gguf(qm, root / f"gguf-{name}"))
    return out


def _canonical(qm: QuantizedModel) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in qm.iter_files():
        out.update(t)
    return out


def _hf_rows(qm: QuantizedModel, gguf_name: str, rows: torch.Tensor) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation so a GGUF tensor lines up with the canonical one."""
    kind = gguf_name.split(".")[-2]
    if kind == "attn_q":
        return G.llama_unpermute(rows, qm.config["num_attention_heads"])
    if kind == "attn_k":
        return G.llama_unpermute(rows, qm.config["num_key_value_heads"])
    return rows


@pytest.mark.parametrize("name", list(SCHEMES))
def test_fp4_weights_decode_to_the_canonical_values(exported, name: str) -> None:
    qm, res = exported[name]
    ggml_type = GGMLQuantizationType[name.upper()]
    reader = GGUFReader(str(res.path))
    tensors = {t.name: t for t in reader.tensors}
    canonical = _canonical(qm)
    n_layers = qm.config["num_hidden_layers"]
    checked = 0
    for layer in range(n_layers):
        for short, hf in LINEARS.items():
            gname = f"blk.{layer}.{short}.weight"
            module = f"model.layers.{layer}.{hf}"
            t = tensors[gname]
            assert t.tensor_type == ggml_type
            want = qm.dequantized_weight(canonical, module).float()
            blocks = dequantize(np.asarray(t.data), ggml_type)
            got = _hf_rows(qm, gname, torch.from_numpy(blocks.copy()))
            assert got.shape == want.shape
            if name == "mxfp4":
                assert f"blk.{layer}.{short}.scale" not in tensors  # MX has no per-tensor scale
                assert torch.equal(got, want)  # exact: E8M0 x E2M1 is representable in float32
            else:
                # the blocks alone: code x block scale, exactly llmc's values before the global scale
                unscaled = dequantize_blocks(BlockQuantized(
                    codes=canonical[f"{module}.weight"], scale=canonical[f"{module}.weight_scale"],
                    global_scale=torch.ones(1), format=NVFP4))
                assert torch.equal(got, unscaled)
                scale = tensors[f"blk.{layer}.{short}.scale"]
                assert scale.tensor_type == GGMLQuantizationType.F32 and scale.n_elements == 1
                g = canonical[f"{module}.weight_global_scale"].float()
                assert float(np.asarray(scale.data)[0]) == float((1.0 / g)[0])  # ModelOpt's multiplier
                scaled = got * torch.from_numpy(np.asarray(scale.data).copy())
                # llmc: code * (block scale / G); llama.cpp: (code * block scale) * fl(1 / G): two roundings apart
                bound = 2 * FLOAT32_EPS * want.abs()
                assert ((scaled - want).abs() <= bound).all(), float((scaled - want).abs().max())
            checked += 1
    assert checked == 7 * n_layers
    # embeddings and norms as the integer exports write them
    assert tensors["token_embd.weight"].tensor_type == GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert res.plan.method == "repacked" and res.plan.weight_type == name.upper()
    err = res.weight_error
    assert err["max_abs"] == 0.0 if name == "mxfp4" else err["max_abs"] < 1e-6


@pytest.mark.parametrize("name", list(SCHEMES))
def test_weight_only_fp4_tensors_are_kept_from_4_bit_activations(exported, name: str) -> None:
    qm, res = exported[name]
    reader = GGUFReader(str(res.path))
    names = [bytes(reader.fields[G.PREC_A4_KEYS[0]].parts[i]).decode()
             for i in reader.fields[G.PREC_A4_KEYS[0]].data]
    a4 = reader.fields[G.PREC_A4_KEYS[1]].contents()
    fp4 = sorted(t.name for t in reader.tensors if t.tensor_type == GGMLQuantizationType[name.upper()])
    assert sorted(names) == fp4 and len(fp4) == 7 * qm.config["num_hidden_layers"]
    assert a4 == [False] * len(names)
    assert reader.fields["general.file_type"].contents() == int(LlamaFileType[res.plan.file_type])


def test_fp4_refusals(exported, tmp_path: Path) -> None:
    qm, _ = exported["nvfp4"]
    qwen2 = dataclasses.replace(qm, meta={**qm.meta, "config": {**qm.config, "model_type": "qwen2"}})
    with pytest.raises(IncompatibleTargetError, match="qwen2 graph does not apply per-tensor scales"):
        G.export_gguf(qwen2, tmp_path / "qwen2")
    assert not (tmp_path / "qwen2" / "model.gguf").exists()
    with pytest.raises(InputError, match="requantize applies to the integer GGUF types"):
        G.type_plan(SCHEMES["nvfp4"].weights, requantize=True)
    for spec in (TensorSpec("mxfp8", "group", group_size=32), TensorSpec("fp8_e4m3", "block")):
        with pytest.raises(IncompatibleTargetError, match="GGUF has no"):
            G.type_plan(spec)


def test_llama_cpp_plans_fp4_and_ollama_does_not() -> None:
    from llmc.runtimes import catalog as targets

    llama = targets.runtime("llama.cpp").rules
    assert llama["W4A16-MXFP4"].cpu and llama["W4A16-NVFP4"].cpu
    assert "W4A4-NVFP4" not in llama  # activations would not be carried
    assert "W4A16-MXFP4" not in targets.runtime("ollama").rules


def test_fp4_gguf_builds_from_a_recipe(tiny_model_session: Path, tmp_path: Path) -> None:
    import yaml

    from llmc.build import build_until
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store

    recipe = parse_recipe(yaml.safe_dump({
        "name": "tiny-fp4",
        "model": {"source": str(tiny_model_session)},
        "variants": [{"name": "nvfp4", "quantization": {"weights": {"format": "nvfp4", "strategy": "group",
                                                                    "group_size": 16}}},
                     {"name": "mxfp4", "quantization": {"weights": {"format": "mxfp4", "strategy": "group",
                                                                    "group_size": 32}}}],
        "targets": [{"runtime": "llama.cpp", "gpu_arch": "cpu"}, {"runtime": "vllm", "gpu_arch": "sm100"}],
    }))
    result = build_until(recipe, Store(tmp_path / "cache"), "export")
    ggufs = [a for a in result.artifacts.values() if a.format == "gguf"]
    assert len(ggufs) == 2
    types = set()
    for a in ggufs:
        reader = GGUFReader(str(a.dir / "model.gguf"))
        types |= {t.tensor_type.name for t in reader.tensors if t.name.endswith("ffn_down.weight")}
    assert types == {"MXFP4", "NVFP4"}
