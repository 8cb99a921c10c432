"""Content-addressed stage outputs and atomic writes.

Each stage's output is a directory `<root>/stages/<stage>/<key>` where key hashes the stage's
config, its inputs' keys and the llmc version. A directory is only ever made visible by one
rename from `<key>.partial`, so a complete-looking output is complete. A resumable stage may keep
work in its `.partial` directory across a crash; a non-resumable one starts it afresh.

Reuse is verified: the complete marker records every file's size and sha256, a reused output must still
have exactly those files at those sizes, and an output read to produce another stage (or published) is
checked byte for byte. One lock per stage key serializes producers across processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from llmc import __version__
from llmc.telemetry import events
from llmc.errors import InputError, LlmcError
from llmc.storage.paths import confined
from llmc.telemetry.progress import Meter, log
from llmc.storage.resource_errors import resource_error
from llmc.storage.links import share_identical_files, sweep_blobs
from llmc.storage import direct_io
from llmc.inputs.files import shown

COMPLETE_MARKER = ".llmc-complete"
BLOBS = "blobs"  # <cache>/blobs/<sha256[:2]>/<sha256>: hard links of large stage files (llmc.storage.links)


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
    (llmc.storage.resource_errors). The innermost block names the most precise place; outer ones pass it on."""
    try:
        yield
    except LlmcError:
        raise
    except Exception as e:
        error = resource_error(e, what, where)
        if error is None:
            raise
        raise error from e




def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    with resource_errors(path.name, path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, _file_mode())  # mkstemp makes 0600; a cache shared by a team follows the umask
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


def _atomic_safetensors(path: Path, write: Callable[[Path], str | None]) -> None:
    """The lifecycle both safetensors writers share: `write(tmp)` writes a temp name beside `path`, made durable, and
    returns its sha256 where it hashed it (else None); then rename, directory fsync, the file's event. A failure
    removes the temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with resource_errors(path.name, path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            digest = write(tmp)
            os.replace(tmp, path)
            if digest is not None:
                direct_io.remember(path, digest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    fsync_dir(path.parent)
    events.emit(f"file:{path.name}")


def atomic_save_safetensors_streamed(path: Path, like: dict, load, metadata: dict[str, str] | None = None) -> None:
    """`atomic_save_safetensors` of tensors read one at a time as their bytes are written: `like` holds meta tensors
    of their dtypes and shapes, `load(name)` reads one (the same bytes as the whole dict written at once; one tensor
    in memory instead of all of them: a 405B's embedding and head are 4.2 GB each)."""
    def write(tmp: Path) -> str:
        if sum(v.numel() * v.element_size() for v in like.values()) >= direct_io.DIRECT_MIN_BYTES:
            digest = direct_io.write_safetensors(tmp, like, metadata, load=load)
            if digest is not None:
                return digest
        head, order = direct_io.header(like, metadata)
        hashed = hashlib.sha256()
        with open(tmp, "wb") as f:
            for piece in direct_io.streamed_pieces(head, order, load):
                f.write(piece)
                hashed.update(piece)
                piece = None  # noqa: PLW2901 -- freed before the next tensor is read
            f.flush()
            os.fsync(f.fileno())
        return hashed.hexdigest()

    _atomic_safetensors(path, write)


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """safetensors to a temp name, fsync, rename. A file of DIRECT_MIN_BYTES or more is written around the page
    cache and hashed as it is written (llmc.storage.direct_io), where the filesystem allows it."""
    from safetensors.torch import save_file  # lazy: safetensors.torch imports torch; the store stays torch-free

    def write(tmp: Path) -> str | None:
        whole = {k: v.contiguous() for k, v in tensors.items()}
        if sum(v.numel() * v.element_size() for v in whole.values()) >= direct_io.DIRECT_MIN_BYTES:
            digest = direct_io.write_safetensors(tmp, whole, metadata)
            if digest is not None:
                return digest
        save_file(whole, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        return None

    _atomic_safetensors(path, write)


_METERED_HASH_BYTES = 1 << 28  # files this large say how far their hashing has got (a 70B shard takes minutes)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        meter = Meter(f"hash {Path(path).name}", size, unit="B", every_s=10.0) if size >= _METERED_HASH_BYTES else None
        with meter or contextlib.nullcontext():
            # large files (written around the page cache where llmc wrote them) are read around it too
            direct = (direct_io.sha256_around_cache(path, meter.advance if meter else None)
                      if size >= direct_io.DIRECT_MIN_BYTES else None)
            if direct is not None:
                return direct
            while block := f.read(chunk):
                h.update(block)
                if meter is not None:
                    meter.advance(len(block))
    return h.hexdigest()


def current_sha256(path: Path) -> str:
    """The sha256 of the file at `path`: the one this process wrote it with while it is unchanged
    (llmc.storage.direct_io), else read and hashed."""
    return direct_io.written_digest(os.stat(path)) or sha256_file(path)


RESUMABLE_MARKER = ".llmc-resumable"  # in a resumable stage's .partial folder: keep it for the next run


class CorruptOutput(InputError):
    """A cached stage output no longer holds the bytes recorded when it was written."""


def record_files(folder: Path) -> dict[str, dict]:
    """What a folder holds, for verifying it later: '/'-separated relative path -> {size, sha256} for each file
    ({symlink: target} for a link), everything but the complete marker. Hard links of one file hash once."""
    folder = Path(folder)
    by_inode: dict[tuple[int, int], str] = {}
    files: dict[str, dict] = {}
    for rel, st, path in walk_files(folder):
        if rel == COMPLETE_MARKER:
            continue
        if stat.S_ISLNK(st.st_mode):
            files[rel] = {"symlink": os.readlink(path)}
            continue
        inode = (st.st_dev, st.st_ino)
        if inode not in by_inode:  # a file this process wrote directly was hashed as it was written
            by_inode[inode] = direct_io.written_digest(st) or sha256_file(path)
        files[rel] = {"size": st.st_size, "sha256": by_inode[inode]}
    return files


def check_files(folder: Path, recorded: dict[str, dict], *, full: bool) -> list[str]:
    """How `folder` differs from `recorded` (record_files' form): missing, extra, resized, and with `full` also
    changed bytes. Empty: it matches. Sizes cost one stat per file; `full` reads every byte."""
    folder = Path(folder)
    problems: list[str] = []
    present = {rel: (st, path) for rel, st, path in walk_files(folder) if rel != COMPLETE_MARKER}
    for rel in sorted(set(recorded) - set(present)):
        problems.append(f"missing {rel}")
    for rel in sorted(set(present) - set(recorded)):
        problems.append(f"extra {rel}")
    for rel in sorted(set(recorded) & set(present)):
        want, (st, path) = recorded[rel], present[rel]
        if stat.S_ISLNK(st.st_mode) or "symlink" in want:
            if want.get("symlink") != (os.readlink(path) if stat.S_ISLNK(st.st_mode) else None):
                problems.append(f"changed link {rel}")
        elif st.st_size != want.get("size"):
            problems.append(f"resized {rel} ({want.get('size')} -> {st.st_size} bytes)")
        elif full and sha256_file(path) != want.get("sha256"):
            problems.append(f"modified {rel} (sha256 differs)")
    return problems


def walk_files(folder: Path) -> Iterator[tuple[str, os.stat_result, Path]]:
    """(relative path, lstat, path) of every file and symbolic link under `folder`, links not followed."""
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            path = base / name
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                continue  # walked into (a link to a folder is not a folder by lstat: it is listed)
            yield path.relative_to(folder).as_posix(), st, path


def _file_mode(executable: bool = False) -> int:
    """The mode a new file gets under this process's umask (0644 with the usual 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def remove_if_abandoned(leftover: Path, lock: FileLock) -> bool:
    """Remove a work folder whose producer is gone (its lock is free: a live producer holds it); False if one lives."""
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return False
    try:
        log(f"removing {leftover}: left by an llmc process that is gone")
        shutil.rmtree(leftover, ignore_errors=True)
        return True
    finally:
        lock.release()


class Store:
    """The cache root: stage outputs plus a memo of file hashes.

    Each stage key has a lock (`<root>/locks/<stage>/<key>.lock`, held while the stage is produced, looked up or
    discarded): a second process that wants a stage another one is producing waits for it and reuses it. A
    complete output records every file's size and sha256 in its marker; `lookup` reuses it only when every
    recorded file is there with its size and nothing else is (else it is discarded, with a warning, and rebuilt),
    and a stage that reads another's output to produce its own verifies every byte of it first (`require_intact`).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if (resource := resource_error(e)) is not None:  # a full disk is not a bad path
                raise resource from None

            raise InputError(f"the cache {shown(self.root)} cannot be used as a directory ({e.strerror})",
                             fix="point --cache-dir or LLMC_CACHE at a writable directory") from None
        self._intact: set[tuple[str, int]] = set()  # (folder, marker mtime) verified in full by this process

    @classmethod
    def default(cls, override: str | Path | None = None) -> "Store":
        root = override or os.environ.get("LLMC_CACHE") or Path.home() / ".cache" / "llmc"
        return cls(Path(root))

    def stage_dir(self, stage: str, key: str) -> Path:
        return confined(self.root, f"stages/{stage}/{key}", what="stage folder")

    # ------------------------------------------------------------------ locks

    def _lock(self, stage: str, key: str) -> FileLock:
        path = confined(self.root, f"locks/{stage}/{key}.lock", what="lock file")
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(path), is_singleton=True)

    @contextlib.contextmanager
    def locked(self, stage: str, key: str) -> Iterator[None]:
        """Hold the stage key's lock, waiting (with a log line) while another process holds it."""
        lock = self._lock(stage, key)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            log(f"waiting for another llmc process working on {stage} {key[:12]} (lock {lock.lock_file})")
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    # ------------------------------------------------------------------ reuse

    def lookup(self, stage: str, key: str, *, full: bool = False) -> Path | None:
        """The stage's complete output if it still matches its record (sizes; every byte with `full`), else None.
        A stage another process is producing is waited for."""
        d = self.stage_dir(stage, key)
        with self.locked(stage, key):
            if not (d / COMPLETE_MARKER).is_file():
                return None
            problems = self._problems(d, full=full)
            if problems:
                self.discard(d, problems)
                return None
        return d

    def recorded(self, folder: Path) -> dict[str, dict]:
        """The files a complete stage output recorded when it was written (record_files' form); {} without one."""
        return self.record(folder)[0]

    def record(self, folder: Path) -> tuple[dict[str, dict], str | None]:
        """(recorded files, None), or ({}, why there is no record): what is known, so a warning blames the right
        cause (a concurrent process, damage, or an llmc that wrote no record)."""
        try:
            text = (Path(folder) / COMPLETE_MARKER).read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}, (f"its {COMPLETE_MARKER} is gone: another llmc process discarded or replaced this output "
                        "while this one was using it")
        except (OSError, UnicodeDecodeError) as e:
            return {}, f"its {COMPLETE_MARKER} cannot be read ({type(e).__name__})"
        try:
            files = json.loads(text).get("files")
        except (ValueError, AttributeError):
            return {}, f"its {COMPLETE_MARKER} is not the JSON object llmc writes (damaged or edited)"
        if not isinstance(files, dict) or not files:
            return {}, f"its {COMPLETE_MARKER} records no files (written by an llmc that kept no record, or edited)"
        return files, None

    def require_intact(self, folder: Path) -> None:
        """Check every byte of a complete stage output against its record before reading it to produce another;
        a mismatch discards it and raises CorruptOutput (`llmc.build.build` then rebuilds it)."""
        folder = Path(folder)
        marker = folder / COMPLETE_MARKER
        try:
            tag = (str(folder), marker.stat().st_mtime_ns)
        except FileNotFoundError:
            tag = None
        if tag is not None and tag in self._intact:
            return
        problems = self._problems(folder, full=True) if tag else ["missing its complete marker"]
        if problems:
            if tag:
                self.discard(folder, problems)
            raise CorruptOutput(
                f"cached {folder.parent.name} output {folder} changed after it was written: {_summary(problems)}",
                fix="rerun: the output was discarded and is rebuilt; if it happens again, check the disk")
        self._intact.add(tag)

    def _problems(self, folder: Path, *, full: bool) -> list[str]:
        recorded, why = self.record(folder)
        return [why] if why else check_files(folder, recorded, full=full)

    def discard(self, folder: Path, problems: list[str]) -> None:
        stage, key = folder.parent.name, folder.name
        with self.locked(stage, key):
            log(f"warning: cached {stage} output {key[:12]} does not match what was recorded when it was written "
                f"({_summary(problems)}); discarded, it is rebuilt")
            trash = folder.with_name(f"{key}.discard-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ produce

    def materialized(self, stage: str, key: str, produce: Callable[[Path], None]) -> Path:
        """The stage's complete output: found, or written now by `produce(folder)` under the key's lock. For the
        outputs made before the stage walk (a demo model's joined parts, a GGUF source unpacked); the stages go
        through `llmc.pipeline.runner`, which adds their records, events and input checks."""
        done = self.lookup(stage, key)
        if done is None:
            with self.produce(stage, key) as out:
                produce(out)
            done = self.lookup(stage, key)
        if done is None:  # committed a moment ago: only a concurrent discard could remove it
            raise CorruptOutput(f"the {stage} output {key} vanished right after it was written",
                                fix="run the command again")
        return done

    @contextlib.contextmanager
    def produce(self, stage: str, key: str, *, resumable: bool = False) -> Iterator[Path]:
        """Yield a work directory; on clean exit it becomes the stage's complete output, with its files recorded.

        Holds the stage key's lock throughout. A non-resumable stage's leftover `.partial` (its producer is gone:
        the lock was free) is removed; a resumable one's is kept and carries RESUMABLE_MARKER while it works."""
        final = self.stage_dir(stage, key)
        partial = final.with_name(final.name + ".partial")
        with self.locked(stage, key):
            if not resumable and partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True, exist_ok=True)
            if resumable:
                (partial / RESUMABLE_MARKER).touch()
            with resource_errors(f"stage '{stage}'", partial):
                yield partial
                (partial / RESUMABLE_MARKER).unlink(missing_ok=True)
                recorded = record_files(partial)
                share_identical_files(partial, recorded, self.root / BLOBS,  # identical files stored once
                                      sha256_file=current_sha256)
                marker = {"stage": stage, "key": key, "llmc": __version__, "files": recorded}
                atomic_write_json(partial / COMPLETE_MARKER, marker)
                if (final / COMPLETE_MARKER).is_file() and not self._problems(final, full=False):
                    shutil.rmtree(partial)  # another process finished it while this one worked: keep theirs
                    return
                if final.exists():  # an older incomplete leftover (no marker): replace it
                    shutil.rmtree(final)
                os.replace(partial, final)
                fsync_dir(final.parent)

    def sweep(self) -> list[Path]:
        """Remove `.partial` folders of non-resumable stages and `.discard-*` folders whose producer is gone
        (their stage key's lock is free); resumable stages' `.partial` folders are kept for resume. Returns them."""
        removed = []
        stages = self.root / "stages"
        for leftover in sorted([*stages.glob("*/*.partial"), *stages.glob("*/*.discard-*")]):
            if leftover.is_symlink() or not leftover.is_dir() or (leftover / RESUMABLE_MARKER).exists():
                continue
            if remove_if_abandoned(leftover, self._lock(leftover.parent.name, leftover.name.split(".", 1)[0])):
                removed.append(leftover)
        sweep_blobs(self.root / BLOBS)  # files no stage output links to any more
        return removed

    def file_hash(self, path: Path) -> str:
        """sha256 of a file, memoized so big checkpoints hash once.

        The memo is trusted only while the file's (path, size, mtime, ctime, inode, device) are all unchanged.
        Editing a file in place changes its ctime, which no user can set back (`touch -d` and os.utime restore the
        mtime but themselves set ctime to now); replacing it changes the inode. So the content is hashed again
        after any write, rename over, copy or restore; only an untouched file keeps its memoized hash."""
        path = Path(path).resolve()
        memo, tag = self._hash_memo(), _file_tag(path)
        entry = memo.get(str(path))
        if isinstance(entry, dict) and entry.get("tag") == tag:
            return entry["sha256"]
        digest = sha256_file(path)
        memo[str(path)] = {"tag": tag, "sha256": digest}
        atomic_write_json(self.root / "file-hashes.json", memo)
        return digest

    def memoized_file_hash(self, path: Path) -> str | None:
        """file_hash's answer when the memo holds it for the file as it is now, else None; reads no file content."""
        path = Path(path).resolve()
        entry = self._hash_memo().get(str(path))
        return entry["sha256"] if isinstance(entry, dict) and entry.get("tag") == _file_tag(path) else None

    def _hash_memo(self) -> dict:
        memo_path = self.root / "file-hashes.json"
        try:
            memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
        except (OSError, ValueError):  # unreadable or not JSON: a memo, rebuilt
            memo = {}
        return memo if isinstance(memo, dict) else {}


def _file_tag(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"


def _summary(problems: list[str], shown: int = 4) -> str:
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")
