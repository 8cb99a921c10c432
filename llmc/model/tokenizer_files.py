"""A model folder's tokenizer files, read with size caps before transformers sees them, and the facts llmc checks.

transformers reads tokenizer.json, tokenizer_config.json and special_tokens_map.json whole, so a 500 MB garbage
file costs ~1.4 GB before it fails with an internal error. Here each file is size-capped (a cap is several times
the largest real file of its kind) and must be a JSON object of the expected shape.
`load_tokenizer` loads the tokenizer only after those checks, and turns a refusal by `tokenizers` into exit 7;
`tokenizer_facts` gives the consistency checks (llmc.model.checks) its ids as transformers numbers them.

Custom tokenizer code (an `auto_map` naming a module of the folder, as `trust_remote_code` would import) is never
run: every load passes trust_remote_code=False (without it transformers asks "Do you wish to run the custom code?"
on stdin, and a "y" — typed, or piped in by a script — runs the folder's Python). As with config.json's auto_map,
the name is dropped: the tokenizer is transformers' own class (tokenizer.json), said in a plan warning, and no
artifact's tokenizer_config.json carries the auto_map on. A tokenizer_class that only the folder's code defines is
refused (exit 7): transformers would otherwise quietly substitute a generic class for it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import InputError
from llmc.inputs.caps import TOKENIZER_JSON_CAPS, TOKENIZER_OTHER_CAPS
from llmc.inputs.excerpt import shorten
from llmc.inputs.files import read_input_json, shown, stat_input
from llmc.storage.resource_errors import raise_if_resource

# the caps live with every other input cap (llmc.inputs.caps)
JSON_CAPS = TOKENIZER_JSON_CAPS
OTHER_CAPS = TOKENIZER_OTHER_CAPS
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a tokenizer needs one of these
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
_FIX = "replace the tokenizer files with those the model's tokenizer.save_pretrained() wrote"


@dataclass
class TokenizerFacts:
    """What the consistency checks need from a loaded tokenizer (`tokenizer_facts`)."""

    max_id: int | None = None  # the highest id it can produce: len(tokenizer) - 1
    special_ids: dict[str, int] = field(default_factory=dict)  # 'bos_token', ..., 'added special token <id>'
    has_chat_template: bool = False


def tokenizer_facts(tokenizer) -> TokenizerFacts:
    """The ids as transformers actually numbers them (tokenizers renumbers an added token whose id is taken, so a
    file's ids cannot be trusted), and whether a chat template is there."""
    special = {role: getattr(tokenizer, f"{role}_id", None) for role in SPECIAL_ROLES}
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.setdefault(f"added special token {token_id}", token_id)
    return TokenizerFacts(max_id=len(tokenizer) - 1 if len(tokenizer) else None,
                          special_ids={k: v for k, v in special.items() if type(v) is int},
                          has_chat_template=bool(getattr(tokenizer, "chat_template", None)))


def _read(folder: Path, name: str) -> dict:
    path = folder / name
    value = read_input_json(path, "tokenizer file", JSON_CAPS[name], _FIX)
    if not isinstance(value, dict):
        raise InputError(f"tokenizer file {shown(path)} holds a JSON {type(value).__name__}, not the object a "
                         f"{name} holds", fix=_FIX)
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bad(folder: Path, name: str, what: str) -> InputError:
    return InputError(f"tokenizer file {shown(folder / name)}: {what}", fix=_FIX)


def check_tokenizer_files(folder: Path) -> None:
    """Read every tokenizer file present in `folder` with its cap: InputError (exit 7) naming the file for one that
    is too large, not JSON, or not shaped as that file is, before transformers reads any of them whole."""
    folder = Path(folder)
    for name, cap in OTHER_CAPS.items():
        if os.path.lexists(folder / name):
            st = stat_input(folder / name, "tokenizer file", _FIX)
            if st.st_size > cap:
                raise _bad(folder, name, f"{st.st_size:,} bytes; at most {cap:,} are read")
    for name in JSON_CAPS:
        if os.path.lexists(folder / name):
            _CHECKS.get(name, lambda folder, value: None)(folder, _read(folder, name))


def _tokenizer_json(folder: Path, tj: dict) -> None:
    model = tj.get("model")
    if not isinstance(model, dict):
        raise _bad(folder, "tokenizer.json", "has no 'model' object")
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: text -> id
        if not all(type(i) is int and i >= 0 for i in vocab.values()):
            raise _bad(folder, "tokenizer.json", "a vocabulary id is not a non-negative whole number")
    elif isinstance(vocab, list):  # Unigram: [[text, score], ...]
        if not all(isinstance(e, list) and e and isinstance(e[0], str) for e in vocab):
            raise _bad(folder, "tokenizer.json", "a vocabulary entry is not a [text, score] pair")
    elif vocab is not None:
        raise _bad(folder, "tokenizer.json", "its model's vocab is neither an object nor a list")
    added = tj.get("added_tokens", [])
    if not (isinstance(added, list) and all(isinstance(a, dict) and isinstance(a.get("content"), str)
                                            and type(a.get("id")) is int and a["id"] >= 0 for a in added)):
        raise _bad(folder, "tokenizer.json", "added_tokens is not a list of {id, content} objects")


def _tokenizer_config(folder: Path, tc: dict) -> None:
    decoder = tc.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise _bad(folder, "tokenizer_config.json", "added_tokens_decoder is not an object")
    for key, entry in decoder.items():
        if not (key.isdigit() and len(key) < 12):
            raise _bad(folder, "tokenizer_config.json", "an added_tokens_decoder key is not a token id")
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)):
            raise _bad(folder, "tokenizer_config.json", "an added_tokens_decoder entry has no content")
    _special_tokens(folder, tc, "tokenizer_config.json")


def _special_tokens(folder: Path, mapping: dict, name: str = "special_tokens_map.json") -> None:
    for role in SPECIAL_ROLES:
        value = mapping.get(role)
        if value is not None and _token_text(value) is None:
            raise _bad(folder, name, f"{role} is neither a string nor an object with a string content")


def _token_ids(folder: Path, ids: dict, name: str = "added_tokens.json") -> None:
    if not all(type(i) is int and i >= 0 for i in ids.values()):
        raise _bad(folder, name, "a token id is not a non-negative whole number")


_CHECKS = {"tokenizer.json": _tokenizer_json, "tokenizer_config.json": _tokenizer_config,
           "special_tokens_map.json": _special_tokens, "added_tokens.json": _token_ids, "vocab.json": _token_ids}


def _auto_map_tokenizer(mapping: dict) -> list[str]:
    """The custom tokenizer classes an auto_map names: {"AutoTokenizer": [slow, fast]} or the legacy [slow, fast]."""
    refs = mapping.get("auto_map")
    if isinstance(refs, dict):
        refs = refs.get("AutoTokenizer")
    if isinstance(refs, str):
        refs = [refs]
    return [r for r in refs if isinstance(r, str)] if isinstance(refs, (list, tuple)) else []


def _known_to_transformers(class_name: str) -> bool:
    # lazy: transformers (~2 s), only when a tokenizer class is looked up
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    base = class_name.removesuffix("Fast")
    return any(tokenizer_class_from_name(n) is not None for n in (class_name, base, base + "Fast"))


def custom_tokenizer_code(folder: Path) -> str | None:
    """None when the folder names no custom tokenizer code; else the warning the plan states (the code is not run,
    transformers' own tokenizer_class loads the files). InputError (exit 7) when there is no tokenizer_class, or one
    that only the folder's code defines: transformers would need the code. Reads tokenizer_config.json size-capped."""
    folder = Path(folder)
    path = folder / "tokenizer_config.json"
    tc = _read(folder, path.name) if os.path.lexists(path) else {}
    refs = _auto_map_tokenizer(tc)  # transformers 5 takes a tokenizer's code from here only (not config.json)
    if not refs:
        return None
    class_name = tc.get("tokenizer_class")
    shown_refs = ", ".join(shorten(r, 80) for r in refs)
    if not (isinstance(class_name, str) and _known_to_transformers(class_name)):
        which = (f"its tokenizer class {shorten(class_name, 80)}, which transformers does not define"
                 if isinstance(class_name, str) else "its tokenizer, and no tokenizer_class transformers defines")
        raise InputError(
            f"{shown(path)} names custom tokenizer code ({shown_refs}) for {which}; llmc never runs a model "
            "folder's code",
            fix="if tokenizer.json is the whole tokenizer, set \"tokenizer_class\": \"PreTrainedTokenizerFast\" in "
                "tokenizer_config.json and delete its auto_map; otherwise use a checkpoint whose tokenizer transformers "
                "loads without trust_remote_code")
    return (f"{shown(path)} names custom tokenizer code ({shown_refs}); llmc never runs it: the tokenizer is "
            f"transformers' own {shorten(class_name, 80)}, and the auto_map is dropped from every artifact")


def copy_tokenizer_file(src: Path, dst: Path) -> None:
    """Copy one tokenizer file into an artifact; tokenizer_config.json without its auto_map (no artifact names code
    llmc did not run, as config.json's auto_map is dropped). Other files, and a config without one, byte for byte."""
    if Path(src).name == "tokenizer_config.json":
        try:
            value = json.loads(Path(src).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # checked when the source was read; whatever it is now is copied as it is
            value = None
        if isinstance(value, dict) and "auto_map" in value:
            del value["auto_map"]
            Path(dst).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            return
    shutil.copyfile(src, dst)


def load_tokenizer(folder: Path):
    """AutoTokenizer.from_pretrained(folder) after the capped reads above; a tokenizer that `tokenizers` or
    transformers refuses is InputError (exit 7) naming the folder, not an internal error. Never runs the folder's
    own code (custom_tokenizer_code)."""
    from transformers import AutoTokenizer  # lazy: transformers (~2 s), only when a tokenizer loads

    check_tokenizer_files(folder)
    custom_tokenizer_code(folder)  # refuses a class only the folder's code defines
    if not any(os.path.lexists(Path(folder) / n) for n in VOCABULARY_FILES):
        raise InputError(f"{shown(folder)} has no tokenizer (none of {', '.join(VOCABULARY_FILES)})",
                         fix="save the model's tokenizer into the folder: tokenizer.save_pretrained(folder)")
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers, huggingface_hub's config validation and tokenizers' Rust
        # side (a bare Exception) raise many types for files they refuse
        raise_if_resource(e, "loading the tokenizer", folder)
        first = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"the tokenizer in {shown(folder)} cannot be loaded "
                         f"({type(e).__name__}: {shorten(first, 120)})",
                         fix=f"{_FIX}; check config.json too (transformers reads it to pick the tokenizer)") from None
