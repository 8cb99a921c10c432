"""Exact full-vocabulary KL(baseline ‖ artifact) inside a worker, numpy only (the worker's environment has no
torch and no llmc): the same computation as llmc.engines.agreement.exact_kl, from the reference head the request
carries (_wire.py: reference_head_*). Why the baseline is sent as its output head's inputs rather than its logits:
llmc.engines.agreement.

llmc imports this file as llmc.engines.workers._agreement (its tests call it in-process); a worker imports it as
`_agreement`.
"""

from __future__ import annotations

import numpy as np

CHUNK_BYTES = 64 << 20  # float64 [rows, vocab] temporaries of one chunk, all together


def reference_head(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The reference head a request carries (None: it carries none, so the worker sends no exact KL)."""
    if "reference_head_weight" not in tensors:
        return None
    return {"input": tensors["reference_head_input"], "weight": tensors["reference_head_weight"],
            "bias": tensors.get("reference_head_bias"), "post": tensors["reference_head_post"]}


def head_logits(hidden: np.ndarray, head: dict[str, np.ndarray]) -> np.ndarray:
    """float64 logits [rows, vocab] = post(h · Wᵀ + b): multiply by post[0], then soft-cap at post[1] (0: none)."""
    logits = (hidden.astype(np.float32) @ head["weight"].T).astype(np.float64)
    if head["bias"] is not None:
        logits += head["bias"]
    scale, softcap = float(head["post"][0]), float(head["post"][1])
    if scale != 1.0:
        logits *= scale
    if softcap:
        logits = np.tanh(logits / softcap) * softcap
    return logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def exact_kl(head: dict[str, np.ndarray], hidden: np.ndarray, logits: np.ndarray,
             chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """Per-token KL(baseline ‖ artifact), float64 [tokens], from the baseline's head inputs [tokens, hidden] and
    the artifact's logits [tokens, vocab], a bounded number of tokens at a time."""
    vocab = logits.shape[-1]
    rows = max(1, chunk_bytes // (vocab * 8 * 4))
    out = np.empty(logits.shape[0], dtype=np.float64)
    for start in range(0, logits.shape[0], rows):
        log_p = _log_softmax(head_logits(hidden[start : start + rows], head))
        log_q = _log_softmax(logits[start : start + rows].astype(np.float64))
        p = np.exp(log_p)
        with np.errstate(invalid="ignore"):  # p = 0 where log q = -inf too: contributes nothing
            out[start : start + rows] = np.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    return np.maximum(out, 0.0)


class WindowScores:
    """The per-window scores a full-logits worker sends back, accumulated one window at a time: NLL, top-1, and
    (when the request carries a reference) the log-probs at the reference's top-k indices and the exact KL."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.reference_index = tensors.get("reference_index")
        self.head = reference_head(tensors)
        self.nll: list[np.ndarray] = []
        self.top1: list[np.ndarray] = []
        self.at_reference: list[np.ndarray] = []
        self.kl_exact: list[np.ndarray] = []

    def add(self, window: int, ids: np.ndarray, logits: np.ndarray) -> None:
        """Score window `window` (token ids [seq]) from the artifact's logits [seq - 1, vocab] (float64)."""
        m = logits.max(-1, keepdims=True)
        lse = m + np.log(np.exp(logits - m).sum(-1, keepdims=True))
        self.nll.append(lse[:, 0] - logits[np.arange(len(ids) - 1), ids[1:]])
        self.top1.append(logits.argmax(-1))
        if self.reference_index is not None:
            self.at_reference.append(np.take_along_axis(logits, self.reference_index[window], axis=-1) - lse)
        # a reference head of another vocabulary (a GGUF that padded or trimmed it) cannot give an exact KL
        if self.head is not None and self.head["weight"].shape[0] == logits.shape[-1]:
            self.kl_exact.append(exact_kl(self.head, self.head["input"][window], logits))

    def arrays(self) -> dict[str, np.ndarray]:
        """The scores to write back (_wire.write_result)."""
        scores = {"nll": np.stack(self.nll), "top1_index": np.stack(self.top1)}
        if self.at_reference:
            scores["logprobs_at_reference"] = np.stack(self.at_reference).astype(np.float32)
        if self.kl_exact:
            scores["kl_exact"] = np.stack(self.kl_exact)
        return scores
