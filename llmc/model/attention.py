"""The model's own attention entered through a named wrapper that first sees (or changes) the keys and values it
would cache: calibration's KV-cache observer (`llmc.quant.observe`) and the torch engine's quantized KV cache
(`llmc.engines.torch_ref`) are the two wrappers.

`register_kv_attention` names a wrapper; `route_kv` points the chosen attention modules' configs at it. The name
a config gets says which attention the wrapper then runs — the one the config named before (`<wrapper>+sdpa`,
`<wrapper>+eager`, `<wrapper>+flash_attention_2`, …) — and transformers builds that attention's own mask for it:
an eager attention (Gemma 2's logit soft-capping) adds a float mask, SDPA takes a boolean one, and an eager
function given SDPA's boolean mask adds 0/1 and masks nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

KvHook = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_HOOKS: dict[str, KvHook] = {}
_BASE: dict[int, str] = {}  # id(attention module) -> the implementation its config named before routing


def register_kv_attention(name: str, on_kv: KvHook) -> None:
    """Name a wrapper: `on_kv(module, key, value)` returns the keys and values the base attention then uses."""
    _HOOKS[name] = on_kv


def _routed(name: str, base: str) -> str:
    """The implementation name of wrapper `name` over `base`, registered with transformers on first use."""
    # lazy: transformers (~2 s), only when attention is routed; torch_ref imports this module
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    routed = f"{name}+{base}"
    if routed in ALL_ATTENTION_FUNCTIONS:
        return routed
    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {base!r} is not registered with transformers")
    on_kv = _HOOKS[name]

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = on_kv(module, key, value)
        if base == "eager":  # the family's own function (soft-capping, sinks), as the model calls it
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        return fn(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(routed, attention)
    mask = ALL_MASK_ATTENTION_FUNCTIONS[base] if base in ALL_MASK_ATTENTION_FUNCTIONS else ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    AttentionMaskInterface.register(routed, mask)
    return routed


def route_kv(modules: Iterable[tuple[nn.Module, object]], name: str) -> None:
    """Point each (attention module, its config) at wrapper `name` over the attention the config names now. Every
    base is read before any config changes: the modules of one model share a config."""
    pairs = [(module, config, config._attn_implementation or "sdpa") for module, config in modules]
    for module, _config, base in pairs:
        if not base.startswith(f"{name}+"):
            _BASE[id(module)] = base
    for module, config, _base in pairs:
        config._attn_implementation = _routed(name, _BASE.get(id(module), "sdpa"))


def unroute_kv(modules: Iterable[tuple[nn.Module, object]]) -> None:
    """Give each module's config back the implementation it named before `route_kv`."""
    for module, config in list(modules):
        config._attn_implementation = _BASE.pop(id(module), "sdpa")
