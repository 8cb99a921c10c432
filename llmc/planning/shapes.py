"""A model's tensors as the planner needs them: names and shapes from safetensors headers, or from config.json
alone (planning a Hub model offline from the config kept beside its recipe, recipes/configs/).

The config path writes the tensor names and shapes Hugging Face checkpoints of these architectures hold (Llama,
Mistral, Qwen2/3 dense; Qwen3-MoE, Mixtral, DeepSeek-V3 with its latent attention, GLM-4.5, Qwen3-Next with its
linear attention, Llama-4 text and gpt-oss experts as one Linear per expert), and the bytes a quantized original
stores them in (FP8 block-wise, MXFP4). Its totals equal the published
checkpoints' (Llama-3.1-8B: 8,030,261,248 parameters; Llama-3.3-70B: 70,553,706,496; tests/unit/test_plan_scale.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import InputError
from llmc.model.families import expert_count

_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


@dataclass
class ModelTensors:
    """name -> shape, and the bytes each tensor takes where it is stored (None when planned from a config)."""

    shapes: dict[str, tuple[int, ...]]
    stored_bytes: dict[str, int] | None = None
    layer_of: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.shapes:
            m = _LAYER.match(name)
            if m:
                self.layer_of[name] = int(m.group(1))

    @staticmethod
    def numel(shape: tuple[int, ...]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    @property
    def params(self) -> int:
        return sum(self.numel(s) for s in self.shapes.values())

    def layer_params(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for name, i in self.layer_of.items():
            out[i] = out.get(i, 0) + self.numel(self.shapes[name])
        return out

    @property
    def outer_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, output head."""
        return sum(self.numel(s) for n, s in self.shapes.items() if n not in self.layer_of)

    @property
    def head_params(self) -> int:
        """Parameters of an output head of its own (none when tied to the input embeddings)."""
        from llmc.model.checks import HEAD_SUFFIXES

        return sum(self.numel(s) for n, s in self.shapes.items() if n not in self.layer_of and n.endswith(HEAD_SUFFIXES))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """2-D weights other than embeddings: module name -> (out, in), as check_model takes them."""
        return {n[: -len(".weight")]: (s[0], s[1]) for n, s in self.shapes.items()
                if n.endswith(".weight") and len(s) == 2 and "embed" not in n}

    def stored_total(self, elem: int) -> int:
        return sum(self.stored_bytes.values()) if self.stored_bytes else self.params * elem


def from_headers(folder: Path) -> ModelTensors:
    """The tensors as the build reads them: a quantized original's (llmc.model.source_formats) decoded, each
    costing the bytes of its stored parts to read."""
    from llmc.model.checkpoint import check_safetensors_header, read_model_config, safetensors_files
    from llmc.model.source_formats import decoding_map, source_format

    shapes: dict[str, tuple[int, ...]] = {}
    stored: dict[str, int] = {}
    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in safetensors_files(folder):
        for name, info in check_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(info["shape"])
            stored[name] = info["data_offsets"][1] - info["data_offsets"][0]
            header[name] = (info["dtype"], shapes[name])
    fmt = source_format(read_model_config(Path(folder)))
    if fmt is not None:
        decoded, hidden = decoding_map(fmt, header)
        for name, parts in decoded.items():
            shapes[name] = parts.shape
            stored[name] = stored.pop(parts.codes) + stored.pop(parts.scale)
            hidden -= {parts.codes, parts.scale}
            shapes.pop(parts.scale, None)
            if parts.codes != name:
                shapes.pop(parts.codes, None)
        for name in hidden:  # static activation scales: read with the layer, not a weight
            shapes.pop(name, None)
    if any(n.endswith(".experts.gate_up_proj") for n in shapes):
        shapes, stored = _experts_per_expert(folder, shapes, stored)
    return ModelTensors(shapes, stored)


def _experts_per_expert(folder: Path, shapes: dict[str, tuple[int, ...]],
                        stored: dict[str, int]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """A family whose Hub checkpoints hold fused 3-D experts (gpt-oss): the per-expert Linears the build reads them
    as (llmc.quant.moe.per_expert_tensors), each stored in its share of the fused tensor's bytes. Other families'
    fused tensors stay as they are (the build refuses them, naming the missing per-expert tensor)."""
    from llmc.model.checkpoint import read_model_config
    from llmc.model.families import LAYOUTS
    from llmc.quant.moe import per_expert_shapes

    layout = LAYOUTS.get(read_model_config(folder).get("model_type"))
    if layout is None or not layout.checkpoint_fused:
        return shapes, stored
    split = per_expert_shapes(shapes, layout)
    fused = [n for n in shapes if n not in split]
    per_element = sum(stored[n] for n in fused) / max(sum(ModelTensors.numel(shapes[n]) for n in fused), 1)
    return split, {n: stored[n] if n in stored else round(ModelTensors.numel(s) * per_element)
                   for n, s in split.items()}


# model_types planned from config.json alone: the dense decoders and MoE families whose Hub tensor names and shapes
# `from_config` writes
CONFIG_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe",
                   "qwen3_next", "llama4_text", "gpt_oss")


def from_config(config: dict) -> ModelTensors:
    """The tensors a Hugging Face checkpoint of this config holds, as the build reads them: fused experts (gpt-oss,
    Llama-4) split per expert, a quantized original (DeepSeek's FP8 block-wise, gpt-oss's MXFP4) decoded, each
    tensor costing the bytes its stored parts take (`_stored_bytes`)."""
    kind = config.get("model_type")
    h, n_layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    inter = config.get("intermediate_size") or 4 * h
    if kind not in CONFIG_FAMILIES:
        raise InputError(f"planning from config.json alone knows the {', '.join(CONFIG_FAMILIES)} layouts, not "
                         f"{kind!r}", fix="plan with the checkpoint itself (model.source: its folder)")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    attn_bias = kind == "qwen2" or bool(config.get("attention_bias"))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "deepseek_v3":
            shapes.update(_mla(config, p, h, heads))
        elif kind == "qwen3_next" and _layer_type(config, i) == "linear_attention":
            shapes.update(_gated_deltanet(config, p, h))
        else:
            # Qwen3-Next's full attention: q_proj holds the query and its output gate (attn_output_gate)
            q_out = heads * head_dim * (2 if kind == "qwen3_next" else 1)
            for proj, out in (("q_proj", q_out), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)):
                shapes[f"{p}self_attn.{proj}.weight"] = (out, h)
                if attn_bias:
                    shapes[f"{p}self_attn.{proj}.bias"] = (out,)
            shapes[f"{p}self_attn.o_proj.weight"] = (h, heads * head_dim)
            if kind == "gpt_oss":  # o_proj biased too, and one attention sink per head
                shapes[f"{p}self_attn.o_proj.bias"] = (h,)
                shapes[f"{p}self_attn.sinks"] = (heads,)
            if kind in ("qwen3", "qwen3_moe", "qwen3_next") or kind == "glm4_moe" and config.get("use_qk_norm"):
                shapes[f"{p}self_attn.q_norm.weight"] = (head_dim,)
                shapes[f"{p}self_attn.k_norm.weight"] = (head_dim,)
        if kind in ("deepseek_v3", "glm4_moe"):
            shapes.update(_deepseek_mlp(config, i, p, h, inter))
        elif kind in ("llama4_text", "gpt_oss"):
            shapes.update(_fused_experts(config, kind, i, p, h, inter))
        else:
            shapes.update(_mlp(config, kind, i, p, h, inter))
    return ModelTensors(shapes, _stored_bytes(config, shapes))


def _mlp(config: dict, kind: str, i: int, p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    if kind == "mixtral":
        experts = config["num_local_experts"]
        out = {f"{p}block_sparse_moe.gate.weight": (experts, h)}
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            out |= {q + "w1.weight": (inter, h), q + "w2.weight": (h, inter), q + "w3.weight": (inter, h)}
        return out
    sparse = kind in ("qwen3_moe", "qwen3_next") and i not in (config.get("mlp_only_layers") or []) and (
        config.get("num_experts", 0) > 0 and (i + 1) % (config.get("decoder_sparse_step") or 1) == 0)
    if not sparse:
        return {f"{p}mlp.gate_proj.weight": (inter, h), f"{p}mlp.up_proj.weight": (inter, h),
                f"{p}mlp.down_proj.weight": (h, inter)}
    experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
    out = {f"{p}mlp.gate.weight": (experts, h)}
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        out |= {q + "gate_proj.weight": (moe_inter, h), q + "up_proj.weight": (moe_inter, h),
                q + "down_proj.weight": (h, moe_inter)}
    if kind == "qwen3_next":  # Qwen2-MoE's block: a shared expert and its one-row sigmoid gate
        out |= _swiglu(f"{p}mlp.shared_expert.", config["shared_expert_intermediate_size"], h)
        out[f"{p}mlp.shared_expert_gate.weight"] = (1, h)
    return out


def _layer_type(config: dict, i: int) -> str:
    types = config.get("layer_types")
    if types:
        return types[i]
    return "full_attention" if (i + 1) % (config.get("full_attention_interval") or 4) == 0 else "linear_attention"


def _mla(config: dict, p: str, h: int, heads: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's multi-head latent attention: low-rank query (q_lora_rank; none: a full q_proj) and a shared
    compressed key/value (kv_lora_rank) plus one rope key, expanded per head by kv_b_proj."""
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
    a = f"{p}self_attn."
    out: dict[str, tuple[int, ...]] = {}
    if q_rank:
        out |= {a + "q_a_proj.weight": (q_rank, h), a + "q_a_layernorm.weight": (q_rank,),
                a + "q_b_proj.weight": (heads * (nope + rope), q_rank)}
    else:
        out[a + "q_proj.weight"] = (heads * (nope + rope), h)
    return out | {a + "kv_a_proj_with_mqa.weight": (kv_rank + rope, h), a + "kv_a_layernorm.weight": (kv_rank,),
                  a + "kv_b_proj.weight": (heads * (nope + v), kv_rank), a + "o_proj.weight": (h, heads * v)}


def _gated_deltanet(config: dict, p: str, h: int) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's linear-attention layer (transformers' Qwen3NextGatedDeltaNet)."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim = k_heads * config["linear_key_head_dim"]
    value_dim = v_heads * config["linear_value_head_dim"]
    a = f"{p}linear_attn."
    return {a + "in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, h), a + "in_proj_ba.weight": (2 * v_heads, h),
            a + "conv1d.weight": (2 * key_dim + value_dim, 1, config["linear_conv_kernel_dim"]),
            a + "dt_bias": (v_heads,), a + "A_log": (v_heads,), a + "norm.weight": (config["linear_value_head_dim"],),
            a + "out_proj.weight": (h, value_dim)}


def _swiglu(prefix: str, inter: int, h: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
            prefix + "down_proj.weight": (h, inter)}


def _deepseek_mlp(config: dict, i: int, p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3 / GLM-4.5: a dense MLP in the first `first_k_dense_replace` layers, then routed experts, the
    shared experts (one MLP n_shared_experts wide) and the sigmoid router with its score-correction bias."""
    if i < (config.get("first_k_dense_replace") or 0):
        return _swiglu(f"{p}mlp.", inter, h)
    experts, moe_inter = config["n_routed_experts"], config["moe_intermediate_size"]
    out = {f"{p}mlp.gate.weight": (experts, h), f"{p}mlp.gate.e_score_correction_bias": (experts,)}
    for e in range(experts):
        out |= _swiglu(f"{p}mlp.experts.{e}.", moe_inter, h)
    return out | _swiglu(f"{p}mlp.shared_experts.", moe_inter * (config.get("n_shared_experts") or 1), h)


def _fused_experts(config: dict, kind: str, i: int, p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss and Llama-4: fused 3-D experts in the Hub checkpoint, split per expert as the build reads them
    (llmc.quant.moe.per_expert_shapes)."""
    from llmc.model.families import LAYOUTS
    from llmc.quant.moe import per_expert_shapes

    experts = config["num_local_experts"]
    if kind == "llama4_text":
        moe_layers = config.get("moe_layers")
        if moe_layers is None:
            step = config.get("interleave_moe_layer_step") or 1
            moe_layers = list(range(step - 1, config["num_hidden_layers"], step))
        if i not in moe_layers:
            return _swiglu(f"{p}feed_forward.", config.get("intermediate_size_mlp") or inter, h)
        b = f"{p}feed_forward."
        fused = {b + "experts.gate_up_proj": (experts, h, 2 * inter), b + "experts.down_proj": (experts, inter, h)}
        return {b + "router.weight": (experts, h), **_swiglu(b + "shared_expert.", inter, h),
                **per_expert_shapes(fused, LAYOUTS[kind])}
    b = f"{p}mlp."
    fused = {b + "experts.gate_up_proj": (experts, h, 2 * inter), b + "experts.gate_up_proj_bias": (experts, 2 * inter),
             b + "experts.down_proj": (experts, inter, h), b + "experts.down_proj_bias": (experts, h)}
    return {b + "router.weight": (experts, h), b + "router.bias": (experts,), **per_expert_shapes(fused, LAYOUTS[kind])}


def _stored_bytes(config: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, int] | None:
    """Bytes each tensor of a quantized original takes in its Hub checkpoint (None: all in the config's dtype). FP8
    block-wise (DeepSeek-V3/R1, Kimi-K2): every decoder-layer Linear weight but the router, one byte an element plus
    a float32 scale per block; MXFP4 (gpt-oss): the routed experts' weights, half a byte an element plus one E8M0
    byte per 32; the rest in the config's dtype."""
    from llmc.model.source_formats import MXFP4_BYTES_PER_BLOCK, source_format

    fmt = source_format(config)
    if fmt is None or fmt.name == "fp8-tensor":
        return None
    elem = 4 if config.get("torch_dtype", config.get("dtype")) == "float32" else 2
    out: dict[str, int] = {}
    for name, shape in shapes.items():
        n = ModelTensors.numel(shape)
        layer_linear = _LAYER.match(name) and name.endswith(".weight") and len(shape) == 2 and "layernorm" not in name
        if fmt.name == "fp8-block" and layer_linear and not re.search(r"\.(gate|router)\.weight$", name):
            rows, cols = fmt.block
            out[name] = n + -(-shape[0] // rows) * -(-shape[1] // cols) * 4
        elif fmt.name == "mxfp4" and layer_linear and ".experts." in name:
            out[name] = n // 2 + n // (2 * MXFP4_BYTES_PER_BLOCK)
        else:
            out[name] = n * elem
    return out


def inputs_per_token(linears: dict[str, tuple[int, int]], config: dict) -> float:
    """Input elements one token feeds these Linears (`linears`: name -> (out, in)), a routed expert's at the share
    of tokens it gets (`active_fraction`): what a hook on every Linear's input touches per token."""
    routed = active_fraction(config)
    return sum(i * (routed if ".experts." in n else 1.0) for n, (_, i) in linears.items())


def active_fraction(config: dict) -> float:
    """The share of expert parameters a token runs through (1 for dense models): top-k of the experts."""
    experts = expert_count(config)  # DeepSeek's n_routed_experts too
    top = config.get("num_experts_per_tok") or experts
    return top / experts if experts else 1.0


@dataclass
class Shape:
    """The sizes the stages' cost models use, from the tensors and config."""

    params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    layer_params: int  # the largest decoder layer
    outer_params: int
    largest_linear: int  # elements of the largest quantized Linear weight
    widest_input: int  # the largest Linear input width (GPTQ's Hessian side)
    intermediate: int
    attn_width: int
    active: float  # share of a layer's parameters one token runs through (MoE < 1)
    stored_bytes: int
    head_params: int = 0  # an untied output head's, in outer_params (the calibration skeleton leaves it unread)

    @classmethod
    def of(cls, tensors: ModelTensors, config: dict, elem: int) -> Shape:
        per_layer = tensors.layer_params()
        linears = tensors.linear_shapes()
        in_layers = {n: s for n, s in linears.items() if f"{n}.weight" in tensors.layer_of}
        h = config.get("hidden_size", 0)
        heads = config.get("num_attention_heads", 1)
        # a routed expert's width for MoE models (DeepSeek's n_routed_experts, Mixtral's num_local_experts too)
        inter = (config.get("moe_intermediate_size") if expert_count(config) else None) or config.get("intermediate_size")
        fraction = active_fraction(config)
        largest = max(per_layer.values()) if per_layer else 0
        experts = sum(tensors.numel(s) for n, s in in_layers.items() if ".experts." in n) / max(len(per_layer), 1)
        active = (largest - experts * (1 - fraction)) / largest if largest else 1.0
        return cls(params=tensors.params, layers=config.get("num_hidden_layers", 1), hidden=h, heads=heads,
                   vocab=config.get("vocab_size", 0), layer_params=largest, outer_params=tensors.outer_params,
                   largest_linear=max((a * b for a, b in in_layers.values()), default=0),
                   widest_input=max((b for _, b in in_layers.values()), default=h),
                   intermediate=inter or 4 * h, attn_width=heads * (config.get("head_dim") or h // max(heads, 1)),
                   active=active, stored_bytes=tensors.stored_total(elem), head_params=tensors.head_params)
