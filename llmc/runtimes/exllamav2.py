"""ExLlamaV2: reads GPTQ-format 4-bit checkpoints (llmc.formats.gptq_format; its own EXL2 format is not written by
llmc), CUDA only. The same files feed the ONNX Runtime export."""

from __future__ import annotations

from pathlib import Path

from llmc.runtimes.base import (
    ArtifactFormat,
    ExportRequest,
    Rule,
    Runtime,
    architectures,
    quantization_config,
    read_json,
    serve_line,
    target_key,
)
from llmc.runtimes.registry import register_format, register_runtime


_NEEDS_GPU = ("not evaluated: LMDeploy / ExLlamaV2 need an NVIDIA GPU; add gptqmodel to eval.runtimes to load "
              "it in GPTQModel's CPU kernels (bash scripts/setup-gptqmodel.sh)")


@register_format
class GptqCheckpoint(ArtifactFormat):
    name = "gptq"
    # float16 scales and the zero points packed at the codes' bits, written for symmetric schemes too; GPTQ adds
    # g_idx (int32 per input feature)
    scale_bytes = 2 + 0.5
    per_input_bytes = 4
    repacks_layers = True  # llmc.formats.files.write_repacked_checkpoint
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = "GPTQ-format loaders verified against here: Llama-family layouts"
    read_by = ("gptqmodel",)  # GPTQModel's CPU kernels (bash scripts/setup-gptqmodel.sh)
    unevaluated = _NEEDS_GPU
    proof = ("loaded and scored here by GPTQModel's CPU kernels (engine gptqmodel; docs/formats-and-runtimes.md, issue 20); "
             "ExLlamaV2 itself needs a GPU. GPTQ v1 layout decodes to the canonical weights exactly, and "
             "onnxruntime-genai's own GPTQ loader reads it back to the same weights; the same files feed the ONNX "
             "Runtime export, which is scored here")

    def check_scheme(self, scheme) -> None:
        from llmc.formats.gptq_format import check_scheme

        check_scheme(scheme)

    def stage_config(self, request: ExportRequest) -> dict:
        from llmc.formats.gptq_format import serve_args

        return {"target": target_key(request.target), "serve": serve_args(tensor_parallel=request.target.tensor_parallel)}

    def write(self, request: ExportRequest, out: Path) -> None:
        from llmc.formats.gptq_format import export_gptq

        export_gptq(request.quantized, out, serve=self.stage_config(request)["serve"])

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


register_runtime(Runtime(
    name="exllamav2",
    format=GptqCheckpoint.name,
    rules={"W4A16-INT": Rule("sm70", since="0.0.11", refuse_reason="ExLlamaV2 runs on CUDA GPUs", source="turboderp/exllamav2: exllamav2/exllamav2_ext/cuda/q_gemm.cu")},
    known_versions=("0.0.11", "0.1.0", "0.2.0", "0.3.2"),
))
