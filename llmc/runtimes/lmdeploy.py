"""LMDeploy: TurboMind reads AutoAWQ GEMM checkpoints (`--model-format awq`, llmc.formats.awq_format): 4-bit groups,
GPU only."""

from __future__ import annotations

from llmc.formats.awq_format import AwqCheckpoint
from llmc.runtimes.base import Rule, Runtime
from llmc.runtimes.registry import register_runtime


register_runtime(Runtime(
    name="lmdeploy",
    format=AwqCheckpoint.name,
    rules={"W4A16-INT": Rule("sm75", since="0.2.0", refuse_reason="TurboMind's W4A16 kernels need sm75+", source="InternLM/lmdeploy: docs/en/quantization/w4a16.md (supported GPUs)")},
    known_versions=("0.1.0", "0.2.0", "0.6.0", "0.10.0", "0.18.0"),
))
