"""TensorRT: a standard-op ONNX Q/DQ graph (llmc.formats.onnx_qdq, opset 21: blocked INT4 DequantizeLinear, which
TensorRT 10's ONNX parser reads); `llmc.engines.tensorrt` builds a strongly typed engine from it on a GPU."""

from __future__ import annotations

from llmc.formats.onnx_qdq import OnnxQdq
from llmc.runtimes.base import Rule, Runtime
from llmc.runtimes.registry import register_runtime


register_runtime(Runtime(
    name="tensorrt",
    format=OnnxQdq.name,
    rules={
        "W8A8-INT8": Rule("sm75", since="10.3.0", refuse_reason="TensorRT's INT8 Q/DQ GEMMs need sm75+", source="NVIDIA TensorRT support matrix (docs.nvidia.com/deeplearning/tensorrt/latest/getting-started/support-matrix.html)"),
        "W8A16-INT8": Rule("sm80", since="10.3.0",
                           refuse_reason="TensorRT's weight-only (DQ -> MatMul) kernels need sm80+", source="NVIDIA TensorRT support matrix (docs.nvidia.com/deeplearning/tensorrt/latest/getting-started/support-matrix.html)"),
        "W4A16-INT": Rule("sm80", since="10.3.0",
                          refuse_reason="TensorRT's INT4 block-quantized weight-only GEMM needs sm80+", source="NVIDIA TensorRT support matrix (docs.nvidia.com/deeplearning/tensorrt/latest/getting-started/support-matrix.html)"),
        "W8A8-FP8": Rule("sm89", since="10.3.0", refuse_reason="TensorRT's FP8 GEMMs need Ada/Hopper (sm89+)", source="NVIDIA TensorRT support matrix (docs.nvidia.com/deeplearning/tensorrt/latest/getting-started/support-matrix.html)"),
    },
    known_versions=("8.6.0", "10.0.0", "10.3.0", "10.8.0", "10.13.0"),
))
