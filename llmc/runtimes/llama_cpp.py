"""llama.cpp and Ollama: they read GGUF files (llmc.formats.gguf), Ollama with a Modelfile beside it."""

from __future__ import annotations

from llmc.formats.gguf import Gguf
from llmc.formats.gguf_arch import GGUF_REFUSED, MOE_MODEL_TYPES
from llmc.runtimes.base import Rule, Runtime
from llmc.runtimes.registry import register_runtime

_ACTIVATIONS_NOTE = "llama.cpp quantizes activations itself (dynamic, blocks of 32)"


# Integer block formats, any arch and the CPU. W8A8: weights as Q8_0; llama.cpp quantizes activations itself, so
# the scheme's activation settings are not carried (llmc.formats.gguf).
_GGML_CUDA = ("ggml-org/llama.cpp: ggml/src/ggml-cuda/mmq.cuh, mmvq.cu (dp4a integer kernels, any CUDA arch); CPU "
              "measured here")


def _gguf_rules(since: str) -> dict[str, Rule]:
    return {
        "W8A8-INT8": Rule("sm70", cpu=True, since=since, cpu_note=_ACTIVATIONS_NOTE, source=_GGML_CUDA),
        "W8A16-INT8": Rule("sm70", cpu=True, since=since, source=_GGML_CUDA),
        "W4A16-INT": Rule("sm70", cpu=True, since=since, source=_GGML_CUDA),
    }


# FP4 weights (llmc.formats.gguf.MICROSCALING_GGUF), llama.cpp only: versions are llama-cpp-python's, the build
# llmc's engine runs. MXFP4 (GGML_TYPE_MXFP4) came with gpt-oss (llama.cpp PR #15091, 2025-08-05), in
# llama-cpp-python 0.3.15 (its maintainer, llama-cpp-python issue #2048). NVFP4 (GGML_TYPE_NVFP4, PR #19769) and
# the per-tensor `.scale` multiplied after the matmul (PR #20427) landed in llama.cpp in March 2026; which
# llama-cpp-python release first vendored both is not established here (0.3.36, the one setup-llama.sh installs,
# has both), so its version is left open. Both run on the CPU backend (ggml-cpu's vec_dot against Q8_0
# activations); NVFP4 GGUF only for the families whose graph applies `.scale` (GgufFamily.tensor_scales).
_FP4_NOTE = "llama.cpp quantizes activations to Q8_0 itself (dynamic, blocks of 32)"
_FP4_RULES = {
    "W4A16-MXFP4": Rule("sm70", cpu=True, since="0.3.15", cpu_note=_FP4_NOTE, source="ggml-org/llama.cpp: PR #15091 (GGML_TYPE_MXFP4); llama-cpp-python issue #2048"),
    "W4A16-NVFP4": Rule("sm70", cpu=True, cpu_note=_FP4_NOTE + "; NVFP4 for llama, mistral and qwen3 models only", source="ggml-org/llama.cpp: PR #19769 (GGML_TYPE_NVFP4), PR #20427 (.scale)"),
}

register_runtime(Runtime(name="llama.cpp", format=Gguf.name, rules={**_gguf_rules("0.0.1"), **_FP4_RULES},
                         known_versions=("0.0.1", "0.3.15", "0.3.36"), refused_families=dict(GGUF_REFUSED)))
# Ollama: not given the FP4 types. Its gpt-oss MXFP4 files predate ggml's type 39 (llama.cpp issue #15597: an Ollama
# gpt-oss blob stores another type id), and which Ollama release loads ggml's MXFP4 / NVFP4 in a dense model is not
# established here.
# Ollama: nor the MoE families. llmc's DeepSeek-V3 GGUF is the decompressed-MLA form, its experts merged as llama.cpp
# merges them; which Ollama release (its own Go engine for several of these architectures) loads such files is not
# established here, and none is run.
_OLLAMA_MOE_UNRUN = ("llmc's GGUF of this MoE family is proven in llama.cpp only; which Ollama release loads it "
                     "(Ollama runs several MoE architectures in its own engine) is not established here")
# Nor Qwen3.5's dense linear-attention model (llama.cpp's qwen35 architecture, newer than the Ollama releases known here)
_OLLAMA_LINEAR_ATTENTION_UNRUN = ("llmc's GGUF of this gated-DeltaNet family is proven in llama.cpp only; which Ollama "
                                  "release loads llama.cpp's qwen35 architecture is not established here")
# Nor Gemma-4 (llama.cpp's gemma4 architecture: per-layer embeddings, KV-shared layers), likewise
_OLLAMA_GEMMA4_UNRUN = ("llmc's GGUF of Gemma-4 is proven in llama.cpp only; which Ollama release loads llama.cpp's "
                        "gemma4 architecture is not established here")
# Nor the dense newcomers (issue 45): llama.cpp's smollm3, exaone4, seed_oss, apertus architectures and OLMo 3's
# sliding olmo2, proven in llama.cpp 0.3.36 only
_OLLAMA_NEWCOMERS_UNRUN = ("llmc's GGUF of this family is proven in llama.cpp only; which Ollama release loads "
                           "llama.cpp's {arch} architecture as llmc writes it is not established here")
_OLLAMA_NEWCOMERS = {"smollm3": "smollm3", "olmo3": "olmo2 (with sliding layers)", "exaone4": "exaone4",
                     "seed_oss": "seed_oss", "apertus": "apertus"}
_OLLAMA_REFUSED = {**GGUF_REFUSED, **dict.fromkeys(sorted(MOE_MODEL_TYPES), _OLLAMA_MOE_UNRUN),
                   "qwen3_5_text": _OLLAMA_LINEAR_ATTENTION_UNRUN, "gemma4_text": _OLLAMA_GEMMA4_UNRUN,
                   **{mt: _OLLAMA_NEWCOMERS_UNRUN.format(arch=a) for mt, a in _OLLAMA_NEWCOMERS.items()}}
register_runtime(Runtime(name="ollama", format=Gguf.name, rules=_gguf_rules("0.1.0"), known_versions=("0.1.0", "0.5.0"),
                         refused_families=_OLLAMA_REFUSED))
