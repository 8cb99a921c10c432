"""A model folder's tokenizer files, read with size caps before transformers sees them, and the facts llmc checks.

transformers reads tokenizer.json, tokenizer_config.json and special_tokens_map.json whole, so a 500 MB garbage
file costs ~1.4 GB before it fails with an internal error. Here each file is size-capped (a cap is several times
the largest real file of its kind), must be a JSON object of the expected shape, and yields only what the
consistency checks need (`TokenizerFacts`: the highest id, the special tokens' ids, a chat template's presence).
`load_tokenizer` loads the tokenizer only after those checks, and turns a refusal by `tokenizers` into exit 7.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import InputError
from llmc.excerpt import shorten
from llmc.inputs import read_input_json, shown, stat_input

# bytes; the largest real files seen: tokenizer.json 33 MB (Gemma 3, 262k tokens), tokenizer_config.json 1.2 MB
JSON_CAPS = {
    "tokenizer.json": 128 << 20,
    "tokenizer_config.json": 16 << 20,
    "special_tokens_map.json": 1 << 20,
    "added_tokens.json": 16 << 20,
    "vocab.json": 64 << 20,
    "generation_config.json": 1 << 20,
    "chat_template.json": 4 << 20,
}
OTHER_CAPS = {"tokenizer.model": 64 << 20, "merges.txt": 64 << 20, "chat_template.jinja": 4 << 20}
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
_FIX = "replace the tokenizer files with those the model's tokenizer.save_pretrained() wrote"


@dataclass
class TokenizerFacts:
    """What a folder's tokenizer files say, without loading the tokenizer."""

    max_id: int | None = None  # the highest id of the vocabulary and added tokens (None: no file gave a vocabulary)
    max_id_from: str = ""  # which file gave it
    special_ids: dict[str, int] = field(default_factory=dict)  # role ('bos_token', 'eos_token', ...) -> id
    special_from: dict[str, str] = field(default_factory=dict)  # role -> the file that named it
    unresolved: dict[str, str] = field(default_factory=dict)  # role -> file, for a token in no vocabulary
    has_chat_template: bool = False
    files: list[str] = field(default_factory=list)  # the tokenizer files present


def _read(folder: Path, name: str, kind: type | tuple[type, ...] = dict):
    path = folder / name
    value = read_input_json(path, "tokenizer file", JSON_CAPS[name], _FIX)
    if not isinstance(value, kind):
        raise InputError(f"tokenizer file {shown(path)} holds a JSON {type(value).__name__}, not the "
                         f"{'object' if kind is dict else 'value'} a {name} holds", fix=_FIX)
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bad(folder: Path, name: str, what: str) -> InputError:
    return InputError(f"tokenizer file {shown(folder / name)}: {what}", fix=_FIX)


def read_tokenizer_facts(folder: Path) -> TokenizerFacts:
    """Read every tokenizer file present in `folder` with its cap; InputError (exit 7) naming the file for one
    that is too large, not JSON, or not shaped as that file is."""
    folder = Path(folder)
    facts = TokenizerFacts(files=[n for n in (*JSON_CAPS, *OTHER_CAPS) if os.path.lexists(folder / n)])
    for name, cap in OTHER_CAPS.items():
        if name in facts.files:
            st = stat_input(folder / name, "tokenizer file", _FIX)
            if st.st_size > cap:
                raise _bad(folder, name, f"{st.st_size:,} bytes; at most {cap:,} are read")
    ids: dict[str, int] = {}  # token text -> id, from every vocabulary and added-token list
    highest: list[tuple[int, str]] = []

    def learn(text, id_, name: str) -> None:
        if not (isinstance(text, str) and type(id_) is int and id_ >= 0):
            raise _bad(folder, name, "a token entry is not a (text, non-negative id) pair")
        ids.setdefault(text, id_)
        highest.append((id_, name))

    if "tokenizer.json" in facts.files:
        tj = _read(folder, "tokenizer.json")
        model = tj.get("model")
        if not isinstance(model, dict):
            raise _bad(folder, "tokenizer.json", "has no 'model' object")
        vocab = model.get("vocab")
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: text -> id
            for text, id_ in vocab.items():
                learn(text, id_, "tokenizer.json")
        elif isinstance(vocab, list):  # Unigram: [[text, score], ...], the id is the position
            for id_, entry in enumerate(vocab):
                if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
                    raise _bad(folder, "tokenizer.json", f"vocabulary entry {id_} is not a [text, score] pair")
                ids.setdefault(entry[0], id_)
            if vocab:
                highest.append((len(vocab) - 1, "tokenizer.json"))
        elif vocab is not None:
            raise _bad(folder, "tokenizer.json", "its model's vocab is neither an object nor a list")
        added = tj.get("added_tokens", [])
        if not isinstance(added, list) or not all(isinstance(a, dict) for a in added):
            raise _bad(folder, "tokenizer.json", "added_tokens is not a list of objects")
        for a in added:
            learn(a.get("content"), a.get("id"), "tokenizer.json")
        del tj, model, vocab, added
    if "vocab.json" in facts.files:
        for text, id_ in _read(folder, "vocab.json").items():
            learn(text, id_, "vocab.json")
    if "added_tokens.json" in facts.files:
        for text, id_ in _read(folder, "added_tokens.json").items():
            learn(text, id_, "added_tokens.json")
    maps: list[tuple[str, dict]] = []
    if "tokenizer_config.json" in facts.files:
        tc = _read(folder, "tokenizer_config.json")
        decoder = tc.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise _bad(folder, "tokenizer_config.json", "added_tokens_decoder is not an object")
        for key, entry in decoder.items():
            if not (isinstance(key, str) and key.isdigit() and len(key) < 12):
                raise _bad(folder, "tokenizer_config.json", "an added_tokens_decoder key is not a token id")
            learn(_token_text(entry), int(key), "tokenizer_config.json")
        facts.has_chat_template = bool(tc.get("chat_template"))
        maps.append(("tokenizer_config.json", tc))
    if "special_tokens_map.json" in facts.files:
        maps.append(("special_tokens_map.json", _read(folder, "special_tokens_map.json")))
    if "chat_template.json" in facts.files:
        facts.has_chat_template = facts.has_chat_template or bool(_read(folder, "chat_template.json").get("chat_template"))
    facts.has_chat_template = facts.has_chat_template or "chat_template.jinja" in facts.files
    if highest:
        facts.max_id, facts.max_id_from = max(highest)
    for name, mapping in reversed(maps):  # tokenizer_config.json wins, as in transformers
        for role in SPECIAL_ROLES:
            text = _token_text(mapping.get(role))
            if text is None:
                continue
            if text in ids:
                facts.special_ids[role], facts.special_from[role] = ids[text], name
                facts.unresolved.pop(role, None)
            elif highest:  # transformers appends a special token missing from the vocabulary: a new id
                facts.unresolved[role] = name
                facts.special_ids.pop(role, None)
    return facts


def load_tokenizer(folder: Path):
    """AutoTokenizer.from_pretrained(folder) after the capped reads above; a tokenizer that `tokenizers` or
    transformers refuses is InputError (exit 7) naming the folder, not an internal error."""
    from transformers import AutoTokenizer

    read_tokenizer_facts(folder)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        raise InputError(f"the tokenizer in {shown(folder)} cannot be loaded ({type(e).__name__}: "
                         f"{shorten(str(e).splitlines()[0] if str(e) else '', 120)})", fix=_FIX) from None
    except Exception as e:  # tokenizers' Rust errors (a PyO3 exception type), e.g. an unknown model type
        if type(e).__module__.split(".")[0] not in ("tokenizers", "builtins"):
            raise
        raise InputError(f"the tokenizer in {shown(folder)} cannot be loaded ({type(e).__name__})", fix=_FIX) from None
