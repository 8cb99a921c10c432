"""ONNX Runtime: an onnxruntime-genai folder (llmc.formats.onnx_genai) — the builder's graph with KV cache and
GroupQueryAttention; INT4 as MatMulNBits, 8-bit schemes as llmc's codes behind DequantizeLinear (+ Q/DQ on static
activations). Measured on this CPU."""

from __future__ import annotations

from pathlib import Path

from llmc.runtimes.base import ArtifactFormat, ExportRequest, Rule, Runtime, read_json, target_key
from llmc.runtimes.registry import register_format, register_runtime

GENAI_CONFIG = "genai_config.json"
_ORT_U8S8 = (
    "Q/DQ fused into ORT's int8 GEMM (MatMulIntegerToFloat); on x86 CPUs without VNNI its u8s8 kernel "
    "saturates 16-bit pair sums, which costs accuracy with full-range int8 weights (measured, docs/formats-and-runtimes.md)"
)


@register_format
class OnnxGenai(ArtifactFormat):
    name = "onnx"
    libraries = ("onnx", "onnxruntime", "onnxruntime_genai")
    unquantized_elem = 4  # the graph is traced in float32: every unquantized initializer is float32
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = ("llmc maps the onnxruntime-genai builder's packed qkv/gate_up weights back to Llama-family "
                       "modules; other families' graphs are not verified here")
    read_by = ("onnxruntime",)
    whole_model = True
    triton_backend = "onnxruntime"
    unevaluated = "not evaluated: add onnxruntime to eval.runtimes"
    proof = ("loaded and scored in onnxruntime 1.32 here (CPU EP; tests in the default run on a tiny model, and "
             "the real model in the integration suite): fp32 compute reproduces the torch reference of the same codes "
             "(INT4: KL ~1e-6, MatMulNBits blocks decode to the canonical weights with fp16 scales; 8-bit Q/DQ: "
             "KL < 1e-6 with ORT's int8 kernel fusion off); onnxruntime-genai's genai_config.json written by its own "
             "builder")

    def check_scheme(self, scheme) -> None:
        from llmc.formats.onnx_genai import check_scheme

        check_scheme(scheme)

    def stage_config(self, request: ExportRequest) -> dict:
        from llmc.formats.onnx_genai import ONNX_OPTIONS

        return {"target": target_key(request.target), "options": ONNX_OPTIONS}

    def write(self, request: ExportRequest, out: Path) -> None:
        from llmc.formats.onnx_genai import ONNX_OPTIONS, export_onnx

        export_onnx(request.quantized, out, **ONNX_OPTIONS)

    def recognizes(self, path: Path) -> bool:
        return (path / GENAI_CONFIG).is_file()

    def describe(self, path: Path) -> str:
        from collections import Counter

        import onnx

        from llmc.formats.files import SERVE_FILE

        cfg = read_json(path / GENAI_CONFIG)["model"]
        dec = cfg["decoder"]
        graph = onnx.load(str(path / dec["filename"]), load_external_data=False).graph
        ops = Counter(n.op_type for n in graph.node)
        blocks = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name in ("bits",)}
        extra = read_json(path / SERVE_FILE) or {}
        return "\n".join([
            f"ONNX Runtime model folder (onnxruntime-genai) at {path} ({cfg.get('type')}, "
            f"{dec['num_hidden_layers']} layers)",
            "  ops: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
            + (f"; MatMulNBits bits {sorted(blocks)}" if blocks else ""),
            f"  {extra.get('weights', 'not written by llmc')}"
            + (f"; accuracy_level {extra['accuracy_level']} ({extra['activations']})" if "accuracy_level" in extra else ""),
            "  accepted by: onnxruntime (CPU EP here; CUDA/DML EPs run MatMulNBits too), onnxruntime-genai "
            f"(og.Model('{path}'))",
        ])


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
