"""llama.cpp and Ollama: they read GGUF files (llmc.formats.gguf), Ollama with a Modelfile beside it."""

from __future__ import annotations

from pathlib import Path

from llmc.formats.gguf_arch import GGUF_FAMILIES, GGUF_REFUSED, MOE_MODEL_TYPES
from llmc.runtimes.base import ArtifactFormat, ExportRequest, Rule, Runtime, WrittenTensors, target_key
from llmc.runtimes.registry import register_format, register_runtime

_ACTIVATIONS_NOTE = "llama.cpp quantizes activations itself (dynamic, blocks of 32)"


def _gguf_file(path: Path) -> Path:
    return path if path.suffix == ".gguf" else path / "model.gguf"


@register_format
class Gguf(ArtifactFormat):
    name = "gguf"
    libraries = ("gguf",)
    read_by = ("llama.cpp",)
    unevaluated = "not evaluated: add llama.cpp to eval.runtimes (bash scripts/setup-llama.sh)"
    proof = ("loaded and scored in llama.cpp here (Q8_0, Q4_0; tests marked llama); read back with the gguf "
             "library and compared tensor by tensor in the default test run (MXFP4, NVFP4 too: decoded to llmc's "
             "values, and by ggml's own C dequantizers; not yet scored in llama.cpp); the MoE families (Mixtral, "
             "Qwen2/3-MoE, DeepSeek-V3, GLM-4.5, MiniMax-M2: Q8_0) loaded and scored in llama.cpp 0.3.36 against "
             "the torch reference (tests/integration/test_gguf_moe_llamacpp.py); Ollama itself (which embeds "
             "llama.cpp) is not run here")

    mixed_precision = True  # each group's GGUF type, per tensor (llmc.formats.gguf)
    # the families llmc.formats.gguf_arch maps to a llama.cpp architecture (its MoE ones: experts merged into
    # llama.cpp's 3-D tensors, tests/unit/test_gguf_moe.py); the others are refused at plan time, those llama.cpp has
    # with the reason (GGUF_REFUSED, the runtimes' refused_families)
    families = frozenset(GGUF_FAMILIES)
    families_source = ("llmc.formats.gguf_arch: the families whose llama.cpp architecture (src/models/<arch>.cpp in "
                       "the llama.cpp llama-cpp-python 0.3.36 vendors) llmc's GGUF exporter writes")
    moe_families = MOE_MODEL_TYPES

    def check_scheme(self, scheme) -> None:
        from llmc.formats.gguf import type_plan

        type_plan(scheme.weights)  # raises for weights GGUF has no llama.cpp type for (fp8, mxfp8)

    copies_tokenizer_files = False  # the vocabulary and merges go into the GGUF's metadata (counted as their size)

    def written_bytes(self, w: WrittenTensors) -> float:
        """model.gguf: each quantized Linear in its ggml type's blocks (F16 where its input width is no multiple
        of the blocks), norms and biases F32, the embedding and head at the embedding type, the vocabulary."""
        from llmc.formats.gguf import GGUF_OPTIONS, _nbytes, type_plan

        plan = type_plan(w.weights, GGUF_OPTIONS["embedding_type"], GGUF_OPTIONS["requantize"])
        total = sum(_nbytes((o, i), plan.weight_type) if i % plan.row_multiple == 0 else 2 * o * i
                    for o, i in w.linears)
        embedding = {"F32": 4, "F16": 2}.get(plan.embedding_type, 34 / 32)  # Q8_0: 34 bytes a block of 32
        return total + w.layer_unquantized * 4 + w.outer * embedding + w.side_files

    def stage_config(self, request: ExportRequest) -> dict:
        from llmc.formats.gguf import GGUF_OPTIONS

        return {"target": target_key(request.target), "options": GGUF_OPTIONS}

    def write(self, request: ExportRequest, out: Path) -> None:
        from llmc.formats.gguf import GGUF_OPTIONS, export_gguf

        export_gguf(request.quantized, out, **GGUF_OPTIONS)

    def recognizes(self, path: Path) -> bool:
        return _gguf_file(path).is_file()

    def describe(self, path: Path) -> str:
        from gguf import GGUFReader

        path = _gguf_file(path)
        reader = GGUFReader(str(path))

        def field(name: str):
            f = reader.fields.get(name)
            if f is None:
                return None
            v = f.parts[f.data[0]]
            return bytes(v).decode() if f.types and f.types[0].name == "STRING" else v.tolist()[0]

        types: dict[str, int] = {}
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        return "\n".join([
            f"GGUF file {path} ({field('general.architecture')}, {len(reader.tensors)} tensors: "
            + ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1])) + ")",
            f"  scheme {field('llmc.scheme') or '?'}; linear weights {field('llmc.gguf.weight_type') or '?'} "
            f"({field('llmc.gguf.weight_method') or 'not written by llmc'})",
            "  accepted by: llama.cpp (CPU and GPU builds), Ollama (with the Modelfile beside it)",
        ])


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
_OLLAMA_REFUSED = {**GGUF_REFUSED, **dict.fromkeys(sorted(MOE_MODEL_TYPES), _OLLAMA_MOE_UNRUN)}
register_runtime(Runtime(name="ollama", format=Gguf.name, rules=_gguf_rules("0.1.0"), known_versions=("0.1.0", "0.5.0"),
                         refused_families=_OLLAMA_REFUSED))
