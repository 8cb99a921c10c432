"""`llmc plan` reads config and safetensors headers only: no file of the source is hashed (the README's promise;
a 512 GiB sparse weights file was hashed whole before any check). The build hashes it, to the same stage key as
before, says so in its log when the unmemoized bytes are large, and reuses the memo after.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import llmc.storage.store as store_module
from llmc.cli import main
from llmc.model import source as source_module
from llmc.model.source import TOKENIZER_FILES, locate_source, resolve_source
from llmc.storage.store import Store, stage_key


@pytest.fixture
def model(tiny_model_session: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_session, folder)
    return folder


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """Every file whose content is hashed (Store.file_hash's one reader)."""
    seen: list[Path] = []
    real = store_module.sha256_file
    monkeypatch.setattr(store_module, "sha256_file", lambda path: seen.append(Path(path)) or real(path))
    return seen


def test_plan_hashes_no_file_of_the_source(model: Path, tmp_path: Path, hashed: list[Path]) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "t", "model": {"source": str(model)},
                                      "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
                                      "targets": [{"runtime": "vllm"}]}))
    out = CliRunner().invoke(main, ["plan", "--cache-dir", str(tmp_path / "cache"), str(recipe)])
    assert out.exit_code == 0, out.output
    assert not [p for p in hashed if model.resolve() in p.resolve().parents], hashed


def test_the_build_key_is_the_content_hash_it_always_was(model: Path, tmp_path: Path) -> None:
    files = [model / "config.json", model / "model.safetensors",
             *(model / n for n in TOKENIZER_FILES if (model / n).is_file())]
    expected = stage_key("source-folder", {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
    store = Store(tmp_path / "cache")
    assert locate_source(str(model), store).sha256 is None  # located, not hashed
    assert resolve_source(str(model), store).sha256 == expected


def test_the_build_says_it_hashes_and_then_uses_the_memo(model: Path, tmp_path: Path, hashed: list[Path],
                                                          monkeypatch, capsys) -> None:
    monkeypatch.setattr(source_module, "LOG_HASH_BYTES", 0)
    store = Store(tmp_path / "cache")
    first = resolve_source(str(model), store)
    assert "hashing" in capsys.readouterr().err and (model / "model.safetensors").resolve() in hashed
    hashed.clear()
    assert resolve_source(str(model), store).sha256 == first.sha256
    assert "hashing" not in capsys.readouterr().err and not hashed
