"""This machine's disk as the plan sees it: the sequential write+fsync and read rates of the cache's filesystem,
probed like the other rates (llmc.planning.probes: timed, cached per machine in machine-rates.json, measured again
with --reprobe), so no gigabyte-scale term of a plan rests on a constant measured on one VM.

Both probes go around the page cache, because what they must measure is the disk: a file small enough to stay in
the page cache's dirty limits is "written" at memory speed (a 16 MB `save_file` + fsync read 0.6-0.9 GB/s where
the stages' gigabyte writes ran under 0.3: benchmarks/results/planner-log.md, "Tried and reverted"), and a file
just written is read back from memory. So the write is `O_DIRECT` + fsync of PROBE_BYTES, and the read is an
`O_DIRECT` read of that file; where the filesystem refuses `O_DIRECT` (tmpfs before Linux 6.6, some FUSE and
network filesystems) the write is buffered + fsync and the read follows `posix_fadvise(DONTNEED)`, which drops the
file's clean pages first. Each probe runs REPEATS times for at least MIN_SAMPLE_S: about 1 s for both on a disk of
~1 GB/s, 64 MB write and read per call.

A model's source is the exception: it is read through mmap (safetensors), and the page cache may hold it when the
plan is made (a download or an earlier build just read or wrote it; llmc's own hashing reads around the cache).
`resident_share` asks the kernel (mincore) how much of it is there, and `source_read_seconds` prices that share at
`cached_read_rate`, the copy out of a cached mapping, and the rest at the disk's read rate.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from llmc.planning import probes
from llmc.storage.direct_io import DIRECT_MIN_BYTES

PROBE_BYTES = DIRECT_MIN_BYTES  # 64 MB: the smallest file the stages write around the page cache
CHUNK = 16 << 20  # bytes per write or read call (direct_io's chunk)
REPEATS = 3  # timed runs per probe
# each run repeats its call at least this long: I/O waits on the disk, not on a slice of a busy CPU, so a shorter
# span than the compute probes' MIN_SAMPLE_S measures it (both probes ~1 s on a ~1 GB/s disk)
MIN_SAMPLE_S = 0.1
WRITE_KEY = "disk write+fsync"
READ_KEY = "disk read uncached"
CACHED_READ_KEY = "page cache read"


def write_rate() -> float:
    """Bytes/s a large file is written sequentially and made durable (fsync), around the page cache."""
    return probes.rate(WRITE_KEY, _timer("write"), repeats=REPEATS)


def read_rate() -> float:
    """Bytes/s a file the page cache does not hold is read sequentially."""
    return probes.rate(READ_KEY, _timer("read"), repeats=REPEATS)


def cached_read_rate() -> float:
    """Bytes/s a file the page cache holds is copied out of a fresh read-only mapping, as safetensors reads a
    tensor: page faults and a copy, no disk."""
    return probes.rate(CACHED_READ_KEY, _cached_timer(), repeats=REPEATS)


@contextlib.contextmanager
def _probe_folder() -> Iterator[Path]:
    """A temporary folder on the cache's filesystem (the rates file's), or the system's without a cache."""
    where = probes.book().path
    parent = None
    if where is not None:
        with contextlib.suppress(OSError):  # a cache not writable yet: the plan says so elsewhere
            where.parent.mkdir(parents=True, exist_ok=True)
            parent = where.parent
    try:
        folder = tempfile.TemporaryDirectory(prefix=".llmc-disk-probe-", dir=parent)
    except OSError:
        folder = tempfile.TemporaryDirectory(prefix=".llmc-disk-probe-")
    with folder as name:
        yield Path(name)


def _aligned_buffer() -> mmap.mmap:
    """CHUNK bytes of page-aligned memory (O_DIRECT wants the buffer aligned), filled with non-zero bytes."""
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(4096) * (CHUNK // 4096))
    return buf


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o600)


def write_file(path: Path, buf: mmap.mmap, direct: bool) -> None:
    """PROBE_BYTES written to `path` from `buf` and fsynced (O_DIRECT when `direct`)."""
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        view = memoryview(buf)
        for _ in range(PROBE_BYTES // CHUNK):
            os.write(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, buf: mmap.mmap, direct: bool) -> None:
    """`path` read whole into `buf`, CHUNK at a time; without O_DIRECT its pages are dropped from the cache first."""
    fd = _open(path, os.O_RDONLY, direct)
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)


def _supports_direct(path: Path, buf: mmap.mmap) -> bool:
    """Whether the filesystem at `path` takes an O_DIRECT write (the probe file written once so)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        write_file(path, buf, direct=True)
        return True
    except OSError:  # EINVAL: the filesystem refuses O_DIRECT
        return False


def _file_probe(setup, call):
    """A function timing one run of `call(state)` over PROBE_BYTES and returning its bytes/s. `setup(stack, state)`
    makes the probe's folder, buffer and file on its first call (a cached rate makes none of them); after REPEATS
    runs they go (a killed plan leaves a hidden temp)."""
    state: dict = {}

    def run_once() -> float:
        if not state:
            stack = contextlib.ExitStack()
            setup(stack, state)
            state["stack"] = stack
        try:
            return probes.sustained_rate(PROBE_BYTES, lambda: call(state), min_s=MIN_SAMPLE_S)
        finally:
            state["runs"] = state.get("runs", 0) + 1
            if state["runs"] == REPEATS:
                state.pop("stack").close()
                state.clear()

    return run_once


def _probe_file(stack: contextlib.ExitStack, state: dict, name: str) -> None:
    """The probe's folder and aligned buffer, and `name` in that folder, into `state` (path, buf)."""
    folder = stack.enter_context(_probe_folder())
    buf = _aligned_buffer()
    stack.callback(buf.close)
    state.update(path=folder / name, buf=buf)


def _timer(which: str):
    """A function timing one run of the `which` ("write" | "read") probe, around the page cache."""
    def setup(stack: contextlib.ExitStack, state: dict) -> None:
        _probe_file(stack, state, "probe.bin")
        state["direct"] = _supports_direct(state["path"], state["buf"])
        if not state["direct"]:
            write_file(state["path"], state["buf"], direct=False)

    io = write_file if which == "write" else read_file
    return _file_probe(setup, lambda state: io(state["path"], state["buf"], state["direct"]))


def _copy_out_of_cache(path: Path) -> None:
    """`path` (in the page cache) mapped read-only and copied into new memory, as safetensors reads a tensor."""
    import numpy as np  # lazy: only when the probe runs (a cached rate imports nothing)

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        view.copy()
        del view  # the mapping closes only once no array exports it


def _cached_timer():
    """A function timing one run of the cached-read probe (its file written through the page cache and read once
    on the first call)."""
    def setup(stack: contextlib.ExitStack, state: dict) -> None:
        _probe_file(stack, state, "cached.bin")
        write_file(state["path"], state["buf"], direct=False)
        _copy_out_of_cache(state["path"])  # every page in the cache before the first timed run

    return _file_probe(setup, lambda state: _copy_out_of_cache(state["path"]))


def resident_share(paths: list[Path]) -> float:
    """The share of these files' bytes the page cache holds now (Linux mincore over a read-only mapping of each);
    0.0 where the kernel cannot say (another OS, an unreadable file): the plan then reads them all from the disk."""
    import ctypes  # lazy: once a plan, for the source's files

    total = resident = 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        for path in paths:
            size = os.path.getsize(path)
            if size == 0:
                continue
            pages = -(-size // mmap.PAGESIZE)
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return 0.0
                try:
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return 0.0
                    held = pages - bytes(vec).count(0)
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
            total += size
            resident += min(size, held * mmap.PAGESIZE)
    except (OSError, AttributeError):
        return 0.0
    return resident / total if total else 0.0


def source_read_seconds(nbytes: float, resident: float = 0.0, converted_bytes: float = 0.0) -> float:
    """Seconds to read `nbytes` of the model's source, `resident` (0-1) of which the page cache holds: that share
    copied out of memory at the probed cached rate, the rest read from the disk; into `converted_bytes` of another
    dtype in the same pass where that is not 0 (`converted_read_seconds`)."""
    if converted_bytes:
        return converted_read_seconds(nbytes, converted_bytes, resident)
    if nbytes <= 0:
        return 0.0
    cached = nbytes * min(max(resident, 0.0), 1.0)
    return (nbytes - cached) / read_rate() + (cached / cached_read_rate() if cached else 0.0)


def converted_read_seconds(stored_bytes: float, converted_bytes: float, resident: float = 0.0) -> float:
    """Seconds to read `stored_bytes` of the model's source into `converted_bytes` of another dtype in one pass over
    its mapped files, `resident` (0-1) of them in the page cache: what the cache lacks read from the disk, then every
    stored byte read and every converted byte written at the copy probe's pace (it moves two bytes, one read and one
    written, per byte it counts)."""
    if stored_bytes <= 0:
        return 0.0
    cold = stored_bytes * (1 - min(max(resident, 0.0), 1.0))
    return read_seconds(cold) + (stored_bytes + converted_bytes) / (2 * cached_read_rate())


def write_seconds(nbytes: float) -> float:
    """Seconds to write `nbytes` sequentially and fsync them, at the probed rate."""
    return nbytes / write_rate() if nbytes > 0 else 0.0


def read_seconds(nbytes: float) -> float:
    """Seconds to read `nbytes` the page cache does not hold, at the probed rate."""
    return nbytes / read_rate() if nbytes > 0 else 0.0
