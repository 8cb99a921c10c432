"""A model's tensors as the planner needs them: names and shapes from safetensors headers, or from config.json
alone (planning a Hub model offline from the config kept beside its recipe, recipes/configs/).

The config path writes the tensor names and shapes Hugging Face checkpoints of the families with a row in
llmc.model.shape_rows hold (dense decoders; MoE families under their families.LAYOUTS names, MLA, gated-DeltaNet
linear attention, fused Llama-4 / gpt-oss experts as one Linear per expert), and the bytes a quantized original
stores them in (FP8 block-wise, MXFP4). Its totals equal the published
checkpoints' (Llama-3.1-8B: 8,030,261,248 parameters; Llama-3.3-70B: 70,553,706,496; tests/unit/test_plan_scale.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import InputError
from llmc.model.families import LAYOUTS, MoeLayout, expert_count, experts_per_token
from llmc.model.shape_rows import SHAPE_ROWS, ShapeRow, layer_attention

_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


@dataclass
class ModelTensors:
    """name -> shape, and the bytes each tensor takes where it is stored (None when planned from a config)."""

    shapes: dict[str, tuple[int, ...]]
    stored_bytes: dict[str, int] | None = None
    layer_of: dict[str, int] = field(default_factory=dict)
    source_format: object = None  # a quantized original's llmc.model.source_formats.SourceFormat
    decoded: frozenset[str] = frozenset()  # its tensors decoded as they are read
    # the weights files the headers came from (llmc.model.checkpoint.safetensors_files: an index's shards, checked);
    # () when planned from a config
    files: tuple[Path, ...] = ()

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

    def largest_layer_read(self, elem: int) -> tuple[int, int]:
        """(stored bytes, decoded elements) of the decoder layer with the most parameters: what the stream reads
        for it (a quantized original's codes and scales, not `elem` bytes a weight) and decodes."""
        per_layer = self.layer_params()
        if not per_layer:
            return 0, 0
        i = max(per_layer, key=per_layer.__getitem__)
        stored = per_layer[i] * elem
        if self.stored_bytes:
            stored = sum(b for n, b in self.stored_bytes.items() if (m := _LAYER.match(n)) and int(m.group(1)) == i)
        decoded = sum(self.numel(self.shapes[n]) for n in self.decoded if self.layer_of.get(n) == i)
        return stored, decoded


def from_headers(folder: Path) -> ModelTensors:
    """The tensors as the build reads them: a quantized original's (llmc.model.source_formats) decoded, each
    costing the bytes of its stored parts to read."""
    from llmc.model.checkpoint import check_safetensors_header, folder_source_format, safetensors_files
    from llmc.model.source_formats import decoding_map

    shapes: dict[str, tuple[int, ...]] = {}
    stored: dict[str, int] = {}
    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = tuple(safetensors_files(folder))
    for f in files:
        for name, info in check_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(info["shape"])
            stored[name] = info["data_offsets"][1] - info["data_offsets"][0]
            header[name] = (info["dtype"], shapes[name])
    fmt = folder_source_format(Path(folder))
    if fmt is not None:
        decoded, hidden = decoding_map(fmt, header)
        for name, parts in decoded.items():
            shapes[name] = parts.shape
            stored[name] = sum(stored.pop(p) for p in parts.parts)
            hidden -= set(parts.parts)
            for p in parts.parts:
                if p != name:
                    shapes.pop(p, None)
        for name in hidden:  # static activation scales: read with the layer, not a weight
            shapes.pop(name, None)
    decoded_names = frozenset(decoded) if fmt is not None else frozenset()
    if any(n.endswith(".experts.gate_up_proj") for n in shapes):
        shapes, stored = _experts_per_expert(folder, shapes, stored)
        # (MXFP4 encodes the experts' weights; their biases are stored bf16 and read as they are)
        decoded_names = frozenset(n for n in shapes if n in decoded_names or ".experts." in n and fmt is not None
                                  and fmt.name == "mxfp4" and not n.endswith(".bias"))
    return ModelTensors(shapes, stored, source_format=fmt, decoded=decoded_names, files=files)


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


# model_types planned from config.json alone: those with a row in llmc.model.shape_rows.SHAPE_ROWS (the dense
# decoders and MoE families whose Hub tensor names and shapes `from_config` writes)
CONFIG_FAMILIES = tuple(SHAPE_ROWS)


def from_config(config: dict) -> ModelTensors:
    """The tensors a Hugging Face checkpoint of this config holds, as the build reads them: its family's row
    (llmc.model.shape_rows) laid out layer by layer, fused experts (gpt-oss, Llama-4) split per expert, a quantized
    original (DeepSeek's FP8 block-wise, gpt-oss's MXFP4) decoded, each tensor costing the bytes its stored parts
    take (`_stored_bytes`)."""
    kind = config.get("model_type")
    if kind not in SHAPE_ROWS:
        raise InputError(f"planning from config.json alone knows the {', '.join(CONFIG_FAMILIES)} layouts, not "
                         f"{kind!r}", fix="plan with the checkpoint itself (model.source: its folder)")
    row = SHAPE_ROWS[kind]
    h, n_layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    per_layer = config.get("hidden_size_per_layer_input") if row.per_layer_inputs else None
    if per_layer:
        shapes |= {"model.embed_tokens_per_layer.weight": (config["vocab_size_per_layer_input"], n_layers * per_layer),
                   "model.per_layer_model_projection.weight": (n_layers * per_layer, h),
                   "model.per_layer_projection_norm.weight": (per_layer,)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({f"{p}{norm}.weight": (h,) for norm in row.norms})
        if row.linear_attention and _layer_type(config, i) == "linear_attention":
            shapes.update(_gated_deltanet(config, row, p, h))
        elif row.attention == "mla":
            shapes.update(_mla(config, p, h, config["num_attention_heads"]))
            if row.indexer:
                shapes.update(_indexer(config, p, h))
        else:
            shapes.update(_attention(config, row, p, h, i))
        layout = LAYOUTS.get(kind)
        sparse = layout is not None and _sparse(config, row, i)
        if sparse:
            shapes.update(_moe(config, row, layout, p, h))
        if not sparse or row.moe_beside_mlp:
            shapes.update(_dense_mlp(config, row, f"{p}{row.dense_mlp}.", h, 2 if _double_wide(config, row, i) else 1))
        if per_layer:
            shapes |= {f"{p}per_layer_input_gate.weight": (per_layer, h),
                       f"{p}per_layer_projection.weight": (h, per_layer), f"{p}post_per_layer_input_norm.weight": (h,)}
        if row.layer_scalar:
            shapes[f"{p}layer_scalar"] = (1,)
    stored = _stored_bytes(config, shapes)
    if not stored:
        return ModelTensors(shapes, stored)
    from llmc.model.source_formats import source_format

    # a quantized original's weights take under 2 bytes an element where stored (FP8, MXFP4): those are decoded
    decoded = frozenset(n for n, b in stored.items() if b < 2 * ModelTensors.numel(shapes[n]))
    return ModelTensors(shapes, stored, source_format=source_format(config, strict=False), decoded=decoded)


def _kv_shared(config: dict, row: ShapeRow, i: int) -> bool:
    """Layer i reads an earlier layer's keys/values (Gemma-4's last num_kv_shared_layers): no k/v of its own."""
    shared = config.get("num_kv_shared_layers") or 0
    return row.per_layer_attention and i >= config["num_hidden_layers"] - shared


def _double_wide(config: dict, row: ShapeRow, i: int) -> bool:
    return bool(config.get("use_double_wide_mlp")) and _kv_shared(config, row, i)


def _attention(config: dict, row: ShapeRow, p: str, h: int, i: int = 0) -> dict[str, tuple[int, ...]]:
    """q/k/v/o projections (grouped-query), their biases, sinks and q/k norms as the row says (layer i's own head
    width, KV heads and k/v where the row says they are per layer)."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    projections = ["q_proj", "k_proj", "v_proj"]
    if row.per_layer_attention:
        head_dim, kv = layer_attention(config, "head_dim")[i], layer_attention(config, "num_key_value_heads")[i]
        if _kv_shared(config, row, i):
            projections = ["q_proj"]
        elif config.get("attention_k_eq_v") and _layer_type(config, i) == "full_attention":
            projections = ["q_proj", "k_proj"]  # values from k_proj
    q_out = heads * head_dim * (2 if row.q_gate else 1)
    qkv_bias = _flag(config, row.qkv_bias if row.qkv_bias is not None else "attention_bias")
    a = f"{p}self_attn."
    out: dict[str, tuple[int, ...]] = {}
    for proj, width in (("q_proj", q_out), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)):
        if proj not in projections:
            continue
        out[f"{a}{proj}.weight"] = (width, h)
        if qkv_bias:
            out[f"{a}{proj}.bias"] = (width,)
    out[f"{a}o_proj.weight"] = (h, heads * head_dim)
    if _flag(config, row.o_bias):
        out[f"{a}o_proj.bias"] = (h,)
    if row.sinks:
        out[f"{a}sinks"] = (heads,)
    if row.qk_norm and (row.qk_norm_key is None or config.get(row.qk_norm_key)):
        q_norm, k_norm = (head_dim, head_dim) if row.qk_norm == "head" else (heads * head_dim, kv * head_dim)
        out[f"{a}q_norm.weight"] = (q_norm,)
        if "k_proj" in projections:
            out[f"{a}k_norm.weight"] = (k_norm,)
    return out


def _flag(config: dict, flag: bool | str) -> bool:
    """A row's yes/no fact: fixed, or the config key that states it."""
    return bool(config.get(flag)) if isinstance(flag, str) else flag


def _dense_mlp(config: dict, row: ShapeRow, prefix: str, h: int, wide: int = 1) -> dict[str, tuple[int, ...]]:
    inter = (config.get(row.dense_width) or config.get("intermediate_size") or 4 * h) * wide
    if row.mlp == "up_down":  # Apertus: up/down with xIELU's two learned scalars
        return {prefix + "up_proj.weight": (inter, h), prefix + "down_proj.weight": (h, inter),
                prefix + "act_fn.alpha_p": (1,), prefix + "act_fn.alpha_n": (1,)}
    return _swiglu(prefix, inter, h)


def _sparse(config: dict, row: ShapeRow, i: int) -> bool:
    """Whether layer i holds the MoE block (else the family's dense MLP), by the row's layer pattern."""
    if row.sparse_layers == "first_k_dense":
        return i >= (config.get("first_k_dense_replace") or 0)
    if row.sparse_layers == "sparse_step":
        return i not in (config.get("mlp_only_layers") or []) and expert_count(config) > 0 and (
            (i + 1) % (config.get("decoder_sparse_step") or 1) == 0)
    if row.sparse_layers == "moe_layers":
        moe_layers = config.get("moe_layers")
        if moe_layers is None:
            step = config.get("interleave_moe_layer_step") or 1
            moe_layers = list(range(step - 1, config["num_hidden_layers"], step))
        return i in moe_layers
    if row.sparse_layers == "enable_moe_block":
        return bool(config.get("enable_moe_block"))
    return True


def _moe(config: dict, row: ShapeRow, layout: MoeLayout, p: str, h: int) -> dict[str, tuple[int, ...]]:
    """One MoE block under its LAYOUTS names: router (and its bias / score-correction bias), the routed experts (per
    expert in the checkpoint, or fused there and split as the build reads them), the shared expert and its gate."""
    from llmc.quant.moe import per_expert_shapes

    experts, inter = expert_count(config), config[row.expert_width]
    b = f"{p}{layout.block}." if layout.block else p  # "": the decoder layer is the block (Gemma-4)
    out: dict[str, tuple[int, ...]] = {f"{b}{layout.router}.weight": (experts, h)}
    out |= {f"{b}{name}": (h if width == "hidden" else experts,) for name, width in row.router_vectors}
    out |= {f"{p}{norm}.weight": (h,) for norm in row.moe_norms}
    if row.router_bias:
        out[f"{b}{layout.router}.bias"] = (experts,)
    if row.score_bias:
        out[b + row.score_bias] = (experts,)
    if layout.checkpoint_fused:
        fused = ({b + "experts.gate_up_proj": (experts, h, 2 * inter), b + "experts.down_proj": (experts, inter, h)}
                 if layout.transposed else  # [E, in, out] (gpt-oss, Llama-4); else [E, out, in] (Gemma-4)
                 {b + "experts.gate_up_proj": (experts, 2 * inter, h), b + "experts.down_proj": (experts, h, inter)})
        if layout.bias:
            fused |= {b + "experts.gate_up_proj_bias": (experts, 2 * inter), b + "experts.down_proj_bias": (experts, h)}
        out |= per_expert_shapes(fused, layout)
    else:
        for e in range(experts):
            q = f"{b}experts.{e}."
            out |= {f"{q}{layout.gate}.weight": (inter, h), f"{q}{layout.up}.weight": (inter, h),
                    f"{q}{layout.down}.weight": (h, inter)}
    if layout.shared and row.shared_width:
        key, times = row.shared_width
        out |= _swiglu(f"{b}{layout.shared}.", config[key] * ((config.get(times) or 1) if times else 1), h)
    if layout.shared_gate:
        out[f"{b}{layout.shared_gate}.weight"] = (1, h)
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


def _indexer(config: dict, p: str, h: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3.2's lightning indexer: index_n_heads query heads of index_head_dim from the query latent (wq_b),
    one key from the hidden state (wk, then a LayerNorm with bias) and a weight per head (weights_proj)."""
    heads, dim = config["index_n_heads"], config["index_head_dim"]
    a = f"{p}self_attn.indexer."
    return {a + "wq_b.weight": (heads * dim, config["q_lora_rank"]), a + "wk.weight": (dim, h),
            a + "k_norm.weight": (dim,), a + "k_norm.bias": (dim,), a + "weights_proj.weight": (heads, h)}


def _gated_deltanet(config: dict, row: ShapeRow, p: str, h: int) -> dict[str, tuple[int, ...]]:
    """A gated-DeltaNet linear-attention layer (transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet): the
    query/key/value/z projection fused (Qwen3-Next in_proj_qkvz, beta and decay in in_proj_ba) or split (Qwen3.5
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), the causal convolution over q/k/v, per-head decay terms."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim = k_heads * config["linear_key_head_dim"]
    value_dim = v_heads * config["linear_value_head_dim"]
    a = f"{p}linear_attn."
    if row.linear_attention == "qkvz":
        proj = {a + "in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, h), a + "in_proj_ba.weight": (2 * v_heads, h)}
    else:
        proj = {a + "in_proj_qkv.weight": (2 * key_dim + value_dim, h), a + "in_proj_z.weight": (value_dim, h),
                a + "in_proj_b.weight": (v_heads, h), a + "in_proj_a.weight": (v_heads, h)}
    return proj | {a + "conv1d.weight": (2 * key_dim + value_dim, 1, config["linear_conv_kernel_dim"]),
                   a + "dt_bias": (v_heads,), a + "A_log": (v_heads,),
                   a + "norm.weight": (config["linear_value_head_dim"],), a + "out_proj.weight": (h, value_dim)}


def _swiglu(prefix: str, inter: int, h: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
            prefix + "down_proj.weight": (h, inter)}


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
    top = experts_per_token(config) or experts
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
    layer_stored_bytes: int = 0  # the largest layer's bytes as stored (a quantized original's codes and scales)
    layer_decoded: int = 0  # elements of the largest layer decoded as it is read (a quantized original's)
    source_format: object = None  # a quantized original's SourceFormat: its decoder's probed rate times them
    # the largest decoder layer's routed experts (not shared ones), and one routed expert's parameters: what
    # expert-by-expert streaming holds instead of the layer (llmc.quant.expert_stream)
    routed_params: int = 0
    expert_params: int = 0
    # the decoder layers' parameters over the largest layer's times their count: below 1 where layers differ (a
    # DeepSeek's dense first layers beside its MoE ones); each layer's time is priced by its size
    layer_share: float = 1.0
    kv_heads: int = 0  # key/value heads (0: as many as the query heads)
    # the lookup tables among the outer weights that the calibration skeleton keeps in their stored dtype
    # (llmc.model.skeleton.materialize_skeleton; set by the plan where the stored and compute dtypes differ)
    gathered_params: int = 0

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
        layer_read = tensors.largest_layer_read(elem)
        routed_by_layer: dict[int, int] = {}
        for n, shape in in_layers.items():
            if ".experts." in n:  # routed only: a shared expert is `shared_experts.`
                i = tensors.layer_of[f"{n}.weight"]
                routed_by_layer[i] = routed_by_layer.get(i, 0) + tensors.numel(shape)
        routed = max(routed_by_layer.values(), default=0)
        return cls(params=tensors.params, layers=config.get("num_hidden_layers", 1), hidden=h, heads=heads,
                   vocab=config.get("vocab_size", 0), layer_params=largest, outer_params=tensors.outer_params,
                   largest_linear=max((a * b for a, b in in_layers.values()), default=0),
                   widest_input=max((b for _, b in in_layers.values()), default=h),
                   intermediate=inter or 4 * h, attn_width=heads * (config.get("head_dim") or h // max(heads, 1)),
                   active=active, stored_bytes=tensors.stored_total(elem), head_params=tensors.head_params,
                   layer_stored_bytes=layer_read[0], layer_decoded=layer_read[1],
                   source_format=tensors.source_format,
                   routed_params=routed, expert_params=routed // max(expert_count(config), 1),
                   layer_share=sum(per_layer.values()) / (largest * len(per_layer)) if largest else 1.0,
                   kv_heads=config.get("num_key_value_heads") or heads)
