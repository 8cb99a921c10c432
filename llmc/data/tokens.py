"""Token ids from a data source: packed windows or one row per sample, with their provenance and content hash.

Windows (default, and the perplexity protocol): rows are joined with "\\n\\n", tokenized once and cut into
non-overlapping windows of `seq_len` ids (BOS + seq_len-1 where the tokenizer adds a BOS: `llmc.data.bos`), tail
dropped —
`llmc.calibration.windows`' protocol, id for id. Every position is real text, all windows have one shape
(batched forwards, GPTQ in one forward), and samples shorter than seq_len waste nothing.

Samples: one row per sample (BOS + its tokens for plain text; the chat template's own text for chat
samples), truncated to seq_len and right-padded, with an attention mask. The start of every sample (template,
system prompt, first turn) is seen as it is served. Padding never reaches a layer: the quantizer runs each
sample at its own length (`llmc.quant.stream`), so no statistic, scale, Hessian or search sees a pad token.

Calibration draws a seeded subset; evaluation takes the first N in order. A mix draws from each part in
proportion to its weight (largest remainder). `sha256` hashes exactly the ids (and mask) used.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from llmc.data import chat
from llmc.data.bos import BosDecision, bos_decision
from llmc.data.registry import Role, Row, read_rows
from llmc.data.sources import label
from llmc.errors import InputError
from llmc.model.skeleton import return_free_heap_to_os
from llmc.telemetry.progress import log

Packing = Literal["windows", "samples"]
# How much of a source is read: READ_CHARS_PER_TOKEN characters per token the recipe needs (English runs ~4 per
# token), at least MIN_READ_CHARS. A source smaller than that is read whole; a larger one only that far (more when
# its tokens turn out longer), so a 1 GiB file costs no more than the recipe's tokens do. A seeded calibration
# draw then picks among the windows or rows read; evaluation takes the first ones, which a cut does not change.
READ_CHARS_PER_TOKEN = 16
MIN_READ_CHARS = 1 << 20


class _TooLittleData(InputError):
    """The part read holds fewer windows or samples than asked for."""


@dataclass
class TokenSet:
    input_ids: torch.Tensor  # [n, seq_len] int64
    attention_mask: torch.Tensor | None  # [n, seq_len] int64, samples only
    provenance: list[dict]  # per row of input_ids: source label, row ids, window index
    chat_templates: dict[str, str] = field(default_factory=dict)  # source label -> template id
    texts: list[str] = field(default_factory=list)  # the rendered documents read (for the overlap check)
    row_ids: list[str] = field(default_factory=list)  # their row ids, in the same order
    bos: bool = False  # windows/plain-text samples start with the BOS (the tokenizer adds one)
    bos_decision: BosDecision | None = None  # which id and why (llmc.data.bos)

    @property
    def sha256(self) -> str:
        return token_hash(self.input_ids, self.attention_mask)

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def token_hash(ids: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    h = hashlib.sha256(str(tuple(ids.shape)).encode())
    h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    if mask is not None:
        h.update(b"mask" + mask.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def make_tokens(source, tokenizer, role: Role, *, packing: Packing, count: int, seq_len: int,
                seed: int | None) -> TokenSet:
    """`count` windows or samples of `source`'s `role` part (seeded draw, or the first `count` when seed is None)."""
    if source.kind == "mix":
        return _mix(source, tokenizer, role, packing=packing, count=count, seq_len=seq_len, seed=seed)
    budget = max(MIN_READ_CHARS, count * seq_len * READ_CHARS_PER_TOKEN)
    while True:
        part, complete = read_rows(source, role, budget)
        try:
            tokens = _token_set(source, part, complete, tokenizer, role, packing, count, seq_len, seed)
        except _TooLittleData:
            if complete:
                raise
            budget *= 4  # tokens much longer than READ_CHARS_PER_TOKEN characters: read further
            continue
        if not complete:
            log(f"{label(source)}: read the first {budget:,} characters of its {role} text (the recipe needs "
                f"{count} x {seq_len} tokens), not the whole source")
        # the tokenizer's encodings of the whole text (ids, offsets, token strings as Python objects: ~0.45 GB for
        # Brown) are freed by now, but glibc kept their heap: the stages after would carry it in their peaks
        return_free_heap_to_os()
        return tokens


def _token_set(source, part, complete: bool, tokenizer, role, packing, count, seq_len, seed) -> TokenSet:
    """The token set of the rows read. A cut source (not `complete`) keeps its last window spare: the cut may
    tokenize differently from the whole text there. (A cut document still holds over seq_len tokens: the budget
    is at least READ_CHARS_PER_TOKEN characters per token of a sample.)"""
    texts = [chat.render(r, source, tokenizer) for r in part]
    templates = {label(source): chat.template_id(source, tokenizer)} if any(chat.is_chat(r, source) for r in part) else {}
    bos = bos_decision(tokenizer)
    if packing == "windows":
        ids, mask, prov = _windows(source, part, texts, tokenizer, bos.token_id, role, count, seq_len, seed,
                                   spare=int(not complete))
    else:
        ids, mask, prov = _samples(source, part, texts, tokenizer, bos.token_id, role, count, seq_len, seed)
    return TokenSet(ids, mask, prov, templates, texts, [r.row for r in part], bos.used, bos)


def _choose(available: int, count: int, seed: int | None) -> list[int]:
    if seed is None:
        return list(range(count))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(available, generator=g)[:count].tolist())


def _windows(source, part: list[Row], texts: list[str], tokenizer, bos_id, role, count, seq_len, seed, spare=0):
    joined = "\n\n".join(texts)
    enc = tokenizer(joined, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    stream = enc["input_ids"]
    body = seq_len - 1 if bos_id is not None else seq_len
    available = max(len(stream) // body - spare, 0)
    if count > available:
        raise _TooLittleData(
            f"asked for {count} windows of {seq_len} tokens ({count * body} tokens) but the {role} part of "
            f"{label(source)} holds {len(stream)} tokens in {len(part)} documents: {available} windows",
            fix=f"lower the count to at most {available}, shorten seq_len, or give more text",
        )
    chosen = _choose(available, count, seed)
    t = torch.tensor(stream[: available * body], dtype=torch.int64).view(available, body)[chosen]
    if bos_id is not None:
        t = torch.cat([torch.full((len(chosen), 1), bos_id, dtype=torch.int64), t], dim=1)
    starts = []  # character offset where each row's text begins in the joined string
    at = 0
    for text in texts:
        starts.append(at)
        at += len(text) + 2
    offsets = enc.get("offset_mapping")
    prov = []
    for w in chosen:
        entry = {"source": label(source), "window": w}
        if offsets is not None:
            first = bisect.bisect_right(starts, offsets[w * body][0]) - 1
            last = bisect.bisect_right(starts, offsets[(w + 1) * body - 1][0]) - 1
            entry["rows"] = [r.row for r in part[first:last + 1]]
        prov.append(entry)
    return t.clone(), None, prov


def _samples(source, part: list[Row], texts: list[str], tokenizer, bos_id, role, count, seq_len, seed):
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    encoded = []
    for r, text in zip(part, texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        templated = chat.is_chat(r, source) and source.chat_template != "none"
        if bos_id is not None and not templated and ids[:1] != [bos_id]:
            ids = [bos_id] + ids  # plain text (chat turns without a template too) starts as windows do
        if len(ids) >= 2:
            encoded.append((r, ids[:seq_len]))
    if count > len(encoded):
        raise _TooLittleData(
            f"asked for {count} samples but the {role} part of {label(source)} holds {len(encoded)} non-empty "
            f"rows (of {len(part)})", fix=f"lower the count to at most {len(encoded)}, or give more rows",
        )
    chosen = _choose(len(encoded), count, seed)
    ids = torch.full((count, seq_len), pad_id, dtype=torch.int64)
    mask = torch.zeros((count, seq_len), dtype=torch.int64)
    prov = []
    for i, c in enumerate(chosen):
        r, toks = encoded[c]
        ids[i, : len(toks)] = torch.tensor(toks)
        mask[i, : len(toks)] = 1
        prov.append({"source": r.source, "rows": [r.row], "tokens": len(toks)})
    return ids, mask, prov


def _mix(source, tokenizer, role, *, packing, count, seq_len, seed) -> TokenSet:
    weights = [p.weight for p in source.sources]
    exact = [count * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: count - sum(counts)]:
        counts[i] += 1  # largest remainders first
    sets = [make_tokens(p.source, tokenizer, role, packing=packing, count=n, seq_len=seq_len, seed=seed)
            for p, n in zip(source.sources, counts) if n > 0]
    masks = [s.attention_mask for s in sets]
    return TokenSet(
        input_ids=torch.cat([s.input_ids for s in sets]),
        attention_mask=torch.cat(masks) if packing == "samples" else None,
        provenance=[p for s in sets for p in s.provenance],
        chat_templates={k: v for s in sets for k, v in s.chat_templates.items()},
        texts=[t for s in sets for t in s.texts],
        row_ids=[r for s in sets for r in s.row_ids],
        bos=sets[0].bos,
        bos_decision=sets[0].bos_decision,
    )
