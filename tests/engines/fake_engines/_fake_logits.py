"""Deterministic next-token logits for the stand-in engines: row t depends on token t and its position."""

import numpy as np

VOCAB = 64


def logits_for(ids) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.float64)
    t = np.arange(len(ids))[:, None]
    return 3 * np.sin(0.37 * (ids[:, None] + 1) * (np.arange(VOCAB)[None, :] + 1) + 0.11 * t)
