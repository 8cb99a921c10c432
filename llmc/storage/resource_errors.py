"""The one place that recognises a resource error: disk full, quota, I/O error, out of memory.

They arrive in many shapes. Python raises OSError with an errno, but libraries wrap it: safetensors raises
`SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')` (no errno, no
path), tokenizers a plain Exception with the same text, numpy's `tofile` (gguf's tensor writer) an OSError without
an errno ("65536 requested and 16352 written"), torch a RuntimeError from its CPU allocator
("DefaultCPUAllocator: can't allocate memory") or `torch.OutOfMemoryError` for CUDA. `resource_error` looks at
the exception and at its causes and turns any of these into a `ResourceError` (exit 4) that names what was being
written and where, with the fix. `llmc.storage.store.resource_errors` applies it around every write llmc makes, and the
CLI applies it once more to anything that escapes, so no resource failure ends as an internal error.

EIO is reported as exit 4 too: like a full disk it is the storage, not the recipe or the input, that failed, and
the remedy is the same (fix or change the disk, rerun; finished stages are kept).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from pathlib import Path

from llmc.errors import ResourceError

DISK_FULL, QUOTA, IO_ERROR, OUT_OF_MEMORY, GPU_OUT_OF_MEMORY = (
    "disk full", "disk quota exceeded", "I/O error", "out of memory", "out of GPU memory")

_ERRNOS = {errno.ENOSPC: DISK_FULL, errno.EDQUOT: QUOTA, errno.EIO: IO_ERROR, errno.ENOMEM: OUT_OF_MEMORY}
# How wrapped errors spell them: Rust's io::Error ("... (os error 28)"), C's strerror, torch's allocators.
_MESSAGES = [
    (re.compile(r"no space left on device|os error 28\b|errno 28\b|storagefull", re.I), DISK_FULL),
    # numpy's ndarray.tofile (gguf's tensor writer) on a short write, errno dropped: a full disk in practice
    (re.compile(r"\b\d+ requested and \d+ written\b"), DISK_FULL),
    (re.compile(r"disk quota exceeded|os error 122\b|errno 122\b|quotaexceeded", re.I), QUOTA),
    (re.compile(r"input/output error|os error 5\b|errno 5\b", re.I), IO_ERROR),
    (re.compile(r"cuda out of memory|cuda error: out of memory|hip out of memory|out of memory on device", re.I),
     GPU_OUT_OF_MEMORY),
    (re.compile(r"can't allocate memory|cannot allocate memory|failed to allocate memory|bad_alloc|bad allocation"
                r"|os error 12\b|errno 12\b", re.I),
     OUT_OF_MEMORY),
]

_RESUME = "finished stages are kept and a rerun resumes where this one stopped"
FIXES = {
    DISK_FULL: "free disk space or point LLMC_CACHE / --cache-dir (and publish.registry) at a larger disk, then "
               f"rerun: {_RESUME}",
    QUOTA: f"free space within your quota or point LLMC_CACHE / --cache-dir at another disk, then rerun: {_RESUME}",
    IO_ERROR: "the disk failed to read or write (check `dmesg` and the disk's health); rerun on a healthy disk: "
              f"{_RESUME}",
    OUT_OF_MEMORY: "free memory or use a larger machine; lower calibration.samples, eval.batch_size or eval.windows, "
                   f"or set calibration.spill_activations: always; then rerun: {_RESUME}",
    GPU_OUT_OF_MEMORY: "free GPU memory (other processes), or set calibration.device: cpu, or lower "
                       f"calibration.samples / eval.batch_size; then rerun: {_RESUME}",
}


def resource_kind(exc: BaseException) -> str | None:
    """Which resource ran out behind `exc` (or one of its causes), or None for any other error."""
    return next((kind for e in _chain(exc) if (kind := _kind_of(e))), None)


def _kind_of(e: BaseException) -> str | None:
    return kind_from_description([c.__name__ for c in type(e).__mro__], getattr(e, "errno", None), str(e))


def kind_from_description(type_names: list[str], errno_value: int | None, text: str) -> str | None:
    """Which resource ran out, from an exception's class names (its MRO), errno and message: what an exception
    raised in another process (an engine worker) can send back."""
    if "MemoryError" in type_names:
        return OUT_OF_MEMORY
    if "OutOfMemoryError" in type_names:  # torch.OutOfMemoryError (CUDA, MPS, XPU); no torch import needed
        return GPU_OUT_OF_MEMORY
    if errno_value in _ERRNOS:
        return _ERRNOS[errno_value]
    if "OSError" in type_names and errno_value is not None:
        return None  # an OSError that says what it is (missing file, permission, ...): not a resource error
    for pattern, kind in _MESSAGES:
        if pattern.search(text):
            return kind
    return None


def resource_error(exc: BaseException, what: str | None = None, where: Path | str | None = None
                   ) -> ResourceError | None:
    """A ResourceError for `exc` when a resource ran out behind it, naming `what` was being written `where`;
    None otherwise. Without `where`, the path comes from the OSError itself when it carries one."""
    kind = resource_kind(exc)
    if kind is None:
        return None
    if where is None:
        where = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    return error_for(kind, what, where, _detail(type(exc).__name__, str(exc)))


def raise_if_resource(exc: BaseException, what: str | None = None, where: Path | str | None = None) -> None:
    """For a broad `except Exception` that turns failures into another error: let a resource failure through as
    itself (exit 4) instead of as a corrupt input or a failed runtime."""
    if (error := resource_error(exc, what, where)) is not None:
        raise error from exc


def error_for(kind: str, what: str | None, where: Path | str | None, detail: str = "") -> ResourceError:
    """The ResourceError for a `kind` of this module: "<kind> writing <what> under <where> (<detail>)" + fix."""
    verb = "reading or writing" if kind == IO_ERROR else "writing" if kind in (DISK_FULL, QUOTA) else "in"
    place = f" {verb} {what}" if what else ""
    place += f" under {where}" if where is not None else ""
    return ResourceError(f"{kind}{place}" + (f" ({detail})" if detail else ""), fix=FIXES[kind])


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it was raised from or while handling, each once."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _detail(type_name: str, text: str) -> str:
    """The library's own words, one line and short: which allocation, which device."""
    text = " ".join(text.split())
    return f"{type_name}: {text[:200]}" + ("..." if len(text) > 200 else "") if text else ""
