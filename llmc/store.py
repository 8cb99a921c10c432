"""Content-addressed stage outputs and atomic writes.

Each stage's output is a directory `<root>/stages/<stage>/<key>` where key hashes the stage's
config, its inputs' keys and the llmc version. A directory is only ever made visible by one
rename from `<key>.partial`, so a complete-looking output is complete. A resumable stage may keep
work in its `.partial` directory across a crash; a non-resumable one starts it afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmc import __version__
from llmc import events
from llmc.errors import LlmcError
from llmc.resource_errors import resource_error

COMPLETE_MARKER = ".llmc-complete"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stage_key(stage: str, config: Any, inputs: list[str] | tuple[str, ...] = ()) -> str:
    """Key of a stage's output: its name, config, input keys and the llmc version."""
    payload = canonical_json(
        {"stage": stage, "config": config, "inputs": list(inputs), "llmc": __version__}
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def resource_errors(what: str, where: Path) -> Iterator[None]:
    """Turn a full disk, an exceeded quota, an I/O error or running out of memory inside the block (also when a
    library wraps it, as safetensors does) into a ResourceError naming `what` was written `where`
    (llmc.resource_errors). The innermost block names the most precise place; outer ones pass it on."""
    try:
        yield
    except LlmcError:
        raise
    except Exception as e:
        error = resource_error(e, what, where)
        if error is None:
            raise
        raise error from e


disk_errors = resource_errors  # the earlier name, for callers that still use it


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    with resource_errors(path.name, path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    fsync_dir(path.parent)
    events.emit(f"file:{path.name}")


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """safetensors.save_file to a temp name, fsync, rename."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with resource_errors(path.name, path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    fsync_dir(path.parent)
    events.emit(f"file:{path.name}")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Store:
    """The cache root: stage outputs plus a memo of file hashes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            from llmc.errors import InputError
            from llmc.inputs import shown

            raise InputError(f"the cache {shown(self.root)} cannot be used as a directory ({e.strerror})",
                             fix="point --cache-dir or LLMC_CACHE at a writable directory") from None

    @classmethod
    def default(cls, override: str | Path | None = None) -> "Store":
        root = override or os.environ.get("LLMC_CACHE") or Path.home() / ".cache" / "llmc"
        return cls(Path(root))

    def stage_dir(self, stage: str, key: str) -> Path:
        return self.root / "stages" / stage / key

    def lookup(self, stage: str, key: str) -> Path | None:
        d = self.stage_dir(stage, key)
        return d if (d / COMPLETE_MARKER).is_file() else None

    @contextlib.contextmanager
    def produce(self, stage: str, key: str, *, resumable: bool = False) -> Iterator[Path]:
        """Yield a work directory; on clean exit it becomes the stage's complete output."""
        final = self.stage_dir(stage, key)
        partial = final.with_name(final.name + ".partial")
        if not resumable and partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        with resource_errors(f"stage '{stage}'", partial):
            yield partial
            atomic_write_json(partial / COMPLETE_MARKER, {"stage": stage, "key": key, "llmc": __version__})
            if final.exists():  # an older incomplete leftover (no marker): replace it
                shutil.rmtree(final)
            os.replace(partial, final)
            fsync_dir(final.parent)

    def file_hash(self, path: Path) -> str:
        """sha256 of a file, memoized by (path, size, mtime) so big checkpoints hash once."""
        path = Path(path).resolve()
        st = path.stat()
        memo_path = self.root / "file-hashes.json"
        try:
            memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
        except (OSError, ValueError):  # unreadable or not JSON: a memo, rebuilt
            memo = {}
        if not isinstance(memo, dict):
            memo = {}
        tag = f"{st.st_size}:{st.st_mtime_ns}"
        entry = memo.get(str(path))
        if entry and entry.get("tag") == tag:
            return entry["sha256"]
        digest = sha256_file(path)
        memo[str(path)] = {"tag": tag, "sha256": digest}
        atomic_write_json(memo_path, memo)
        return digest
