"""What llmc can quantize, decided from config.json alone (before any weight loads).

Dense decoder-only families are found structurally (llmc.quant.algorithms.mappings). Mixture-of-Experts models are
quantized expert by expert (llmc.quant.moe) for the families whose fused experts llmc maps to per-expert Linears
under their Hub names and whose export round-trip is tested (tests/unit/test_moe.py): Mixtral and Qwen3-MoE. Other
MoE families are refused with the reason: their blocks hold more than routed SwiGLU experts (shared experts and
their gates, DeepSeek's multi-head latent attention), which the stream would quantize without a tested layout.
"""

from __future__ import annotations

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
