"""Which Hugging Face families become which llama.cpp architecture, as table rows (no heavy imports: the planner reads
these to refuse a GGUF target before any weight loads; llmc.formats.gguf writes the files).

Read in the llama.cpp that llama-cpp-python 0.3.36 vendors (scripts/setup-llama.sh): src/models/<arch>.cpp
(`load_arch_hparams`: the keys an architecture reads; `load_arch_tensors`: the tensors and shapes it creates; the
graph: what it computes), src/llama-arch.cpp (the tensor names), conversion/<family>.py (what convert_hf_to_gguf.py
writes).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GgufFamily:
    """How one Hugging Face model family becomes a llama.cpp architecture. Tensor names come from the gguf
    package's own tables for that architecture (gguf.TensorNameMap), so a family is one row here."""

    arch: str  # gguf.MODEL_ARCH member
    permute_qk: bool  # llama.cpp's rotary kernel for this architecture wants q/k rows interleaved (Llama-style)
    norm_offset: float = 0.0  # added to every norm weight: Gemma's norms multiply by (1 + weight), llama.cpp by weight

    # llama.cpp multiplies every Linear's output by its per-tensor `<name>.scale` (NVFP4's global scale). Read in the
    # llama.cpp that llama-cpp-python 0.3.36 vendors (src/models/<arch>.cpp): llama and qwen3 pass the scales of
    # q/k/v/o and the FFN; qwen2, gemma2/3, granite, phi3 and olmo2 pass NULL for the FFN's, so an NVFP4 GGUF of
    # those would load and compute wrong FFN outputs: refused. (MoE families: one `.scale` per merged expert tensor
    # cannot hold each expert's own global scale: refused too.)
    tensor_scales: bool = False
    norm_offset_skip: tuple[str, ...] = ()  # llama.cpp norms that take the weight as it is (Qwen3-Next's gated norm)


# As llama.cpp's convert_hf_to_gguf.py writes these families (permutation, Gemma's +1 on norm weights).
GGUF_FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("LLAMA", permute_qk=True, tensor_scales=True),
    "mistral": GgufFamily("LLAMA", permute_qk=True, tensor_scales=True),
    "granite": GgufFamily("GRANITE", permute_qk=True),
    "qwen2": GgufFamily("QWEN2", permute_qk=False),
    "qwen3": GgufFamily("QWEN3", permute_qk=False, tensor_scales=True),
    "phi3": GgufFamily("PHI3", permute_qk=False),
    "olmo2": GgufFamily("OLMO2", permute_qk=False),
    "gemma2": GgufFamily("GEMMA2", permute_qk=False, norm_offset=1.0),
    "gemma3": GgufFamily("GEMMA3", permute_qk=False, norm_offset=1.0),
    "gemma3_text": GgufFamily("GEMMA3", permute_qk=False, norm_offset=1.0),
    # Mixture-of-Experts: each layer's per-expert Linears merged into llama.cpp's 3-D `ffn_{gate,up,down}_exps`
    # (conversion/llama.py, qwen.py, deepseek.py, glm.py, minimax.py merge them the same way)
    "mixtral": GgufFamily("LLAMA", permute_qk=True),  # conversion/llama.py: Mixtral is the llama architecture
    "qwen2_moe": GgufFamily("QWEN2MOE", permute_qk=False),
    "qwen3_moe": GgufFamily("QWEN3MOE", permute_qk=False),
    # DeepSeek-V3 / R1 / Kimi-K2 (MLA, written in its decompressed kv_b form: see llmc.formats.gguf HEADS)
    "deepseek_v3": GgufFamily("DEEPSEEK2", permute_qk=False),
    # DeepSeek-V3.2 (src/models/deepseek32.cpp): DeepSeek-V3's layers with MLA in the absorbed form its loader requires
    # (kv_b_proj split into attn_k_b / attn_v_b, a latent KV cache: llmc.formats.gguf HEADS, ROW_SPLITS, PER_HEAD)
    # and the lightning indexer as blk.N.indexer.{attn_q_b, attn_k, k_norm, proj}
    "deepseek_v32": GgufFamily("DEEPSEEK32", permute_qk=False),
    "glm4_moe": GgufFamily("GLM4_MOE", permute_qk=False),
    "minimax_m2": GgufFamily("MINIMAXM2", permute_qk=False),
    # gpt-oss (conversion/gpt_oss.py): biased experts, attention sinks, sliding/full layers, YaRN; llama.cpp's
    # openai-moe graph (src/models/openai-moe.cpp) runs NeoX rope, so q/k keep Hugging Face's row order
    "gpt_oss": GgufFamily("GPT_OSS", permute_qk=False),
    # Qwen3-Next (conversion/qwen.py Qwen3NextModel): Qwen2-MoE's block, gated-DeltaNet linear attention in the layers
    # layer_types names, full attention with an output gate elsewhere; its norms multiply by (1 + weight) except
    # the linear attention's gated norm (ssm_norm), as Gemma's
    "qwen3_next": GgufFamily("QWEN3NEXT", permute_qk=False, norm_offset=1.0, norm_offset_skip=("ssm_norm",)),
    # Qwen3.5 (conversion/qwen.py Qwen3_5TextModel): Qwen3-Next's linear attention with in_proj_qkv / in_proj_z /
    # in_proj_a / in_proj_b apart and its value heads reordered for llama.cpp's broadcast (llmc.formats.gguf)
    "qwen3_5_text": GgufFamily("QWEN35", permute_qk=False, norm_offset=1.0, norm_offset_skip=("ssm_norm",)),
    "qwen3_5_moe_text": GgufFamily("QWEN35MOE", permute_qk=False, norm_offset=1.0, norm_offset_skip=("ssm_norm",)),
    # Llama-4 text (conversion/llama.py Llama4Model, undo_permute = False): transformers' Llama-4 already rotates
    # adjacent pairs, as llama.cpp's normal rope does, so q/k keep their rows; MoE every interleave_moe_layer_step-th
    # layer with a shared expert, the dense layers' MLP intermediate_size_mlp wide
    "llama4_text": GgufFamily("LLAMA4", permute_qk=False),
    # Gemma-4 text (conversion/gemma.py Gemma4Model, norm_shift 0: its RMSNorm multiplies by the weight itself, not
    # 1 + weight; NeoX rope, so q/k keep their rows): per-layer input embeddings, sliding layers with their own head
    # width, KV-shared trailing layers, proportional rope on the full layers as the rope_freqs tensor; its MoE variant
    # (enable_moe_block): experts merged as ffn_gate_up_exps / ffn_down_exps beside the dense MLP, the router's
    # scale and per-expert scales (llmc.formats.gguf GATE_UP_EXPERTS, DIRECT_NAMES)
    "gemma4_text": GgufFamily("GEMMA4", permute_qk=False),
    # the dense newcomers of 2025-26 (issue 45), as convert_hf_to_gguf.py writes them
    # SmolLM3 (SmolLM3Model, a LlamaModel: q/k permuted for llama.cpp's normal rope): no rope on every 4th layer,
    # which src/models/smollm3.cpp fixes (n_no_rope_layer_step = 4: llmc.formats.gguf ARCH_CHECKS)
    "smollm3": GgufFamily("SMOLLM3", permute_qk=True),
    # OLMo 3 is llama.cpp's olmo2 architecture (Olmo2Model registers Olmo3ForCausalLM; no olmo3 architecture): OLMo 2's
    # post-norms and full-width q/k norms, with the sliding window and its per-layer pattern (FAMILY_KEYS)
    "olmo3": GgufFamily("OLMO2", permute_qk=False),
    # EXAONE 4 (Exaone4Model): post-norms, per-head q/k norms; NeoX rope, so q/k keep their rows
    "exaone4": GgufFamily("EXAONE4", permute_qk=False),
    # Seed-OSS (SeedOssModel): q/k/v biases, o_proj without; its pre-MLP norm is llama.cpp's attn_post_norm
    "seed_oss": GgufFamily("SEED_OSS", permute_qk=False),
    # Apertus (ApertusModel, undo_permute = False): per-head q/k norms, an up/down MLP with xIELU, whose four
    # per-layer parameters are the checkpoint's tensors and llama.cpp's per-layer key arrays (TENSOR_KEYS)
    "apertus": GgufFamily("APERTUS", permute_qk=False),
}
MOE_MODEL_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v32", "glm4_moe",
                             "minimax_m2", "gpt_oss", "qwen3_next", "qwen3_5_moe_text", "llama4_text", "gemma4_text"})

# Architectures llama.cpp 0.3.36 runs that the installed gguf package (gguf 0.19 on PyPI) does not name: GGUF
# architecture -> (llama.cpp's name for it, src/llama-arch.cpp LLM_ARCH_NAMES; the gguf.MODEL_ARCH whose tensor-name
# table holds every tensor that architecture loads). gguf 0.19 has no MODEL_ARCH.DEEPSEEK32; its GLM_DSA table (GLM-5's
# DeepSeek sparse attention) lists DeepSeek-V3's MLA and MoE tensors, attn_k_b / attn_v_b and the four indexer tensors
# under the names llama-arch.cpp gives LLM_ARCH_DEEPSEEK32's. Used only while the gguf package lacks the member.
GGUF_PACKAGE_GAPS: dict[str, tuple[str, str]] = {"DEEPSEEK32": ("deepseek32", "GLM_DSA")}

# model_type -> why llmc writes no GGUF for it (families llmc quantizes; each: whether llama.cpp has the architecture,
# and what is missing). Refused at plan time (llmc.runtimes.llama_cpp) and by the exporter.
GGUF_REFUSED: dict[str, str] = {
    # none today: DeepSeek-V3.2 (deepseek32), the last one, is written in the absorbed MLA form with its indexer
}

# What llmc's GGUF exporter does not write yet for a family it writes: (model_type, config key, the value transformers
# assumes when config.json lacks the key, the only value written, what is missing). Refused by the exporter.
GGUF_UNWRITTEN: tuple[tuple[str, str, object, object, str], ...] = ()


def unwritten_violations(config: dict) -> list[str]:
    """What in this config llmc's GGUF exporter does not write yet (GGUF_UNWRITTEN), one line each."""
    mt = config.get("model_type")
    return [f"{key} = {config.get(key, default)!r}: llmc does not write {what} yet"
            for family, key, default, want, what in GGUF_UNWRITTEN
            if family == mt and (config.get(key, default) or default) != want]

# What llama.cpp's graph fixes for an architecture rather than reading it from the file: (model_type, config key,
# value transformers assumes when config.json lacks the key, the value llama.cpp computes with, where it is fixed).
# A model whose config says otherwise would load and compute something else: refused by the exporter.
GGUF_FIXED: tuple[tuple[str, str, object, object, str], ...] = (
    ("qwen3_moe", "norm_topk_prob", False, True,
     "src/models/qwen3moe.cpp: build_moe_ffn(..., norm_w = true, ...) renormalises the top-k router weights"),
    ("qwen2_moe", "norm_topk_prob", False, False,
     "src/models/qwen2moe.cpp: build_moe_ffn(..., norm_w = false, ...) keeps the softmax weights unnormalised"),
    ("minimax_m2", "norm_topk_prob", True, True,
     "src/models/minimax-m2.cpp: build_moe_ffn(..., norm_w = true, ...)"),
    ("deepseek_v3", "rope_interleave", True, True,
     "src/models/deepseek2.cpp: ggml's normal rope on adjacent pairs (DeepSeek's interleaved rope dims)"),
    ("deepseek_v3", "topk_method", "noaux_tc", "noaux_tc",
     "src/models/deepseek2.cpp: sigmoid scores + exp_probs_b bias, DeepSeek-V3's noaux_tc routing"),
    ("qwen3_next", "norm_topk_prob", True, True,
     "src/models/qwen3next.cpp: build_moe_ffn(..., norm_w = true, ...) renormalises the top-k router weights"),
    ("qwen3_next", "mlp_only_layers", [], [],
     "src/models/qwen3next.cpp: every layer loads the experts (ffn_gate_inp, flags 0): no dense-MLP layers"),
    ("qwen3_next", "decoder_sparse_step", 1, 1, "src/models/qwen3next.cpp: every layer is a Mixture-of-Experts layer"),
    ("llama4_text", "attention_chunk_size", 8192, 8192,
     "src/models/llama4.cpp: load_arch_hparams sets the chunked-attention window n_swa = 8192"),
    ("llama4_text", "floor_scale", 8192, 8192, "src/models/llama4.cpp: n_attn_temp_floor_scale = 8192"),
    ("llama4_text", "attn_scale", 0.1, 0.1, "src/models/llama4.cpp: f_attn_temp_scale = 0.1"),
    ("llama4_text", "attn_temperature_tuning", True, True,
     "src/models/llama4.cpp: the no-rope layers' query temperature is always applied"),
    ("gpt_oss", "swiglu_limit", 7.0, 7.0,
     "src/llama-graph.cpp: LLM_FFN_SWIGLU_OAI_MOE clamps the experts' gate/up at the constant limit 7.0"),
    ("smollm3", "use_sliding_window", False, False,
     "src/models/smollm3.cpp: every layer attends to the whole context (build_attn_inp_kv, no sliding window)"),
)


def fixed_fact_violations(config: dict) -> list[str]:
    """What in this config llama.cpp's graph for its family computes differently (GGUF_FIXED), one line each."""
    mt = config.get("model_type")
    return [f"{key} = {config.get(key, default)!r}, but llama.cpp computes with {want!r} ({where})"
            for family, key, default, want, where in GGUF_FIXED
            if family == mt and config.get(key, default) != want]
