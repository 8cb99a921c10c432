"""`model.source: hf:<org>/<name>[@<branch|tag|sha>]`: a checkpoint on the Hugging Face Hub, through huggingface_hub.

Only what llmc reads is fetched: config, generation config, tokenizer and chat-template files, and the safetensors
weights (the shards `model.safetensors.index.json` lists, else `model.safetensors`). Pickled weights (.bin/.pt) and
other copies of the weights some repositories carry (`consolidated.safetensors`, `original/`) are never requested.

Files land in the standard Hub cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), so
other tools share them. `HF_TOKEN` authenticates gated models; `HF_ENDPOINT` names a mirror; `HF_HUB_OFFLINE=1`
resolves from the cache alone. The environment is read when a source is resolved, not when a module is imported.

The revision resolves to a commit sha (the snapshot folder's name), which the caller records and puts into the
stage keys: a branch that moves to a new commit rebuilds, the same commit reuses.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt
from llmc.model.checkpoint import read_index
from llmc.model.confine import source_file

PREFIX = "hf:"

# Everything besides the weights that transformers' config/tokenizer loaders may read.
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"

_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_FORMAT_FIX = "write model.source as hf:<org>/<name> or hf:<org>/<name>@<branch|tag|commit>"


@dataclass(frozen=True)
class HubSpec:
    repo_id: str
    revision: str  # as written ("main" when none was)

    @property
    def shown(self) -> str:
        return f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class HubSnapshot:
    spec: HubSpec
    commit: str  # the 40-hex commit sha the revision resolved to
    folder: Path  # <cache>/models--org--name/snapshots/<commit>
    weights: tuple[str, ...]  # safetensors file names inside folder


def is_hub_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse_hub_spec(spec: str) -> HubSpec:
    """`hf:org/name[@revision]` -> HubSpec; InputError for anything the Hub would refuse."""
    # lazy: huggingface_hub (~0.35 s cold for utils), only for Hub specs
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    body = spec[len(PREFIX):]
    repo_id, _, revision = body.partition("@")
    if "@" in body and not revision:
        raise InputError(f"model source {excerpt(spec)} names no revision after '@'", fix=_FORMAT_FIX)
    revision = revision or "main"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise InputError(f"model source {excerpt(spec)}: {excerpt(repo_id)} is not a Hub model id ({e})",
                         fix=_FORMAT_FIX) from None
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise InputError(f"model source {excerpt(spec)}: {excerpt(revision)} is not a branch, tag or commit",
                         fix=_FORMAT_FIX)
    return HubSpec(repo_id, revision)


def hub_cache_dir() -> Path:
    """The standard Hub cache, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants  # lazy: huggingface_hub (~0.35 s cold for utils), only for Hub specs

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE", "")).strip().upper() in {
        "1", "ON", "YES", "TRUE"}


def download(spec: HubSpec) -> HubSnapshot:
    """Fetch (or find in the cache) the metadata files, then the weights they name, at one commit."""
    folder = _snapshot(spec, spec.revision, list(METADATA_FILES))
    commit = folder.name
    if not _COMMIT.fullmatch(commit):  # snapshot folders are named by commit; anything else is not a Hub cache
        raise InputError(f"{spec.shown} resolved to {folder}, not a snapshot folder named by a commit sha",
                         fix="clear that model from the Hub cache (hf cache delete) and fetch it again")
    if not (folder / "config.json").is_file():
        raise InputError(f"{spec.shown} (commit {commit}) has no config.json: not a transformers model repository",
                         fix="name a repository that holds a transformers checkpoint (config.json + safetensors)")
    weights = _weight_files(spec, commit, folder)
    folder = _snapshot(spec, commit, list(weights))
    missing = [w for w in weights if not (folder / w).is_file()]
    if missing:
        raise InputError(
            f"{spec.shown} (commit {commit}) has no {', '.join(missing[:3])}: llmc reads only safetensors weights",
            fix="if the repository holds only pickled weights (.bin), convert them where you trust the file: "
                "AutoModelForCausalLM.from_pretrained(id).save_pretrained(out, safe_serialization=True), "
                "and point model.source at out",
        )
    return HubSnapshot(spec, commit, folder, weights)


def _weight_files(spec: HubSpec, commit: str, folder: Path) -> tuple[str, ...]:
    """The shards the index lists (its weight_map values), else the single model.safetensors."""
    index = source_file(folder, INDEX_FILE, "shard index")  # a snapshot links into its blobs/, nowhere else
    if not index.is_file():
        return (SINGLE_WEIGHTS_FILE,)
    return tuple(read_index(index).shards)


def _snapshot(spec: HubSpec, revision: str, patterns: list[str]) -> Path:
    # lazy: huggingface_hub's download stack (~0.7 s), only to download
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(
            spec.repo_id, revision=revision, allow_patterns=patterns, cache_dir=hub_cache_dir(),
            local_files_only=offline(), endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except GatedRepoError:
        raise InputError(
            f"{spec.shown} is a gated model and this machine's Hugging Face token has no access to it",
            fix=f"accept its licence at https://huggingface.co/{spec.repo_id} and set HF_TOKEN to a token of that "
                "account (or run `hf auth login`)",
        ) from None
    except RevisionNotFoundError:
        raise InputError(f"model {spec.repo_id} has no revision {excerpt(spec.revision)}",
                         fix="name an existing branch, tag or commit sha after '@'") from None
    except RepositoryNotFoundError:
        raise InputError(
            f"model {spec.repo_id} was not found on the Hub (or is private and HF_TOKEN does not grant access)",
            fix="check the id's spelling, or set HF_TOKEN to a token that can read it",
        ) from None
    except (LocalEntryNotFoundError, OSError, HfHubHTTPError) as e:
        raise unreachable(spec, e) from None
    return Path(path)


def unreachable(spec: HubSpec, cause: BaseException) -> InputError:
    """The model is neither in the cache nor downloadable: say which, and the three ways out."""
    cache = hub_cache_dir()
    how = "HF_HUB_OFFLINE is set" if offline() else \
        f"the Hub at {os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'} cannot be reached"
    return InputError(
        f"model {spec.repo_id} at revision {spec.revision} is not in the Hugging Face cache ({cache}) and {how} "
        f"({type(cause).__name__}: {excerpt(str(cause).splitlines()[0] if str(cause) else '', 160)})",
        fix=f"(1) pre-download it into the cache on a machine with network: `hf download {spec.repo_id} "
            f"--revision {spec.revision}` and copy {cache} here (or set HF_HUB_CACHE to a copy); "
            "(2) set HF_ENDPOINT to a Hub mirror this machine reaches; "
            "(3) point model.source at a local folder with config.json, tokenizer and safetensors",
    )


def describe_snapshot(snapshot: HubSnapshot) -> dict:
    """What the manifest records about a Hub source."""
    return {"repo_id": snapshot.spec.repo_id, "revision": snapshot.spec.revision, "commit": snapshot.commit}

