"""Store.materialized: the outputs made before the stage walk (a demo's joined parts, an unpacked GGUF) are found,
or written once under the key's lock; a failed write leaves nothing that looks complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.storage.store import Store


def test_written_once_then_found(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    calls = []

    def produce(out: Path) -> None:
        calls.append(out)
        (out / "model.gguf").write_bytes(b"joined")

    first = store.materialized("demo", "k1", produce)
    again = store.materialized("demo", "k1", produce)
    assert first == again and (first / "model.gguf").read_bytes() == b"joined" and len(calls) == 1


def test_a_failed_write_leaves_no_output_and_the_next_call_writes_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")

    def half_then_fail(out: Path) -> None:
        (out / "model.gguf").write_bytes(b"half")
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        store.materialized("source", "k2", half_then_fail)
    assert store.lookup("source", "k2") is None
    done = store.materialized("source", "k2", lambda out: (out / "model.gguf").write_bytes(b"whole"))
    assert (done / "model.gguf").read_bytes() == b"whole"
