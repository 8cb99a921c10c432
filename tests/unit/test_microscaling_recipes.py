"""Single-scheme microscaling recipes end to end: NVFP4 (W4A16, W4A4), MXFP4, MXFP8 and block-wise FP8 are planned,
quantized into the canonical form, exported as compressed-tensors and reloaded by the torch engine
(tests/unit/test_roundtrip.py checks the reloaded model against llmc's reference); here the recipe side, the
compressed-tensors config, the refusals and the scale-search quantizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from llmc.errors import IncompatibleTargetError, RecipeError
from llmc.formats.compressed_tensors import export_compressed_tensors, quantization_config, spec_from_args
from llmc.model.source import ModelSource
from llmc.planning.plan import make_plan
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import MICROSCALING_FORMATS, dequantize_blocks, quantize_blocks
from llmc.quant.numerics import QuantizedWeight, dequantize_weight, weight_global_scales
from llmc.quant.scale_search import block_errors
from llmc.quant.stream import quantize_model
from llmc.recipe.load import parse_recipe

NVFP4 = {"format": "nvfp4", "strategy": "group", "group_size": 16}
MXFP4 = {"format": "mxfp4", "strategy": "group", "group_size": 32}
MXFP8 = {"format": "mxfp8", "strategy": "group", "group_size": 32}
QUANT = {
    "W4A16-NVFP4": {"weights": NVFP4},
    "W4A4-NVFP4": {"weights": NVFP4, "activations": NVFP4},
    "W4A16-MXFP4": {"weights": MXFP4},
    "W8A8-MXFP8": {"weights": MXFP8, "activations": {**MXFP8, "dynamic": True}},
    "W8A8-FP8-BLOCK": {"weights": {"format": "fp8_e4m3", "strategy": "block"},
                       "activations": {"format": "fp8_e4m3", "strategy": "group", "group_size": 128, "dynamic": True}},
}
# compressed-tensors' compression format and weight strategy for each (its presets, what vLLM matches kernels on)
CONFIG = {"W4A16-NVFP4": ("nvfp4-pack-quantized", "tensor_group"), "W4A4-NVFP4": ("nvfp4-pack-quantized", "tensor_group"),
          "W4A16-MXFP4": ("mxfp4-pack-quantized", "group"), "W8A8-MXFP8": ("mxfp8-quantized", "group"),
          "W8A8-FP8-BLOCK": ("float-quantized", "block")}


def recipe(quant: dict, *targets: dict, source: str = "demo:smollm2-135m"):
    return parse_recipe(yaml.safe_dump({"name": "mx", "model": {"source": source}, "quantization": quant,
                                        "targets": list(targets) or [{"runtime": "vllm", "gpu_arch": "sm100"}]}))


@pytest.mark.parametrize("name", QUANT)
def test_the_planner_accepts_each_scheme_for_vllm_on_blackwell(name: str) -> None:
    plan = make_plan(recipe(QUANT[name]))
    assert plan.scheme.name == name
    assert [t["status"] for t in plan.targets] == ["native"]


@pytest.mark.parametrize("name", QUANT)
def test_the_compressed_tensors_config_is_the_preset_vllm_matches(name: str) -> None:
    scheme = recipe(QUANT[name]).quantization.to_scheme()
    config = quantization_config(scheme)
    fmt, strategy = CONFIG[name]
    assert config["format"] == fmt and config["quant_method"] == "compressed-tensors"
    group = config["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == strategy and group["weights"]["type"] == "float"
    assert ("input_activations" in group) == (scheme.activations is not None)
    if name == "W8A8-FP8-BLOCK":
        assert group["weights"]["block_structure"] == [128, 128]
        assert group["input_activations"]["group_size"] == 128 and group["input_activations"]["dynamic"] is True
    else:
        assert group["weights"]["group_size"] == scheme.weights.group_size
    # read back (llmc inspect, the torch engine's activation hooks): the same specs
    assert spec_from_args(group["weights"]) == scheme.weights
    if scheme.activations is not None:
        assert spec_from_args(group["input_activations"]) == scheme.activations


def test_a_runtime_without_the_scheme_is_refused_naming_the_runtimes_that_take_it() -> None:
    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(recipe(QUANT["W8A8-FP8-BLOCK"], {"runtime": "tgi", "gpu_arch": "sm90"}))
    assert "tgi does not run W8A8-FP8-BLOCK" in e.value.message
    assert "runtimes that do: vllm, sglang" in e.value.message


def test_mx_on_hopper_is_refused_with_the_arch_it_needs() -> None:
    with pytest.raises(IncompatibleTargetError, match="sm100"):
        make_plan(recipe(QUANT["W8A8-MXFP8"], {"runtime": "vllm", "gpu_arch": "sm90"}))


def test_block_fp8_activation_groups_must_divide_the_model_widths() -> None:
    config = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
              "tie_word_embeddings": True, "hidden_size": 576, "num_hidden_layers": 1, "vocab_size": 100,
              "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(IncompatibleTargetError, match=r"groups of 128, which do not divide input dimension\(s\) \[576\]"):
        make_plan(recipe(QUANT["W8A8-FP8-BLOCK"]), config=config)


@pytest.mark.parametrize(("quant", "message"), [
    ({"weights": NVFP4, "algorithm": "smoothquant"}, "algorithm smoothquant does not quantize nvfp4"),
    ({**QUANT["W8A8-FP8-BLOCK"], "algorithm": "gptq"}, "gptq does not quantize block-wise FP8"),
    ({"weights": {"format": "int4", "strategy": "group", "group_size": 32}, "algorithm": "gptq",
      "options": {"block_scales": "search"}}, "block_scales search chooses nvfp4, mxfp4 or mxfp8 block scales"),
    ({**QUANT["W4A4-NVFP4"], "algorithm": "awq"}, "awq searches nvfp4 weight-only schemes"),
    ({**QUANT["W8A8-MXFP8"], "algorithm": "awq"}, "awq is a 4-bit weight method"),
    ({"weights": {**MXFP4, "group_size": 16}}, "mxfp4 uses 32-element groups"),
    ({"weights": {"format": "int8", "strategy": "block"}}, "strategy 'block' is block-wise FP8"),
    ({"weights": {"format": "fp8_e4m3", "strategy": "channel"}, "activations": QUANT["W8A8-FP8-BLOCK"]["activations"]},
     "block-wise FP8 pairs 128x128 weight blocks"),
    ({"weights": MXFP8, "activations": MXFP8}, "mxfp8 activations are scaled per block at run time"),
    ({"weights": {"format": "int4", "strategy": "group", "group_size": 32}, "algorithm": "scale_search"},
     "scale_search chooses block scales of nvfp4, mxfp4 or mxfp8"),
])
def test_what_the_formats_cannot_do_is_a_recipe_error(quant: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        recipe(quant)


def test_canonical_form_and_export_hold_the_codes_and_scales_as_the_format_stores_them(tiny_model: Path,
                                                                                       tmp_path: Path) -> None:
    scheme = recipe(QUANT["W4A16-NVFP4"], source=str(tiny_model)).quantization.to_scheme()
    quantize_model(ModelSource(tiny_model, "t", "t"), scheme, tmp_path / "q", None)
    qm = QuantizedModel.open(tmp_path / "q")
    module = "model.layers.0.mlp.down_proj"
    with safe_open(str(tmp_path / "q" / "layers" / "00000.safetensors"), "pt") as h:
        codes, scale = h.get_tensor(f"{module}.weight"), h.get_tensor(f"{module}.weight_scale")
        global_scale = h.get_tensor(f"{module}.weight_global_scale")
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.dtype == torch.float8_e4m3fn
    assert scale.shape == (codes.shape[0], codes.shape[1] // 16) and global_scale.shape == (1,)
    export_compressed_tensors(qm, tmp_path / "artifact")
    config = json.loads((tmp_path / "artifact" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    with safe_open(str(next((tmp_path / "artifact").glob("*.safetensors"))), "pt") as h:
        packed = h.get_tensor(f"{module}.weight_packed")
        assert f"{module}.weight" not in h.keys()
    assert packed.shape == (codes.shape[0], codes.shape[1] // 2)
    assert torch.equal(packed & 0x0F, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])


def test_compressed_tensors_decodes_llmcs_nvfp4_to_its_values_rounded_to_bf16(tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    """Why the torch engine decodes NVFP4 itself: compressed-tensors 0.20's NVFP4 decompressor unpacks into bfloat16
    whatever the model's dtype. Max |Δ| between its decode and llmc's values rounded once to bf16: 0."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = recipe(QUANT["W4A16-NVFP4"], source=str(tiny_model)).quantization.to_scheme()
    quantize_model(ModelSource(tiny_model, "t", "t"), scheme, tmp_path / "q", None)
    qm = QuantizedModel.open(tmp_path / "q")
    export_compressed_tensors(qm, tmp_path / "artifact")
    group = json.loads((tmp_path / "artifact" / "config.json").read_text())["quantization_config"]["config_groups"]
    ct_scheme = QuantizationScheme.model_validate(group["group_0"])
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    canonical = next(qm.iter_files())
    with safe_open(str(next((tmp_path / "artifact").glob("*.safetensors"))), "pt") as h:
        for module in [m for m in qm.quantized_modules if f"{m}.weight" in canonical]:
            state = {k: h.get_tensor(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            theirs = compressor.decompress(state, ct_scheme)["weight"]
            ours = qm.dequantized_weight(canonical, module)
            assert theirs.dtype == torch.bfloat16
            assert (theirs.float() - ours.to(torch.bfloat16).float()).abs().max().item() == 0.0
            assert (theirs.float() - ours).abs().max().item() > 0  # the rounding the engine avoids


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_scale_search_never_loses_to_rounding_and_wins_somewhere(fmt: str, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    """The scale_search quantizer through the stream: every block's error at most RTN's (the RTN scale is a
    candidate), the total lower; its codes dequantize through the canonical form like RTN's."""
    block = MICROSCALING_FORMATS[fmt].block_size
    weights = {"format": fmt, "strategy": "group", "group_size": block}
    acts = {"activations": {**weights, "dynamic": True}} if fmt == "mxfp8" else {}  # W8A8-MXFP8: vLLM's scheme
    scheme = recipe({"weights": weights, **acts, "algorithm": "scale_search"},
                    source=str(tiny_model)).quantization.to_scheme()
    quantize_model(ModelSource(tiny_model, "t", "t"), scheme, tmp_path / "q", None)
    qm = QuantizedModel.open(tmp_path / "q")
    source = {}
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as h:
        source = {k: h.get_tensor(k) for k in h.keys()}
    canonical = next(qm.iter_files())
    searched_total = rtn_total = 0.0
    modules = [m for m in qm.quantized_modules if f"{m}.weight" in canonical]
    global_scales = weight_global_scales({m: source[f"{m}.weight"].float() for m in modules}, scheme.weights)
    for module in modules:
        w = source[f"{module}.weight"].float()
        rtn = quantize_blocks(w, MICROSCALING_FORMATS[fmt], global_scales.get(module))
        searched = qm.dequantized_weight(canonical, module)
        q = QuantizedWeight(canonical[f"{module}.weight"], canonical[f"{module}.weight_scale"], None,
                            canonical.get(f"{module}.weight_global_scale"))
        assert torch.equal(dequantize_weight(q, scheme.weights), searched)
        err_search = ((searched - w) ** 2).unflatten(-1, (-1, block)).sum(-1)
        err_rtn = block_errors(w, rtn)
        assert (err_search <= err_rtn + 1e-12).all()
        assert torch.equal(dequantize_blocks(rtn), dequantize_weight(
            QuantizedWeight(rtn.codes, rtn.scale, None, rtn.global_scale), scheme.weights))
        searched_total += err_search.sum().item()
        rtn_total += err_rtn.sum().item()
    assert searched_total < rtn_total


@pytest.mark.parametrize("algorithm", ["rtn", "scale_search", "gptq"])
def test_fused_siblings_share_one_nvfp4_global_scale_in_the_canonical_form(algorithm: str, tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    """vLLM and SGLang load q/k/v and gate/up as one matmul with one global scale (the largest stored): the
    quantize stage gives the siblings their joint one, from their joint amax; an unfused Linear keeps its own.
    GPTQ's global scale is round-to-nearest's, from the weights before its column loop."""
    from llmc.quant.microscaling import nvfp4_global_scale
    from llmc.quant.stream import Calibration

    scheme = recipe({**QUANT["W4A16-NVFP4"], "algorithm": algorithm}, source=str(tiny_model)).quantization.to_scheme()
    calibration = (Calibration(torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(0)))
                   if scheme.needs_calibration else None)
    quantize_model(ModelSource(tiny_model, "t", "t"), scheme, tmp_path / "q", calibration)
    weights = {}
    from safetensors.torch import load_file

    for f in sorted((tiny_model).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    with safe_open(str(tmp_path / "q" / "layers" / "00000.safetensors"), "pt") as h:
        scales = {n: h.get_tensor(f"model.layers.0.{n}.weight_global_scale")
                  for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}

    def joint(*names: str) -> torch.Tensor:
        amax = torch.stack([weights[f"model.layers.0.{n}.weight"].abs().amax().float() for n in names]).amax()
        return nvfp4_global_scale(amax).reshape(1)

    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                  ("self_attn.o_proj",), ("mlp.down_proj",)):
        for name in group:
            torch.testing.assert_close(scales[name], joint(*group), rtol=0, atol=0)
    assert not torch.equal(scales["self_attn.q_proj"], scales["self_attn.o_proj"])
