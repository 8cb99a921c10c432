"""Nothing is read from outside a model source: every file llmc (or transformers, for llmc) opens from a model folder
is refused (exit 7, the file named, none of its bytes quoted) when a symbolic link takes it outside the folder; a
Hugging Face Hub snapshot may link into its own repository cache's blobs/, as the Hub's cache does. Also: what a
source's README.md gives an artifact enters the source hash, a file edited in place is hashed again, and config
values that are no JSON number (NaN, Infinity) are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

hypothesis = pytest.importorskip("hypothesis", reason="pip install -e '.[dev]' installs hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llmc.cli import main  # noqa: E402
from llmc.errors import InputError  # noqa: E402
from llmc.model.checkpoint import read_model_config  # noqa: E402
from llmc.model.source import _from_folder, resolve_source  # noqa: E402
from llmc.storage.store import Store  # noqa: E402

SECRET = b"TOPSECRET-4f1c2d\nroot:$6$salt$hash:19000:0:99999:7:::\n"


def _recipe(model: Path, registry: Path) -> str:
    return yaml.safe_dump({
        "name": "tiny-int8",
        "model": {"source": str(model)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm"}],
        "eval": {"seq_len": 32, "windows": 2, "decode_tokens": 1, "throughput_repeats": 1, "bootstrap_samples": 100},
        "publish": {"registry": str(registry)},
    })


def _run(args: list[str], tmp: Path) -> tuple[int, str]:
    out = CliRunner().invoke(main, [*args[:1], "--cache-dir", str(tmp / "cache"), *args[1:]])
    return out.exit_code, out.output


def _secret_file(tmp: Path) -> Path:
    outside = tmp / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "shadow").write_bytes(SECRET)
    return outside / "shadow"


def _published_bytes(registry: Path) -> bytes:
    return b"".join(p.read_bytes() for p in registry.rglob("*") if p.is_file()) if registry.exists() else b""


@pytest.fixture
def model(tiny_model_session: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_session, folder)
    return folder


def _link(folder: Path, name: str, target: Path) -> None:
    path = folder / name
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.mark.parametrize("name", ["generation_config.json", "chat_template.jinja"])
def test_a_side_file_linked_outside_fails_the_build_and_publishes_nothing(name: str, model: Path,
                                                                          tmp_path: Path) -> None:
    _link(model, name, _secret_file(tmp_path))
    (tmp_path / "recipe.yaml").write_text(_recipe(model, tmp_path / "registry"))
    code, output = _run(["build", str(tmp_path / "recipe.yaml")], tmp_path)
    assert code == 7, output
    assert name in output and "outside the model folder" in output and "fix:" in output
    assert b"TOPSECRET" not in output.encode() and b"TOPSECRET" not in _published_bytes(tmp_path / "registry")
    assert not any(SECRET in p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file())


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json", "vocab.json", "README.md",
                                  "additional_chat_templates/tool_use.jinja"])
def test_every_file_a_source_may_be_read_through_is_confined(name: str, model: Path, tmp_path: Path) -> None:
    _link(model, name, _secret_file(tmp_path))
    (tmp_path / "recipe.yaml").write_text(_recipe(model, tmp_path / "registry"))
    code, output = _run(["plan", str(tmp_path / "recipe.yaml")], tmp_path)
    assert code == 7, output
    assert Path(name).name in output and "outside the model folder" in output
    assert "TOPSECRET" not in output


def test_a_linked_folder_leaving_the_model_is_refused(model: Path, tmp_path: Path) -> None:
    _secret_file(tmp_path)
    _link(model, "additional_chat_templates", tmp_path / "outside")
    with pytest.raises(InputError, match="additional_chat_templates.*outside the model folder"):
        resolve_source(str(model), Store(tmp_path / "cache"))


def test_a_weights_file_refused_is_never_quoted(model: Path, tmp_path: Path) -> None:
    """The first 8 bytes of a file that is no safetensors would be printed as its header length."""
    (model / "model.safetensors").unlink()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "key").write_bytes(SECRET)
    _link(model, "model.safetensors", tmp_path / "outside" / "key")
    as_number = str(struct.unpack("<Q", SECRET[:8])[0])
    (tmp_path / "recipe.yaml").write_text(_recipe(model, tmp_path / "registry"))
    code, output = _run(["plan", str(tmp_path / "recipe.yaml")], tmp_path)
    assert code == 7 and as_number not in output and "TOPSECRET" not in output
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").write_bytes(SECRET * 4)  # a regular file in the folder: still not quoted
    code, output = _run(["plan", str(tmp_path / "recipe.yaml")], tmp_path)
    assert code == 7 and "not a readable safetensors file" in output and as_number not in output


def test_links_between_the_folders_own_files_are_read(model: Path, tmp_path: Path) -> None:
    before = resolve_source(str(model), Store(tmp_path / "cache"))
    (model / "real").mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        os.replace(model / name, model / "real" / name)
        (model / name).symlink_to(Path("real") / name)
    alias = tmp_path / "alias"
    alias.symlink_to(model)  # the folder itself may be reached through a link: its real path is the boundary
    after = resolve_source(str(alias), Store(tmp_path / "cache"))
    assert after.sha256 == before.sha256


def _hub_snapshot(model: Path, cache: Path, blobs_target: Path | None = None) -> Path:
    """A Hub cache as huggingface_hub lays it out: snapshots/<commit>/<file> -> ../../blobs/<sha256>."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    blobs = repo / "blobs"
    if blobs_target is not None:
        blobs.symlink_to(blobs_target, target_is_directory=True)
    else:
        blobs.mkdir()
    for f in model.iterdir():
        data = f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def _from_hub(snapshot: Path, store: Store):
    hub = {"repo_id": "org/tiny", "revision": "main", "commit": snapshot.name}
    return _from_folder(snapshot, store, "hf:org/tiny", "source-hf", {"repo_id": "org/tiny", "commit": hub["commit"]},
                        hub)


def test_a_hub_snapshot_may_link_into_its_own_blobs_and_nowhere_else(model: Path, tmp_path: Path) -> None:
    snapshot = _hub_snapshot(model, tmp_path / "hub")
    store = Store(tmp_path / "cache")
    assert read_model_config(_from_hub(snapshot, store).folder)["model_type"] == "llama"
    _link(snapshot, "generation_config.json", _secret_file(tmp_path))
    with pytest.raises(InputError, match="generation_config.json.*outside the model folder"):
        _from_hub(snapshot, store)
    (snapshot / "generation_config.json").unlink()
    (snapshot / "chat_template.jinja").symlink_to(Path("..") / ".." / "blobs" / ".." / ".." / ".." / "outside"
                                                  / "shadow")
    with pytest.raises(InputError, match="chat_template.jinja"):
        _from_hub(snapshot, store)


def test_a_hub_cache_whose_blobs_folder_is_a_link_elsewhere_is_refused(model: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    snapshot = _hub_snapshot(model, tmp_path / "hub", blobs_target=tmp_path / "elsewhere")
    with pytest.raises(InputError, match="outside the model folder"):
        _from_hub(snapshot, Store(tmp_path / "cache"))


# --- what else a source gives an artifact, and when its content is hashed again ---------------------------------


def test_the_readme_license_enters_the_source_hash_and_nothing_else_of_it(model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    plain = resolve_source(str(model), store).sha256
    (model / "README.md").write_text("# my model\n\nno front matter\n")
    assert resolve_source(str(model), store).sha256 == plain  # keys of sources without a license are unchanged
    (model / "README.md").write_text("---\nlicense: apache-2.0\n---\n# my model\n")
    apache = resolve_source(str(model), store).sha256
    (model / "README.md").write_text("---\nlicense: mit\n---\n# my model\n")
    assert len({plain, apache, resolve_source(str(model), store).sha256}) == 3


def test_a_file_edited_in_place_with_its_mtime_restored_is_hashed_again(model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    before = resolve_source(str(model), store).sha256
    path = model / "tokenizer_config.json"
    st = path.stat()
    with open(path, "r+b") as f:  # same size, same inode, mtime put back: only ctime tells
        first = f.read(1)
        f.seek(0)
        f.write(b" " if first != b" " else b"\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert resolve_source(str(model), store).sha256 != before


@pytest.mark.parametrize("text", ['NaN', 'Infinity', '-Infinity', '1e999'])
def test_a_config_number_json_cannot_hold_is_refused(text: str, model: Path, tmp_path: Path) -> None:
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace("{", '{"rope_theta": ' + text + ", ", 1))
    (tmp_path / "recipe.yaml").write_text(_recipe(model, tmp_path / "registry"))
    code, output = _run(["plan", str(tmp_path / "recipe.yaml")], tmp_path)
    assert code == 7 and "rope_theta is not a finite number" in output, output


def test_auto_map_never_leaves_the_config_llmc_reads(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    assert "auto_map" not in read_model_config(model)  # the canonical form, and so every export, is written from it


# --- property: any layout of links, inside and outside --------------------------------------------------------

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "chat_template.jinja", "README.md", "notes/extra.txt")
# how one file of the folder is laid out: itself, a link to a copy inside, or a link leaving the folder
KINDS = ("file", "link-inside", "link-inside-relative", "link-outside", "link-outside-relative", "dangling-outside",
         "absent")
LEAVES = {"link-outside", "link-outside-relative", "dangling-outside"}
REQUIRED = {"config.json", "model.safetensors"}


DEFAULT = dict(derandomize=True, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# half the layouts keep every link inside (so that what resolves is exercised as much as what is refused)
LAYOUTS = st.booleans().flatmap(lambda leave: st.fixed_dictionaries(
    {name: st.sampled_from(KINDS if leave else tuple(k for k in KINDS if k not in LEAVES)) for name in FILES}))


@settings(max_examples=25, **DEFAULT)
@given(layout=LAYOUTS)
def test_property_a_source_is_read_only_when_no_link_leaves_it(layout: dict[str, str], tiny_model_session: Path,
                                                               tmp_path_factory) -> None:
    _check_layout(layout, tiny_model_session, tmp_path_factory.mktemp("links"))


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_LINKS", 1000)), **dict(DEFAULT, derandomize=False))
@given(layout=LAYOUTS)
def test_property_a_source_is_read_only_when_no_link_leaves_it_long(layout: dict[str, str],
                                                                    tiny_model_session: Path,
                                                                    tmp_path_factory) -> None:
    tmp = tmp_path_factory.mktemp("links")
    try:
        _check_layout(layout, tiny_model_session, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_layout(layout: dict[str, str], tiny_model_session: Path, tmp: Path) -> None:
    """Lay the tiny model out as `layout` says; it resolves exactly when no link leaves it, and an error quotes
    no byte of the file outside."""
    secret = _secret_file(tmp)
    folder = tmp / "model"
    shutil.copytree(tiny_model_session, folder)
    (folder / "README.md").write_text("# tiny\n")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (folder / "notes").mkdir()
    (folder / "notes" / "extra.txt").write_text("notes\n")
    (folder / ".inside").mkdir()
    for name, kind in layout.items():
        path = folder / name
        if kind == "file":
            continue
        if path.exists():
            shutil.move(path, folder / ".inside" / path.name)
        if kind == "link-inside":
            path.symlink_to(folder / ".inside" / path.name)
        elif kind == "link-inside-relative":
            path.symlink_to(Path("../" * name.count("/") + ".inside") / path.name)
        elif kind == "link-outside":
            path.symlink_to(secret)
        elif kind == "link-outside-relative":
            path.symlink_to(Path("../" * (name.count("/") + 1)) / "outside" / "shadow")
        elif kind == "dangling-outside":
            path.symlink_to(tmp / "outside" / "missing")
    leaving = {n for n, k in layout.items() if k in LEAVES}
    if layout["config.json"] == "absent":
        leaving = set()  # no model folder: refused before any entry is looked at, let alone read
    try:
        source = resolve_source(str(folder), Store(tmp / "cache"))
    except InputError as e:
        text = str(e)
        assert "TOPSECRET" not in text and "root:" not in text
        if leaving:
            assert "outside the model folder" in text and any(Path(n).name in text for n in leaving)
            event("exit 7: a link leaves the folder")
        else:  # no link leaves: only a missing required file may refuse it
            assert REQUIRED & {n for n, k in layout.items() if k == "absent"}, text
            event("exit 7: config.json or the weights absent")
        return
    assert not leaving, f"read through links leaving the folder: {sorted(leaving)}"
    event("resolved: every link stays inside")
    assert source.folder == folder.resolve()
