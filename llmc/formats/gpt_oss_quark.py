"""gpt-oss quantized to FP8 (W8A8), written from llmc's canonical form in AMD Quark's layout: what vLLM's gpt-oss
loader reads with `quantization_config.quant_method: quark` (issue 45; the vLLM files read, and at which commits, are
in docs/models.md, "vLLM with FP8 experts, in AMD Quark's layout").

What the loader requires, and so what this writer holds to: a name with two numbers (layer, expert) is one expert of
the fused MoE layer; gate and up rows interleaved in `gate_up_proj` (gate at even rows, up at odd: swigluoai reads
them so); ONE per-tensor weight scale for the fused gate/up pair (the loader keeps one per expert), or one per row;
every expert `input_scale` 0-dim (copied into a 0-dim slot). The MoE method takes weights per-tensor with static or
dynamic per-tensor activations, or weights per-channel with dynamic per-token ones. The router and lm_head are built
without the quantization config (they stay unquantized whatever it says). Below compute capability 89 the experts run
Marlin, which does not take gpt-oss's swigluoai activation: sm89 is the floor (the attention scheme's too).

Per MoE layer L, expert E (hidden H, intermediate I):

  model.layers.L.mlp.experts.E.gate_up_proj.weight        float8_e4m3fn [2I, H]  gate row i at 2i, up row i at 2i+1
  model.layers.L.mlp.experts.E.gate_up_proj.weight_scale  float32 []  (per-tensor) or [2I] (per-channel, interleaved)
  model.layers.L.mlp.experts.E.gate_up_proj.input_scale   float32 []  (static activations only)
  model.layers.L.mlp.experts.E.gate_up_proj.bias          [2I] interleaved (the model's dtype)
  model.layers.L.mlp.experts.E.down_proj.{weight [H, I], weight_scale [] or [H], input_scale [], bias [H]}

llmc's quantize stage already gives an expert's gate and up one per-tensor scale (llmc.quant.runtime_scales, for every
target: vLLM and SGLang fuse them anyway), so the canonical form holds equal scales and this writer writes that one;
it refuses a canonical form where they differ rather than requantize codes llmc has evaluated. Attention Linears are
quantized with the same scheme (Quark's W8A8 FP8: static per-tensor or dynamic per-token activations) or all left in
the model's dtype (named in `exclude`); every other tensor is written as the canonical form holds it."""

from __future__ import annotations

from pathlib import Path

import torch

from llmc.errors import IncompatibleTargetError
from llmc.formats.base import RuntimeTarget, architectures, read_json
from llmc.formats.gpt_oss_layout import (EXPERT, FAMILY, GptOssForVllm, attention_linears, experts_by_block,
                                         interleave, write_artifact)
from llmc.formats.registry import register_format
from llmc.quant.canonical import QuantizedModel, module_matches
from llmc.quant.spec import Scheme

# (weight strategy, activation strategy, activations dynamic) that QuarkW8A8Fp8MoEMethod loads (quark_moe.py at
# 004b19d): per-tensor weights with per-tensor activations, static or dynamic; per-channel weights with dynamic
# per-token activations
MOE_LAYOUTS = frozenset({("tensor", "tensor", False), ("tensor", "tensor", True), ("channel", "token", True)})
# ... and those its dense QuarkW8A8Fp8 loads for quantized attention (schemes/quark_w8a8_fp8.py at 037cffe)
ATTENTION_LAYOUTS = frozenset({("tensor", "tensor", False), ("channel", "token", True)})
MIN_ARCH = "sm89"
MIN_ARCH_SOURCE = ("vllm-project/vllm: vllm/model_executor/layers/quantization/quark/quark_moe.py "
                   "(QuarkW8A8Fp8MoEMethod: Marlin below capability 89, whose apply asserts SILU, and gpt-oss's "
                   "experts use swigluoai; read at 004b19d) and quark/schemes/quark_w8a8_fp8.py (QuarkW8A8Fp8."
                   "get_min_capability: 89; read at 037cffe)")
LOADER = ("vLLM's gpt-oss loader reads FP8 experts only in AMD Quark's per-expert fused layout "
          "(quant_method quark: GptOssModel._load_weights_quark, vllm/model_executor/models/gpt_oss.py; "
          "QuarkW8A8Fp8MoEMethod, quark/quark_moe.py at 004b19d)")
FIX = ("quantize gpt-oss for vllm with quantization.weights {format: fp8_e4m3, strategy: tensor} and activations "
       "{format: fp8_e4m3, strategy: tensor} (static or dynamic: true), or weights strategy channel with activations "
       "{format: fp8_e4m3, strategy: token, dynamic: true}; no kv_cache; lm_head in ignore; attention quantized with "
       "the same scheme (not dynamic per-tensor) or all in ignore ('re:.*self_attn.*'); "
       "for any other scheme use llama.cpp")


def _refuse(what: str) -> IncompatibleTargetError:
    return IncompatibleTargetError(f"{LOADER}; {what}", fix=FIX)


def _layout(scheme: Scheme) -> tuple[str, str, bool] | None:
    a = scheme.activations
    return None if a is None else (scheme.weights.strategy, a.strategy, a.dynamic)


def check_fp8_scheme(scheme: Scheme) -> None:
    """IncompatibleTargetError unless `scheme` is one FP8 W8A8 scheme QuarkW8A8Fp8MoEMethod loads, without a KV-cache
    scheme (what the format can hold whatever the model)."""
    if scheme.mixed:
        raise _refuse("this recipe's scheme is mixed (quantization.groups); the layout holds one global scheme")
    w, a = scheme.weights, scheme.activations
    if w.format != "fp8_e4m3" or a is None or a.format != "fp8_e4m3":
        raise _refuse(f"this scheme is {scheme.name}, not FP8 W8A8 (Quark's FP8 MoE method needs FP8 weights and "
                      "FP8 activations)")
    if _layout(scheme) not in MOE_LAYOUTS:
        raise _refuse(f"QuarkW8A8Fp8MoEMethod does not load {w.strategy} weights with "
                      f"{'dynamic' if a.dynamic else 'static'} {a.strategy} activations")
    if scheme.kv_cache is not None:
        raise _refuse("this scheme also quantizes the KV cache (Quark's kv_cache_group with k/v output scales), "
                      "which this exporter does not write")


def check_quark_scheme(scheme: Scheme, config: dict) -> None:
    """IncompatibleTargetError unless `scheme` on a gpt-oss of `config` is what the layout holds: one FP8 W8A8
    scheme QuarkW8A8Fp8MoEMethod loads, lm_head unquantized, attention quantized with it (a layout QuarkW8A8Fp8
    loads) or all unquantized."""
    if config.get("model_type") != FAMILY:
        raise _refuse(f"this model's model_type is {config.get('model_type')!r}")
    check_fp8_scheme(scheme)
    if not module_matches("lm_head", scheme.ignore):
        raise _refuse("this scheme quantizes lm_head, which gpt-oss's ParallelLMHead loads unquantized")
    attention = attention_linears(config)
    quantized = [n for n in attention if not module_matches(n, scheme.ignore)]
    if quantized and len(quantized) != len(attention):
        raise _refuse(f"this scheme quantizes {len(quantized)} of the {len(attention)} attention Linears "
                      f"({quantized[0]}, ...); the exporter writes all of them FP8 or none")
    if quantized and _layout(scheme) not in ATTENTION_LAYOUTS:
        raise _refuse("quantized attention with dynamic per-tensor activations: QuarkW8A8Fp8 "
                      "(quark/schemes/quark_w8a8_fp8.py at 037cffe) registers no input scale for it and runs it as "
                      "static per-tensor")


def _qscheme(strategy: str) -> str:
    return "per_channel" if strategy in ("channel", "token") else "per_tensor"


def quark_config(scheme: Scheme, config: dict) -> dict:
    """config.json's quantization_config: one global FP8 scheme (what QuarkConfig._is_fp8_w8a8 matches), the
    unquantized Linears in `exclude` by their checkpoint names."""
    w, a = scheme.weights, scheme.activations
    weight = {"dtype": "fp8_e4m3", "qscheme": _qscheme(w.strategy), "ch_axis": 0 if w.strategy == "channel" else None,
              "is_dynamic": False, "symmetric": True, "group_size": None, "round_method": "half_even",
              "scale_type": "float"}
    inputs = {"dtype": "fp8_e4m3", "qscheme": _qscheme(a.strategy), "ch_axis": None, "is_dynamic": bool(a.dynamic),
              "symmetric": True, "group_size": None, "round_method": "half_even", "scale_type": "float"}
    layers = range(config.get("num_hidden_layers", 0))
    exclude = [n for n in attention_linears(config) if module_matches(n, scheme.ignore)]
    exclude += [f"model.layers.{i}.mlp.router" for i in layers] + ["lm_head"]
    return {"quant_method": "quark",
            "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None},
            "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": exclude,
            "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real"}}


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale as the loader copies it into an expert's 0-dim slot: 0-dim float32."""
    return t.reshape(()).float().clone()


def _scales(t: torch.Tensor, per_channel: bool) -> torch.Tensor:
    return t.reshape(-1).float().contiguous() if per_channel else _scalar(t)


def _fused(tensors: dict[str, torch.Tensor], qm: QuantizedModel) -> dict[str, torch.Tensor]:
    """One canonical file's tensors in Quark's layout: its experts' gate/up fused per expert (rows interleaved, one
    scale), per-tensor scales 0-dim, per-channel ones 1-D; every other tensor as it is."""
    out = dict(tensors)
    for block, by_expert in experts_by_block(tensors, _refuse).items():
        for e, names in enumerate(by_expert):
            gate, up, down = (names[p] for p in ("gate_proj", "up_proj", "down_proj"))
            specs = {n: qm.scheme_of(n) if n in qm.quantized_modules else None for n in (gate, up, down)}
            for n, s in specs.items():
                if s is None or s.weights.format != "fp8_e4m3" or s.activations is None:
                    raise _refuse(f"{n} is {'not quantized' if s is None else s.name} in the quantized form")
            per_channel = specs[gate].weights.strategy == "channel"
            static = not specs[gate].activations.dynamic
            p = f"{block}.{e}"
            gs, us = out.pop(f"{gate}.weight_scale"), out.pop(f"{up}.weight_scale")
            if per_channel:
                out[f"{p}.gate_up_proj.weight_scale"] = interleave(gs.reshape(-1), us.reshape(-1)).float()
            else:
                if not torch.equal(gs.float(), us.float()):
                    raise IncompatibleTargetError(
                        f"{gate} and {up} have different per-tensor FP8 scales ({gs.item()} and {us.item()}); "
                        "vLLM's Quark MoE method for gpt-oss holds one for the fused pair",
                        fix="quantize again with this llmc (its quantize stage gives fused siblings one scale: "
                            "llmc.quant.runtime_scales)")
                out[f"{p}.gate_up_proj.weight_scale"] = _scalar(gs)
            out[f"{p}.gate_up_proj.weight"] = interleave(out.pop(f"{gate}.weight"), out.pop(f"{up}.weight"))
            out[f"{p}.gate_up_proj.bias"] = interleave(out.pop(f"{gate}.bias"), out.pop(f"{up}.bias"))
            if static:
                gi, ui = out.pop(f"{gate}.input_scale"), out.pop(f"{up}.input_scale")
                if not torch.equal(gi.float(), ui.float()):  # they read the same input: one observed range
                    raise _refuse(f"{gate} and {up} have different input scales ({gi.item()} and {ui.item()})")
                out[f"{p}.gate_up_proj.input_scale"] = _scalar(gi)
                out[f"{p}.down_proj.input_scale"] = _scalar(out.pop(f"{down}.input_scale"))
            out[f"{p}.down_proj.weight"] = out.pop(f"{down}.weight")
            out[f"{p}.down_proj.weight_scale"] = _scales(out.pop(f"{down}.weight_scale"), per_channel)
            out[f"{p}.down_proj.bias"] = out.pop(f"{down}.bias")
    for name in [n for n in qm.quantized_modules if not EXPERT.match(n)]:  # attention Linears (QuarkW8A8Fp8)
        if f"{name}.weight_scale" in out:
            per_channel = qm.scheme_of(name).weights.strategy == "channel"
            out[f"{name}.weight_scale"] = _scales(out[f"{name}.weight_scale"], per_channel)
            if f"{name}.input_scale" in out:
                out[f"{name}.input_scale"] = _scalar(out[f"{name}.input_scale"])
    return out


def export_gpt_oss_quark(qm: QuantizedModel, out: Path, *, serve_args: dict | None = None) -> list[Path]:
    """Write config.json (Quark's quantization_config), the safetensors shards in Quark's gpt-oss layout, the
    tokenizer files and the runtime arguments."""
    check_quark_scheme(qm.scheme, qm.config)
    return write_artifact(qm, out, lambda t: _fused(t, qm), quark_config(qm.scheme, qm.config), serve_args)


@register_format
class GptOssQuarkFp8(GptOssForVllm):
    name = "gpt-oss-quark-fp8"
    read_by = ()  # no engine here reads Quark checkpoints (tests/unit/test_gpt_oss_quark.py decodes one itself)
    families_source = "AMD Quark's gpt-oss layout, as vLLM's gpt_oss.py loads it with quant_method quark"
    proof = ("tensor names, shapes and dtypes as vLLM's quark loader reads them; the files decoded (FP8 codes x "
             "scales, gate/up de-interleaved) and run by transformers' GptOss give llmc's torch-engine logits on the "
             "canonical form (tests/unit/test_gpt_oss_quark.py); not served by vLLM here")
    unevaluated = "no engine here loads Quark checkpoints (vLLM on a GPU does)"

    quant_method = "quark"
    min_arch, min_arch_source = MIN_ARCH, MIN_ARCH_SOURCE
    arch_reason = f"vLLM's Quark FP8 MoE method runs gpt-oss's experts on {MIN_ARCH}+ (no CPU path was read)"
    export = staticmethod(export_gpt_oss_quark)

    def check_scheme(self, scheme: Scheme) -> None:
        check_fp8_scheme(scheme)

    def check_model(self, target: RuntimeTarget, scheme: Scheme, config: dict) -> None:
        """The scheme on this gpt-oss is what the layout holds (`check_quark_scheme`); the GPU arch vLLM's Quark FP8
        MoE method runs gpt-oss's swigluoai experts on."""
        check_quark_scheme(scheme, config)
        self.check_arch(target)

    def describe(self, path: Path) -> str:
        config = read_json(Path(path) / "config.json") or {}
        g = (config.get("quantization_config") or {}).get("global_quant_config") or {}
        w, a = g.get("weight") or {}, g.get("input_tensors") or {}
        return "\n".join([
            f"gpt-oss FP8 checkpoint (AMD Quark's layout) at {path} ({architectures(config)})",
            f"  weights {w.get('dtype')} {w.get('qscheme')}, activations {a.get('dtype')} {a.get('qscheme')}"
            f"{' dynamic' if a.get('is_dynamic') else ' static'}; routed experts per expert, gate/up fused",
            "  accepted by: vllm (" + MIN_ARCH + "+)",
        ])
