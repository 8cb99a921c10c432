"""Whether windows and samples start with a BOS token: the model's own tokenizer decides, not the presence of an id.

A tokenizer can name a BOS token it never adds: Qwen's declares `<|endoftext|>`-style ids while
`add_bos_token` is false, and a GGUF's metadata carries `tokenizer.ggml.bos_token_id` next to
`tokenizer.ggml.add_bos_token = false`. Prepending that id anyway puts a token at position 0 the model never saw
there in training: on a Qwen-family model the baseline's perplexity read ~60% high and the INT4 loss doubled. So
a BOS is used exactly when encoding text with the tokenizer's special tokens on puts the BOS id first (what
`tokenizer("x")` produces, i.e. `add_bos_token` or a post-processor that adds it), and the decision is recorded
with its reason beside every figure.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROBE = "x"  # any plain text; only what the tokenizer puts around it matters


@dataclass(frozen=True)
class BosDecision:
    token_id: int | None  # the id every window/sample starts with; None: no BOS
    reason: str
    declared_id: int | None = None  # the tokenizer's bos_token_id, used or not

    @property
    def used(self) -> bool:
        return self.token_id is not None

    @property
    def differs_from_legacy(self) -> bool:
        """llmc before this rule prepended any declared BOS id; True where the windows therefore changed."""
        return self.declared_id is not None and self.token_id is None

    def record(self) -> dict:
        """What report.json and the manifest say about it."""
        return {"used": self.used, "token_id": self.token_id, "reason": self.reason}


def bos_decision(tokenizer) -> BosDecision:
    """Use a BOS exactly where the tokenizer itself adds one to plain text."""
    declared = tokenizer.bos_token_id
    if declared is None:
        return BosDecision(None, "the tokenizer has no BOS token")
    name = tokenizer.convert_ids_to_tokens(declared)
    with_special = tokenizer(_PROBE, add_special_tokens=True)["input_ids"]
    without = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    if with_special[:1] == [declared] and without[:1] != [declared]:
        return BosDecision(declared, f"the tokenizer adds its BOS {name!r} (id {declared}) to text", declared)
    flag = getattr(tokenizer, "add_bos_token", None)
    return BosDecision(
        None,
        f"the tokenizer declares BOS {name!r} (id {declared}) but does not add it to text"
        + (" (add_bos_token is false)" if flag is False else ""),
        declared,
    )


def gguf_add_bos_flag(path) -> bool | None:
    """`tokenizer.ggml.add_bos_token` of a GGUF file (None when the file does not say)."""
    from gguf import GGUFReader  # lazy: gguf (~0.5 s cold), only for GGUF sources

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.contents())


def follow_gguf_flag(tokenizer, add_bos: bool | None) -> str | None:
    """Make `tokenizer` (built from a GGUF) add a BOS exactly when the GGUF's add_bos_token says so: a GGUF can declare
    a BOS id while saying not to add it, and a tokenizer built from it must not add it either. Returns what was
    changed (None: the tokenizer already agreed, or the GGUF has no flag)."""
    if add_bos is None:
        return None
    adds = bos_decision(tokenizer).used
    if adds == add_bos:
        return None
    if add_bos and tokenizer.bos_token_id is None:
        return "the GGUF says add_bos_token but declares no BOS id: no BOS is added"
    tokenizer.add_bos_token = add_bos  # transformers rebuilds the post-processor from this flag
    if bos_decision(tokenizer).used != add_bos:
        raise ValueError(f"the tokenizer still {'does not add' if add_bos else 'adds'} a BOS after add_bos_token="
                         f"{add_bos}")
    return f"BOS {'added' if add_bos else 'no longer added'}: the GGUF's tokenizer.ggml.add_bos_token is {add_bos}"
