"""Before an export is recorded: its config.json's quantization_config describes exactly the tensors it wrote.

A runtime decides how to load each Linear from that config alone, so a config that claims a Linear the files store
unquantized (or the other way round) gives an artifact no runtime loads as built. One check for every format that
writes such a claim, read in the claim's own language (`quantization_config.quant_method`):

    compressed-tensors   a Linear in `ignore` (exact name or "re:" pattern, as vLLM matches) is unquantized; one a
                         config group targets (name, "re:" pattern or "Linear") has codes, weight_scale and, with
                         static activations, its input scale; one neither ignored nor targeted is a mismatch itself
    modelopt             a Linear in `ignore` (exact or fnmatch pattern) is unquantized, or, mixed precision, one
                         missing from `quantized_layers`; the others have weight_scale (and input_scale when static)
    gptq                 every Linear but lm_head and those a "-:" pattern of `dynamic` skips (vLLM's and
                         GPTQModel's rule) has qweight, qzeros, scales
    awq                  every Linear whose name holds no `modules_to_not_convert` entry (vLLM's and transformers'
                         rule) has qweight, qzeros, scales

Formats without such a claim (GGUF, ONNX: each tensor or node states its own type) are not checked. The Linears
are the model's own, from its config on the meta device (MoE experts under their per-expert names), not the
exporter's bookkeeping: the check must not share the bug it looks for.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from safetensors import safe_open

# tensors only a quantized Linear has (an unquantized one keeps `weight` and `bias` alone)
QUANTIZED_SUFFIXES = ("weight_scale", "weight_packed", "weight_shape", "weight_zero_point", "weight_global_scale",
                      "weight_scale_2", "input_scale", "input_global_scale", "pre_quant_scale", "qweight", "qzeros",
                      "scales", "g_idx")
_CODES = ("weight", "weight_packed")
_PACKED = (("qweight",), ("qzeros",), ("scales",))

# a Linear's claim: None = stored unquantized; a tuple = the tensors it needs (each entry: any one of these suffixes)
Claim = tuple[tuple[str, ...], ...] | None
UNLISTED = ("unlisted",)  # neither quantized nor listed as unquantized: a mismatch whatever the files hold


class ConfigMismatch(RuntimeError):
    """An export whose quantization_config does not describe its tensors: a bug in llmc, never a user's input."""


def matches_exact_or_re(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' and vLLM's rule for `ignore` and `targets`: the exact name or a "re:" pattern."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in patterns)


def _compressed_tensors(q: dict) -> Callable[[str], Claim]:
    ignore = q.get("ignore") or []
    groups = list((q.get("config_groups") or {}).values())

    def claim(name: str) -> Claim:
        if matches_exact_or_re(name, ignore):
            return None
        for g in groups:
            if "Linear" in g.get("targets", []) or matches_exact_or_re(name, g.get("targets", [])):
                acts = g.get("input_activations")
                static = acts is not None and acts.get("dynamic") is not True
                return (_CODES, ("weight_scale",)) + ((("input_scale", "input_global_scale"),) if static else ())
        return UNLISTED

    return claim


STATIC_MODELOPT = {"FP8", "W8A8_SQ_PER_CHANNEL", "W4A8_AWQ", "NVFP4"}


def _modelopt(q: dict) -> Callable[[str], Claim]:
    ignore, layers = q.get("ignore") or [], q.get("quantized_layers")

    def claim(name: str) -> Claim:
        if any(p == name or fnmatch.fnmatchcase(name, p) for p in ignore):
            return None
        algo = q.get("quant_algo") if layers is None else (layers.get(name) or {}).get("quant_algo")
        if algo is None:
            return None
        return (_CODES, ("weight_scale",)) + ((("input_scale",),) if algo in STATIC_MODELOPT else ())

    return claim


def _gptq(q: dict) -> Callable[[str], Claim]:
    skipped = [p[2:] for p in (q.get("dynamic") or {}) if p.startswith("-:")]
    head = bool(q.get("lm_head"))
    return lambda name: (None if (name == "lm_head" and not head) or any(re.match(p, name) for p in skipped)
                         else _PACKED)


def _awq(q: dict) -> Callable[[str], Claim]:
    skipped = q.get("modules_to_not_convert") or []
    return lambda name: None if any(s in name for s in skipped) else _PACKED


CLAIMS: dict[str, Callable[[dict], Callable[[str], Claim]]] = {
    "compressed-tensors": _compressed_tensors, "modelopt": _modelopt, "gptq": _gptq, "awq": _awq}


def model_linears(config: dict) -> list[str]:
    """Every nn.Linear of the model `config` describes (per-expert names for fused MoE experts), from the meta
    device: no weight is read."""
    import torch
    from torch import nn

    from llmc.model.skeleton import build_skeleton
    from llmc.quant import moe

    model = build_skeleton(config, torch.float32)
    moe.unfuse_experts(model)
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear))


# `check_export` builds the model's skeleton on the meta device to list its Linears: Python work per decoder layer,
# whatever the widths (SmolLM2-135M: 0.75 s for 30 layers under load ~8, 0.09 s for 1 layer: more than the FP8
# export's own writes). The plan times `model_linears` on the model's own config cut to 1 and CHECK_PROBE_LAYERS layers
# and fits the two (benchmarks/results/planner-log.md, "The export stages' own work"); 8, not fewer: the slope is a
# difference of two timings, which a busy machine's noise swamps when the two differ by little (at 4 layers the
# probe read 0.063 s per layer under load ~13, against 0.023 measured on 1, 4 and 30 layers).
CHECK_PROBE_LAYERS = 8


def skeleton_rate(config: dict, layers: int) -> float:
    """Calls/s of `model_linears` on `config` cut to `layers` decoder layers (llmc.planning.probes: timed, cached
    per machine; the key names the family and its experts per layer, which set the modules a layer holds)."""
    from llmc.model.families import expert_count
    from llmc.model.skeleton import config_with_layers
    from llmc.planning import probes

    key = f"meta skeleton {config.get('model_type')} experts={expert_count(config)} layers={layers}"
    return probes.rate(key, _skeleton_timer(config_with_layers(config, layers)))


def _skeleton_timer(cut: dict):
    """A function timing `model_linears(cut)` and returning calls/s; its first call warms up untimed (the first
    skeleton imports transformers and accelerate: seconds that a build's earlier stages already paid)."""
    warm: list[bool] = []

    def run_once() -> float:
        from llmc.planning import probes

        if not warm:
            model_linears(cut)
            warm.append(True)
        return probes.sustained_rate(1.0, lambda: model_linears(cut))

    return run_once


def check_seconds(config: dict) -> float:
    """Seconds `check_export` takes for the model of `config`: the probed skeleton of 1 layer, plus each further
    layer at the probed difference between CHECK_PROBE_LAYERS layers and 1."""
    from llmc.planning.target import per_layer_host_seconds

    return per_layer_host_seconds(skeleton_rate, config, CHECK_PROBE_LAYERS)


def stored_tensor_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names.update(h.keys())
    return names


def mismatches(quantization_config: dict, linears: Iterable[str], stored: set[str]) -> list[str]:
    """One line per Linear the config misdescribes (empty: it describes them all); a config in no claim language
    this module reads: empty."""
    reader = CLAIMS.get(quantization_config.get("quant_method"))
    if reader is None:
        return []
    claim = reader(quantization_config)
    out = []
    for name in linears:
        c = claim(name)
        held = sorted(s for s in QUANTIZED_SUFFIXES if f"{name}.{s}" in stored)
        if c is UNLISTED:
            out.append(f"{name}: neither targeted by a config group nor in ignore")
        elif c is None and held:
            out.append(f"{name}: the config leaves it unquantized but the files hold {', '.join(held)}")
        elif c is not None:
            missing = [" or ".join(f"{name}.{s}" for s in alts) for alts in c
                       if not any(f"{name}.{s}" in stored for s in alts)]
            if missing:
                out.append(f"{name}: the config quantizes it but the files lack {', '.join(missing)}")
    return out


def check_export(folder: Path, model_config: dict) -> None:
    """ConfigMismatch naming every Linear that `folder`'s config.json misdescribes (`model_config`: the source
    model's config, which the Linears are read from); nothing for an artifact without a quantization_config."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return
    q = json.loads(config_file.read_text()).get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") not in CLAIMS:
        return
    found = mismatches(q, model_linears(model_config), stored_tensor_names(folder))
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise ConfigMismatch(f"the {q['quant_method']} export in {folder} has a quantization_config that does not "
                             f"describe its tensors (a bug in llmc; the export is not recorded): {shown}")
