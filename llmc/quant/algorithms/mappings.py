"""Which operation produces the input of which Linears inside a decoder layer.

SmoothQuant and AWQ rescale a shared input between its producer (an RMSNorm, or a Linear) and the
Linears that consume it; AWQ measures the error at the output of `parent`. Names are relative to the
decoder layer and follow the Llama family (Llama, Mistral, Qwen2/3, SmolLM, Gemma 2/3).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Mapping:
    producer: str
    consumers: tuple[str, ...]
    parent: str
    from_norm: bool  # the producer is a norm (SmoothQuant only rescales these)


class UnsupportedLayout(ValueError):
    pass


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


def layer_mappings(layer: nn.Module) -> list[Mapping]:
    """The producer → consumers pairs of one decoder layer, in forward order."""
    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    mlp_norm = "pre_feedforward_layernorm" if _has(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
    needed = ["input_layernorm", *attn, "self_attn.o_proj", mlp_norm, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    missing = [n for n in needed if not _has(layer, n)]
    if missing:
        raise UnsupportedLayout(
            f"{type(layer).__name__} has no {', '.join(missing)}: SmoothQuant/AWQ know Llama-family layers "
            "(input_layernorm → q/k/v_proj, post_attention_layernorm → gate/up_proj); fix: use algorithm rtn or gptq"
        )
    mappings = [Mapping("input_layernorm", attn, "self_attn", True)]
    v, o = layer.get_submodule("self_attn.v_proj"), layer.get_submodule("self_attn.o_proj")
    if v.out_features == o.in_features:  # with grouped-query attention v's outputs are shared by heads
        mappings.append(Mapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", False))
    mappings.append(Mapping(mlp_norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp", True))
    mappings.append(Mapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj", False))
    return mappings
