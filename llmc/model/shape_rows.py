"""The tensors each family's Hub checkpoints hold, as rows: one row per model_type, one fact per field, read by
`llmc.planning.shapes.from_config` (planning a Hub model from config.json alone). Widths come from the config keys
a row names; the MoE block's names (block, experts' projections, router, shared expert and its gate, fused or per
expert in the checkpoint) are the family's `llmc.model.families.LAYOUTS` row, not restated here.

The gguf-py way (gguf/tensor_mapping.py): what differs between families is data, so a new family is a row, and
tests/unit/test_plan_scale.py holds every row's parameter count to transformers' own model of the same config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShapeRow:
    """What a decoder layer of one family holds beyond the Llama layout (the defaults)."""

    # "gqa": q/k/v/o projections; "mla": DeepSeek's latent attention (q_lora_rank, kv_lora_rank, nope/rope/v widths)
    attention: str = "gqa"
    # DeepSeek-V3.2's lightning indexer in each MLA block (self_attn.indexer: wq_b, wk, k_norm LayerNorm, weights_proj;
    # widths index_n_heads x index_head_dim)
    indexer: bool = False
    q_gate: bool = False  # q_proj also holds the output gate (Qwen3-Next / Qwen3.5 attn_output_gate): twice the rows
    # biases on q/k/v: True, False, or the config key that says (None: "attention_bias")
    qkv_bias: bool | str | None = None
    o_bias: bool | str = False  # o_proj's bias: True, or the config key that says (Seed-OSS attention_out_bias)
    sinks: bool = False  # one learned attention sink per head (gpt-oss self_attn.sinks)
    # q_norm/k_norm: "head" (one head_dim vector, Qwen3), "full" (all heads' width, OLMo-3 / MiniMax-M2), None
    qk_norm: str | None = None
    qk_norm_key: str | None = None  # the config key that switches qk_norm on (GLM-4.5 use_qk_norm); None: always
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # the decoder layer's own norms
    # the dense MLP: "swiglu" (gate/up/down), "up_down" with a learned activation (Apertus' xIELU alpha_p/alpha_n)
    mlp: str = "swiglu"
    dense_mlp: str = "mlp"  # the dense MLP's name in the layer (Llama-4: feed_forward)
    dense_width: str = "intermediate_size"  # its width's config key (Llama-4: intermediate_size_mlp)
    # gated-DeltaNet linear attention in the layers config.layer_types (or full_attention_interval) marks
    # linear_attention: "qkvz" (Qwen3-Next: in_proj_qkvz + in_proj_ba), "qkv_z_b_a" (Qwen3.5: four projections)
    linear_attention: str | None = None
    # MoE (the family has a LAYOUTS row): which layers are sparse ("all", "first_k_dense": first_k_dense_replace,
    # "sparse_step": mlp_only_layers + decoder_sparse_step, "moe_layers": moe_layers / interleave_moe_layer_step,
    # "enable_moe_block": every layer where that config key is true, none otherwise: Gemma-4)
    sparse_layers: str = "all"
    expert_width: str = "moe_intermediate_size"  # a routed expert's width's config key
    # the shared expert's width: (config key, config key of a multiplier or None) (DeepSeek: moe width x n_shared)
    shared_width: tuple[str, str | None] | None = None
    router_bias: bool = False  # the router Linear has a bias (gpt-oss)
    score_bias: str | None = None  # the sigmoid router's e_score_correction_bias, its name inside the MoE block
    # per-layer input embeddings (Gemma-4 hidden_size_per_layer_input): outside the layers the packed embedding,
    # its projection from the hidden state and that projection's norm; in each layer an input gate, a projection
    # back to the hidden size and its norm
    per_layer_inputs: bool = False
    layer_scalar: bool = False  # one scalar per layer the checkpoints hold (Gemma-4 layer_scalar, a buffer)
    # each layer's head width and KV heads by its type (`layer_attention`), the last num_kv_shared_layers reading
    # earlier layers' keys/values (no k/v projections or k norm) with MLPs twice as wide under use_double_wide_mlp,
    # full layers without v_proj under attention_k_eq_v (Gemma-4)
    per_layer_attention: bool = False
    # Gemma-4's MoE variant (sparse_layers "enable_moe_block": every layer): the MoE block runs beside the dense MLP,
    # with the norms only such a layer has and the router's vectors besides its weight (name -> "hidden" / "experts")
    moe_beside_mlp: bool = False
    moe_norms: tuple[str, ...] = ()
    router_vectors: tuple[tuple[str, str], ...] = ()


_QWEN3 = ShapeRow(qk_norm="head")
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
_QWEN2_MOE_SHARED = ("shared_expert_intermediate_size", None)
_DEEPSEEK_MOE = dict(sparse_layers="first_k_dense", shared_width=("moe_intermediate_size", "n_shared_experts"),
                     score_bias="gate.e_score_correction_bias")
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")  # OLMo-2/3, EXAONE-4: norms after each block

SHAPE_ROWS: dict[str, ShapeRow] = {
    "llama": ShapeRow(),
    "mistral": ShapeRow(),
    "qwen2": ShapeRow(qkv_bias=True),
    "qwen3": _QWEN3,
    "smollm3": ShapeRow(),
    "seed_oss": ShapeRow(o_bias="attention_out_bias"),
    "olmo3": ShapeRow(qk_norm="full", norms=_POST_NORMS),
    "exaone4": ShapeRow(qk_norm="head", norms=_POST_NORMS),
    "apertus": ShapeRow(qk_norm="head", norms=("attention_layernorm", "feedforward_layernorm"), mlp="up_down"),
    "qwen3_5_text": ShapeRow(qk_norm="head", q_gate=True, linear_attention="qkv_z_b_a"),
    "gemma4_text": ShapeRow(qk_norm="head", norms=_GEMMA_NORMS, per_layer_inputs=True, layer_scalar=True,
                            per_layer_attention=True, sparse_layers="enable_moe_block", moe_beside_mlp=True,
                            moe_norms=("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                                       "pre_feedforward_layernorm_2"),
                            router_vectors=(("router.scale", "hidden"), ("router.per_expert_scale", "experts"))),
    # MoE families (the names of their blocks: families.LAYOUTS)
    "mixtral": ShapeRow(expert_width="intermediate_size"),
    "minimax_m2": ShapeRow(qk_norm="full", expert_width="intermediate_size", score_bias="e_score_correction_bias"),
    "qwen3_moe": ShapeRow(qk_norm="head", sparse_layers="sparse_step"),
    "qwen2_moe": ShapeRow(qkv_bias=True, sparse_layers="sparse_step", shared_width=_QWEN2_MOE_SHARED),
    "qwen3_next": ShapeRow(qk_norm="head", q_gate=True, linear_attention="qkvz", sparse_layers="sparse_step",
                           shared_width=_QWEN2_MOE_SHARED),
    "qwen3_5_moe_text": ShapeRow(qk_norm="head", q_gate=True, linear_attention="qkv_z_b_a",
                                 shared_width=_QWEN2_MOE_SHARED),
    "deepseek_v3": ShapeRow(attention="mla", **_DEEPSEEK_MOE),
    "deepseek_v32": ShapeRow(attention="mla", indexer=True, **_DEEPSEEK_MOE),
    "glm4_moe": ShapeRow(qk_norm="head", qk_norm_key="use_qk_norm", **_DEEPSEEK_MOE),
    "llama4_text": ShapeRow(dense_mlp="feed_forward", dense_width="intermediate_size_mlp", sparse_layers="moe_layers",
                            expert_width="intermediate_size", shared_width=("intermediate_size", None)),
    "gpt_oss": ShapeRow(o_bias=True, sinks=True, expert_width="intermediate_size", router_bias=True),
}


# the config key that names the full-attention layers' value of a per-layer attention key (Gemma4TextConfig)
_GLOBAL_KEYS = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}


def layer_attention(config: dict, key: str) -> list[int]:
    """Each layer's `key` (head_dim or num_key_value_heads) as transformers' Gemma4TextConfig resolves it: the
    per_layer_config overrides where config.json holds them (what transformers 5.x saves), else the full layers'
    global_head_dim (transformers' default 512) and, with attention_k_eq_v, num_global_key_value_heads; the config's
    own value elsewhere."""
    types = config["layer_types"]
    base = config.get(key) or config["num_attention_heads"]
    if "per_layer_config" in config:
        per_layer = {int(i): v for i, v in (config["per_layer_config"] or {}).items()}
        return [int(per_layer.get(i, {}).get(key, base)) for i in range(len(types))]
    full = config.get(_GLOBAL_KEYS[key])
    if key == "head_dim" and full is None:
        full = 512
    if key == "num_key_value_heads" and not config.get("attention_k_eq_v"):
        full = None
    return [int(full if t == "full_attention" and full is not None else base) for t in types]
