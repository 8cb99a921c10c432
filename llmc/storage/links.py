"""Identical files stored once: hard links between stage outputs of the cache (never from a registry entry).

Two targets whose weights are identical (two vLLM targets that differ only in their serve arguments, a TP 4 and a
TP 8 compressed-tensors checkpoint) export byte-identical weight files. When a stage output is committed, each of
its files of at least LINK_MIN_BYTES is looked up by sha256 (which `record_files` computed anyway) in
`<cache>/blobs/`: a file already there is replaced by a hard link to it, a new one is linked there. The blob is
checked byte for byte before anything links to it, so a file edited in place (through any of its links) is never
shared again; a blob no stage output links to any more is removed by the next sweep. Where the filesystem refuses
hard links (another device, no support, the link limit) the file simply stays a copy. Nothing is ever written
through a link: every llmc write replaces its file (atomic rename).

A registry entry owns its bytes (`clone_or_copy`): a copy-on-write clone where the filesystem makes one (btrfs,
XFS, bcachefs: no second copy of the bytes until one side is written), else a byte copy; never a hard link, so a
byte changed in one entry changes no other entry and no cached output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

LINK_MIN_BYTES = 1 << 20  # small files (configs, tokenizer) are not worth an inode's bookkeeping


def share_identical_files(folder: Path, recorded: dict[str, dict], blobs: Path, *,
                          sha256_file: Callable[[Path], str]) -> int:
    """Replace every large file of `folder` that `blobs` already holds by a hard link to it, and link the others
    into `blobs`; returns the bytes no longer stored twice. `sha256_file` re-hashes a blob before it is shared (the
    store passes its own, metered one: this module imports nothing of the store, which imports it)."""
    saved = 0
    for rel, info in recorded.items():
        size, digest = info.get("size"), info.get("sha256")
        if not digest or size is None or size < LINK_MIN_BYTES:
            continue
        path = Path(folder) / rel
        blob = blobs / digest[:2] / digest
        try:
            st = path.lstat()
            if blob.is_file():
                bst = blob.stat()
                if (bst.st_dev, bst.st_ino) == (st.st_dev, st.st_ino):
                    continue
                if bst.st_size != size or sha256_file(blob) != digest:  # changed in place: never share it again
                    blob.unlink()
                else:
                    tmp = path.with_name(f".{path.name}.link-{os.getpid()}")
                    os.link(blob, tmp)
                    os.replace(tmp, path)
                    saved += size
                    continue
            blob.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, blob)
        except OSError:  # another filesystem, no hard links, too many links: the file stays a copy
            with contextlib.suppress(OSError):
                path.with_name(f".{path.name}.link-{os.getpid()}").unlink()
    return saved


FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), the reflink ioctl (cp --reflink)


def clone_or_copy(src: str | Path, dst: str | Path) -> str:
    """A file at `dst` with the bytes of `src` and an inode of its own, flushed to disk: a copy-on-write clone where
    the filesystem supports one, else a copy."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            import fcntl  # lazy: POSIX only: its ImportError falls back to a plain copy

            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except (ImportError, OSError):  # not Linux, another filesystem, no reflink support: copy the bytes
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, 1 << 22)
        fout.flush()
        os.fsync(fout.fileno())
    return str(dst)


def sweep_blobs(blobs: Path) -> list[Path]:
    """Remove blobs no stage output links to any more (link count 1); returns them."""
    removed = []
    if not blobs.is_dir():
        return removed
    for blob in blobs.glob("??/*"):
        with contextlib.suppress(OSError):
            if blob.is_file() and not blob.is_symlink() and blob.stat().st_nlink == 1:
                blob.unlink()
                removed.append(blob)
    return removed
