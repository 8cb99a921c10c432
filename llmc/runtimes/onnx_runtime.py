"""ONNX Runtime: an onnxruntime-genai folder (llmc.formats.onnx_genai) — the builder's graph with KV cache and
GroupQueryAttention; INT4 as MatMulNBits, 8-bit schemes as llmc's codes behind DequantizeLinear (+ Q/DQ on static
activations). Measured on this CPU."""

from __future__ import annotations

from llmc.formats.onnx_genai import OnnxGenai
from llmc.runtimes.base import Rule, Runtime
from llmc.runtimes.registry import register_runtime

_ORT_U8S8 = (
    "Q/DQ fused into ORT's int8 GEMM (MatMulIntegerToFloat); on x86 CPUs without VNNI its u8s8 kernel "
    "saturates 16-bit pair sums, which costs accuracy with full-range int8 weights (measured, docs/formats-and-runtimes.md)"
)


register_runtime(Runtime(
    name="onnxruntime",
    format=OnnxGenai.name,
    rules={
        "W4A16-INT": Rule("sm70", cpu=True, since="1.17.0",
                          cpu_note="MatMulNBits; accuracy_level 4 computes with int8 activations", source="microsoft/onnxruntime's ContribOperators.md (MatMulNBits) and OperatorKernels.md; CPU measured here"),
        "W8A8-INT8": Rule("sm70", cpu=True, since="1.20.0", cpu_note=_ORT_U8S8, source="microsoft/onnxruntime's ContribOperators.md (MatMulNBits) and OperatorKernels.md; CPU measured here"),
        "W8A16-INT8": Rule("sm70", cpu=True, since="1.20.0", cpu_note="DequantizeLinear -> MatMul (float compute)", source="microsoft/onnxruntime's ContribOperators.md (MatMulNBits) and OperatorKernels.md; CPU measured here"),
        "W8A8-FP8": Rule(None, cpu=True, since="1.20.0",
                         cpu_note="FP8 Q/DQ run as float on the CPU EP (exact, no FP8 speed-up)",
                         refuse_reason="ORT's FP8 Q/DQ graphs are verified on the CPU EP only; on a "
                         "GPU target tensorrt or vllm", source="microsoft/onnxruntime's ContribOperators.md (MatMulNBits) and OperatorKernels.md; CPU measured here"),
    },
    known_versions=("1.16.0", "1.17.0", "1.20.0", "1.31.0"),
))
