"""TensorRT-LLM: the ModelOpt-style unified checkpoint (llmc.formats.modelopt_hf) from 0.17 on, the legacy
per-rank checkpoint for trtllm-build (llmc.formats.trtllm_legacy) for targets pinned below it."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llmc.formats.modelopt_hf import ModelOptCheckpoint
from llmc.formats.trtllm_legacy import LegacyCheckpoint
from llmc.runtimes.base import MatrixRow, Rule, Runtime
from llmc.runtimes.registry import register_runtime

# TensorRT-LLM reads the unified (ModelOpt HF) checkpoint from this version; a target pinned below it gets the
# legacy per-rank checkpoint for trtllm-build.
UNIFIED_SINCE = "0.17.0"


class TensorRtLlm(Runtime):
    def format_for(self, version: str | None) -> str:
        """A version range that admits no release from UNIFIED_SINCE on gets the legacy checkpoint."""
        if version:
            spec = SpecifierSet(version)
            if not any(Version(v) >= Version(UNIFIED_SINCE) and v in spec for v in self.known_versions):
                return LegacyCheckpoint.name
        return self.format

    def matrix_rows(self) -> list[MatrixRow]:
        newer = tuple(v for v in self.known_versions if Version(v) >= Version(UNIFIED_SINCE))
        older = tuple(v for v in self.known_versions if Version(v) < Version(UNIFIED_SINCE))
        return [MatrixRow(self.name, self.format, newer),
                MatrixRow(f"{self.name} (pinned <{UNIFIED_SINCE})", LegacyCheckpoint.name, older)]


_TRTLLM_MATRIX = "NVIDIA/TensorRT-LLM: docs/source/reference/support-matrix.md (quantization by GPU arch)"

register_runtime(TensorRtLlm(
    name="tensorrt-llm",
    format=ModelOptCheckpoint.name,
    rules={
        "W8A8-FP8": Rule("sm89", since="0.9.0",
                         refuse_reason="TensorRT-LLM has no FP8 GEMM before Ada (sm89); on A100 "
                         "use W8A8-INT8 (SmoothQuant) or W4A16 (AWQ)", source=_TRTLLM_MATRIX),
        "W8A8-INT8": Rule("sm80", since="0.7.0", refuse_reason="SmoothQuant INT8 kernels need sm80+", source=_TRTLLM_MATRIX),
        "W8A16-INT8": Rule("sm80", since="0.7.0", refuse_reason="weight-only kernels need sm80+", source=_TRTLLM_MATRIX),
        "W4A16-INT": Rule("sm80", since="0.7.0", refuse_reason="INT4 AWQ kernels need sm80+", source=_TRTLLM_MATRIX),
        "W4AFP8": Rule("sm89", since="0.10.0", refuse_reason="W4A8 AWQ needs FP8 tensor cores (sm89+)", source=_TRTLLM_MATRIX),
        "W4A4-NVFP4": Rule("sm100", since="0.17.0", refuse_reason="NVFP4 needs Blackwell (sm100+)", source=_TRTLLM_MATRIX),
        # ModelOpt's fp8_pb_wo read as FP8_BLOCK_SCALES (its 4-D weight_scale squeezed) from release 1.0 on
        "W8A8-FP8-BLOCK": Rule("sm90", since="1.0.0",
                               refuse_reason="TensorRT-LLM's block-scaled FP8 GEMM (FP8_BLOCK_SCALES) needs Hopper "
                               "(sm90+); on Ada use W8A8-FP8", source=_TRTLLM_MATRIX),
        "KV-FP8": Rule("sm89", since="0.9.0", refuse_reason="FP8 KV cache needs sm89+", source=_TRTLLM_MATRIX),
        "KV-INT8": Rule("sm80", since="0.7.0", refuse_reason="INT8 KV cache needs sm80+", source=_TRTLLM_MATRIX),
    },
    known_versions=("0.7.0", "0.9.0", "0.10.0", "0.12.0", "0.17.0", "0.20.0", "1.0.0"),
))
