"""Calibration and evaluation text must not share a document: a quantizer tuned on the text it is judged on
looks better than it is. Documents are compared by the hash of their normalised text (case folded,
whitespace collapsed), so a copy with different line breaks still counts."""

from __future__ import annotations

import hashlib
import re

from llmc.errors import InputError

_SPACE = re.compile(r"\s+")


def document_hashes(texts: list[str]) -> set[str]:
    return {hashlib.sha256(_SPACE.sub(" ", t).strip().casefold().encode()).hexdigest()
            for t in texts if t.strip()}


def check_overlap(calibration_texts: list[str], eval_texts: list[str], *, allowed: bool,
                  corpus: str | None = None) -> int:
    """Number of documents in both; an error when there are any and the recipe did not allow it. `corpus`: the
    evaluation corpus's label, when eval.corpus names several."""
    shared = len(document_hashes(calibration_texts) & document_hashes(eval_texts))
    if shared and not allowed:
        which = f"evaluation corpus '{corpus}'" if corpus is not None else "evaluation corpus"
        raise InputError(
            f"{shared} documents appear both in the calibration data and in the {which} "
            "(compared after case folding and whitespace collapsing)",
            fix="evaluate on text the calibration did not read (e.g. `holdout: 10` on the source, or another file), "
            "or set eval.allow_calibration_overlap: true to accept it knowingly",
        )
    return shared
