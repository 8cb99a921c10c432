"""Export INT4 weight-only schemes as an AutoAWQ "GEMM" checkpoint (quant_method "awq", version "gemm").

The layout LMDeploy's TurboMind (`--model-format awq`), vLLM's AWQ/AWQ-Marlin kernels and
transformers' AWQ integration read. For each quantized Linear `m` (4-bit, 8 codes per int32):

    m.qweight   int32 [in, out // 8]        unsigned codes, packed along the *output* dim in the
                                            interleaved order 0 2 4 6 1 3 5 7 (nibble k holds output
                                            column 8j + AWQ_ORDER[k]), as AutoAWQ's GEMM kernel expects
    m.qzeros    int32 [groups, out // 8]    unsigned zero points, packed the same way (no offset)
    m.scales    float16 [groups, out]
    m.bias      unchanged

    weight[o, i] = scales[g, o] * (q[i, o] - zeros[g, o]),  g = i // group_size

Canonical signed codes c in [-8, 8) with zero point z (0 when symmetric) map exactly to q = c + 8,
zero z + 8, so symmetric schemes are stored with zero_point true and every zero 8. Only the scales are
rounded (float32 -> float16). AWQ checkpoints are grouped: per-channel INT4 and INT8 are refused
(use the GPTQ format for those).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmc.formats.base import architectures, quantization_config, read_json, serve_line
from llmc.formats.registry import register_format
from llmc.formats.gptq_format import RepackedCheckpoint
from llmc.formats import files
from llmc.formats.files import write_repacked_checkpoint
from llmc.formats.gptq_format import check_scheme as check_integer_weight_only
from llmc.errors import IncompatibleTargetError
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) stored in nibble k
OUTPUT_DIMS = {"qweight": 1, "qzeros": 1, "scales": 1}  # the dimension each stored tensor spans the output rows along


def check_scheme(scheme: Scheme, target: str = "AWQ format") -> int:
    """The scheme's group size, or IncompatibleTargetError naming what the format cannot hold."""
    bits = check_integer_weight_only(scheme, target)
    w = scheme.weights
    if bits != 4 or w.strategy != "group":
        raise IncompatibleTargetError(
            f"{target} holds 4-bit group-quantized weights; this scheme is {w.format} per {w.strategy}",
            fix="use int4 weights with strategy group (e.g. group_size 128), or a GPTQ-format target for INT8")
    return w.group_size


# Bit offset of output column c (within 8) in its int32 word: nibble k holds column AWQ_ORDER[k].
_SHIFT = tuple(4 * AWQ_ORDER.index(c) for c in range(8))


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[n, m] unsigned 4-bit codes -> int32 [n, m // 8], nibble k = column 8j + AWQ_ORDER[k]."""
    n, m = values.shape
    if m % 8:
        raise ValueError(f"{m} columns do not pack into int32 words of 8 codes")
    # int32 shifts wrap into the sign bit, which is the word's bit pattern; one strided shift-or per column is
    # ~6x faster than gathering the order and summing int64 nibbles (and a quarter of the temporaries)
    v = values.to(torch.int32).reshape(n, m // 8, 8)
    words = v[:, :, 0] << _SHIFT[0]
    for c in range(1, 8):
        words |= v[:, :, c] << _SHIFT[c]
    return words


def unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_columns: int32 [n, m / 8] -> int32 [n, m]."""
    out = torch.empty(*words.shape, 8, dtype=torch.int32, device=words.device)
    for c in range(8):
        out[:, :, c] = (words >> _SHIFT[c]) & 0xF  # arithmetic shift: the mask drops the sign's copies
    return out.reshape(words.shape[0], -1)


def to_awq(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Canonical [out, in] int4 codes + [out, groups] scales (+ zero points) -> qweight, qzeros, scales."""
    out_f, _ = codes.shape
    scale = scale.float().reshape(out_f, -1)
    zero = torch.zeros_like(scale, dtype=torch.int64) if zero_point is None else zero_point.to(torch.int64).reshape(scale.shape)
    return {
        "qweight": pack_columns((codes.to(torch.int16) + 8).t().contiguous()),  # int16: a quarter of int64's traffic
        "qzeros": pack_columns((zero + 8).t().contiguous()),
        "scales": scale.t().contiguous().to(torch.float16),
    }


def dequantize_awq(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """Independent decoding of the stored tensors (what an AWQ GEMM kernel computes): float32 [out, in], a view."""
    q = unpack_columns(t["qweight"])  # [in, out]
    groups, out_f = t["scales"].shape
    z = unpack_columns(t["qzeros"])  # [groups, out]
    w = (q.view(groups, group_size, out_f) - z[:, None, :]).float() * t["scales"].float()[:, None, :]
    return w.view(-1, out_f).t()  # a view: the caller compares it, a copy would cost as much as the decoding


def awq_quantization_config(scheme: Scheme, group_size: int, ignored: list[str]) -> dict:
    return {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "modules_to_not_convert": ignored or None,
    }


def serve_args(*, tensor_parallel: int = 1) -> dict:
    """How LMDeploy serves the artifact (TurboMind reads the AWQ layout directly)."""
    args = {"backend": "turbomind", "model_format": "awq", "tp": tensor_parallel}
    return {"lmdeploy": args, "command": "lmdeploy serve api_server <artifact> " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in args.items())}


def export_awq(qm: QuantizedModel, out: Path, *, serve: dict | None = None) -> dict:
    """Write config.json (with quantization_config), AWQ GEMM safetensors, the tokenizer and, when
    given, the runtime arguments (llmc-serve.json).

    Returns a summary with the largest relative weight error the float16 scales introduced."""
    group_size = check_scheme(qm.scheme)
    written, worst = write_repacked_checkpoint(
        qm, out, repack=to_awq, decode=lambda t: dequantize_awq(t, group_size), output_dims=OUTPUT_DIMS,
        # substrings, as vLLM and transformers match them: the scheme's ignore and every Linear left unquantized
        quantization_config=awq_quantization_config(qm.scheme, group_size, list(qm.scheme.ignore) + [
            n for n in qm.unquantized_linears if not any(s in n for s in qm.scheme.ignore)]),
        dtype="float16",  # AWQ kernels compute in half precision
        serve=serve)
    return {"files": [p.name for p in written], "group_size": group_size,
            "max_relative_weight_error_fp16_scales": worst}


def repack_rate(weights: TensorSpec) -> float:
    """Quantized weight elements/s `export_awq` repacks into the AWQ GEMM layout and checks (llmc.formats.files.
    repack_rate with `to_awq` / `dequantize_awq`)."""
    group_size = weights.group_size
    return files.repack_rate("awq", weights, repack=to_awq, decode=lambda t: dequantize_awq(t, group_size),
                             output_dims=OUTPUT_DIMS)


@register_format
class AwqCheckpoint(RepackedCheckpoint):
    name = "awq"
    families_source = "AutoAWQ-format loaders verified against here: Llama-family layouts"
    proof = ("loaded and scored here by GPTQModel's CPU AWQ kernels (engine gptqmodel; docs/formats-and-runtimes.md, issue 20); "
             "LMDeploy/vLLM's AWQ kernels need a GPU. AutoAWQ GEMM layout (nibble order "
             "0 2 4 6 1 3 5 7, unsigned zeros, fp16 scales) decodes to the canonical weights exactly, and "
             "onnxruntime-genai's own AWQ loader reads llmc's checkpoint back to the same weights (default test run)")

    def check_scheme(self, scheme) -> None:
        check_scheme(scheme)

    def serve(self, tensor_parallel: int) -> dict:
        return serve_args(tensor_parallel=tensor_parallel)

    def repack_rate(self, weights: TensorSpec) -> float:
        return repack_rate(weights)

    def export(self, quantized: QuantizedModel, out: Path, serve: dict) -> None:
        export_awq(quantized, out, serve=serve)

    def recognizes(self, path: Path) -> bool:
        return (quantization_config(path) or {}).get("quant_method") == "awq"

    def describe(self, path: Path) -> str:
        config = read_json(path / "config.json") or {}
        q = config["quantization_config"]
        arch = architectures(config)
        return "\n".join([
            f"AWQ checkpoint ({q.get('version', 'gemm').upper()} layout) at {path} ({arch})",
            f"  {q.get('bits')}-bit, group {q.get('group_size')}, zero point {q.get('zero_point')}",
            "  accepted by: LMDeploy TurboMind (--model-format awq), vLLM (awq/awq_marlin), transformers + AutoAWQ/"
            "GPTQModel, onnxruntime-genai's model builder; all need an NVIDIA GPU except the builder",
            *serve_line(path),
        ])
