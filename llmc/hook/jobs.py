"""One hook job: fetch the source model version, build the recipe on it, register the variants that passed.

A job names its source (`{"kind": "mlflow", "name", "version", "uri", "tags"}` or `{"kind": "hf", "name", "version"
(a revision), "uri"}`) and one recipe, resolved when the job was queued. Registered-model names and versions are
validated before anything touches a path (`check_source`); a source is downloaded once into
`<state>/sources/<kind>/<name>/<version>/` (a temp folder renamed into place when complete) and read as safetensors
only: llmc never unpickles weights (`llmc.model.checkpoint`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from llmc.errors import InputError, LlmcError, RegistryError
from llmc.hook.config import HookConfig
from llmc.hook.queue import JobQueue, job_id
from llmc.storage.paths import SAFE_NAME, confined
from llmc.telemetry.progress import log
from llmc.recipe.schema import Recipe
from llmc.publish.mlflow import _call, client, idempotency_key, register_build
from llmc.build import build
from llmc.storage.store import Store

_VERSION = re.compile(r"^[0-9]{1,12}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# what a Hub download takes: never pickles (no *.bin / *.pt), only what llmc reads
_HF_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "tokenizer*", "README.md"]
COMPLETE = ".llmc-fetched"


def mlflow_source(name: str, version: str | int, tags: dict | None = None) -> dict:
    return check_source({"kind": "mlflow", "name": name, "version": str(version), "uri": f"models:/{name}/{version}",
                         "tags": dict(tags or {})})


def hf_source(repo: str, revision: str) -> dict:
    return check_source({"kind": "hf", "name": repo, "version": revision, "uri": f"hf:{repo}@{revision}", "tags": {}})


def parse_model_uri(uri: str) -> dict:
    """`models:/<name>/<version>` (MLflow) or `hf:<org>/<name>@<revision>` (the Hub) as a job source."""
    if uri.startswith("models:/"):
        name, _, version = uri[len("models:/"):].rpartition("/")
        return mlflow_source(name, version)
    if uri.startswith("hf:"):
        repo, _, revision = uri[3:].partition("@")
        return hf_source(repo, revision or "main")
    raise InputError(f"{ascii(uri)[:100]} is not a model URI llmc's hook reads",
                     fix="pass models:/<registered model>/<version> or hf:<org>/<name>@<revision>")


def check_source(source: dict) -> dict:
    """The source, refused (InputError) unless its name and version are safe to become folder names."""
    name, version = source["name"], source["version"]
    ok_name = re.match(SAFE_NAME, name) if source["kind"] == "mlflow" else _HF_REPO.match(name)
    ok_version = (_VERSION if source["kind"] == "mlflow" else _REVISION).match(version)
    if not ok_name or not ok_version:
        raise InputError(f"model {ascii(name)[:100]} version {ascii(version)[:40]} is refused: names are "
                         "letters, digits, '.', '_' and '-' (Hub: org/name), MLflow versions are numbers",
                         fix="rename the registered model; the hook builds only names that are safe as folder names")
    return source


def recipe_for_job(recipe: Recipe, source: dict) -> Recipe:
    """The recipe as the job records it: model.source is the source's URI, model.name the source's name (the model
    card's base_model and the registered names derive from it)."""
    model = recipe.model.model_copy(update={"source": source["uri"], "name": source["name"].split("/")[-1]})
    return recipe.model_copy(update={"model": model})


def new_job(recipe: Recipe, recipe_path: Path, source: dict) -> dict:
    resolved = recipe_for_job(recipe, source).model_dump(mode="json")
    return {"id": job_id(source["uri"], {k: v for k, v in resolved.items() if k != "publish"}),
            "source": source, "recipe_path": str(recipe_path), "recipe": resolved}


def fetch_source(source: dict, config: HookConfig) -> Path:
    """The source's files as a local Hugging Face folder (downloaded once)."""
    root = config.state / "sources"
    final = confined(root, f"{source['kind']}/{source['name']}/{source['version']}", what="source folder")
    if (final / COMPLETE).is_file():
        return _model_folder(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if source["kind"] == "mlflow":
            _download_mlflow(source, config, tmp)
        else:
            _download_hf(source, tmp)
        (tmp / COMPLETE).write_text(source["uri"])
        shutil.rmtree(final, ignore_errors=True)  # an incomplete earlier download
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _model_folder(final)


def _download_mlflow(source: dict, config: HookConfig, into: Path) -> None:
    c = client(config.tracking_uri())
    from mlflow.artifacts import download_artifacts  # lazy: optional mlflow (llmc[registry], ~4 s)

    # the version's own artifact location, resolved by the hook's server (a bare models:/ URI would be resolved
    # against the process's default registry, not the configured one)
    where = _call(f"find {source['uri']}", c.get_model_version_download_uri, source["name"], source["version"])
    _call(f"download {source['uri']}", download_artifacts, artifact_uri=where, dst_path=str(into),
          tracking_uri=config.tracking_uri())


def _download_hf(source: dict, into: Path) -> None:
    # lazy: huggingface_hub's download stack (~0.7 s), only for Hub sources
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(source["name"], revision=source["version"], local_dir=str(into),
                          allow_patterns=_HF_PATTERNS)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth: all "the Hub did not give us the files"
        raise RegistryError(f"could not download {source['uri']} from the Hugging Face Hub: {type(e).__name__}",
                            fix="check that the Hub is reachable from this machine and HF_TOKEN can read the repo")


def _model_folder(root: Path) -> Path:
    """The folder under `root` holding config.json: root itself or one nested folder (MLflow flavors nest)."""
    if (root / "config.json").is_file():
        return root
    found = sorted(p.parent for p in root.rglob("config.json") if len(p.relative_to(root).parts) <= 4)
    if len(found) != 1:
        raise InputError(f"{root} holds {len(found) or 'no'} folders with a config.json",
                         fix="register a Hugging Face model folder (config.json, safetensors, tokenizer) as the version")
    return found[0]


def cache_store(config: HookConfig) -> Store:
    """The stage cache the config names (relative to its file), else llmc's default ($LLMC_CACHE, ~/.cache/llmc)."""
    return Store.default(config.path(config.cache_dir) if config.cache_dir else None)


def run_job(job: dict, config: HookConfig, queue: JobQueue) -> dict:
    """Run a job taken from the queue; returns it as finally stored (state done or failed). Any failure is recorded
    on the job, never raised: the worker goes on with the next."""
    source = job["source"]
    try:
        folder = fetch_source(source, config)
        recorded = Recipe.model_validate(job["recipe"])
        model = recorded.model.model_copy(update={"source": str(folder)})
        publish = recorded.publish.model_copy(update={"registry": str(config.state / "registry")})
        recipe = recorded.model_copy(update={"model": model, "publish": publish})
        store = cache_store(config)
        log(f"hook: building {recipe.name} for {source['uri']} (job {job['id'][:12]})")
        result = build(recipe, store, publish=True)
        if not result.passed:
            failed = "; ".join(f"{v.gate} on {v.target}: {v.measured} vs {v.threshold}"
                               for v in result.verdicts if not v.passed)
            return queue.update(job["id"], state="failed", build_id=result.build_id,
                                error=f"gate failed (nothing registered): {failed}"[:2000])
        key = idempotency_key(source["uri"], result.source.sha256,
                              {k: v for k, v in job["recipe"].items() if k != "publish"})
        registrations = []
        if source["kind"] == "mlflow":
            c = client(config.tracking_uri())
            registrations = [r.__dict__ for r in register_build(c, result, source, key)]
        return queue.update(job["id"], state="done", build_id=result.build_id, idempotency_key=key,
                            published=str(result.published), registrations=registrations)
    except LlmcError as e:
        log(f"hook: job {job['id'][:12]} failed: {e.kind}: {e.message}")
        return queue.update(job["id"], state="failed", error=f"{e.kind}: {e.message}"[:2000])
    except Exception as e:  # noqa: BLE001 - one job's crash must not stop the worker
        log(f"hook: job {job['id'][:12]} failed: internal error: {type(e).__name__}: {e}")
        return queue.update(job["id"], state="failed", error=f"internal error: {type(e).__name__}: {e}"[:2000])
