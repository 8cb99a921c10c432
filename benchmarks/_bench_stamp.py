"""What every row of benchmarks/gpu_calibration.py is stamped with, so a figure can be traced to the code and the machine
that made it: a content hash of llmc/ and whether the checkout differed from its commit (a device copy's git metadata
may name another commit than the code run: docs/gpu.md), the GPU and its driver, the filesystem the model and the
outputs were written to, and that filesystem's read and write rates measured here (llmc writes every layer and
resume point to disk inside its timer; llm-compressor keeps the model in memory).

Needs nothing but the standard library (and torch, already imported, for the GPU's name).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path


def tree_sha256(folder: Path) -> str:
    """sha256 over every file under `folder` (sorted relative paths and their bytes), caches and bytecode left out:
    two checkouts with the same hash ran the same code, whatever their git metadata says."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and p.suffix not in (".pyc", ".pyo")):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def git_state(repo: Path, paths: tuple[str, ...] = ("llmc", "benchmarks")) -> dict:
    """The commit and whether `paths` differ from it (None for both where there is no git or no repository)."""
    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None

    head = git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--", *paths)
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status is not None
            and status.returncode == 0 else None}


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/mounts): ext4, xfs,
    overlay, tmpfs, ... None off Linux."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best = str(Path(path).resolve()), (None, -1)
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best[1]:
            best = (fields[2], len(point))
    return best[0]


def disk_rates(folder: Path, megabytes: int = 256) -> dict:
    """Write `megabytes` to a file in `folder` with fsync, drop it from the page cache, read it back: MB/s each way
    (the read is from the device only where the kernel honoured the drop; tmpfs reads memory)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".disk-probe-{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        t = time.monotonic()
        with open(path, "wb") as f:
            for _ in range(megabytes):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.monotonic() - t
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.monotonic()
            while os.read(fd, 8 << 20):
                pass
            read_s = time.monotonic() - t
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"disk_write_mb_s": megabytes / max(write_s, 1e-9), "disk_read_mb_s": megabytes / max(read_s, 1e-9),
            "disk_probe_mb": megabytes}


def gpu_identity(device: str) -> dict:
    """The GPU's name (torch) and driver version (nvidia-smi); None for both on a CPU run."""
    if not device.startswith("cuda"):
        return {"gpu": None, "driver": None}
    import torch

    index = torch.device(device).index or 0
    driver = None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index)],
                           capture_output=True, text=True, timeout=30)
        driver = (r.stdout.strip() or None) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"gpu": torch.cuda.get_device_name(index), "driver": driver}


def environment_stamp(repo: Path, work: Path, device: str, probe_mb: int) -> dict:
    """Every field a row is stamped with (stamp_row)."""
    git = git_state(repo)
    return {"llmc_sha256": tree_sha256(repo / "llmc"), "llmc_commit": git["commit"], "llmc_dirty": git["dirty"],
            **gpu_identity(device), "fs_type": filesystem_type(work), "work_dir": str(work),
            **(disk_rates(work, probe_mb) if probe_mb else {})}


def stamp_row(row: dict, stamp: dict) -> dict:
    """`row` with the stamp under "stamp" (the row's own fields are never overwritten)."""
    return {**row, "stamp": stamp}
