"""Large safetensors files written around the page cache (O_DIRECT), hashed while they are written.

Why: a stage's gigabytes written through the page cache run at the rate the kernel finds it fresh pages, which on a
VM can be a tenth of the disk's and swings with what else the machine did in the last seconds. On the development VM
(Firecracker, free page reporting) 1 GB written into fresh page-cache pages took 3-7 s, into pages another file had
just freed 0.2 s, and with O_DIRECT 0.36 s every time (docs/planner-constants.md, `write_rate`). Written this way, the
stages' time no longer depends on the page cache's history, and the planner's probe of it (`llmc.planning.machine.
write_rate`) reads what a stage gets.

The bytes are those `safetensors.torch.save` makes for the same tensors and metadata (header then data, in the
library's order: tests/unit/test_direct_io.py compares them), so a file's sha256 does not depend on how it was
written. The sha256 of what was written is kept for this process (`written_digest`): the store records a stage's
files right after it, and reading them back would put them through the page cache after all.

A filesystem that refuses O_DIRECT (tmpfs before Linux 6.6, some network and FUSE filesystems), a platform without
it, a tensor safetensors' table does not name, or a big-endian host: `write_safetensors` returns None and the caller
writes the file the ordinary way.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the first big write: the store imports this module and stays torch-free
    import torch

DIRECT_MIN_BYTES = 64 << 20  # smaller files go through the page cache: their pages are few and the next stage reads them
ALIGNMENT = 4096  # O_DIRECT: buffer address, file offset and length in multiples of the logical block (<= 4 KiB)
CHUNK_BYTES = 16 << 20  # one write: the bounce buffer's size (one per writing thread, kept: a fresh one costs page faults)
_HEADER_ALIGNMENT = 8  # safetensors pads its JSON header with spaces to a multiple of 8 bytes

_bounce = threading.local()
_digests: dict[tuple[int, int, int, int], str] = {}  # (st_dev, st_ino, st_size, st_mtime_ns) -> sha256


def _dtype_names() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors' name for it, from safetensors' own table."""
    from safetensors import torch as st  # lazy: imports torch, which the store's importers may not need

    return {dtype: name for name, dtype in st._TYPES.items() if dtype is not None}


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """safetensors' header for `tensors` (the 8-byte little-endian length, then the padded JSON) and the order their
    data follows it in, the library's."""
    names = _dtype_names()
    order = _library_order(tensors)
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return len(text).to_bytes(8, "little") + text, order


def _library_order(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The order safetensors writes these tensors' data in (by dtype, then name: a rule of the library's, so read from
    the header it makes for empty tensors of the same names and dtypes)."""
    import torch  # lazy: the store imports this module and stays torch-free until a big write
    from safetensors.torch import save  # lazy: imports torch

    empty = save({n: torch.empty(0, dtype=t.dtype) for n, t in tensors.items()})
    length = int.from_bytes(empty[:8], "little")
    return [n for n in json.loads(empty[8:8 + length]) if n != "__metadata__"]


def supported(tensors: dict[str, torch.Tensor], loaded: bool = False) -> bool:
    """Whether `write_safetensors` can write these: host tensors (or, `loaded`, meta tensors standing for what a
    loader reads) of dtypes safetensors names, on a little-endian host with O_DIRECT."""
    if not hasattr(os, "O_DIRECT") or sys.byteorder != "little":
        return False
    names = _dtype_names()
    return all(t.device.type == ("meta" if loaded else "cpu") and t.dtype in names and not t.is_sparse
               for t in tensors.values())


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      load: Callable[[str], torch.Tensor] | None = None) -> str | None:
    """Write `tensors` to `path` as safetensors with O_DIRECT, made durable (fsync); the file's sha256, or None when
    the filesystem or the tensors do not allow it (nothing written then). The caller renames the file into place.
    With `load`, `tensors` are meta tensors of the file's dtypes and shapes and `load(name)` reads each as its bytes
    are written: one tensor in memory at a time (`streamed_pieces`)."""
    if not supported(tensors, loaded=load is not None):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
    except OSError as e:
        if e.errno == errno.EINVAL:  # this filesystem has no direct I/O
            return None
        raise
    try:
        return _write(fd, path, tensors, metadata, load)
    except OSError as e:
        if e.errno != errno.EINVAL or os.lseek(fd, 0, os.SEEK_CUR) > 0:
            raise
        # refused at the first write (some FUSE and network filesystems accept the flag, not the I/O): nothing
        # written, the caller writes the file the ordinary way
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _write(fd: int, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
           load: Callable[[str], torch.Tensor] | None) -> str:
    head, order = header(tensors, metadata)
    digest = hashlib.sha256()
    view = _bounce_buffer()
    filled = total = 0

    def flush(length: int) -> None:
        written = 0
        while written < length:
            n = os.write(fd, view[written:length])
            if n <= 0 or (n % ALIGNMENT and written + n < length):
                raise OSError(f"short direct write to {path} ({n} of {length - written} bytes)")
            written += n

    for piece in streamed_pieces(head, order, load or tensors.__getitem__):
        while piece:
            take = min(len(piece), CHUNK_BYTES - filled)
            view[filled:filled + take] = piece[:take]
            filled += take
            piece = piece[take:]
            if filled == CHUNK_BYTES:
                digest.update(view[:filled])
                flush(filled)
                total += filled
                filled = 0
        piece = None  # the tensor's bytes: freed before the next tensor is read (streamed_pieces)
    if filled:
        digest.update(view[:filled])
        padded = filled + (-filled % ALIGNMENT)
        view[filled:padded] = bytes(padded - filled)
        flush(padded)
        total += filled
        os.ftruncate(fd, total)  # the tail's padding was written for alignment only
    os.fsync(fd)
    return digest.hexdigest()


def _bounce_buffer() -> memoryview:
    """This thread's CHUNK_BYTES buffer, page-aligned (an anonymous mapping) as O_DIRECT needs."""
    if getattr(_bounce, "view", None) is None or len(_bounce.view) != CHUNK_BYTES:
        _bounce.view = memoryview(mmap.mmap(-1, CHUNK_BYTES))
    return _bounce.view


def streamed_pieces(head: bytes, order: list[str], load: Callable[[str], torch.Tensor]) -> Iterator[memoryview]:
    """The file's bytes in order, as memoryviews: the header, then each tensor's data, `load(name)` called as it is
    reached and its tensor dropped before the next one's call (a caller that lets go of each piece before asking for
    the next holds one tensor at a time)."""
    import torch  # lazy: the store imports this module and stays torch-free until a big write

    yield memoryview(head)
    for name in order:
        t = load(name)
        if t.numel():
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            yield memoryview(data).cast("B")
            del data
        del t


def held_bytes(largest_file: float) -> int:
    """Anonymous memory this module holds while a stage reads and writes files up to `largest_file` bytes: the two
    read buffers of `sha256_around_cache` and the writing thread's bounce buffer (kept). Smaller files go through the
    page cache and hold none."""
    return 3 * CHUNK_BYTES if largest_file >= DIRECT_MIN_BYTES else 0


def remember(path: Path, digest: str) -> None:
    """Keep `digest` as the sha256 of the file now at `path` (its inode, size and modification time)."""
    st = os.stat(path)
    _digests[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = digest


def written_digest(st: os.stat_result) -> str | None:
    """The sha256 this process wrote a file with, if the file is still that one (same inode, size and modification
    time), else None."""
    return _digests.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def sha256_around_cache(path: Path, on_chunk=None) -> str | None:
    """The sha256 of a large file read around the page cache (O_DIRECT), each chunk read on a helper thread while
    the one before is hashed (both release the GIL), so checking a file costs the slower of the disk's read and the
    hash, not their sum; `on_chunk(n)` after each chunk. None where the filesystem or platform refuses O_DIRECT.
    A 2.18 GB file this module wrote was checked in 12.3 s through the page cache on the development VM, in 2.35 s
    so (benchmarks/results/planner-log.md, "Quiet re-measure and the fixes it found")."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    buffers = [mmap.mmap(-1, CHUNK_BYTES), mmap.mmap(-1, CHUNK_BYTES)]
    h = hashlib.sha256()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="llmc-read") as reader:
            which, pending = 0, reader.submit(os.readv, fd, [buffers[0]])
            while (n := pending.result()) > 0:
                pending = reader.submit(os.readv, fd, [buffers[1 - which]])
                h.update(memoryview(buffers[which])[:n])
                if on_chunk is not None:
                    on_chunk(n)
                which = 1 - which
    except OSError as e:
        if e.errno == errno.EINVAL:  # the filesystem opened it O_DIRECT but refuses such reads
            return None
        raise
    finally:
        os.close(fd)
        for b in buffers:
            b.close()
    return h.hexdigest()
