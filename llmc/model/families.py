"""What llmc can quantize, decided from config.json alone (before any weight loads).

Dense decoder-only families are found structurally (llmc.quant.algorithms.mappings). Mixture-of-Experts models are
quantized expert by expert (llmc.quant.moe) for the families whose fused experts llmc maps to per-expert Linears
under their Hub names and whose export round-trip is tested (tests/unit/test_moe.py): Mixtral, Qwen3-MoE, Qwen2-MoE,
Qwen3-Next, Qwen3.5-MoE (text), MiniMax-M2, gpt-oss, Llama-4 text, DeepSeek-V3 (Kimi-K2: the same model_type;
multi-head latent attention, shared experts, dense first layers), DeepSeek-V3.2 (V3 plus a sparse-attention lightning
indexer in every attention block), GLM-4.5 (tests/unit/test_deepseek.py) and Gemma-4's MoE variant (its decoder layer
is the block; tests/unit/test_gemma4_moe.py). How a
family's experts differ (gpt-oss: biased, gate/up interleaved and stored transposed, a clamped SwiGLU; Llama-4:
router-scaled inputs; both: fused tensors in their Hub checkpoints; shared experts and their gates) is data in its
`MoeLayout` row, read by one `Expert` / `ExpertLinears` pair (llmc.quant.moe). A shared expert is an ordinary MLP
inside the block (role shared_experts); a one-row sigmoid gate for it stays in the model's dtype (`KEPT_IN_DTYPE`), as
do the gated-DeltaNet per-head gate projections of Qwen3-Next / Qwen3.5's linear-attention layers (dense Qwen3.5 too).
DeepSeek-V3.2's indexer projections wk and weights_proj stay in the model's dtype too (`KEPT_IN_DTYPE` says why).
Other MoE families are refused with the reason: their blocks hold more than llmc has a tested layout for
(DeepSeek-V2's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmc.errors import IncompatibleTargetError, RecipeError

# config keys that give a Mixture-of-Experts model's routed expert count (Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, ...)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

# model_type -> why llmc refuses it, for MoE families people ask about
_WHY_NOT = {
    "deepseek_v2": "multi-head latent attention (low-rank q/kv projections) and shared experts",
}


def expert_count(config: dict) -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return max((int(config[k]) for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), default=0)


def experts_per_token(config: dict) -> int | None:
    """The experts each token is routed to (top-k): num_experts_per_tok, Gemma-4's top_k_experts; None if unsaid."""
    top = config.get("num_experts_per_tok") or config.get("top_k_experts")
    return int(top) if top else None


@dataclass(frozen=True)
class MoeLayout:
    """How a family's Hub checkpoints name one MoE block (what vLLM's fused-MoE loaders read)."""

    block: str  # the block's name inside a decoder layer in the Hub checkpoint ("": the layer itself, Gemma-4)
    gate: str  # the per-expert projection names: gate (through the activation), up, down
    up: str
    down: str
    router: str = "gate"
    # How transformers holds the fused experts and what one expert computes; the defaults are Mixtral's / Qwen3-MoE's.
    # gate_up: "halves" (gate rows, then up rows) or "interleaved" (gate = [..., ::2], up = [..., 1::2]: gpt-oss)
    gate_up: str = "halves"
    transposed: bool = False  # fused tensors stored [E, in, out] (gpt-oss: gate_up_proj [E, H, 2I]), not [E, out, in]
    bias: bool = False  # per-expert biases (gpt-oss: gate_up_proj_bias [E, 2I], down_proj_bias [E, H])
    # "glu": down(act(gate) * up); "clamped_swiglu": gpt-oss's down((clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)),
    # g = clamp(gate, max=limit), alpha and limit from the fused module (swiglu_alpha / swiglu_limit in config.json)
    activation: str = "glu"
    # the Hub checkpoint stores the fused 3-D tensors as transformers holds them (no conversion mapping, gpt-oss);
    # llmc splits them per expert as it reads a layer (llmc.quant.moe.per_expert_tensors)
    checkpoint_fused: bool = False
    # how the block calls its experts: "top_k" experts(hidden, top-k index, top-k weights), each expert's output
    # weighted; "scaled_input" (Llama-4) experts(routed_in): every token once per expert, [E * T, H], already
    # multiplied by that expert's sigmoid router score (0 where not routed), outputs summed unweighted
    routing: str = "top_k"
    shared: str | None = None  # a shared expert beside the routed ones (Llama-4 `shared_expert`: a dense MLP)
    # the shared expert's own gate (Qwen2-MoE's `shared_expert_gate`: a one-row Linear, a router in its role, kept)
    shared_gate: str | None = None


# model_type -> layout of the MoE families llmc quantizes expert by expert (llmc.quant.moe; transformers'
# conversion_mapping.py converts from exactly these names)
LAYOUTS: dict[str, MoeLayout] = {
    "mixtral": MoeLayout("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    # gpt-oss: exported per expert under llm-compressor's names for it (mlp.experts.E.{gate,up,down}_proj, with
    # biases; docs/models.md says why); the router `mlp.router` (weight and bias) stays unquantized
    "gpt_oss": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", router="router", gate_up="interleaved",
                         transposed=True, bias=True, activation="clamped_swiglu", checkpoint_fused=True),
    # Llama-4 text: gate_up_proj [E, H, 2I] (transposed, halves), a shared expert, the router (an nn.Linear) kept;
    # MoE only in config.moe_layers (interleave_moe_layer_step), the other layers a dense `feed_forward` MLP
    "llama4_text": MoeLayout("feed_forward", "gate_proj", "up_proj", "down_proj", router="router", transposed=True,
                             checkpoint_fused=True, routing="scaled_input", shared="shared_expert"),
    # DeepSeek-V3 (and Kimi-K2, same model_type) and GLM-4.5: Qwen-style experts plus `mlp.shared_experts` (a
    # dense SwiGLU MLP, quantized) and a sigmoid top-k router `mlp.gate` with `e_score_correction_bias` (kept in
    # float); their first `first_k_dense_replace` layers hold a dense `mlp`
    "deepseek_v3": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts"),
    # DeepSeek-V3.2: DeepSeek-V3's block (transformers' conversion_mapping maps both from the same per-expert names);
    # its attention adds the lightning indexer (self_attn.indexer, `KEPT_IN_DTYPE` below)
    "deepseek_v32": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts"),
    "glm4_moe": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts"),
    # routed experts + mlp.shared_expert (an MLP) + mlp.shared_expert_gate (Linear, 1 row: KEPT_IN_DTYPE)
    "qwen2_moe": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_expert",
                           shared_gate="shared_expert_gate"),
    # Qwen2-MoE's block; layers alternate gated-DeltaNet linear attention (linear_attn) and full attention (self_attn)
    "qwen3_next": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_expert",
                            shared_gate="shared_expert_gate"),
    "qwen3_5_moe_text": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_expert",
                                  shared_gate="shared_expert_gate"),
    # Mixtral's Hub names (conversion_mapping.py maps minimax_m2 to mixtral); the router's sigmoid scores take the
    # block's e_score_correction_bias buffer, a non-Linear tensor kept as stored
    "minimax_m2": MoeLayout("block_sparse_moe", "w1", "w3", "w2"),
    # Gemma-4's MoE variant (enable_moe_block): the decoder layer itself is the block (block ""), its experts
    # `layers.L.experts` beside a dense `mlp` that stays; fused [E, 2I, H] halves in the Hub checkpoint (no conversion
    # mapping), read per expert as `layers.L.experts.E.{gate,up,down}_proj` by vLLM's gemma4.py _weight_iterator; the
    # router `layers.L.router` (norm, scale, per_expert_scale) projects through `router.proj`, an nn.Linear kept
    "gemma4_text": MoeLayout("", "gate_proj", "up_proj", "down_proj", router="router.proj", checkpoint_fused=True),
}

# model_type -> Linears of a decoder layer that stay in the model's dtype, as for MoE routers: regex on the name inside
# the layer -> why. The stream never quantizes them, the plan names them, every export lists them as unquantized
# (quantized.json's unquantized_linears). vLLM builds the same modules unquantized or takes them from `ignore`:
# Qwen2-MoE's shared_expert_gate is a plain torch Linear (vllm/model_executor/models/qwen2_moe.py); the gated-DeltaNet
# in_proj_ba (Qwen3-Next) / in_proj_b + in_proj_a (Qwen3.5, merged into in_proj_ba) have num_v_heads rows, fewer per
# rank than Marlin's 64 and than an FP8 block's 128 (vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py,
# create_ba_proj / maybe_disable_tp, vllm issue 35924). The conv1d, A_log, dt_bias and norms are no Linears: kept too.
_SHARED_EXPERT_GATE = {r"mlp\.shared_expert_gate$": "the shared expert's sigmoid gate (one output row)"}
_DELTANET_GATES = "the gated-DeltaNet per-head decay/beta gate projection (num_v_heads output rows)"
# DeepSeek-V3.2's lightning indexer (self_attn.indexer: wq_b, wk, k_norm, weights_proj; it picks the index_topk keys
# each query attends to): vLLM builds wq_b as a quantized ReplicatedLinear (quant_config) but fuses wk and weights_proj
# into one unquantized GEMM, `wk_weights_proj` (MergedColumnParallelLinear, quant_config=None), upcasting an FP8 wk to
# bf16 as it loads (vllm-project/vllm: vllm/model_executor/models/deepseek_v2.py, `Indexer` and
# `_try_load_fp8_indexer_wk`, read at 002d607): a compressed-tensors-quantized wk or weights_proj has no quantized
# layer to load into there. So wq_b is quantized with the attention (role attention, `self_attn.`), wk and
# weights_proj stay in the dtype (and in `ignore`); k_norm is a LayerNorm, no Linear.
_DSA_INDEXER = {r"self_attn\.indexer\.(wk|weights_proj)$":
                "the sparse-attention indexer's key / head-weight projection (vLLM fuses them into one unquantized "
                "GEMM, wk_weights_proj)"}
KEPT_IN_DTYPE: dict[str, dict[str, str]] = {
    "deepseek_v32": _DSA_INDEXER,
    "qwen2_moe": _SHARED_EXPERT_GATE,
    "qwen3_next": {**_SHARED_EXPERT_GATE, r"linear_attn\.in_proj_ba$": _DELTANET_GATES},
    "qwen3_5_text": {r"linear_attn\.in_proj_[ab]$": _DELTANET_GATES},
    "qwen3_5_moe_text": {**_SHARED_EXPERT_GATE, r"linear_attn\.in_proj_[ab]$": _DELTANET_GATES},
}

_LAYER_LOCAL = re.compile(r"(?:^|\.)layers\.\d+\.(.+)$")


def kept_in_dtype(model_type: str | None, name: str) -> str | None:
    """Why the Linear `name` (a full module name, or a name inside a decoder layer) stays in the model's dtype for
    `model_type`; None when the family's table quantizes it."""
    m = _LAYER_LOCAL.search(name)
    local = m.group(1) if m else name
    for pattern, why in KEPT_IN_DTYPE.get(model_type or "", {}).items():
        if re.match(pattern, local):
            return why
    return None


def moe_families() -> frozenset[str]:
    """The MoE model_types llmc quantizes."""
    return frozenset(LAYOUTS)


def check_quantizable(config: dict) -> None:
    """IncompatibleTargetError for model families llmc cannot quantize correctly yet."""
    experts = expert_count(config)
    family = config.get("model_type")
    if experts > 1 and family not in moe_families():
        why = _WHY_NOT.get(family, "a Mixture-of-Experts layout llmc has no tested per-expert mapping for")
        raise IncompatibleTargetError(
            f"model_type {family!r} is a Mixture-of-Experts model ({experts} experts per layer) with {why}: llmc "
            f"quantizes the MoE families {', '.join(sorted(moe_families()))} only",
            fix="quantize this model with llm-compressor or ModelOpt, or use a supported family",
        )


def all_experts_refused(family: str | None):
    """The RecipeError (exit 2) for calibration.moe_calibrate_all_experts on a family whose experts get router-scaled
    inputs (`MoeLayout.routing` "scaled_input", Llama-4: 0 for every token not routed to an expert)."""
    return RecipeError(
        f"calibration.moe_calibrate_all_experts: model_type {family!r} experts receive their input already scaled by "
        "the router score, which is 0 for every token not routed to them: there is no input to calibrate them on for "
        "those tokens", fix="set calibration.moe_calibrate_all_experts: false (experts no token reaches are reported "
        "and get their peers' scales), or give more calibration.samples")


def check_all_experts(config: dict, all_experts: bool) -> None:
    """Refuse (`all_experts_refused`) calibrating every expert on every token where the family's experts cannot be."""
    layout = LAYOUTS.get(config.get("model_type"))
    if all_experts and layout is not None and layout.routing == "scaled_input":
        raise all_experts_refused(config.get("model_type"))


# model_type -> why llmc does not quantize its KV cache (the scheme's kv_cache is refused at plan time)
_MLA_CACHE = ("multi-head latent attention caches the compressed latent (kv_a_layernorm's output and the shared "
              "rope key, one scale in vLLM's MLA cache), not per-head keys and values, which are what llmc "
              "observes k_scale/v_scale on")
_NO_KV_CACHE = {
    "deepseek_v3": _MLA_CACHE,
    # DeepSeek-V3.2: V3's latent cache, plus the indexer's own key cache (vLLM: FP8 with a float32 scale per 128
    # values, quantized as it is written, DeepseekV32IndexerCache), which no llmc scale reaches either
    "deepseek_v32": _MLA_CACHE,
}


def check_kv_cache(config: dict) -> None:
    """IncompatibleTargetError for a family whose KV cache llmc cannot quantize correctly (`_NO_KV_CACHE`)."""
    family = config.get("model_type")
    if family in _NO_KV_CACHE:
        raise IncompatibleTargetError(
            f"model_type {family!r}: no KV-cache quantization: {_NO_KV_CACHE[family]}",
            fix="drop quantization.kv_cache (the weights and activations still quantize)",
        )


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def unloaded_layers_note(config: dict, tensor_names) -> str | None:
    """The plan's and the quantize log's line for decoder layers a checkpoint holds beyond `num_hidden_layers`:
    DeepSeek-V3's and GLM-4.5's multi-token-prediction (MTP) layers (`num_nextn_predict_layers`), which transformers
    does not load (`_keys_to_ignore_on_load_unexpected`) and llmc neither quantizes nor exports. None: there are
    none."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        return None
    extra: dict[int, int] = {}
    for name in tensor_names:
        m = _LAYER_INDEX.match(name)
        if m and int(m.group(1)) >= n:
            extra[int(m.group(1))] = extra.get(int(m.group(1)), 0) + 1
    if not extra:
        return None
    layers = ", ".join(f"model.layers.{i}.* ({extra[i]} tensors)" for i in sorted(extra))
    mtp = config.get("num_nextn_predict_layers")
    what = (f"the multi-token-prediction layer{'s' if len(extra) > 1 else ''} (num_nextn_predict_layers {mtp})"
            if mtp else f"layers past num_hidden_layers {n}")
    return (f"{layers}: {what}, which transformers does not load: skipped (neither quantized nor exported), so the "
            "artifact serves without MTP speculative decoding")


# What each Linear of a decoder layer does, per family: role -> regex on its name inside the layer (after
# "<layers>.<i>."), asked in order (the first match wins, so experts come before the dense MLP they sit in). Mixed-
# precision groups select by these roles (llmc.quant.groups). Dense families share one entry: transformers names their
# attention `self_attn` and their MLP `mlp` (Phi-3's fused qkv_proj / gate_up_proj included). MoE families: experts
# and router under the Hub names of their `LAYOUTS` entry; the Qwen2-MoE block (Qwen3-Next, Qwen3.5-MoE too) has a
# shared expert and a Linear gate for it.
_ATTENTION = r"self_attn\."
_DENSE_ROLES: dict[str, str] = {"attention": _ATTENTION, "mlp": r"mlp\."}
# Qwen3-Next / Qwen3.5: the gated-DeltaNet projections (in_proj_qkvz or in_proj_qkv + in_proj_z, out_proj) are
# attention too
_HYBRID_ATTENTION = r"(self_attn|linear_attn)\."


def _moe_roles(layout: MoeLayout, attention: str = _ATTENTION) -> dict[str, str]:
    block = re.escape(layout.block)
    shared = {"shared_experts": rf"{block}\.{re.escape(layout.shared)}\."} if layout.shared else {}
    routers = "|".join(re.escape(r) for r in (layout.router, layout.shared_gate) if r)
    return {"attention": attention, "experts": rf"{block}\.experts\.\d+\.", **shared,
            "router": rf"{block}\.({routers})$",
            # dense MLPs in some layers: Qwen3-MoE's mlp_only_layers / decoder_sparse_step, Llama-4's interleave
            "mlp": rf"(mlp|{block})\."}


# families whose layers alternate full attention (self_attn) and gated-DeltaNet linear attention (linear_attn)
_HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")

LINEAR_ROLES: dict[str, dict[str, str]] = {
    **{family: _moe_roles(layout, _HYBRID_ATTENTION if family in _HYBRID_FAMILIES else _ATTENTION)
       for family, layout in LAYOUTS.items() if layout.block},
    "qwen3_5_text": {"attention": _HYBRID_ATTENTION, "mlp": r"mlp\."},
    # Gemma-4: the layer is the MoE block (experts and router directly in it); its dense `mlp` runs beside them, and
    # the per-layer-input gate and projection (a gated feed-forward path of their own) count as MLP too
    "gemma4_text": {"attention": _ATTENTION, "experts": r"experts\.\d+\.", "router": r"router\.proj$",
                    "mlp": r"(mlp\.|per_layer_(input_gate|projection)$)"},
}


def linear_role(model_type: str | None, local_name: str) -> str | None:
    """The role (llmc.quant.spec.ROLES) of the Linear named `local_name` inside a decoder layer of `model_type`;
    None when the family's table names none for it."""
    for role, pattern in LINEAR_ROLES.get(model_type or "", _DENSE_ROLES).items():
        if re.match(pattern, local_name):
            return role
    return None
