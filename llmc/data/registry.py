"""Data-source loaders by `kind`: each turns a source into its rows (documents or chat samples), in a stable order.

A loader returns every row of the source; `rows()` then applies the role's part (`holdout`, Brown's file split).
Register a new kind with `@loader("kind")` and add its schema class to `llmc.data.sources.DataSource`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from llmc.errors import InputError

Role = Literal["calibration", "eval"]


@dataclass(frozen=True)
class Row:
    """One document or chat sample: where it came from (`source` label, `row` id) and its text or turns."""

    source: str
    row: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None


Loader = Callable[..., list[Row]]
_LOADERS: dict[str, Loader] = {}


def loader(kind: str) -> Callable[[Loader], Loader]:
    def register(fn: Loader) -> Loader:
        _LOADERS[kind] = fn
        return fn

    return register


def rows(source, role: Role) -> list[Row]:
    """The rows of `source` that `role` may read. Brown's loader splits by file itself; other kinds with
    `holdout: N` give evaluation every N-th row and calibration the rest; without holdout, all rows."""
    from llmc.data import loaders  # noqa: F401  (registers the built-in kinds)

    if source.kind == "mix":
        raise ValueError("a mix has no rows of its own: take each part's (llmc.data.tokens)")
    fn = _LOADERS.get(source.kind)
    if fn is None:
        raise InputError(f"no loader is registered for data source kind '{source.kind}'",
                         fix=f"use one of {sorted(_LOADERS)}")
    if source.kind == "brown":
        return fn(source, role)
    everything = fn(source)
    if source.holdout is None:
        return everything
    n = source.holdout
    return [r for i, r in enumerate(everything) if (i % n == n - 1) == (role == "eval")]
