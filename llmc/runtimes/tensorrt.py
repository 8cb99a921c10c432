"""TensorRT: a standard-op ONNX Q/DQ graph (llmc.formats.onnx_qdq, opset 21: blocked INT4 DequantizeLinear, which
TensorRT 10's ONNX parser reads); `llmc.engines.tensorrt` builds a strongly typed engine from it on a GPU."""

from __future__ import annotations

from pathlib import Path

from llmc.runtimes.base import ArtifactFormat, ExportRequest, Rule, Runtime, read_json
from llmc.runtimes.registry import register_format, register_runtime


@register_format
class OnnxQdq(ArtifactFormat):
    name = "onnx-qdq"
    libraries = ("onnx",)
    unquantized_elem = 4  # the graph is traced in float32: every unquantized initializer is float32
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = "the Q/DQ graph export is verified on Llama-family models only"
    read_by = ("onnxruntime", "tensorrt")
    whole_model = True
    measures_decode = False  # input_ids -> logits, no KV cache
    triton_backend = "onnxruntime"
    unevaluated = "not evaluated: add onnxruntime to eval.runtimes (or tensorrt, on a GPU machine with TensorRT)"
    proof = ("the standard-op Q/DQ graph is loaded and scored in onnxruntime 1.32 here (CPU EP; default test "
             "run, tiny model): without ORT's int8 kernel fusions it reproduces the torch reference of the same codes "
             "(KL < 2e-5); a TensorRT engine is built and scored from it only on a GPU machine with TensorRT (test "
             "marked gpu, not run)")

    def check_scheme(self, scheme) -> None:
        from llmc.formats.onnx_qdq import check_scheme

        check_scheme(scheme)

    def stage_config(self, request: ExportRequest) -> dict:
        from llmc.formats.onnx_qdq import OPSET

        return {"opset": OPSET}  # the graph does not depend on the target: onnxruntime and tensorrt share one export

    def write(self, request: ExportRequest, out: Path) -> None:
        from llmc.formats.onnx_qdq import export_onnx_qdq

        export_onnx_qdq(request.quantized, out)

    def recognizes(self, path: Path) -> bool:
        from llmc.formats.onnx_qdq import MODEL_FILE

        return (path / MODEL_FILE).is_file() and not (path / "genai_config.json").is_file()

    def describe(self, path: Path) -> str:
        from collections import Counter

        import onnx

        from llmc.formats.files import SERVE_FILE
        from llmc.formats.onnx_qdq import MODEL_FILE

        graph = onnx.load(str(path / MODEL_FILE), load_external_data=False).graph
        ops = Counter(n.op_type for n in graph.node)
        extra = read_json(path / SERVE_FILE) or {}
        return "\n".join([
            f"ONNX Q/DQ graph at {path} (input_ids -> logits, no KV cache)",
            f"  ops: {ops['DequantizeLinear']} DequantizeLinear, {ops['QuantizeLinear']} QuantizeLinear, "
            f"{ops['MatMul']} MatMul, {sum(ops.values())} nodes in all",
            f"  scheme {extra.get('scheme', '?')}: weights {extra.get('weights', 'not written by llmc')}; "
            f"activations {extra.get('activations', '?')}",
            "  accepted by: onnxruntime (CPU EP here), TensorRT (engine: "
            + extra.get("tensorrt", {}).get("build", "trtexec --onnx=model.onnx --stronglyTyped") + ")",
        ])


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
