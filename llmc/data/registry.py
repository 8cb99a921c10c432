"""Data-source loaders by `kind`: each turns a source into its rows (documents or chat samples), in a stable order.

A loader yields every row of the source, in order; `read_rows()` then applies the role's part (`holdout`,
Brown's file split) and stops where the recipe has enough text.
Register a new kind with `@loader("kind")` (a `llmc.registry.Registry`) and add its schema class to
`llmc.data.sources.DataSource`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Literal

from llmc.data.sources import BrownSource, MixSource
from llmc.registry import Registry

Role = Literal["calibration", "eval"]


@dataclass(frozen=True)
class Row:
    """One document or chat sample: where it came from (`source` label, `row` id) and its text or turns."""

    source: str
    row: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None


Loader = Callable[..., Iterable[Row]]
LOADERS: Registry[Loader] = Registry("data source kind")


def loader(kind: str) -> Callable[[Loader], Loader]:
    return LOADERS.register(kind)


def rows(source, role: Role) -> list[Row]:
    """Every row of `source` that `role` may read."""
    return read_rows(source, role)[0]


def read_rows(source, role: Role, max_chars: int | None = None) -> tuple[list[Row], bool]:
    """The rows of `source` that `role` may read, and whether that is all of them. Brown's loader splits by file
    itself; other kinds with `holdout: N` give evaluation every N-th row and calibration the rest; without holdout,
    all rows. `max_chars`: stop once the role's rows hold that many characters (a loader yields rows lazily; a row's
    text is cut there), so a recipe needing 256 tokens does not read a 1 GiB file whole."""
    # lazy: cycle: llmc.data.loaders imports this module to register its kinds
    from llmc.data import loaders  # noqa: F401  (registers the built-in kinds)

    if isinstance(source, MixSource):
        raise ValueError("a mix has no rows of its own: take each part's (llmc.data.tokens)")
    fn = LOADERS[source.kind]  # UnknownName (bad input, exit 7) naming the registered kinds
    if isinstance(source, BrownSource):  # a fixed corpus of 6 MB, always read whole (its stage keys assume it)
        return list(fn(source, role)), True
    n = source.holdout
    out, chars = [], 0
    for i, r in enumerate(fn(source, max_chars=max_chars)):
        if n is not None and (i % n == n - 1) != (role == "eval"):
            continue
        if max_chars is not None and chars >= max_chars:
            return out, False
        if max_chars is not None and r.text is not None and chars + len(r.text) > max_chars + 1:
            # a row is cut where the budget ends, as the text loader cuts a file: what is tokenized (~300 bytes of
            # memory per byte) stays within the budget however long one row is
            r = replace(r, text=r.text[:max_chars + 1 - chars])
        out.append(r)
        chars += len(r.text) if r.text is not None else sum(len(str(t["content"])) for t in r.messages)
    return out, max_chars is None or chars <= max_chars  # over it: a document was cut (the text loader)
