"""Plan a build before any weight loads: compatibility, model-shape checks, and estimates.

Reads only the recipe, the model's config.json and its safetensors headers. Incompatibilities are
IncompatibleTargetError with the target, the reason and the fix; degradations are warnings that
say what the user loses.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llmc import targets
from llmc.errors import IncompatibleTargetError
from llmc.quant.activations import memory_available, should_spill
from llmc.quant.device import resolve_device
from llmc.quant.algorithms import IMPLEMENTED as IMPLEMENTED_ALGORITHMS
from llmc.quant.algorithms import Pipeline, calibration_passes
from llmc.quant.spec import Scheme
from llmc.recipe.schema import Recipe, Target

# Measured on this class of machine (2 cores): ~800 calibration tok/s for a 135M model in fp32.
_CPU_FLOPS = 2 * 135e6 * 800
# Effective rate of the layer-at-a-time loop on an H100 (SmolLM2-width, 32x512 windows; GPTQ / SmoothQuant
# 1.7 / 1.5 TFLOP/s in the model-forward units below: small layers are bound by launches and file writes).
_GPU_FLOPS = 2 * 135e6 * 6_000


@dataclass
class Plan:
    recipe: Recipe
    scheme: Scheme  # the first (or only) variant's
    schemes: dict[str, Scheme] = field(default_factory=dict)  # variant name ("" when single) -> scheme
    warnings: list[str] = field(default_factory=list)
    estimates: dict = field(default_factory=dict)
    targets: list[dict] = field(default_factory=list)
    gates: dict[str, str] = field(default_factory=dict)  # variant name -> its gates, described
    distributed: dict = field(default_factory=dict)  # per-rank estimates under --nproc / torchrun (llmc.scaling)

    def render(self) -> str:
        names = ", ".join(f"{n + ': ' if n else ''}{s.name} ({s.algorithm})" for n, s in self.schemes.items())
        lines = [f"plan for '{self.recipe.name}': {names}"]
        e = self.estimates
        if e:
            lines.append(
                f"  model: {e['params'] / 1e6:.1f}M params in {e['layers']} layers; "
                f"peak memory ~{e['peak_memory_gb']:.2f} GB (one layer + calibration activations"
                f"{', spilled to disk' if e.get('spill_activations') else ''}), "
                f"calibrating on {e['device']}"
                f"{' (~%.2f GB of GPU memory)' % e['device_memory_gb'] if e['device'] != 'cpu' else ''}, "
                f"disk ~{e['disk_gb']:.2f} GB, calibration ~{e['calibration_s']:.0f} s, eval ~{e['eval_s']:.0f} s"
                + (f", ONNX export ~{e['export_memory_gb']:.2f} GB of memory" if "export_memory_gb" in e else "")
            )
        if self.distributed:
            from llmc.scaling import render

            lines += render(self.distributed)
        for t in self.targets:
            lines.append(f"  target {t['label']}: {t['exporter']} ({t['status']})")
        for name, described in self.gates.items():
            lines.append(f"  gates{' for ' + name if name else ''}: {described}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)


def check_target(scheme: Scheme, target: Target) -> tuple[str, list[str]]:
    """Status ('native'/'degraded'/'cpu') and warnings; raises when the target cannot run it."""
    warnings: list[str] = []
    status = "native"
    label = target.label
    rt = targets.runtime(target.runtime)
    for key in targets.scheme_keys(scheme):
        rule = rt.rules.get(key)
        if rule is None:
            raise IncompatibleTargetError(
                f"target {label}: {target.runtime} does not run {key} checkpoints",
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
        elif rule.native_until and targets.arch_at_least(target.gpu_arch, rule.native_until) and target.gpu_arch != rule.native_until:
            raise IncompatibleTargetError(
                f"target {label}: {target.runtime} runs {key} on {rule.native_until} only, gpu_arch is "
                f"{target.gpu_arch}: {rule.refuse_reason}",
                fix=f"set gpu_arch to {rule.native_until}, or choose another scheme for {target.gpu_arch}",
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
        targets.artifact_format(format_name).check_scheme(scheme)
    except IncompatibleTargetError as e:
        raise IncompatibleTargetError(f"target {label}: {e.message}", fix=e.fix) from None
    warnings += [f"target {label}: {w}" for w in rt.plan_warnings(scheme)]
    return status, warnings


def check_model(recipe: Recipe, scheme: Scheme, config: dict, linear_shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Shape checks against the model's config and its Linear weights' shapes."""
    from llmc.quant.canonical import module_matches

    warnings: list[str] = []
    quantized = {n: s for n, s in linear_shapes.items() if not module_matches(n, scheme.ignore)}
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
                f"quantization.weights.group_size {w.group_size} does not divide input dimension(s) {bad} "
                f"of this model",
                fix=fix,
            )
    if config.get("tie_word_embeddings") and not module_matches("lm_head", scheme.ignore):
        raise IncompatibleTargetError(
            "lm_head is tied to the input embeddings in this model; quantizing it would untie them",
            fix="keep 'lm_head' in quantization.ignore",
        )
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
        if w.strategy == "group":
            for n, (_, cols) in quantized.items():
                if n.endswith(("o_proj", "down_proj")) and (cols // tp) % w.group_size:
                    raise IncompatibleTargetError(
                        f"target {t.label}: row-parallel {n} splits its {cols} inputs into {cols // tp} per rank, "
                        f"not a multiple of group_size {w.group_size}",
                        fix="lower group_size or tensor_parallel",
                    )
    return warnings


def linear_shapes_from_headers(folder: Path) -> tuple[dict[str, tuple[int, int]], int, int]:
    """2-D weight shapes (module name -> (out, in)), total parameter count and bytes, from headers only."""
    from llmc.model.checkpoint import check_safetensors_header, safetensors_files

    shapes: dict[str, tuple[int, int]] = {}
    params = nbytes = 0
    for f in safetensors_files(folder):
        for name, info in check_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            params += n
            nbytes += info["data_offsets"][1] - info["data_offsets"][0]
            if name.endswith(".weight") and len(info["shape"]) == 2 and "embed" not in name:
                shapes[name[: -len(".weight")]] = tuple(info["shape"])
    return shapes, params, nbytes


def _check_scheme(scheme: Scheme, where: str) -> None:
    if scheme.algorithm not in IMPLEMENTED_ALGORITHMS:
        raise IncompatibleTargetError(
            f"{where}.algorithm '{scheme.algorithm}' is not implemented in this llmc version",
            fix=f"use one of: {', '.join(sorted(IMPLEMENTED_ALGORITHMS))}",
        )
    if scheme.weights.format == "nvfp4" or scheme.activations and scheme.activations.format == "nvfp4":
        raise IncompatibleTargetError(f"{where}: nvfp4 quantization is not implemented in this llmc version",
                                      fix="use fp8_e4m3, int8 or int4 weights")


def make_plan(recipe: Recipe, model_folder: Path | None = None, cache_dir: Path | None = None,
              nproc: int | None = None) -> Plan:
    """Check every variant x target; with the model folder, also shapes and resource estimates (per rank when `nproc`
    or torchrun's WORLD_SIZE says several)."""
    schemes = {name: q.to_scheme() for name, q in recipe.variant_sections()}
    plan = Plan(recipe=recipe, scheme=next(iter(schemes.values())), schemes=schemes)
    for name, scheme in schemes.items():
        where = f"variants[{name}].quantization" if name else "quantization"
        for t in recipe.targets:  # what the hardware/runtime cannot do is the more useful message
            status, warns = check_target(scheme, t)
            plan.warnings += [f"{name}: {w}" if name else w for w in warns]
            label = f"{name}/{t.label}" if name else t.label
            plan.targets.append({"label": label, "exporter": targets.format_for(t).name, "status": status})
        _check_scheme(scheme, where)
    _plan_gates(plan)
    if recipe.gates.min_decode_tokens_per_s is not None:
        no_cache = sorted({t["label"] for t in plan.targets
                           if not targets.artifact_format(t["exporter"]).measures_decode})
        if no_cache:
            plan.warnings.append(f"targets {', '.join(no_cache)}: their artifact has no KV cache, so "
                                 "min_decode_tokens_per_s cannot be measured for them and that gate will fail")
    if model_folder is not None:
        from llmc.model.checkpoint import read_model_config

        config = read_model_config(Path(model_folder))
        shapes, params, nbytes = linear_shapes_from_headers(Path(model_folder))
        for scheme in schemes.values():
            plan.warnings += check_model(recipe, scheme, config, shapes)
        device = resolve_device(recipe.calibration.device)  # weight-only schemes are quantized there too
        plan.estimates = _estimates(recipe, list(schemes.values()), config, params, nbytes, device)
        nproc = nproc or int(os.environ.get("WORLD_SIZE", 1))
        if nproc > 1:
            plan.distributed = _distributed_estimate(recipe, list(schemes.values()), config, shapes, plan.estimates,
                                                     nproc)
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0] / 1e9
            if free < plan.estimates["device_memory_gb"]:
                from llmc.errors import ResourceError

                raise ResourceError(
                    f"calibrating one layer needs ~{plan.estimates['device_memory_gb']:.1f} GB on {device}, "
                    f"{free:.1f} GB are free",
                    fix="free the GPU, lower calibration.samples (AWQ keeps every batch's inputs on the device), "
                    "or set calibration.device: cpu",
                )
        whole_model = [t["label"] for t in plan.targets if targets.artifact_format(t["exporter"]).whole_model]
        if whole_model:
            # whole-model exporters (ONNX) hold float32 weights, the graph's copy of them, then the codes
            need = 3 * params * 4 / 1e9
            plan.estimates["export_memory_gb"] = need
            available = memory_available()
            if available is not None and need > available / 1e9:
                from llmc.errors import ResourceError

                streaming = [r.name for r in targets.runtimes() if not targets.artifact_format(r.format).whole_model]
                raise ResourceError(
                    f"the export for {', '.join(whole_model)} holds the whole model in float32 "
                    f"(~{need:.1f} GB); {available / 1e9:.1f} GB of memory are available",
                    fix=f"export these targets on a machine with more memory, or drop them (the exporters for "
                        f"{', '.join(streaming)} stream one layer at a time)",
                )
        if cache_dir is not None:
            free = shutil.disk_usage(cache_dir).free / 1e9
            if free < plan.estimates["disk_gb"]:
                from llmc.errors import ResourceError

                raise ResourceError(
                    f"the build needs ~{plan.estimates['disk_gb']:.1f} GB under {cache_dir}, {free:.1f} GB are free",
                    fix="free disk space or set LLMC_CACHE to a larger disk",
                )
    return plan



def _distributed_estimate(recipe: Recipe, schemes: list[Scheme], config: dict, shapes: dict, estimates: dict,
                          nproc: int) -> dict:
    """Per-rank memory/time, bytes per layer and speed-up of data-parallel calibration (llmc.scaling)."""
    from llmc.scaling import Workload, layer_shapes, plan_estimate

    calibrated = [s for s in schemes if s.needs_calibration]
    if not calibrated:
        return {"nproc": nproc, "note": "no scheme calibrates: the ranks would only share the quantization of each "
                                        "layer's Linears; run it as one process"}
    pipelines = [Pipeline.of(s) for s in calibrated]
    work = Workload(ranges=any(s.stores_ranges for s in calibrated),
                    hessians=any(p.observes_hessians for p in pipelines),
                    awq=any(p.replays_module_calls for p in pipelines),
                    solve_on_rank0=any(p.calibrates and p.true_sequential for p in pipelines))
    c = recipe.calibration
    activations_gb = 0.0 if estimates.get("spill_activations") else \
        2 * c.samples * c.seq_len * config.get("hidden_size", 0) * 4 / 1e9
    flops = _GPU_FLOPS if str(estimates.get("device", "cpu")).startswith("cuda") else _CPU_FLOPS
    return plan_estimate(estimates, layer_shapes(shapes), work, nproc, activations_gb, flops)


def _plan_gates(plan: Plan) -> None:
    """The gates each variant gets, and what the planner can already say about them (llmc.eval.gates)."""
    from llmc.eval import gates

    recipe = plan.recipe
    refusal = None if recipe.gates.allow_unevaluated else gates.emulated_performance_gates(
        recipe, plan.schemes, plan.targets)
    if refusal:
        from llmc.errors import RecipeError

        raise RecipeError(refusal, fix="add a runtime that reads the artifact to eval.runtimes (its own speed), "
                                       "or drop the performance gate; emulation timings are not gated")
    plan.gates = {name: gates.describe_gates(recipe.gates, s) for name, s in plan.schemes.items()}
    plan.warnings += gates.plan_warnings(recipe, plan.schemes, plan.targets)


def _estimates(
    recipe: Recipe, schemes: list[Scheme], config: dict, params: int, nbytes: int,
    device: torch.device = torch.device("cpu"),
) -> dict:
    layers = config.get("num_hidden_layers", 1)
    hidden = config.get("hidden_size", 0)
    vocab = config.get("vocab_size", 0)
    elem = 4 if recipe.model.dtype == "float32" else 2
    embed = vocab * hidden * elem
    per_layer = max(nbytes - embed, 0) / max(layers, 1)
    c = recipe.calibration
    calibrated = any(s.needs_calibration for s in schemes)
    act = 2 * c.samples * c.seq_len * hidden * 4 if calibrated else 0
    batch_act = 2 * min(4, c.samples) * c.seq_len * hidden * 4  # one batch in, one out (batches are 4 windows)
    spill = calibrated and should_spill(c.spill_activations, act // 2, memory_available())
    if spill:  # only the batch in flight is resident
        act = batch_act
    awq_act = 0
    if any(Pipeline.of(s).replays_module_calls for s in schemes):
        # AWQ keeps each module's calibration inputs for its grid search (about 2 + intermediate/hidden copies)
        awq_act = c.samples * c.seq_len * (2 * hidden + config.get("intermediate_size", 4 * hidden)) * 4
    act += awq_act
    passes = sum(calibration_passes(s) for s in schemes)
    qbytes = sum(params * s.weights.bits / 8 + embed for s in schemes)
    ev = recipe.eval
    eval_tokens = ev.windows * ev.seq_len * (1 + len(schemes)) * len(ev.runtimes)
    flops_per_token = 2 * params
    layer_flops = _GPU_FLOPS if device.type == "cuda" else _CPU_FLOPS
    return {
        "params": params,
        "layers": layers,
        "peak_memory_gb": (per_layer * 2 + embed + act) / 1e9,
        "disk_gb": (nbytes + qbytes * (1 + len(recipe.targets))) / 1e9,
        "calibration_s": passes * c.samples * c.seq_len * flops_per_token / layer_flops,
        "eval_s": eval_tokens * flops_per_token / _CPU_FLOPS,
        "cpu_count": os.cpu_count(),
        "spill_activations": spill,
        "device": str(device),
        # on the device: the layer (float weights + a float32 copy for the algorithms), a batch, AWQ's inputs
        "device_memory_gb": (per_layer * 3 + batch_act + awq_act) / 1e9 if device.type != "cpu" else 0.0,
    }
