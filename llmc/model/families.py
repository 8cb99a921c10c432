"""What llmc can quantize, decided from config.json alone (before any weight loads).

Dense decoder-only families are found structurally (llmc.quant.algorithms.mappings). Mixture-of-Experts models are
quantized expert by expert (llmc.quant.moe) for the families whose fused experts llmc maps to per-expert Linears
under their Hub names and whose export round-trip is tested (tests/unit/test_moe.py): Mixtral, Qwen3-MoE, Qwen2-MoE,
Qwen3-Next, Qwen3.5-MoE (text) and MiniMax-M2. Other MoE families are refused with the reason (DeepSeek's multi-head
latent attention, ...): the stream would quantize them without a tested layout. A shared expert is an ordinary MLP
inside the block (role shared_experts); its one-row sigmoid gate stays in the model's dtype (`KEPT_IN_DTYPE`), as do
the gated-DeltaNet per-head gate projections of Qwen3-Next / Qwen3.5's linear-attention layers (dense Qwen3.5 too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmc.errors import IncompatibleTargetError

# config keys that give a Mixture-of-Experts model's routed expert count (Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, ...)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

# model_type -> why llmc refuses it, for MoE families people ask about
_WHY_NOT = {
    "deepseek_v2": "multi-head latent attention (low-rank q/kv projections) and shared experts",
    "deepseek_v3": "multi-head latent attention (low-rank q/kv projections) and shared experts",
}


def expert_count(config: dict) -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return max((int(config[k]) for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), default=0)


@dataclass(frozen=True)
class MoeLayout:
    """How a family's Hub checkpoints name one MoE block (what vLLM's fused-MoE loaders read)."""

    block: str  # the block's name inside a decoder layer in the Hub checkpoint
    gate: str  # the per-expert projection names: gate (through the activation), up, down
    up: str
    down: str
    router: str = "gate"


# model_type -> layout of the MoE families llmc quantizes expert by expert (llmc.quant.moe; transformers'
# conversion_mapping.py converts from exactly these names)
LAYOUTS: dict[str, MoeLayout] = {
    "mixtral": MoeLayout("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    # routed experts + mlp.shared_expert (an MLP) + mlp.shared_expert_gate (Linear, 1 row: KEPT_IN_DTYPE)
    "qwen2_moe": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    # Qwen2-MoE's block; layers alternate gated-DeltaNet linear attention (linear_attn) and full attention (self_attn)
    "qwen3_next": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_5_moe_text": MoeLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    # Mixtral's Hub names (conversion_mapping.py maps minimax_m2 to mixtral); the router's sigmoid scores take the
    # block's e_score_correction_bias buffer, a non-Linear tensor kept as stored
    "minimax_m2": MoeLayout("block_sparse_moe", "w1", "w3", "w2"),
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
KEPT_IN_DTYPE: dict[str, dict[str, str]] = {
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


def _moe_roles(layout: MoeLayout) -> dict[str, str]:
    block = re.escape(layout.block)
    return {"attention": _ATTENTION, "experts": rf"{block}\.experts\.\d+\.",
            "router": rf"{block}\.{re.escape(layout.router)}$",
            "mlp": r"mlp\."}  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step: dense MLPs in some layers


LINEAR_ROLES: dict[str, dict[str, str]] = {
    **{family: _moe_roles(layout) for family, layout in LAYOUTS.items()},
    **{family: {"attention": _HYBRID_ATTENTION if family != "qwen2_moe" else _ATTENTION,
                "experts": r"mlp\.experts\.\d+\.", "shared_experts": r"mlp\.shared_expert\.",
                "router": r"mlp\.(gate|shared_expert_gate)$", "mlp": r"mlp\."}
       for family in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")},
    "qwen3_5_text": {"attention": _HYBRID_ATTENTION, "mlp": r"mlp\."},
}


def linear_role(model_type: str | None, local_name: str) -> str | None:
    """The role (llmc.quant.spec.ROLES) of the Linear named `local_name` inside a decoder layer of `model_type`;
    None when the family's table names none for it."""
    for role, pattern in LINEAR_ROLES.get(model_type or "", _DENSE_ROLES).items():
        if re.match(pattern, local_name):
            return role
    return None
