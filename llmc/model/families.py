"""What llmc can quantize, decided from config.json alone (before any weight loads).

Dense decoder-only families are found structurally (llmc.quant.algorithms.mappings); Mixture-of-Experts models are
not supported yet: transformers keeps their experts as fused 3-D parameters (not nn.Linear), which the layer stream
would leave unquantized without a word, and per-expert calibration (tokens routed to each expert, starved experts)
is not implemented. They are refused with that reason instead.
"""

from __future__ import annotations

from llmc.errors import IncompatibleTargetError

# config keys that give a Mixture-of-Experts model's routed expert count (Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, ...)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config: dict) -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return max((int(config[k]) for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), default=0)


def check_quantizable(config: dict) -> None:
    """IncompatibleTargetError for model families llmc cannot quantize correctly yet."""
    experts = expert_count(config)
    if experts > 1:
        raise IncompatibleTargetError(
            f"model_type {config.get('model_type')!r} is a Mixture-of-Experts model ({experts} experts per layer): "
            "llmc does not quantize MoE experts yet (transformers keeps them as fused 3-D parameters, which would "
            "stay unquantized, and per-expert calibration is not implemented)",
            fix="use a dense model, or quantize this one with llm-compressor or ModelOpt until llmc supports MoE",
        )
