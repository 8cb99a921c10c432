"""Token windows: the published perplexity protocol, shared by calibration and evaluation.

Documents are joined with "\\n\\n" and tokenized once; the stream is cut into non-overlapping
windows of `seq_len - 1` tokens (tail dropped), each prefixed with the tokenizer's BOS token where
the tokenizer adds one to text (`llmc.data.bos`), else windows of `seq_len` tokens; every window is exactly
`seq_len` ids and the loss is taken on positions 1..n-1.
Calibration draws a seeded random subset of windows; evaluation takes the first N in order.
A window's id is its index in the stream, recorded so a build can say exactly what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.calibration.corpora import Document
from llmc.data.bos import bos_decision
from llmc.errors import InputError


@dataclass(frozen=True)
class Windows:
    ids: torch.Tensor  # [n, seq_len] int64
    window_index: list[int]  # position of each window in the tokenized stream
    bos: bool

    def __len__(self) -> int:
        return self.ids.shape[0]


def tokenize_stream(tokenizer, docs: list[Document]) -> list[int]:
    text = "\n\n".join(d.text for d in docs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_windows(stream: list[int], seq_len: int, bos_id: int | None) -> torch.Tensor:
    body = seq_len - 1 if bos_id is not None else seq_len
    n = len(stream) // body
    t = torch.tensor(stream[: n * body], dtype=torch.int64).view(n, body)
    if bos_id is not None:
        t = torch.cat([torch.full((n, 1), bos_id, dtype=torch.int64), t], dim=1)
    return t


def make_windows(
    tokenizer, docs: list[Document], seq_len: int, count: int, *, seed: int | None
) -> Windows:
    """`count` windows: seeded random choice (calibration) or the first `count` (seed=None, eval)."""
    bos_id = bos_decision(tokenizer).token_id
    all_windows = cut_windows(tokenize_stream(tokenizer, docs), seq_len, bos_id)
    available = all_windows.shape[0]
    if count > available:
        raise InputError(
            f"asked for {count} windows of {seq_len} tokens but the corpus split yields {available}",
            fix=f"lower the count to at most {available} or shorten seq_len",
        )
    if seed is None:
        chosen = list(range(count))
    else:
        g = torch.Generator().manual_seed(seed)
        chosen = sorted(torch.randperm(available, generator=g)[:count].tolist())
    return Windows(ids=all_windows[chosen].clone(), window_index=chosen, bos=bos_id is not None)
