"""Every built-in runtime and artifact format, registered, and the lookups over them: what consumers import
(`from llmc.runtimes import catalog as targets`; `targets.runtime("vllm")`, `targets.format_for(target)`).

Importing this module imports each runtime module below, in the order the compatibility matrix lists them
(registration order is `runtimes()`'s order). A new runtime is one module and one name here.
"""

from __future__ import annotations

from llmc.runtimes import (  # noqa: F401  (registration side effects, in this order)
    vllm,
    tensorrt_llm,
    llama_cpp,
    onnx_runtime,
    tensorrt,
    lmdeploy,
    exllamav2,
)
from llmc.runtimes.base import (
    ArtifactFormat,
    ExportRequest,
    Rule,
    Runtime,
    WrittenTensors,
    arch_at_least,
    arch_rank,
    arch_span,
    scheme_keys,
    target_key,
)
from llmc.runtimes.registry import (
    FORMATS,
    RUNTIMES,
    accepting_runtimes,
    artifact_format,
    check_family,
    check_moe_scheme,
    format_for,
    formats,
    is_implemented,
    recognize,
    register_format,
    register_runtime,
    runtime,
    runtime_names,
    runtimes,
    triton_backend,
)

__all__ = ["FORMATS", "RUNTIMES", "ArtifactFormat", "ExportRequest", "Rule", "Runtime", "WrittenTensors", "accepting_runtimes",
           "arch_at_least", "arch_rank", "arch_span", "artifact_format", "check_family", "check_moe_scheme",
           "format_for", "formats", "is_implemented", "recognize", "register_format", "register_runtime", "runtime", "runtime_names",
           "runtimes", "scheme_keys", "target_key", "triton_backend"]
