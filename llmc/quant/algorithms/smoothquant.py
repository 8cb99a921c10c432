"""SmoothQuant: move activation outliers into the weights with a per-input-channel scale s.

    y = (x / s) · (W · s)ᵀ    with    s_j = max|x_j|^α / max_k |W_kj|^(1-α)

The division by s is folded into the operation that produces x (an RMSNorm's weight, or the rows of
the previous Linear), so the model computes the same function with easier-to-quantize activations.
"""

from __future__ import annotations

import torch
from torch import nn

MIN_SCALE = 1e-5


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Per-input-channel scales for Linears sharing one input, from the observed |x| maxima."""
    w_absmax = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    a = act_absmax.float().clamp(min=MIN_SCALE)
    s = a.pow(alpha) / w_absmax.clamp(min=MIN_SCALE).pow(1 - alpha)
    # A channel that never carries signal (or whose weights are all zero) keeps scale 1.
    s = torch.where((act_absmax > 0) & (w_absmax > 0), s, torch.ones_like(s))
    return s.clamp(min=MIN_SCALE)


def divide_output(producer: nn.Module, s: torch.Tensor) -> None:
    """Make `producer`'s output x become x / s (per output channel)."""
    if isinstance(producer, nn.Linear):
        producer.weight.data = producer.weight.data / s.to(producer.weight.dtype)[:, None]
        if producer.bias is not None:
            producer.bias.data = producer.bias.data / s.to(producer.bias.dtype)
        return
    weight = producer.weight.data
    if "gemma" in type(producer).__name__.lower():
        # Gemma's RMSNorm multiplies by (1 + weight).
        producer.weight.data = ((1.0 + weight.float()) / s - 1.0).to(weight.dtype)
    else:
        producer.weight.data = (weight.float() / s).to(weight.dtype)
    if getattr(producer, "bias", None) is not None:
        producer.bias.data = (producer.bias.data.float() / s).to(producer.bias.dtype)


def multiply_input(consumers: list[nn.Linear], s: torch.Tensor) -> None:
    """Scale the input columns of each consumer by s, so it sees x / s and computes the same y."""
    for lin in consumers:
        lin.weight.data = (lin.weight.data.float() * s[None, :]).to(lin.weight.dtype)
