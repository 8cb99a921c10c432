"""A model's tensors as the planner needs them: names and shapes from safetensors headers, or from config.json
alone (planning a Hub model offline from the config kept beside its recipe, recipes/configs/).

The config path writes the tensor names and shapes Hugging Face checkpoints of these architectures hold (Llama,
Mistral, Qwen2/3 dense; Qwen3-MoE and Mixtral experts as one Linear per expert). Its totals equal the published
checkpoints' (Llama-3.1-8B: 8,030,261,248 parameters; Llama-3.3-70B: 70,553,706,496; tests/unit/test_plan_scale.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import InputError

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


def from_config(config: dict) -> ModelTensors:
    """The tensors a Hugging Face checkpoint of this config holds (dense decoders and Qwen3-MoE / Mixtral)."""
    kind = config.get("model_type")
    h, n_layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    inter = config.get("intermediate_size") or 4 * h
    if kind not in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"):
        raise InputError(f"planning from config.json alone knows llama, mistral, qwen2, qwen3, qwen3_moe and mixtral "
                         f"layouts, not {kind!r}", fix="plan with the checkpoint itself (model.source: its folder)")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    attn_bias = kind == "qwen2" or bool(config.get("attention_bias"))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)):
            shapes[f"{p}self_attn.{proj}.weight"] = (out, h)
            if attn_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, heads * head_dim)
        if kind in ("qwen3", "qwen3_moe"):
            shapes[f"{p}self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}self_attn.k_norm.weight"] = (head_dim,)
        shapes.update(_mlp(config, kind, i, p, h, inter))
    return ModelTensors(shapes)


def _mlp(config: dict, kind: str, i: int, p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    if kind == "mixtral":
        experts = config["num_local_experts"]
        out = {f"{p}block_sparse_moe.gate.weight": (experts, h)}
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            out |= {q + "w1.weight": (inter, h), q + "w2.weight": (h, inter), q + "w3.weight": (inter, h)}
        return out
    sparse = kind == "qwen3_moe" and i not in (config.get("mlp_only_layers") or []) and (
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
    return out


def inputs_per_token(linears: dict[str, tuple[int, int]], config: dict) -> float:
    """Input elements one token feeds these Linears (`linears`: name -> (out, in)), a routed expert's at the share
    of tokens it gets (`active_fraction`): what a hook on every Linear's input touches per token."""
    routed = active_fraction(config)
    return sum(i * (routed if ".experts." in n else 1.0) for n, (_, i) in linears.items())


def active_fraction(config: dict) -> float:
    """The share of expert parameters a token runs through (1 for dense models): top-k of the experts."""
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
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
        inter = config.get("moe_intermediate_size") if config.get("num_experts") else config.get("intermediate_size")
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
