"""Gemma-4's MoE variant (issue 45; transformers 5.23 `Gemma4TextDecoderLayer` with `enable_moe_block`): a row of the
family tables (`llmc.model.families.LAYOUTS["gemma4_text"]`, block "": the decoder layer itself holds `experts` and
`router` beside its dense `mlp`), on a tiny random model (tests/unit/families.py GEMMA4_MOE: 2 layers, 4 experts top-2,
per-layer inputs 32 wide). Checked: the per-expert Linears compute transformers' fused experts; the router's Linear
(`router.proj`) stays in float while the layer's other 2-D Linears (per-layer-input gate and projection) are quantized;
the layer-by-layer calibration forward equals transformers' whole forward; the FP8 and W4A16 GPTQ exports reload in
llmc's torch engine with the fake-quantized reference's logits and (W4A16) decode in plain transformers (experts
re-fused) to llmc's logits; the config-only planner lays out every tensor transformers' model holds. SmoothQuant and
AWQ: the norm -> experts pair is pre_feedforward_layernorm_2 (the router, reading the residual, left as it is), the
smoothing keeps the model's function before quantization, and SmoothQuant W8A8 / AWQ W4A16 exports decode in plain
transformers to llmc's logits (AWQ's cases heavy: ~25-30 s of CPU each)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.quant import moe
from llmc.quant.algorithms import mappings
from tests.unit.families import GEMMA4_MOE, make_tiny
from tests.unit.test_families import SCHEMES, _ids
from tests.unit.test_moe import (_float_model, _quantize, _tensors, _transformers_logits_of_export,
                                 _transformers_model_of_export, export_gives_the_reference_logits)

# per layer: q/k/v/o, the dense MLP's 3, the per-layer-input gate and projection, 4 experts x 3
PER_LAYER = 4 + 3 + 2 + 4 * 3


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory) -> Path:
    return make_tiny("gemma4_moe", tmp_path_factory.mktemp("gemma4-moe") / "model")


def test_gemma4_per_expert_linears_compute_transformers_fused_experts(gemma4_moe: Path) -> None:
    """The decoder layer is the block: unfusing names it (not a child), the experts become Linears that view the
    fused [E, 2I, H] parameter (gate rows, then up rows), the logits stay transformers' (bit-identical here; asserted
    to 1e-6), and only `router.proj` is a router: the per-layer-input Linears beside it are not."""
    model = _float_model(gemma4_moe)
    fused = model.model.layers[0].experts.gate_up_proj
    inter = fused.shape[1] // 2
    ids = _ids(2, 3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        blocks = moe.unfuse_experts(model)
        after = model(input_ids=ids).logits
    assert blocks == ["model.layers.0", "model.layers.1"]
    assert (after - before).abs().max().item() < 1e-6 and before.abs().max().item() > 0.1
    expert = model.get_submodule("model.layers.0.experts.2")
    assert torch.equal(expert.gate_proj.weight, fused[2][:inter]) and expert.gate_proj.weight.data_ptr() == fused[2].data_ptr()
    assert torch.equal(expert.up_proj.weight, fused[2][inter:])
    layer = model.model.layers[0]
    assert moe.layer_routers(layer) == {"router.proj"}
    assert moe.router_names(model, blocks) == ["model.layers.0.router.proj", "model.layers.1.router.proj"]
    assert set(moe.expert_names(layer)) == {f"experts.{e}.{p}" for e in range(4)
                                            for p in ("gate_proj", "up_proj", "down_proj")}
    with safe_open(str(gemma4_moe / "model.safetensors"), "pt") as f:  # the checkpoint holds the fused tensors
        saved = moe.per_expert_shapes({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()},
                                      moe.layout_of(model.config))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"} == {
        k: v for k, v in saved.items() if k != "lm_head.weight"}  # tied head


def test_gemma4_layer_by_layer_calibration_sees_the_whole_models_activations(gemma4_moe: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """The stream's forward (the router on the residual, the experts on pre_feedforward_layernorm_2's output, their
    sum with the dense MLP's, the per-layer inputs) gives every quantized Linear the per-channel input ranges
    transformers' whole-model forward gives it; the check sees the routing weights (per_expert_scale set to 1 moves
    layer 1's ranges). The router's Linear is kept, and the export ignores it."""
    from transformers import AutoModelForCausalLM

    from tests.unit.test_gemma3 import _linear_input_absmax, observing_channel_absmax

    calib = _ids(4, 1)
    whole = _float_model(gemma4_moe)
    moe.unfuse_experts(whole)
    ref = {k: v for k, v in _linear_input_absmax(whole, calib).items() if not k.endswith(".router.proj")}
    unscaled = AutoModelForCausalLM.from_pretrained(gemma4_moe, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in unscaled.model.layers:
            layer.router.per_expert_scale.fill_(1.0)
    moe.unfuse_experts(unscaled)
    assert not torch.allclose(_linear_input_absmax(unscaled, calib)["model.layers.1.self_attn.q_proj"],
                              ref["model.layers.1.self_attn.q_proj"], rtol=1e-4)
    observed = observing_channel_absmax(monkeypatch)
    qm = _quantize(gemma4_moe, SCHEMES["fp8-static-kv"], tmp_path / "q")
    assert len(ref) == len(observed) == len(qm.quantized_modules) == 2 * PER_LAYER
    for name, absmax in ref.items():
        torch.testing.assert_close(observed[name], absmax, rtol=1e-5, atol=1e-6, msg=name)
    assert qm.meta["moe"]["ignore"] == ["re:.*\\.router\\.proj$"]
    assert qm.meta["moe"]["routers"] == ["model.layers.0.router.proj", "model.layers.1.router.proj"]
    assert {"model.layers.0.per_layer_input_gate", "model.layers.1.per_layer_projection"} <= set(qm.quantized_modules)
    tokens = qm.meta["moe"]["tokens"]["blocks"]
    assert sorted(tokens) == ["model.layers.0", "model.layers.1"]
    assert all(sum(b["tokens"]) == calib.numel() * 2 for b in tokens.values())  # top-2 of every token


@pytest.mark.parametrize("scheme_name", ["fp8-static-kv", "int4-gptq"])
def test_gemma4_moe_export_reloads_with_the_reference_logits(gemma4_moe: Path, scheme_name: str,
                                                             tmp_path: Path) -> None:
    """FP8 W8A8 static + KV and W4A16 GPTQ: experts per expert under vLLM's gemma4 names (layers.L.experts.E.*),
    router.proj float and ignored; llmc's torch engine on the export gives the fake-quantized reference's logits;
    W4A16 decoded by compressed-tensors into plain transformers (experts re-fused: transformers 5.23 has no
    per-expert names for Gemma-4) gives llmc's logits too."""
    scheme = SCHEMES[scheme_name]
    qm = _quantize(gemma4_moe, scheme, tmp_path / "q")
    tensors = _tensors(qm)
    assert tensors["model.layers.0.router.proj.weight"].dtype == torch.float32
    assert not [k for k, t in tensors.items() if t.dim() == 3 and t.is_floating_point()]  # no fused expert left
    export_compressed_tensors(qm, tmp_path / "export")
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.experts.3.down_proj.weight_scale", "model.layers.1.router.proj.weight",
            "model.layers.1.router.per_expert_scale", "model.layers.1.mlp.gate_proj.weight_scale"} <= names
    assert "model.layers.1.router.proj.weight_scale" not in names
    ids, got = export_gives_the_reference_logits(gemma4_moe, qm, scheme, tmp_path / "export")
    if scheme_name == "int4-gptq":
        assert (_transformers_logits_of_export(tmp_path / "export", gemma4_moe, ids) - got).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", [{}, {"num_kv_shared_layers": 2, "use_double_wide_mlp": True}])
def test_gemma4_moe_is_planned_tensor_by_tensor_as_transformers_builds_it(variant: dict) -> None:
    """From config.json alone (llmc.model.shape_rows gemma4_text, llmc.planning.shapes): per MoE layer the router's
    Linear, scale and per-expert scales, the experts (fused in the checkpoint, split per expert as the build reads
    them), the three norms only an MoE layer has, and the dense MLP beside them: every tensor transformers' model
    holds, by name and shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.planning.shapes import from_config

    _, overrides = GEMMA4_MOE["gemma4_moe"]
    kwargs = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "vocab_size": 300, "vocab_size_per_layer_input": 300, "tie_word_embeddings": True,
              **overrides, "layer_types": ["sliding_attention", "full_attention"] * 2, **variant}
    config = AutoConfig.for_model("gemma4_text", **kwargs)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    theirs = moe.per_expert_shapes({n: tuple(t.shape) for n, t in built.state_dict().items() if n != "lm_head.weight"},
                                   moe.layout_of(config))
    planned = from_config(config.to_dict())
    assert planned.shapes == theirs
    assert "model.layers.3.experts.3.down_proj.weight" in planned.shapes


@pytest.fixture(scope="module")
def gguf_export(gemma4_moe: Path, tmp_path_factory):
    """The tiny model quantized W8A16 (int8 per channel -> Q8_0) and written as GGUF."""
    from llmc.formats import gguf as G
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    root = tmp_path_factory.mktemp("gemma4-moe-gguf")
    quantize_model(ModelSource(gemma4_moe, "t", str(gemma4_moe)), Scheme(TensorSpec("int8", "channel")), root / "q",
                   None)
    qm = QuantizedModel.open(root / "q")
    return qm, G.export_gguf(qm, root / "out")


def test_gemma4_moe_gguf_holds_what_llama_cpps_gemma4_reads_for_its_moe_layers(gguf_export) -> None:
    """Per MoE layer, the tensors src/models/gemma4.cpp load_arch_tensors creates for one (ggml ne order: input dim
    first): the router ffn_gate_inp [H, E] (F32) with its input scale ffn_gate_inp.scale [H], the merged
    ffn_gate_up_exps [H, 2I, E] (each expert's gate rows, then its up rows), ffn_down_exps [I, H, E] and its
    per-expert output scales ffn_down_exps.scale [E], the norms pre_ffw_norm_2, post_ffw_norm_1 / _2, beside the
    dense MLP; the expert keys; every value decodes to llmc's canonical one (Q8_0: to fp16 block-scale rounding)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    qm, res = gguf_export
    reader = GGUFReader(str(res.path))
    tensors = {t.name: t for t in reader.tensors}
    h, experts, inter = 64, 4, 128
    moe_layer = {"ffn_gate_inp.weight": (h, experts), "ffn_gate_inp.scale": (h,), "pre_ffw_norm_2.weight": (h,),
                 "post_ffw_norm_1.weight": (h,), "post_ffw_norm_2.weight": (h,),
                 "ffn_gate_up_exps.weight": (h, 2 * inter, experts), "ffn_down_exps.weight": (inter, h, experts),
                 "ffn_down_exps.scale": (experts,), "ffn_gate.weight": (h, 128), "ffn_up.weight": (h, 128),
                 "ffn_down.weight": (128, h), "ffn_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    for i in range(2):
        for kind, shape in moe_layer.items():
            assert tuple(int(d) for d in tensors[f"blk.{i}.{kind}"].shape) == shape, (i, kind)
    assert not [n for n in tensors if "ffn_gate_exps" in n or "ffn_up_exps" in n]
    for key, value in (("expert_count", 4), ("expert_used_count", 2), ("expert_feed_forward_length", inter)):
        assert reader.fields[f"gemma4.{key}"].contents() == value, key

    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}

    def decoded(name: str) -> np.ndarray:
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape([int(d) for d in t.shape[::-1]])

    def weight(module: str) -> np.ndarray:
        return qm.dequantized_weight(canonical, module).numpy()

    for i in range(2):
        p = f"model.layers.{i}"
        gate_up, down = decoded(f"blk.{i}.ffn_gate_up_exps.weight"), decoded(f"blk.{i}.ffn_down_exps.weight")
        assert tensors[f"blk.{i}.ffn_gate_up_exps.weight"].tensor_type.name == "Q8_0"
        for e in range(experts):
            want = np.concatenate([weight(f"{p}.experts.{e}.gate_proj"), weight(f"{p}.experts.{e}.up_proj")])
            np.testing.assert_allclose(gate_up[e], want, rtol=0, atol=2.0**-10 * float(np.abs(want).max()))
            want = weight(f"{p}.experts.{e}.down_proj")
            np.testing.assert_allclose(down[e], want, rtol=0, atol=2.0**-10 * float(np.abs(want).max()))
        for kind, hf in (("ffn_gate_inp.weight", "router.proj.weight"), ("ffn_gate_inp.scale", "router.scale"),
                         ("ffn_down_exps.scale", "router.per_expert_scale")):
            assert tensors[f"blk.{i}.{kind}"].tensor_type.name == "F32", kind
            np.testing.assert_array_equal(decoded(f"blk.{i}.{kind}").reshape(canonical[f"{p}.{hf}"].shape),
                                          canonical[f"{p}.{hf}"].float().numpy(), err_msg=kind)


# --------------------------------------------------------------------------- SmoothQuant and AWQ (issue 45)

EXPERT_GATE_UP = tuple(f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj"))


def _layer_and_call(folder: Path, index: int):
    """Layer `index` of the float64 model (experts per expert) and a call of it on the inputs transformers' whole
    forward gives it (residual, per-layer input, rotary tables, mask)."""
    model = _float_model(folder).double()
    moe.unfuse_experts(model)
    layer = model.model.layers[index]
    seen: dict = {}
    hook = layer.register_forward_pre_hook(lambda _m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=_ids(1, 0), use_cache=False)
    hook.remove()
    return layer, seen["args"][0], lambda: layer(*seen["args"], **seen["kwargs"])


def test_gemma4_moe_smoothing_pairs_are_the_experts_own_norm_without_the_router(gemma4_moe: Path) -> None:
    """The experts read pre_feedforward_layernorm_2 of the residual; the router reads the residual itself (its own
    weightless norm, times router.scale); the dense MLP reads pre_feedforward_layernorm. So the one norm -> experts
    pair is pre_feedforward_layernorm_2 -> every expert's gate/up, the router left as it is, AWQ scoring the experts
    module (the layer, the block, reads the residual). The structural check rejects the wrong ones: the router
    scaled with it, the dense MLP's norm, one norm for both branches. Gemma-4's norms multiply by weight (not Gemma
    2/3's 1 + weight): the module says so."""
    from llmc.quant.algorithms.smoothquant import scales_by_one_plus_weight

    layer, x, run = _layer_and_call(gemma4_moe, 1)
    found = mappings.discover(layer, lambda: (x, run()))
    assert [(m.producer, m.consumers[0]) for m in found if m.from_norm] == [
        ("input_layernorm", "self_attn.q_proj"), ("pre_feedforward_layernorm", "mlp.gate_proj"),
        ("pre_feedforward_layernorm_2", "experts.0.gate_proj")]
    (pair,) = [m for m in found if m.routed]
    assert (pair.producer, set(pair.consumers), pair.parent, pair.also_scaled) == (
        "pre_feedforward_layernorm_2", set(EXPERT_GATE_UP), "experts", ())
    assert {(m.producer, m.consumers) for m in found if m.producer.startswith("experts.")} == {
        (f"experts.{e}.up_proj", (f"experts.{e}.down_proj",)) for e in range(4)}
    assert not scales_by_one_plus_weight(layer.pre_feedforward_layernorm_2)

    with torch.no_grad():
        out = run()
    added = (out - x).abs().max().item()
    generator = torch.Generator().manual_seed(1)
    M = mappings.Mapping
    assert mappings._preserves(layer, pair, run, out, added, generator)
    wrong = [M("pre_feedforward_layernorm_2", EXPERT_GATE_UP, "experts", True, also_scaled=("router.proj",),
               routed=True),
             M("pre_feedforward_layernorm", EXPERT_GATE_UP, "experts", True, routed=True),
             M("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj", *EXPERT_GATE_UP), "", True, routed=True)]
    assert not [m for m in wrong if mappings._preserves(layer, m, run, out, added, generator)]


def _smoothed_float_layers(monkeypatch) -> dict[str, torch.Tensor]:
    """Collects every layer's float tensors as the transform (SmoothQuant, AWQ) leaves them, before quantization."""
    from llmc.quant.algorithms.steps import AlgorithmSteps

    smoothed: dict[str, torch.Tensor] = {}
    real = AlgorithmSteps.transform_layer

    def transform_layer(self, layer, prefix, stats):
        changed = real(self, layer, prefix, stats)
        smoothed.update({prefix + k: v.detach().clone() for k, v in layer.state_dict().items()})
        return changed

    monkeypatch.setattr(AlgorithmSteps, "transform_layer", transform_layer)
    return smoothed


@pytest.mark.parametrize("scheme_name", ["int8-smoothquant", pytest.param("int4-awq", marks=pytest.mark.heavy)])
def test_gemma4_moe_smoothing_keeps_the_models_function_before_quantization(gemma4_moe: Path, scheme_name: str,
                                                                           tmp_path: Path, monkeypatch) -> None:
    """SmoothQuant W8A8 (alpha 0.5, norms) and AWQ W4A16 (its scale search alone: clip off) through the stream: the
    float model with the smoothed weights and norms, as the transform leaves each layer before quantization, gives
    the original model's logits (float tolerance), and the smoothing moved pre_feedforward_layernorm_2 and the
    experts' gate/up columns (the router's weights untouched)."""
    import dataclasses

    scheme = SCHEMES[scheme_name]
    if scheme.algorithm == "awq":
        scheme = dataclasses.replace(scheme, algorithm_options=(("clip", False),))
    smoothed = _smoothed_float_layers(monkeypatch)
    _quantize(gemma4_moe, scheme, tmp_path / "q")
    model = _float_model(gemma4_moe)
    moe.unfuse_experts(model)
    ids = _ids(2, 2)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    original = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(smoothed) <= set(original) and len(smoothed) > 2 * PER_LAYER
    model.load_state_dict(smoothed, strict=False)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    for i in range(2):
        p = f"model.layers.{i}"
        for moved in ("pre_feedforward_layernorm_2.weight", "experts.1.up_proj.weight"):
            assert not torch.allclose(smoothed[f"{p}.{moved}"], original[f"{p}.{moved}"], rtol=1e-3), (p, moved)
        assert torch.equal(smoothed[f"{p}.router.proj.weight"], original[f"{p}.router.proj.weight"])
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * before.abs().max().item())


class _DynamicInt8Inputs(torch.overrides.TorchFunctionMode):
    """Every F.linear whose weight is one of `weights` (by storage address: transformers' fused experts call it on
    gate_up_proj[e] and down_proj[e]) gets its input quantized per token as vLLM's dynamic symmetric int8 kernel does:
    scale = the row's |x| max / 127, codes rounded to nearest (even) and clamped to [-128, 127]."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights = weights
        self.seen: set[int] = set()  # the weights whose inputs it quantized

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[1].data_ptr() in self.weights:
            self.seen.add(args[1].data_ptr())
            x = args[0]
            scale = x.abs().amax(dim=-1, keepdim=True) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            args = ((x / scale).round().clamp(-128, 127) * scale, *args[1:])
        return func(*args, **kwargs)


@pytest.mark.parametrize("scheme_name", ["int8-smoothquant", pytest.param("int4-awq", marks=pytest.mark.heavy)])
def test_gemma4_moe_smoothed_export_decodes_in_plain_transformers_to_llmcs_logits(gemma4_moe: Path, scheme_name: str,
                                                                                tmp_path: Path) -> None:
    """SmoothQuant W8A8 (int8 per-channel weights, dynamic per-token int8 activations) and AWQ W4A16 g32: the
    artifact holds the smoothed pre_feedforward_layernorm_2 and the experts per expert (router.proj float, ignored);
    llmc's torch engine on it gives the fake-quantized reference's logits, and the weights decoded by
    compressed-tensors into plain transformers (experts re-fused; W8A8: every quantized Linear's input, the fused
    experts' included, quantized per token as vLLM does) give llmc's logits."""
    scheme = SCHEMES[scheme_name]
    qm = _quantize(gemma4_moe, scheme, tmp_path / "q")
    tensors = _tensors(qm)
    original = _float_model(gemma4_moe).state_dict()
    norm = "model.layers.0.pre_feedforward_layernorm_2.weight"
    assert not torch.allclose(tensors[norm], original[norm], rtol=1e-3)  # smoothed, and stored so
    assert len(qm.quantized_modules) == 2 * PER_LAYER and "model.layers.0.router.proj" not in qm.quantized_modules
    export_compressed_tensors(qm, tmp_path / "export")
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        torch.testing.assert_close(f.get_tensor(norm), tensors[norm], rtol=0, atol=0)
        assert "model.layers.1.router.proj.weight_scale" not in set(f.keys())
    ids, got = export_gives_the_reference_logits(gemma4_moe, qm, scheme, tmp_path / "export")
    plain = _transformers_model_of_export(tmp_path / "export", gemma4_moe)
    weights: set[int] = set()
    if scheme.activations is not None:  # dynamic per token: the runtime quantizes each quantized Linear's input
        assert scheme.activations.dynamic and scheme.activations.strategy == "token"
        # transformers' own per-expert loop (an F.linear per expert, whose input the mode can quantize): its default
        # grouped_mm calls none
        plain.set_experts_implementation("eager")
        for module in qm.quantized_modules:
            layer, _, rest = module.partition(".experts.")
            if rest:  # experts.E.{gate,up,down}_proj: a slice of the fused tensors
                expert, proj = rest.split(".")
                fused = plain.get_submodule(f"{layer}.experts")
                weights.add((fused.down_proj if proj == "down_proj" else fused.gate_up_proj)[int(expert)].data_ptr())
            else:
                weights.add(plain.get_submodule(module).weight.data_ptr())
    with torch.no_grad(), _DynamicInt8Inputs(weights) as mode:
        own = plain(input_ids=ids).logits
    assert mode.seen == weights  # every quantized Linear's input, each expert's included
    assert (own - got).abs().max().item() < 1e-4
