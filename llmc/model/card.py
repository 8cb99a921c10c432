"""A model folder's own model card (README.md in the Hugging Face convention): the YAML front matter that a
quantized artifact inherits (its license, `llmc.model.source` hashes it; its base model). Here, below the source
and the publisher, because both read it (`llmc.publish.model_card` writes the artifact's card)."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmc.model.confine import source_file

CARD_FILE = "README.md"
CARD_BYTES = 200_000  # of the source's README.md read for its front matter


def source_metadata(folder: Path | None) -> dict:
    """The YAML front matter of the source's own README.md (its license and base model), {} when absent or unreadable.
    Read through `llmc.model.confine.source_file`: a README linked outside the folder is refused (exit 7)."""
    if not folder:
        return {}
    card = source_file(Path(folder), CARD_FILE, "model card")
    if not card.is_file():
        return {}
    with open(card, "rb") as f:
        text = f.read(CARD_BYTES).decode("utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    try:
        meta = yaml.safe_load(text[3:].split("\n---", 1)[0])
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}
