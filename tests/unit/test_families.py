"""Every dense family on tiny random models built from transformers' own config classes (tests/unit/families.py):
layer discovery finds the smoothing pairs the family really has, and FP8 (static + KV), INT8 SmoothQuant W8A8,
INT4 GPTQ and INT4 AWQ quantize through the layer stream; the compressed-tensors export reloads in transformers
(llmc's torch engine) with the logits of the fake-quantized reference computed here from llmc's numerics."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.engines.torch_ref import TorchEngine
from llmc.model.source import ModelSource
from llmc.quant import stream
from llmc.quant.algorithms import mappings
from llmc.quant.canonical import QuantizedModel
from llmc.quant.numerics import dequantize_weight, fake_quantize, quantize_weight
from llmc.quant.spec import Scheme, TensorSpec
from tests.unit.families import EXPECTED_PAIRS, EXPECTED_PAIRS_BY_LAYER, FAMILIES, QUANTIZED_LINEARS, make_tiny

SCHEMES = {
    "fp8-static-kv": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                            kv_cache=TensorSpec("fp8_e4m3", "tensor")),
    "int8-smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True),
                               algorithm="smoothquant"),
    "int4-gptq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"),
    "int4-awq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="awq"),
}
SEQ = 24  # longer than the sliding windows of the Gemma models (6), so sliding layers really mask


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_tiny(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _ids(n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(3, 200, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 1
    return ids


def test_discovery_finds_each_familys_smoothing_pairs(family, tmp_path: Path, monkeypatch) -> None:
    """The pairs found by tracing each layer: Llama-style pre-norms, Gemma's pre_feedforward_layernorm, Phi-3's
    fused row slices, none from OLMo 2's post-norms; a true pair rescaled keeps the layer's function."""
    name, folder = family
    found: dict[int, list] = {}
    real = mappings.remember
    monkeypatch.setattr(mappings, "remember", lambda layer, ms: (found.__setitem__(id(layer), ms), real(layer, ms)))
    stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES["int8-smoothquant"], tmp_path / "q",
                          stream.Calibration(_ids(4, 1)))
    assert len(found) == 2  # every layer recorded
    expected = EXPECTED_PAIRS_BY_LAYER[name] if name in EXPECTED_PAIRS_BY_LAYER else [EXPECTED_PAIRS[name]] * 2
    for pairs, want in zip(found.values(), expected):
        assert [(m.producer, m.consumers[0]) for m in pairs] == want
    if name == "phi3":  # the v rows of qkv_proj (no GQA here) and the up half of gate_up_proj
        rows = {m.producer: m.producer_rows for m in next(iter(found.values())) if not m.from_norm}
        assert rows == {"self_attn.qkv_proj": (128, 192), "mlp.gate_up_proj": (128, 256)}


def _fake_quantized_reference(folder: Path, qm: QuantizedModel, scheme: Scheme, from_original: bool,
                              prepare=None) -> nn.Module:
    """The float model computing what the scheme computes: weights from llmc's numerics (RTN: quantized here
    from the original weights; transforms: the canonical form's dequantized, transformed weights and norms),
    activations fake-quantized with the canonical input scales, keys/values with its k/v scales. `prepare(model)`
    runs first (MoE: experts as per-expert Linears, tests/unit/test_moe.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if prepare is not None:
        prepare(model)
    tensors = {k: v for t in qm.iter_files() for k, v in t.items()}
    state = {}
    for module in qm.quantized_modules:
        lin = model.get_submodule(module)
        state[f"{module}.weight"] = (dequantize_weight(quantize_weight(lin.weight.data, scheme.weights), scheme.weights)
                                     if from_original else qm.dequantized_weight(tensors, module))
        act = scheme.activations
        if act is not None:
            scale = None if act.dynamic else tensors[f"{module}.input_scale"]
            lin.register_forward_pre_hook(lambda _m, a, s=scale, sp=act: (fake_quantize(a[0], sp, s), *a[1:]))
    if not from_original:  # smoothed norms and biases
        own = model.state_dict()
        state.update({k: v for k, v in tensors.items() if k in own and k not in state})
    model.load_state_dict(state, strict=False)
    if scheme.kv_cache is not None:
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
        from transformers.modeling_utils import AttentionInterface

        base = model.config._attn_implementation
        scales = {id(model.get_submodule(m)): (tensors[f"{m}.k_scale"], tensors[f"{m}.v_scale"])
                  for m in qm.kv_cache_modules}

        def attention(module, q, k, v, mask, **kw):
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            ks, vs = scales[id(module)]
            k, v = fake_quantize(k, scheme.kv_cache, ks), fake_quantize(v, scheme.kv_cache, vs)
            if base == "eager":
                return sys.modules[type(module).__module__].eager_attention_forward(module, q, k, v, mask, **kw)
            return sdpa_attention_forward(module, q, k, v, mask, **kw)

        # the mask the base attention takes: an eager function adds a float mask (given SDPA's boolean one it adds
        # 0/1 and masks nothing)
        reference = f"test_kv_reference_{base}"
        AttentionInterface.register(reference, attention)
        AttentionMaskInterface.register(reference, eager_mask if base == "eager" else sdpa_mask)
        model.config._attn_implementation = reference
    return model


def roundtrip(folder: Path, scheme: Scheme, work: Path, prepare=None) -> tuple[float, float, int]:
    """(max |export logits - reference logits|, max |reference - float model|, quantized Linears): quantize
    `folder` with `scheme`, export compressed-tensors, reload in transformers through llmc's torch engine.
    `prepare`: as for `_fake_quantized_reference` (MoE: llmc.quant.moe.unfuse_experts)."""
    from transformers import AutoModelForCausalLM

    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, work / "q",
                          stream.Calibration(_ids(4, 1), batch_size=2) if scheme.needs_calibration else None)
    qm = QuantizedModel.open(work / "q")
    export_compressed_tensors(qm, work / "export")
    ids = _ids(2, 2)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=ids).logits
        want = _fake_quantized_reference(folder, qm, scheme, scheme.algorithm == "rtn", prepare)(input_ids=ids).logits
        got = TorchEngine(work / "export", streamed=False).model(input_ids=ids, use_cache=False).logits
    return (got - want).abs().max().item(), (want - base).abs().max().item(), len(qm.quantized_modules)


@pytest.mark.heavy
@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_compressed_tensors_export_reloads_with_the_reference_logits(family, scheme_name: str, tmp_path: Path) -> None:
    name, folder = family
    diff, effect, quantized = roundtrip(folder, SCHEMES[scheme_name], tmp_path)
    assert quantized == QUANTIZED_LINEARS.get(name, 2 * 7)  # Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj
    assert effect > 1e-3, "quantization must be visible"
    assert diff < 1e-4, f"{name} {scheme_name}: export logits differ from the fake-quantized reference by {diff}"


def _recipe(folder: Path, *targets: dict):
    import yaml

    from llmc.recipe.load import parse_recipe

    return parse_recipe(yaml.safe_dump({"name": "f", "model": {"source": str(folder)},
                                        "quantization": {"weights": {"format": "int4", "strategy": "group",
                                                                     "group_size": 32}},
                                        "targets": list(targets)}))


def test_plan_refuses_targets_whose_format_lacks_the_family_before_any_weight_loads(tmp_path: Path, monkeypatch) -> None:
    """Per-format family lists are data (llmc/runtimes/*): OLMo 2 to ONNX Runtime or TensorRT-LLM is refused at plan
    time with the runtimes that take it; GGUF and compressed-tensors take it."""
    from llmc.errors import IncompatibleTargetError
    from llmc.model import checkpoint
    from llmc.planning.plan import make_plan

    folder = make_tiny("olmo2", tmp_path / "olmo2")
    read_weights = checkpoint.CheckpointReader.get_many

    def refuse_this_model(reader, *args, **kwargs):  # the planner's own probe model (cold rates cache) may be read
        if reader.folder.resolve() == folder.resolve():
            pytest.fail("weights were read")
        return read_weights(reader, *args, **kwargs)

    monkeypatch.setattr(checkpoint.CheckpointReader, "get_many", refuse_this_model)
    for target in ({"runtime": "onnxruntime", "gpu_arch": "cpu"}, {"runtime": "tensorrt-llm", "gpu_arch": "sm90"},
                   {"runtime": "lmdeploy", "gpu_arch": "sm90"}):
        with pytest.raises(IncompatibleTargetError, match="model_type is 'olmo2'") as refused:
            make_plan(_recipe(folder, target), folder)
        assert "vllm" in refused.value.fix and "llama.cpp" in refused.value.fix
    plan = make_plan(_recipe(folder, {"runtime": "vllm", "gpu_arch": "sm90"}, {"runtime": "llama.cpp"}), folder)
    assert [t["exporter"] for t in plan.targets] == ["compressed-tensors", "gguf"]


def test_plan_takes_supported_mixture_of_experts_families_and_refuses_the_rest_from_the_config(tmp_path: Path) -> None:
    """A tiny random Mixtral plans for vLLM (compressed-tensors exports its experts, tests/unit/test_moe.py) and for
    llama.cpp (GGUF merges them, tests/unit/test_gguf_moe.py); an Ollama target is refused at plan time naming the
    runtimes that take it; DeepSeek-V2 (MLA, shared experts, no tested layout) is refused with that reason, from
    config.json alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.errors import IncompatibleTargetError
    from llmc.model.families import check_quantizable
    from llmc.planning.plan import make_plan

    config = AutoConfig.for_model("mixtral", vocab_size=300, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mixtral")
    plan = make_plan(_recipe(tmp_path / "mixtral", {"runtime": "vllm", "gpu_arch": "sm90"}), tmp_path / "mixtral")
    assert [t["exporter"] for t in plan.targets] == ["compressed-tensors"]
    plan = make_plan(_recipe(tmp_path / "mixtral", {"runtime": "llama.cpp"}), tmp_path / "mixtral")
    assert [t["exporter"] for t in plan.targets] == ["gguf"]
    with pytest.raises(IncompatibleTargetError, match="ollama does not load llmc's gguf artifact") as refused:
        make_plan(_recipe(tmp_path / "mixtral", {"runtime": "ollama"}), tmp_path / "mixtral")
    assert "vllm" in refused.value.fix and "llama.cpp" in refused.value.fix
    with pytest.raises(IncompatibleTargetError, match="multi-head latent attention"):
        check_quantizable({"model_type": "deepseek_v2", "n_routed_experts": 160})


def test_qwen3_5_keeps_its_gated_deltanet_gate_projections_in_float(tmp_path: Path) -> None:
    """Issue 45: Qwen3.5's linear-attention per-head gate projections in_proj_b / in_proj_a (4 output rows here) were
    quantized, with no plan line. The plan now names them, the stream stores them as they were (no scale), and the
    export lists them as unquantized; the rest of the gated-DeltaNet layer (in_proj_qkv, in_proj_z, out_proj; the
    conv1d, A_log, dt_bias and norms are no Linears) is quantized, and the FP8 KV cache holds the full-attention
    layer's keys and values only (a linear-attention layer has a recurrent state, kept in the model's dtype)."""
    import json

    from llmc.planning.plan import make_plan

    folder = make_tiny("qwen3_5", tmp_path / "model")
    plan = make_plan(_recipe(folder, {"runtime": "vllm", "gpu_arch": "sm90"}), folder)
    (line,) = [w for w in plan.warnings if "gated-DeltaNet" in w]
    assert line.startswith("2 Linears (in_proj_a, in_proj_b): ") and "kept in the model's dtype" in line
    scheme = Scheme(TensorSpec("fp8_e4m3", "channel"), kv_cache=TensorSpec("fp8_e4m3", "tensor"))
    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, tmp_path / "q", stream.Calibration(_ids(4, 1)))
    qm = QuantizedModel.open(tmp_path / "q")
    gates = {"model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b"}
    assert not gates & set(qm.quantized_modules)
    assert {f"model.layers.0.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "out_proj")} <= set(
        qm.quantized_modules) and len(qm.quantized_modules) == QUANTIZED_LINEARS["qwen3_5"]
    tensors = {k: v for t in qm.iter_files() for k, v in t.items()}
    original = load_file(str(folder / "model.safetensors"))
    for gate in gates:
        assert torch.equal(tensors[f"{gate}.weight"], original[f"{gate}.weight"])
        assert f"{gate}.weight_scale" not in tensors
    assert qm.kv_cache_modules == ["model.layers.1.self_attn"]
    export_compressed_tensors(qm, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    assert gates <= set(config["ignore"])
