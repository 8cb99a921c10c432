"""SmoothQuant: move activation outliers into the weights with a per-input-channel scale s.

    y = (x / s) · (W · s)ᵀ    with    s_j = max|x_j|^α / max_k |W_kj|^(1-α)

The division by s is folded into the operation that produces x (an RMSNorm's weight, or the rows of
the previous Linear), so the model computes the same function with easier-to-quantize activations.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from llmc.quant.algorithms.mappings import layer_mappings
from llmc.quant.algorithms.registry import AlgorithmOptions, Context, register
from llmc.quant.spec import TensorSpec

MIN_SCALE = 1e-5


class SmoothQuantOptions(AlgorithmOptions):
    alpha: float | None = Field(
        default=None, ge=0, le=1,
        description="the migration strength, a number from 0 to 1 (default 1.0 for static per-tensor activations, "
        "else 0.5)",
    )
    smooth: Literal["norms", "all"] | None = Field(
        default=None,
        description="'norms' (SmoothQuant folds into the RMSNorms before q/k/v and gate/up) or 'all' (also "
        "up_proj -> down_proj and v_proj -> o_proj); default 'all' for static per-tensor activations, else 'norms'",
    )

    def resolve(self, context: Context) -> SmoothQuantOptions:
        """Which producers SmoothQuant folds its scales into: "norms" (the RMSNorms before q/k/v and gate/up, as
        llm-compressor does) or "all" (also up_proj -> down_proj, and v_proj -> o_proj where grouped-query
        attention does not share v's outputs; ModelOpt smooths every Linear), and with what migration strength.
        Static per-tensor activations default to "all" with alpha 1.0 (all of the activations' range moves into
        the weights), as ModelOpt: one scale for a whole tensor cannot cover down_proj's input outliers. SmolLM2
        static W8A8-INT8 (seed 0, 16 windows): "norms" alpha 0.5 +100% perplexity, "all" alpha 0.5 +31%, "all"
        alpha 1.0 +8.80%, ModelOpt +8.83% (docs/calibration.md). Dynamic per-token activations keep "norms" and
        alpha 0.5, as measured before (+1.66%)."""
        a = context.scheme.activations
        static_per_tensor = a is not None and not a.dynamic and a.strategy == "tensor"
        return self.model_copy(update={
            "alpha": (1.0 if static_per_tensor else 0.5) if self.alpha is None else self.alpha,
            "smooth": ("all" if static_per_tensor else "norms") if self.smooth is None else self.smooth,
        })

    def check(self, context: Context) -> None:
        if context.scheme.activations is None:
            raise ValueError(
                "smoothquant migrates activation outliers into weights and only helps when "
                "activations are quantized; fix: add activations, or use algorithm rtn/gptq/awq"
            )

    def stage_key(self) -> dict | None:
        # "norms" entered no key before "all" existed: those keys stay as they were
        return {"smooth": "all", "alpha": self.alpha} if self.smooth == "all" else None


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Per-input-channel scales for Linears sharing one input, from the observed |x| maxima."""
    w_absmax = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    a = act_absmax.float().clamp(min=MIN_SCALE)
    s = a.pow(alpha) / w_absmax.clamp(min=MIN_SCALE).pow(1 - alpha)
    # A channel that never carries signal (or whose weights are all zero) keeps scale 1.
    s = torch.where((act_absmax > 0) & (w_absmax > 0), s, torch.ones_like(s))
    return s.clamp(min=MIN_SCALE)


def divide_output(producer: nn.Module, s: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """Make `producer`'s output x become x / s (per output channel); `rows`: only that slice of a fused
    Linear's outputs (Phi-3's up half of gate_up_proj), which s covers."""
    if isinstance(producer, nn.Linear):
        start, end = rows or (0, producer.out_features)
        weight = producer.weight.data.clone()
        weight[start:end] = weight[start:end] / s.to(weight.dtype)[:, None]
        producer.weight.data = weight
        if producer.bias is not None:
            bias = producer.bias.data.clone()
            bias[start:end] = bias[start:end] / s.to(bias.dtype)
            producer.bias.data = bias
        return
    weight = producer.weight.data
    if scales_by_one_plus_weight(producer):  # Gemma's RMSNorms multiply by (1 + weight)
        producer.weight.data = ((1.0 + _wide(weight)) / s - 1.0).to(weight.dtype)
    else:
        producer.weight.data = (_wide(weight) / s).to(weight.dtype)
    if getattr(producer, "bias", None) is not None:
        producer.bias.data = (_wide(producer.bias.data) / s).to(producer.bias.dtype)


def scales_by_one_plus_weight(norm: nn.Module) -> bool:
    """Whether a norm multiplies by (1 + weight) rather than weight: with its weight zeroed it still passes a
    signal (asked of the module itself, not its class name)."""
    weight = norm.weight.data
    probe = torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)
    try:
        norm.weight.data = torch.zeros_like(weight)
        with torch.no_grad():
            out = norm(probe)
    finally:
        norm.weight.data = weight
    return bool(out.abs().amax() > 0)


def multiply_input(consumers: list[nn.Linear], s: torch.Tensor) -> None:
    """Scale the input columns of each consumer by s, so it sees x / s and computes the same y."""
    for lin in consumers:
        lin.weight.data = (_wide(lin.weight.data) * s[None, :]).to(lin.weight.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 arithmetic, or float64 where it already is (layer discovery checks pairs in float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _input_absmax(stats, prefix: str, m) -> torch.Tensor | None:
    """Per-channel max |x| of the producer's output: the consumers' shared input, or for MoE experts (each reads
    its routed subset) the max over every expert that saw tokens, which covers every token the block received."""
    if not m.routed:
        return stats.channel_absmax.get(prefix + m.consumers[0])
    seen = [stats.channel_absmax[prefix + c] for c in m.consumers if prefix + c in stats.channel_absmax]
    return torch.stack(seen).amax(dim=0) if seen else None


@register("smoothquant", kind="transform", options=SmoothQuantOptions)
def smoothquant_layer(layer: nn.Module, prefix: str, stats, weights: TensorSpec, options: SmoothQuantOptions) -> bool:
    """Smooth each producer -> consumers mapping of `layer` in place (norms only unless smooth is "all");
    True when weights changed."""
    del weights
    changed = False
    for m in layer_mappings(layer):
        if m.from_norm or options.smooth == "all":
            absmax = _input_absmax(stats, prefix, m)
            if absmax is None:  # an MoE expert no calibration token reached: nothing to balance against
                continue
            consumers = [layer.get_submodule(c) for c in m.consumers]
            s = smoothing_scales(absmax, [c.weight for c in consumers], options.alpha)
            divide_output(layer.get_submodule(m.producer), s, m.producer_rows)
            multiply_input(consumers + [layer.get_submodule(a) for a in m.also_scaled], s)
            changed = True
    return changed
