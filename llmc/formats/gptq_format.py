"""Export integer weight-only schemes as a GPTQ-format checkpoint (AutoGPTQ / GPTQModel "gptq" v1).

The layout ExLlama(v2), LMDeploy's GPTQ path, transformers + GPTQModel and onnxruntime-genai's model
builder read. For each quantized Linear `m` (bits b, 32 // b codes per int32):

    m.qweight   int32 [in // (32/b), out]   unsigned codes, packed along the *input* dim, low bits first
    m.qzeros    int32 [groups, out // (32/b)] zero point - 1 (the v1 format's historical offset),
                                            packed along the output dim, masked to b bits
    m.scales    float16 [groups, out]
    m.g_idx     int32 [in]                   group of each input channel (i // group_size: no act-order
                                            permutation is needed, llmc's GPTQ stores codes in input order)
    m.bias      unchanged

    weight[o, i] = scales[g, o] * (q[i, o] - (qzeros[g, o] + 1)),  g = g_idx[i]

Canonical signed codes c in [-2^(b-1), 2^(b-1)) with zero point z (0 when symmetric) map exactly to
unsigned q = c + 2^(b-1), zero z + 2^(b-1); an unsigned zero of 0 would be stored as 2^b - 1, which GPTQ's readers
read differently (2^b: vLLM's gptq_gemm, ExLlamaV2, AutoGPTQ's cuda/triton kernels; 0: onnxruntime-genai's loader,
AutoGPTQ's cuda_old; 0 with the next column's zero off by one: GPTQModel's v1 -> v2 word add, transformers/optimum
through it), so the format asks the quantizer for zero points of at least 1 (`zero_grid = "nonzero"`: such a range
takes a one-level narrower grid, llmc.quant.numerics.qparams_from_range) and the exporter refuses any other
(`check_v1_zeros`). gptq_v2 would need no offset, but ExLlamaV2 and onnxruntime-genai's loader do not read it.
Only the scales are rounded (float32 -> float16, relative
error <= 2^-11, measured and returned). Per-channel and per-tensor scales become one group spanning the
input (group_size -1 in the config). FP8 and activation-quantized schemes are refused: the format is
weight-only integer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.formats.base import (
    ArtifactFormat,
    ExportLayout,
    ExportRequest,
    ExportWork,
    architectures,
    quantization_config,
    read_json,
    serve_line,
    target_key,
)
from llmc.formats.registry import register_format
from llmc.formats import files
from llmc.formats.files import write_repacked_checkpoint
from llmc.errors import IncompatibleTargetError
from llmc.planning.target import host_work_seconds
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec

BITS = {"int4": 4, "int8": 8}
# The dimension each stored tensor spans the output rows along (g_idx depends on the input channels only).
OUTPUT_DIMS = {"qweight": 1, "qzeros": 1, "scales": 1, "g_idx": None}


def check_scheme(scheme: Scheme, target: str = "GPTQ format") -> int:
    """Bits of the scheme's weights, or IncompatibleTargetError naming what the format cannot hold."""
    w = scheme.weights
    if w is None or w.format not in BITS:
        raise IncompatibleTargetError(
            f"{target} holds integer weights (int4/int8); this scheme's weights are {w.format if w else 'unquantized'}",
            fix="use a W4A16 or W8A16 integer scheme for this target, or a compressed-tensors / TensorRT-LLM target")
    if scheme.activations is not None:
        raise IncompatibleTargetError(
            f"{target} is weight-only; this scheme also quantizes activations ({scheme.name})",
            fix="use the weight-only variant of the scheme (e.g. W8A16 / W4A16) for this target")
    if scheme.weights.strategy == "group" and scheme.weights.group_size is None:
        raise IncompatibleTargetError(f"{target}: group strategy without a group size")
    return BITS[w.format]


def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, m] unsigned codes (< 2^bits) -> int32 [n // (32/bits), m]; row n*k + j sits at bits j*bits."""
    per = 32 // bits
    n, m = values.shape
    if n % per:
        raise ValueError(f"{n} rows do not pack into int32 words of {per} codes")
    # int32 shifts wrap into the sign bit, which is the word's bit pattern (one shift-or per code in the word: ~6x
    # faster than summing int64 fields)
    v = values.to(torch.int32).reshape(n // per, per, m)
    words = v[:, 0].clone()
    for j in range(1, per):
        words |= v[:, j] << (j * bits)
    return words


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_along_rows: int32 [n / per, m] -> int32 [n, m] unsigned codes."""
    per = 32 // bits
    codes = torch.empty(words.shape[0], per, words.shape[1], dtype=torch.int32, device=words.device)
    for j in range(per):
        codes[:, j] = (words >> (j * bits)) & ((1 << bits) - 1)  # arithmetic shift: the mask drops the sign's copies
    return codes.reshape(-1, words.shape[-1])


@dataclass
class GPTQTensors:
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


def check_v1_zeros(zero_point: torch.Tensor | None, bits: int, where: str = "a Linear") -> None:
    """IncompatibleTargetError where a canonical zero point is -2^(b-1) (unsigned 0): GPTQ v1 would store it as
    2^b - 1, which its readers read as 0, as 2^b, or as 0 with the next column's zero shifted (module docstring)."""
    if zero_point is not None and bool((zero_point.to(torch.int64) == -(1 << (bits - 1))).any()):
        raise IncompatibleTargetError(
            f"GPTQ format: {where} has a zero point of 0 (unsigned), which the v1 layout stores as {(1 << bits) - 1} "
            f"and GPTQ's readers read differently ({1 << bits} in vLLM and ExLlamaV2, 0 in onnxruntime-genai, and "
            "GPTQModel shifts the next column's zero)",
            fix="quantize for this target through `llmc build`/`llmc quantize` with the recipe's gptq-format target, "
                "which keeps zero points off 0 (zero_grid nonzero), or use a symmetric scheme")


def to_gptq(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int,
            *, v1_zeros_checked: bool = True) -> GPTQTensors:
    """Canonical [out, in] signed codes + [out, groups] (or [out,1] / [1]) scales -> GPTQ v1 tensors.
    `v1_zeros_checked=False` skips `check_v1_zeros`, for a reader known to take a stored 2^b - 1 as zero 0
    (onnxruntime-genai's loader: llmc.formats.onnx_genai)."""
    if v1_zeros_checked:
        check_v1_zeros(zero_point, bits)
    out_f, in_f = codes.shape
    offset = 1 << (bits - 1)
    scale = scale.float().reshape(out_f, -1) if scale.numel() > 1 else scale.float().reshape(1, 1).expand(out_f, 1)
    groups = scale.shape[1]
    group_size = in_f // groups
    zero = torch.zeros_like(scale, dtype=torch.int64) if zero_point is None else zero_point.to(torch.int64).reshape(out_f, groups)
    unsigned = (codes.to(torch.int16) + offset).t().contiguous()  # [in, out]; int16 holds 8-bit codes + 128
    stored_zero = ((zero + offset - 1) & ((1 << bits) - 1)).t().contiguous()  # [groups, out]
    return GPTQTensors(
        qweight=pack_along_rows(unsigned, bits),
        qzeros=pack_along_rows(stored_zero.t().contiguous(), bits).t().contiguous(),
        scales=scale.t().contiguous().to(torch.float16),
        g_idx=(torch.arange(in_f, dtype=torch.int32) // group_size),
    )


def dequantize_gptq(t: GPTQTensors, bits: int) -> torch.Tensor:
    """Independent decoding of the stored tensors (what a GPTQ kernel computes): float32 [out, in], a view."""
    q = unpack_rows(t.qweight, bits)  # [in, out]
    z = unpack_rows(t.qzeros.t().contiguous(), bits).t()  # [groups, out]
    g = t.g_idx.long()
    zeros = ((z + 1) & ((1 << bits) - 1))[g]  # [in, out]
    return (t.scales.float()[g] * (q - zeros).float()).t()  # a view: the caller compares it


def gptq_quantization_config(scheme: Scheme, bits: int, unquantized: list[str] = ()) -> dict:
    """`unquantized`: Linears left in the model's dtype, skipped through `dynamic`'s "-:" patterns (vLLM and
    GPTQModel quantize every other Linear but lm_head)."""
    w = scheme.weights
    skipped = {f"-:{re.escape(n)}$": {} for n in unquantized if n != "lm_head"}
    return {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": bits,
        "group_size": w.group_size if w.strategy == "group" else -1,
        "desc_act": False,
        "sym": bool(w.symmetric),
        "true_sequential": True,
        "damp_percent": 0.01,
        "static_groups": False,
        "pack_dtype": "int32",
        "meta": {"quantizer": ["llmc"], "algorithm": scheme.algorithm},
        **({"dynamic": skipped} if skipped else {}),
    }


def serve_args(*, tensor_parallel: int = 1) -> dict:
    """How ExLlamaV2 loads the artifact (it reads GPTQ-format folders as they are)."""
    args = {"model_dir": "<artifact>", "tensor_parallel": tensor_parallel > 1}
    return {"exllamav2": args, "command": "python -c \"from exllamav2 import ExLlamaV2, ExLlamaV2Config; "
            "m = ExLlamaV2(ExLlamaV2Config('<artifact>'))\" (or TabbyAPI with model_dir set to the artifact)"}


def gptq_codec(bits: int, *, v1_zeros_checked: bool = True) -> tuple[Callable, Callable]:
    """(repack, decode) of one block of a Linear's output rows in the GPTQ v1 layout, as `write_repacked_checkpoint`
    takes them: canonical codes / scale / zero point -> the layout's tensors, and those decoded back to float32.
    `v1_zeros_checked`: as `to_gptq`."""
    def repack(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return vars(to_gptq(codes, scale, zero_point, bits, v1_zeros_checked=v1_zeros_checked))

    return repack, lambda t: dequantize_gptq(GPTQTensors(**t), bits)


def export_gptq(qm: QuantizedModel, out: Path, *, serve: dict | None = None, v1_zeros_checked: bool = True) -> dict:
    """Write config.json (with quantization_config), GPTQ-format safetensors, the tokenizer and, when
    given, the runtime arguments (llmc-serve.json). A zero point of 0 (unsigned) is refused (`check_v1_zeros`)
    unless `v1_zeros_checked` is False (`to_gptq`).

    Returns a summary with the largest relative weight error the float16 scales introduced."""
    bits = check_scheme(qm.scheme)
    repack, decode = gptq_codec(bits, v1_zeros_checked=v1_zeros_checked)
    written, worst = write_repacked_checkpoint(
        qm, out, repack=repack, decode=decode, output_dims=OUTPUT_DIMS,
        quantization_config=gptq_quantization_config(qm.scheme, bits, qm.unquantized_linears), dtype=qm.meta.get("dtype", "float32"),
        serve=serve)
    return {"files": [p.name for p in written], "bits": bits, "max_relative_weight_error_fp16_scales": worst}


def repack_rate(weights: TensorSpec) -> float:
    """Quantized weight elements/s `export_gptq` repacks into the GPTQ layout and checks (llmc.formats.files.
    repack_rate with the GPTQ codec, as the onnxruntime int4 export writes it: its zero points unchecked, a check
    too small to time)."""
    repack, decode = gptq_codec(weights.bits, v1_zeros_checked=False)
    return files.repack_rate("gptq", weights, repack=repack, decode=decode, output_dims=OUTPUT_DIMS)


# why llmc does not score a GPTQ or AWQ artifact in the runtimes that read it (the report's and the gates' reason)
NEEDS_GPU = ("not evaluated: LMDeploy / ExLlamaV2 need an NVIDIA GPU; add gptqmodel to eval.runtimes to load "
             "it in GPTQModel's CPU kernels (bash scripts/setup-gptqmodel.sh)")


class RepackedCheckpoint(ArtifactFormat):
    """What the GPTQ and AWQ checkpoints share: integer codes repacked a block at a time
    (llmc.formats.files.write_repacked_checkpoint), float16 scales and the zero points packed at the codes' bits
    (written for symmetric schemes too), the Llama-family layouts their loaders were verified against, GPTQModel's
    CPU kernels to score them, and a stage config of the target and the serving arguments. Each format gives its
    `check`, `serve` and `export`."""

    scale_bytes = 2 + 0.5
    layout = ExportLayout(repacks_layers=True)
    describes_linears = True  # its quantization_config is checked against the Linears (check_export)
    families = frozenset({"llama", "mistral", "qwen2"})
    read_by = ("gptqmodel",)  # GPTQModel's CPU kernels (bash scripts/setup-gptqmodel.sh)
    unevaluated = NEEDS_GPU

    def serve(self, tensor_parallel: int) -> dict:
        raise NotImplementedError

    def repack_rate(self, weights: TensorSpec) -> float:
        """Quantized weight elements/s this format's exporter repacks and checks (probed per machine)."""
        raise NotImplementedError

    def repack_seconds(self, work: ExportWork) -> float:
        """Every quantized weight repacked a block at a time and decoded again (llmc.formats.files.repack_linear),
        at this format's probed `repack_rate` per scheme; 0 for a named profile (no host probes)."""
        def seconds() -> float:
            return sum(sum(o * i for o, i in w.linears) / self.repack_rate(w.weights)
                       for w in work.written if w.linears)

        return host_work_seconds(seconds)

    def export(self, quantized: QuantizedModel, out: Path, serve: dict) -> None:
        raise NotImplementedError

    def stage_config(self, request: ExportRequest) -> dict:
        return {"target": target_key(request.target), "serve": self.serve(request.target.tensor_parallel)}

    def write(self, request: ExportRequest, out: Path) -> None:
        self.export(request.quantized, out, serve=self.stage_config(request)["serve"])


@register_format
class GptqCheckpoint(RepackedCheckpoint):
    name = "gptq"
    zero_grid = "nonzero"  # v1 stores zero - 1: an unsigned zero of 0 would read differently per reader (above)
    per_input_bytes = 4  # g_idx: int32 per input feature
    families_source = "GPTQ-format loaders verified against here: Llama-family layouts"
    proof = ("loaded and scored here by GPTQModel's CPU kernels (engine gptqmodel; docs/formats-and-runtimes.md, issue 20); "
             "ExLlamaV2 itself needs a GPU. GPTQ v1 layout decodes to the canonical weights exactly, and "
             "onnxruntime-genai's own GPTQ loader reads it back to the same weights; the same files feed the ONNX "
             "Runtime export, which is scored here")

    def check_scheme(self, scheme) -> None:
        check_scheme(scheme)

    def serve(self, tensor_parallel: int) -> dict:
        return serve_args(tensor_parallel=tensor_parallel)

    def repack_rate(self, weights: TensorSpec) -> float:
        return repack_rate(weights)

    def export(self, quantized: QuantizedModel, out: Path, serve: dict) -> None:
        export_gptq(quantized, out, serve=serve)

    def recognizes(self, path: Path) -> bool:
        q = quantization_config(path) or {}
        return q.get("quant_method") == "gptq" and "llmc" in (q.get("meta") or {}).get("quantizer", [])

    def describe(self, path: Path) -> str:
        config = read_json(path / "config.json") or {}
        q = config["quantization_config"]
        arch = architectures(config)
        return "\n".join([
            f"GPTQ-format checkpoint (v1 layout, written by llmc) at {path} ({arch})",
            f"  {q['bits']}-bit, group {q['group_size']}, {'symmetric' if q.get('sym') else 'asymmetric'}, "
            f"desc_act {q.get('desc_act')}; algorithm {(q.get('meta') or {}).get('algorithm')}",
            "  accepted by: ExLlamaV2, transformers + GPTQModel, vLLM (gptq/marlin), onnxruntime-genai's model builder",
            *serve_line(path),
        ])
