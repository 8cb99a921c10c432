"""Mixed precision chosen by measurement (`quantization.search`): small functions, each testable on its own.

    units        the decoder layers' Linears cut into units (a layer, a role of a layer, or one Linear; siblings a
                 target runtime fuses into one GEMM always in one unit: `make_units`)
    bytes        what each unit's weights take stored under each candidate (`unit_bytes`, as `llmc plan` counts
                 a group's bytes: codes packed, microscaling scales included, unquantized in the model's dtype)
    damage       measured while the layer is resident in the layer stream, on the calibration activations: the
                 layer output's relative squared error with that unit quantized by that candidate and the rest of
                 the layer untouched (`layer_damage`)
    solve        an exact multiple-choice knapsack by dynamic programming over integer byte units (`solve`): the
                 least total damage whose bytes fit the budget, and the whole Pareto front (bytes vs damage) from the
                 same table
    groups       the chosen assignment as plain module groups (`assignment_groups`), which the rest of llmc
                 quantizes, exports and evaluates like any hand-written `quantization.groups`

The damage of a mix is predicted as the sum of its units' damages (additivity: a first-order proxy; each unit is
measured alone on the layer's original inputs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from llmc.model.checkpoint import read_elem, widened_bytes
from llmc.model.dtype import BYTES
from llmc.model.families import linear_role
from llmc.model.skeleton import layer_output
from llmc.planning.disk import source_read_seconds
from llmc.planning.machine import PROCESS_BYTES, forward_seconds, spill_seconds
from llmc.quant.groups import is_layer_spec, layers_of, site_of
from llmc.quant.microscaling import fused_groups
from llmc.quant import fisher
from llmc.quant.numerics import (dequantize_weight, fake_quantize, fake_quantize_rate, quantize_rate,
                                 quantize_weights, static_scale)
from llmc.quant.spec import ModuleGroup, ModuleTargets, Scheme, TensorSpec

if TYPE_CHECKING:
    from llmc.planning.shapes import Shape

BF16 = "bf16"  # the candidate that leaves a unit unquantized (in the model's dtype)
GRANULARITIES = ("layer", "role", "linear")
# the byte axis of the dynamic programme: at most this many cells x units (memory of the choice table); above it the
# byte units are coarsened, each unit's bytes rounded up, so the budget still holds (the solve says so: `exact`)
MAX_TABLE_CELLS = 50_000_000


@dataclass(frozen=True)
class Unit:
    """One searched unit: the Linears that take one candidate together."""

    name: str
    linears: tuple[str, ...]
    params: int


def make_units(linears: Mapping[str, tuple[int, int]], granularity: str, model_type: str | None,
               fuse: bool) -> list[Unit]:
    """The units of `linears` (decoder-layer Linear name -> (out, in)) at `granularity`, in layer order. With `fuse`
    (a target runtime runs q/k/v, gate/up, an expert's gate/up as one GEMM), siblings never land in two units."""
    keys: dict[str, list[str]] = {}
    for name in linears:
        site = site_of(name)
        if site is None:
            continue
        layer, local = site
        if granularity == "layer":
            key = f"layers.{layer}"
        elif granularity == "role":
            key = f"layers.{layer}.{linear_role(model_type, local) or local}"
        else:
            key = name
        keys.setdefault(key, []).append(name)
    if fuse and granularity == "linear":  # merge fused siblings into one unit
        merged: dict[str, list[str]] = {}
        for siblings in fused_groups(list(keys)):
            merged["+".join(siblings) if len(siblings) > 1 else siblings[0]] = siblings
        keys = merged
    elif fuse:  # a role or a layer holds its siblings unless a role table splits them: merge those units
        keys = _merge_split_siblings(keys)
    return [Unit(k, tuple(v), sum(linears[n][0] * linears[n][1] for n in v)) for k, v in keys.items()]


def _merge_split_siblings(keys: dict[str, list[str]]) -> dict[str, list[str]]:
    unit_of = {n: k for k, names in keys.items() for n in names}
    for siblings in fused_groups(list(unit_of)):
        owners = list(dict.fromkeys(unit_of[n] for n in siblings))
        if len(owners) > 1:
            into = owners[0]
            for other in owners[1:]:
                for n in keys.pop(other):
                    keys[into].append(n)
                    unit_of[n] = into
    return keys


def protected(name: str, patterns: Iterable[str], n_layers: int, matches: Callable[[str, tuple], bool]) -> bool:
    """Whether a `protect` entry names Linear `name`: a layer selector ("first 1", "last 2", "3", "4-6") or a module
    name pattern (exact, a trailing part, 're:<regex>', as quantization.ignore)."""
    site = site_of(name)
    names = []
    for p in patterns:
        if is_layer_spec(p):
            if site is not None and site[0] in layers_of(p, n_layers):
                return True
        else:
            names.append(p)
    return bool(names) and matches(name, tuple(names))


def unit_bytes(params: int, spec: TensorSpec | None, elem: int) -> Fraction:
    """Bytes `params` weights take stored under `spec` (None: unquantized, `elem` bytes each), exactly."""
    bits = Fraction(spec.stored_bits).limit_denominator(64) if spec is not None else Fraction(8 * elem)
    return params * bits / 8


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per unit, the index of its candidate
    bytes: float
    damage: float
    exact: bool  # False: the byte axis was coarsened (bytes rounded up per unit), the optimum on that grid
    front: tuple[tuple[float, float], ...]  # (bytes, least damage at or under them), bytes ascending, damage falling


def solve(sizes: Sequence[Sequence[Fraction | float]], damage: Sequence[Sequence[float]], budget: float,
          max_cells: int = MAX_TABLE_CELLS) -> Solution | None:
    """Multiple-choice knapsack, exactly: one candidate per unit, total `sizes` at most `budget`, least total
    `damage`. Dynamic programming over the byte axis in integer units (the sizes' common divisor, so every sum is
    exact); None when even the smallest choice of every unit exceeds the budget. The Pareto front of bytes against
    damage comes from the same table."""
    units = len(sizes)
    exact_sizes = [[Fraction(s) for s in row] for row in sizes]
    step = reduce(_gcd, (s for row in exact_sizes for s in row if s > 0), Fraction(0)) or Fraction(1)
    cells = sum(max(row) for row in exact_sizes) / step
    exact = cells * max(units, 1) <= max_cells
    if not exact:  # coarser units, each size rounded up: every found mix still fits
        step = Fraction(math.ceil(sum(max(row) for row in exact_sizes) * max(units, 1) / max_cells))
    weights = [[math.ceil(s / step) for s in row] for row in exact_sizes]
    capacity = sum(max(row) for row in weights)
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    picks = np.zeros((units, capacity + 1), dtype=np.int16)
    for u in range(units):
        new = np.full(capacity + 1, np.inf)
        for c, (w, d) in enumerate(zip(weights[u], damage[u])):
            shifted = np.full(capacity + 1, np.inf)
            shifted[w:] = best[:capacity + 1 - w] + d
            better = shifted < new
            new[better] = shifted[better]
            picks[u, better] = c
        best = new
    limit = min(capacity, math.floor(Fraction(budget) / step)) if budget >= 0 else -1
    if limit < 0 or not np.isfinite(best[:limit + 1]).any():
        return None
    at = int(np.argmin(best[:limit + 1]))
    choice = []
    for u in reversed(range(units)):
        c = int(picks[u, at])
        choice.append(c)
        at -= weights[u][c]
    choice.reverse()
    front, low = [], np.inf
    for w in np.flatnonzero(np.isfinite(best)):
        if best[w] < low - 1e-15:
            low = best[w]
            front.append((float(w * step), float(low)))
    return Solution(tuple(choice), float(sum(exact_sizes[u][c] for u, c in enumerate(choice))),
                    float(sum(damage[u][c] for u, c in enumerate(choice))), exact, tuple(front))


def _gcd(a: Fraction, b: Fraction) -> Fraction:
    """The greatest common divisor of two non-negative rationals."""
    return Fraction(math.gcd(a.numerator * b.denominator, b.numerator * a.denominator), a.denominator * b.denominator)


def assignment_groups(units: Sequence[Unit], candidates: Sequence[str], choice: Sequence[int],
                      member: Callable[[str], ModuleGroup], protected_linears: Iterable[str] = ()) -> list[ModuleGroup]:
    """The chosen assignment as module groups, one per candidate chosen (`member(candidate)` gives its formats,
    its targets replaced by the exact module names): named `search-<candidate>`; bf16 and the protected Linears in
    one `ignore: true` group."""
    names: dict[str, list[str]] = {}
    for unit, c in zip(units, choice):
        names.setdefault(candidates[c], []).extend(unit.linears)
    kept = list(protected_linears) + names.pop(BF16, [])
    groups = [ModuleGroup(f"search-{cand.lower()}", ModuleTargets(names=tuple(sorted(ns))),
                          member(cand).weights, member(cand).activations) for cand, ns in names.items()]
    if kept:
        groups.append(ModuleGroup(f"search-{BF16}", ModuleTargets(names=tuple(sorted(kept)))))
    return groups


# --------------------------------------------------------------------------- measurement, one resident layer


# the damage measures `layer_damages` returns; `fisher` needs the loss gradient at the layer's output
PROXIES = ("output", "update", "token", "fisher")


def layer_damage(layer: nn.Module, linears: Mapping[str, nn.Linear], units: Sequence[Unit],
                 candidates: Mapping[str, Scheme | None], inputs: Sequence[torch.Tensor], extras: Sequence,
                 outputs: Sequence[torch.Tensor], input_absmax: Mapping[str, torch.Tensor], *,
                 proxy: str = "output", grads: Sequence[torch.Tensor] | None = None) -> dict[str, list[float]]:
    """Per unit (of this layer), per candidate (in `candidates`' order; None: unquantized, damage 0): the damage
    `proxy` (see `layer_damages`) with that unit's Linears quantized by the candidate (weights round-to-nearest;
    activations fake-quantized with the static scale of the observed absmax, or dynamically) and every other Linear
    as it is. `inputs`/`extras`/`outputs`: the layer's original inputs, its call arguments and its original outputs,
    per batch; `grads` (proxy fisher): the gradient of the summed log-likelihood at those outputs, per batch."""
    if proxy not in PROXIES:
        raise ValueError(f"unknown search proxy {proxy!r}: one of {', '.join(PROXIES)}")
    if proxy == "fisher" and grads is None:
        raise ValueError("the fisher proxy needs the loss gradient at the layer's outputs (grads): measure with "
                         "llmc.quant.stream.measure_model(..., gradients=True)")
    return layer_damages(layer, linears, units, candidates, inputs, extras, outputs, input_absmax, grads)[proxy]


def layer_damages(layer: nn.Module, linears: Mapping[str, nn.Linear], units: Sequence[Unit],
                  candidates: Mapping[str, Scheme | None], inputs: Sequence[torch.Tensor], extras: Sequence,
                  outputs: Sequence[torch.Tensor], input_absmax: Mapping[str, torch.Tensor],
                  grads: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, list[float]]]:
    """Every damage measure of `layer_damage` from one set of quantized forwards, with dy = y_q - y the output's
    change, x the layer's input, summed over the calibration batches:

        output   sum ||dy||^2 / sum ||y||^2             (relative to the residual stream the layer writes)
        update   sum ||dy||^2 / sum ||y - x||^2         (relative to what the layer adds to the stream)
        token    mean over tokens of ||dy_t||^2 / ||y_t||^2
        fisher   1/2 sum g^2 dy^2 / tokens              (g: the loss gradient at y, `grads`; the diagonal Fisher
                                                        estimate of the end-to-end KL divergence per token)

    fisher only where `grads` is given."""
    device = next(layer.parameters()).device
    width = outputs[0].shape[-1] if outputs else 1
    tokens = sum(y.numel() // width for y in outputs) or 1
    reference = sum(float(y.double().pow(2).sum()) for y in outputs) or 1.0
    update = sum(float((y.double() - x.to(y.device).double()).pow(2).sum()) for x, y in zip(inputs, outputs)) or 1.0
    names = [p for p in PROXIES if p != "fisher" or grads is not None]
    out: dict[str, dict[str, list[float]]] = {p: {} for p in names}
    for unit in units:
        mine = [n for n in unit.linears if n in linears]
        rows: dict[str, list[float]] = {p: [] for p in names}
        for scheme in candidates.values():
            if scheme is None or not mine:
                for p in names:
                    rows[p].append(0.0)
                continue
            sums = _quantized_errors(layer, {n: linears[n] for n in mine}, scheme, inputs, extras, outputs,
                                     input_absmax, grads, device)
            values = {"output": sums["sq"] / reference, "update": sums["sq"] / update, "token": sums["token"] / tokens,
                      "fisher": 0.5 * sums["fisher"] / tokens}
            for p in names:
                rows[p].append(values[p])
        for p in names:
            out[p][unit.name] = rows[p]
    return out


def _quantized_errors(layer: nn.Module, linears: Mapping[str, nn.Linear], scheme: Scheme,
                      inputs: Sequence[torch.Tensor], extras: Sequence, outputs: Sequence[torch.Tensor],
                      input_absmax: Mapping[str, torch.Tensor], grads: Sequence[torch.Tensor] | None,
                      device: torch.device) -> dict[str, float]:
    """The layer's output error with `linears` quantized by `scheme`, summed over the batches: squared (sq), per
    token relative to the token's output (token), weighted by the squared gradient (fisher)."""
    saved = {n: m.weight.data for n, m in linears.items()}
    codes = quantize_weights(dict(saved), scheme.weights)
    hooks = []
    sums = {"sq": 0.0, "token": 0.0, "fisher": 0.0}
    try:
        for n, m in linears.items():
            m.weight.data = dequantize_weight(codes[n], scheme.weights, saved[n].dtype)
            if scheme.activations is not None:
                hooks.append(m.register_forward_pre_hook(_activation_hook(scheme.activations, input_absmax.get(n))))
        with torch.no_grad():
            for b, (x, (args, kwargs), y) in enumerate(zip(inputs, extras, outputs)):
                q = layer_output(layer(x.to(device), *args, **kwargs))
                y = y.to(q.device).double()
                dy2 = (q.double() - y).pow(2)
                sums["sq"] += float(dy2.sum())
                sums["token"] += float((dy2.sum(-1) / y.pow(2).sum(-1).clamp_min(1e-30)).sum())
                if grads is not None:
                    sums["fisher"] += float((grads[b].to(q.device).double().pow(2) * dy2).sum())
    finally:
        for h in hooks:
            h.remove()
        for n, w in saved.items():
            linears[n].weight.data = w
    return sums


def _activation_hook(spec: TensorSpec, absmax: torch.Tensor | None):
    scale = static_scale(absmax, spec) if not spec.dynamic and absmax is not None else None

    def hook(_module, args):
        return (fake_quantize(args[0], spec, scale), *args[1:])

    return hook


# --------------------------------------------------------------------------- the search on one model


# bytes one Linear (out, in) takes stored under a candidate's weights (None: unquantized), in the target's files
LinearBytes = Callable[[tuple[int, int], "TensorSpec | None"], Fraction]


@dataclass(frozen=True)
class SearchSpace:
    """A recipe's search resolved on a model's shapes: what the plan prints and the build measures and solves."""

    candidates: tuple[str, ...]  # those every target runs, in the recipe's order (BF16 among them where given)
    removed: tuple[tuple[str, str], ...]  # (candidate, why) for those a target cannot run
    units: tuple[Unit, ...]
    protected: tuple[str, ...]  # Linears kept in the model's dtype, not searched (protect, and their fused siblings)
    fixed_bytes: Fraction  # bytes of the decoder layers' Linears outside the search (protected, quantization.ignore)
    sizes: tuple[tuple[Fraction, ...], ...]  # per unit, per candidate: stored bytes (in the targets' files)
    budget_bytes: Fraction  # for every decoder-layer Linear, fixed ones included
    total_params: int
    granularity: str
    fused: bool  # a target fuses siblings, so they were kept in one unit
    notes: tuple[str, ...] = ()
    proxy: str = "output"  # the damage measure (PROXIES)

    def forwards_per_layer(self) -> int:
        """Forwards of each decoder layer over the calibration windows the measurement costs: the calibration pass's
        own, one per unit of the layer and scheme candidate, and for the fisher proxy the second pass's forward with
        its backward (counted as three forwards)."""
        per_layer: dict[int, int] = {}
        for u in self.units:
            layer = site_of(u.linears[0])[0]
            per_layer[layer] = per_layer.get(layer, 0) + 1
        schemes = sum(c != BF16 for c in self.candidates)
        return 1 + max(per_layer.values(), default=0) * schemes + (3 if self.proxy == "fisher" else 0)

    def bounds(self) -> tuple[float, float]:
        """The fewest and most bytes a mix can take (fixed bytes included)."""
        return (float(self.fixed_bytes + sum(min(r) for r in self.sizes)),
                float(self.fixed_bytes + sum(max(r) for r in self.sizes)))


def search_space(linears: Mapping[str, tuple[int, int]], *, candidates: Sequence[str],
                 removed: Sequence[tuple[str, str]], specs: Mapping[str, TensorSpec], granularity: str,
                 protect: Sequence[str], budget_bytes: float | None, effective_bits: float | None,
                 ignore: tuple[str, ...], n_layers: int, model_type: str | None, fuse: bool, elem: int,
                 matches: Callable[[str, tuple], bool], linear_bytes: LinearBytes | None = None,
                 proxy: str = "output") -> SearchSpace:
    """The search on a model of `linears` (every Linear name -> (out, in)): its decoder layers' Linears, less those
    `ignore`d and `protect`ed (fused siblings of a protected Linear are protected too where a target fuses them),
    cut into units; each unit's bytes under each candidate (`specs`; BF16: None), as `linear_bytes` counts one
    Linear's (the target formats' files: `ArtifactFormat.linear_weight_bytes`), or by default its codes at the
    candidate's stored bits and `elem` bytes a weight left unquantized."""
    if linear_bytes is None:
        def linear_bytes(shape: tuple[int, int], spec: TensorSpec | None) -> Fraction:
            return unit_bytes(shape[0] * shape[1], spec, elem)

    inside = {n: s for n, s in linears.items() if site_of(n) is not None}
    ignored = {n for n in inside if matches(n, ignore)}
    kept = {n for n in inside if n not in ignored and protected(n, protect, n_layers, matches)}
    notes = []
    if fuse:
        for siblings in fused_groups(sorted(set(inside) - ignored)):
            if kept & set(siblings) and not set(siblings) <= kept:
                notes.append(f"{', '.join(sorted(set(siblings) - kept))} protected with "
                             f"{', '.join(sorted(kept & set(siblings)))}: a target runs them as one GEMM")
                kept |= set(siblings)
    searched = {n: s for n, s in inside.items() if n not in ignored and n not in kept}
    units = make_units(searched, granularity, model_type, fuse)
    sizes = tuple(tuple(sum((linear_bytes(inside[n], specs.get(c)) for n in u.linears), Fraction(0))
                        for c in candidates) for u in units)
    fixed = sum((linear_bytes(inside[n], None) for n in kept | ignored), Fraction(0))
    total = sum(a * b for a, b in inside.values())
    budget = (Fraction(budget_bytes) if budget_bytes is not None
              else Fraction(effective_bits).limit_denominator(1 << 20) * total / 8)
    return SearchSpace(tuple(candidates), tuple(removed), tuple(units), tuple(sorted(kept)), fixed, sizes, budget,
                       total, granularity, fuse, tuple(notes), proxy)


def solve_space(space: SearchSpace, damage: Mapping[str, Sequence[float]]) -> Solution | None:
    """The least-damage mix of `space` within its budget, from each unit's measured `damage` (per candidate)."""
    return solve(space.sizes, [damage[u.name] for u in space.units], space.budget_bytes - space.fixed_bytes)


def summary(space: SearchSpace, solution: Solution, damage: Mapping[str, Sequence[float]],
            front_points: int = 12) -> dict:
    """What quantized.json, the plan and the report show: each chosen candidate's Linears, bytes and predicted
    damage, the mix's totals and the Pareto front (bytes with the fixed ones, thinned to `front_points`)."""
    per: dict[str, dict] = {}
    for unit, c, row in zip(space.units, solution.choice, space.sizes):
        cand = space.candidates[c]
        entry = per.setdefault(cand, {"group": f"search-{cand.lower()}", "scheme": cand, "units": 0, "linears": 0,
                                      "params": 0, "bytes": 0.0, "damage": 0.0})
        entry["units"] += 1
        entry["linears"] += len(unit.linears)
        entry["params"] += unit.params
        entry["bytes"] += float(row[c])
    for unit, c in zip(space.units, solution.choice):
        per[space.candidates[c]]["damage"] += damage[unit.name][c]
    front = [(b + float(space.fixed_bytes), d) for b, d in solution.front]
    if len(front) > front_points:  # evenly spread points, the ends kept
        idx = sorted({round(i * (len(front) - 1) / (front_points - 1)) for i in range(front_points)})
        front = [front[i] for i in idx]
    return {"granularity": space.granularity, "proxy": space.proxy, "budget_bytes": float(space.budget_bytes),
            "budget_effective_bits": float(space.budget_bytes * 8 / space.total_params) if space.total_params else 0.0,
            "bytes": solution.bytes + float(space.fixed_bytes),
            "effective_bits": (solution.bytes + float(space.fixed_bytes)) * 8 / max(space.total_params, 1),
            "predicted_damage": solution.damage, "exact": solution.exact,
            "groups": list(per.values()), "protected": list(space.protected),
            "removed": [{"candidate": c, "why": why} for c, why in space.removed],
            "units": {u.name: space.candidates[c] for u, c in zip(space.units, solution.choice)},
            "front": [{"bytes": b, "damage": d} for b, d in front]}



# --------------------------------------------------------------------------- what the measurement costs


@dataclass(frozen=True)
class MeasurementCost:
    """The measuring pass's cost (`llmc.quant.stream.measure_model`), which the quantize stage of a searched variant
    adds to its row until the measurement is cached (`llmc.pipeline.quantize.Quantize.cost`)."""

    layer_seconds: float  # one (the largest) decoder layer: read, its forwards, the candidates' quantization
    fixed_seconds: float  # once: the weights outside the layers read, the fisher proxy's output-head gradients
    host_bytes: float  # the pass's peak
    parts: dict[str, float]  # host_bytes term by term
    seconds_parts: dict[str, float]  # layer_seconds term by term
    forwards: int  # forwards of each layer over the calibration windows

    def seconds(self, layers: float) -> float:
        return self.layer_seconds * layers + self.fixed_seconds


def measurement_cost(space: SearchSpace, candidates: Mapping[str, Scheme | None],
                     linears: Mapping[str, tuple[int, int]], shape: Shape, *, tokens: int, seq_len: int,
                     batch_tokens: int, activations: str, compute: str, stored_elem: int,
                     device: str = "cpu", resident: float = 0.0) -> MeasurementCost:
    """What `measure_model` spends on a model of `shape`, term by term as it runs: each decoder layer read and run
    over the calibration windows `space.forwards_per_layer()` times (the calibration pass, one forward per unit of
    the layer and scheme candidate with that unit quantized, the fisher proxy's second forward and its backward),
    each unit quantized and dequantized by each candidate at the quantizer's probed rate (its activations
    fake-quantized at their probed rate in every forward of that unit), and with the fisher proxy each layer read
    again and the output head's gradient (`llmc.quant.fisher.head_cost`). `activations`: where the pass keeps them
    ("disk": spilled), as its layer loop decided (`llmc.quant.stream.measurement_facts`: every layer's inputs kept
    for the fisher proxy's backward pass). `resident`: the share of the source the page cache holds
    (llmc.planning.disk.source_read_seconds)."""
    e = BYTES[compute]
    h, layer, layers = shape.hidden, shape.layer_params, max(shape.layers, 1)
    gradients = space.proxy == "fisher"
    forward = forward_seconds(2 * tokens * layer * shape.active, 2 * tokens * seq_len * shape.attn_width,
                              compute=compute, device=device, width=h, rows=batch_tokens)
    candidates_s = 0.0
    for unit in space.units:
        for scheme in candidates.values():
            if scheme is None:
                continue
            # quantize_weights, then dequantize_weight of its codes into the Linear: about one quantizer pass each
            candidates_s += 2 * unit.params / quantize_rate(scheme.weights, compute, elements=shape.largest_linear,
                                                            device=device)
            if scheme.activations is not None:  # every forward of the unit fake-quantizes its Linears' inputs
                for n in unit.linears:
                    width = linears[n][1]
                    candidates_s += tokens * width / fake_quantize_rate(scheme.activations, compute, width,
                                                                        batch_tokens, device)
    copy = tokens * h * e  # one copy of the activations passed between layers
    stored = shape.layer_stored_bytes or layer * stored_elem  # a quantized original: its codes and scales
    # a 16-bit float source widened into a wider compute dtype as it is read (llmc.model.checkpoint.widened)
    as_read, widened = read_elem(stored_elem, e), widened_bytes(layer, stored_elem, e, shape.layer_decoded)
    read = source_read_seconds(stored, resident, widened)
    # the fisher pass reads each layer again
    per_layer = {"read": read * (2 if gradients else 1),
                 "forwards": space.forwards_per_layer() * forward,
                 "candidates": candidates_s / layers}  # the units spread over the layers
    if activations == "disk":  # written, fsynced and read back (with gradients: read again by the backward pass)
        per_layer["spill"] = spill_seconds(copy) * (2 if gradients else 1)
    skeleton = shape.outer_params - shape.head_params
    fixed = source_read_seconds(skeleton * stored_elem, resident)
    head_bytes = 0.0
    if gradients:
        head_s, head_bytes = fisher.head_cost(h, shape.vocab, tokens=tokens, batch_tokens=batch_tokens,
                                              compute=compute, device=device)
        fixed += head_s + source_read_seconds(shape.head_params * stored_elem, resident)
    kept_as_stored = min(shape.gathered_params, skeleton)  # lookup tables (llmc.model.skeleton.materialize_skeleton)
    parts = {"process": PROCESS_BYTES,
             "outer weights": (skeleton - kept_as_stored) * e + kept_as_stored * stored_elem
             + (shape.head_params * e if gradients else 0),
             "layer": layer * e + (layer * as_read if as_read != e else 0),  # (and its clone, where not widened)
             # with gradients every layer's inputs wait for the backward pass, with its gradients and outputs
             "activations": ((layers + 3 if gradients else 2) * copy if activations != "disk"
                             else 2 * batch_tokens * h * e),
             "forward temporaries": batch_tokens * (4 * h + 3 * shape.intermediate) * e
             + (batch_tokens * shape.heads * seq_len * e if device == "cpu" else 0),
             # a unit's float weights kept while its quantized copy runs (float32 at most)
             "candidate weights": 2 * 4 * max((u.params for u in space.units), default=0),
             "head gradients": head_bytes}
    return MeasurementCost(sum(per_layer.values()), fixed, sum(parts.values()), parts, per_layer,
                           space.forwards_per_layer())
