"""What the registry-hook tests share: a tiny recipe that builds in seconds, a real MLflow server on a loopback
port, MLflow-signed deliveries, and `llmc hook serve` in a child process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import yaml

from llmc.hook.signatures import mlflow_signature

REPO = Path(__file__).resolve().parents[2]
SECRET = "test-webhook-secret-0123456789"


def tiny_recipe(path: Path, registry: Path, name: str = "tiny-w8") -> Path:
    """INT8 weight-only for vLLM (no calibration pass), evaluated on 4 windows of 64 tokens, one gate."""
    path.write_text(yaml.safe_dump({
        "name": name,
        "model": {"source": "replaced-by-the-hook"},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 64, "windows": 4, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 100},
        "gates": {"max_ppl_increase_pct": 50.0, "max_mean_kld": 1.0, "min_top1_agreement_pct": 10.0},
        "publish": {"registry": str(registry)},
    }))
    return path


def hook_config(path: Path, tracking_uri: str, recipe: Path, models: str = "tiny*", **extra) -> Path:
    path.write_text(yaml.safe_dump({"mlflow": {"tracking_uri": tracking_uri}, "state_dir": str(path.parent / "state"),
                                    "cache_dir": str(path.parent / "cache"),
                                    "routes": [{"models": models, "recipes": [str(recipe)]}], **extra}))
    return path


def make_receiver(tmp: Path, monkeypatch, max_queued: int):
    """(Flask test client, queue, config) of the hook's app with both receivers on (the Hub's secret is "hf-" +
    SECRET) and no worker: what a delivery leaves queued."""
    from llmc.hook.config import load_hook_config
    from llmc.hook.queue import JobQueue
    from llmc.hook.server import create_app

    monkeypatch.setenv("LLMC_HOOK_MLFLOW_SECRET", SECRET)
    monkeypatch.setenv("LLMC_HOOK_HF_SECRET", "hf-" + SECRET)
    recipe = tiny_recipe(tmp / "recipe.yaml", tmp / "registry")
    config = load_hook_config(hook_config(tmp / "hook.yaml", "http://127.0.0.1:9", recipe, max_queued=max_queued))
    queue = JobQueue(config.state, config.max_queued)
    return create_app(config, queue, threading.Event()).test_client(), queue, config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"{url}: the process exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer within {timeout} s")
            time.sleep(0.5)


def start_mlflow(root: Path) -> tuple[subprocess.Popen, str]:
    """A real MLflow server: SQLite backend, local artifact store, loopback port, webhooks allowed to loopback."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # no job runner: its 7 huey consumers (GenAI scorer jobs; webhooks are sent from the server's own threads) are 8
    # more Python processes importing MLflow on the shared 2-core host
    env = {**os.environ, "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true", "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
           "MLFLOW_WEBHOOK_CACHE_TTL": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            env=env, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    wait_http(f"{uri}/health", 400, proc)
    return proc, uri


# `llmc hook serve` in a child: the small corpus instead of Brown's 500 files, and optionally SIGKILL at an event.
_HOOK_CHILD = """
import os, resource, signal, sys
sys.path.insert(0, sys.argv.pop(1))
nofile = int(sys.argv.pop(1))
if nofile:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from llmc.telemetry import events
from tests.unit.build_helpers import use_corpus_file
corpus = sys.argv.pop(1)
if corpus != "-":
    use_corpus_file(corpus)
kill_at = sys.argv.pop(1)
if kill_at != "-":
    events.subscribe(lambda event: event.startswith(kill_at) and os.kill(os.getpid(), signal.SIGKILL))
from llmc.cli import main
main()
"""


def start_hook(config: Path, corpus: Path | None, log: Path, kill_at: str = "-",
               nofile: int = 0) -> tuple[subprocess.Popen, str]:
    """`llmc hook serve --port 0` on `config` (the small corpus file instead of Brown unless None); (process, URL).
    `nofile`: the child's soft limit on open descriptors (0: inherited)."""
    env = {**os.environ, "LLMC_PROGRESS_JSON": "0", "LLMC_HOOK_MLFLOW_SECRET": SECRET}
    seen = log.stat().st_size if log.exists() else 0  # a restart appends to the log: read only its own lines
    proc = subprocess.Popen([sys.executable, "-c", _HOOK_CHILD, str(REPO), str(nofile), str(corpus or "-"), kill_at,
                             "hook", "serve", "--config", str(config), "--port", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a"), start_new_session=True,
                            cwd=config.parent)  # anything written relative to the working directory stays there
    deadline = time.monotonic() + 120
    while True:
        found = re.findall(r"listening on (http://127\.0\.0\.1:\d+)", log.read_bytes()[seen:].decode(errors="replace"))
        if found:
            return proc, found[-1]
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def signed_headers(body: bytes, secret: str = SECRET, timestamp: int | None = None,
                   delivery_id: str | None = None) -> dict:
    """The headers MLflow sends with `body` (signed exactly as sent)."""
    delivery_id = delivery_id or str(uuid.uuid4())
    ts = str(int(time.time()) if timestamp is None else timestamp)
    return {"Content-Type": "application/json", "X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": ts,
            "X-MLflow-Signature": mlflow_signature(secret, delivery_id, ts, body)}


def signed_delivery(payload: dict, secret: str = SECRET, timestamp: int | None = None,
                    delivery_id: str | None = None) -> tuple[bytes, dict]:
    """A delivery exactly as MLflow sends one (body, headers)."""
    body = json.dumps(payload).encode()
    return body, signed_headers(body, secret, timestamp, delivery_id)


def version_created(name: str, version: str, tags: dict | None = None) -> dict:
    return {"entity": "model_version", "action": "created", "timestamp": "2026-01-01T00:00:00+00:00",
            "data": {"name": name, "version": version, "source": "runs:/x/model", "run_id": "x",
                     "tags": tags or {}, "description": None}}


def post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_jobs(hook_url: str, done: int, timeout: float, proc: subprocess.Popen | None = None) -> list[dict]:
    """The hook's jobs once `done` of them finished (done or failed)."""
    deadline = time.monotonic() + timeout
    status = urllib.request.Request(f"{hook_url}/status", headers={"Authorization": f"Bearer {SECRET}"})
    while True:
        with urllib.request.urlopen(status, timeout=10) as r:
            jobs = json.loads(r.read())["jobs"]
        if sum(j["state"] in ("done", "failed") for j in jobs) >= done:
            return jobs
        assert proc is None or proc.poll() is None, "the hook exited"
        assert time.monotonic() < deadline, jobs
        time.sleep(1)


def register_source_version(tracking_uri: str, name: str, folder: Path, tags: dict | None = None) -> str:
    """Log `folder` to a run and register it as a new version of `name` (what a training job does)."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    try:
        client.create_registered_model(name)
    except mlflow.exceptions.MlflowException:
        pass
    exp = client.get_experiment_by_name("training") or client.get_experiment(client.create_experiment("training"))
    run = client.create_run(exp.experiment_id)
    client.log_artifacts(run.info.run_id, str(folder), "model")
    client.set_terminated(run.info.run_id)
    mv = client.create_model_version(name, f"runs:/{run.info.run_id}/model", run.info.run_id, tags=tags)
    return str(mv.version)
