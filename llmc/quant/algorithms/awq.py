"""AWQ: activation-aware weight scaling and clipping for low-bit weights.

Scale search: for Linears sharing one input x, try s = mean|x|^r / mean|Ŵ|^(1-r) over a grid of r in
[0, 1) (Ŵ: each weight normalized by its group's absmax), quantize W·s, run the module that consumes
those Linears' outputs on x / s, and keep the s with the smallest output error. Salient input channels
get larger scales and so finer effective quantization.

Clip search: per output channel and group, shrink the clipping range by up to `max_shrink` and keep
the one whose quantized weights best reproduce x_g · w_g on sampled inputs.

NVFP4 and MXFP4 weights (weight-only) are searched with the format's own quantizer in the loop
(`fake_quantize_weight`: E2M1 codes, E4M3 / E8M0 block scales). Approximations there: during the scale search each
NVFP4 Linear takes its own global scale (the final quantization shares one across fused siblings), and the clip
search's global scale is that of the rows it scores at once, not the whole weight's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from llmc import distributed
from llmc.quant.algorithms.gptq import gram_float32
from llmc.quant.algorithms.mappings import layer_mappings
from llmc.quant.algorithms.registry import AlgorithmOptions, Context, register
from llmc.quant.algorithms.smoothquant import divide_output, multiply_input
from llmc.quant.numerics import (
    BLOCK_ELEMENTS,
    block_scaled,
    compute_qparams,
    dequantize,
    dequantize_weight,
    grouped_view,
    quantize_weight,
    quantize_with,
)
from llmc.quant.spec import TensorSpec

# AutoAWQ leaves q/k to RTN ranges: clipping them perturbs attention scores more than it saves.
_NO_CLIP = ("q_proj", "k_proj")


class AwqOptions(AlgorithmOptions):
    n_grid: int = Field(default=20, ge=1, description="the number of scale ratios searched, a whole number >= 1")
    search: Literal["grid", "refine"] = Field(
        default="refine",
        description="'grid' (every ratio, as AutoAWQ and llm-compressor) or 'refine' (every 4th, then the "
        "neighbours of the best: the same resolution with about half the evaluations)",
    )
    duo_scaling: bool = Field(default=True, description="true (the scale formula includes the weight magnitudes) "
                              "or false")
    clip: bool = Field(default=True, description="true (search a clipping range per weight group) or false")
    clip_grid: int = Field(default=20, ge=1, description="the number of clipping ranges tried, a whole number >= 1")
    max_shrink: float = Field(default=0.5, ge=0, lt=1,
                              description="the largest fraction the clip search takes off a group's range, "
                              "from 0 to below 1")
    clip_tokens: int = Field(default=512, ge=1,
                             description="the number of evenly spaced input rows the clip search uses")

    def check(self, context: Context) -> None:
        w = context.scheme.weights
        if w.format not in ("int4", "nvfp4", "mxfp4"):
            raise ValueError("awq is a 4-bit weight method; fix: use weights.format int4, nvfp4 or mxfp4")
        if w.info.microscaling and context.scheme.activations is not None:
            # its search scores weights alone: FP4 activations divided by the scale would quantize differently
            raise ValueError(f"awq searches {w.format} weight-only schemes; fix: drop the activations, or algorithm "
                             "gptq or rtn")
        if w.strategy != "group" and self.clip:
            raise ValueError("awq's clip search works per weight group; fix: weights.strategy group, or options.clip "
                             "false")

    def extra_calibration_passes(self) -> float:
        # the reference outputs, then each candidate scale reruns each mapping's block (attention, MLP: about a
        # layer's forward): 11 for the default refined search, 22 for the full grid
        return 1 + self.search_evaluations()

    def search_evaluations(self) -> int:
        """Candidate scales `search_scale` scores per mapping (at most): s = 1, then the grid or its refinement."""
        return 1 + (self.n_grid if self.search == "grid" else len(range(0, self.n_grid, 4)) + 4)

    def clip_iterations(self) -> int:
        """Clipping ranges `search_clip` tries per Linear."""
        return int(self.max_shrink * self.clip_grid) if self.clip else 0

    def search_cost(self) -> tuple[int, int, int]:
        return self.search_evaluations(), self.clip_iterations(), self.clip_tokens


def fake_quantize_weight(w: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """w through the quantizer RTN applies (microscaling: the format's own; NVFP4 under w's own global scale)."""
    if block_scaled(spec):
        return dequantize_weight(quantize_weight(w, spec), spec).to(w.dtype)
    if _rows_independent(spec):
        return _fake_quantize_rows(w, spec).to(w.dtype)
    scale, zp = compute_qparams(w, spec)
    return dequantize(quantize_with(w, scale, zp, spec), scale, zp, spec).to(w.dtype)


def quantized_at_scale(w: torch.Tensor, s: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """q(w·s) / s in float32: a candidate scale's quantized weight, as the search scores it."""
    if _rows_independent(spec):
        return _fake_quantize_rows(w, spec, s)
    return fake_quantize_weight(w.float() * s, spec) / s


def _rows_independent(spec: TensorSpec) -> bool:
    """Integer formats with a scale per group or per row: each row quantizes on its own (so block by block)."""
    return not block_scaled(spec) and not spec.info.is_float and spec.strategy in ("group", "channel")


def _fake_quantize_rows(w: torch.Tensor, spec: TensorSpec, s: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(quantize_with(w·s)) / s in float32, a block of rows at a time, the same numbers: each step is the
    same float operation on the same values, and the codes, whole numbers, are exact in float32 (only a code -0.0
    stays -0.0 instead of becoming +0.0). Without the full-size temporaries (the scales repeated to the weight's shape,
    int8 codes and their float copy) that made fake quantization AWQ's largest cost on the host: 0.04 G elements/s at
    8B width (benchmarks/results/awq_search.jsonl)."""
    rows = w.reshape(-1, w.shape[-1])
    out = torch.empty(rows.shape, dtype=torch.float32, device=w.device)
    qmin, qmax = spec.info.int_range(spec.symmetric)
    step = max(1, BLOCK_ELEMENTS // rows.shape[1])
    for r in range(0, rows.shape[0], step):
        x = rows[r : r + step].float()
        if s is not None:
            x = x * s
        scale, zp = compute_qparams(x, spec)
        per_row = scale.reshape(-1, 1)  # one scale per row of the grouped view
        y = grouped_view(x, spec) / per_row
        y.round_()
        if zp is None:
            y.clamp_(qmin, qmax)
        else:
            z = zp.reshape(-1, 1).float()
            y.add_(z).clamp_(qmin, qmax).sub_(z)
        y.mul_(per_row)
        y = y.view(x.shape)
        if s is not None:
            y.div_(s)
        out[r : r + step] = y
    return out.reshape(w.shape)


def weight_mean(weights: list[torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    """Per-input-channel mean of |W| normalized by its quantization group's absmax."""
    w = torch.cat([x.detach().float() for x in weights], dim=0)
    grouped = grouped_view(w, spec).abs()
    normalized = grouped / grouped.amax(dim=-1, keepdim=True).clamp(min=1e-6)
    return normalized.reshape(w.shape).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    if w_mean is None:
        s = x_mean.pow(ratio).clamp(min=1e-4)
    else:
        s = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1
    s[torch.isinf(s) | torch.isnan(s)] = 1.0
    return s


def search_scale(
    x_mean: torch.Tensor,
    w_mean: torch.Tensor | None,
    output_error: Callable[[torch.Tensor], float],
    options: AwqOptions = AwqOptions(),
) -> tuple[torch.Tensor, list[float]]:
    """The candidate scale with the smallest `output_error(s)`, and the error of every candidate tried.

    Candidates: s ≡ 1 (plain RTN, so the search never does worse than RTN on the calibration data), then
    grid ratios r = i / n_grid. `search="grid"` tries all n_grid of them (AutoAWQ, llm-compressor);
    `search="refine"` tries every 4th, then the two neighbours at ±2 and ±1 steps around the best so
    far — the same resolution with about half the evaluations, exact when the error is unimodal in r.
    """
    tried: dict[int | None, float] = {}

    def err(i: int | None) -> float:
        if i not in tried:
            s = torch.ones_like(x_mean) if i is None else candidate_scales(x_mean, w_mean, i / options.n_grid)
            tried[i] = output_error(s)
        return tried[i]

    err(None)
    if options.search == "grid":
        for i in range(options.n_grid):
            err(i)
    else:
        for i in range(0, options.n_grid, 4):
            err(i)
        for step in (2, 1):
            best_i = min((i for i in tried if i is not None), key=tried.__getitem__)
            for i in (best_i - step, best_i + step):
                if 0 <= i < options.n_grid:
                    err(i)
    best = min(tried, key=tried.__getitem__)
    s = torch.ones_like(x_mean) if best is None else candidate_scales(x_mean, w_mean, best / options.n_grid)
    return s, list(tried.values())


def search_clip(w: torch.Tensor, x: torch.Tensor, spec: TensorSpec, options: AwqOptions = AwqOptions()) -> torch.Tensor:
    """Per (output channel, group) clipping bound max|w| minimizing the error of x_g · q(w_g).

    Returns the clipped weight (same shape as w); quantizing it with `spec` uses the chosen bounds."""
    if spec.strategy != "group":
        raise ValueError("AWQ clip search needs group-wise weights")
    g = spec.group_size
    n_out, n_in = w.shape
    x = x.reshape(-1, n_in)
    if x.shape[0] > options.clip_tokens:  # the rows picked before the float32 copy (15 GB of down inputs at 8B)
        x = x[torch.linspace(0, x.shape[0] - 1, options.clip_tokens, device=x.device).long()]
    basis = _group_basis(x.float().reshape(x.shape[0], n_in // g, g))
    wg = w.detach().float().reshape(n_out, n_in // g, g)  # [o, G, g]
    rows = max(1, (1 << 22) // n_in)  # [o, G, g] temporaries of 16 MB
    clipped = torch.cat([_clip_rows(wg[r : r + rows], basis, spec, options) for r in range(0, n_out, rows)])
    return clipped.reshape(n_out, n_in).to(w.dtype)


def _group_basis(xg: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """What `_group_errors` scores a weight change Δ [o, G, g] against, from the sampled inputs xg [t, G, g]: each
    group's Gram matrix H = x_gᵀ x_g [G, g, g] when the sample has more rows than a group has columns (Δᵀ H Δ costs
    g² per group instead of t·g), else the inputs themselves [G, g, t]; and the row count."""
    t, _, g = xg.shape
    if t > g:
        return torch.einsum("tGg,tGh->Ggh", xg, xg), True, t
    return xg.permute(1, 2, 0).contiguous(), False, t


def _group_errors(delta: torch.Tensor, basis: tuple[torch.Tensor, bool, int]) -> torch.Tensor:
    """mean over the sampled rows of (x_g · Δ_og)² per output channel and group: [o, G, 1] (the same number as
    multiplying out x_g·q and x_g·w, up to float rounding)."""
    m, is_gram, t = basis
    d = delta.transpose(0, 1)  # [G, o, g]
    err = ((d @ m) * d).sum(dim=-1) if is_gram else (d @ m).pow(2).sum(dim=-1)
    return (err / t).transpose(0, 1).unsqueeze(-1)


def _clip_rows(wg: torch.Tensor, basis: tuple[torch.Tensor, bool, int], spec: TensorSpec,
               options: AwqOptions) -> torch.Tensor:
    g = spec.group_size
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # [o, G, 1]
    best_max = org_max.clone()
    best_err = torch.full(org_max.shape, float("inf"), device=wg.device)
    # One row = one group. The clip search scores each group with its exact scale: a row's FP8 scale grid
    # (`scale_grid`) depends on the bounds chosen for all its groups, so only the final quantization snaps.
    group_spec = replace(spec, strategy="channel", group_size=None, scale_grid=None)
    for i in range(int(options.max_shrink * options.clip_grid)):
        max_val = org_max * (1 - i / options.clip_grid)
        clipped = torch.maximum(torch.minimum(wg, max_val), -max_val)
        q = fake_quantize_weight(clipped.reshape(-1, g), group_spec).reshape(wg.shape)
        err = _group_errors(q - wg, basis)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return torch.maximum(torch.minimum(wg, best_max), -best_max)


# --------------------------------------------------------------------------- one decoder layer


def awq_module_calls(layer: nn.Module) -> tuple[str, ...]:
    """The modules whose calls AWQ replays: each mapping's parent (the search scores its output) and every
    Linear (the clip search reads its inputs)."""
    parents = {m.parent for m in layer_mappings(layer)}
    linears = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    return tuple(sorted(parents | linears))


def _clip_rows_of(chunks: list[torch.Tensor], count: int) -> torch.Tensor:
    """The rows `search_clip` samples from the chunks stacked (the same rows, picked where they lie): no stacked copy
    of every calibration input (the down projection's at 8B width: 7.5 GB, and as much again divided by AWQ's
    scale)."""
    total = sum(c.shape[0] for c in chunks)
    if total <= count:
        return torch.cat(chunks)
    picks = torch.linspace(0, total - 1, count, device=chunks[0].device).long().cpu()  # as search_clip computes them
    rows, start = [], 0
    for chunk in chunks:
        mine = picks[(picks >= start) & (picks < start + chunk.shape[0])] - start
        if len(mine):
            rows.append(chunk[mine.to(chunk.device)])
        start += chunk.shape[0]
    return torch.cat(rows)


def _first_input(call: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _call(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _search_mapping(parent: nn.Module, calls: list, consumers: list[nn.Linear], x_mean: torch.Tensor,
                    w_mean: torch.Tensor | None, spec: TensorSpec, options: AwqOptions) -> torch.Tensor:
    """AWQ's grid search for one mapping: the scale whose quantized consumers best reproduce the
    parent's output on the calibration calls. Leaves the consumers' weights as they were."""
    if consumers == [parent] and isinstance(parent, nn.Linear):
        return _search_linear(parent, calls, x_mean, w_mean, spec, options)
    originals = [c.weight.data.clone() for c in consumers]
    with torch.no_grad():
        reference = [_call(parent, a, k) for a, k in calls]
    elements = distributed.sum_float(float(sum(r.numel() for r in reference)))  # over every rank's windows

    def output_error(s: torch.Tensor) -> float:
        for c, w in zip(consumers, originals):
            c.weight.data = quantized_at_scale(w, s, spec).to(w.dtype)
        with torch.no_grad():
            # per call on the device, read back once (one GPU sync per candidate, not one per call); summed in
            # Python in call order as before, so the same number
            total = sum(torch.stack([(_call(parent, a, k) - r).float().pow(2).sum()
                                     for (a, k), r in zip(calls, reference)]).cpu().tolist())
        return distributed.sum_float(total) / elements  # every rank scores the same candidate on its own windows

    try:
        s, _ = search_scale(x_mean, w_mean, output_error, options)
    finally:
        for c, w in zip(consumers, originals):
            c.weight.data = w
    return s


def _search_linear(linear: nn.Linear, calls: list, x_mean: torch.Tensor, w_mean: torch.Tensor | None,
                   spec: TensorSpec, options: AwqOptions) -> torch.Tensor:
    """`_search_mapping` for a lone Linear: ||X ΔWᵀ||² per candidate from the inputs X themselves (tokens·in·out) when
    there are fewer rows than input channels, else through their Gram matrix G = XᵀX: Σ (ΔW G) ⊙ ΔW (out·in²). The
    same number either way, up to float rounding."""
    w = linear.weight.data.float()
    inputs = [_first_input(c).reshape(-1, linear.in_features) for c in calls]
    tokens = sum(t.shape[0] for t in inputs)
    if tokens < linear.in_features and not distributed.active():  # under torchrun the Gram matrices sum over ranks
        x = torch.cat([t.float() for t in inputs])

        def direct_error(s: torch.Tensor) -> float:
            delta = quantized_at_scale(w, s, spec) - w
            return float((x @ delta.T).pow(2).sum()) / (tokens * linear.out_features)

        return search_scale(x_mean, w_mean, direct_error, options)[0]
    if w.is_cuda:  # per call, half precision multiplied as it is (gram_float32): no float32 copy of every input
        gram = functools.reduce(torch.add, (gram_float32(t) for t in inputs))
    else:
        x = torch.cat([t.float() for t in inputs])
        gram = x.T @ x
    elements = sum(t.shape[0] for t in inputs) * linear.out_features
    if distributed.active():  # the Gram matrix and the row count over every rank's windows
        gram, elements = distributed.sum_in_rank_order(gram).float(), distributed.sum_float(float(elements))

    def output_error(s: torch.Tensor) -> float:
        delta = quantized_at_scale(w, s, spec) - w
        return float(((delta @ gram) * delta).sum()) / elements

    s, _ = search_scale(x_mean, w_mean, output_error, options)
    return s


@register("awq", kind="transform", options=AwqOptions, propagate="quantized", module_calls=awq_module_calls,
          block_scaled=True,  # NVFP4 / MXFP4 weight-only: the format's quantizer in the search (AwqOptions.check)
          # On Gemma-3-270M AWQ on vLLM's fp8_row scale grid measured 47.4 ppl against 43.3 for plain scales as
          # vLLM converts them (docs/calibration.md), a loss not yet understood: AWQ keeps plain scales by default.
          fp8_row_by_default=False)
def awq_layer(layer: nn.Module, prefix: str, stats, weights: TensorSpec, options: AwqOptions) -> bool:
    """AWQ scale search over each mapping in forward order, then clip search per Linear; True (weights change)."""
    # the Linears the stream quantizes (the observer records an input range for each): a Linear the recipe ignores or
    # the family keeps in its dtype (llmc.model.families.KEPT_IN_DTYPE) is scaled with its mapping, never searched as
    # quantized nor clipped (its weights are stored as they are)
    def quantized(name: str) -> bool:
        return f"{prefix}{name}" in stats.channel_absmax

    input_divisor: dict[str, torch.Tensor] = {}
    for m in layer_mappings(layer):
        parent = layer.get_submodule(m.parent)
        calls = stats.module_calls.get(m.parent)
        searched = [layer.get_submodule(c) for c in m.consumers if quantized(c)]
        if not calls or not searched:  # an MoE expert no calibration token reached: it keeps s = 1 (plain RTN)
            continue
        consumers = [layer.get_submodule(c) for c in m.consumers]
        x = [_first_input(c) for c in calls]  # the parent's first input is the consumers' shared input
        x_mean = distributed.mean_abs_rows(x)
        w_mean = weight_mean([c.weight for c in searched], weights) if options.duo_scaling else None
        s = _search_mapping(parent, calls, searched, x_mean, w_mean, weights, options)
        divide_output(layer.get_submodule(m.producer), s, m.producer_rows)
        multiply_input(consumers + [layer.get_submodule(a) for a in m.also_scaled], s)  # the router: same input
        for c in m.consumers:
            input_divisor[c] = s
    if not options.clip:
        return True
    for name, lin in layer.named_modules():
        if (not isinstance(lin, nn.Linear) or name.rsplit(".", 1)[-1] in _NO_CLIP or name not in stats.module_calls
                or not quantized(name)):
            continue
        inputs = [_first_input(c).reshape(-1, lin.in_features) for c in stats.module_calls[name]]
        if distributed.active():  # the rows the clip search samples, from every rank's windows
            x = distributed.evenly_spaced_rows(torch.cat(inputs), options.clip_tokens)
        else:
            x = _clip_rows_of(inputs, options.clip_tokens)
        if name in input_divisor:
            x = x / input_divisor[name]
        lin.weight.data = search_clip(lin.weight.data, x, weights, options)
    return True
