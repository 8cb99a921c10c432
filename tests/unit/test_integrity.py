"""Integrity: confinement, verified reuse, housekeeping and locks.

Confinement: names that become path components match a strict pattern; paths read from manifests, registry entries
and report references stay inside their root (absolute, '..', NUL, control characters, symbolic links).
Verified reuse: a cached stage output is reused only while it matches the sizes recorded when it was written; every
byte is checked before another stage reads it and when it is published; inspect/verify exit non-zero on any
difference; publishing over a modified entry repairs it; an optional HMAC signs the manifest.
Housekeeping: leftovers of dead processes are removed under the locks, resumable work is kept, two processes
wanting one stage produce it once, published files follow the umask.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from llmc.build import build
from llmc.cli import main
from llmc.formats.files import SERVE_FILE
from llmc.errors import InputError, RecipeError
from llmc.storage.paths import confined
from llmc.recipe.load import parse_recipe
from llmc.publish.local import verify_entry
from llmc.publish.outputs import write_build_outputs
from llmc.storage.store import COMPLETE_MARKER, Store, sha256_file

pytestmark = pytest.mark.heavy  # most tests damage one published build (a whole build, then rebuilds)


def tiny_recipe(model: Path, registry: Path) -> str:
    return yaml.safe_dump({
        "name": "tiny-fp8",
        "model": {"source": str(model)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
        "calibration": {"samples": 4, "seq_len": 32, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 32, "windows": 3, "decode_tokens": 1, "throughput_repeats": 1, "bootstrap_samples": 100},
        "gates": {"max_ppl_increase_pct": 50.0},
        "publish": {"registry": str(registry)},
    })


@dataclass
class Built:
    model: Path
    cache: Path
    registry: Path
    entry: Path
    recipe: str  # YAML
    export: Path  # the export stage output
    clean: dict[str, str]  # sha256 of the export's files as first written

    @property
    def store(self) -> Store:
        return Store(self.cache)

    def build(self, **kwargs):
        return build(parse_recipe(self.recipe), self.store, **kwargs)


@pytest.fixture(scope="module")
def _built_once(tmp_path_factory, tiny_model_factory_module) -> Built:
    root = tmp_path_factory.mktemp("built")
    model = tiny_model_factory_module(root / "model")
    config = json.loads((model / "config.json").read_text())  # remote code llmc never runs, and a card to inherit
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    recipe = tiny_recipe(model, root / "registry")
    result = build(parse_recipe(recipe), Store(root / "cache"))
    assert result.published is not None
    write_build_outputs(result, Store(root / "cache"))  # <cache>/builds/<id>/report.md, as `llmc build` does
    (export,) = [a.dir for a in result.artifacts.values()]
    return Built(model, root / "cache", root / "registry", result.published, recipe, export, _hashes(export))


@pytest.fixture(scope="module")
def tiny_model_factory_module():
    from tests.conftest import make_tiny_model

    return make_tiny_model


@pytest.fixture
def published(_built_once: Built, tmp_path: Path) -> Built:
    """A copy of one finished, published build (cache + registry) that the test may damage."""
    b = _built_once
    cache, registry = tmp_path / "cache", tmp_path / "registry"
    shutil.copytree(b.cache, cache, symlinks=True)
    shutil.copytree(b.registry, registry, symlinks=True)
    return Built(b.model, cache, registry, registry / b.entry.relative_to(b.registry),
                 tiny_recipe(b.model, registry), cache / b.export.relative_to(b.cache), b.clean)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def _flip_byte_keeping_mtime(path: Path, offset: int | None = None) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


ESCAPING = ["/abs/path", "../../x", "a/../../x", "a/b", "a\x00b", "a\x1b[2Jb", "a\nb", ".hidden", "..", "x" * 200]


def _recipe(**changes) -> dict:
    r = {
        "name": "tiny",
        "model": {"source": "/nonexistent"},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm"}],
    }
    r.update(changes)
    return r


@pytest.mark.parametrize("relative", ["/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "", "a\x00b",
                                      "a\x1bb", "a\nb", "a\x85b", "a\\..\\b"])
def test_confined_refuses_absolute_dotdot_nul_and_control_characters(relative: str, tmp_path: Path) -> None:
    with pytest.raises(InputError) as e:
        confined(tmp_path, relative)
    assert "\x00" not in str(e.value) and "\x1b" not in str(e.value)  # shown escaped


def test_confined_refuses_symlinked_components_even_pointing_inside(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("secret")
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "real")
    (root / "real" / "f").write_text("ok")
    (root / "real" / "flink").symlink_to(outside / "secret")
    for rel in ("out/secret", "in/f", "real/flink"):
        with pytest.raises(InputError, match="symbolic link"):
            confined(root, rel)
    assert confined(root, "real/f") == root.resolve() / "real" / "f"
    assert confined(root, "real/not-yet/new") == root.resolve() / "real" / "not-yet" / "new"  # may be written


@pytest.mark.parametrize("name", ESCAPING)
@pytest.mark.parametrize("where", ["target", "variant", "model", "recipe"])
def test_names_that_become_path_components_are_refused(where: str, name: str) -> None:
    changes = {
        "target": {"targets": [{"runtime": "vllm", "name": name}]},
        "model": {"model": {"source": "/nonexistent", "name": name}},
        "recipe": {"name": name},
        "variant": {"quantization": None,
                    "variants": [{"name": name, "quantization": {"weights": {"format": "int8", "strategy": "channel"}}}]},
    }[where]
    r = _recipe(**changes)
    if r.get("quantization") is None:
        r.pop("quantization")
    with pytest.raises(RecipeError):
        parse_recipe(yaml.safe_dump(r))


def test_a_target_name_that_escapes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    recipe = tmp_path / "work" / "recipe.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump(_recipe(targets=[{"runtime": "vllm", "name": "../../escaped"}],
                                             publish={"registry": str(tmp_path / "work" / "registry")})))
    result = CliRunner().invoke(main, ["build", str(recipe), "--cache-dir", str(tmp_path / "work" / "cache")])
    assert result.exit_code == 2, result.output
    assert "targets[0].name" in result.output
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == [recipe]  # nothing written, least of all outside


# ------------------------------------------------------------------ manifests and reports (a real entry)


def _tamper_manifest(entry: Path, rel: str) -> None:
    m = json.loads((entry / "manifest.json").read_text())
    m["files"][rel] = "0" * 64
    (entry / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("rel", ["/etc/hostname", "../../secret", "artifacts/../../../secret", "a\x00b",
                                 "artifacts/\x1b[31mred", "linked/secret"])
def test_inspect_and_verify_refuse_manifest_paths_outside_the_entry(rel: str, published, tmp_path: Path) -> None:
    entry = published.entry
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "secret").write_text("TOP-SECRET-CONTENT")
    (entry / "linked").symlink_to(secret)
    _tamper_manifest(entry, rel)
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(main, [command, str(entry)])
        assert result.exit_code == 7, result.output
        assert "refused" in result.output or "outside" in result.output
        assert "TOP-SECRET" not in result.output and "\x1b" not in result.output and "Traceback" not in result.output


def test_report_prints_only_llmc_reports_from_the_cache_or_a_verified_entry(published, tmp_path: Path,
                                                                          monkeypatch) -> None:
    cache, entry = published.cache, published.entry
    build_id = entry.name
    run = lambda *args: CliRunner().invoke(main, ["report", *args, "--cache-dir", str(cache)])  # noqa: E731
    ok = [run(build_id[:10]), run(str(cache / "builds" / build_id)), run(str(entry))]
    for result in ok:
        assert result.exit_code == 0, result.output
        assert "tiny-fp8" in result.output

    outside = tmp_path / "x"
    outside.mkdir()
    (outside / "report.md").write_text("NOT-AN-LLMC-REPORT")
    (cache / "builds" / "0badc0de").symlink_to(outside)
    monkeypatch.chdir(cache / "builds")
    for ref in ("../../x", str(outside), "../*", "0badc0de", str(cache / "builds" / "0badc0de"), "a\x00b"):
        result = run(ref)
        assert result.exit_code == 7, (ref, result.output)
        assert "NOT-AN-LLMC-REPORT" not in result.output and "Traceback" not in result.output

    (entry / "report.md").write_text("# edited")
    result = run(str(entry))
    assert result.exit_code == 7 and "does not match" in result.output


# ------------------------------------------------------------------ verified reuse


def _warnings(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "warning" in line)


def test_a_byte_flipped_in_a_cached_export_is_caught_at_publish_and_rebuilt_identically(published, capsys) -> None:
    b = published
    shutil.rmtree(b.registry)  # publish anew from the damaged cache
    _flip_byte_keeping_mtime(b.export / "model.safetensors")
    result = b.build()
    assert "changed after it was written" in _warnings(capsys.readouterr().err)
    assert result.published is not None and not result.publish_noop
    assert _hashes(b.export) == b.clean  # rebuilt: the export is deterministic
    manifest = json.loads((result.published / "manifest.json").read_text())
    (label,) = result.artifacts
    published_files = {rel.split("/", 2)[2]: d for rel, d in manifest["files"].items() if rel.startswith("artifacts/")}
    assert published_files.pop("README.md")  # the model card, written at publication beside the export's files
    assert published_files == b.clean
    # the report's measurements are of exactly these bytes
    for ev in manifest["report"]["evals"].values():
        if ev.get("measured_files"):
            assert ev["measured_files"] == {k: v for k, v in b.clean.items() if "/" not in k and k != SERVE_FILE}
    assert verify_entry(result.published) == []


def test_a_byte_flipped_in_a_cached_export_is_never_measured(published, capsys) -> None:
    b = published
    for d in (b.cache / "stages" / "eval").iterdir():  # the artifact must be measured again...
        if json.loads((d / "metrics.json").read_text()).get("measured_files"):
            shutil.rmtree(d)
    _flip_byte_keeping_mtime(b.export / "model.safetensors")  # ...from bytes that are no longer the recorded ones
    result = b.build(publish=False)
    assert "changed after it was written" in capsys.readouterr().err
    assert _hashes(b.export) == b.clean
    (ev,) = [e for e in result.evals.values() if e.measured_files]
    assert ev.measured_files == {k: v for k, v in b.clean.items() if "/" not in k and k != SERVE_FILE}


@pytest.mark.parametrize("damage", ["resize", "delete", "extra"])
def test_a_cached_export_that_lost_or_gained_files_is_rebuilt_with_a_warning(damage: str, published, capsys) -> None:
    b = published
    target = b.export / "config.json"
    if damage == "resize":
        target.write_text(target.read_text() + " ")
    elif damage == "delete":
        target.unlink()
    else:
        (b.export / "stray.bin").write_bytes(b"x")
    result = b.build(publish=False)
    cached = {s.name: s.cached for s in result.stages}
    assert [n for n, c in cached.items() if not c] == [n for n in cached if n.startswith("export:")]
    assert "does not match what was recorded" in capsys.readouterr().err
    assert _hashes(b.export) == b.clean


def test_a_byte_flipped_in_a_published_file_fails_inspect_and_is_repaired_by_the_next_build(published, capsys) -> None:
    b = published
    (model_file,) = list(b.entry.glob("artifacts/*/model.safetensors"))
    _flip_byte_keeping_mtime(model_file)
    for command in ("inspect", "verify"):
        out = CliRunner().invoke(main, [command, str(b.entry)])
        assert out.exit_code == 7, out.output
        assert "modified artifacts/" in out.output
    result = b.build()
    assert result.published == b.entry and not result.publish_noop
    assert "republishing" in capsys.readouterr().err
    assert verify_entry(b.entry) == []
    assert CliRunner().invoke(main, ["inspect", str(b.entry)]).exit_code == 0
    again = b.build()
    assert again.publish_noop  # intact now: a real no-op


def test_an_extra_or_missing_published_file_fails_verify(published) -> None:
    b = published
    (b.entry / "artifacts" / "dropped.txt").write_text("x")
    out = CliRunner().invoke(main, ["verify", str(b.entry)])
    assert out.exit_code == 7 and "extra artifacts/dropped.txt" in out.output
    (b.entry / "artifacts" / "dropped.txt").unlink()
    (b.entry / "report.md").unlink()
    out = CliRunner().invoke(main, ["verify", str(b.entry)])
    assert out.exit_code == 7 and "missing report.md" in out.output


def test_inspect_verifies_a_cached_stage_output_against_its_record(published) -> None:
    b = published
    ok = CliRunner().invoke(main, ["inspect", str(b.export)])
    assert ok.exit_code == 0 and "match the sizes and sha256 recorded" in ok.output
    _flip_byte_keeping_mtime(b.export / "model.safetensors")
    bad = CliRunner().invoke(main, ["verify", str(b.export)])
    assert bad.exit_code == 7 and "modified model.safetensors" in bad.output


def test_manifest_signature_with_a_key_from_the_environment(published, tmp_path: Path, monkeypatch) -> None:
    b = published
    secret = "k3y-that-must-never-be-printed"
    monkeypatch.setenv("LLMC_SIGNING_KEY", secret)
    unsigned = CliRunner().invoke(main, ["inspect", str(b.entry)])  # published without a key: a failure with one
    assert unsigned.exit_code == 7 and "signature: MISSING" in unsigned.output
    assert CliRunner().invoke(main, ["verify", "--require-signature", str(b.entry)]).exit_code == 7
    result = b.build()  # publishing signs the entry that lacked a signature
    assert not result.publish_noop
    assert (b.entry / "manifest.sig").is_file() and verify_entry(b.entry) == []
    ok = CliRunner().invoke(main, ["inspect", str(b.entry)])
    assert ok.exit_code == 0 and "signature: valid" in ok.output
    assert CliRunner().invoke(main, ["verify", "--require-signature", str(b.entry)]).exit_code == 0

    m = json.loads((b.entry / "manifest.json").read_text())
    m["model"]["source"] = "somewhere-else"  # files untouched, provenance edited
    (b.entry / "manifest.json").write_text(json.dumps(m))
    bad = CliRunner().invoke(main, ["verify", str(b.entry)])
    assert bad.exit_code == 7 and "INVALID" in bad.output

    monkeypatch.delenv("LLMC_SIGNING_KEY")
    (tmp_path / "key").write_text("another-key\n")
    monkeypatch.setenv("LLMC_SIGNING_KEY_FILE", str(tmp_path / "key"))
    assert CliRunner().invoke(main, ["verify", str(b.entry)]).exit_code == 7  # another key signed it
    monkeypatch.delenv("LLMC_SIGNING_KEY_FILE")
    unchecked = CliRunner().invoke(main, ["verify", str(b.entry)])
    assert unchecked.exit_code == 0 and "not checked" in unchecked.output
    assert CliRunner().invoke(main, ["verify", "--require-signature", str(b.entry)]).exit_code == 7

    monkeypatch.setenv("LLMC_SIGNING_KEY", secret)
    repaired = b.build()  # a bad signature is a modified entry: republished, signed again
    assert not repaired.publish_noop and verify_entry(b.entry) == []
    assert result.build_id == repaired.build_id
    for text in (unsigned.output, ok.output, bad.output, unchecked.output):
        assert secret not in text


# ------------------------------------------------------------------ housekeeping and locks


def test_leftovers_of_dead_processes_are_removed_and_resumable_work_is_kept(published) -> None:
    b = published
    stale_tmp = b.registry / "tiny-fp8" / f".{b.entry.name}.tmp-999999"
    (stale_tmp / "artifacts").mkdir(parents=True)
    (stale_tmp / "artifacts" / "big.bin").write_bytes(b"0" * 1000)
    stale_partial = b.cache / "stages" / "export" / ("ab" * 16 + ".partial")
    stale_partial.mkdir()
    (stale_partial / "model.safetensors").write_bytes(b"half")
    resumable = b.cache / "stages" / "quantize" / ("cd" * 16 + ".partial")
    (resumable / "layers").mkdir(parents=True)
    (resumable / ".llmc-resumable").touch()
    live = b.cache / "stages" / "eval" / ("ef" * 16 + ".partial")
    live.mkdir()
    holder = _hold_lock(b.cache / "locks" / "eval" / ("ef" * 16 + ".lock"))
    try:
        result = b.build()  # everything cached and published: only housekeeping happens
        assert result.publish_noop
        assert not stale_tmp.exists() and not stale_partial.exists()
        assert resumable.is_dir()  # a killed quantization resumes from it
        assert live.is_dir()  # its producer still holds the lock
    finally:
        holder.kill()
        holder.wait()


def _hold_lock(path: Path) -> subprocess.Popen:
    path.parent.mkdir(parents=True, exist_ok=True)
    code = ("import sys, time\nfrom filelock import FileLock\nlock = FileLock(sys.argv[1]); lock.acquire()\n"
            "print('held', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_published_files_follow_the_umask(umask: int, file_mode: int, dir_mode: int, published) -> None:
    b = published
    shutil.rmtree(b.registry)
    old = os.umask(umask)
    try:
        result = b.build()
    finally:
        os.umask(old)
    modes = {p.relative_to(result.published).as_posix(): p.stat().st_mode & 0o777
             for p in [result.published, *result.published.rglob("*")]}
    assert {rel for rel, m in modes.items() if m not in (file_mode, dir_mode)} == set()
    assert modes["manifest.json"] == file_mode and modes["."] == dir_mode
    assert any(rel.endswith("model.safetensors") for rel in modes)


_PRODUCER = """
import sys, time
from pathlib import Path
from llmc.storage.store import Store
store, name, pause, flag = Store(Path(sys.argv[1])), sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
done = store.lookup("demo", "0" * 32)
if done is None:
    with store.produce("demo", "0" * 32) as out:
        flag.write_text(name)
        time.sleep(pause)
        (out / "who.txt").write_text(name)
    print("produced", flush=True)
    done = store.lookup("demo", "0" * 32)
else:
    print("reused", flush=True)
print((done / "who.txt").read_text(), flush=True)
"""


def test_two_processes_wanting_one_stage_produce_it_once(tmp_path: Path) -> None:
    flag = tmp_path / "producing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(tmp_path / "cache"), "first", "2", str(flag)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", _PRODUCER, str(tmp_path / "cache"), "second", "0", str(flag)],
                            capture_output=True, text=True, env=env, timeout=120)
    out_first, err_first = first.communicate(timeout=120)
    assert out_first.split() == ["produced", "first"], err_first
    assert second.stdout.split() == ["reused", "first"], second.stderr
    assert "waiting for another llmc process" in second.stderr
    assert flag.read_text() == "first"  # the second never entered production


def test_a_killed_producer_releases_its_stage_to_the_next_process(tmp_path: Path) -> None:
    flag = tmp_path / "producing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(tmp_path / "cache"), "first", "600", str(flag)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.05)
    first.kill()
    first.communicate()
    second = subprocess.run([sys.executable, "-c", _PRODUCER, str(tmp_path / "cache"), "second", "0", str(flag)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert second.stdout.split() == ["produced", "second"], second.stderr
    assert (tmp_path / "cache" / "stages" / "demo" / ("0" * 32) / COMPLETE_MARKER).is_file()


@pytest.mark.parametrize("umask,file_mode", [(0o022, 0o644), (0o027, 0o640)])
def test_atomic_writes_follow_the_umask(tmp_path: Path, umask: int, file_mode: int) -> None:
    """A cache shared by a team must be readable by it: mkstemp's 0600 is not what the umask asks for."""
    from llmc.storage.store import atomic_write_json

    old = os.umask(umask)
    try:
        atomic_write_json(tmp_path / "stage" / "marker.json", {"ok": True})
    finally:
        os.umask(old)
    assert (tmp_path / "stage" / "marker.json").stat().st_mode & 0o777 == file_mode


# ------------------------------------------------------------------ independent, self-healing registry entries


def _verify(path: Path) -> int:
    return CliRunner().invoke(main, ["verify", str(path)]).exit_code


def test_one_corrupted_entry_leaves_every_other_entry_and_the_cache_verifying(published) -> None:
    b = published
    shutil.rmtree(b.registry)  # published afresh from this cache, as a real publication is (not a test's copy)
    first = b.build()
    second = build(parse_recipe(b.recipe.replace("name: tiny-fp8", "name: tiny-fp8-again")), b.store)
    assert second.build_id != first.build_id
    assert {a.dir for a in second.artifacts.values()} == {b.export}  # both entries publish the one cached export
    entries = [first.published, second.published]
    (model_file,) = list(entries[0].glob("artifacts/*/model.safetensors"))
    _flip_byte_keeping_mtime(model_file)
    assert _verify(entries[0]) == 7
    assert _verify(entries[1]) == 0  # owns its bytes: no hard link shared with the other entry...
    assert _verify(b.export) == 0  # ...nor with the cache
    for entry in entries:
        for f in entry.rglob("*"):
            if f.is_file() and f.name == "model.safetensors":
                assert f.stat().st_nlink == 1


def test_an_artifact_rewritten_with_its_manifest_hash_is_repaired_by_publish(published, tmp_path: Path,
                                                                              capsys) -> None:
    b = published
    (model_file,) = list(b.entry.glob("artifacts/*/model.safetensors"))
    rel = model_file.relative_to(b.entry).as_posix()
    _flip_byte_keeping_mtime(model_file)
    m = json.loads((b.entry / "manifest.json").read_text())
    m["files"][rel] = sha256_file(model_file)  # the tampering covers its tracks: the entry matches its manifest
    (b.entry / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    assert verify_entry(b.entry) == []
    (tmp_path / "recipe.yaml").write_text(b.recipe)
    out = CliRunner().invoke(main, ["publish", "--cache-dir", str(b.cache), str(tmp_path / "recipe.yaml")])
    assert out.exit_code == 0, out.output
    assert "no-op" not in out.output and "against the cache's record" in capsys.readouterr().err + out.output
    assert sha256_file(model_file) == b.clean["model.safetensors"]
    assert verify_entry(b.entry) == [] and b.build().publish_noop  # repaired, and intact from then on


def test_a_manifest_field_the_build_determines_is_repaired_by_publish(published) -> None:
    b = published
    m = json.loads((b.entry / "manifest.json").read_text())
    m["model"] = {"source": "elsewhere", "sha256": "0" * 32}  # provenance rewritten, no file touched
    (b.entry / "manifest.json").write_text(json.dumps(m))
    assert verify_entry(b.entry) == []  # without a key the entry alone cannot tell; the build can
    assert not b.build().publish_noop
    assert json.loads((b.entry / "manifest.json").read_text())["model"]["source"] == str(b.model)


def test_a_stripped_signature_fails_everywhere_with_a_key_set(published, monkeypatch) -> None:
    b = published
    monkeypatch.setenv("LLMC_SIGNING_KEY", "k3y")
    assert not b.build().publish_noop and (b.entry / "manifest.sig").is_file()  # signed the unsigned entry
    (b.entry / "manifest.sig").unlink()
    for command in ("inspect", "verify"):
        out = CliRunner().invoke(main, [command, str(b.entry)])
        assert out.exit_code == 7 and "MISSING" in out.output, out.output
    from llmc.publish.hub import upload_plan

    with pytest.raises(InputError, match="signature MISSING"):
        upload_plan(b.entry, "org/name")
    assert not b.build().publish_noop and verify_entry(b.entry) == []  # publish signs it again
    monkeypatch.delenv("LLMC_SIGNING_KEY")
    (b.entry / "manifest.sig").unlink()
    assert _verify(b.entry) == 0  # without a key, an unsigned entry is what it always was


def test_the_published_config_carries_no_remote_code_and_the_card_no_local_path(published) -> None:
    (label_dir,) = list((published.entry / "artifacts").iterdir())
    assert "auto_map" not in json.loads((label_dir / "config.json").read_text())
    card = (label_dir / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "apache-2.0"  # inherited from the source's own card
    assert "base_model" not in meta  # an unnamed local folder: its path is this machine's business
    assert str(published.model) not in card.split("---")[1]
