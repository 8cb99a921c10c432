"""Calibration algorithms, applied to one decoder layer at a time.

Each step is a small function over one layer and what its calibration pass observed:

  transform_layer  SmoothQuant and/or AWQ rescale (and AWQ clips) weights in place; the layer
                   computes the same function (up to AWQ's clipping) with easier-to-quantize tensors;
  quantize_layer   RTN or GPTQ turns each Linear's weight into codes and scales.

The pure algorithms over tensors live beside this file (`gptq.py`, `smoothquant.py`, `awq.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from llmc.quant.algorithms.awq import (
    AwqOptions,
    fake_quantize_weight,
    search_clip,
    search_scale,
    weight_mean,
)
from llmc.quant.algorithms.gptq import GptqOptions, gptq_quantize_shared
from llmc.quant.algorithms.mappings import Mapping, layer_mappings
from llmc.quant.algorithms.smoothquant import (
    divide_output,
    multiply_input,
    smoothing_scales,
)
from llmc.quant.numerics import QuantizedWeight, quantize_weight
from llmc.quant.spec import Scheme

ALGORITHMS = ("rtn", "gptq", "smoothquant", "smoothquant+gptq", "awq")
# AutoAWQ leaves q/k to RTN ranges: clipping them perturbs attention scores more than it saves.
_NO_CLIP = ("q_proj", "k_proj")


@dataclass(frozen=True)
class Observe:
    """What the calibration pass over a layer must record for the scheme's algorithm."""

    hessians: bool
    module_calls: tuple[str, ...]  # layer-relative modules whose (args, kwargs) are kept per batch


def steps(scheme: Scheme) -> list[str]:
    return scheme.algorithm.split("+")


def options(scheme: Scheme) -> dict:
    return dict(scheme.algorithm_options)


def gptq_options(scheme: Scheme) -> GptqOptions:
    o = options(scheme)
    return GptqOptions(
        block_size=int(o.get("block_size", 128)),
        dampening=float(o.get("dampening", 0.01)),
        act_order=bool(o.get("act_order", False)),
    )


def awq_options(scheme: Scheme) -> AwqOptions:
    o = options(scheme)
    return AwqOptions(
        n_grid=int(o.get("n_grid", 20)),
        search=str(o.get("search", "refine")),
        duo_scaling=bool(o.get("duo_scaling", True)),
        clip=bool(o.get("clip", True)),
    )


def observe_for(scheme: Scheme, layer: nn.Module) -> Observe:
    calls: tuple[str, ...] = ()
    if "awq" in steps(scheme):
        parents = {m.parent for m in layer_mappings(layer)}
        linears = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        calls = tuple(sorted(parents | linears))
    return Observe(hessians="gptq" in steps(scheme), module_calls=calls)


def propagate_for(scheme: Scheme) -> Literal["original", "quantized"]:
    """Which outputs of layer i the calibration of layer i+1 sees (`options.propagate` overrides).

    GPTQ and AWQ see the already-quantized layer, as llm-compressor's sequential pipeline does: GPTQ
    calibrated on original outputs measured 56-70% worse perplexity change on SmolLM2 W4A16. RTN and
    SmoothQuant see the original layer, as ModelOpt does: one layer forward per layer instead of two
    (SmoothQuant W8A8: 0.48x llm-compressor's time instead of 0.81x, perplexity 43.997 vs 43.910 mean
    over three seeds; llm-compressor 44.026; docs/results.md)."""
    if "propagate" in options(scheme):
        return options(scheme)["propagate"]
    return "quantized" if ("gptq" in steps(scheme) or "awq" in steps(scheme)) else "original"


def true_sequential_for(scheme: Scheme) -> bool:
    """Whether GPTQ quantizes each Linear on inputs through the layer's already-quantized Linears, inside
    the forward that makes the next layer's inputs (`llmc.quant.true_sequential`; `options.true_sequential`
    overrides). The default for GPTQ alone with quantized propagation: one forward per layer instead of
    two (docs/results.md has the measured time and perplexity against the two-forward order)."""
    applies = steps(scheme) == ["gptq"] and propagate_for(scheme) == "quantized"  # else a transform comes first
    return applies and bool(options(scheme).get("true_sequential", True))


# --------------------------------------------------------------------------- transforms


def _static_per_tensor(scheme: Scheme) -> bool:
    a = scheme.activations
    return a is not None and not a.dynamic and a.strategy == "tensor"


def smooth_for(scheme: Scheme) -> str:
    """Which producers SmoothQuant folds its scales into: "norms" (the RMSNorms before q/k/v and gate/up,
    as llm-compressor does) or "all" (also up_proj -> down_proj, and v_proj -> o_proj where grouped-query
    attention does not share v's outputs; ModelOpt smooths every Linear). Static per-tensor activations
    default to "all" with alpha 1.0, as ModelOpt: one scale for a whole tensor cannot cover down_proj's
    input outliers. SmolLM2 static W8A8-INT8 (seed 0, 16 windows): "norms" alpha 0.5 +100% perplexity,
    "all" alpha 0.5 +31%, "all" alpha 1.0 +8.80%, ModelOpt +8.83% (docs/results.md). Dynamic per-token
    activations keep "norms" and alpha 0.5, as measured before (+1.66%)."""
    if "smooth" in options(scheme):
        return str(options(scheme)["smooth"])
    return "all" if _static_per_tensor(scheme) else "norms"


def alpha_for(scheme: Scheme) -> float:
    """SmoothQuant's migration strength: the recipe's, else 1.0 for static per-tensor activations (all of
    the activations' range moves into the weights; see smooth_for) and 0.5 otherwise."""
    if "alpha" in options(scheme):
        return float(options(scheme)["alpha"])
    return 1.0 if _static_per_tensor(scheme) else 0.5


def transform_layer(layer: nn.Module, prefix: str, stats, scheme: Scheme) -> bool:
    """Apply SmoothQuant / AWQ to `layer` in place; True when weights changed."""
    changed = False
    if "smoothquant" in steps(scheme):
        alpha = alpha_for(scheme)
        smooth_all = smooth_for(scheme) == "all"
        for m in layer_mappings(layer):
            if m.from_norm or smooth_all:
                consumers = [layer.get_submodule(c) for c in m.consumers]
                absmax = stats.channel_absmax[prefix + m.consumers[0]]
                s = smoothing_scales(absmax, [c.weight for c in consumers], alpha)
                divide_output(layer.get_submodule(m.producer), s)
                multiply_input(consumers, s)
                changed = True
    if "awq" in steps(scheme):
        awq_layer(layer, stats, scheme)
        changed = True
    return changed


def _first_input(call: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _call(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _search_mapping(parent: nn.Module, calls: list, consumers: list[nn.Linear], x_mean: torch.Tensor,
                    w_mean: torch.Tensor | None, scheme: Scheme) -> torch.Tensor:
    """AWQ's grid search for one mapping: the scale whose quantized consumers best reproduce the
    parent's output on the calibration calls. Leaves the consumers' weights as they were."""
    spec = scheme.weights
    if consumers == [parent] and isinstance(parent, nn.Linear):
        return _search_linear(parent, calls, x_mean, w_mean, scheme)
    originals = [c.weight.data.clone() for c in consumers]
    with torch.no_grad():
        reference = [_call(parent, a, k) for a, k in calls]
    elements = sum(r.numel() for r in reference)

    def output_error(s: torch.Tensor) -> float:
        for c, w in zip(consumers, originals):
            c.weight.data = (fake_quantize_weight(w.float() * s, spec) / s).to(w.dtype)
        with torch.no_grad():
            total = sum(float((_call(parent, a, k) - r).float().pow(2).sum()) for (a, k), r in zip(calls, reference))
        return total / elements

    try:
        s, _ = search_scale(x_mean, w_mean, output_error, awq_options(scheme))
    finally:
        for c, w in zip(consumers, originals):
            c.weight.data = w
    return s


def _search_linear(linear: nn.Linear, calls: list, x_mean: torch.Tensor, w_mean: torch.Tensor | None,
                   scheme: Scheme) -> torch.Tensor:
    """`_search_mapping` for a lone Linear, through the Gram matrix G = XᵀX of its inputs:
    ||X ΔWᵀ||² = Σ (ΔW G) ⊙ ΔW costs out·in² per candidate instead of tokens·in·out (the same number)."""
    spec, w = scheme.weights, linear.weight.data.float()
    x = torch.cat([_first_input(c).reshape(-1, linear.in_features).float() for c in calls])
    gram, elements = x.T @ x, x.shape[0] * linear.out_features

    def output_error(s: torch.Tensor) -> float:
        delta = fake_quantize_weight(w * s, spec) / s - w
        return float(((delta @ gram) * delta).sum()) / elements

    s, _ = search_scale(x_mean, w_mean, output_error, awq_options(scheme))
    return s


def awq_layer(layer: nn.Module, stats, scheme: Scheme) -> None:
    """AWQ scale search over each mapping in forward order, then clip search per Linear."""
    spec, opts = scheme.weights, awq_options(scheme)
    input_divisor: dict[str, torch.Tensor] = {}
    for m in layer_mappings(layer):
        parent = layer.get_submodule(m.parent)
        calls = stats.module_calls[m.parent]
        consumers = [layer.get_submodule(c) for c in m.consumers]
        x = [_first_input(c) for c in calls]  # the parent's first input is the consumers' shared input
        x_mean = torch.cat([t.reshape(-1, t.shape[-1]).abs().float() for t in x]).mean(dim=0)
        w_mean = weight_mean([c.weight for c in consumers], spec) if opts.duo_scaling else None
        s = _search_mapping(parent, calls, consumers, x_mean, w_mean, scheme)
        divide_output(layer.get_submodule(m.producer), s)
        multiply_input(consumers, s)
        for c in m.consumers:
            input_divisor[c] = s
    if not opts.clip:
        return
    for name, lin in layer.named_modules():
        if not isinstance(lin, nn.Linear) or name.rsplit(".", 1)[-1] in _NO_CLIP or name not in stats.module_calls:
            continue
        x = torch.cat([_first_input(c).reshape(-1, lin.in_features) for c in stats.module_calls[name]])
        if name in input_divisor:
            x = x / input_divisor[name]
        lin.weight.data = search_clip(lin.weight.data, x, spec, opts)


# --------------------------------------------------------------------------- weight quantization


def quantize_layer(layer: nn.Module, linears: dict[str, nn.Linear], stats, scheme: Scheme) -> dict[str, QuantizedWeight]:
    """Codes and scales for every target Linear: GPTQ when the scheme says so, else RTN."""
    del layer
    if "gptq" not in steps(scheme):
        return {name: quantize_weight(lin.weight.data, scheme.weights) for name, lin in linears.items()}
    opts = gptq_options(scheme)
    by_input: dict[str, list[str]] = {}
    for name in linears:
        by_input.setdefault(stats.hessian_of[name], []).append(name)
    out = {}
    for key, names in by_input.items():
        results, _ = gptq_quantize_shared([linears[n].weight.data for n in names], stats.hessians[key],
                                          scheme.weights, opts)
        out.update(zip(names, results))
    return out


__all__ = ["ALGORITHMS", "Mapping", "Observe", "observe_for", "propagate_for", "quantize_layer", "transform_layer",
           "true_sequential_for"]


def quantize_stage_config(scheme):  # TEMPORARY SHIM
    cfg = {"propagate": propagate_for(scheme)}
    if "smoothquant" in scheme.algorithm and smooth_for(scheme) == "all":
        cfg["smoothquant"] = {"smooth": "all", "alpha": alpha_for(scheme)}
    if true_sequential_for(scheme):
        cfg["gptq"] = {"true_sequential": True}
    return cfg
