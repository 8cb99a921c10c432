"""Every built-in runtime and artifact format, registered, and the lookups over them: what consumers import
(`from llmc.runtimes import catalog as targets`; `targets.runtime("vllm")`, `targets.format_for(target)`).

Importing this module imports each runtime module below, in the order the compatibility matrix lists them
(registration order is `runtimes()`'s order); each imports the `llmc.formats` module whose class it reads, which
registers that format. A new runtime is one module and one name here (and in `llmc.runtimes.names`).
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
from llmc.formats.base import ArtifactFormat, ExportRequest, ExportWork, WrittenTensors, target_key
from llmc.formats.registry import (
    FORMATS,
    artifact_format,
    formats,
    import_libraries,
    is_implemented,
    recognize,
    register_format,
)
from llmc.runtimes.base import Rule, Runtime, arch_at_least, arch_rank, arch_span, scheme_keys
from llmc.runtimes.registry import (
    RUNTIMES,
    accepting_runtimes,
    check_family,
    check_family_format,
    check_moe_scheme,
    family_format,
    format_for,
    register_runtime,
    runtime,
    runtime_names,
    runtimes,
    triton_backend,
)

__all__ = ["FORMATS", "RUNTIMES", "ArtifactFormat", "ExportRequest", "ExportWork", "Rule", "Runtime", "WrittenTensors",
           "accepting_runtimes", "arch_at_least", "arch_rank", "arch_span", "artifact_format", "check_family",
           "check_family_format", "check_moe_scheme", "family_format", "format_for", "formats", "import_libraries", "is_implemented", "recognize",
           "register_format", "register_runtime", "runtime", "runtime_names", "runtimes", "scheme_keys", "target_key",
           "triton_backend"]
