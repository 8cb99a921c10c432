"""Checks of a model source made at plan time, from config.json, the tokenizer files and the safetensors headers
alone (no tensor data is read), so that a source llmc would mis-handle fails with exit 7 before any weight moves.

- **Already-quantized checkpoints** (docs/model-sources.md): FP8 scales without an FP8 quantization_config,
  bitsandbytes, a variant no decoder reads and every other `quantization_config` are refused with the fix (the
  unquantized parent, named by the model card's `base_model` where it has one): llmc reads a checkpoint's `.weight`
  tensors as the weights, and a quantized checkpoint's are codes whose scales live beside them. Two kinds are
  decoded instead, and the plan says so: a GGUF (transformers' GGUF reader dequantizes it to the declared dtype)
  and a quantized original llmc.model.source_formats decodes (FP8 block-wise or per-tensor, MXFP4,
  compressed-tensors, ModelOpt FP8/NVFP4, GPTQ, AWQ), whose tensors every check below sees decoded.
- **Consistency**: every token id the tokenizer can produce or names as special (bos/eos/pad/unk, added special
  tokens, as transformers numbers them once loaded; config.json's and generation_config.json's ids) indexes a
  row of the embedding (and of the output head), and `vocab_size` is the embedding's row count; heads, head_dim
  and the attention projections agree; transformers accepts the config; model_type is a plain identifier; the
  recipe's seq_len fits `max_position_embeddings`; chat data has a chat template.

The functions taking (config, tensors, facts) are pure; `check_source` gathers those inputs from a folder (the
tokenizer is loaded, after its files pass llmc.model.tokenizer_files' size and shape checks: tokenizers renumbers
an added token whose id is taken, so only the loaded tokenizer's ids are the ones the build will use).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.data.sources import corpora_of, label
from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt, shorten
from llmc.inputs.files import read_input_json, read_input_text, shown
from llmc.model.checkpoint import MAX_CONFIG_BYTES, check_safetensors_header, safetensors_files
from llmc.model.confine import source_file
from llmc.model.dtype import SAFETENSORS_FLOATS, source_dtype
from llmc.model.skeleton import build_skeleton
from llmc.model.source import DEMO_MODELS
from llmc.model.source_formats import decoded_config, decoded_header, decoding_map, source_format
from llmc.model.source_formats import statement as decoded_statement
from llmc.model.tokenizer_files import (VOCABULARY_FILES, TokenizerFacts, custom_tokenizer_code, load_tokenizer,
                                        tokenizer_facts)
from llmc.quant.moe import unfuse_experts
from llmc.storage.resource_errors import raise_if_resource

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape), from the headers

MODEL_TYPE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
# tensor-name endings of the token embedding and the output head in the families llmc reads
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
                      "tok_embeddings.weight")
HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.\d+\.")


# --------------------------------------------------------------------------- already-quantized sources

@dataclass(frozen=True)
class QuantizedKind:
    kind: str  # 'compressed-tensors', 'modelopt', 'gptq', 'awq', 'fp8', 'bitsandbytes', or a quant_method
    evidence: str  # what said so, in words


# quant_method values (lowercase) -> the kind reported; any other quant_method is reported under its own name
_METHODS = {"compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
            "modelopt": "modelopt", "gptq": "gptq", "awq": "awq", "fp8": "fp8", "fbgemm_fp8": "fp8",
            "bitsandbytes": "bitsandbytes", "bitsandbytes_4bit": "bitsandbytes", "bitsandbytes_8bit": "bitsandbytes"}
# tensor-name endings that exist only in quantized checkpoints -> kind (the scales come after the weights' own
# layouts: their kind is the dtype of the weight they scale, see _scaled_kind)
_QUANT_TENSORS = (
    ((".qweight", ".qzeros", ".g_idx"), "gptq/awq"),
    ((".weight_packed", ".weight_global_scale"), "compressed-tensors"),
    ((".SCB", ".weight_format", ".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4",
      ".quant_state.bitsandbytes__fp4"), "bitsandbytes"),
)
# scale tensors stored beside a weight of codes -> the kind when that weight's dtype does not say more
# (DeepSeek-V3's block-wise FP8 names its scales weight_scale_inv)
_SCALE_SUFFIXES = {".weight_scale_inv": "fp8", ".weight_scale": "quantized", ".input_scale": "quantized"}
FLOAT_DTYPES = frozenset(SAFETENSORS_FLOATS)  # the safetensors dtypes of float tensors
# the safetensors dtype of a weight's codes -> the format they are (what a refusal names)
_CODE_FORMATS = {"I8": "int8", "U8": "int4/fp4 (packed in U8)", "I16": "int16", "I32": "int4 (packed in I32)",
                 "U32": "int4 (packed in U32)", "F8_E4M3": "fp8", "F8_E5M2": "fp8", "F8_E8M0": "mxfp",
                 "F6_E2M3": "fp6", "F6_E3M2": "fp6", "F4": "fp4"}
_WHY = {
    "compressed-tensors": "its Linear weights are stored as quantized codes with scales beside them",
    "modelopt": "NVIDIA ModelOpt wrote it with quantized weights and their scales",
    "gptq": "its Linear weights are packed int codes (qweight/qzeros/scales)",
    "awq": "its Linear weights are packed int codes (qweight/qzeros/scales)",
    "gptq/awq": "its Linear weights are packed int codes (qweight/qzeros/scales)",
    "bitsandbytes": "its weights are bitsandbytes int8/4-bit codes with their quantization state",
}


def _code_format(dtype: str) -> str:
    return _CODE_FORMATS.get(dtype, "quantized")


def _scaled_kind(tensors: Tensors) -> QuantizedKind | None:
    """A weight with scales beside it (`X.weight_scale`, `X.weight_scale_inv`, `X.input_scale`), named by the
    format of `X.weight`'s codes: a stripped INT8 W8A8 checkpoint holds I8 weights, an FP8 one F8_E4M3."""
    for name in tensors:
        suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            continue
        weight = name[: -len(suffix)] + ".weight"
        dtype = tensors[weight][0] if weight in tensors else None
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return QuantizedKind(_code_format(dtype), f"the weights hold quantization tensors such as "
                                 f"{excerpt(name, 80)} beside the {dtype} weight {excerpt(weight, 80)}")
        return QuantizedKind(_SCALE_SUFFIXES[suffix], f"the weights hold quantization tensors such as "
                             f"{excerpt(name, 80)}")
    return None


def _weight_with_parts(tensors: Tensors) -> QuantizedKind | None:
    """A `weight` that is not a tensor but has parts (`X.weight._data` + `X.weight._scale`: optimum-quanto's
    layout), named by the dtype of its codes."""
    parts = sorted(n for n in tensors if ".weight." in n and ".parametrizations.weight." not in n)  # torch's
    # weight parametrizations (weight_norm's original0/1) are float tensors of a real module, not codes
    if not parts:
        return None
    codes = next((n for n in parts if tensors[n][0] not in FLOAT_DTYPES), parts[0])
    owner = codes.split(".weight.", 1)[0] + ".weight"
    quanto = any(n.endswith(".weight._data") for n in parts) and any(n.endswith(".weight._scale") for n in parts)
    layout = "optimum-quanto's layout, " if quanto else ""
    return QuantizedKind(_code_format(tensors[codes][0]),
                         f"{layout}{excerpt(owner, 80)} is not a tensor but parts such as {excerpt(codes, 80)} "
                         f"({tensors[codes][0]})")


def _why(kind: str) -> str:
    if kind in _WHY:
        return _WHY[kind]
    codes = "quantized codes" if kind == "quantized" else f"{kind} codes"
    return f"its Linear weights are {codes} whose scales live beside them"


def quantized_kind(config: dict, tensors: Tensors, hf_quant_config: dict | None = None) -> QuantizedKind | None:
    """Which kind of already-quantized checkpoint this is (None: not quantized), from config.json, ModelOpt's
    hf_quant_config.json and the tensors' names and dtypes (a format the config does not name is named by the
    dtype of its codes: I8 int8, F8_E4M3 fp8, U8 packed int4/fp4, ...)."""
    if hf_quant_config is not None:
        return QuantizedKind("modelopt", "hf_quant_config.json is present (NVIDIA ModelOpt's export)")
    for key in ("quantization_config", "compression_config"):
        qc = config.get(key)
        if isinstance(qc, dict):
            method = str(qc.get("quant_method") or "").lower()
            if not method and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
                method = "bitsandbytes"
            if method:
                return QuantizedKind(_METHODS.get(method, method), f"config.json's {key} says quant_method "
                                     f"{excerpt(method, 40)}")
            return QuantizedKind("quantized", f"config.json has a {key}")
        if qc is not None:
            return QuantizedKind("quantized", f"config.json has a {key}")
    for suffixes, kind in _QUANT_TENSORS:
        found = next((n for n in tensors if n.endswith(suffixes)), None)
        if found is not None:
            return QuantizedKind(kind, f"the weights hold quantization tensors such as {excerpt(found, 80)}")
    found = _weight_with_parts(tensors) or _scaled_kind(tensors)
    if found is not None:
        return found
    for name, (dtype, shape) in tensors.items():
        if name.endswith(".weight") and len(shape) == 2 and dtype not in FLOAT_DTYPES:
            return QuantizedKind(_code_format(dtype), f"the 2-D weight {excerpt(name, 80)} is stored as {dtype}")
    return None


def base_model_of(card: str) -> str | None:
    """The `base_model` a model card's YAML front matter names (the first, if a list), or None."""
    if not card.startswith("---"):
        return None
    head = card.split("\n---", 1)[0]
    m = re.search(r"^base_model:[ \t]*(?:\n[ \t]*-[ \t]*)?['\"]?([^\s'\"#]+)", head, re.M)
    return m.group(1) if m else None


def refuse_quantized(found: QuantizedKind, where: str, base_model: str | None) -> None:
    """InputError for an already-quantized source: what it is, why llmc cannot start from it, and the fix."""
    hub_id = base_model is not None and re.match(r"^[\w.-]+/[\w.-]+$", base_model) and not base_model.startswith(".")
    parent = ("point model.source at the unquantized checkpoint it was made from (a model card's base_model usually "
              "names it)")
    if base_model:
        parent = f"its model card names the unquantized parent: model.source: {'hf:' if hub_id else ''}" + \
            shorten(base_model, 120)
    why = _why(found.kind)
    raise InputError(
        f"model source {where} is already quantized ({found.kind}: {found.evidence}); {why}, and quantizing codes "
        "again without their scales gives a model that scores like noise",
        fix=f"{parent}; llmc decodes only GGUF sources and the quantized originals docs/model-sources.md lists",
    )


# --------------------------------------------------------------------------- consistency

def _text_config(config: dict) -> dict:
    """The language model's part of a config (Gemma 3's multimodal configs nest it as text_config)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def check_config(config: dict, where: str) -> None:
    """model_type a plain identifier; heads dividing the sizes they split."""
    fix = "repair config.json (model_type names the architecture, e.g. llama; sizes as the checkpoint was trained)"
    model_type = config.get("model_type")
    if not (isinstance(model_type, str) and MODEL_TYPE.match(model_type)):
        raise InputError(f"model config {where}: model_type {excerpt(model_type, 40)} is not an architecture name "
                         "(letters, digits, '_' or '-', at most 64)", fix=fix)
    c = _text_config(config)
    heads, kv_heads = c.get("num_attention_heads"), c.get("num_key_value_heads") or c.get("num_attention_heads")
    hidden, head_dim = c.get("hidden_size"), c.get("head_dim")
    if not all(type(v) is int and v > 0 for v in (heads, kv_heads, hidden)):
        return  # read_model_config has refused these already where they are required
    if heads % kv_heads:
        raise InputError(f"model config {where}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}", fix=fix)
    if head_dim is None and hidden % heads:
        raise InputError(f"model config {where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                         f"{heads} and there is no head_dim", fix=fix)


def check_transformers_config(config: dict, where: str) -> None:
    """transformers' own validation of the config (its config classes check field types: `mlp_bias: null`, a list
    for `pretraining_tp`), which the build's model load would otherwise fail on as an internal error."""
    from transformers import AutoConfig  # lazy: transformers (~2 s), only when a config is checked

    fields = {k: v for k, v in config.items() if k not in ("model_type", "auto_map", "transformers_version")}
    try:
        AutoConfig.for_model(config["model_type"], **fields)
    except Exception as e:  # noqa: BLE001 - an unknown model_type, a strict-dataclass field error, ...
        raise_if_resource(e, "reading the model config")
        first = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"model config {where}: transformers refuses it ({type(e).__name__}: {shorten(first, 160)})",
                         fix="repair config.json (a model_type transformers knows, each field of its type), or "
                         "re-save the model with save_pretrained()") from None


def check_shapes(config: dict, tensors: Tensors, where: str) -> None:
    """The checkpoint holds the model's tensors, and the attention projections have the rows heads x head_dim say."""
    fix = "point model.source at a complete checkpoint whose config.json describes its weights"
    if not any(n.endswith(EMBEDDING_SUFFIXES) for n in tensors) and not any(_LAYER.search(n) for n in tensors):
        raise InputError(f"model source {where}: its safetensors hold {len(tensors)} tensor(s) and none of a "
                         "decoder's (no token embedding, no layers.N.* tensor)", fix=fix)
    c = _text_config(config)
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    if not (type(heads) is int and type(hidden) is int):
        return
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    for proj, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        name = next((t for t in tensors if t.endswith(f"layers.0.self_attn.{proj}.weight")), None)
        if name is None:
            continue
        rows = tensors[name][1][0] if tensors[name][1] else None
        if rows != n * head_dim:
            said = f"head_dim {head_dim}" if c.get("head_dim") else f"hidden_size {hidden} / {heads} heads = {head_dim}"
            raise InputError(
                f"model source {where}: {name} has {rows} rows, but config.json's {n} heads x {said} make "
                f"{n * head_dim}", fix="set head_dim (and the head counts) in config.json to the checkpoint's: "
                f"{proj} rows = heads x head_dim")


def implied_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The tensors the model config.json describes holds, as the build reads them: name -> (shape, floating),
    from the model built on the meta device (no memory) with Mixture-of-Experts experts unfused into the Hub's
    per-expert names (llmc.quant.moe). Tied weights appear under each name (a checkpoint may store either);
    non-persistent buffers (rotary inv_freq) are left out: no checkpoint needs them."""
    try:
        model = build_skeleton(config, torch.float32)
        unfuse_experts(model)
    except Exception as e:  # noqa: BLE001 - transformers has no causal-LM class, a config it cannot build, ...
        raise_if_resource(e, "building the model from config.json on the meta device")
        raise InputError(f"transformers cannot build a causal LM from this config.json ({type(e).__name__}: "
                         f"{shorten(str(e).splitlines()[0] if str(e) else '', 160)})",
                         fix="use a model_type transformers builds with AutoModelForCausalLM, with the config "
                         "save_pretrained() wrote") from None
    return {name: (tuple(t.shape), t.is_floating_point())
            for name, t in model.state_dict(keep_vars=True).items()}


def _how_it_differs(implied: tuple[int, ...], held: tuple[int, ...]) -> str:
    if len(implied) == 2 and held == implied[::-1]:
        return " (transposed)"
    n_implied = n_held = 1
    for d in implied:
        n_implied *= d
    for d in held:
        n_held *= d
    return " (the same elements in another shape)" if n_implied == n_held else ""


def check_tensors(config: dict, tensors: Tensors, files: dict[str, str], where: str) -> None:
    """Every tensor of the checkpoint that the model has is of the shape config.json implies and a float (the
    build reads each into the model built from config.json, and a transposed, flattened, 3-D or integer tensor
    fails there, after the plan said it would run). Only the headers are read. A tensor the model does not have
    (another architecture's extra, an old checkpoint's rotary inv_freq) is not checked here; a checkpoint that
    lacks an output head with tied embeddings is fine (the head is the embedding)."""
    implied = implied_tensors(config)
    fix = ("point model.source at weights and the config.json saved with them (save_pretrained() writes both), or "
           "re-save the model with save_pretrained()")
    tensors = _fused_experts_split(config, tensors, files, where, fix)
    for name, (dtype, shape) in tensors.items():
        if name not in implied:
            continue
        want, floating = implied[name]
        wrong_dtype = floating and dtype not in FLOAT_DTYPES
        if tuple(shape) != want or wrong_dtype:
            said = f"{dtype} {list(shape)}"
            raise InputError(
                f"model source {where}: tensor {excerpt(name, 100)} in {excerpt(files.get(name, '?'), 80)} is "
                f"{said}{_how_it_differs(want, tuple(shape)) if tuple(shape) != want else ''}, but config.json "
                f"implies a {'float (F32, F16 or BF16) ' if floating else ''}tensor of shape {list(want)}"
                + (f" (a {dtype} tensor is quantized codes or not a weight)" if wrong_dtype else ""), fix=fix)


def _fused_experts_split(config: dict, tensors: Tensors, files: dict[str, str], where: str, fix: str) -> Tensors:
    """A family whose Hub checkpoints hold fused 3-D experts (gpt-oss, Llama-4): their per-expert shapes as the build
    reads them (llmc.quant.moe.per_expert_tensors), so each is checked against config.json like any tensor; a fused
    tensor that cannot be split so (not 3-D, odd gate/up width) is named here."""
    from llmc.model.families import LAYOUTS  # lazy: with per_expert_shapes, only for fused-expert checkpoints
    from llmc.quant.moe import per_expert_shapes  # lazy: llmc.quant sits above llmc.model (docs/architecture.md)

    layout = LAYOUTS.get(config.get("model_type"))
    if layout is None or not layout.checkpoint_fused:
        return tensors
    fused = [n for n in tensors if n.rpartition(".")[2] in ("gate_up_proj", "down_proj", "gate_up_proj_bias",
                                                               "down_proj_bias") and ".experts." in n]
    for name in fused:
        dims = 2 if name.endswith("_bias") else 3
        if len(tensors[name][1]) != dims or (name.endswith("gate_up_proj") and tensors[name][1][-1 if layout.transposed
                                                                                                 else 1] % 2):
            raise InputError(f"model source {where}: tensor {excerpt(name, 100)} in "
                             f"{excerpt(files.get(name, '?'), 80)} is {tensors[name][0]} {list(tensors[name][1])}, "
                             f"but {config.get('model_type')}'s fused experts are {dims}-D", fix=fix)
    split = per_expert_shapes({n: s for n, (_, s) in tensors.items()}, layout)
    dtype_of = {n[: -len(part)]: tensors[n][0] for n in fused for part in ("gate_up_proj", "down_proj",
                                                                           "gate_up_proj_bias", "down_proj_bias")
                if n.endswith(part)}
    out = {}
    for n, shape in split.items():
        if n in tensors:
            out[n] = tensors[n]
        else:  # <block>.experts.<e>.<proj>.<weight|bias>: the dtype of its block's fused tensors
            base = n[: n.index(".experts.") + len(".experts.")]
            out[n] = (dtype_of.get(base, "F32"), shape)
            files.setdefault(n, files.get(base + "gate_up_proj", "?"))
    return out


def embedding_rows(tensors: Tensors) -> dict[str, int]:
    """The token embedding's and the output head's row counts, by tensor name."""
    return {n: shape[0] for n, (_, shape) in tensors.items()
            if n.endswith(EMBEDDING_SUFFIXES + HEAD_SUFFIXES) and len(shape) == 2}


def _config_token_ids(config: dict, generation: dict | None) -> dict[str, int]:
    out = {}
    for file, d in (("config.json", _text_config(config)), ("generation_config.json", generation or {})):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            value = d.get(key)
            for v in value if isinstance(value, list) else [value]:
                if type(v) is int:
                    out[f"{file}'s {key}"] = max(v, out.get(f"{file}'s {key}", v))
    return out


def check_vocabulary(config: dict, tensors: Tensors, facts: TokenizerFacts, where: str,
                     generation: dict | None = None) -> None:
    """Every id the tokenizer produces or names, and every token id the configs name, indexes a row of the
    embedding and of the output head; vocab_size equals the embedding's rows."""
    rows = embedding_rows(tensors)
    vocab_size = _text_config(config).get("vocab_size")
    for name, n in rows.items():
        if name.endswith(EMBEDDING_SUFFIXES) and type(vocab_size) is int and n != vocab_size:
            raise InputError(f"model source {where}: config.json's vocab_size is {vocab_size:,} but {name} has "
                             f"{n:,} rows", fix="set vocab_size in config.json to the embedding's row count")
    size = min([*rows.values(), *([vocab_size] if type(vocab_size) is int else [])], default=None)
    if size is None:
        return
    fix = (f"use the tokenizer this checkpoint was trained with (its ids must stay below {size:,}), or a checkpoint "
           "whose embedding covers this tokenizer; a tokenizer rebuilt from another file (e.g. a GGUF header) can "
           "number its tokens differently")
    named = {f"the tokenizer's {role}": i for role, i in facts.special_ids.items()}
    if facts.max_id is not None:
        named["the tokenizer's highest token id (its vocabulary and added tokens)"] = facts.max_id
    named.update(_config_token_ids(config, generation))
    for what, token_id in sorted(named.items(), key=lambda kv: -kv[1]):
        if token_id >= size:
            raise InputError(f"model source {where}: {what} is id {token_id:,}, past the {size:,}-row embedding "
                             f"(ids 0..{size - 1:,})", fix=fix)


def check_recipe_fits(config: dict, seq_lens: dict[str, int], chat_sources: list[str], has_chat_template: bool,
                      where: str) -> None:
    """The recipe's windows fit the model's context, and chat data meets a chat template."""
    limit = _text_config(config).get("max_position_embeddings")
    if type(limit) is int:
        for field_, n in seq_lens.items():
            if n > limit:
                raise InputError(f"{field_} is {n:,} tokens but model source {where} has max_position_embeddings "
                                 f"{limit:,}: positions past it were never trained",
                                 fix=f"set {field_} to at most {limit:,}")
    if chat_sources and not has_chat_template:
        raise InputError(f"{', '.join(chat_sources)} hold chat samples (messages or wrap_as_user) but the tokenizer "
                         f"of model source {where} has no chat template (tokenizer_config.json's chat_template, "
                         "chat_template.jinja or chat_template.json)",
                         fix="set the source's chat_template to a Jinja template file, or to 'none' (turns as "
                         "'role: content' lines)")


# --------------------------------------------------------------------------- gathering the inputs

def gguf_statement(spec: str, dtype: str) -> str | None:
    """What the plan says about a GGUF source: its quantized tensors are dequantized, then quantized again."""
    if spec.startswith("demo:") and spec[5:] in DEMO_MODELS:
        name = DEMO_MODELS[spec[5:]].gguf_name
    elif spec.endswith(".gguf"):
        name = Path(spec).name
    else:
        return None
    rounding = "" if dtype == "float32" else f", rounded to {dtype}"
    return (f"model.source is a GGUF ({excerpt(name, 80)}): transformers' GGUF reader dequantizes its quantized "
            f"tensors (each code times its block's scale, in float32{rounding}) and this recipe quantizes that model "
            "again, so the result carries the GGUF's quantization error as well as this recipe's; the baseline is "
            "the dequantized GGUF")


def _chat_sources(recipe) -> list[str]:
    def walk(source):
        if source.kind == "mix":
            for part in source.sources:
                yield from walk(part.source)
        else:
            yield source

    sources = [*walk(recipe.calibration.dataset), *(s for c in corpora_of(recipe.eval.corpus).values()
                                                    for s in walk(c))]
    return sorted({label(s) for s in sources if s.chat_template == "model"
                   and (getattr(s, "messages", None) is not None or s.wrap_as_user)})


def check_source(recipe, config: dict, folder: Path | None) -> list[str]:
    """Every check above for a recipe's model source (InputError, exit 7, on the first failure); returns what the
    plan states about the source (a GGUF's dequantization, code the folder names that is never run). `folder` None: planning from config.json alone."""
    where = shown(folder) if folder is not None else shown(recipe.model.source)
    statement = gguf_statement(recipe.model.source, source_dtype(recipe.model.dtype))
    notes = [statement] if statement else []
    tensors: Tensors = {}
    files: dict[str, str] = {}  # tensor name -> the file holding it, for messages
    for f in safetensors_files(folder) if folder is not None else []:
        for name, info in check_safetensors_header(f).items():
            if name != "__metadata__":
                tensors[name] = (info["dtype"], tuple(info["shape"]))
                files[name] = f.name
    hf_quant_config = _optional_json(folder, "hf_quant_config.json")  # ModelOpt's export
    # a quantized original llmc decodes (FP8, MXFP4, compressed-tensors, ModelOpt, GPTQ, AWQ); InputError for a
    # malformed one or a variant no decoder reads
    fmt = source_format(config, hf_quant_config)
    if fmt is not None:
        hf_quant_config = None  # decoded: what is left is checked as a float model
        notes.append(decoded_statement(fmt, source_dtype(recipe.model.dtype)))
        decoded, _ = decoding_map(fmt, tensors)
        if not decoded and folder is not None:  # planning from config.json alone: no tensors to look at
            raise InputError(f"model source {where}: its quantization config says {fmt.describe()}, but no tensor "
                             "holds such codes (every weight is a float)",
                             fix="remove the quantization config (config.json's quantization_config, ModelOpt's "
                                 "hf_quant_config.json) from an unquantized checkpoint, or re-download the quantized one")
        files.update({name: files.get(parts.codes, "?") for name, parts in decoded.items()})
        tensors = decoded_header(fmt, tensors)  # every check below sees the model the build reads
        config = decoded_config(config)
    found = quantized_kind(config, tensors, hf_quant_config)
    if found is not None:
        refuse_quantized(found, where, base_model_of(_model_card(folder)))
    check_config(config, where)
    check_transformers_config(config, where)
    seq_lens = {"calibration.seq_len": recipe.calibration.seq_len, "eval.seq_len": recipe.eval.seq_len}
    if folder is None:
        check_recipe_fits(config, seq_lens, [], True, where)
        return notes
    check_shapes(config, tensors, where)
    notes += [n for n in [replaced_architectures(folder, config)] if n]  # the folder's own class is never run
    if not any(os.path.lexists(folder / n) for n in VOCABULARY_FILES):
        check_tensors(config, tensors, files, where)
        return [f"{where} has no tokenizer ({', '.join(VOCABULARY_FILES)}): a build will stop when it loads one",
                *notes]
    facts = tokenizer_facts(load_tokenizer(folder))  # the files size-capped and checked first
    notes += [n for n in [custom_tokenizer_code(folder)] if n]  # code it names is never run; said
    check_vocabulary(config, tensors, facts, where, _optional_json(folder, "generation_config.json"))
    check_tensors(config, tensors, files, where)  # after the checks whose messages say more (vocab_size, head_dim)
    check_recipe_fits(config, seq_lens, _chat_sources(recipe), facts.has_chat_template, where)
    return notes


def replaced_architectures(folder: Path, config: dict) -> str | None:
    """What the plan says when config.json's `architectures` names a class transformers does not have (the
    folder's own code, which llmc never runs) and the artifacts name transformers' class instead
    (llmc.model.checkpoint.transformers_architectures); None when they name the file's own."""
    path = source_file(Path(folder), "config.json", "model config")
    written = read_input_json(path, "model config", MAX_CONFIG_BYTES, "").get("architectures")
    if written == config.get("architectures") or not written:
        return None
    return (f"config.json's architectures {excerpt(written, 80)} names a class transformers does not have (the "
            f"folder's own code, which llmc never runs): the model is built, and every artifact's config.json names "
            f"it, as transformers' {', '.join(config['architectures'])} for model_type {config['model_type']}")


_SIDE_FILE_BYTES = 1 << 20


def _optional_json(folder: Path | None, name: str) -> dict | None:
    """A small JSON side file of the folder, or None when there is none (or it is not an object)."""
    if folder is None or not os.path.lexists(Path(folder) / name):
        return None
    value = read_input_json(Path(folder) / name, name, _SIDE_FILE_BYTES,
                            "replace the file with the one the model was saved with")
    return value if isinstance(value, dict) else None


def _model_card(folder: Path | None) -> str:
    """The folder's README.md (where a card names base_model), or '' when absent or unreadable."""
    if folder is None or not os.path.lexists(Path(folder) / "README.md"):
        return ""
    try:
        return read_input_text(Path(folder) / "README.md", "model card", _SIDE_FILE_BYTES, "")
    except InputError:
        return ""
