"""LMDeploy: TurboMind reads AutoAWQ GEMM checkpoints (`--model-format awq`, llmc.formats.awq_format): 4-bit groups,
GPU only."""

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
class AwqCheckpoint(ArtifactFormat):
    name = "awq"
    # float16 scales and the zero points packed at the codes' bits, written for symmetric schemes too; GPTQ adds
    # g_idx (int32 per input feature)
    scale_bytes = 2 + 0.5
    repacks_layers = True  # llmc.formats.files.write_repacked_checkpoint
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = "AutoAWQ-format loaders verified against here: Llama-family layouts"
    read_by = ("gptqmodel",)  # GPTQModel's CPU kernels (bash scripts/setup-gptqmodel.sh)
    unevaluated = _NEEDS_GPU
    proof = ("loaded and scored here by GPTQModel's CPU AWQ kernels (engine gptqmodel; docs/formats-and-runtimes.md, issue 20); "
             "LMDeploy/vLLM's AWQ kernels need a GPU. AutoAWQ GEMM layout (nibble order "
             "0 2 4 6 1 3 5 7, unsigned zeros, fp16 scales) decodes to the canonical weights exactly, and "
             "onnxruntime-genai's own AWQ loader reads llmc's checkpoint back to the same weights (default test run)")

    def check_scheme(self, scheme) -> None:
        from llmc.formats.awq_format import check_scheme

        check_scheme(scheme)

    def stage_config(self, request: ExportRequest) -> dict:
        from llmc.formats.awq_format import serve_args

        return {"target": target_key(request.target), "serve": serve_args(tensor_parallel=request.target.tensor_parallel)}

    def write(self, request: ExportRequest, out: Path) -> None:
        from llmc.formats.awq_format import export_awq

        export_awq(request.quantized, out, serve=self.stage_config(request)["serve"])

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


register_runtime(Runtime(
    name="lmdeploy",
    format=AwqCheckpoint.name,
    rules={"W4A16-INT": Rule("sm75", since="0.2.0", refuse_reason="TurboMind's W4A16 kernels need sm75+", source="InternLM/lmdeploy: docs/en/quantization/w4a16.md (supported GPUs)")},
    known_versions=("0.1.0", "0.2.0", "0.6.0", "0.10.0", "0.18.0"),
))
