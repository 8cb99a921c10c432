"""Tiny random models of every dense family llmc supports, built from transformers' own config classes: the
layouts the tests check layer discovery, quantization and export on (tests/unit/test_families.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import make_tokenizer

_COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "max_position_embeddings": 1024, "tie_word_embeddings": True}

# gated-DeltaNet linear attention in layer 0, full attention in layer 1 (Qwen3-Next, Qwen3.5): 4 value heads, so
# in_proj_b / in_proj_a have 4 rows (in_proj_ba 8)
_DELTANET = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}

# family -> (model_type, config overrides): each shows what sets the family apart
FAMILIES: dict[str, tuple[str, dict]] = {
    # no grouped-query attention, so v_proj -> o_proj is a smoothing pair; Llama-3.1's rope scaling
    "llama": ("llama", {"num_key_value_heads": 4, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}, "rope_theta": 500000.0}),
    "mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": ("qwen2", {"num_key_value_heads": 2}),  # q/k/v biases
    "qwen3": ("qwen3", {"num_key_value_heads": 2, "head_dim": 16}),  # q_norm / k_norm after the projections
    "gemma2": ("gemma2", {"num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3_text", {"num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                                   "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {"num_key_value_heads": 4, "pad_token_id": 0}),  # fused qkv_proj and gate_up_proj
    "granite": ("granite", {"num_key_value_heads": 2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    "olmo2": ("olmo2", {"num_key_value_heads": 4}),  # norms after attention and MLP, q/k norms
    # layer 0 gated-DeltaNet linear attention (in_proj_qkv, in_proj_z, in_proj_b / in_proj_a kept in float, conv1d,
    # out_proj), layer 1 full attention with an output gate (q_proj twice as wide), both zero-centred RMSNorms
    "qwen3_5": ("qwen3_5_text", {"num_key_value_heads": 2, "head_dim": 16, **_DELTANET}),
}

# what discovery finds per family (producer -> first consumer), the module docstring of mappings.py says why
EXPECTED_PAIRS: dict[str, list[tuple[str, str]]] = {
    "llama": [("input_layernorm", "self_attn.q_proj"), ("self_attn.v_proj", "self_attn.o_proj"),
              ("post_attention_layernorm", "mlp.gate_proj"), ("mlp.up_proj", "mlp.down_proj")],
    "mistral": [("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.gate_proj"),
                ("mlp.up_proj", "mlp.down_proj")],
    "gemma": [("input_layernorm", "self_attn.q_proj"), ("pre_feedforward_layernorm", "mlp.gate_proj"),
              ("mlp.up_proj", "mlp.down_proj")],
    "phi3": [("input_layernorm", "self_attn.qkv_proj"), ("self_attn.qkv_proj", "self_attn.o_proj"),
             ("post_attention_layernorm", "mlp.gate_up_proj"), ("mlp.gate_up_proj", "mlp.down_proj")],
    "olmo2": [("self_attn.v_proj", "self_attn.o_proj"), ("mlp.up_proj", "mlp.down_proj")],
}
# Mixture-of-Experts families (tests/unit/test_moe.py): 4 experts, top-2; transformers fuses their experts into 3-D
# parameters, the saved checkpoint names them per expert (Hub layout)
MOE_FAMILIES: dict[str, tuple[str, dict]] = {
    "mixtral": ("mixtral", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                            "sliding_window": None}),
    "qwen3_moe": ("qwen3_moe", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 128, "norm_topk_prob": True}),
    # biased experts, gate/up interleaved in a transposed [E, H, 2I] tensor, the clamped SwiGLU (limit lowered so the
    # tiny model's activations reach it), attention sinks, sliding/full layers (window 6 < the tests' 24 tokens);
    # its checkpoint holds the fused tensors (transformers has no per-expert conversion for it)
    "gpt_oss": ("gpt_oss", {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                            "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                            "swiglu_limit": 0.7, "rope_parameters": {
                                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0}}),
    # multi-head latent attention (q_lora_rank set: q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa ->
    # kv_a_layernorm -> kv_b_proj, interleaved rope on 8 of each head's dims), a shared expert, a sigmoid router with
    # e_score_correction_bias; every layer MoE here (first_k_dense_replace 0; tests/unit/test_deepseek.py mixes)
    "deepseek_v3": ("deepseek_v3", {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 128, "n_shared_experts": 1, "n_group": 1,
                                    "topk_group": 1, "first_k_dense_replace": 0, "q_lora_rank": 32,
                                    "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                                    "v_head_dim": 16, "routed_scaling_factor": 2.5}),
    # DeepSeek-V3.2: DeepSeek-V3's layers plus the lightning indexer in each attention block (wq_b from the query
    # latent, wk + k_norm + weights_proj from the hidden state: 4 heads of 16, half-split rope on 8 dims), which keeps
    # index_topk 8 of the tests' 24 tokens for each query, so the sparse selection changes the attention; every layer
    # MoE here (test_deepseek.py mixes)
    "deepseek_v32": ("deepseek_v32", {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 128, "n_shared_experts": 1, "n_group": 1,
                                      "topk_group": 1, "first_k_dense_replace": 0, "q_lora_rank": 32,
                                      "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                                      "v_head_dim": 16, "routed_scaling_factor": 2.5, "index_topk": 8,
                                      "index_n_heads": 4, "index_head_dim": 16}),
    # GLM-4.5: grouped-query attention with q/k/v biases, partial rotary and per-head q/k RMSNorms (use_qk_norm, as
    # recipes/configs/GLM-4.5/config.json; transformers' default is False), shared expert, DeepSeek's router
    "glm4_moe": ("glm4_moe", {"num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
                              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "attention_bias": True,
                              "use_qk_norm": True}),
    # a shared expert (an MLP, 96 wide) beside the routed ones, gated by a one-row Linear kept in float. No q/k/v
    # biases (the dense qwen2 family has them): with them, at N(0.2, 0.3), every token's router input is nearly the
    # same and this seed's router never picks expert 0 (the starved-expert tests starve expert 3 on purpose only)
    "qwen2_moe": ("qwen2_moe", {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 128, "shared_expert_intermediate_size": 96,
                                "norm_topk_prob": True, "qkv_bias": False}),
    # Qwen2-MoE's block; layer 0 gated-DeltaNet linear attention (in_proj_qkvz / in_proj_ba / conv1d / out_proj),
    # layer 1 full attention with an output gate
    "qwen3_next": ("qwen3_next", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 128, "shared_expert_intermediate_size": 96,
                                  "norm_topk_prob": True, **_DELTANET}),
    # Qwen3.5's separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, Qwen2-MoE's block
    "qwen3_5_moe": ("qwen3_5_moe_text", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                         "shared_expert_intermediate_size": 96, **_DELTANET}),
    # Mixtral's Hub names; sigmoid router with e_score_correction_bias, q/k norms over all heads, partial rotary
    "minimax_m2": ("minimax_m2", {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "rotary_dim": 8}),
}

# Llama-4 text (tests/unit/test_moe.py, its own tests: its experts take router-scaled inputs, so the generic MoE tests'
# direct computations do not apply): MoE in layer 1 only (interleave 2), a shared expert, chunked attention (chunks of
# 8 tokens < the tests' 24), the dense layer's MLP of its own width
LLAMA4: dict[str, tuple[str, dict]] = {
    "llama4_text": ("llama4_text", {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                                    "num_experts_per_tok": 2, "interleave_moe_layer_step": 2,
                                    "intermediate_size_mlp": 96, "attention_chunk_size": 8}),
}

# dense families with a Linear outside the decoder layers (tests/unit/test_export_described.py): Gemma-4's
# per-layer embeddings project the token embeddings through model.per_layer_model_projection (hidden -> layers x 8)
OUTER_LINEAR_FAMILIES: dict[str, tuple[str, dict]] = {
    "gemma4": ("gemma4_text", {"num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16, "sliding_window": 6,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "hidden_size_per_layer_input": 8}),
}

# Gemma-4's MoE variant (tests/unit/test_gemma4_moe.py): every layer runs a routed block (4 experts, top-2; router
# with its own norm, scale and per-expert scales) beside its dense MLP; the decoder layer is the block (experts and
# router directly in it, beside the per-layer-input Linears, 32 wide as in test_frontier_proof)
GEMMA4_MOE: dict[str, tuple[str, dict]] = {
    "gemma4_moe": ("gemma4_text", {**OUTER_LINEAR_FAMILIES["gemma4"][1], "hidden_size_per_layer_input": 32,
                                   "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                   "moe_intermediate_size": 128}),
}

# Gemma-4 as its GGUF tests build it (tests/unit/test_gguf_gemma4.py, tests/integration/test_gguf_moe_llamacpp.py):
# every feature llama.cpp's gemma4 reads beyond Gemma 3's: the full layers' heads twice as wide as the sliding ones
# (key_length vs key_length_swa), one KV head there with values from k_proj (attention_k_eq_v: no v_proj), the last
# two layers KV-shared (reading layers 0 and 1), their MLPs double-wide
GEMMA4_GGUF = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
               "global_head_dim": 32, "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "attention_k_eq_v": True,
               "num_global_key_value_heads": 1}

# dense families of 2025-26 (issue 45, tests/unit/test_frontier_proof.py): each builds with llmc unchanged
NEWCOMER_FAMILIES: dict[str, tuple[str, dict]] = {
    # NoPE in every 4th layer (none of the 2 here)
    "smollm3": ("smollm3", {"num_key_value_heads": 2, "pad_token_id": 0}),  # its default pad id is past the vocabulary
    # OLMo 2's post-norms with sliding/full layers (window 6 < the tests' 24 tokens)
    "olmo3": ("olmo3", {"num_key_value_heads": 2, "sliding_window": 6,
                        "layer_types": ["sliding_attention", "full_attention"]}),
    # post-norms, q/k norms, sliding/full layers (NoPE on the full ones)
    "exaone4": ("exaone4", {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "seed_oss": ("seed_oss", {"num_key_value_heads": 2, "head_dim": 16}),  # q/k/v biases, o_proj without
    # xIELU activation (no gate_proj), q/k norms; its llama3 rope needs more positions than the original 8192
    "apertus": ("apertus", {"num_key_value_heads": 2, "max_position_embeddings": 16384}),
}

for _f in ("qwen2", "qwen3", "granite"):
    EXPECTED_PAIRS[_f] = EXPECTED_PAIRS["mistral"]
# per layer where layers differ: Qwen3.5's linear-attention layer 0 (its kept in_proj_b / in_proj_a are scaled with
# the pair, never quantized), full-attention layer 1
EXPECTED_PAIRS_BY_LAYER: dict[str, list[list[tuple[str, str]]]] = {
    "qwen3_5": [[("input_layernorm", "linear_attn.in_proj_qkv"), *EXPECTED_PAIRS["mistral"][1:]],
                EXPECTED_PAIRS["mistral"]],
}
# Linears each layer quantizes (7: q, k, v, o, gate, up, down), where a family differs
QUANTIZED_LINEARS: dict[str, int] = {"phi3": 2 * 4, "qwen3_5": 6 + 7}  # Qwen3.5: in_proj_qkv, in_proj_z, out_proj
EXPECTED_PAIRS["gemma2"] = EXPECTED_PAIRS["gemma3"] = EXPECTED_PAIRS.pop("gemma")


def make_tiny(family: str, folder: Path, *, seed: int = 0, **config) -> Path:
    """A random `family` model (2 layers, hidden 64, unless `config` says otherwise) and a tokenizer, saved as a
    safetensors folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = {**FAMILIES, **MOE_FAMILIES, **LLAMA4, **OUTER_LINEAR_FAMILIES, **GEMMA4_MOE,
                             **NEWCOMER_FAMILIES}[family]
    tok = make_tokenizer()
    torch.manual_seed(seed)
    if family in OUTER_LINEAR_FAMILIES or family in GEMMA4_MOE:
        overrides = {**overrides, "vocab_size_per_layer_input": len(tok)}
    if model_type.startswith("qwen3_5"):  # transformers reads it as Qwen3_5Tokenizer, whose default pad token
        tok.pad_token = tok.eos_token  # (<|endoftext|>) this vocabulary lacks: it would be added past the embedding
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, **{**_COMMON, **overrides, **config})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so quantization error is visible; norms away from 0 and 1
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.normal_(0.2, 0.3)  # MoE: fused 3-D experts are weights
            # gpt-oss's biases drawn as wide as the norms' weights would fix the routing (o_proj's bias adds one
            # vector to every token, the router's shifts every logit)
            if family in MOE_FAMILIES and name.endswith("bias"):
                p.normal_(0, 0.05)
        for name, b in model.named_buffers():  # MiniMax-M2's router bias (a buffer, zeros by default) moves routing
            if family == "minimax_m2" and name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return Path(folder)
