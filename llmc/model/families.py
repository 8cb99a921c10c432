"""What llmc can quantize, decided from config.json alone (before any weight loads).

Dense decoder-only families are found structurally (llmc.quant.algorithms.mappings). Mixture-of-Experts models are
quantized expert by expert (llmc.quant.moe) for the families whose fused experts llmc maps to per-expert Linears
under their Hub names and whose export round-trip is tested (tests/unit/test_moe.py): Mixtral and Qwen3-MoE. Other
MoE families are refused with the reason: their blocks hold more than routed SwiGLU experts (shared experts and
their gates, DeepSeek's multi-head latent attention), which the stream would quantize without a tested layout.
"""

from __future__ import annotations

import re

from llmc.errors import IncompatibleTargetError

# config keys that give a Mixture-of-Experts model's routed expert count (Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, ...)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

# model_type -> why llmc refuses it, for MoE families people ask about
_WHY_NOT = {
    "deepseek_v2": "multi-head latent attention (low-rank q/kv projections) and shared experts",
    "deepseek_v3": "multi-head latent attention (low-rank q/kv projections) and shared experts",
    "qwen2_moe": "a shared expert with its own sigmoid gate (shared_expert_gate, a Linear that must stay unquantized)",
}


def expert_count(config: dict) -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return max((int(config[k]) for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), default=0)


def moe_families() -> frozenset[str]:
    """The MoE model_types llmc quantizes."""
    # lazy: llmc.quant.moe pulls torch; llmc.runtimes.registry (torch-free) imports this module
    from llmc.quant.moe import LAYOUTS

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
# precision groups select by these roles (llmc.quant.groups); MoE names are the Hub's (llmc.quant.moe.LAYOUTS).
# Dense families share one entry: transformers names their attention `self_attn` and their MLP `mlp` (Phi-3's fused
# qkv_proj / gate_up_proj included). A router that is an nn.Linear (Qwen2-MoE's shared_expert_gate) has its role so
# a group can leave it unquantized.
_ATTENTION = r"self_attn\."
_DENSE_ROLES: dict[str, str] = {"attention": _ATTENTION, "mlp": r"mlp\."}
LINEAR_ROLES: dict[str, dict[str, str]] = {
    "mixtral": {"attention": _ATTENTION, "experts": r"block_sparse_moe\.experts\.\d+\.",
                "router": r"block_sparse_moe\.gate$"},
    "qwen3_moe": {"attention": _ATTENTION, "experts": r"mlp\.experts\.\d+\.", "router": r"mlp\.gate$",
                  "mlp": r"mlp\."},  # mlp_only_layers / decoder_sparse_step: dense MLPs in some layers
    "qwen2_moe": {"attention": _ATTENTION, "experts": r"mlp\.experts\.\d+\.",
                  "shared_experts": r"mlp\.shared_expert\.", "router": r"mlp\.(gate|shared_expert_gate)$"},
}


def linear_role(model_type: str | None, local_name: str) -> str | None:
    """The role (llmc.quant.spec.ROLES) of the Linear named `local_name` inside a decoder layer of `model_type`;
    None when the family's table names none for it."""
    for role, pattern in LINEAR_ROLES.get(model_type or "", _DENSE_ROLES).items():
        if re.match(pattern, local_name):
            return role
    return None
