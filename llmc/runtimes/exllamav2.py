"""ExLlamaV2: reads GPTQ-format 4-bit checkpoints (llmc.formats.gptq_format; its own EXL2 format is not written by
llmc), CUDA only. The same files feed the ONNX Runtime export."""

from __future__ import annotations

from llmc.formats.gptq_format import GptqCheckpoint
from llmc.runtimes.base import Rule, Runtime
from llmc.runtimes.registry import register_runtime


register_runtime(Runtime(
    name="exllamav2",
    format=GptqCheckpoint.name,
    rules={"W4A16-INT": Rule("sm70", since="0.0.11", refuse_reason="ExLlamaV2 runs on CUDA GPUs", source="turboderp/exllamav2: exllamav2/exllamav2_ext/cuda/q_gemm.cu")},
    known_versions=("0.0.11", "0.1.0", "0.2.0", "0.3.2"),
))
