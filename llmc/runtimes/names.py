"""The names a recipe chooses among, as plain data: the registered runtimes' names (a recipe's `targets[].runtime`)
and the GPU architectures (its `gpu_arch`, and every rule's arch bound).

A leaf module (it imports nothing from llmc), so that `llmc.recipe.schema` can build its `Literal`s without
importing the runtime catalog and every format module behind it. `tests/unit/test_targets.py` asserts that
`RUNTIME_NAMES` equals the registered runtimes, in registration order (`llmc.runtimes.catalog.runtime_names()`).
"""

from __future__ import annotations

# every runtime `llmc.runtimes.catalog` registers, in its order (that of docs/compatibility.md)
RUNTIME_NAMES: tuple[str, ...] = (
    "vllm", "sglang", "tgi", "tensorrt-llm", "llama.cpp", "ollama", "onnxruntime", "tensorrt", "lmdeploy", "exllamav2",
)

# Every NVIDIA GPU architecture a rule or a recipe target names, oldest first (the recipe's `gpu_arch` takes these
# and "cpu"): one line each.
ARCH_ORDER: tuple[str, ...] = (
    "sm70",  # Volta (V100)
    "sm75",  # Turing (T4)
    "sm80",  # Ampere (A100)
    "sm86",  # Ampere (A10, RTX 30xx)
    "sm89",  # Ada Lovelace (L4, L40S, RTX 40xx): first FP8 tensor cores
    "sm90",  # Hopper (H100, H200)
    "sm100",  # Blackwell (B200): first FP4 tensor cores
    "sm120",  # Blackwell (RTX 50xx, RTX PRO 6000)
)
