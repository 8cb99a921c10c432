"""Mixture-of-Experts on tiny random Mixtral, Qwen3-MoE, Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE, MiniMax-M2, gpt-oss,
DeepSeek-V3 and GLM-4.5 models (4 experts, top-2, hidden 64, 2 layers; built from transformers' own config classes,
tests/unit/families.py): every expert quantized as its own Linear under the Hub names, shared experts quantized and
their gates (and the gated-DeltaNet gate projections) kept in float, per-expert statistics from the tokens actually
routed to it, the layer-by-layer calibration forward equal to transformers' whole-model forward, starved experts
reported and given defensible scales, the all-tokens option, and the compressed-tensors export round-trip
(llmc.quant.moe). gpt-oss and Llama-4 text have their own tests below too: their layout rows (fused checkpoints, biased
interleaved experts, the clamped SwiGLU; router-scaled inputs, a shared expert), their calibration forward against
transformers' whole forward, and their exports decoded by compressed-tensors in plain transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.model.source import ModelSource
from llmc.quant import moe, stream
from llmc.quant.algorithms import mappings
from llmc.quant.canonical import QuantizedModel
from llmc.quant.numerics import quantize_weight, static_scale
from tests.unit.build_helpers import save_as_mxfp4_original
from tests.unit.families import MOE_FAMILIES, make_tiny
from tests.unit.test_families import SCHEMES, _fake_quantized_reference, _ids

_QWEN = ("mlp", ("gate_proj", "up_proj", "down_proj"))
_MIXTRAL = ("block_sparse_moe", ("w1", "w3", "w2"))
LAYOUT = {"mixtral": _MIXTRAL, "qwen3_moe": _QWEN, "qwen2_moe": _QWEN, "qwen3_next": _QWEN, "qwen3_5_moe": _QWEN,
          "minimax_m2": _MIXTRAL, "gpt_oss": _QWEN, "deepseek_v3": _QWEN, "glm4_moe": _QWEN, "deepseek_v32": _QWEN}
ROUTER = {name: "router" if name == "gpt_oss" else "gate" for name in LAYOUT}  # the router's name inside the block
REFUSED_BY_VLLM = {"gpt_oss"}  # llmc.runtimes.vllm: vLLM's gpt-oss loader reads fused experts only
# quantized Linears per family (2 layers): attention (4; a gated-DeltaNet layer: in_proj_qkvz, out_proj or
# in_proj_qkv, in_proj_z, out_proj; DeepSeek's MLA: q_a, q_b, kv_a_proj_with_mqa, kv_b, o), a shared expert (3),
# 4 experts x 3
QUANTIZED = {"mixtral": 2 * (4 + 12), "qwen3_moe": 2 * (4 + 12), "qwen2_moe": 2 * (4 + 3 + 12),
             "qwen3_next": (2 + 3 + 12) + (4 + 3 + 12), "qwen3_5_moe": (3 + 3 + 12) + (4 + 3 + 12),
             "minimax_m2": 2 * (4 + 12), "gpt_oss": 2 * (4 + 12), "deepseek_v3": 2 * (5 + 3 + 12),
             "glm4_moe": 2 * (4 + 3 + 12), "deepseek_v32": 2 * (5 + 1 + 3 + 12)}  # V3.2: MLA + the indexer's wq_b
# Linears the family keeps in float (llmc.model.families.KEPT_IN_DTYPE), which every export must list as unquantized
_GATE = ["model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate"]
KEPT = {"qwen2_moe": _GATE, "qwen3_next": [*_GATE, "model.layers.0.linear_attn.in_proj_ba"],
        "qwen3_5_moe": [*_GATE, "model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.in_proj_a"],
        # DeepSeek-V3.2's indexer: wk and weights_proj (vLLM's unquantized wk_weights_proj)
        "deepseek_v32": [f"model.layers.{i}.self_attn.indexer.{p}" for i in range(2) for p in ("wk", "weights_proj")]}
# a shared expert beside the routed ones: family -> its name inside the block
SHARED = {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert", "qwen3_5_moe": "shared_expert",
          "deepseek_v3": "shared_experts", "glm4_moe": "shared_experts", "deepseek_v32": "shared_experts"}
SHARED_GATE = ("qwen2_moe", "qwen3_next", "qwen3_5_moe")  # ... with its own one-row gate (kept, scaled like a router)
# MLA caches a latent: its KV-cache quantization is refused (test_deepseek.py)
NO_KV_CACHE = ("deepseek_v3", "deepseek_v32")
STARVED = 3  # the expert the starved model's layer-0 router never picks
CHANNEL = 5  # the embedding channel that makes it so


# Mixtral and Qwen3-MoE in the fast tier; the newer families' cases are `heavy` (still in the default run)
@pytest.fixture(scope="module", params=[f if f in ("mixtral", "qwen3_moe") else pytest.param(f, marks=pytest.mark.heavy)
                                        for f in MOE_FAMILIES])
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_tiny(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _scheme(family: str, scheme_name: str):
    """SCHEMES[scheme_name], without the KV cache for the families whose KV-cache quantization llmc refuses."""
    scheme = SCHEMES[scheme_name]
    return dataclasses.replace(scheme, kv_cache=None) if family in NO_KV_CACHE else scheme



def export_gives_the_reference_logits(folder: Path, qm, scheme, export: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Asserts that llmc's torch engine on the compressed-tensors `export` of `qm` gives the logits of the float
    model fake-quantized as `scheme` says (experts unfused), within 1e-4, and that the quantization is visible in
    them; returns the token ids (2 windows) and the export's logits for the caller's further checks."""
    from llmc.engines.torch_ref import TorchEngine

    ids = _ids(2, 2)
    with torch.no_grad():
        base = _float_model(folder)(input_ids=ids).logits
        want = _fake_quantized_reference(folder, qm, scheme, scheme.algorithm == "rtn", moe.unfuse_experts)(
            input_ids=ids).logits
        got = TorchEngine(export, streamed=False).model(input_ids=ids, use_cache=False).logits
    assert (want - base).abs().max().item() > 1e-3, "quantization must be visible"
    assert (got - want).abs().max().item() < 1e-4
    return ids, got

def _float_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _quantize(folder: Path, scheme, out: Path, **kw) -> QuantizedModel:
    calibration = stream.Calibration(_ids(4, 1), batch_size=2, **kw) if scheme.needs_calibration else None
    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, out, calibration)
    return QuantizedModel.open(out)


def _tensors(qm: QuantizedModel) -> dict[str, torch.Tensor]:
    return {k: v for t in qm.iter_files() for k, v in t.items()}


def test_per_expert_linears_view_the_fused_experts_and_compute_the_same_logits(family) -> None:
    """unfuse_experts: the same logits as transformers' fused block, Linears named as the saved (Hub) checkpoint,
    weights that are views of the fused parameters (no copy)."""
    name, folder = family
    model = _float_model(folder)
    ids = _ids(2, 3)
    fused = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    with torch.no_grad():
        before = model(input_ids=ids).logits
        blocks = moe.unfuse_experts(model)
        after = model(input_ids=ids).logits
    block, projections = LAYOUT[name]
    assert blocks == [f"model.layers.{i}.{block}" for i in range(2)]
    assert (after - before).abs().max().item() < 1e-5
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # gpt-oss's checkpoint holds the fused tensors: the names the build reads it under are its per-expert split
    saved = moe.per_expert_shapes(saved, moe.layout_of(model.config))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"} == {
        k: v for k, v in saved.items() if k != "lm_head.weight"}  # tied head
    gate = model.get_submodule(f"model.layers.0.{block}.experts.2.{projections[0]}")
    assert isinstance(gate, torch.nn.Linear) and gate.weight.data_ptr() == fused[2].data_ptr()
    assert not [n for n, p in model.named_parameters() if p.dim() == 3 and ".experts" in n]  # conv1d: 3-D, no expert


@pytest.mark.heavy
@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_every_expert_is_quantized_and_the_export_reloads_with_the_reference_logits(family, scheme_name: str,
                                                                                   tmp_path: Path) -> None:
    """FP8 static + KV, INT8 SmoothQuant W8A8, INT4 GPTQ and AWQ: every expert Linear in the canonical form (no fused
    3-D float tensor left), the router kept in float and ignored by the export, experts written per expert in the
    Hub naming; llmc's torch engine reloads the export with the fake-quantized reference's logits."""
    from llmc.engines.torch_ref import TorchEngine

    name, folder = family
    scheme = _scheme(name, scheme_name)
    qm = _quantize(folder, scheme, tmp_path / "q")
    block, projections = LAYOUT[name]
    experts = {f"model.layers.{i}.{block}.experts.{e}.{p}" for i in range(2) for e in range(4) for p in projections}
    assert experts <= set(qm.quantized_modules) and len(qm.quantized_modules) == QUANTIZED[name]
    if name in SHARED:
        assert {f"model.layers.{i}.{block}.{SHARED[name]}.{p}" for i in range(2) for p in projections} <= set(
            qm.quantized_modules)
    tensors = _tensors(qm)
    assert not [k for k, t in tensors.items() if t.dim() == 3 and t.is_floating_point() and ".experts" in k]
    router = f"model.layers.0.{block}.{ROUTER[name]}"
    assert router not in qm.quantized_modules and tensors[f"{router}.weight"].dtype == torch.float32
    for kept in KEPT.get(name, []):  # in float, without scales, and named as unquantized by the export
        assert kept not in qm.quantized_modules and tensors[f"{kept}.weight"].dtype == torch.float32
        assert not [k for k in tensors if k.startswith(f"{kept}.") and k != f"{kept}.weight"]
    export_compressed_tensors(qm, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    assert any(p.startswith("re:") and mappings_match(p, router) for p in ignore)
    assert all(any(mappings_match(p, kept) for p in ignore) for kept in KEPT.get(name, []))
    if scheme.kv_cache is not None:  # a KV cache exists only in the full-attention layers: only they hold scales
        with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
            kv = sorted(k for k in f.keys() if k.endswith(("k_scale", "v_scale")))
        layers = [1] if name in ("qwen3_next", "qwen3_5_moe") else [0, 1]
        assert kv == [f"model.layers.{i}.self_attn.{s}" for i in layers for s in ("k_scale", "v_scale")]
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        assert f"model.layers.1.{block}.experts.3.{projections[2]}.weight_scale" in set(f.keys())

    ids, got = export_gives_the_reference_logits(folder, qm, scheme, tmp_path / "export")
    if scheme_name == "fp8-static-kv":  # the streamed evaluation (one layer resident) scores the same
        whole = TorchEngine(tmp_path / "export", streamed=False).token_nll(ids)
        torch.testing.assert_close(TorchEngine(tmp_path / "export", streamed=True).token_nll(ids), whole,
                                   rtol=1e-5, atol=1e-5)
    # decoded by compressed-tensors in plain transformers (gpt-oss: transformers has no per-expert names for it;
    # test_gpt_oss_w4a16_gptq_export_decodes_in_plain_transformers_to_llmcs_logits re-fuses them)
    if scheme_name in ("int4-gptq", "fp8-static-kv") and name not in REFUSED_BY_VLLM:  # fused in its Hub checkpoints
        with torch.no_grad():
            own = _compressed_tensors_model(tmp_path / "export")(input_ids=ids).logits
        assert (own - got).abs().max().item() < 1e-4


def _compressed_tensors_model(export: Path):
    """The export as transformers loads it with compressed-tensors decompressing its weights, and (static FP8) its
    Linears' inputs and its keys/values fake-quantized by compressed-tensors' own `fake_quantize` with the stored
    input / k / v scales: llmc's numerics nowhere (the experts are viewed per expert only to hook their inputs)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    # compressed-tensors 0.20 decodes NVFP4 into bf16 whatever the model's dtype: without the cast a float32 model
    # with NVFP4 experts mixes dtypes in its matmuls (bf16 -> float32 is exact)
    model = model.float()
    q = json.loads((export / "config.json").read_text())["quantization_config"]
    # static activations: one set of args for every group that has them (a mixed-precision export's FP8 group)
    groups = [g["input_activations"] for g in q["config_groups"].values() if g.get("input_activations")]
    if not groups:
        return model
    assert all(g == groups[0] for g in groups) and not groups[0]["dynamic"], groups
    acts = QuantizationArgs(**groups[0])
    tensors = {k: v for f in export.glob("*.safetensors") for k, v in load_file(f).items()}
    moe.unfuse_experts(model)

    def quantized(x: torch.Tensor, scale: torch.Tensor, args) -> torch.Tensor:
        return fake_quantize(x, scale, torch.zeros_like(scale), args)

    for name, module in model.named_modules():
        if f"{name}.input_scale" in tensors:
            scale = tensors[f"{name}.input_scale"]
            module.register_forward_pre_hook(lambda _m, a, s=scale: (quantized(a[0], s, acts), *a[1:]))
    if q.get("kv_cache_scheme"):
        kv = QuantizationArgs(**q["kv_cache_scheme"])
        names = {id(m): n for n, m in model.named_modules()}

        def attention(module, query, key, value, mask, **kw):
            name = names[id(module)]
            key = quantized(key, tensors[f"{name}.k_scale"], kv)
            value = quantized(value, tensors[f"{name}.v_scale"], kv)
            return sdpa_attention_forward(module, query, key, value, mask, **kw)

        AttentionInterface.register("test_compressed_tensors_kv", attention)
        AttentionMaskInterface.register("test_compressed_tensors_kv", sdpa_mask)
        model.config._attn_implementation = "test_compressed_tensors_kv"
    return model


def mappings_match(pattern: str, name: str) -> bool:
    from llmc.quant.canonical import module_matches

    return module_matches(name, [pattern])


def _routing(folder: Path, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(MoE block input [tokens, H], top-k expert index [tokens, k], the float model's experts) of `layer` on the
    calibration windows, captured from transformers' own (fused) model."""
    model = _float_model(folder)
    mlp = model.model.layers[layer].mlp
    seen = {}
    mlp.register_forward_pre_hook(lambda _m, a: seen.__setitem__("x", a[0].reshape(-1, a[0].shape[-1])))
    router = mlp.gate if hasattr(mlp, "gate") else mlp.router
    router.register_forward_hook(lambda _m, _a, out: seen.__setitem__("top", out[2]))
    with torch.no_grad():
        for batch in _ids(4, 1).split(2):
            model(input_ids=batch)
            seen.setdefault("xs", []).append(seen["x"])
            seen.setdefault("tops", []).append(seen["top"])
    return torch.cat(seen["xs"]), torch.cat(seen["tops"]), mlp.experts


def test_the_layer_by_layer_calibration_forward_is_transformers_whole_forward(family, tmp_path: Path,
                                                                              monkeypatch) -> None:
    """Layer by layer (the stream, two windows a forward), every quantized Linear, each expert's included, sees the
    inputs it gets in transformers' own forward of the whole model on the same tokens (per-channel ranges equal):
    routing, shared experts, the gated-DeltaNet layers' convolution and recurrence, and the full-attention layers'
    masks and rotary tables are computed as transformers computes them. The Linears a family keeps in float are not
    observed (never quantized)."""
    from tests.unit.test_gemma3 import _linear_input_absmax, observing_channel_absmax

    name, folder = family
    calib = _ids(4, 1)
    model = _float_model(folder)
    moe.unfuse_experts(model)  # per-expert Linears computing the fused block's output (test above)
    ref = _linear_input_absmax(model, calib)
    observed = observing_channel_absmax(monkeypatch)
    _quantize(folder, _scheme(name, "fp8-static-kv"), tmp_path / "q")
    # an expert no token reached is absent from both
    assert set(observed) == set(ref) - set(KEPT.get(name, [])) and any(".experts." in n for n in observed)
    for linear, absmax in ref.items():
        if linear in observed:
            torch.testing.assert_close(observed[linear], absmax, rtol=1e-5, atol=1e-6, msg=linear)


def _expert_inputs(x: torch.Tensor, experts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate/up input, down input) of expert e computed directly from the fused weights, as transformers' fused
    forward computes them (gpt-oss: biased, interleaved, transposed, its clamped gate)."""
    if hasattr(experts, "gate_up_proj_bias"):  # gpt-oss
        return x, experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
    inter = experts.gate_up_proj.shape[1] // 2
    w = experts.gate_up_proj[e]
    return x, experts.act_fn(x @ w[:inter].T) * (x @ w[inter:].T)


def test_per_expert_scales_come_from_the_tokens_routed_to_each_expert(family, tmp_path: Path) -> None:
    """Static FP8 input scales: each expert's gate/up and down ranges are computed from the tokens the router sent it
    (not the block's whole input), and the stored scales are one per layer and operand, the largest of those
    per-expert ones (vLLM's / SGLang's fused-MoE kernels take one: llmc.quant.runtime_scales); the token report
    counts the routed tokens."""
    name, folder = family
    scheme = _scheme(name, "fp8-static-kv")
    qm = _quantize(folder, scheme, tmp_path / "q")
    tensors = _tensors(qm)
    block, (gate, up, down) = LAYOUT[name]
    x, top, experts = _routing(folder)
    counts = json.loads((tmp_path / "q" / moe.TOKENS_FILE).read_text())["blocks"][f"model.layers.0.{block}"]["tokens"]
    assert counts == [int((top == e).any(dim=-1).sum()) for e in range(4)] and sum(counts) == x.shape[0] * 2
    assert qm.meta["moe"]["tokens"]["blocks"][f"model.layers.0.{block}"]["tokens"] == counts
    own_gate, own_down = [], []
    for e in range(4):
        gate_in, down_in = _expert_inputs(x[(top == e).any(dim=-1)], experts, e)
        own_gate.append(static_scale(gate_in.abs().amax(), scheme.activations))
        own_down.append(static_scale(down_in.abs().amax(), scheme.activations))
    for e in range(4):
        prefix = f"model.layers.0.{block}.experts.{e}"
        for proj in (gate, up):
            torch.testing.assert_close(tensors[f"{prefix}.{proj}.input_scale"], max(own_gate), rtol=1e-5, atol=0)
        torch.testing.assert_close(tensors[f"{prefix}.{down}.input_scale"], max(own_down), rtol=1e-5, atol=0)
    # the per-expert ranges differ (so one scale per layer is a choice, not a coincidence)
    assert min(own_down) < max(own_down) * (1 - 1e-4)


def _starve(folder: Path, name: str) -> Path:
    """The same model with layer 0's router unable to pick expert STARVED: embedding channel CHANNEL is a positive
    constant and the norm before the experts keeps its sign, so the router's input is positive there on every token;
    STARVED's router row reads only that channel, negated (its logit is always the lowest), the other rows ignore it
    (their routing still varies by token)."""
    state = load_file(str(folder / "model.safetensors"))
    state["model.embed_tokens.weight"][:, CHANNEL] = 1.0
    if "lm_head.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.post_attention_layernorm.weight"][CHANNEL] = 1.0
    router = f"model.layers.0.{LAYOUT[name][0]}.{ROUTER[name]}.weight"
    state[router][:, CHANNEL] = 0.0
    row = torch.zeros_like(state[router][STARVED])
    row[CHANNEL] = -50.0
    state[router][STARVED] = row
    fused = f"model.layers.0.{LAYOUT[name][0]}.experts.gate_up_proj"
    if fused in state:  # gpt-oss ([E, H, 2I]): its experts ignore the constant channel too, which would otherwise
        state[fused][:, CHANNEL, :] = 0.0  # drive every expert into the clamp (all down inputs at the same ceiling)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def starved(family, tmp_path_factory) -> tuple[str, Path]:
    name, _ = family
    folder = make_tiny(name, tmp_path_factory.mktemp(f"{name}-starved") / "model")
    return name, _starve(folder, name)


def test_a_starved_expert_is_reported_and_gets_the_widest_scale_of_its_peers(starved, tmp_path: Path, capsys) -> None:
    """Expert STARVED gets no token in layer 0: the report and the warning name it; its weights are RTN from their own
    range; its static input scales are the largest of the layer's other experts for the same projection."""
    name, folder = starved
    _x, top, _ = _routing(folder)
    assert not (top == STARVED).any(), "the starved model must really starve the expert"
    scheme = _scheme(name, "fp8-static-kv")
    qm = _quantize(folder, scheme, tmp_path / "q")
    block, projections = LAYOUT[name]
    report = qm.meta["moe"]["tokens"]["blocks"][f"model.layers.0.{block}"]
    assert report["tokens"][STARVED] == 0 and report["starved"] == [STARVED] and STARVED in report["below"]
    err = capsys.readouterr().err
    assert f"warning: layer 0 {block}: experts [{STARVED}] received no calibration token" in err
    tensors, model = _tensors(qm), _float_model(folder)
    moe.unfuse_experts(model)
    for proj in projections:
        prefix = f"model.layers.0.{block}.experts"
        others = torch.stack([tensors[f"{prefix}.{e}.{proj}.input_scale"] for e in range(4) if e != STARVED])
        assert torch.equal(tensors[f"{prefix}.{STARVED}.{proj}.input_scale"], others.amax(dim=0))
        rtn = quantize_weight(model.get_submodule(f"{prefix}.{STARVED}.{proj}").weight.data, scheme.weights)
        assert torch.equal(tensors[f"{prefix}.{STARVED}.{proj}.weight"].view(torch.uint8), rtn.codes.view(torch.uint8))


def test_calibrating_every_expert_on_every_token_gives_the_starved_expert_data_driven_scales(starved,
                                                                                             tmp_path: Path,
                                                                                             monkeypatch) -> None:
    """moe_calibrate_all_experts: the starved expert's scales come from every calibration token (computed directly
    here), while the layer's output stays the routed one (the next layer's statistics do not move). The expert's own
    statistic, before the serving runtimes' one-scale-per-layer rule takes the max over the experts (that rule:
    tests/unit/test_runtime_scales.py): with the rule, a starved expert's scale rarely shows."""
    from llmc.quant import runtime_scales

    monkeypatch.setattr(runtime_scales, "unify_expert_input_scales", lambda tensors, specs: {})
    name, folder = starved
    scheme = _scheme(name, "fp8-static-kv")
    routed = _tensors(_quantize(folder, scheme, tmp_path / "routed"))
    qm = _quantize(folder, scheme, tmp_path / "all", moe_all_experts=True)
    every = _tensors(qm)
    block, (gate, _up, down) = LAYOUT[name]
    assert qm.meta["moe"]["tokens"]["calibrate_all_experts"] is True
    assert qm.meta["moe"]["tokens"]["blocks"][f"model.layers.0.{block}"]["starved"] == []
    x, _top, experts = _routing(folder)
    gate_in, down_in = _expert_inputs(x, experts, STARVED)
    prefix = f"model.layers.0.{block}.experts.{STARVED}"
    want_down = static_scale(down_in.abs().amax(), scheme.activations)
    torch.testing.assert_close(every[f"{prefix}.{gate}.input_scale"], static_scale(gate_in.abs().amax(),
                               scheme.activations), rtol=1e-5, atol=0)
    torch.testing.assert_close(every[f"{prefix}.{down}.input_scale"], want_down, rtol=1e-5, atol=0)
    assert not torch.allclose(routed[f"{prefix}.{down}.input_scale"], want_down), "the proxy was not data-driven"
    for k, t in every.items():  # layer 1 sees the same (routed) outputs of layer 0
        if k.startswith("model.layers.1.self_attn") and k.endswith("input_scale"):
            torch.testing.assert_close(t, routed[k], rtol=1e-5, atol=0)


@pytest.mark.heavy
@pytest.mark.parametrize("scheme_name", ["int8-smoothquant", "int4-gptq", "int4-gptq-two-forwards", "int4-awq"])
def test_algorithms_quantize_a_starved_expert_by_round_to_nearest(starved, scheme_name: str, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """SmoothQuant, GPTQ (true-sequential: the starved expert's Linears are never called; and the two-forward order
    MoE layers take when the windows do not fit one forward) and AWQ finish and leave the starved expert's down
    projection as round-to-nearest codes of its own weights."""
    name, folder = starved
    if scheme_name == "int4-gptq-two-forwards":
        monkeypatch.setattr("llmc.quant.loop_plan.fits_one_forward", lambda *a: False)
        scheme_name = "int4-gptq"
    scheme = _scheme(name, scheme_name)
    qm = _quantize(folder, scheme, tmp_path / "q")
    tensors, model = _tensors(qm), _float_model(folder)
    moe.unfuse_experts(model)
    block, projections = LAYOUT[name]
    prefix = f"model.layers.0.{block}.experts.{STARVED}"
    down = model.get_submodule(f"{prefix}.{projections[2]}").weight.data
    if scheme_name == "int4-gptq":  # smoothing transforms rescale gate/up with the whole block; down is its own
        rtn = quantize_weight(down, scheme.weights)
        assert torch.equal(tensors[f"{prefix}.{projections[2]}.weight"], rtn.codes)
    assert qm.meta["moe"]["tokens"]["blocks"][f"model.layers.0.{block}"]["starved"] == [STARVED]


def test_smoothing_the_norm_into_the_experts_is_a_pair_only_with_the_router_scaled_too(family) -> None:
    """The structural check: post_attention_layernorm -> every expert's gate/up keeps the layer's function only when
    the router's input columns take the same scale (else the routing moves)."""
    name, folder = family
    model = _float_model(folder).double()
    moe.unfuse_experts(model)
    layer = model.model.layers[0]
    block, (gate, up, _down) = LAYOUT[name]
    consumers = tuple(f"{block}.experts.{e}.{p}" for e in range(4) for p in (gate, up))
    routers = (f"{block}.{ROUTER[name]}",)
    shared = (f"{block}.{SHARED[name]}.{gate}", f"{block}.{SHARED[name]}.{up}") if name in SHARED else ()
    if name in SHARED_GATE:  # the shared expert's one-row gate reads the block's input too: scaled like the router
        routers += (f"{block}.shared_expert_gate",)
    x = torch.randn(1, 16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    position = torch.arange(16)[None]
    rotary = model.model.rotary_emb(x, position)
    # DeepSeek-V3.2's indexer takes its top-k over the keys the mask leaves: the causal one its model builds
    mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None] if name == "deepseek_v32" else None

    def run():
        return layer(x, attention_mask=mask, position_ids=position, position_embeddings=rotary)

    out = run()
    added = (out - x).abs().max().item()
    with_router = mappings.Mapping("post_attention_layernorm", consumers + shared, block, True, also_scaled=routers,
                                   routed=True)
    without = mappings.Mapping("post_attention_layernorm", consumers + shared, block, True, routed=True)
    generator = torch.Generator().manual_seed(1)
    assert mappings._preserves(layer, with_router, run, out, added, generator)
    assert not mappings._preserves(layer, without, run, out, added, generator)
    if shared:  # the shared expert reads the norm's output too: left out of the pair, the layer's function moves
        routed_only = mappings.Mapping("post_attention_layernorm", consumers, block, True, also_scaled=routers,
                                       routed=True)
        assert not mappings._preserves(layer, routed_only, run, out, added, generator)
    # what discovery finds from the layer itself: that very pair (a shared expert's gate/up among the consumers)
    found = mappings.discover(layer, lambda: (x, run()))
    (pair,) = [m for m in found if m.routed]
    assert (pair.producer, set(pair.consumers), set(pair.also_scaled)) == (
        "post_attention_layernorm", set(consumers + shared), set(routers))


def test_a_checkpoint_with_fused_experts_is_refused_naming_the_layout(family, tmp_path: Path) -> None:
    """A checkpoint holding transformers' in-memory fused tensors (experts.gate_up_proj) instead of the Hub's
    per-expert ones: InputError (exit 7) naming the missing tensor and the fix, before any layer computes."""
    import shutil

    from llmc.errors import InputError

    name, folder = family
    if moe.LAYOUTS[MOE_FAMILIES[name][0]].checkpoint_fused:
        pytest.skip("this family's Hub checkpoints hold the fused tensors: llmc splits them (test_gpt_oss_*)")
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    state = {k: v.contiguous() for k, v in _float_model(folder).state_dict().items() if k != "lm_head.weight"}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match="not fused 3-D tensors") as refused:
        _quantize(fused, _scheme(name, "fp8-static-kv"), tmp_path / "q")
    assert "save_pretrained" in refused.value.fix and refused.value.exit_code == 7


@pytest.mark.slow  # two whole builds: ~75 s on the loaded 2-core machine
def test_llmc_build_of_a_tiny_moe_model_end_to_end(tmp_path: Path) -> None:
    """`llmc build` on a tiny Mixtral: FP8 static + KV for vLLM, evaluated in the torch engine from the exported files,
    the token report in the quantize stage's output; with moe_calibrate_all_experts another quantize key (and stage)."""
    from llmc.build import build
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store
    from tests.unit.test_build import recipe_text

    folder = make_tiny("mixtral", tmp_path / "model")
    store = Store(tmp_path / "cache")
    # per-tensor weights: vLLM's fused-MoE FP8 method loads static activations only with them (llmc refuses the
    # recipe's default per-channel weights for a MoE target: IncompatibleTargetError)
    fp8_moe = {"gates.max_ppl_increase_pct": 1000.0, "quantization.weights.strategy": "tensor"}
    result = build(parse_recipe(recipe_text(folder, tmp_path / "registry", **fp8_moe)), store, publish=False)
    assert result.passed
    quantized = next(store.root.glob("stages/quantize/*/quantized.json")).parent
    tokens = json.loads((quantized / moe.TOKENS_FILE).read_text())["blocks"]
    assert sorted(tokens) == ["model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"]
    assert sum(tokens["model.layers.0.block_sparse_moe"]["tokens"]) == 8 * 64 * 2  # every calibration token, top-2
    every = build(parse_recipe(recipe_text(folder, tmp_path / "registry", **{
        **fp8_moe, "calibration.moe_calibrate_all_experts": True})), store, publish=False)
    assert every.passed and len(list(store.root.glob("stages/quantize/*/quantized.json"))) == 2


# one family in the default run (Qwen3-Next: hybrid attention, a shared expert and its gate), the rest with -m slow;
# DeepSeek-V3 / GLM-4.5 and gpt-oss / Llama-4 builds: tests/unit/test_deepseek.py and the Llama-4 tests below
@pytest.mark.heavy
@pytest.mark.parametrize("name", ["qwen3_next", *(pytest.param(f, marks=pytest.mark.slow)
                                                  for f in ("qwen2_moe", "qwen3_5_moe", "minimax_m2"))])
def test_llmc_build_fp8_and_w4a16_gptq_of_the_newer_moe_families(name: str, tmp_path: Path) -> None:
    """`llmc build` (plan, calibrate, quantize, export, evaluate, gate) of a tiny Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE /
    MiniMax-M2 in FP8 W8A8 (static, FP8 KV cache) and W4A16 GPTQ for vLLM: the plan names the Linears kept in float,
    every gate is measured, and each compressed-tensors artifact decoded by compressed-tensors in plain transformers
    gives the logits of llmc's torch engine."""
    import yaml

    from llmc.build import build
    from llmc.engines.torch_ref import TorchEngine
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store

    folder = make_tiny(name, tmp_path / "model")
    recipe = parse_recipe(yaml.safe_dump({
        "name": "moe", "model": {"source": str(folder)},
        # per-tensor weights: vLLM's fused MoE refuses per-channel weights with static activations (issue 45)
        "variants": [{"name": "fp8", "quantization": {
                          "weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                          "activations": {"format": "fp8_e4m3", "strategy": "tensor"},
                          "kv_cache": {"format": "fp8_e4m3"}}},
                     {"name": "w4a16", "quantization": {
                          "weights": {"format": "int4", "strategy": "group", "group_size": 32}, "algorithm": "gptq"}}],
        "calibration": {"samples": 8, "seq_len": 32, "seed": 0, "moe_calibrate_all_experts": True},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 32, "windows": 2, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 100,
                 "runtimes": ["torch"]},
        "gates": {"max_ppl_increase_pct": 1000.0},
        "publish": {"registry": str(tmp_path / "registry")}}))
    result = build(recipe, Store(tmp_path / "cache"), publish=False)
    kept = KEPT.get(name, [])
    assert all(any(k.rsplit(".", 1)[-1] in w and "kept in the model's dtype" in w for w in result.plan.warnings)
               for k in kept), result.plan.warnings
    assert result.passed and result.verdicts and all(v.evaluated for v in result.verdicts), result.verdicts
    assert sorted(result.artifacts) == ["fp8/vllm-sm90-tp1", "w4a16/vllm-sm90-tp1"]
    ids = _ids(2, 2)
    for artifact in result.artifacts.values():
        with torch.no_grad():
            got = TorchEngine(artifact.dir, streamed=False).model(input_ids=ids, use_cache=False).logits
            own = _compressed_tensors_model(artifact.dir)(input_ids=ids).logits
        assert (own - got).abs().max().item() < 1e-4, artifact.label


def test_data_parallel_calibration_of_a_moe_model_is_planned_per_rank_and_awq_refused(family, tmp_path: Path) -> None:
    """--nproc 2 on a MoE model: a calibrated scheme (static FP8) is planned per rank, as weight-only RTN is
    (llmc.distributed combines the experts' statistics; tests/unit/test_moe_distributed.py); AWQ, whose search
    runs per expert on inputs that differ by rank, is refused (exit 2) before torchrun starts, naming the fix."""
    import yaml

    from llmc.errors import RecipeError
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    name, folder = family
    if name in REFUSED_BY_VLLM:
        pytest.skip("the plan refuses vLLM targets for this family (test_vllm_targets_of_gpt_oss_are_refused_by_the_plan)")

    def recipe(quantization: dict):
        return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)}, "quantization": quantization,
                                            "targets": [{"runtime": "vllm"}]}))

    static = recipe({"weights": {"format": "fp8_e4m3", "strategy": "tensor"},  # a layout vLLM's fused MoE loads
                     "activations": {"format": "fp8_e4m3", "strategy": "tensor"}})
    assert make_plan(static, folder, nproc=2).distributed["nproc"] == 2
    weight_only = recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 32}})
    assert make_plan(weight_only, folder, nproc=2).distributed["nproc"] == 2
    awq = recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 32}, "algorithm": "awq"})
    with pytest.raises(RecipeError, match=r"\(AWQ\) on a Mixture-of-Experts model over 2 processes") as refused:
        make_plan(awq, folder, nproc=2)
    assert "no --nproc" in refused.value.fix
    make_plan(awq, folder)  # one process: planned


def test_gptq_on_experts_routed_fewer_tokens_than_their_inputs_is_named_by_the_plan(family) -> None:
    """GPTQ solves each expert with the Hessian of its routed tokens: fewer than the expert's inputs (on average) and
    the solve is ill-posed (the AVX2 device-test failure of issue 50 item 1). The plan says so and names the fix;
    calibrating every expert on every token, or enough tokens, silences it."""
    import yaml

    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    name, folder = family
    if name in REFUSED_BY_VLLM:
        pytest.skip("the plan refuses vLLM targets for this family (test_vllm_targets_of_gpt_oss_are_refused_by_the_plan)")

    def warnings(samples: int, **calibration) -> list[str]:
        recipe = parse_recipe(yaml.safe_dump({
            "name": "t", "model": {"source": str(folder)}, "targets": [{"runtime": "vllm"}],
            "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 32},
                             "algorithm": "gptq"},
            "calibration": {"samples": samples, "seq_len": 16, **calibration}}))
        return [w for w in make_plan(recipe, folder).warnings if "routed to it" in w]

    few = warnings(4)
    assert len(few) == 1 and "moe_calibrate_all_experts: true" in few[0] and ".experts." in few[0]
    assert warnings(4, moe_calibrate_all_experts=True) == []
    assert warnings(256) == []


# --------------------------------------------------------------------------- gpt-oss: what its layout row says


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return make_tiny("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "model")


def test_gpt_oss_per_expert_linears_compute_transformers_fused_experts(gpt_oss: Path) -> None:
    """gpt-oss's experts (biased, gate/up interleaved in a transposed [E, H, 2I] tensor, the clamped SwiGLU) as
    per-expert Linears: gate/up are the even/odd columns of gate_up_proj, transposed; the block computes what
    transformers' fused GptOssExperts computes, to float tolerance (not bit-identical: other matmul shapes), on
    random inputs large enough that the clamp bites on about half the activations; the checkpoint's fused tensors
    split as the stream reads them equal the views."""
    model = _float_model(gpt_oss)
    fused = model.model.layers[0].mlp.experts
    limit, x = fused.limit, torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 8
    top = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:2] for t in range(64)])
    weights = torch.softmax(torch.randn(64, 2, generator=torch.Generator().manual_seed(1)), dim=-1)
    with torch.no_grad():
        gate_up = torch.einsum("th,ehi->eti", x, fused.gate_up_proj) + fused.gate_up_proj_bias[:, None]
        clamped = ((gate_up[..., ::2] > limit).float().mean() + (gate_up[..., 1::2].abs() > limit).float().mean()) / 2
        want = fused(x, top, weights)
        unfused = moe.expert_linears(fused, moe.layout_of(model.config))
        got = unfused(x, top, weights)
    assert clamped > 0.3, "the clamp must be exercised"
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    e2 = unfused[2]
    assert torch.equal(e2.gate_proj.weight, fused.gate_up_proj[2][:, ::2].T)
    assert torch.equal(e2.up_proj.bias, fused.gate_up_proj_bias[2][1::2])
    assert torch.equal(e2.down_proj.weight, fused.down_proj[2].T) and torch.equal(e2.down_proj.bias, fused.down_proj_bias[2])
    # a half-split (Qwen3-MoE's) reading of the same tensor computes something else: the layout row matters
    halves = moe.expert_linears(fused, moe.MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", "router",
                                                     transposed=True, bias=True, activation="clamped_swiglu"))
    assert (halves(x, top, weights) - want).abs().max().item() > 1e-2
    with safe_open(str(gpt_oss / "model.safetensors"), "pt") as f:
        layer0 = {k[len("model.layers.0."):]: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.0.")}
    split = moe.per_expert_tensors(layer0, moe.layout_of(model.config))
    moe.unfuse_experts(model)
    own = {k[len("model.layers.0."):]: v for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    assert split.keys() == own.keys() and all(torch.equal(split[k], own[k]) for k in own)


def test_gpt_oss_layer_by_layer_calibration_sees_the_whole_models_activations(gpt_oss: Path, tmp_path: Path,
                                                                                monkeypatch) -> None:
    """The stream's layer-by-layer forward (sliding window 6 and full layers, attention sinks, experts per expert)
    gives every Linear the inputs transformers' whole-model forward gives it: per-channel input ranges equal those
    hooked on the whole (unfused) model, attention and every routed expert alike. The check can fail: with the
    sinks zeroed, o_proj sees other inputs."""
    from tests.unit.test_gemma3 import _linear_input_absmax, observing_channel_absmax

    calib = _ids(4, 1)
    whole = _float_model(gpt_oss)
    moe.unfuse_experts(whole)
    ref = _linear_input_absmax(whole, calib)
    sinkless = _float_model(gpt_oss)
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.zero_()
    moe.unfuse_experts(sinkless)
    assert not torch.allclose(_linear_input_absmax(sinkless, calib)["model.layers.0.self_attn.o_proj"],
                              ref["model.layers.0.self_attn.o_proj"], rtol=1e-4)

    observed = observing_channel_absmax(monkeypatch)
    _quantize(gpt_oss, SCHEMES["fp8-static-kv"], tmp_path / "q")
    assert len(ref) == len(observed) == 2 * (4 + 4 * 3)
    for name, absmax in ref.items():
        torch.testing.assert_close(observed[name], absmax, rtol=1e-5, atol=1e-6, msg=name)


def _transformers_logits_of_export(export: Path, source: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `_transformers_model_of_export`, by transformers' own fused forward (no llmc code on the path)."""
    model = _transformers_model_of_export(export, source)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _transformers_model_of_export(export: Path, source: Path, state: dict[str, torch.Tensor] | None = None):
    """The export decoded by compressed-tensors' own decompressors, the per-expert tensors put back into transformers'
    fused layout (transposed; gate/up interleaved for gpt-oss, halves for Llama-4: the inverse of the layout row,
    written out here), loaded into the plain transformers model. `state`: the export already decoded (weights only;
    tests/unit/test_frontier_proof.py's `_decoded_state`, every Linear by its own config group)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from transformers import AutoModelForCausalLM

    if state is None:
        config = json.loads((export / "config.json").read_text())["quantization_config"]
        (group,) = config["config_groups"].values()
        scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
        compressor = BaseCompressor.get_value_from_registry(group.get("format") or config["format"])
        raw = {k: v for f in export.glob("*.safetensors") for k, v in load_file(str(f)).items()}
        state, modules = {}, {k.rsplit(".", 1)[0] for k in raw if k.endswith(".weight_scale")}
        for name, t in raw.items():
            module, _, local = name.rpartition(".")
            if module in modules and local.startswith("weight"):  # codes and scales: decompressed below
                state.setdefault(module, {})[local] = t
            else:  # everything else (the experts' biases included) is stored as it is
                state[name] = t
        for module in modules:
            state[f"{module}.weight"] = compressor.decompress(state.pop(module), scheme)["weight"].float()
    state = dict(state)  # popped below
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        if isinstance(getattr(layer, "experts", None), torch.nn.Module):  # Gemma-4: [E, out, in], halves
            _refuse_gemma4_experts(layer.experts, state, f"model.layers.{i}.experts")
            continue
        block = "mlp" if hasattr(layer, "mlp") else "feed_forward"
        p, experts = f"model.layers.{i}.{block}.experts", getattr(getattr(layer, block), "experts", None)
        if experts is None:  # Llama-4's dense layers
            continue
        inter = experts.gate_up_proj.shape[-1] // 2
        gate, up = ((slice(0, None, 2), slice(1, None, 2)) if hasattr(experts, "gate_up_proj_bias")  # gpt-oss
                    else (slice(0, inter), slice(inter, None)))  # Llama-4
        with torch.no_grad():
            for e in range(experts.gate_up_proj.shape[0]):
                experts.gate_up_proj[e][:, gate] = state.pop(f"{p}.{e}.gate_proj.weight").T
                experts.gate_up_proj[e][:, up] = state.pop(f"{p}.{e}.up_proj.weight").T
                experts.down_proj[e] = state.pop(f"{p}.{e}.down_proj.weight").T
                if hasattr(experts, "gate_up_proj_bias"):
                    experts.gate_up_proj_bias[e][gate] = state.pop(f"{p}.{e}.gate_proj.bias")
                    experts.gate_up_proj_bias[e][up] = state.pop(f"{p}.{e}.up_proj.bias")
                    experts.down_proj_bias[e] = state.pop(f"{p}.{e}.down_proj.bias")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".experts." in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


def _refuse_gemma4_experts(experts, state: dict, p: str) -> None:
    """Gemma-4's fused experts (gate_up_proj [E, 2I, H]: gate rows then up rows; down_proj [E, H, I]) from the
    per-expert tensors `p`.E.{gate,up,down}_proj.weight of `state` (popped)."""
    inter = experts.gate_up_proj.shape[1] // 2
    with torch.no_grad():
        for e in range(experts.gate_up_proj.shape[0]):
            experts.gate_up_proj[e][:inter] = state.pop(f"{p}.{e}.gate_proj.weight")
            experts.gate_up_proj[e][inter:] = state.pop(f"{p}.{e}.up_proj.weight")
            experts.down_proj[e] = state.pop(f"{p}.{e}.down_proj.weight")


@pytest.mark.heavy
def test_gpt_oss_w4a16_gptq_export_decodes_in_plain_transformers_to_llmcs_logits(gpt_oss: Path, tmp_path: Path) -> None:
    """W4A16 GPTQ of gpt-oss through the stream (its fused checkpoint split per expert as each layer is read),
    exported as compressed-tensors (experts per expert with their float biases, the router ignored): decoded by
    compressed-tensors and run by transformers' own fused GptOssForCausalLM, the logits equal llmc's torch engine's
    on the artifact, and the quantization is visible."""
    from llmc.engines.torch_ref import TorchEngine

    qm = _quantize(gpt_oss, SCHEMES["int4-gptq"], tmp_path / "q")
    export_compressed_tensors(qm, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    assert "re:.*\\.mlp\\.router$" in config["ignore"]
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.mlp.experts.3.down_proj.weight_packed", "model.layers.1.mlp.experts.3.down_proj.bias",
            "model.layers.0.mlp.router.bias", "model.layers.0.self_attn.sinks"} <= names
    assert not [n for n in names if n.endswith(("gate_up_proj", "gate_up_proj_bias"))]
    from llmc.runtimes.catalog import FORMATS  # `llmc inspect` names no runtime that refuses the family

    assert FORMATS["compressed-tensors"].describe(tmp_path / "export").split("accepted by:")[1].split("\n")[0].strip() == ""
    ids = _ids(2, 2)
    with torch.no_grad():
        base = _float_model(gpt_oss)(input_ids=ids).logits
        llmc_logits = TorchEngine(tmp_path / "export", streamed=False).model(input_ids=ids, use_cache=False).logits
    plain = _transformers_logits_of_export(tmp_path / "export", gpt_oss, ids)
    assert (plain - base).abs().max().item() > 1e-3, "quantization must be visible"
    assert (llmc_logits - plain).abs().max().item() < 1e-4


def test_vllm_targets_of_gpt_oss_are_refused_by_the_plan(gpt_oss: Path) -> None:
    """vLLM's gpt-oss loader reads fused experts only (llmc.runtimes.vllm cites it): a vllm target is refused at plan
    time (exit 3) naming the loader; SGLang and TGI are refused as unread. llama.cpp fixes gpt-oss's clamp at 7.0:
    the tiny model's lowered one is refused, and the way out no longer names the runtimes refused above."""
    import yaml

    from llmc.errors import IncompatibleTargetError
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    def recipe(folder: Path, runtime: str, weights: dict | None = None):
        quantization = ({"weights": weights} if weights else
                        {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}})
        return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)}, "targets": [
            {"runtime": runtime}], "quantization": quantization}))

    with pytest.raises(IncompatibleTargetError, match="_load_weights_other") as refused:
        make_plan(recipe(gpt_oss, "vllm"), gpt_oss)
    # the way out names the runtime that does take it: llama.cpp's GGUF (llmc.formats.gguf_arch's gpt-oss row)
    assert refused.value.exit_code == 3 and "gpt_oss" in str(refused.value) and refused.value.fix.endswith("llama.cpp")
    for runtime in ("sglang", "tgi"):
        with pytest.raises(IncompatibleTargetError, match="not checked"):
            make_plan(recipe(gpt_oss, runtime), gpt_oss)
    # it said "target a compressed-tensors runtime (vllm, sglang)"; with gpt-oss's own clamp (7.0) the llama.cpp
    # build runs end to end (test_llmc_build_of_a_tiny_gpt_oss_for_llama_cpp_end_to_end)
    with pytest.raises(IncompatibleTargetError, match=r"swiglu_limit = 0\.7") as refused:
        make_plan(recipe(gpt_oss, "llama.cpp", {"format": "int8", "strategy": "channel"}), gpt_oss)
    assert refused.value.exit_code == 3 and "(vllm, sglang)" not in refused.value.fix
    assert "sglang, tgi, vllm refuse it" in refused.value.fix


# --------------------------------------------------------------------------- Llama-4 text: its layout row


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    return make_tiny("llama4_text", tmp_path_factory.mktemp("llama4") / "model")


def test_llama4_per_expert_linears_compute_transformers_fused_experts(llama4: Path) -> None:
    """Llama-4's experts (gate_up_proj [E, H, 2I]: transposed, gate then up; inputs already scaled by the sigmoid
    router score) as per-expert Linears in the MoE layer only (interleave 2: layer 0 dense): the whole model's logits
    equal the fused model's (measured bit-identical here; asserted to 1e-6: a routed-out row, 0, gives 0 in both), the
    weights are views of the fused parameter, the router (an nn.Linear) and the shared expert stay as they are."""
    model = _float_model(llama4)
    fused = model.model.layers[1].feed_forward.experts.gate_up_proj
    inter = fused.shape[-1] // 2
    ids = _ids(2, 3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        blocks = moe.unfuse_experts(model)
        after = model(input_ids=ids).logits
    assert blocks == ["model.layers.1.feed_forward"]
    assert (after - before).abs().max().item() < 1e-6
    expert = model.get_submodule("model.layers.1.feed_forward.experts.2")
    assert torch.equal(expert.gate_proj.weight, fused[2][:, :inter].T) and expert.gate_proj.weight.data_ptr() == fused[2].data_ptr()
    assert torch.equal(expert.up_proj.weight, fused[2][:, inter:].T)
    assert isinstance(model.get_submodule("model.layers.1.feed_forward.router"), torch.nn.Linear)
    with safe_open(str(llama4 / "model.safetensors"), "pt") as f:
        saved = moe.per_expert_shapes({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, moe.layout_of(model.config))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"} == {
        k: v for k, v in saved.items() if k != "lm_head.weight"}  # tied head


def test_llama4_layer_by_layer_calibration_sees_the_whole_models_activations(llama4: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """The stream's forward (chunked attention, chunks of 8 in 24-token windows; the dense and the MoE layer; the
    experts' router-scaled inputs) gives every Linear the per-channel input ranges transformers' whole-model forward
    gives it. The check can fail: with chunks covering the window, o_proj sees other inputs. The router stays out of
    the quantized Linears."""
    from tests.unit.test_gemma3 import _linear_input_absmax, observing_channel_absmax

    calib = _ids(4, 1)
    whole = _float_model(llama4)
    moe.unfuse_experts(whole)
    ref = {k: v for k, v in _linear_input_absmax(whole, calib).items() if not k.endswith(".router")}
    unchunked = _float_model(make_tiny("llama4_text", tmp_path / "unchunked", attention_chunk_size=1024))
    assert not torch.allclose(_linear_input_absmax(unchunked, calib)["model.layers.0.self_attn.o_proj"],
                              ref["model.layers.0.self_attn.o_proj"], rtol=1e-4)
    observed = observing_channel_absmax(monkeypatch)
    qm = _quantize(llama4, SCHEMES["fp8-static-kv"], tmp_path / "q")
    assert len(ref) == len(observed) == len(qm.quantized_modules) == (4 + 3) + (4 + 4 * 3 + 3)
    for name, absmax in ref.items():
        torch.testing.assert_close(observed[name], absmax, rtol=1e-5, atol=1e-6, msg=name)
    assert qm.meta["moe"]["ignore"] == ["re:.*\\.feed_forward\\.router$"]


@pytest.mark.heavy
@pytest.mark.parametrize("scheme_name", ["fp8-static-kv", "int4-gptq"])
def test_llama4_export_reloads_with_the_reference_logits(llama4: Path, scheme_name: str, tmp_path: Path) -> None:
    """FP8 W8A8 static + KV and W4A16 GPTQ of Llama-4 text: experts per expert in the export (router float, ignored),
    llmc's torch engine on the export gives the fake-quantized reference's logits; W4A16 decoded by compressed-tensors
    into plain transformers (experts re-fused) gives llmc's logits too."""
    scheme = SCHEMES[scheme_name]
    qm = _quantize(llama4, scheme, tmp_path / "q")
    export_compressed_tensors(qm, tmp_path / "export")
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.feed_forward.experts.3.down_proj.weight_scale",
            "model.layers.1.feed_forward.shared_expert.gate_proj.weight_scale",
            "model.layers.1.feed_forward.router.weight"} <= names
    ids, got = export_gives_the_reference_logits(llama4, qm, scheme, tmp_path / "export")
    if scheme_name == "int4-gptq":
        assert (_transformers_logits_of_export(tmp_path / "export", llama4, ids) - got).abs().max().item() < 1e-4


def test_llama4_plans_for_vllm_and_refuses_calibrating_every_expert(llama4: Path, tmp_path: Path) -> None:
    """vLLM loads Llama-4's per-expert experts (llmc.runtimes.vllm cites its loader): a vllm target plans; calibrating
    every expert on every token is refused (RecipeError, exit 2) by the plan and by the stream: its experts get
    router-scaled inputs, 0 for tokens not routed to them."""
    import yaml

    from llmc.errors import RecipeError
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    def recipe(**calibration):
        return parse_recipe(yaml.safe_dump({
            "name": "t", "model": {"source": str(llama4)}, "targets": [{"runtime": "vllm"}],
            "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                             "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
            "calibration": {"samples": 4, "seq_len": 16, **calibration}}))

    assert make_plan(recipe(), llama4).targets
    gptq = parse_recipe(yaml.safe_dump({
        "name": "t", "model": {"source": str(llama4)}, "targets": [{"runtime": "vllm"}], "calibration": {
            "samples": 4, "seq_len": 16}, "quantization": {"weights": {"format": "int4", "strategy": "group",
                                                                      "group_size": 32}, "algorithm": "gptq"}}))
    (warning,) = [w for w in make_plan(gptq, llama4).warnings if "routed to it" in w]
    assert "calibrate on more tokens" in warning and "moe_calibrate_all_experts" not in warning
    with pytest.raises(RecipeError, match="router score") as refused:
        make_plan(recipe(moe_calibrate_all_experts=True), llama4)
    assert refused.value.exit_code == 2 and "llama4_text" in str(refused.value)
    with pytest.raises(RecipeError, match="router score"):
        _quantize(llama4, SCHEMES["fp8-static-kv"], tmp_path / "q", moe_all_experts=True)


@pytest.mark.slow  # two whole builds: ~80 s each on the loaded 2-core machine
@pytest.mark.parametrize("scheme_name", ["fp8", "w4a16-gptq"])
def test_llmc_build_of_a_tiny_llama4_end_to_end(scheme_name: str, tmp_path: Path) -> None:
    """`llmc build` of a tiny Llama4ForCausalLM (its Hub-layout checkpoint holds fused experts): FP8 W8A8 static + KV,
    or W4A16 GPTQ g32, for vLLM sm90, evaluated by the torch engine from the exported files; passes its (wide) gate,
    and the token report counts every calibration token top-2 in the MoE layer."""
    from llmc.build import build
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store
    from tests.unit.test_build import recipe_text

    folder = make_tiny("llama4_text", tmp_path / "model")
    overrides = {"gates.max_ppl_increase_pct": 1000.0,
                 "quantization.weights.strategy": "tensor"}  # vLLM's fused-MoE FP8 method: as in the Mixtral test
    if scheme_name == "w4a16-gptq":
        overrides["quantization"] = {"weights": {"format": "int4", "strategy": "group", "group_size": 32},
                                     "algorithm": "gptq"}
    store = Store(tmp_path / "cache")
    result = build(parse_recipe(recipe_text(folder, tmp_path / "registry", **overrides)), store, publish=False)
    assert result.passed
    quantized = next(store.root.glob("stages/quantize/*/quantized.json")).parent
    tokens = json.loads((quantized / moe.TOKENS_FILE).read_text())["blocks"]
    assert sorted(tokens) == ["model.layers.1.feed_forward"]
    assert sum(tokens["model.layers.1.feed_forward"]["tokens"]) == 8 * 64 * 2
    quantized_eval = [e for e in result.evals.values() if e.ppl_change is not None]
    assert quantized_eval and all(e.error is None for e in quantized_eval)
    print(scheme_name, {e.engine: (e.perplexity, e.ppl_change) for e in result.evals.values()})


# the GGUF weight type each scheme's experts are written as (llmc.formats.gguf: int8 per channel -> Q8_0, int4 g32 ->
# Q4_0, codes repacked)
_GPT_OSS_LLAMA_CPP = {"w8a16": ({"format": "int8", "strategy": "channel"}, None, "Q8_0"),
                      "w4a16-gptq": ({"format": "int4", "strategy": "group", "group_size": 32}, "gptq", "Q4_0")}


@pytest.mark.slow  # two whole builds, each scored in llama.cpp's own process: 186 s and 499 s at load ~10 here
@pytest.mark.llama
@pytest.mark.parametrize("scheme_name", list(_GPT_OSS_LLAMA_CPP))
def test_llmc_build_of_a_tiny_gpt_oss_for_llama_cpp_end_to_end(scheme_name: str, tmp_path: Path) -> None:
    """`llmc build` of a tiny GptOssForCausalLM (fused experts in its checkpoint, sinks, biased clamped experts,
    sliding/full layers, YaRN) with a llama.cpp target: W8A16 -> Q8_0 or W4A16 GPTQ g32 -> Q4_0, the GGUF scored in
    llama.cpp against the torch engine's baseline: perplexity within 1%, the gate passes, the experts are merged into
    llama.cpp's 3-D tensors of the scheme's type. The model carries gpt-oss's published clamp (swiglu_limit 7.0) and
    YaRN with truncate: llama.cpp fixes the one and rounds the other (tests/integration/test_gguf_moe_llamacpp.py)."""
    from llmc.build import build
    from llmc.engines.llamacpp import llama_cpp_version
    from gguf import GGUFReader

    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store
    from tests.integration.test_gguf_moe_llamacpp import OVERRIDES
    from tests.unit.test_build import recipe_text

    if llama_cpp_version() is None:
        pytest.skip("llama_cpp is not importable in LLMC_LLAMA_PYTHON / .venv-llama (bash scripts/setup-llama.sh)")
    weights, algorithm, gguf_type = _GPT_OSS_LLAMA_CPP[scheme_name]
    folder = make_tiny("gpt_oss", tmp_path / "model", **OVERRIDES["gpt_oss"])
    quantization = {"weights": weights, **({"algorithm": algorithm} if algorithm else {})}
    overrides = {"quantization": quantization, "targets": [{"runtime": "llama.cpp"}],
                 "eval.runtimes": ["torch", "llama.cpp"], "gates.max_ppl_increase_pct": 1000.0}
    store = Store(tmp_path / "cache")
    result = build(parse_recipe(recipe_text(folder, tmp_path / "registry", **overrides)), store, publish=False)
    assert result.passed
    (artifact,) = result.artifacts.values()
    assert artifact.format == "gguf"
    reader = GGUFReader(str(artifact.dir / "model.gguf"))
    assert reader.fields["general.architecture"].contents() == "gpt-oss"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for layer in (0, 1):  # experts merged, per layer, in the scheme's type; the sinks kept in float
        assert {types[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {gguf_type}
        assert types[f"blk.{layer}.attn_sinks.weight"] == "F32"
    (llama,) = [e for e in result.evals.values() if e.engine == "llama.cpp"]
    (baseline,) = [e for e in result.evals.values() if e.engine == "torch" and e.ppl_change is None]
    assert llama.error is None and baseline.error is None
    # the report's llama.cpp perplexity of the artifact within 1% of the torch engine's of the float model (measured:
    # +0.01% for Q8_0, -0.02% for Q4_0); top-1 agreement with the float model's next token over 80%
    assert abs(llama.perplexity / baseline.perplexity - 1) < 0.01
    assert abs(llama.ppl_change["delta_pct"]) < 1.0
    assert llama.top1_agreement["mean"] > 0.8
    print(scheme_name, gguf_type, {"torch": baseline.perplexity, "llama.cpp": llama.perplexity,
                                   "delta_pct": llama.ppl_change["delta_pct"], "top1": llama.top1_agreement["mean"],
                                   "kld": llama.kld["mean"] if llama.kld else None})

@pytest.mark.slow  # one build scored in llama.cpp's own process: 81 s at load ~9 here
@pytest.mark.llama
def test_llmc_build_of_gpt_oss_from_its_mxfp4_original_for_llama_cpp(tmp_path: Path) -> None:
    """gpt-oss as it ships (experts MXFP4, attention and routers in float) through `llmc build` to llama.cpp's own
    gpt-oss format: the experts' MXFP4 codes pass through (no rounding: the target is MXFP4) into GGUF MXFP4 blocks,
    attention stays float as shipped (`ignore`), and llama.cpp scores the GGUF as the torch engine scores the decoded
    original: perplexity within 1%, top-1 > 0.95, KLD < 1e-4 (the Q8_0 case's bounds; what is left is llama.cpp's
    arithmetic; measured -0.053%, 0.989, 1.0e-05; every expert's down_proj 5% too large moves this tiny model's KLD to
    1.1e-04, top-1 0.964, in transformers)."""
    from gguf import GGUFReader

    from llmc.build import build
    from llmc.engines.llamacpp import llama_cpp_version
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store
    from tests.integration.test_gguf_moe_llamacpp import OVERRIDES
    from tests.unit.test_build import recipe_text

    if llama_cpp_version() is None:
        pytest.skip("llama_cpp is not importable in LLMC_LLAMA_PYTHON / .venv-llama (bash scripts/setup-llama.sh)")
    dense = make_tiny("gpt_oss", tmp_path / "dense", **OVERRIDES["gpt_oss"])
    folder = save_as_mxfp4_original(dense, tmp_path / "model")
    overrides = {"quantization": {"weights": {"format": "mxfp4", "strategy": "group", "group_size": 32},
                                  "ignore": ["lm_head", "re:.*self_attn.*"]},
                 "targets": [{"runtime": "llama.cpp"}], "eval.runtimes": ["torch", "llama.cpp"],
                 "gates.max_ppl_increase_pct": 1000.0}
    store = Store(tmp_path / "cache")
    result = build(parse_recipe(recipe_text(folder, tmp_path / "registry", **overrides)), store, publish=False)
    assert result.passed
    (artifact,) = result.artifacts.values()
    reader = GGUFReader(str(artifact.dir / "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for layer in (0, 1):
        assert {types[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
        assert types[f"blk.{layer}.attn_q.weight"] in ("F16", "F32")  # attention as shipped: not quantized
    # the experts' codes and E8M0 scales passed through bit for bit (down_proj: its rows are the source's rows)
    from llmc.quant.microscaling import unpack_e2m1

    quantized = QuantizedModel.open(next(store.root.glob("stages/quantize/*/quantized.json")).parent)
    canonical = {k: v for t in quantized.iter_files() for k, v in t.items()}
    source = load_file(str(folder / "model.safetensors"))
    for layer in (0, 1):
        blocks = source[f"model.layers.{layer}.mlp.experts.down_proj_blocks"]
        scales = source[f"model.layers.{layer}.mlp.experts.down_proj_scales"]
        for e in range(blocks.shape[0]):
            name = f"model.layers.{layer}.mlp.experts.{e}.down_proj"
            assert torch.equal(canonical[f"{name}.weight_scale"], scales[e])
            assert torch.equal(canonical[f"{name}.weight"], unpack_e2m1(blocks[e].reshape(blocks.shape[1], -1)))
    (llama,) = [e for e in result.evals.values() if e.engine == "llama.cpp"]
    (baseline,) = [e for e in result.evals.values() if e.engine == "torch" and e.ppl_change is None]
    assert abs(llama.perplexity / baseline.perplexity - 1) < 0.01
    assert llama.top1_agreement["mean"] > 0.95 and llama.kld["mean"] < 1e-4
    print("mxfp4", {"torch": baseline.perplexity, "llama.cpp": llama.perplexity,
                    "delta_pct": llama.ppl_change["delta_pct"], "top1": llama.top1_agreement["mean"],
                    "kld": llama.kld["mean"]})


def test_a_gpt_oss_checkpoint_with_a_transposed_fused_tensor_is_refused_by_the_plan(gpt_oss: Path, tmp_path: Path) -> None:
    """The fused experts of a checkpoint that holds them (gpt-oss) are checked against config.json as the per-expert
    tensors the build reads them as: gate_up_proj saved [E, 2I, H] instead of [E, H, 2I] is refused (exit 7) before
    any layer computes, and a 2-D one is named as not 3-D."""
    import shutil

    import yaml

    from llmc.errors import InputError
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    recipe = parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(tmp_path / "m")}, "targets": [
        {"runtime": "vllm"}], "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 32}}}))
    for broken, match in ((lambda t: t.transpose(1, 2).contiguous(), "experts.0.gate_proj.weight"),
                          (lambda t: t[0].contiguous(), "fused experts are 3-D")):
        shutil.rmtree(tmp_path / "m", ignore_errors=True)
        shutil.copytree(gpt_oss, tmp_path / "m")
        state = load_file(str(tmp_path / "m" / "model.safetensors"))
        state["model.layers.1.mlp.experts.gate_up_proj"] = broken(state["model.layers.1.mlp.experts.gate_up_proj"])
        save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(InputError, match=match) as refused:
            make_plan(recipe, tmp_path / "m")
        assert refused.value.exit_code == 7
