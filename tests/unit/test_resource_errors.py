"""A full disk, an I/O error or running out of memory anywhere in a build is exit 4 (resource exhausted) with the
path and the fix, never an internal error with a traceback; nothing half-written looks complete; and the rerun
after freeing space publishes the same bytes as a build that never failed.

The disk fills at one write site at a time (`FullDisk`: every write to a path matching a pattern fails the way
the library making it fails on a full disk: safetensors with its own SafetensorError, Python's file and shutil
writes with OSError ENOSPC). Where this machine lets the test mount a small tmpfs, a build also runs on a real
filesystem that fills up, at seeded random sizes."""

from __future__ import annotations

import builtins
import errno
import fnmatch
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from llmc.cli import main
from llmc.errors import ResourceError
from llmc.storage.resource_errors import (DISK_FULL, GPU_OUT_OF_MEMORY, IO_ERROR, OUT_OF_MEMORY, QUOTA, resource_error,
                                  resource_kind)
from llmc.storage.store import atomic_save_safetensors, resource_errors
from tests.unit.build_helpers import (every_stage_recipe, nothing_half_written_looks_complete,
                                      published_artifact_hashes, small_corpus_file, use_corpus_file)

# What safetensors raises when the disk fills under save_file (seen on a full tmpfs: the Rust io::Error, no errno).
SAFETENSORS_DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


# --------------------------------------------------------------------------- recognising resource errors


def _safetensor_error(message: str) -> Exception:
    from safetensors import SafetensorError

    return SafetensorError(message)


def _cpu_allocation_failure() -> RuntimeError:
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: torch's CPU allocator refuses it
    except RuntimeError as e:
        return e
    pytest.skip("this machine allocated 1 PiB")


@pytest.mark.parametrize("make, kind", [
    (lambda: OSError(errno.ENOSPC, "No space left on device"), DISK_FULL),
    (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), QUOTA),
    (lambda: OSError(errno.EIO, "Input/output error"), IO_ERROR),
    (lambda: _safetensor_error(SAFETENSORS_DISK_FULL), DISK_FULL),
    (lambda: Exception("No space left on device (os error 28)"), DISK_FULL),  # tokenizers' save
    (lambda: shutil.Error([("a", "b", "[Errno 28] No space left on device")]), DISK_FULL),  # copytree
    (lambda: OSError("65536 requested and 16352 written"), DISK_FULL),  # numpy's tofile (GGUF tensors)
    (lambda: MemoryError(), OUT_OF_MEMORY),
    (_cpu_allocation_failure, OUT_OF_MEMORY),
    (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), GPU_OUT_OF_MEMORY),
    (lambda: RuntimeError("CUDA error: out of memory"), GPU_OUT_OF_MEMORY),
])
def test_resource_errors_are_recognised_in_every_shape(make, kind: str) -> None:
    exc = make()
    assert resource_kind(exc) == kind
    wrapped = ValueError("the library's own wrapper")
    wrapped.__cause__ = exc
    assert resource_kind(wrapped) == kind  # also behind another exception


@pytest.mark.parametrize("exc", [
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"),
    PermissionError(errno.EACCES, "Permission denied", "/x"),
    ValueError("no space for another key"),
    RuntimeError("shape mismatch"),
])
def test_other_errors_are_not_resource_errors(exc: Exception) -> None:
    assert resource_kind(exc) is None and resource_error(exc) is None


def test_the_seam_names_what_and_where_and_keeps_the_cause(tmp_path: Path) -> None:
    with pytest.raises(ResourceError) as e:
        with resource_errors("model.safetensors", tmp_path):
            raise _safetensor_error(SAFETENSORS_DISK_FULL)
    assert e.value.exit_code == 4
    assert e.value.message.startswith(f"disk full writing model.safetensors under {tmp_path}")
    assert "LLMC_CACHE" in e.value.fix and "rerun" in e.value.fix
    assert type(e.value.__cause__).__name__ == "SafetensorError"
    with pytest.raises(KeyError):  # anything else passes through untouched
        with resource_errors("x", tmp_path):
            raise KeyError("x")


def test_atomic_safetensors_on_a_full_disk_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")  # as far as it got
        raise _safetensor_error(SAFETENSORS_DISK_FULL)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ResourceError, match="disk full writing layer.safetensors"):
        atomic_save_safetensors(tmp_path / "layer.safetensors", {"w": torch.zeros(4)})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- a full disk at each write site


class _FullFile:
    """A file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, _data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class FullDisk:
    """Every write to a path matching `pattern` fails as on a full disk, through the low-level function each
    write site calls: safetensors' save_file, the file llmc's atomic writers open (os.fdopen), shutil.copyfile
    (tokenizer files), the file a registry entry's own copy opens (llmc.storage.links.clone_or_copy), and the file
    gguf's writer opens. `hits` counts the failed writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pattern: str) -> None:
        import gguf.gguf_writer
        import safetensors.torch

        import llmc.quant.activations
        import llmc.storage.links

        self.pattern, self.hits = pattern, 0
        real_save, real_fdopen, real_copyfile = safetensors.torch.save_file, os.fdopen, shutil.copyfile

        def save_file(tensors, filename, metadata=None):
            if self._full(filename):
                raise _safetensor_error(SAFETENSORS_DISK_FULL)
            return real_save(tensors, filename, metadata=metadata)

        def fdopen(fd, *args, **kwargs):
            f = real_fdopen(fd, *args, **kwargs)
            return _FullFile(f) if self._full(os.readlink(f"/proc/self/fd/{fd}")) else f

        def copyfile(src, dst, *, follow_symlinks=True):
            if self._full(dst):
                raise OSError(errno.ENOSPC, "No space left on device")  # as shutil's sendfile copy raises it
            return real_copyfile(src, dst, follow_symlinks=follow_symlinks)

        def open_(file, mode="r", *args, **kwargs):
            f = builtins.open(file, mode, *args, **kwargs)
            return _FullFile(f) if "w" in mode and self._full(file) else f

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        monkeypatch.setattr(llmc.quant.activations, "save_file", save_file)
        monkeypatch.setattr(os, "fdopen", fdopen)
        monkeypatch.setattr(shutil, "copyfile", copyfile)
        monkeypatch.setattr(gguf.gguf_writer, "open", open_, raising=False)
        monkeypatch.setattr(llmc.storage.links, "open", open_, raising=False)

    def _full(self, path) -> bool:
        hit = fnmatch.fnmatch(str(path), self.pattern)
        self.hits += hit
        return hit


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_corpus_file(tmp_path_factory.mktemp("corpus") / "docs.json")


@pytest.fixture(scope="module")
def clean_build(tmp_path_factory, tiny_model_session: Path, corpus: Path) -> dict[str, str]:
    """The artifact hashes of a build that never failed."""
    root = tmp_path_factory.mktemp("clean")
    with pytest.MonkeyPatch.context() as mp:
        use_corpus_file(corpus, mp.setattr)
        result = _cli_build(root, tiny_model_session)
    assert result.exit_code == 0, result.stderr
    hashes = published_artifact_hashes(root / "registry")
    assert any(k.endswith("model.gguf") for k in hashes) and any(k.endswith("model.safetensors") for k in hashes)
    return hashes


def _cli_build(root: Path, model: Path):
    recipe = root / "recipe.yaml"
    recipe.write_text(every_stage_recipe(model, root / "registry"))
    return CliRunner().invoke(main, ["-q", "build", str(recipe), "--cache-dir", str(root / "cache")])


def _cross_device_link(src, dst, *args, **kwargs):
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(dst))


# (write site, the path pattern that fills up, where the message must point)
SITES = [
    ("calibration windows", "*/stages/calibrate/*/.tokens.safetensors*", "stages/calibrate/"),
    ("calibration record", "*/stages/calibrate/*/.samples.json.*", "stages/calibrate/"),
    ("spilled activations", "*/state/inputs-00001.partial/b00000.safetensors", "/state/inputs-00001.partial"),
    ("shared statistics", "*/shared-stats/*/.layer-00001.safetensors*", "shared-stats/"),
    ("quantized layer", "*/stages/quantize/*/layers/.00001.safetensors*", "stages/quantize/"),
    ("quantize progress", "*/stages/quantize/*/state/.progress.json.*", "/state"),  # not the stream probe's own
    ("tokenizer copy", "*/stages/quantize/*/tokenizer.json", "stages/quantize/"),
    ("export shard", "*/stages/export/*/.model.safetensors*", "stages/export/"),
    ("GGUF file", "*/stages/export/*/.model.gguf.*", "stages/export/"),
    ("stage marker", "*/stages/export/*/..llmc-complete.*", "stages/export/"),
    ("evaluation scores", "*/stages/eval/*/.scores.safetensors*", "stages/eval/"),
    ("evaluation metrics", "*/stages/eval/*/.metrics.json.*", "stages/eval/"),
    ("file hash memo", "*/cache/.file-hashes.json.*", "/cache"),
    ("report", "*/cache/builds/*/.report.md.*", "/cache/builds/"),
    ("registry copy", "*/registry/*/artifacts/*/model.safetensors", "registry/tiny-int8"),
    ("registry manifest", "*/registry/*/.manifest.json.*", "registry/tiny-int8/"),
]
DEFAULT_RUN = {"calibration windows", "spilled activations", "GGUF file", "evaluation scores", "report",
               "registry copy"}  # one or more per stage; the rest under -m slow


@pytest.mark.parametrize("site, pattern, where", [
    pytest.param(*s, marks=() if s[0] in DEFAULT_RUN else pytest.mark.slow, id=s[0].replace(" ", "-")) for s in SITES])
def test_full_disk_at_each_write_site_exits_4_and_the_rerun_is_identical(
        site: str, pattern: str, where: str, tmp_path: Path, tiny_model_session: Path, corpus: Path,
        clean_build: dict[str, str], monkeypatch) -> None:
    use_corpus_file(corpus, monkeypatch.setattr)
    with pytest.MonkeyPatch.context() as mp:
        if site == "registry copy":  # the registry hard-links the cache's files; it copies them on another filesystem
            mp.setattr(os, "link", _cross_device_link)
        disk = FullDisk(mp, pattern)
        failed = _cli_build(tmp_path, tiny_model_session)
    assert disk.hits, f"the build never wrote {pattern}"
    assert failed.exit_code == 4, failed.stderr
    assert "llmc: resource exhausted: disk full writing" in failed.stderr
    assert str(tmp_path) in failed.stderr and where in failed.stderr, failed.stderr
    assert "fix: free disk space" in failed.stderr and "Traceback" not in failed.stderr
    assert nothing_half_written_looks_complete(tmp_path / "cache", tmp_path / "registry") == []

    rerun = _cli_build(tmp_path, tiny_model_session)  # space freed
    assert rerun.exit_code == 0, rerun.stderr
    assert published_artifact_hashes(tmp_path / "registry") == clean_build


def _raiser(make):
    def fail(*args, **kwargs):
        raise make()

    return fail


@pytest.mark.parametrize("function, make, message", [  # a function each stage's module calls while it writes
    pytest.param("llmc.pipeline.calibrate.atomic_save_safetensors", MemoryError, "out of memory in stage 'calibrate'",
                 marks=pytest.mark.slow),
    pytest.param("llmc.pipeline.quantize.quantize_model", _cpu_allocation_failure,
                 "out of memory in stage 'quantize'", marks=pytest.mark.slow),
    ("llmc.pipeline.evaluate.open_engine",
     lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
     "out of GPU memory in stage 'eval'"),
], ids=["calibrate", "quantize", "eval-gpu"])
def test_out_of_memory_in_a_stage_is_exit_4_naming_the_stage(
        function: str, make, message: str, tmp_path: Path, tiny_model_session: Path, corpus: Path,
        clean_build: dict[str, str], monkeypatch) -> None:
    use_corpus_file(corpus, monkeypatch.setattr)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(function, _raiser(make))
        failed = _cli_build(tmp_path, tiny_model_session)
    assert failed.exit_code == 4 and "Traceback" not in failed.stderr, failed.stderr
    assert f"llmc: resource exhausted: {message} under {tmp_path}/cache/stages/" in failed.stderr, failed.stderr
    assert "then rerun" in failed.stderr
    rerun = _cli_build(tmp_path, tiny_model_session)  # memory freed
    assert rerun.exit_code == 0, rerun.stderr
    assert published_artifact_hashes(tmp_path / "registry") == clean_build


def test_resource_error_escaping_any_seam_is_still_exit_4(tmp_path: Path) -> None:
    """The CLI's last line: a resource error no seam named (here: `llmc matrix --write` on a full disk) is exit 4
    with the path the OSError carries."""
    import llmc.cli

    def matrix_write(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    out = tmp_path / "matrix.md"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("llmc.storage.store.atomic_write_text", matrix_write)
        result = CliRunner().invoke(llmc.cli.main, ["matrix", "--write", str(out)])
    assert result.exit_code == 4 and "Traceback" not in result.stderr
    assert f"disk full under {out}" in result.stderr


# --------------------------------------------------------------------------- a real filesystem that fills up


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A tmpfs mounted on tmp_path/fs, or a skip where this machine does not allow mounting."""
    fs = tmp_path / "fs"
    fs.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(fs)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def _resize(fs: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(fs)], check=True, capture_output=True)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_build_on_a_real_filesystem_that_fills_up(seed: int, small_filesystem: Path, tiny_model_session: Path,
                                                  corpus: Path, clean_build: dict[str, str], monkeypatch) -> None:
    """Cache and registry on a tmpfs of a seeded random size below what the build needs: exit 4 wherever it
    fills; grown to enough, the rerun publishes the clean build's bytes."""
    import llmc.planning.plan

    use_corpus_file(corpus, monkeypatch.setattr)
    refused = _cli_build(small_filesystem, tiny_model_session)  # the planner sees 64 KiB free and refuses first
    assert refused.exit_code == 4 and f"under {small_filesystem}/cache" in refused.stderr, refused.stderr
    # Past the planner (its estimate is generous), the disk fills wherever the seeded size runs out.
    real_usage = shutil.disk_usage
    monkeypatch.setattr(llmc.planning.plan.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 40))
    sizes = random.Random(seed).sample(range(16, 1600, 8), 3)  # KiB; the build writes ~1.9 MB
    for size_kib in sorted(sizes):
        _resize(small_filesystem, size_kib * 1024)
        result = _cli_build(small_filesystem, tiny_model_session)
        assert result.exit_code in (0, 4), result.stderr
        assert "Traceback" not in result.stderr
        if result.exit_code == 4:
            assert "disk full" in result.stderr and str(small_filesystem) in result.stderr, result.stderr
        assert nothing_half_written_looks_complete(small_filesystem / "cache", small_filesystem / "registry") == []
    _resize(small_filesystem, 64 << 20)
    result = _cli_build(small_filesystem, tiny_model_session)
    assert result.exit_code == 0, result.stderr
    assert published_artifact_hashes(small_filesystem / "registry") == clean_build


def _write_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1 << 16)}, str(path))


def _write_npz(path: Path) -> None:
    import numpy as np

    np.savez(path, w=np.zeros(1 << 16))


def _write_onnx(path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.zeros(1 << 16, np.float32), "w")])
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location=path.name + ".data")


def _write_gguf(path: Path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path=None, arch="llama")
    writer.add_tensor("w", np.zeros(1 << 16, np.float32))
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tokenizer(path: Path) -> None:
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    tok.add_tokens([f"tok{i:06d}" for i in range(4000)])  # > 64 KiB of JSON
    tok.backend_tokenizer.save(str(path))


@pytest.mark.parametrize("write", [_write_safetensors, _write_npz, _write_onnx, _write_gguf, _write_tokenizer],
                         ids=lambda f: f.__name__.removeprefix("_write_"))
def test_every_writer_s_real_full_disk_error_is_recognised(write, small_filesystem: Path) -> None:
    """Each library llmc writes with, on a filesystem that really is full, raises something llmc recognises."""
    with pytest.raises(Exception) as e:
        write(small_filesystem / "out")
    assert resource_kind(e.value) == DISK_FULL, repr(e.value)
