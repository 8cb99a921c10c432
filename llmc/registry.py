"""One registry mechanism for every plugin kind: runtimes, artifact formats, algorithms, data flows, engines,
data-source loaders.

A `Registry` is a read-only mapping from name to plugin, filled by the plugins' own modules as they are
imported, in registration order:

    RUNTIMES = Registry[Runtime]("runtime")
    RUNTIMES.add("vllm", Runtime(...))          # or, on a function or class: @LOADERS.register("jsonl")
    RUNTIMES["vllm"]                            # UnknownName (exit 7) naming the kind and the registered names
    RUNTIMES.names()                            # ("vllm", ...) in registration order

Names are stored exactly as given (no case or separator folding, unlike compressed-tensors' RegistryMixin):
they enter stage keys and recipes, so one spelling each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from llmc.errors import InputError

T = TypeVar("T")


class UnknownName(InputError, KeyError, ValueError):
    """A name no plugin of its kind is registered under. Also a KeyError and a ValueError: what the lookups it
    replaced raised (a dict's KeyError, the engine table's ValueError), so callers catching those still do."""


class Registry(Mapping[str, T], Generic[T]):
    """The plugins of one kind by name (`kind` is how messages name it: "runtime", "data flow")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, value: T) -> T:
        """Register `value` as `name`; ValueError when the name is taken (two plugins must not shadow)."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = value
        return value

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: the decorated function or class is the plugin."""
        return lambda value: self.add(name, value)

    def remove(self, name: str) -> T:
        """Take a registration back (tests that register a stand-in)."""
        return self._entries.pop(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            fix = f"use one of {', '.join(self._entries)}" if self._entries else f"no {self.kind} is registered"
            raise UnknownName(f"unknown {self.kind} {name!r}", fix=fix) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry[{self.kind}]({', '.join(self._entries)})"
