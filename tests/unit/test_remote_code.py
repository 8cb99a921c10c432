"""A model folder's own Python is never run: a tokenizer_config.json whose auto_map names custom tokenizer code
(what trust_remote_code would import) loads transformers' own tokenizer class with a plan warning, or, when its
tokenizer class exists only in that code, is refused (exit 7); no artifact carries the auto_map on. Without llmc's
explicit trust_remote_code=False transformers asks on stdin, and a "y" (typed or piped in) ran the folder's code.
"""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from llmc.cli import main
from llmc.errors import InputError
from llmc.model.tokenizer_files import custom_tokenizer_code, load_tokenizer

CODE = "tokenization_evil.EvilTokenizer"


@pytest.fixture
def model(tiny_model_session: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_session, folder)
    marker = tmp_path / "ran"
    # the code a trust_remote_code load would import: it leaves a marker file when it runs
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return folder


def _name_code(folder: Path, tokenizer_class: str | None) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, CODE]}
    if tokenizer_class is None:
        config.pop("tokenizer_class", None)
    else:
        config["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(config))


@pytest.fixture
def says_yes(monkeypatch):
    """Whoever answers transformers' 'Do you wish to run the custom code? [y/N]' answers yes."""
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    return asked


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "TokenizersBackend", "LlamaTokenizer"])
def test_code_beside_a_class_transformers_has_is_not_run(tokenizer_class, model: Path, tmp_path: Path,
                                                          says_yes) -> None:
    _name_code(model, tokenizer_class)
    tok = load_tokenizer(model)
    assert not (tmp_path / "ran").exists() and not says_yes
    assert type(tok).__name__ != "EvilTokenizer" and tok("hello world")["input_ids"]
    note = custom_tokenizer_code(model)
    assert note is not None and CODE in note and "never runs it" in note


@pytest.mark.parametrize("tokenizer_class", ["EvilTokenizer", None])
def test_a_tokenizer_only_the_folders_code_defines_is_refused_and_not_run(tokenizer_class, model: Path,
                                                                         tmp_path: Path, says_yes) -> None:
    _name_code(model, tokenizer_class)
    with pytest.raises(InputError) as refused:
        load_tokenizer(model)
    assert not (tmp_path / "ran").exists() and not says_yes
    message = str(refused.value)
    assert "tokenizer_config.json" in message and CODE in message and (tokenizer_class or "no tokenizer_class") in message
    assert "PreTrainedTokenizerFast" in refused.value.fix


def test_no_auto_map_no_note(model: Path) -> None:
    assert custom_tokenizer_code(model) is None


def _recipe(model: Path, registry: Path) -> str:
    return yaml.safe_dump({
        "name": "tiny-int8",
        "model": {"source": str(model)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm"}],
        "eval": {"seq_len": 32, "windows": 2, "decode_tokens": 1, "throughput_repeats": 1, "bootstrap_samples": 100},
        "publish": {"registry": str(registry)},
    })


def test_the_build_warns_and_no_artifact_names_the_code(model: Path, tmp_path: Path, says_yes) -> None:
    _name_code(model, "PreTrainedTokenizerFast")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_recipe(model, tmp_path / "registry"))
    cache = ["--cache-dir", str(tmp_path / "cache")]
    plan = CliRunner().invoke(main, ["plan", *cache, str(recipe)])
    assert plan.exit_code == 0 and CODE in plan.output and "never runs it" in plan.output, plan.output
    build = CliRunner().invoke(main, ["build", *cache, str(recipe)])
    assert build.exit_code == 0, build.output
    assert not (tmp_path / "ran").exists() and not says_yes
    written = [p for root in (tmp_path / "registry", tmp_path / "cache") for p in root.rglob("tokenizer_config.json")]
    assert written  # the canonical form's, each export's and each published entry's
    for path in written:
        config = json.loads(path.read_text())
        assert "auto_map" not in config and config["tokenizer_class"] == "PreTrainedTokenizerFast", path
    assert not any(p.name.endswith(".py") for p in (tmp_path / "registry").rglob("*"))


def test_the_refusal_is_exit_7(model: Path, tmp_path: Path) -> None:
    _name_code(model, "EvilTokenizer")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_recipe(model, tmp_path / "registry"))
    out = CliRunner().invoke(main, ["plan", "--cache-dir", str(tmp_path / "cache"), str(recipe)])
    assert out.exit_code == 7 and "custom tokenizer code" in out.output and "Traceback" not in out.output, out.output
    assert not (tmp_path / "ran").exists()
