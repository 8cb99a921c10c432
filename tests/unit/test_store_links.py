"""Identical files are stored once: stage outputs share them through hard links, a file changed in place is never
shared again, and unreferenced blobs are swept. The registry never links into the cache: it clones or copies."""

from __future__ import annotations

import os
from pathlib import Path

from llmc.storage.store import Store
from llmc.storage.links import LINK_MIN_BYTES, clone_or_copy, sweep_blobs

WEIGHTS = os.urandom(LINK_MIN_BYTES + 5)


def _produce(store: Store, key: str, weights: bytes, serve: str) -> Path:
    with store.produce("export", key) as out:
        (out / "model.safetensors").write_bytes(weights)
        (out / "llmc-serve.json").write_text(serve)  # small, and different per target
    return store.lookup("export", key)


def _inode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def test_identical_weight_files_of_two_outputs_are_one_file(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    a = _produce(store, "a" * 64, WEIGHTS, '{"tp": 4}')
    b = _produce(store, "b" * 64, WEIGHTS, '{"tp": 8}')
    assert _inode(a / "model.safetensors") == _inode(b / "model.safetensors")
    assert _inode(a / "llmc-serve.json") != _inode(b / "llmc-serve.json")
    assert (b / "model.safetensors").read_bytes() == WEIGHTS
    store.require_intact(a)
    store.require_intact(b)  # the records still match: same sizes and sha256
    other = _produce(store, "c" * 64, os.urandom(LINK_MIN_BYTES + 5), "{}")
    assert _inode(other / "model.safetensors") != _inode(a / "model.safetensors")


def test_a_file_changed_in_place_is_not_shared_again(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    a = _produce(store, "a" * 64, WEIGHTS, "{}")
    with open(a / "model.safetensors", "r+b") as f:  # edited in place: the blob (same inode) changes too
        f.write(b"\0" * 16)
    b = _produce(store, "b" * 64, WEIGHTS, "{}")
    assert (b / "model.safetensors").read_bytes() == WEIGHTS
    assert _inode(a / "model.safetensors") != _inode(b / "model.safetensors")


def test_blobs_nothing_links_to_are_swept(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    a = _produce(store, "a" * 64, WEIGHTS, "{}")
    store.discard(a, ["test"])
    blobs = list((store.root / "blobs").glob("??/*"))
    assert len(blobs) == 1 and blobs[0].stat().st_nlink == 1
    assert sweep_blobs(store.root / "blobs") == blobs and not blobs[0].exists()


def test_clone_or_copy_gives_the_copy_its_own_inode(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(WEIGHTS)
    (tmp_path / "dst").write_bytes(b"longer than nothing" * 2)  # replaced, not appended to
    clone_or_copy(src, tmp_path / "dst")
    assert _inode(tmp_path / "dst") != _inode(src) and (tmp_path / "dst").read_bytes() == WEIGHTS
    with open(tmp_path / "dst", "r+b") as f:  # a write to the copy changes nothing of the original
        f.write(b"\0" * 16)
    assert src.read_bytes() == WEIGHTS
