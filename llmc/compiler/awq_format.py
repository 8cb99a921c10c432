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

from llmc.compiler.files import write_repacked_checkpoint
from llmc.compiler.gptq_format import check_scheme as check_integer_weight_only
from llmc.errors import IncompatibleTargetError
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) stored in nibble k


def check_scheme(scheme: Scheme, target: str = "AWQ format") -> int:
    """The scheme's group size, or IncompatibleTargetError naming what the format cannot hold."""
    bits = check_integer_weight_only(scheme, target)
    w = scheme.weights
    if bits != 4 or w.strategy != "group":
        raise IncompatibleTargetError(
            f"{target} holds 4-bit group-quantized weights; this scheme is {w.format} per {w.strategy}",
            fix="use int4 weights with strategy group (e.g. group_size 128), or a GPTQ-format target for INT8")
    return w.group_size


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[n, m] unsigned 4-bit codes -> int32 [n, m // 8], nibble k = column 8j + AWQ_ORDER[k]."""
    n, m = values.shape
    if m % 8:
        raise ValueError(f"{m} columns do not pack into int32 words of 8 codes")
    v = values.to(torch.int64).reshape(n, m // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view(1, 1, 8)
    words = (v << shifts).sum(dim=2)  # disjoint nibbles: sum == bitwise or
    return (words - ((words >> 31) << 32)).to(torch.int32)


def unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_columns: int32 [n, m / 8] -> int64 [n, m]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view(1, 1, 8)
    nibbles = (w.unsqueeze(-1) >> shifts) & 0xF  # [n, m/8, 8] in storage order
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], -1)


def to_awq(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Canonical [out, in] int4 codes + [out, groups] scales (+ zero points) -> qweight, qzeros, scales."""
    out_f, _ = codes.shape
    scale = scale.float().reshape(out_f, -1)
    zero = torch.zeros_like(scale, dtype=torch.int64) if zero_point is None else zero_point.to(torch.int64).reshape(scale.shape)
    return {
        "qweight": pack_columns((codes.to(torch.int64) + 8).t().contiguous()),
        "qzeros": pack_columns((zero + 8).t().contiguous()),
        "scales": scale.t().contiguous().to(torch.float16),
    }


def dequantize_awq(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """Independent decoding of the stored tensors (what an AWQ GEMM kernel computes), float32 [out, in]."""
    q = unpack_columns(t["qweight"])  # [in, out]
    z = unpack_columns(t["qzeros"]).repeat_interleave(group_size, dim=0)  # [in, out]
    s = t["scales"].float().repeat_interleave(group_size, dim=0)
    return (s * (q - z).float()).t().contiguous()


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
        qm, out, repack=to_awq, decode=lambda t: dequantize_awq(t, group_size),
        quantization_config=awq_quantization_config(qm.scheme, group_size, list(qm.scheme.ignore)),
        dtype="float16",  # AWQ kernels compute in half precision
        serve=serve)
    return {"files": [p.name for p in written], "group_size": group_size,
            "max_relative_weight_error_fp16_scales": worst}
