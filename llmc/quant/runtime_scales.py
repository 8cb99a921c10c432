"""Scales the serving runtimes' fused kernels hold one of, where a per-Linear canonical form would hold several
(issue 45): written in the canonical form as the runtime will compute with them, so that what llmc evaluates is
what vLLM / SGLang serve.

Read from the runtimes' own sources (vLLM `compressed_tensors_moe.py` CompressedTensorsW8A8Fp8MoEMethod and
`fp8_utils.process_fp8_{input,weight}_tensor_strategy_moe`; `w8a8_utils.requantize_with_max_scale` for dense fused
Linears; SGLang's `compressed_tensors_moe.py` CompressedTensorsW8A8Fp8MoEMethod does the same, and so does its
successor `schemes/compressed_tensors_w8a8_fp8_moe.py` CompressedTensorsW8A8Fp8MoE, read at 02d5e1b5, whose layout
rule is `llmc.runtimes.vllm._SGLANG_MOE_FP8_LAYOUTS`), as data here:

- `MOE_ONE_INPUT_SCALE`: a fused-MoE layer with FP8 static per-tensor activations takes ONE input scale for every
  expert's gate/up (w13) and ONE for every expert's down (w2): the max over the layer's experts. Shared experts are
  ordinary Linears there (not in the fused kernel) and keep their own.
- `FUSED_FP8_TENSOR_WEIGHTS`: FP8 weights with one scale per tensor, on siblings the runtime runs as one GEMM
  (q/k/v and gate/up: `llmc.quant.microscaling.fused_groups`; an expert's gate/up as w13), get one scale: the max
  of theirs, each member's codes dequantized (E4M3 codes to float16, times its scale) and quantized again with the
  max (float32 times 1/max, saturated at 448, rounded to nearest even).

Static input scales of dense fused siblings need nothing: they read the same input, so their observed ranges and
scales are equal already (vLLM takes their max). Per-channel FP8 weights are not requantized by either runtime.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from llmc.quant.spec import FP8_E4M3_MAX, Scheme, TensorSpec

# the rules, as data: (what the runtime fuses, what it keeps one of, how) - printed by `llmc plan`
MOE_ONE_INPUT_SCALE = ("vLLM's and SGLang's fused-MoE FP8 kernels take one static input scale per layer for "
                       "gate/up and one for down: the max over the experts")
FUSED_FP8_TENSOR_WEIGHTS = ("vLLM and SGLang run q/k/v and gate/up (an expert's w13) as one GEMM with one "
                            "per-tensor FP8 weight scale: the max, the other members' codes requantized to it")

_EXPERT = re.compile(r"^(?P<block>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)\.input_scale$")
# the gate and up projections of an expert, fused as w13 (names as llmc.quant.microscaling.FUSED_PROJECTIONS)
_W13 = {"gate_proj", "up_proj", "w1", "w3"}


def fp8_static_tensor_acts(spec: TensorSpec | None) -> bool:
    return spec is not None and spec.format == "fp8_e4m3" and spec.strategy == "tensor" and not spec.dynamic


def fp8_tensor_weights(spec: TensorSpec | None) -> bool:
    return spec is not None and spec.format == "fp8_e4m3" and spec.strategy == "tensor"


def requantize_fp8(codes: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 `codes` under `scale` quantized again under `new_scale`, as the runtime does it on load: dequantized in
    float16 (the codes as float16 times the float32 scalar, rounded to float16), then times the float32 reciprocal
    of `new_scale`, saturated at ±448 and rounded to nearest even."""
    dq = codes.to(torch.float16) * scale.reshape(()).float()  # a 0-dim float32 scalar: the product stays float16
    inv = torch.reciprocal(new_scale.reshape(()).float())
    return (dq.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def unify_fused_weight_scales(tensors: dict[str, torch.Tensor], specs: Mapping[str, TensorSpec]) -> list[str]:
    """In place: each fused sibling group (`fused_groups`) of Linears with FP8 per-tensor weights gets the max of
    their scales, its members' codes requantized to it (`requantize_fp8`). `specs`: each quantized Linear's weight
    spec. Returns the groups changed, by their first member's name."""
    from llmc.quant.microscaling import fused_groups  # lazy, as llmc.quant.groups imports it

    names = [n for n, s in specs.items() if fp8_tensor_weights(s) and f"{n}.weight_scale" in tensors]
    changed = []
    for group in fused_groups(names):
        if len(group) < 2:
            continue
        scales = [tensors[f"{n}.weight_scale"].float().reshape(()) for n in group]
        top = torch.stack(scales).max()
        for n, s in zip(group, scales):
            tensors[f"{n}.weight"] = requantize_fp8(tensors[f"{n}.weight"], s, top)
            tensors[f"{n}.weight_scale"] = top.reshape(tensors[f"{n}.weight_scale"].shape).clone()
        changed.append(group[0])
    return changed


def unify_expert_input_scales(tensors: dict[str, torch.Tensor], specs: Mapping[str, TensorSpec | None]
                              ) -> dict[str, torch.Tensor]:
    """The routed experts' FP8 static input scales, one per MoE block and fused operand (w13: gate/up, w2: down): the
    max over the block's experts, as vLLM / SGLang load them. `tensors`: at least every expert's `<...>.input_scale`
    of the layer; `specs`: each quantized Linear's activation spec. Returns the replaced tensors (a copy each:
    safetensors stores no aliases); `tensors` is left as it is."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key in tensors:
        m = _EXPERT.match(key)
        if m is None or not fp8_static_tensor_acts(specs.get(key[: -len(".input_scale")])):
            continue
        operand = "w13" if m["proj"] in _W13 else "w2"
        groups.setdefault((m["block"], operand), []).append(key)
    out = {}
    for keys in groups.values():
        top = torch.stack([tensors[k].float().reshape(()) for k in keys]).max()
        for k in keys:
            out[k] = top.to(tensors[k].dtype).reshape(tensors[k].shape).clone()
    return out


def rules_applied(scheme: Scheme, moe: bool) -> list[str]:
    """Which of the rules the quantize step applies to `scheme` on a model with (`moe`) or without routed experts:
    what its stage key names, so a canonical form written before the rules is not read as one written by them."""
    members = scheme.members().values()
    rules = []
    if moe and any(fp8_static_tensor_acts(m.activations) for m in members):
        rules.append("moe_one_input_scale")
    if any(fp8_tensor_weights(m.weights) for m in members):
        rules.append("fused_fp8_tensor_weights")
    return rules


def plan_notes(schemes: Mapping[str, Scheme], linears: Iterable[str], moe: bool) -> list[str]:
    """`llmc plan`'s lines for the scales the quantize step unifies (which, and why), per variant."""
    from llmc.quant.microscaling import fused_groups

    fused = any(len(g) > 1 for g in fused_groups(sorted(linears)))
    notes = []
    for variant, scheme in schemes.items():
        rules = rules_applied(scheme, moe)
        where = f"{variant}: " if variant else ""
        if "moe_one_input_scale" in rules:
            notes.append(f"{where}the routed experts' FP8 static input scales are written one per MoE layer for "
                         f"gate/up and one for down, the max over the layer's experts, for every target: "
                         f"{MOE_ONE_INPUT_SCALE} (docs/models.md, \"One input scale per MoE layer\")")
        if fused and "fused_fp8_tensor_weights" in rules:
            notes.append(f"{where}per-tensor FP8 weight scales of fused siblings (q/k/v, gate/up, each expert's "
                         f"gate/up) are unified to their max, for every target: {FUSED_FP8_TENSOR_WEIGHTS}")
    return notes
