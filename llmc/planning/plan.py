"""Plan a build before any weight loads: compatibility, model-shape checks, and estimates.

Reads only the recipe, the model's config.json and its safetensors headers. Incompatibilities are
IncompatibleTargetError with the target, the reason and the fix; degradations are warnings that
say what the user loses.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llmc.planning import shapes as plan_shapes
from llmc.runtimes import catalog as targets
from llmc.errors import IncompatibleTargetError, RecipeError, ResourceError
from llmc.eval import gates
from llmc.model.checkpoint import INDEX_FILE, read_model_config
from llmc.model.checks import check_source
from llmc.model.dtype import BYTES, resolve_dtype, source_dtype
from llmc.model.families import (LAYOUTS, check_all_experts, check_kv_cache, check_quantizable, expert_count,
                                  experts_per_token, kept_in_dtype, unloaded_layers_note)
from llmc.model.skeleton import gathered_params
from llmc.model.source import TOKENIZER_FILES, locate_source
from llmc.pipeline.context import Costing
from llmc.pipeline.quantize import Quantize
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.stages import stages
from llmc.planning import disk, probes
from llmc.planning.machine import (HOST_POOL_BYTES, PROCESS_BYTES, RECLAIM_RATE, Machine, host_memory_pace,
                                   matmul_rate, memory_available, memory_free, memory_from_host,
                                   new_memory_seconds, time_range)
from llmc.planning.rows import CostRow
from llmc.planning.target import active as target_machine
from llmc.quant.canonical import module_matches
from llmc.quant.algorithms.catalog import IMPLEMENTED as IMPLEMENTED_ALGORITHMS
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.device import resolve_device
from llmc.quant import int_source, runtime_scales
from llmc.quant.groups import by_group, split_fused
from llmc.quant.search import BF16, SearchSpace, search_space
from llmc.quant.spec import FORMATS, Scheme, with_zero_grid
from llmc.quant.stream import CALIBRATION_BATCH_SIZE, check_moe_ranks
from llmc.recipe.schema import QuantizationSection, Recipe, Target
from llmc.planning.scaling import Workload, deferred_bytes, layer_shapes, moe_layer, plan_estimate, render


@dataclass
class CostedFor:
    """What the plan's rows were costed for: the model (from its headers or config.json), the compute dtype, this
    machine."""

    params: int
    layers: int
    dtype: str  # the compute dtype
    source_gb: float  # the source's weights as stored
    available_gb: float  # MemAvailable
    free_gb: float | None  # MemFree on a VM given new memory at its host's pace (else None)
    cpu_count: int
    device: str  # the calibration device
    machine: str = "this machine"  # or `--machine`'s: "the machine h100-sxm:8 (an estimate)"
    source_resident: float = 0.0  # the share of the source's files in the page cache when planned (Machine)
    host_pace_gb_s: float | None = None  # that host's pace, probed (None: not such a VM, or not probed)


@dataclass
class SlowDtype:
    """The compute dtype's matmuls probed `ratio` times slower than float32's on this CPU; the build in float32."""

    ratio: float
    float32_seconds: float


@dataclass
class Plan:
    recipe: Recipe
    scheme: Scheme  # the first (or only) variant's
    schemes: dict[str, Scheme] = field(default_factory=dict)  # variant name ("" when single) -> scheme
    warnings: list[str] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    gates: dict[str, str] = field(default_factory=dict)  # variant name -> its gates, described
    basis: str = ""  # what the estimates were computed from, when not the source's own files
    distributed: dict = field(default_factory=dict)  # per-rank estimates under --nproc / torchrun (llmc.planning.scaling)
    # The estimates (none without a model's config): each stage's row, typed (with its StageId and the decision it
    # costs); the totals below are summed from them
    rows: list[CostRow] = field(default_factory=list)
    costed_for: CostedFor | None = None
    groups: dict[str, list[dict]] = field(default_factory=dict)  # mixed precision: variant -> its groups' sizes
    slow_dtype: SlowDtype | None = None  # the compute dtype is far slower than float32 on this CPU
    export_memory_gb: float | None = None  # a whole-model (ONNX) export's peak; None without such a target
    rates: str = ""  # where the probed rates the estimates used came from (llmc.planning.probes)
    copy_rate: float | None = None  # bytes/s a file is copied (read + written, fsynced) on the machine planned for
    cache_writes: list[str] = field(default_factory=list)  # what planning itself wrote to the cache (a GGUF unpacked)
    # quantization.search, per variant: the search on this model (with the model's shapes) and, once a build has
    # measured and solved it, the chosen mix (llmc.quant.search.summary)
    search: dict[str, SearchSpace] = field(default_factory=dict)
    searched: dict[str, dict] = field(default_factory=dict)

    def mark_cached(self, pending: Collection[StageId], walked: Collection[StageId] | None = None) -> None:
        """The build knows which stages' outputs are cached: their rows say so, rows of stages after the command's
        last (`walked`: the stages it runs; None: all) say they do not run, and the totals (time, disk) count only
        the stages in `pending`."""
        for row in self.rows:
            row.skipped = walked is not None and not any(w.covers(row.id) for w in walked)
            row.cached = not row.skipped and not any(p.covers(row.id) for p in pending)

    def _todo(self) -> list[CostRow]:
        return [r for r in self.rows if not r.cached and not r.skipped]

    @property
    def seconds(self) -> float:
        """The predicted time of the stages that run."""
        return sum(r.seconds for r in self._todo())

    @property
    def seconds_range(self) -> tuple[float, float]:
        todo = self._todo()
        return (sum(r.seconds_low for r in todo), sum(r.seconds_high for r in todo))

    @property
    def disk_gb(self) -> float:
        """New bytes in the cache from the stages that run."""
        return sum(r.disk_bytes for r in self._todo()) / 1e9

    @property
    def calibration_s(self) -> float:
        return sum(r.seconds for r in self._todo() if r.id.kind is Kind.QUANTIZE)

    @property
    def eval_s(self) -> float:
        return sum(r.seconds for r in self._todo() if r.id.kind is Kind.EVAL)

    def _quantize_rows(self) -> list[CostRow]:
        return [r for r in self.rows if r.id.kind is Kind.QUANTIZE]

    @property
    def peak_memory_gb(self) -> float:
        """The largest quantize stage's host memory (cached or not: what this recipe needs of a machine)."""
        return max(r.host_bytes for r in self._quantize_rows()) / 1e9

    @property
    def device_memory_gb(self) -> float:
        return max(r.gpu_bytes for r in self._quantize_rows()) / 1e9

    @property
    def registry_gb(self) -> float:
        """What the artifacts take when the registry copies them (on another filesystem than the cache)."""
        return sum(r.disk_bytes for r in self.rows if r.id.kind is Kind.EXPORT) / 1e9

    @property
    def spill_activations(self) -> bool:
        """A quantize stage keeps its activations on disk."""
        return any(r.decision.activations == "disk" for r in self._quantize_rows() if r.decision is not None)

    @property
    def streamed_eval(self) -> bool:
        return any(getattr(r.decision, "streamed", False) for r in self.rows)

    def _estimates_dict(self) -> dict:
        """The estimates as `llmc plan --json` prints them (each stage's row under "stages", with its "decision");
        {} when the plan has none."""
        m = self.costed_for
        if m is None:
            return {}
        return {
            "params": m.params, "layers": m.layers, "dtype": m.dtype,
            "stages": [r.as_dict() for r in self.rows],
            "cheaper": {r.name: r.cheaper for r in self.rows if r.cheaper is not None},
            **({"groups": self.groups} if self.groups else {}),
            "source_gb": m.source_gb, "source_resident": m.source_resident, "registry_gb": self.registry_gb,
            "available_gb": m.available_gb,
            "free_gb": m.free_gb, **({"host_pace_gb_s": m.host_pace_gb_s} if m.host_pace_gb_s else {}),
            "peak_memory_gb": self.peak_memory_gb, "disk_gb": self.disk_gb,
            "calibration_s": self.calibration_s, "seconds": self.seconds,
            **({"slow_dtype": {"ratio": self.slow_dtype.ratio, "float32_seconds": self.slow_dtype.float32_seconds}}
               if self.slow_dtype else {}),
            "seconds_range": self.seconds_range, "eval_s": self.eval_s, "cpu_count": m.cpu_count, "machine": m.machine,
            "spill_activations": self.spill_activations, "streamed_eval": self.streamed_eval, "device": m.device,
            "device_memory_gb": self.device_memory_gb,
            **({"export_memory_gb": self.export_memory_gb} if self.export_memory_gb is not None else {}),
        }

    def as_dict(self) -> dict:
        """The plan as `llmc plan --json` prints it."""
        return {"recipe": self.recipe.name, "schemes": {n: s.name for n, s in self.schemes.items()},
                "estimates": self._estimates_dict(), "targets": self.targets, "gates": self.gates,
                "warnings": self.warnings, "distributed": self.distributed, "rates": self.rates, "basis": self.basis}

    def decision_of(self, id: StageId):
        """The decision the plan's row for stage `id` costs (None: no such row, or a stage without one)."""
        return next((r.decision for r in self.rows if r.id == id), None)

    def render(self) -> str:
        names = ", ".join(f"{n + ': ' if n else ''}{s.name} ({s.algorithm})" for n, s in self.schemes.items())
        lines = [f"plan for '{self.recipe.name}': {names}"]
        if self.basis:
            lines.append(f"  planned from {self.basis}")
        if self.costed_for is not None:
            lines += _render_estimates(self)
        if self.rates:
            lines.append(f"  {self.rates}")
        for written in self.cache_writes:
            lines.append(f"  cache: {written}")
        if self.distributed:
            lines += render(self.distributed)
        for t in self.targets:
            shown = t.get("shown_label", t["label"])
            lines.append(f"  target {shown}: {t['exporter']} ({t['status']})" + (
                "" if shown == t["label"] else
                f"; gpu_arch left at its default {t['gpu_arch']}, which it was checked against and "
                f"which names its stages, cache key and artifact ({t['label']}); llmc scores it on the CPU"))
        for name, described in self.gates.items():
            lines.append(f"  gates{' for ' + name if name else ''}: {described}")
        for variant, space in self.search.items():
            lines += render_search(variant, space, self.searched.get(variant))
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)


def render_search(variant: str, space: SearchSpace, chosen: dict | None) -> list[str]:
    """quantization.search's lines: the space (candidates kept and removed, units, budget), then, once measured,
    each chosen group's bytes and predicted damage and the Pareto front of bytes against predicted damage."""
    lo, hi = space.bounds()
    budget = float(space.budget_bytes)
    lines = [f"  search{' (' + variant + ')' if variant else ''}: {len(space.units)} units by {space.granularity}"
             + (" (fused siblings kept in one unit: a target runs them as one GEMM)" if space.fused else "")
             + f", candidates {', '.join(space.candidates)}; budget {_size(budget)} "
             f"({budget * 8 / max(space.total_params, 1):.2f} effective bits) of {_size(lo)}-{_size(hi)} reachable; "
             f"{len(space.protected)} Linears protected"]
    lines += [f"    candidate {c} removed: {why}" for c, why in space.removed]
    lines += [f"    note: {n}" for n in space.notes]
    lines.append(f"    measurement: {space.forwards_per_layer()} forwards of each decoder layer over the calibration windows "
                 "(the calibration pass's own + one per unit and scheme candidate"
                 + (" + a second pass from the last layer back, a forward and a backward each, every layer's inputs "
                    "kept: the fisher proxy" if space.proxy == "fisher" else "")
                 + "), one layer resident at a time; the quantize stage then reuses its ranges. Cached: a new budget "
                 "re-solves without measuring")
    if chosen is None:
        lines.append("    the chosen mix, its groups' bytes and predicted damage and the Pareto front: printed by "
                     "`llmc build` once measured")
        return lines
    lines.append(f"    chosen mix: {_size(chosen['bytes'])} ({chosen['effective_bits']:.2f} effective bits), "
                 f"predicted damage {chosen['predicted_damage']:.4g} ("
                 + ("sum of units' estimated KL divergences" if space.proxy == "fisher"
                    else f"sum of units' {space.proxy} proxies") + ")"
                 + ("" if chosen["exact"] else "; byte axis coarsened, optimum on that grid"))
    for g in chosen["groups"]:
        lines.append(f"    {g['group']:<24} {g['scheme']:<16} {g['units']:>4} units {g['linears']:>5} Linears "
                     f"{_size(g['bytes']):>10}  predicted damage {g['damage']:.4g}")
    lines.append("    Pareto front (bytes -> least predicted damage): "
                 + ", ".join(f"{_size(p['bytes'])} -> {p['damage']:.4g}" for p in chosen["front"]))
    return lines


def _whose_rates(machine: str) -> str:
    return "this machine's probed" if machine == "this machine" else f"{machine}'s"


def _render_estimates(plan: Plan) -> list[str]:
    """The per-stage table: device, peak host RAM, peak GPU memory, new disk, time, strategy and why."""
    m, rows = plan.costed_for, plan.rows
    w = max([34, *(len(r.name) for r in rows)])  # a mixed scheme's name is long: never cut
    lines = [
        f"  model: {m.params / 1e6:,.1f}M params in {m.layers} layers, computed in {m.dtype}; "
        f"source {m.source_gb:.2f} GB"
        + (f" ({m.source_resident:.0%} of it in the page cache now: read from memory)" if m.source_resident >= 0.005
           else "")
        + f"; {m.machine}: {m.available_gb:.1f} GB available"
        + (f" ({m.free_gb:.1f} GB free; a VM given new memory at its host's pace"
           + (f", probed at {m.host_pace_gb_s:.2f} GB/s: each stage's new memory past {HOST_POOL_BYTES / 1e9:.0f} GB"
              " is planned at it," if m.host_pace_gb_s else "")
           + " the times' slow ends wait for all of it)" if m.free_gb is not None else "")
        + f", {m.cpu_count} CPUs; calibrating on {m.device}",
        f"  peak memory ~{plan.peak_memory_gb:.2f} GB (one layer + calibration activations"
        f"{', spilled to disk' if plan.spill_activations else ''})"
        + (f", ONNX export ~{plan.export_memory_gb:.2f} GB of memory" if plan.export_memory_gb is not None else ""),
        f"  {'stage':<{w}} {'device':<7} {'host RAM':>9} {'GPU mem':>8} {'disk':>9} {'time (range)':>13}  strategy",
    ]
    for r in rows:
        if r.cached or r.skipped:  # nothing to run, nothing new on disk
            lines.append(f"  {r.name:<{w}} {'cached' if r.cached else '-':<7}  "
                         + ("its output is in the cache: it will not run" if r.cached
                            else "after this command's last stage: it will not run"))
            continue
        gpu = f"{r.gpu_bytes / 1e9:.2f} GB" if r.gpu_bytes else "-"
        lines.append(f"  {r.name:<{w}} {r.device:<7} {r.host_bytes / 1e9:>6.2f} GB {gpu:>8} "
                     f"{r.disk_bytes / 1e9:>6.2f} GB {_span(r.seconds_low, r.seconds_high):>13}  "
                     f"{r.strategy}: {r.why}")
    for r in rows:
        if r.layer_seconds and not r.cached and not r.skipped:
            per_layer = r.layer_seconds  # a small model's layers take a fraction of a second each
            equivalent = (r.seconds - r.fixed_seconds) / per_layer  # smaller layers priced by their size
            count = (f"x {m.layers} layers" if abs(equivalent - m.layers) < 0.05 else
                     f"(the largest) x {equivalent:.1f} of its size ({m.layers} layers, each priced by its size)")
            lines.append(f"  {r.name} time (prediction): "
                         f"~{f'{per_layer:.2f} s' if per_layer < 1 else _duration(per_layer)} per decoder layer "
                         f"{count} + ~{_duration(r.fixed_seconds)} outside the layers = "
                         f"~{_duration(r.seconds)}, at {_whose_rates(m.machine)} rates")
    for variant, groups in plan.groups.items():
        lines.append(f"  mixed precision{' (' + variant + ')' if variant else ''}, weights of the decoder layers' "
                     "Linears stored:")
        for g in groups:
            lines.append(f"    {g['group']:<24} {g['scheme']:<16} {g['linears']:>6} Linears "
                         f"{g['params'] / 1e6:>10,.1f}M params {_size(g['bytes']):>10}")
    low, high = plan.seconds_range
    cached = sum(r.cached or r.skipped for r in rows)
    lines.append(f"  time: ~{_duration(plan.seconds)} in all, {_span(low, high)}"
                 + (f" for the {len(rows) - cached} stages that run" if cached else "")
                 + " (the range: the probes' fastest and slowest runs, widened by the cost model's measured error "
                   "per stage, docs/planner.md)")
    mapped = max((r.mapped_bytes / 1e9 for r in rows), default=0.0)
    if mapped:
        lines.append("  host RAM: what the process allocates; safetensors files are read through mmap, and up to "
                     f"{mapped:.2f} GB of their pages (page cache, not counted above) stay mapped in a stage")
    lines.append(f"  disk: {plan.disk_gb:.2f} GB new in the cache (each file once; targets with identical weights "
                 f"share them), the registry links them (a copy, {plan.registry_gb:.2f} GB{_copy_time(plan)}, on "
                 "another filesystem); "
                 f"calibration ~{_duration(plan.calibration_s)}, eval ~{_duration(plan.eval_s)} (predictions)")
    return lines


def _copy_time(plan: Plan) -> str:
    """How long the registry's copy of the artifacts takes at the disk's probed rates ("" when not known)."""
    return f", ~{_duration(plan.registry_gb * 1e9 / plan.copy_rate)}" if plan.copy_rate and plan.registry_gb else ""


def _size(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


def _span(low: float, high: float) -> str:
    """A time range in the unit of its upper end: '40-75 s', '3-9 min', '1.2-3.4 h'."""
    if high < 120:
        return f"{low:.0f}-{high:.0f} s"
    if high < 7200:
        return f"{low / 60:.0f}-{high / 60:.0f} min"
    return f"{low / 3600:.1f}-{high / 3600:.1f} h"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def search_removed(q: QuantizationSection, recipe_targets: tuple[Target, ...]) -> list[tuple[str, str]]:
    """(candidate, why) for each quantization.search candidate some target cannot run (`check_target`, the runtimes'
    own rules); IncompatibleTargetError when no scheme candidate is left."""
    base = q.to_scheme()
    removed = []
    for candidate, group in q.search.members(q.algorithm).items():
        for t in recipe_targets:
            try:
                check_target(base.member(group), t)
            except IncompatibleTargetError as e:
                removed.append((candidate, e.message))
                break
    if len(removed) == len(q.search.members(q.algorithm)):
        raise IncompatibleTargetError(
            "quantization.search: no scheme candidate runs on every target: "
            + "; ".join(f"{c}: {why}" for c, why in removed),
            fix="add a candidate every target runs (llmc matrix lists them), or change the targets")
    return removed


def _search_space(recipe: Recipe, q: QuantizationSection, removed: list[tuple[str, str]], config: dict,
                  linears: dict[str, tuple[int, int]], model_folder: Path | None) -> SearchSpace:
    """The search on this model's shapes: candidates whose group sizes the searched widths rule out are removed too
    (`_check_widths`); RecipeError when the budget is below the smallest mix."""
    search, base = q.search, q.to_scheme()
    members = search.members(q.algorithm)
    removed = list(removed)
    inside = {n: s for n, s in linears.items() if not module_matches(n, base.ignore)}
    for c, group in members.items():
        if c in dict(removed):
            continue
        try:
            _check_widths(base.member(group), inside, f"quantization.search candidate {c}")
        except IncompatibleTargetError as e:
            removed.append((c, e.message))
    kept = [c for c in search.names if c not in dict(removed)]
    if not any(c != BF16 for c in kept):
        raise IncompatibleTargetError("quantization.search: no scheme candidate fits this model and the targets: "
                                      + "; ".join(f"{c}: {why}" for c, why in removed),
                                      fix="add a candidate the targets run with a group size this model's widths take")
    elem = BYTES[resolve_dtype(recipe.model.dtype, model_folder, config)]
    formats = {targets.format_for(t).name: targets.format_for(t) for t in recipe.targets}

    def linear_bytes(shape: tuple[int, int], spec) -> Fraction:  # the largest of the targets' files: fits each
        return max(f.linear_weight_bytes(shape, spec, elem) for f in formats.values())

    space = search_space(
        linears, candidates=kept, removed=removed, specs={c: g.weights for c, g in members.items()},
        granularity=search.granularity, protect=search.protect, budget_bytes=search.budget.bytes,
        effective_bits=search.budget.effective_bits, ignore=base.ignore,
        n_layers=config.get("num_hidden_layers", 0), model_type=config.get("model_type"),
        fuse=any(f.fuses_projections for f in formats.values()), elem=elem, matches=module_matches,
        linear_bytes=linear_bytes, proxy=search.proxy)
    if not space.units:
        raise RecipeError(f"quantization.search has nothing to search: search.protect and quantization.ignore hold "
                          f"every decoder-layer Linear ({len(space.protected)} protected)",
                          fix="protect fewer Linears (search.protect), or drop the search for a plain scheme")
    lo, hi = space.bounds()
    if space.budget_bytes < lo:
        raise RecipeError(
            f"quantization.search.budget is {_size(float(space.budget_bytes))} "
            f"({float(space.budget_bytes) * 8 / space.total_params:.2f} effective bits), below the smallest mix of "
            f"this model's decoder-layer Linears, {_size(lo)} ({lo * 8 / space.total_params:.2f} effective bits: "
            f"every unit at its smallest candidate, {len(space.protected)} protected Linears in the model's dtype)",
            fix=f"raise the budget to at least {lo * 8 / space.total_params:.2f} effective bits, protect fewer "
                "Linears, or add a smaller candidate")
    everything_kept = space.fixed_bytes + sum(row[space.candidates.index(BF16)] for row in space.sizes) \
        if BF16 in space.candidates else None
    if everything_kept is not None and space.budget_bytes >= everything_kept:
        raise RecipeError(
            f"quantization.search.budget ({_size(float(space.budget_bytes))}) holds every Linear in the model's dtype "
            f"({_size(float(everything_kept))}), so the search would quantize nothing",
            fix=f"lower the budget below {float(everything_kept) * 8 / space.total_params:.2f} effective bits")
    return space


def check_target(scheme: Scheme, target: Target) -> tuple[str, list[str]]:
    """Status ('native'/'degraded'/'cpu') and warnings; raises when the target cannot run it."""
    warnings: list[str] = []
    status = "native"
    label = target.label
    rt = targets.runtime(target.runtime)
    for key in targets.scheme_keys(scheme):
        rule = rt.rules.get(key)
        if rule is None:
            takers = [r.name for r in targets.runtimes() if key in r.rules]
            raise IncompatibleTargetError(
                f"target {label}: {target.runtime} does not run {key} checkpoints"
                + (f"; runtimes that do: {', '.join(takers)}" if takers else ""),
                fix=f"{target.runtime} runs: {', '.join(sorted(rt.rules))}" if rt.rules else f"{target.runtime} is not supported",
            )
        if target.gpu_arch == "cpu":
            if not rule.cpu:
                on_cpu = sorted(k for k, r in rt.rules.items() if r.cpu)
                raise IncompatibleTargetError(
                    f"target {label}: {target.runtime} has no CPU support for {key}"
                    + (f" ({rule.cpu_note})" if rule.cpu_note else ""),
                    fix="target a GPU arch" + (f", or pick a scheme its CPU build runs ({', '.join(on_cpu)})"
                                               if on_cpu else ""),
                )
            status = "cpu"
        elif rule.native_until and targets.arch_rank(target.gpu_arch) > targets.arch_rank(rule.native_until):
            span = targets.arch_span(rule.native_from or rule.native_until, rule.native_until)
            there = [k for k, r in sorted(rt.rules.items()) if k.startswith("KV-") == key.startswith("KV-")
                     and r.native_from and targets.arch_at_least(target.gpu_arch, r.native_from)
                     and not (r.native_until and targets.arch_rank(target.gpu_arch) > targets.arch_rank(r.native_until))]
            raise IncompatibleTargetError(
                f"target {label}: {target.runtime} runs {key} on {span}, gpu_arch is {target.gpu_arch}: "
                f"{rule.until_reason or rule.refuse_reason} ({rule.source})",
                fix=f"set gpu_arch to {rule.native_until}" + (" or older" if span != f"{rule.native_until} only" else "")
                + (f", or choose a scheme {target.runtime} runs on {target.gpu_arch} ({', '.join(there)})" if there
                   else f", or choose another scheme for {target.gpu_arch}"),
            )
        elif rule.native_from and targets.arch_at_least(target.gpu_arch, rule.native_from):
            pass
        elif rule.degraded_from and targets.arch_at_least(target.gpu_arch, rule.degraded_from):
            status = "degraded"
            warnings.append(f"target {label}: {key} on {target.gpu_arch}: {rule.degraded_effect}")
        else:
            need = rule.degraded_from or rule.native_from
            if need is None:  # no GPU kernel at all (e.g. ONNX Runtime's FP8 Q/DQ): its CPU build runs it
                raise IncompatibleTargetError(
                    f"target {label}: {target.runtime} runs {key} on CPU only, gpu_arch is {target.gpu_arch}"
                    + (f": {rule.refuse_reason}" if rule.refuse_reason else ""),
                    fix="set gpu_arch: cpu, or choose another scheme or runtime for the GPU",
                )
            raise IncompatibleTargetError(
                f"target {label}: {key} needs {need}+ on {target.runtime}, gpu_arch is {target.gpu_arch}: "
                f"{rule.refuse_reason}",
                fix=f"set gpu_arch to {need if rule.native_until else need + ' or newer'}, or choose another scheme",
            )
        if target.version and rule.since:
            spec = SpecifierSet(target.version)
            ok = [v for v in rt.known_versions if Version(v) >= Version(rule.since) and v in spec]
            if not ok and Version(rule.since) not in spec:
                raise IncompatibleTargetError(
                    f"target {label}: {target.runtime} supports {key} from {rule.since}, "
                    f"but version range '{target.version}' admits no such release",
                    fix=f"widen version to include >={rule.since}",
                )
    format_name = rt.format_for(target.version)
    if not targets.is_implemented(format_name):
        raise IncompatibleTargetError(
            f"target {label}: the {format_name} exporter for {target.runtime} is not in this llmc version",
            fix="target " + ", ".join(sorted(r.name for r in targets.runtimes() if targets.is_implemented(r.format))),
        )
    try:
        if target.triton:
            targets.triton_backend(target)
        targets.artifact_format(format_name).check_mixed(scheme)  # check_scheme, per group for a mixed scheme
    except IncompatibleTargetError as e:
        raise IncompatibleTargetError(f"target {label}: {e.message}", fix=e.fix) from None
    warnings += [f"target {label}: {w}" for w in rt.plan_warnings(scheme)]
    return status, warnings


def check_model(recipe: Recipe, scheme: Scheme, config: dict, linear_shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Shape checks against the model's config and its Linear weights' shapes (each group's, for a mixed scheme:
    the groups resolved on the model's Linears, RecipeError naming the modules no group or two groups select)."""
    warnings: list[str] = []
    # (group name, its plain scheme, its Linears' shapes) per quantized group; a plain scheme: every Linear not ignored
    if not scheme.mixed:
        members = [("", scheme, {n: s for n, s in linear_shapes.items() if not module_matches(n, scheme.ignore)})]
    else:
        shapes = by_group(scheme, linear_shapes, config.get("num_hidden_layers", 0), config.get("model_type"))
        members = [(group, member, shapes[group]) for group, member in scheme.members().items()]
        empty = [g.name for g in scheme.groups if not shapes[g.name]]
        if empty:  # harmless (a role this family lacks), but often a misspelt name or a layer out of range
            warnings.append(f"quantization.groups {', '.join(empty)} select no Linear of this model "
                            f"({', '.join(scheme.group(g).targets.describe() for g in empty)})")
    for group, member, quantized in members:
        _check_widths(member, quantized, f"quantization.groups[{group}]" if group else "quantization")
    if config.get("tie_word_embeddings") and not module_matches("lm_head", scheme.ignore):
        raise IncompatibleTargetError(
            "lm_head is tied to the input embeddings in this model; quantizing it would untie them",
            fix="keep 'lm_head' in quantization.ignore",
        )
    for _, member, quantized in members:
        warnings += _hessian_rank_warning(recipe, member, quantized)
        warnings += _expert_hessian_warning(recipe, member, quantized, config)
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    inter = config.get("intermediate_size")
    for t in recipe.targets:
        tp = t.tensor_parallel
        if tp == 1:
            continue
        if heads and heads % tp:
            raise IncompatibleTargetError(
                f"target {t.label}: tensor_parallel {tp} does not divide the {heads} attention heads",
                fix=f"use a tensor_parallel that divides {heads}",
            )
        if kv and (kv % tp if tp <= kv else tp % kv):
            raise IncompatibleTargetError(
                f"target {t.label}: tensor_parallel {tp} does not divide the {kv} KV heads "
                "(nor is it a multiple of them, which runtimes would need to replicate KV heads)",
                fix=f"use a tensor_parallel that divides {kv} or is a multiple of it",
            )
        if inter and inter % tp:
            raise IncompatibleTargetError(
                f"target {t.label}: tensor_parallel {tp} does not divide intermediate_size {inter}",
                fix="use a tensor_parallel that divides it",
            )
        for _, member, quantized in members:
            w = member.weights
            if w.strategy != "group":
                continue
            for n, (_, cols) in quantized.items():
                if n.endswith(("o_proj", "down_proj")) and (cols // tp) % w.group_size:
                    raise IncompatibleTargetError(
                        f"target {t.label}: row-parallel {n} splits its {cols} inputs into {cols // tp} per rank, "
                        f"not a multiple of group_size {w.group_size}",
                        fix="lower group_size or tensor_parallel",
                    )
    return warnings


def outer_linears_note(scheme: Scheme, tensors: plan_shapes.ModelTensors) -> list[str]:
    """The plan line for Linears outside the decoder layers that the scheme does not ignore (Gemma-4's
    per_layer_model_projection, an untied lm_head left out of `ignore`): the stream quantizes the decoder layers'
    Linears only, so these stay in the model's dtype and every export lists them as unquantized."""
    outer = sorted(n for n in tensors.linear_shapes()
                   if f"{n}.weight" not in tensors.layer_of and not module_matches(n, scheme.ignore))
    if not outer:
        return []
    return [f"{', '.join(outer)}: Linear{'s' if len(outer) > 1 else ''} outside the decoder layers, kept in the "
            f"model's dtype (llmc quantizes the decoder layers' Linears only); every export lists "
            f"{'them' if len(outer) > 1 else 'it'} as unquantized (ignore / exclude_modules / modules_to_not_convert)"]


def family_quantized(config: dict, linear_shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The Linears the model's family table lets llmc quantize: all but those it keeps in their dtype
    (llmc.model.families.KEPT_IN_DTYPE), which the stream leaves as they are."""
    return {n: s for n, s in linear_shapes.items() if not kept_in_dtype(config.get("model_type"), n)}


def kept_linears_note(config: dict, linear_shapes: dict[str, tuple[int, int]]) -> list[str]:
    """One plan line per kind of Linear the family keeps in the model's dtype, with how many and why."""
    kept: dict[str, list[str]] = {}
    for n in linear_shapes:
        why = kept_in_dtype(config.get("model_type"), n)
        if why:
            kept.setdefault(why, []).append(n)
    return [f"{len(names)} Linear{'s' if len(names) > 1 else ''} "
            f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n in names}))}): {why}, kept in the model's dtype for "
            f"model_type {config.get('model_type')!r}; every export lists {'them' if len(names) > 1 else 'it'} as "
            "unquantized" for why, names in kept.items()]


def _check_fused(recipe: Recipe, scheme: Scheme, config: dict, linear_shapes: dict[str, tuple[int, int]]) -> None:
    """IncompatibleTargetError when a mixed scheme splits Linears a target's runtime fuses into one GEMM."""
    fusing = [t.label for t in recipe.targets if targets.format_for(t).fuses_projections]
    if not scheme.mixed or not fusing:
        return
    split = split_fused(scheme, linear_shapes, config.get("num_hidden_layers", 0), config.get("model_type"))
    if split:
        siblings, groups = split[0]
        named = ", ".join(f"{n} ({g or 'unquantized'})" for n, g in zip(siblings, groups))
        raise IncompatibleTargetError(
            f"targets {', '.join(fusing)}: their runtimes run {len(siblings)} Linears as one GEMM, which takes one "
            f"scheme, but the groups split them: {named}" + (f"; {len(split) - 1} more such sets" if len(split) > 1
                                                             else ""),
            fix="select fused siblings (q/k/v, gate/up) together: by role, or names covering all of them")


_SHOWN_LINEARS = 4  # Linears named in a width error before "and N more"


def _undivided(quantized: dict[str, tuple[int, int]], size: int) -> str:
    """The Linears whose input width `size` does not divide, named with their (out x in) shapes, the first few."""
    odd = [f"{n} ({o}x{i})" for n, (o, i) in quantized.items() if i % size]
    more = len(odd) - _SHOWN_LINEARS
    return ", ".join(odd[:_SHOWN_LINEARS]) + (f" and {more} more" if more > 0 else "") + " (out x in)"


def _check_widths(scheme: Scheme, quantized: dict[str, tuple[int, int]], where: str) -> None:
    """Group sizes (weights; activations of block-wise FP8, MX and NVFP4) that divide every quantized input width."""
    w = scheme.weights
    if w.strategy == "group":
        bad = sorted({s[1] for s in quantized.values() if s[1] % w.group_size})
        if bad:
            # group sizes the runtimes' W4A16 kernels (Marlin, Machete, TensorRT-LLM) accept
            divisors = [g for g in (32, 64, 128) if all(d % g == 0 for d in bad)]
            fix = f"use group_size {max(divisors)}" if divisors else "use strategy: channel"
            if scheme.name == "W4AFP8":  # its kernels (vLLM, TensorRT-LLM) take groups of 128 only
                fix = f"W4AFP8 needs group_size 128, which this model's widths rule out; use W4A16 ({fix}) or W8A8"
            raise IncompatibleTargetError(
                f"{where}.weights.group_size {w.group_size} does not divide input dimension(s) {bad} "
                f"of this model: {_undivided(quantized, w.group_size)}",
                fix=fix,
            )
    a = scheme.activations
    if a is not None and a.strategy == "group":  # block-wise FP8's 1x128 groups, MX / NVFP4 blocks
        bad = sorted({s[1] for s in quantized.values() if s[1] % a.group_size})
        if bad:
            raise IncompatibleTargetError(
                f"{scheme.name} quantizes activations in groups of {a.group_size}, which do not divide input "
                f"dimension(s) {bad} of this model: {_undivided(quantized, a.group_size)}",
                fix="choose a weight-only scheme or another model")


def _hessian_rank_warning(recipe: Recipe, scheme: Scheme, quantized: dict[str, tuple[int, int]]) -> list[str]:
    """An algorithm that solves with each Linear's input Hessian (X^T X, in x in) needs at least `in` calibration
    tokens for it to have full rank; from fewer, the solve rests on its dampening alone in the directions no token
    spans, and the quantized weights come out far worse than the same tokens give other algorithms."""
    c = recipe.calibration
    tokens = c.samples * c.seq_len
    short = _widest_beyond(quantized, tokens) if AlgorithmSteps.of(scheme).observes_hessians else None
    if short is None:
        return []
    name, widest = short
    return [f"{scheme.algorithm} accumulates each Linear's input Hessian ({widest} x {widest} for the widest, "
            f"{name}) over {tokens:,} calibration tokens (calibration.samples {c.samples} x seq_len {c.seq_len}), "
            f"fewer than its {widest} inputs: the Hessian is rank-deficient and the solve rests on its dampening. "
            f"Fix: calibrate on at least {widest:,} tokens, e.g. calibration.samples: "
            f"{-(-widest // c.seq_len)} at seq_len {c.seq_len}"]


def _widest_beyond(linears: dict[str, tuple[int, int]], tokens: float) -> tuple[str, int] | None:
    """The widest of `linears` (name, inputs) when `tokens` are fewer than its inputs (its Hessian rank-deficient)."""
    if not linears:
        return None
    name, (_, widest) = max(linears.items(), key=lambda item: item[1][1])
    return (name, widest) if tokens < widest else None


def _expert_hessian_warning(recipe: Recipe, scheme: Scheme, quantized: dict[str, tuple[int, int]],
                            config: dict) -> list[str]:
    """A Mixture-of-Experts expert sees only the tokens routed to it: top-k of the experts' share of the calibration
    tokens on average. Fewer than its inputs leave its Hessian rank-deficient, and GPTQ's solve is then ill-posed: on
    a tiny Qwen3-MoE, activations 2.4e-7 apart moved up to 4 code steps on 17% of an expert's weights
    (tests/unit/test_device_mix.py). Calibrating every expert on every token gives each one all of them."""
    c = recipe.calibration
    if c.moe_calibrate_all_experts or not AlgorithmSteps.of(scheme).observes_hessians:
        return []
    layout = LAYOUTS.get(config.get("model_type"))
    every_token = layout is None or layout.routing != "scaled_input"  # Llama-4: refused (families.check_all_experts)
    routed = c.samples * c.seq_len * plan_shapes.active_fraction(config)
    short = _widest_beyond({n: s for n, s in quantized.items() if ".experts." in n}, routed)
    if short is None:
        return []
    name, widest = short
    return [f"{scheme.algorithm} solves each expert's Linears with the Hessian of the tokens routed to it: "
            f"~{routed:,.0f} on average here (calibration.samples {c.samples} x seq_len {c.seq_len} x the routed "
            f"share {plan_shapes.active_fraction(config):.3g}), fewer than the {widest} inputs of {name}, so the "
            f"experts' Hessians are rank-deficient and their codes rest on the dampening. Fix: "
            + ("set calibration.moe_calibrate_all_experts: true (every expert observes every token), or calibrate on "
               "more tokens" if every_token else "calibrate on more tokens (calibration.samples, seq_len)")]


def _check_scheme(scheme: Scheme, where: str) -> None:
    if scheme.algorithm not in IMPLEMENTED_ALGORITHMS:
        raise IncompatibleTargetError(
            f"{where}.algorithm '{scheme.algorithm}' is not implemented in this llmc version",
            fix=f"use one of: {', '.join(sorted(IMPLEMENTED_ALGORITHMS))}",
        )
    for spec in (scheme.weights, scheme.activations):
        if spec is not None and not spec.info.implemented:
            *others, last = [name for name, info in FORMATS.items() if info.implemented]
            raise IncompatibleTargetError(f"{where}: {spec.format} quantization is not implemented in this llmc "
                                          "version", fix=f"use {', '.join(others)} or {last} weights")


def _with_target_zero_grids(schemes: dict[str, Scheme], recipe_targets: list[Target]) -> tuple[dict[str, Scheme], list[str]]:
    """`schemes` with each target format's constraint on zero points (GPTQ v1), which holds for the one canonical
    form every target exports, and a note per scheme it changed."""
    grids = {g for g in (targets.format_for(t).zero_grid for t in recipe_targets) if g is not None}
    gridded = dict(schemes)
    for grid in sorted(grids):
        gridded = {name: with_zero_grid(scheme, grid) for name, scheme in gridded.items()}
    notes = [f"{name + ': ' if name else ''}asymmetric zero points are kept off 0 for the GPTQ-format target(s) "
             f"{', '.join(t.label for t in recipe_targets if targets.format_for(t).zero_grid)} (GPTQ v1 stores "
             "zero - 1, and its readers read a stored 2^b - 1 differently): a range whose zero point would be 0 "
             "takes a one-level narrower grid (docs/model-sources.md)"
             for name, scheme in gridded.items() if scheme != schemes[name]]
    return gridded, notes


def make_plan(recipe: Recipe, model_folder: Path | None = None, cache_dir: Path | None = None, *,
              config: dict | None = None, refuse: bool = True, nproc: int | None = None,
              check_time: bool = True, resolved: dict[str, tuple[Scheme, dict]] | None = None,
              last: Kind | None = None) -> Plan:
    """Check every variant x target; with the model folder (or only its config.json, planning offline), also shapes
    and each stage's memory, disk and time (per rank when `nproc` or torchrun's WORLD_SIZE says several), refusing
    what does not fit this machine or, with `check_time`, the recipe's time budget (the build checks it later,
    against the stages it still has to run). With `last` (`llmc quantize`, `llmc export`), only the stages up to it
    must fit: the later ones are planned and shown, not run."""
    schemes = {name: q.to_scheme() for name, q in recipe.variant_sections()}
    searches = {name: q for name, q in recipe.variant_sections() if q.search is not None}
    removed = {name: search_removed(q, recipe.targets) for name, q in searches.items()}
    for name, q in searches.items():  # the stand-in: the widest candidate every target runs (to_scheme's rule)
        members = q.search.members(q.algorithm)
        kept = [c for c in members if c not in dict(removed[name])]
        schemes[name] = schemes[name].member(members[max(kept, key=lambda c: members[c].weights.stored_bits)])
    resolved = resolved or {}
    schemes.update({name: scheme for name, (scheme, _) in resolved.items()})  # a build's searched mixes, solved
    plan = Plan(recipe=recipe, scheme=next(iter(schemes.values())), schemes=schemes,
                searched={name: chosen for name, (_, chosen) in resolved.items()})
    for name, scheme in schemes.items():
        where = f"variants[{name}].quantization" if name else "quantization"
        for t in recipe.targets:  # what the hardware/runtime cannot do is the more useful message
            status, warns = check_target(scheme, t)
            plan.warnings += [f"{name}: {w}" if name else w for w in warns]
            label = f"{name}/{t.label}" if name else t.label
            plan.targets.append({"label": label, "exporter": targets.format_for(t).name, "status": status,
                                 "gpu_arch": t.gpu_arch, "runs_on": t.runs_on,
                                 "shown_label": f"{name}/{t.shown_label}" if name else t.shown_label})
        _check_scheme(scheme, where)
    # after the targets' checks, which name a target whose exporter is missing (the grid never changes what they accept)
    plan.schemes, zero_note = _with_target_zero_grids(schemes, recipe.targets)
    plan.scheme, plan.warnings = next(iter(plan.schemes.values())), zero_note + plan.warnings
    schemes = plan.schemes
    _plan_gates(plan)
    nproc = nproc or int(os.environ.get("WORLD_SIZE", 1))
    _check_rank_split(recipe, schemes, nproc)
    if recipe.gates.min_decode_tokens_per_s is not None:
        no_cache = sorted({t["label"] for t in plan.targets
                           if not targets.artifact_format(t["exporter"]).measures_decode})
        if no_cache:
            plan.warnings.append(f"targets {', '.join(no_cache)}: their artifact has no KV cache, so "
                                 "min_decode_tokens_per_s cannot be measured for them and that gate will fail")
    if model_folder is not None or config is not None:
        if model_folder is not None:
            config = read_model_config(Path(model_folder))
            plan.warnings += check_source(recipe, config, Path(model_folder))  # exit 7 before the weights' layout
            tensors = plan_shapes.from_headers(Path(model_folder))
        else:
            plan.warnings += check_source(recipe, config, None)
            tensors = plan_shapes.from_config(config)
        # an integer original (GPTQ, AWQ, compressed-tensors): its codes kept or requantized, per scheme, and why
        plan.warnings += int_source.plan_notes(tensors.source_format, schemes)

        check_quantizable(config)  # families llmc cannot quantize yet (MoE), then those a target's format lacks
        check_all_experts(config, recipe.calibration.moe_calibrate_all_experts)
        for t in recipe.targets:
            targets.check_family(t, config)
            for scheme in schemes.values():
                targets.check_family_format(t, scheme, config)  # first: it names the loader a family's format is for
                targets.check_moe_scheme(t, scheme, config)
        for row, (s, t) in zip(plan.targets, [(s, t) for s in schemes.values() for t in recipe.targets]):
            row["exporter"] = targets.format_for(t, config, s).name  # a family's own format (Runtime.family_formats)
        linears = family_quantized(config, tensors.linear_shapes())
        plan.warnings += kept_linears_note(config, tensors.linear_shapes())
        for name, q in searches.items():
            plan.search[name] = _search_space(recipe, q, removed[name], config, linears, model_folder)
        for scheme in schemes.values():
            if scheme.kv_cache is not None:
                check_kv_cache(config)  # DeepSeek's latent cache
            plan.warnings += check_model(recipe, scheme, config, linears)
            plan.warnings += outer_linears_note(scheme, tensors)
            _check_fused(recipe, scheme, config, linears)
        plan.warnings += runtime_scales.plan_notes(schemes, linears, expert_count(config) > 1)
        unloaded = unloaded_layers_note(config, tensors.shapes)  # DeepSeek's / GLM-4.5's MTP layer
        if unloaded:
            plan.warnings.append(unloaded)
        device = _calibration_device(recipe.calibration.device)  # weight-only schemes are quantized there too
        probes.book().used.clear()
        _estimate(plan, config, tensors, device, model_folder)
        plan.rates = probes.book().describe()
        plan.warnings += _slow_dtype_warning(plan)
        if nproc > 1 and expert_count(config) > 1:
            for s in schemes.values():  # refused here, before torchrun starts (the stream checks it again)
                check_moe_ranks(s, nproc)
        if nproc > 1:
            plan.distributed = _distributed_estimate(plan, config, tensors.linear_shapes(), nproc)

        try:
            refuse_if_it_does_not_fit(plan, device, last)
            if check_time:
                check_budget(plan)
            if cache_dir is not None and target_machine() is None:  # another machine's disk is not known here
                check_disk(plan, Path(cache_dir))
        except ResourceError as e:
            if refuse:
                raise
            # planning for another machine (the source is not here): say what this one lacks, do not stop
            where = f"the machine {target_machine().name}" if target_machine() else "this machine"
            plan.warnings.append(f"{where} could not run the build: {e.message} (fix: {e.fix})")
    return plan


# a compute dtype whose probed matmul rate is this many times below float32's on this CPU gets a warning
SLOW_DTYPE_RATIO = 2.0
# the instruction-set flags (/proc/cpuinfo) that make a 16-bit dtype's matmuls native on an x86 CPU
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def _slow_dtype_warning(plan: Plan) -> list[str]:
    """A compute dtype far slower than float32 on this CPU (bf16 without bf16 instructions): both times, the fix."""
    slow = plan.slow_dtype
    if not slow:
        return []
    dtype = plan.costed_for.dtype
    t = target_machine()
    flags = set((t.cpu_flags if t else probes.fingerprint()["cpu_flags"]).split())
    native = NATIVE_FLAGS.get(dtype, ())
    why = (f"this CPU has none of {', '.join(native)} in /proc/cpuinfo, so torch emulates {dtype} matmuls"
           if native and flags and not flags & set(native) else "as probed on this CPU")
    return [f"{dtype} matmuls run {slow.ratio:.1f}x slower than float32 here ({why}): this build is predicted "
            f"at ~{_duration(plan.seconds)} in {dtype}, ~{_duration(slow.float32_seconds)} in float32. Fix: set "
            f"model.dtype: float32 (twice the memory for the weights it holds), or build on a CPU with "
            f"{' / '.join(native) or f'native {dtype}'} or on a GPU (calibration.device: cuda)"]


def _calibration_device(requested: str) -> torch.device:
    """calibration.device on the machine planned for: this one (llmc.quant.device), or `--machine`'s."""
    t = target_machine()
    return torch.device(t.device_for(requested)) if t else resolve_device(requested)


def _machine_name() -> str:
    t = target_machine()
    return "this machine" if t is None else f"the machine {t.name}" + (" (an estimate)" if t.estimate else "")


def _host_available() -> int | None:
    """Host bytes available to the build on the machine planned for."""
    t = target_machine()
    return t.memory_bytes if t else memory_available()


def _gpu_free(device: torch.device) -> int | None:
    """Bytes free on the calibration GPU of the machine planned for (None: calibrating on the CPU)."""
    if device.type != "cuda":
        return None
    t = target_machine()
    return t.gpu_memory_bytes if t else torch.cuda.mem_get_info(device)[0]


def refuse_if_it_does_not_fit(plan: Plan, device: torch.device, last: Kind | None = None) -> None:
    """ResourceError, before any weight loads, when a stage's peak exceeds this machine's memory: the numbers,
    and the cheaper strategy when one exists (spill the activations, stream the evaluation, another machine).
    Stages after `last` are not run by this build and are not checked."""

    def runs(kind: Kind) -> bool:
        return last is None or not kind.comes_after(last)

    available = _host_available()
    if device.type == "cuda":
        free = _gpu_free(device) / 1e9
        if free < plan.device_memory_gb:
            raise ResourceError(
                f"calibrating one layer needs ~{plan.device_memory_gb:.1f} GB on {device}, {free:.1f} GB are free",
                fix="free the GPU, lower calibration.samples (AWQ keeps every batch's inputs on the device), "
                "or set calibration.device: cpu",
            )
    _refuse_if_a_stage_overfills_its_gpu(plan, runs)
    whole_model = [t["label"] for t in plan.targets if runs(Kind.EXPORT)
                   and targets.artifact_format(t["exporter"]).layout.whole_model]
    if whole_model and available is not None and plan.export_memory_gb > available / 1e9:
        streaming = [r.name for r in targets.runtimes() if not targets.artifact_format(r.format).layout.whole_model]
        raise ResourceError(
            f"the export for {', '.join(whole_model)} holds the whole model in float32 "
            f"(~{plan.export_memory_gb:.1f} GB); {available / 1e9:.1f} GB of memory are available",
            fix=f"export these targets on a machine with more memory, or drop them (the exporters for "
                f"{', '.join(streaming)} stream one layer at a time)",
        )
    if available is None:
        return
    for row in (r for r in plan.rows if runs(r.id.kind)):
        # what it allocates plus the file pages it keeps mapped: evicting those re-reads them from disk on every use
        # (a whole model mapped in a machine too small for it reads every weight again for each batch)
        need = row.host_bytes / 1e9 + row.mapped_bytes / 1e9
        if need <= available / 1e9:
            continue
        cheaper = row.cheaper
        mapped_gb = row.mapped_bytes / 1e9
        mapped = f", {mapped_gb:.1f} GB of it mapped checkpoint pages" if mapped_gb >= 0.05 else ""
        raise ResourceError(
            f"{row.name} needs ~{need:.1f} GB of host memory ({row.strategy}{mapped}); "
            f"{available / 1e9:.1f} GB are available",
            fix=(f"{cheaper[0]} (~{cheaper[1]:.1f} GB)" if cheaper else
                 "run on a machine with more memory, or lower calibration.samples / seq_len, eval.batch_size or "
                 "eval.seq_len (one batch of logits is batch x seq_len x vocab floats)"),
        )


def _refuse_if_a_stage_overfills_its_gpu(plan: Plan, runs: Callable[[Kind], bool]) -> None:
    """ResourceError when a stage that runs on a GPU (an evaluation holding the whole model there) needs more than
    that GPU has free: the GPU's own memory, not the host's, bounds it."""
    for row in plan.rows:
        if not runs(row.id.kind) or not row.gpu_bytes or row.cached or row.skipped or not row.device.startswith("cuda"):
            continue
        free = _gpu_free(torch.device(row.device))
        if free is not None and row.gpu_bytes > free:
            raise ResourceError(
                f"{row.name} needs ~{row.gpu_bytes / 1e9:.1f} GB on {row.device} ({row.strategy}), "
                f"{free / 1e9:.1f} GB are free there",
                fix="set LLMC_TORCH_EVAL=streamed (one decoder layer on the GPU at a time), eval.device: cpu, "
                    "or use a GPU with more memory")


def check_budget(plan: Plan, pending: Collection[StageId] | None = None) -> None:
    """ResourceError when the predicted time of the stages still to run (all, or those in `pending`) exceeds the
    recipe's resources.max_hours; a warning when only the upper end of its range does."""
    budget = plan.recipe.resources.max_hours
    rows = [r for r in plan.rows if pending is None or any(p.covers(r.id) for p in pending)]
    if budget is None or not rows:
        return
    seconds = sum(r.seconds for r in rows)
    low = sum((r.seconds_range or (r.seconds, r.seconds))[0] for r in rows)
    high = sum((r.seconds_range or (r.seconds, r.seconds))[1] for r in rows)
    predicted = f"~{_duration(seconds)} ({_span(low, high)})"
    if seconds > budget * 3600:
        longest = max(rows, key=lambda r: r.seconds)
        slow = plan.slow_dtype
        raise ResourceError(
            f"the plan predicts {predicted} for the stages still to run, more than resources.max_hours "
            f"({budget:g} h); the longest is {longest.name} (~{_duration(longest.seconds)})",
            fix=(f"set model.dtype: float32 (~{_duration(slow.float32_seconds)} on this CPU), " if slow else "")
            + "lower calibration.samples / seq_len or eval.windows, calibrate on a GPU (calibration.device: cuda), "
              "or raise resources.max_hours")
    if high > budget * 3600:
        plan.warnings.append(f"the plan predicts {predicted} for the stages still to run: the upper end of the "
                             f"range is over resources.max_hours ({budget:g} h)")


def check_disk(plan: Plan, cache_dir: Path, pending: Collection[StageId] | None = None) -> None:
    """ResourceError when the cache's disk cannot take what the build still has to write: every stage's new files,
    or only the rows of the stages in `pending` (the build passes those whose outputs are not cached yet)."""
    need = sum(row.disk_bytes for row in plan.rows
               if pending is None or any(p.covers(row.id) for p in pending)) / 1e9
    free = shutil.disk_usage(cache_dir).free / 1e9
    if free < need:
        raise ResourceError(
            f"the build needs ~{need:.1f} GB under {cache_dir}, {free:.1f} GB are free",
            fix="free disk space or set LLMC_CACHE to a larger disk",
        )


def _check_rank_split(recipe: Recipe, schemes: dict[str, Scheme], nproc: int) -> None:
    """RecipeError when data-parallel calibration over `nproc` ranks would leave a rank without a calibration batch
    (each rank takes a contiguous block of whole batches, llmc.distributed.shard_bounds): found here, from the recipe,
    by every rank alike before any weight loads, rather than by one rank inside the quantize stage."""
    if nproc <= 1 or not any(s.needs_calibration for s in schemes.values()):
        return
    c = recipe.calibration
    unit = 1 if c.packing == "samples" else CALIBRATION_BATCH_SIZE  # as llmc.quant.stream cuts them
    batches = -(-c.samples // unit)
    if batches < nproc:
        raise RecipeError(f"calibration.samples: {c.samples} calibration windows in batches of {unit} leave "
                          f"{nproc - batches} of {nproc} ranks without any",
                          fix=f"use at most {batches} processes (--nproc) or at least {unit * nproc} "
                              "calibration.samples")


def plan_recipe(recipe: Recipe, store, recipe_path: Path | None = None, nproc: int | None = None) -> Plan:
    """`llmc plan`: from the source's config and headers, or, for a Hub id (`hf:`) or a source not on this machine,
    offline from the config.json the recipe names in `model.config` (relative to the recipe's folder)."""
    probes.use_cache(store.root)  # this machine's rates, as earlier plans probed them (or probed now)
    source = recipe.model.source
    if recipe.model.config is not None:
        config_path = Path(recipe.model.config).expanduser()
        if not config_path.is_absolute() and recipe_path is not None:
            config_path = Path(recipe_path).parent / config_path
        absent = source.startswith("hf:") or (":" not in source and not Path(source).expanduser().exists())
        if absent:
            folder = config_path if config_path.is_dir() else config_path.parent
            plan = make_plan(recipe, config=read_model_config(folder), cache_dir=store.root, refuse=False,
                             nproc=nproc)
            plan.basis = f"{folder / 'config.json'} (model.config; the source {source} is not read)"
            return plan
    unpacked = unpacked_sources(store.root)
    located = locate_source(source, store, source_dtype(recipe.model.dtype))  # no weight data read, none hashed
    plan = make_plan(recipe, located.folder, store.root, nproc=nproc)
    plan.cache_writes += source_cache_note(located.folder, store.root, unpacked)
    return plan


def unpacked_sources(cache: Path) -> set[Path]:
    """The unpacked copies of sources (a GGUF's safetensors folder) in the cache now."""
    return set((Path(cache) / "stages" / "source").glob("*"))


def source_cache_note(folder: Path, cache: Path, before: set[Path]) -> list[str]:
    """What locating the source wrote to the cache (a GGUF unpacked into safetensors, once) or reads from it."""
    folder = Path(folder)
    if folder.parent != Path(cache) / "stages" / "source":
        return []  # the source's own folder: nothing written
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9
    if folder in before:
        return [f"the source's unpacked copy ({size:.2f} GB) is read from {folder}"]
    return [f"wrote the source's unpacked copy, {size:.2f} GB, to {folder} (once: later plans and builds read it; "
            "it counts in the cache's size)"]


def _distributed_estimate(plan: Plan, config: dict, shapes: dict, nproc: int) -> dict:
    """Per-rank memory/time, bytes per layer and speed-up of data-parallel calibration (llmc.planning.scaling)."""
    calibrated = [s for s in plan.schemes.values() if s.needs_calibration]
    if not calibrated:
        return {"nproc": nproc, "note": "no scheme calibrates: the ranks would only share the quantization of each "
                                        "layer's Linears; run it as one process"}
    pipelines = [AlgorithmSteps.of(s) for s in calibrated]
    experts = expert_count(config)
    work = Workload(ranges=any(s.stores_ranges for s in calibrated),
                    hessians=any(p.observes_hessians for p in pipelines),
                    module_calls=any(p.replays_module_calls for p in pipelines),
                    # MoE on several ranks: Hessians observed, then the layer's Linears spread over the ranks
                    solve_on_rank0=not experts and any(p.calibrates and p.true_sequential for p in pipelines))
    c = plan.recipe.calibration
    activations_gb = 0.0 if plan.spill_activations else \
        2 * c.samples * c.seq_len * config.get("hidden_size", 0) * 4 / 1e9

    m = plan.costed_for
    flops = matmul_rate(m.dtype, m.device, config.get("hidden_size") or 1024,
                        c.seq_len)  # measured here, as the stage times are
    layer = layer_shapes(shapes, moe_layer(shapes))  # an MoE model: a layer with its experts
    deferred_gb = 0.0
    if experts and work.hessians:
        share = 1.0 if c.moe_calibrate_all_experts else (experts_per_token(config) or 1) / experts
        deferred_gb = deferred_bytes(layer, c.samples * c.seq_len / nproc, share, BYTES.get(m.dtype, 4)) / 1e9
    return plan_estimate(m.layers, m.device, plan.calibration_s, plan.peak_memory_gb, layer, work,
                         nproc, activations_gb, flops, deferred_gb)


def _plan_gates(plan: Plan) -> None:
    """The gates each variant gets, and what the planner can already say about them (llmc.eval.gates)."""
    recipe = plan.recipe
    refusal = None if recipe.gates.allow_unevaluated else gates.emulated_performance_gates(
        recipe, plan.schemes, plan.targets)
    if refusal:
        raise RecipeError(refusal, fix="add a runtime that reads the artifact to eval.runtimes (its own speed), "
                                       "or drop the performance gate; emulation timings are not gated")
    plan.gates = {name: gates.describe_gates(recipe.gates, s) for name, s in plan.schemes.items()}
    plan.warnings += gates.plan_warnings(recipe, plan.schemes, plan.targets)


def _side_file_bytes(model_folder: Path | None) -> int:
    """Bytes of the source's tokenizer files and config.json, which the exports copy (0 without the folder)."""
    if model_folder is None:
        return 0
    names = (*TOKENIZER_FILES, "config.json")
    return sum(f.stat().st_size for f in (Path(model_folder) / n for n in names)
               if f.is_file() and f.name != INDEX_FILE)


def _estimate(plan: Plan, config: dict, tensors, device: torch.device, model_folder: Path | None) -> None:
    """The plan's estimates: the stages of the build walked, each appending its cost row (`plan.rows`), and what
    they were costed for."""
    recipe, schemes, searched = plan.recipe, plan.schemes, plan.searched
    compute = resolve_dtype(recipe.model.dtype, model_folder, config)
    stored_elem = BYTES.get(resolve_dtype("auto", model_folder, config), 4)
    shape = plan_shapes.Shape.of(tensors, config, stored_elem)
    if config.get("model_type") and (stored_elem != BYTES[compute] or stored_elem != BYTES["float32"]):
        # the calibration skeleton's lookup tables stay as stored (a float32 walk, below, converts the others)
        shape = replace(shape, gathered_params=gathered_params(config))
    available = _host_available()
    # A VM whose free memory goes back to its host gets new pages at the host's pace: ~4 GB/s when the host has them
    # to hand, 0.3-0.6 GB/s when it is short, which no counter in the guest shows (docs/planner-constants.md#
    # reclaim_rate; the slow pages were free ones, not evicted page cache). The point plans each stage's new memory
    # past the recently freed pages it gets first (HOST_POOL_BYTES) at the pace probed within the hour
    # (host_memory_pace); the slowest end plans all of it at the slower of that and a short host's RECLAIM_RATE.
    host_paced = memory_from_host() and target_machine() is None  # another machine: not known to be such a VM
    free = memory_free() if host_paced else None  # shown in the plan's first line
    pace = host_memory_pace() if host_paced else None
    c = recipe.calibration

    gpu_free = _gpu_free(device)
    cpus = target_machine().cpus if target_machine() else os.cpu_count()
    side_files = _side_file_bytes(model_folder)

    # the source's pages the page cache holds now are read from memory (the slowest end: evicted before the build);
    # the files the build reads: those the headers came from (a shard index's, not a consolidated copy beside them)
    resident = disk.resident_share(list(tensors.files)) if tensors.files and target_machine() is None else 0.0

    def walk(compute: str = compute, pool: float = HOST_POOL_BYTES, pace: float | None = pace,
             resident: float = resident) -> Costing:
        machine = Machine(available, gpu_free, str(device), cpus, source_resident=resident)
        costing = Costing(recipe=recipe, shape=shape, machine=machine,
                          linears=tensors.linear_shapes(), compute=compute, stored_elem=stored_elem,
                          config=config, side_files=side_files, tensor_shapes=tensors.shapes)
        for stage in stages(recipe, schemes, searched=searched, spaces=plan.search, config=config):
            stage.cost(costing)
        for row in costing.rows:  # memory the host hands over slowly (host_paced, above)
            reclaim = new_memory_seconds(row.host_bytes - PROCESS_BYTES, pool, pace)
            row.seconds += reclaim
            if row.layer_seconds:  # a layered stage's once-per-stage part
                row.fixed_seconds += reclaim
        return costing

    costing = walk()
    rows = costing.rows
    # the time range: the stages costed again at each probe's fastest and slowest run, then widened by the cost
    # model's own measured error per stage kind
    with probes.reading("fastest"):
        fastest = [r.seconds for r in walk(pace=None).rows]
    with probes.reading("slowest"):
        slow_pace = min(host_memory_pace() or RECLAIM_RATE, RECLAIM_RATE) if host_paced else None
        slowest = [r.seconds for r in walk(pool=0.0, pace=slow_pace, resident=0.0).rows]
    for row, fast, slow in zip(rows, fastest, slowest):
        row.seconds_range = time_range(row.id.kind.value, min(fast, row.seconds), max(slow, row.seconds))
    plan.rows = rows
    plan.copy_rate = 1 / (1 / disk.read_rate() + 1 / disk.write_rate())  # the registry's copy, when it is one
    plan.costed_for = CostedFor(params=shape.params, layers=shape.layers, dtype=compute,
                                source_gb=shape.stored_bytes / 1e9, available_gb=(available or 0) / 1e9,
                                free_gb=free / 1e9 if free is not None else None,
                                host_pace_gb_s=pace / 1e9 if pace else None, cpu_count=cpus,
                                device=str(device), machine=_machine_name(), source_resident=resident)
    if device.type == "cpu" and compute != "float32":
        rows_probed = min(512, c.seq_len * CALIBRATION_BATCH_SIZE)
        ratio = (matmul_rate("float32", "cpu", shape.hidden, rows_probed)
                 / matmul_rate(compute, "cpu", shape.hidden, rows_probed))
        if ratio >= SLOW_DTYPE_RATIO:
            plan.slow_dtype = SlowDtype(ratio, sum(r.seconds for r in walk("float32").rows))
    # mixed precision: variant name ("" for one quantization) -> per group, its Linears, parameters, stored bytes
    plan.groups = {s.variant: s.groups(costing) for s in stages(recipe, schemes, Kind.QUANTIZE)
                   if isinstance(s, Quantize) and s.scheme.mixed}
    if any(targets.artifact_format(t["exporter"]).layout.whole_model for t in plan.targets):
        plan.export_memory_gb = 3 * shape.params * 4 / 1e9
