"""Identical files are stored once: stage outputs share them through hard links, a file changed in place is never
shared again, and unreferenced blobs are swept. The registry never links into the cache: it clones or copies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


# --- the two branches of clone_or_copy: a copy-on-write clone, and the byte copy when the filesystem has none ----

def _reflink_folder(tmp_path: Path) -> Path:
    """A folder on a filesystem that clones (FICLONE): LLMC_TEST_REFLINK_DIR (e.g. a btrfs or XFS mount) or the
    test's own tmp folder; skip, naming the filesystem's answer, where neither clones. As root, an XFS image does:
    truncate -s 512M x.img && mkfs.xfs -m reflink=1 x.img && mount -o loop x.img /mnt/x (apt install xfsprogs)."""
    import errno
    import fcntl

    from llmc.storage.links import FICLONE

    folder = Path(os.environ.get("LLMC_TEST_REFLINK_DIR") or tmp_path)
    probe = folder / f".reflink-probe-{os.getpid()}"
    probe.write_bytes(b"x" * 4096)
    try:
        with open(probe, "rb") as fin, open(probe.with_suffix(".clone"), "wb") as fout:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
    except OSError as e:
        pytest.skip(f"{folder} does not clone files (FICLONE: {errno.errorcode.get(e.errno, e.errno)}); set "
                    "LLMC_TEST_REFLINK_DIR to a folder on btrfs or XFS (reflink=1) to run this")
    finally:
        for p in (probe, probe.with_suffix(".clone")):
            p.unlink(missing_ok=True)
    return folder


def _independent(src: Path, dst: Path, data: bytes) -> None:
    """`dst` holds `data` in an inode of its own, linked once, and a write to either side leaves the other as it was."""
    assert dst.read_bytes() == data and _inode(dst) != _inode(src)
    assert src.stat().st_nlink == 1 and dst.stat().st_nlink == 1
    with open(dst, "r+b") as f:
        f.write(b"\0" * 16)
    assert src.read_bytes() == data
    with open(src, "r+b") as f:
        f.seek(len(data) // 2)
        f.write(b"\xff" * 16)
    assert dst.read_bytes() == b"\0" * 16 + data[16:]


def test_clone_or_copy_clones_where_the_filesystem_can(tmp_path: Path, monkeypatch) -> None:
    import shutil

    folder = _reflink_folder(tmp_path)
    src, dst = folder / f"src-{os.getpid()}", folder / f"dst-{os.getpid()}"
    try:
        src.write_bytes(WEIGHTS)
        dst.write_bytes(b"an older entry's bytes" * 4)

        def no_byte_copy(*args, **kwargs):
            raise AssertionError("clone_or_copy copied bytes on a filesystem that clones")

        monkeypatch.setattr(shutil, "copyfileobj", no_byte_copy)
        clone_or_copy(src, dst)
        _independent(src, dst, WEIGHTS)
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)


@pytest.mark.parametrize("code", ["EOPNOTSUPP", "EXDEV", "EINVAL"])
def test_clone_or_copy_copies_where_the_filesystem_cannot_clone(code: str, tmp_path: Path, monkeypatch) -> None:
    import errno
    import fcntl
    import shutil

    copies = []
    real_copy = shutil.copyfileobj

    def refuse_after_a_partial_write(fd, request, arg):
        os.write(fd, b"half a clone")  # what a clone that failed part way could leave: the copy must replace it
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "ioctl", refuse_after_a_partial_write)
    monkeypatch.setattr(shutil, "copyfileobj", lambda *a, **k: copies.append(a) or real_copy(*a, **k))
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(WEIGHTS)
    dst.write_bytes(b"an older entry's bytes" * 4)
    assert clone_or_copy(src, dst) == str(dst)
    assert len(copies) == 1
    _independent(src, dst, WEIGHTS)
