"""gpt-oss as OpenAI ships it (its MXFP4 original's layout), written from llmc's canonical form: what vLLM's gpt-oss
loader reads with `quantization_config.quant_method: mxfp4` (issue 45).

Per MoE layer L, E experts, hidden H, intermediate I (vllm-project/vllm: vllm/model_executor/models/gpt_oss.py,
`GptOssModel._load_weights_mxfp4`, read at a6b6cfa; the parameters are `Mxfp4MoEMethod.create_weights`' in
vllm/model_executor/layers/quantization/mxfp4.py, read at afdb4a4):

  model.layers.L.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]  E2M1 codes two a byte (w13_weight)
  model.layers.L.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]      E8M0 exponents (w13_weight_scale)
  model.layers.L.mlp.experts.gate_up_proj_bias          [E, 2I]            (w13_bias)
  model.layers.L.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]   (w2_weight)
  model.layers.L.mlp.experts.down_proj_scales     uint8 [E, H, I/32]       (w2_weight_scale)
  model.layers.L.mlp.experts.down_proj_bias             [E, H]             (w2_bias)

gate and up rows interleaved (row 2i gate i, row 2i + 1 up i): llmc's stream splits the fused tensor by even / odd
rows (`llmc.model.families`' gpt_oss row, `gate_up: interleaved`), so re-fusing puts them back where they were.
Every other tensor (attention, sinks, router, embeddings, head, norms) is written as the canonical form holds it
(the model's dtype, unquantized), and config.json gets OpenAI's `quantization_config`.

The format applies only where nothing is rounded: every routed expert's codes are the source's MXFP4 codes kept by
the pass-through (llmc.quant.mxfp4_source; scheme mxfp4 g32, weight-only) and nothing else is quantized
(`check_model`); the exporter checks again that every expert Linear is MXFP4 g32 and that no other Linear is
quantized."""

from __future__ import annotations

from pathlib import Path

import torch

from llmc.errors import IncompatibleTargetError
from llmc.formats.base import RuntimeTarget, architectures, read_json
from llmc.formats.gpt_oss_layout import (EXPERT, FAMILY, GptOssForVllm, attention_linears, experts_by_block,
                                         interleave, write_artifact)
from llmc.formats.registry import register_format
from llmc.quant.canonical import QuantizedModel, module_matches
from llmc.quant.microscaling import pack_e2m1
from llmc.quant.spec import Scheme

MX_BLOCK = 32  # MXFP4: one E8M0 exponent per 32 inputs, 16 bytes of codes
# OpenAI's config.json for gpt-oss-20b / -120b (vLLM's Mxfp4Config.from_config ignores it; transformers reads it)
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
# vLLM's Mxfp4Config.get_min_capability() is 80 (Marlin below sm90, Triton / FlashInfer from sm90), and
# Mxfp4MoEMethod asserts a backend, which get_mxfp4_backend finds on CUDA, XPU and ROCm only: no CPU
MIN_ARCH = "sm80"
MIN_ARCH_SOURCE = ("vllm-project/vllm: vllm/model_executor/layers/quantization/mxfp4.py (Mxfp4Config."
                   "get_min_capability: 80; get_mxfp4_backend: Marlin below sm90, none on CPU), read at afdb4a4")
# why anything else is refused: compressed-tensors' per-expert names are what llmc writes otherwise, and vLLM's
# gpt-oss loader skips them (llmc.runtimes.vllm._GPT_OSS_VLLM says where that was read)
LOADER = ("vLLM's gpt-oss loader reads its experts only as fused 3-D tensors (GptOssModel._load_weights_mxfp4 / "
          "_load_weights_other, vllm/model_executor/models/gpt_oss.py at a6b6cfa), which llmc writes only as gpt-oss's "
          "MXFP4 original: the source's expert codes passed through, nothing else quantized")
FIX = ("build from gpt-oss's MXFP4 original (quantization_config.quant_method mxfp4, as OpenAI ships it) with "
       "quantization.weights {format: mxfp4, strategy: group, group_size: 32}, no activations or kv_cache, algorithm "
       "rtn, and ignore: [lm_head, 're:.*self_attn.*']; for any other scheme use llama.cpp")


def _refuse(what: str) -> IncompatibleTargetError:
    return IncompatibleTargetError(f"{LOADER}; {what}", fix=FIX)


def check_pass_through(scheme: Scheme, config: dict, source_method: str | None) -> None:
    """IncompatibleTargetError unless `scheme` on a model of `config` whose source is quantized by `source_method`
    (its quantization_config's quant_method) leaves the source's MXFP4 experts as they are and quantizes nothing
    else (what the fused original layout holds)."""
    if config.get("model_type") != FAMILY:
        raise _refuse(f"this model's model_type is {config.get('model_type')!r}")
    if source_method != "mxfp4":
        raise _refuse(f"this source's quantization_config is {source_method or 'absent'}, not mxfp4 (its experts "
                      "would be rounded anew)")
    if scheme.mixed:
        raise _refuse("this recipe's scheme is mixed (quantization.groups)")
    w = scheme.weights
    if not (w.format == "mxfp4" and w.strategy == "group" and w.group_size == MX_BLOCK):
        raise _refuse(f"this scheme's weights are {w.describe()}, not the source's MXFP4 g32")
    if scheme.activations is not None or scheme.kv_cache is not None:
        raise _refuse("this scheme also quantizes activations or the KV cache, which the layout cannot hold")
    if scheme.algorithm != "rtn":
        raise _refuse(f"algorithm {scheme.algorithm} would change the experts' weights, so their codes would not be "
                      "the source's")
    quantized = [n for n in [*attention_linears(config), "lm_head"] if not module_matches(n, scheme.ignore)]
    if quantized:
        raise _refuse(f"this scheme quantizes {', '.join(quantized[:4])}"
                      + (f" and {len(quantized) - 4} more" if len(quantized) > 4 else "")
                      + ", which the original keeps in bf16")


def _fused(tensors: dict[str, torch.Tensor], qm: QuantizedModel) -> dict[str, torch.Tensor]:
    """One canonical file's tensors with its layers' per-expert MXFP4 Linears re-fused into OpenAI's tensors."""
    out = dict(tensors)
    for block, by_expert in experts_by_block(tensors, _refuse).items():
        n = len(by_expert)
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("gu_codes", "gu_scales", "gu_bias", "d_codes",
                                                                  "d_scales", "d_bias")}
        for e in range(n):
            names = by_expert[e]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = names[proj]
                spec = qm.scheme_of(name).weights if name in qm.quantized_modules else None
                if spec is None or spec.format != "mxfp4" or spec.group_size != MX_BLOCK:
                    raise _refuse(f"{name} is {'not quantized' if spec is None else spec.describe()} in the "
                                  "quantized form")
            gate, up, down = (names[p] for p in ("gate_proj", "up_proj", "down_proj"))
            # rows interleaved as the original held them: row 2i gate i, row 2i + 1 up i (stack, then flatten)
            parts["gu_codes"].append(interleave(out.pop(f"{gate}.weight"), out.pop(f"{up}.weight")))
            parts["gu_scales"].append(interleave(out.pop(f"{gate}.weight_scale"), out.pop(f"{up}.weight_scale")))
            parts["gu_bias"].append(interleave(out.pop(f"{gate}.bias"), out.pop(f"{up}.bias")))
            parts["d_codes"].append(out.pop(f"{down}.weight"))
            parts["d_scales"].append(out.pop(f"{down}.weight_scale"))
            parts["d_bias"].append(out.pop(f"{down}.bias"))
        for prefix, codes, scales, bias in (("gate_up_proj", "gu_codes", "gu_scales", "gu_bias"),
                                            ("down_proj", "d_codes", "d_scales", "d_bias")):
            stacked = torch.stack(parts[codes])  # [E, rows, cols] unpacked E2M1 codes
            rows, cols = stacked.shape[1:]
            out[f"{block}.{prefix}_blocks"] = pack_e2m1(stacked).reshape(n, rows, cols // MX_BLOCK, MX_BLOCK // 2)
            out[f"{block}.{prefix}_scales"] = torch.stack(parts[scales]).contiguous()
            out[f"{block}.{prefix}_bias"] = torch.stack(parts[bias]).contiguous()
    return out


def export_gpt_oss_mxfp4(qm: QuantizedModel, out: Path, *, serve_args: dict | None = None) -> list[Path]:
    """Write config.json (OpenAI's quantization_config), the safetensors shards in OpenAI's layout, the tokenizer
    files and the runtime arguments."""
    config = qm.config
    # the canonical form's config is the decoded model's; its record names the source format it was decoded from
    decoded_from = str((qm.meta.get("source") or {}).get("decoded_from") or "")
    check_pass_through(qm.scheme, config, "mxfp4" if decoded_from.startswith("MXFP4") else decoded_from or None)
    others = [n for n in qm.quantized_modules if not EXPERT.match(n)]
    if others:  # the plan refused such a scheme; a canonical form that still has them is not this format's
        raise _refuse(f"the quantized form quantizes {', '.join(others[:4])}, which are not routed experts")
    return write_artifact(qm, out, lambda t: _fused(t, qm),
                          {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}, serve_args)


@register_format
class GptOssMxfp4(GptOssForVllm):
    name = "gpt-oss-mxfp4"
    read_by = ("torch",)  # llmc's MXFP4 source decoder reads it back as it reads OpenAI's original
    families_source = "OpenAI's gpt-oss checkpoint layout, as vLLM's gpt_oss.py loads it with quant_method mxfp4"
    proof = ("the experts' blocks and scales byte-identical to the MXFP4 original's, read back by llmc's MXFP4 "
             "source decoder and by transformers' Mxfp4 dequantization (tests/unit/test_gpt_oss_mxfp4.py)")
    unevaluated = "no engine here loads gpt-oss's MXFP4 layout besides llmc's torch engine"

    quant_method = "mxfp4"
    min_arch, min_arch_source = MIN_ARCH, MIN_ARCH_SOURCE
    arch_reason = f"vLLM's MXFP4 MoE method needs {MIN_ARCH}+ and no CPU build has one"
    export = staticmethod(export_gpt_oss_mxfp4)

    def check_scheme(self, scheme: Scheme) -> None:
        if scheme.mixed or scheme.weights.format != "mxfp4" or scheme.activations is not None:
            raise IncompatibleTargetError(f"{LOADER}; this scheme is {scheme.name}", fix=FIX)

    def check_model(self, target: RuntimeTarget, scheme: Scheme, config: dict) -> None:
        """What only the model and the scheme together decide: the source is gpt-oss's MXFP4 original and the scheme
        passes its experts through and quantizes nothing else; the GPU arch vLLM's MXFP4 MoE method needs."""
        check_pass_through(scheme, config, (config.get("quantization_config") or {}).get("quant_method"))
        self.check_arch(target)

    def describe(self, path: Path) -> str:
        config = read_json(Path(path) / "config.json") or {}
        q = config.get("quantization_config") or {}
        return "\n".join([
            f"gpt-oss MXFP4 checkpoint (OpenAI's layout) at {path} ({architectures(config)})",
            f"  routed experts: MXFP4 blocks + E8M0 scales, fused per layer; modules_to_not_convert "
            f"{q.get('modules_to_not_convert')}",
            "  accepted by: vllm (" + MIN_ARCH + "+)",
        ])
