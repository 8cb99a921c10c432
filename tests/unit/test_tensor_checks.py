"""Issue 50, items 4, 8 and 10 (part): a weight file is checked against the model config.json describes (headers
only: each tensor's shape and dtype against the model built on the meta device), a quantized source is found from
its tensors when no config says so and named by its codes' format, and an artifact's config.json names a class
transformers has, never the folder's own code."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.errors import InputError
from llmc.model import checks
from llmc.model.checkpoint import read_model_config, transformers_architectures

sys.path.insert(0, str(Path(__file__).parent))
from families import make_tiny  # noqa: E402
from test_source_checks import plan  # noqa: E402


def _with_tensors(tiny: Path, tmp_path: Path, change) -> Path:
    """A copy of the tiny model whose weights `change(tensors)` rewrote (in place, a dict name -> tensor)."""
    model = Path(shutil.copytree(tiny, tmp_path / "m"))
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, str(weights))
    return model


# --------------------------------------------------------------------------- item 4: tensors against config.json

GATE = "model.layers.0.mlp.gate_proj.weight"  # [intermediate 128, hidden 64] in the tiny model
NORM = "model.layers.1.input_layernorm.weight"


@pytest.mark.parametrize("name, make, said", [
    (GATE, lambda t: t.T.contiguous(), "F32 [64, 128] (transposed)"),
    (GATE, lambda t: t.flatten(), "F32 [8192] (the same elements in another shape)"),
    (GATE, lambda t: t[None], "F32 [1, 128, 64]"),
    (GATE, lambda t: t[:, :32].contiguous(), "F32 [128, 32]"),
    (NORM, lambda t: t.to(torch.int8), "I8 [64]"),
    ("model.embed_tokens.weight", lambda t: t[:, :48].contiguous(), "F32 ["),
])
def test_a_tensor_the_config_contradicts_is_refused_at_plan_time(name, make, said, tiny_model_session: Path,
                                                               tmp_path: Path) -> None:
    model = _with_tensors(tiny_model_session, tmp_path, lambda ts: ts.update({name: make(ts[name])}))
    code, out = plan(model, tmp_path)
    assert code == 7, out
    assert f"tensor '{name}' in 'model.safetensors' is {said}" in out and "config.json implies a float" in out, out
    assert "save_pretrained" in out and not (tmp_path / "cache" / "quantize").exists()


def test_tied_head_bf16_weights_and_extra_tensors_still_plan_and_quantize(tiny_model_session: Path,
                                                                         tmp_path: Path) -> None:
    """What the check must not refuse: a tied model's file without lm_head (the tiny model is tied), weights in
    another float dtype, and tensors the model has no parameter for (not checked): an old checkpoint's per-layer
    rotary inv_freq (8a48c9f's build stopped on it with exit 70: `LlamaAttention has no attribute rotary_emb`) is
    ignored, one outside the layers is carried as before."""
    import llmc.quant.stream as stream
    from llmc.model.source import ModelSource
    from llmc.quant.spec import Scheme, TensorSpec

    def change(ts):
        for n in list(ts):
            ts[n] = ts[n].to(torch.bfloat16)
        ts["model.vision_tower.patch.weight"] = torch.zeros(4, 4)
        ts["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    model = _with_tensors(tiny_model_session, tmp_path, change)
    code, out = plan(model, tmp_path)
    assert code == 0, out
    stream.quantize_model(ModelSource(model, "t", "t"), Scheme(TensorSpec("fp8_e4m3", "channel")), tmp_path / "q",
                          None)
    assert "model.vision_tower.patch.weight" in load_file(tmp_path / "q" / "rest.safetensors")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gemma3", "phi3"])
def test_every_tensor_of_a_saved_model_is_the_one_its_config_implies(family: str, tmp_path: Path) -> None:
    """MoE experts as the Hub stores them (per expert; llmc unfuses transformers' 3-D experts to match), fused
    qkv, Gemma 3's layer types: the file transformers saves agrees with the meta model, tensor by tensor."""
    model = make_tiny(family, tmp_path / family)
    config = read_model_config(model)
    tensors = {n: (info["dtype"], tuple(info["shape"]))
               for f in model.glob("*.safetensors")
               for n, info in checks.check_safetensors_header(f).items() if n != "__metadata__"}
    checks.check_tensors(config, tensors, {}, str(model))
    implied = checks.implied_tensors(config)
    assert set(tensors) <= set(implied), sorted(set(tensors) - set(implied))
    flipped = next(n for n, (_, shape) in sorted(tensors.items(), key=lambda kv: ".experts." not in kv[0])
                   if len(shape) == 2 and shape[0] != shape[1] and (".experts." in n or "_proj" in n))
    dtype, shape = tensors[flipped]
    with pytest.raises(InputError) as refused:
        checks.check_tensors(config, {**tensors, flipped: (dtype, shape[::-1])}, {}, str(model))
    assert flipped in refused.value.message and "(transposed)" in refused.value.message


# --------------------------------------------------------------------------- item 8: quantized sources by tensors

def _quanto(ts: dict) -> None:
    """optimum-quanto's qint8 layout without its quantization config: X.weight._data (I8) + X.weight._scale."""
    for n in [n for n in ts if n.endswith("_proj.weight")]:
        w = ts.pop(n)
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        ts[n + "._data"] = torch.round(w / scale).to(torch.int8)
        ts[n + "._scale"] = scale


def _stripped_int8_w8a8(ts: dict) -> None:
    """An INT8 W8A8 checkpoint (compressed-tensors int-quantized names) whose quantization_config was stripped."""
    for n in [n for n in ts if n.endswith("_proj.weight")]:
        w = ts[n]
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        ts[n] = torch.round(w / scale).to(torch.int8)
        ts[n[: -len(".weight")] + ".weight_scale"] = scale
        ts[n[: -len(".weight")] + ".input_scale"] = torch.ones(1)


@pytest.mark.parametrize("change, kind, evidence", [
    (_quanto, "int8", "optimum-quanto's layout"),
    (_stripped_int8_w8a8, "int8", "beside the I8 weight"),
])
def test_a_quantized_source_without_a_config_is_found_from_its_tensors(change, kind: str, evidence: str,
                                                                      tiny_model_session: Path, tmp_path: Path) -> None:
    model = _with_tensors(tiny_model_session, tmp_path, change)
    code, out = plan(model, tmp_path)
    assert code == 7, out
    assert f"already quantized ({kind}: " in out and evidence in out and f"are {kind} codes" in out, out
    assert "FP8" not in out and "fp8" not in out  # an INT8 checkpoint is not described as FP8
    assert "unquantized checkpoint it was made from" in out


@pytest.mark.parametrize("tensors, kind", [
    ({"m.layers.0.q_proj.weight._data": ("F8_E4M3", (8, 8)), "m.layers.0.q_proj.weight._scale": ("F32", (8, 1))},
     "fp8"),
    ({"m.layers.0.q_proj.weight._data": ("U8", (8, 4)), "m.layers.0.q_proj.weight._scale": ("F32", (8, 1)),
      "m.layers.0.q_proj.weight._shift": ("F32", (8, 1))}, "int4/fp4 (packed in U8)"),
    ({"m.layers.0.q_proj.weight": ("F8_E4M3", (8, 8)), "m.layers.0.q_proj.weight_scale": ("F32", (1,))}, "fp8"),
    ({"m.layers.0.q_proj.weight": ("I8", (8, 8)), "m.layers.0.q_proj.weight_scale": ("F32", (8, 1))}, "int8"),
    ({"m.layers.0.q_proj.weight": ("U8", (8, 4))}, "int4/fp4 (packed in U8)"),
    ({"m.layers.0.q_proj.weight": ("F4", (8, 8))}, "fp4"),
    ({"m.layers.0.q_proj.weight": ("BOOL", (8, 8))}, "quantized"),
    ({"m.layers.0.q_proj.parametrizations.weight.original0": ("F32", (8, 1))}, None),  # torch's weight_norm
])
def test_each_format_is_named_by_its_codes(tensors: dict, kind: str | None) -> None:
    found = checks.quantized_kind({"model_type": "llama"}, tensors)
    assert (found.kind if found else None) == kind


# --------------------------------------------------------------------------- item 10: the published class

def _custom_class(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["EvilForCausalLM"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))


def test_an_artifact_names_transformers_class_not_the_folders_code(tiny_model_session: Path, tmp_path: Path) -> None:
    import llmc.quant.stream as stream
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec

    model = Path(shutil.copytree(tiny_model_session, tmp_path / "m"))
    _custom_class(model)
    code, out = plan(model, tmp_path)
    assert code == 0 and "EvilForCausalLM" in out and "LlamaForCausalLM" in out, out
    stream.quantize_model(ModelSource(model, "t", "t"), Scheme(TensorSpec("fp8_e4m3", "channel")), tmp_path / "q",
                          None)
    export_compressed_tensors(QuantizedModel.open(tmp_path / "q"), tmp_path / "export")
    published = json.loads((tmp_path / "export" / "config.json").read_text())
    assert published["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in published


def test_a_custom_class_transformers_cannot_stand_in_for_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError) as refused:
        transformers_architectures({"model_type": "vit", "architectures": ["EvilForCausalLM"]}, tmp_path)
    assert "EvilForCausalLM" in refused.value.message and "no causal-LM class for model_type 'vit'" in \
        refused.value.message
    assert transformers_architectures({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
                                      tmp_path) == ["Qwen3ForCausalLM"]
