"""Checks of a model source made at plan time, from config.json, the tokenizer files and the safetensors headers
alone (no tensor data is read), so that a source llmc would mis-handle fails with exit 7 before any weight moves.

- **Already-quantized checkpoints** (docs/model-sources.md): compressed-tensors, ModelOpt, GPTQ, AWQ, FP8 with
  `weight_scale(_inv)` tensors, bitsandbytes and every other `quantization_config` are refused with the fix (the
  unquantized parent, named by the model card's `base_model` where it has one): llmc reads a checkpoint's
  `.weight` tensors as the weights, and a quantized checkpoint's are codes whose scales live beside them. A GGUF
  source is the one quantized input llmc takes: transformers' GGUF reader dequantizes it to the declared dtype
  and the recipe quantizes that again; the plan says so.
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

from llmc.data.sources import corpora_of, label
from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt, shorten
from llmc.inputs.files import read_input_json, read_input_text, shown
from llmc.model.checkpoint import check_safetensors_header, safetensors_files
from llmc.model.dtype import source_dtype
from llmc.model.source import DEMO_MODELS
from llmc.model.tokenizer_files import (VOCABULARY_FILES, TokenizerFacts, custom_tokenizer_code, load_tokenizer,
                                        tokenizer_facts)
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
# tensor-name endings that exist only in quantized checkpoints -> kind
_QUANT_TENSORS = (
    ((".qweight", ".qzeros", ".g_idx"), "gptq/awq"),
    ((".weight_scale_inv",), "fp8"),
    ((".weight_packed", ".weight_global_scale"), "compressed-tensors"),
    ((".weight_scale", ".input_scale"), "fp8"),
    ((".SCB", ".weight_format", ".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4",
      ".quant_state.bitsandbytes__fp4"), "bitsandbytes"),
)
_QUANTIZED_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "I8", "U8", "I32", "I16"}
_WHY = {
    "compressed-tensors": "its Linear weights are stored as quantized codes with scales beside them",
    "modelopt": "NVIDIA ModelOpt wrote it with quantized weights and their scales",
    "gptq": "its Linear weights are packed int codes (qweight/qzeros/scales)",
    "awq": "its Linear weights are packed int codes (qweight/qzeros/scales)",
    "gptq/awq": "its Linear weights are packed int codes (qweight/qzeros/scales)",
    "fp8": "its Linear weights are FP8 codes whose scales (weight_scale) live beside them",
    "bitsandbytes": "its weights are bitsandbytes int8/4-bit codes with their quantization state",
}


def quantized_kind(config: dict, tensors: Tensors, hf_quant_config: dict | None = None) -> QuantizedKind | None:
    """Which kind of already-quantized checkpoint this is (None: not quantized), from config.json, ModelOpt's
    hf_quant_config.json and the tensors' names and dtypes."""
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
    for name, (dtype, shape) in tensors.items():
        if name.endswith(".weight") and len(shape) == 2 and dtype in _QUANTIZED_DTYPES:
            kind = "fp8" if dtype.startswith("F8") else "quantized"
            return QuantizedKind(kind, f"the 2-D weight {excerpt(name, 80)} is stored as {dtype}")
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
    why = _WHY.get(found.kind, "its weights are quantized codes")
    raise InputError(
        f"model source {where} is already quantized ({found.kind}: {found.evidence}); {why}, and quantizing codes "
        "again without their scales gives a model that scores like noise",
        fix=f"{parent}; llmc dequantizes only GGUF sources (docs/model-sources.md)",
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
    plan states about the source (a GGUF's dequantization). `folder` None: planning from config.json alone."""
    where = shown(folder) if folder is not None else shown(recipe.model.source)
    statement = gguf_statement(recipe.model.source, source_dtype(recipe.model.dtype))
    notes = [statement] if statement else []
    tensors: Tensors = {}
    for f in safetensors_files(folder) if folder is not None else []:
        for name, info in check_safetensors_header(f).items():
            if name != "__metadata__":
                tensors[name] = (info["dtype"], tuple(info["shape"]))
    found = quantized_kind(config, tensors, _optional_json(folder, "hf_quant_config.json"))
    if found is not None:
        refuse_quantized(found, where, base_model_of(_model_card(folder)))
    check_config(config, where)
    check_transformers_config(config, where)
    seq_lens = {"calibration.seq_len": recipe.calibration.seq_len, "eval.seq_len": recipe.eval.seq_len}
    if folder is None:
        check_recipe_fits(config, seq_lens, [], True, where)
        return notes
    check_shapes(config, tensors, where)
    if not any(os.path.lexists(folder / n) for n in VOCABULARY_FILES):
        return [f"{where} has no tokenizer ({', '.join(VOCABULARY_FILES)}): a build will stop when it loads one",
                *notes]
    facts = tokenizer_facts(load_tokenizer(folder))  # the files size-capped and checked first
    notes += [n for n in [custom_tokenizer_code(folder)] if n]  # code it names is never run; said
    check_vocabulary(config, tensors, facts, where, _optional_json(folder, "generation_config.json"))
    check_recipe_fits(config, seq_lens, _chat_sources(recipe), facts.has_chat_template, where)
    return notes


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
