"""`model.source: hf:<org>/<name>[@rev]`: resolved through huggingface_hub from a real on-disk Hub cache layout
(models--org--name/{blobs,snapshots/<sha>,refs/main}), with the network off; and the error when it cannot be."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import yaml

from llmc.errors import InputError
from llmc.model.hub import parse_hub_spec
from llmc.model.source import resolve_source
from llmc.recipe.load import parse_recipe

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def put_in_hub_cache(model: Path, cache: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",),
                     skip: tuple[str, ...] = ()) -> Path:
    """Lay `model`'s files out exactly as huggingface_hub's cache does: content-addressed blobs, a snapshot folder
    of relative symlinks named by the commit, and refs/<branch> holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        if f.name in skip:
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _recipe(source: str) -> object:
    return parse_recipe(yaml.safe_dump({
        "name": "hub", "model": {"source": source},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
    }))


def test_resolves_offline_from_the_hub_cache_and_records_the_commit(tiny_model, hub_cache, store):
    from transformers import AutoTokenizer

    from llmc.model.checkpoint import CheckpointReader

    snapshot = put_in_hub_cache(tiny_model, hub_cache, "org/tiny", COMMIT_A)
    src = resolve_source("hf:org/tiny", store)
    assert src.folder == snapshot.resolve()
    assert src.hub == {"repo_id": "org/tiny", "revision": "main", "commit": COMMIT_A}
    reader = CheckpointReader(src.folder)  # the symlinked blobs read as the model's tensors
    assert "model.embed_tokens.weight" in reader
    assert AutoTokenizer.from_pretrained(src.folder)("the jury")["input_ids"]


def test_a_moved_branch_changes_the_source_hash_and_the_build_id(tiny_model, hub_cache, store):
    from llmc.build import build_id_for

    put_in_hub_cache(tiny_model, hub_cache, "org/tiny", COMMIT_A)
    first = resolve_source("hf:org/tiny", store)
    again = resolve_source("hf:org/tiny@main", store)
    assert again.sha256 == first.sha256  # same commit: same key, cached stages reused
    put_in_hub_cache(tiny_model, hub_cache, "org/tiny", COMMIT_B)  # main now points at B (same bytes)
    moved = resolve_source("hf:org/tiny", store)
    assert moved.hub["commit"] == COMMIT_B
    assert moved.sha256 != first.sha256
    recipe = _recipe("hf:org/tiny")
    assert build_id_for(recipe, moved) != build_id_for(recipe, first)
    pinned = resolve_source(f"hf:org/tiny@{COMMIT_A}", store)  # a commit pinned in the recipe stays put
    assert pinned.hub["commit"] == COMMIT_A and pinned.sha256 != moved.sha256


def test_a_tag_resolves_through_its_ref(tiny_model, hub_cache, store):
    put_in_hub_cache(tiny_model, hub_cache, "org/tiny", COMMIT_A, refs=("main", "v1.0"))
    assert resolve_source("hf:org/tiny@v1.0", store).hub == {"repo_id": "org/tiny", "revision": "v1.0",
                                                             "commit": COMMIT_A}


def test_a_snapshot_without_its_weights_is_named(tiny_model, hub_cache, store):
    put_in_hub_cache(tiny_model, hub_cache, "org/tiny", COMMIT_A, skip=("model.safetensors",))
    with pytest.raises(InputError, match=r"org/tiny@main \(commit a{40}\) has no model\.safetensors") as e:
        resolve_source("hf:org/tiny", store)
    assert "safe_serialization=True" in e.value.fix


def test_offline_and_not_cached_names_the_model_revision_and_three_fixes(hub_cache, store):
    with pytest.raises(InputError) as e:
        resolve_source("hf:org/absent@v2", store)
    msg = str(e.value)
    assert "model org/absent at revision v2 is not in the Hugging Face cache" in msg
    assert "HF_HUB_OFFLINE is set" in msg
    assert "hf download org/absent --revision v2" in e.value.fix
    assert "HF_ENDPOINT" in e.value.fix and "local folder" in e.value.fix


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_network_error_names_the_endpoint_and_the_fixes(tmp_path, monkeypatch, store):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    t = time.monotonic()
    with pytest.raises(InputError) as e:
        resolve_source("hf:meta-llama/Llama-3.2-1B@main", store)
    assert time.monotonic() - t < 60  # a refused connection is not retried for minutes
    msg = str(e.value)
    assert "meta-llama/Llama-3.2-1B at revision main" in msg
    assert f"the Hub at {endpoint} cannot be reached" in msg
    fix = e.value.fix
    assert "hf download meta-llama/Llama-3.2-1B --revision main" in fix  # (1) pre-download into the cache
    assert "set HF_ENDPOINT to a Hub mirror" in fix  # (2)
    assert "local folder" in fix  # (3)
    assert e.value.exit_code == 7


@pytest.mark.parametrize("spec", ["hf:", "hf:org/", "hf:org/a/b", "hf:org/na..me", "hf:org/tiny@", "hf:org/tiny@../x",
                                  "hf:org/tiny@-rf"])
def test_malformed_hub_specs_are_refused_before_any_lookup(spec):
    with pytest.raises(InputError) as e:
        parse_hub_spec(spec)
    assert "hf:<org>/<name>" in e.value.fix


def test_hub_spec_parts():
    assert parse_hub_spec("hf:Qwen/Qwen3-0.6B").shown == "Qwen/Qwen3-0.6B@main"
    assert parse_hub_spec("hf:org/m@refs/pr/3").revision == "refs/pr/3"


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> Path:
    from tests.unit.test_sharded_checkpoint import make_sharded

    return make_sharded(tmp_path_factory.mktemp("hub-sharded") / "model")


def test_sharded_hub_snapshot_reads_only_the_indexed_shards(tmp_path, sharded_model, hub_cache, store):
    from llmc.model.checkpoint import CheckpointReader, safetensors_files

    model = tmp_path / "sharded"
    shutil.copytree(sharded_model, model)
    (model / "consolidated.safetensors").write_bytes((model / sorted(model.glob("model-*"))[0].name).read_bytes())
    put_in_hub_cache(model, hub_cache, "org/sharded", COMMIT_A)
    src = resolve_source("hf:org/sharded", store)
    names = [f.name for f in safetensors_files(src.folder)]
    assert len(names) >= 2 and "consolidated.safetensors" not in names
    assert set(CheckpointReader(src.folder).names()) == set(CheckpointReader(model).names())


# --------------------------------------------------------------------------- online, against a Hub on loopback


class FakeHub:
    """Just enough of the Hub's HTTP API for huggingface_hub's snapshot_download, on 127.0.0.1: repo info per
    revision, the recursive tree listing, HEAD + GET of /<repo>/resolve/<commit>/<file>. Records every request."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading
        from urllib.parse import unquote, urlparse

        self.repos: dict[str, dict] = {}  # repo_id -> {"refs": {name: commit}, "commits": {commit: {path: bytes}}, ...}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo_id, rest = "/".join(parts[2:4]), parts[4:]
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._send(404, b'{"error": "Repository not found"}',
                                          {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
                    if repo.get("token") and self.headers.get("Authorization") != f"Bearer {repo['token']}":
                        return self._send(401, b'{"error": "Access to model is restricted"}',
                                          {"X-Error-Code": "GatedRepo", "Content-Type": "application/json"})
                    if rest[:1] == ["revision"]:
                        rev = "/".join(rest[1:])
                        commit = repo["refs"].get(rev, rev if rev in repo["commits"] else None)
                        if commit is None:
                            return self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                        files = repo["commits"][commit]
                        return self._send(200, json.dumps({"id": repo_id, "sha": commit, "siblings": [
                            {"rfilename": f} for f in files]}).encode(), {"Content-Type": "application/json"})
                    if rest[:1] == ["tree"]:
                        files = repo["commits"][rest[1]]
                        listing = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                   for f, b in files.items()]
                        return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, commit, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    repo = hub.repos.get(repo_id)
                    body = repo and repo["commits"].get(repo["refs"].get(commit, commit), {}).get(file)
                    if body is None:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    return self._send(200, body, {"X-Repo-Commit": repo["refs"].get(commit, commit),
                                                  "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}, head)
                return self._send(404, b"", None, head)

            def do_GET(self):
                self._route(head=False)

            def do_HEAD(self):
                self._route(head=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, repo_id: str, folder: Path, commit: str, extra: dict[str, bytes] | None = None,
                token: str | None = None) -> None:
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        files = {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}
        repo["commits"][commit] = {**files, **(extra or {})}
        repo["refs"]["main"] = commit
        repo["token"] = token

    def downloaded(self) -> set[str]:
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, _ in self.requests if m == "GET" and "/resolve/" in p}

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    hub = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login token
    yield hub
    hub.close()


def test_online_download_fetches_only_what_llmc_reads(sharded_model, fake_hub, store, monkeypatch):
    model = sharded_model
    junk = {"pytorch_model.bin": b"\x80\x04 pickle", "consolidated.safetensors": b"not read",
            "original/params.json": b"{}", "README.md": b"# card", "onnx/model.onnx": b"graph"}
    fake_hub.publish("org/sharded", model, COMMIT_A, extra=junk)
    src = resolve_source("hf:org/sharded", store)
    shards = {f.name for f in model.glob("model-*.safetensors")}
    assert src.hub == {"repo_id": "org/sharded", "revision": "main", "commit": COMMIT_A}
    got = fake_hub.downloaded()
    assert shards <= got and "config.json" in got and "model.safetensors.index.json" in got
    assert not got & set(junk)  # no pickle, no consolidated copy, nothing unused
    assert {f.name for f in src.folder.iterdir()} == got  # and the snapshot holds exactly that

    # the branch moves: the next resolve sees the new commit and changes the build's keys
    fake_hub.publish("org/sharded", model, COMMIT_B)
    moved = resolve_source("hf:org/sharded", store)
    assert moved.hub["commit"] == COMMIT_B and moved.sha256 != src.sha256

    # and with the network off, the cache answers for the branch's last known commit
    fake_hub.close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source("hf:org/sharded", store).sha256 == moved.sha256


def test_gated_model_needs_hf_token(tiny_model, fake_hub, store, monkeypatch):
    fake_hub.publish("org/gated", tiny_model, COMMIT_A, token="hf_secret")
    with pytest.raises(InputError, match="org/gated@main is a gated model") as e:
        resolve_source("hf:org/gated", store)
    assert "set HF_TOKEN" in e.value.fix
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve_source("hf:org/gated", store).hub["commit"] == COMMIT_A
    assert ("Bearer hf_secret") in {a for _, _, a in fake_hub.requests}


def test_unknown_repo_and_revision_are_named(tiny_model, fake_hub, store):
    fake_hub.publish("org/tiny", tiny_model, COMMIT_A)
    with pytest.raises(InputError, match="model org/tiny has no revision 'v9'|model org/tiny has no revision v9"):
        resolve_source("hf:org/tiny@v9", store)
    with pytest.raises(InputError, match="model org/nothing was not found on the Hub"):
        resolve_source("hf:org/nothing", store)


def test_llmc_plan_on_a_hub_source_works_offline_from_the_cache(tiny_model, hub_cache, tmp_path):
    """`llmc plan` with the network off: config and safetensors headers from the cached snapshot, no weights loaded."""
    from click.testing import CliRunner

    from llmc.cli import main

    put_in_hub_cache(tiny_model, hub_cache, "org/tiny", COMMIT_A)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "hub", "model": {"source": "hf:org/tiny"},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
    }))
    result = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "vllm" in result.output
    recipe.write_text(recipe.read_text().replace("hf:org/tiny", "hf:org/absent"))
    result = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 7 and "org/absent at revision main" in result.output
