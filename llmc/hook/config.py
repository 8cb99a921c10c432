"""The hook's configuration: which registered models build which recipes, where the queue lives, the secrets' names.

    # hook.yaml
    mlflow: {tracking_uri: http://127.0.0.1:5000}   # default: $MLFLOW_TRACKING_URI
    state_dir: ./llmc-hook                          # queue, fetched sources, local registry (relative: to this file)
    max_queued: 100                                  # queued + running jobs; beyond, deliveries get 503 (retried)
    timestamp_tolerance_s: 300
    server: {connection_limit: 100, idle_timeout_s: 10}   # the HTTP server's limits (ServerSection)
    runner: local                                    # local | slurm | kubernetes (llmc.hook.runners)
    slurm: {partitions: [{name: gpu, gpus_per_node: 8, memory_gb: 1900, max_time_h: 48}]}
    routes:
      - {models: "smollm2*", recipes: [recipes/smollm2-fp8.yaml]}   # registered-model name pattern (fnmatch)
      - {tag: llmc.deploy, recipes: [recipes/smollm2-w4a16.yaml]}    # a model version carrying this tag

Secrets never live in this file: the MLflow webhook secret comes from LLMC_HOOK_MLFLOW_SECRET or
LLMC_HOOK_MLFLOW_SECRET_FILE, the Hub's from LLMC_HOOK_HF_SECRET or LLMC_HOOK_HF_SECRET_FILE; GET /status takes
either of them, or LLMC_HOOK_STATUS_TOKEN(_FILE), as a bearer token.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmc.errors import InputError, RecipeError

MLFLOW_SECRET = "LLMC_HOOK_MLFLOW_SECRET"
HF_SECRET = "LLMC_HOOK_HF_SECRET"
STATUS_TOKEN = "LLMC_HOOK_STATUS_TOKEN"  # optional: a read-only token for GET /status besides the receivers' secrets
# A cluster job's time beyond the plan's stages: the interpreter's start, a fresh node's rate probes, the MLflow upload
# and registration, the exit. The tiny test model's job spent ~62 s of its 64 s there at load ~15 on a shared 2-core
# host (start 16 s, plan with probes 26 s, upload and registration 14 s, exit 7 s): with --time the plan's 0 s
# rounded up to 1 min, Slurm ended it TIMEOUT (tests/integration/test_hook_slurm.py).
TIME_OVERHEAD_S = 600.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Route(_Strict):
    models: str | None = Field(default=None, description="fnmatch pattern over registered-model names")
    tag: str | None = Field(default=None, description="'key' or 'key=value' the model version must carry")
    recipes: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_selector(self) -> "Route":
        if (self.models is None) == (self.tag is None):
            raise ValueError("a route names exactly one of 'models' (a name pattern) or 'tag'")
        return self

    def matches(self, name: str, tags: dict[str, str]) -> bool:
        if self.models is not None:
            return fnmatch.fnmatchcase(name, self.models)
        key, sep, value = self.tag.partition("=")
        return key in tags and (not sep or tags[key] == value)


class MlflowSection(_Strict):
    tracking_uri: str | None = None


class ServerSection(_Strict):
    """The limits `llmc hook serve` holds every connection to (llmc.hook.server). A delivery is one small request:
    MLflow and the Hub connect, send it at once and read the answer within seconds."""
    connection_limit: int = Field(default=100, ge=2, le=10_000, description=(
        "open connections; one more closes the connection idle longest (never one whose request is being served)"))
    idle_timeout_s: float = Field(default=10, gt=0, le=3600, description="a connection silent this long is closed")
    header_timeout_s: float = Field(default=10, gt=0, le=3600,
                                    description="the request line and headers must arrive within this")
    request_timeout_s: float = Field(default=30, gt=0, le=3600,
                                     description="the whole request, body included, must arrive within this")
    max_header_bytes: int = Field(default=16 << 10, ge=1 << 10, le=1 << 20)
    max_body_bytes: int = Field(default=1 << 20, ge=1 << 10, le=64 << 20)
    threads: int = Field(default=4, ge=1, le=64, description="requests answered at once")


class Partition(_Strict):
    """One Slurm partition's limits, as `scontrol show partition` / the cluster's admins state them."""
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    gpus_per_node: int = Field(default=0, ge=0, le=64)
    gpu_memory_gb: float | None = Field(default=None, gt=0, description="per GPU; unset: not checked")
    memory_gb: float = Field(gt=0, description="host memory a job may take per node (--mem)")
    max_time_h: float = Field(gt=0, le=100_000, description="the partition's MaxTime")
    max_nodes: int = Field(default=1, ge=1, le=10_000)
    tmp_disk_gb: float | None = Field(default=None, gt=0, description="node-local disk (--tmp); unset: not requested")


class SlurmSection(_Strict):
    partitions: tuple[Partition, ...] = Field(default=(), description="tried in order; the first that fits is used")
    ranks: int = Field(default=1, ge=1, le=4096, description="processes (one GPU each when the recipe uses GPUs)")
    time_margin: float = Field(default=1.5, ge=1, le=10, description="--time = the plan's slowest estimate x this")
    memory_margin: float = Field(default=1.25, ge=1, le=10, description="--mem = the plan's host peak x this")
    time_overhead_s: float = Field(default=TIME_OVERHEAD_S, ge=0, le=86_400,
                                   description="added to --time: the job's work outside the plan's stages")
    llmc: str = Field(default="llmc", description="the llmc executable on the compute nodes")
    poll_s: float = Field(default=30, gt=0, le=3600, description="how often squeue/sacct are asked")
    machine: str | None = Field(default=None, description="plan for the nodes: a profile (h100-sxm:8) or a machine "
                                "file `llmc probe` wrote on one; unset: this host's own rates")


class KubernetesSection(_Strict):
    namespace: str = "default"
    image: str = Field(default="", description="an image with llmc installed")
    state_claim: str = Field(default="", description="PersistentVolumeClaim holding state_dir (queue, registry)")
    cache_claim: str = Field(default="", description="PersistentVolumeClaim holding the stage cache")
    memory_margin: float = Field(default=1.25, ge=1, le=10)
    time_margin: float = Field(default=1.5, ge=1, le=10, description="activeDeadlineSeconds = slowest estimate x this")
    time_overhead_s: float = Field(default=TIME_OVERHEAD_S, ge=0, le=86_400,
                                   description="added to activeDeadlineSeconds, as slurm.time_overhead_s")
    machine: str | None = Field(default=None, description="plan for the nodes, as slurm.machine")


class HookConfig(_Strict):
    mlflow: MlflowSection = MlflowSection()
    state_dir: str = "./llmc-hook"
    cache_dir: str | None = None
    max_queued: int = Field(default=100, ge=1, le=100_000)
    timestamp_tolerance_s: float = Field(default=300, gt=0, le=86_400)
    server: ServerSection = ServerSection()
    runner: Literal["local", "slurm", "kubernetes"] = "local"
    slurm: SlurmSection = SlurmSection()
    kubernetes: KubernetesSection = KubernetesSection()
    routes: tuple[Route, ...] = ()
    base: Path = Field(default=Path("."), exclude=True)  # the config file's folder: relative paths start there

    @model_validator(mode="after")
    def _runner_configured(self) -> "HookConfig":
        if self.runner == "slurm" and not self.slurm.partitions:
            raise ValueError("runner slurm needs slurm.partitions (each partition's name and limits)")
        if self.slurm.ranks > 1:  # the sbatch request is computed for ranks (llmc.hook.runners); the launch is not
            raise ValueError("slurm.ranks above 1 (torchrun across GPUs and nodes) is not implemented yet; use 1")
        if self.runner == "kubernetes" and not (self.kubernetes.image and self.kubernetes.state_claim):
            raise ValueError("runner kubernetes needs kubernetes.image and kubernetes.state_claim")
        return self

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base / p

    @property
    def state(self) -> Path:
        return self.path(self.state_dir)

    def tracking_uri(self) -> str:
        uri = self.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise RecipeError("no MLflow tracking URI: the hook config has no mlflow.tracking_uri and "
                              "MLFLOW_TRACKING_URI is not set", fix="set one of them to the MLflow server's URL")
        return uri

    def recipes_for(self, name: str, tags: dict[str, str]) -> list[Path]:
        """The recipe files every matching route names, each once, in config order."""
        out: list[Path] = []
        for route in self.routes:
            if route.matches(name, tags):
                out += [p for p in map(self.path, route.recipes) if p not in out]
        return out


def load_hook_config(path: Path) -> HookConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise InputError(f"hook config {path} does not exist", fix="pass the hook's YAML config file") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"hook config {path} is not valid YAML: {type(e).__name__}", fix="fix the file") from None
    if not isinstance(data, dict):
        raise RecipeError(f"hook config {path} is not a mapping", fix="see docs/registry-hook.md for the format")
    try:
        return HookConfig(**data, base=path.resolve().parent)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        fix = ("set runner: to local, slurm or kubernetes" if first["loc"] == ("runner",)
               else "see docs/registry-hook.md for the format")
        raise RecipeError(f"hook config {path}: {where}: {first['msg']}", fix=fix) from None


def secret(variable: str) -> str | None:
    """A secret from the environment: `variable` itself or `variable`_FILE (a file holding it, whitespace stripped).
    None when neither is set. Never logged: callers only say which variable they read."""
    value, file_name = os.environ.get(variable), os.environ.get(f"{variable}_FILE")
    if value and file_name:
        raise InputError(f"both {variable} and {variable}_FILE are set", fix="set only one of them")
    if file_name:
        path = Path(file_name)
        if not path.is_file():
            raise InputError(f"{variable}_FILE names {path}, which is not a regular file",
                             fix="point it at a file holding the secret")
        text = path.read_text(encoding="utf-8").strip()
        if not text:
            raise InputError(f"the secret file {path} is empty", fix="write the secret into it")
        return text
    if value is not None and not value:
        raise InputError(f"{variable} is set but empty", fix="unset it or give it the secret")
    return value
