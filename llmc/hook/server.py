"""`llmc hook serve`: the webhook receiver (a Flask app served by waitress) and the one worker thread that builds.

Receivers (each enabled by its secret being set, never read from the config file):
    POST /webhooks/mlflow       MLflow `model_version.created`, signed (llmc.hook.signatures.verify_mlflow)
    POST /webhooks/huggingface  Hugging Face Hub repo webhooks, X-Webhook-Secret
    GET  /status                the queue, as `llmc hook status --json` prints it; `Authorization: Bearer <secret>`
    GET  /health
A delivery that fails verification is answered 401 and logged (the reason, never the secret) and touches nothing.
A verified one is validated against its schema (llmc.hook.payloads: 400 naming the field otherwise), then queues one
job per recipe its route names (202), or says why it was ignored (200): another event, no route, or a version llmc
registered itself. A full queue answers 503 with Retry-After, which MLflow retries.

The HTTP server is waitress under the limits of the config's `server` section (llmc.hook.http_server).
"""

from __future__ import annotations

import hmac
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmc.errors import InputError, LlmcError
from llmc.hook import payloads, signatures
from llmc.hook.config import HF_SECRET, MLFLOW_SECRET, STATUS_TOKEN, HookConfig, secret
from llmc.hook.jobs import hf_source, mlflow_source, new_job, run_job
from llmc.hook.queue import JobQueue, QueueFull
from llmc.hook.runners import Runner, dispatch, follow, runner_for
from llmc.telemetry.progress import log
from llmc.recipe.load import load_recipe

OWN_VERSION_TAG = "llmc.build_id"  # carried by every version llmc registers: never a source for another build


def enqueue_for(config: HookConfig, queue: JobQueue, source: dict, delivery: str | None,
                recipes: list[Path] | None = None) -> list[tuple[dict, bool]]:
    """Queue one job per recipe the routes give `source` (or per `recipes`); [(job, new)]."""
    paths = recipes if recipes is not None else config.recipes_for(source["name"], source.get("tags") or {})
    return [queue.enqueue(new_job(load_recipe(p), p, source), delivery) for p in paths]


def _summary(jobs: list[dict]) -> list[dict]:
    keys = ("id", "state", "source", "recipe_path", "attempts", "build_id", "registrations", "error", "deliveries",
            "scheduler", "scheduler_id", "scheduler_state")
    return [{k: j.get(k) for k in keys if j.get(k) is not None} | {"source": j["source"]["uri"]} for j in jobs]


def create_app(config: HookConfig, queue: JobQueue, wake: threading.Event, now: Callable[[], float] = time.time):
    # lazy: Flask comes with the optional mlflow (llmc[registry]); only the server needs it
    from flask import Flask, jsonify, request
    from werkzeug.exceptions import HTTPException

    app = Flask("llmc-hook")
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    mlflow_secret, hf_secret = secret(MLFLOW_SECRET), secret(HF_SECRET)
    status_tokens = [t for t in (secret(STATUS_TOKEN), mlflow_secret, hf_secret) if t]

    def queue_jobs(source: dict, delivery: str | None):
        try:
            results = enqueue_for(config, queue, source, delivery)
        except QueueFull as e:
            log(f"hook: queue full, delivery {delivery} deferred: {e.message}")
            return jsonify(error=e.message), 503, {"Retry-After": "60"}
        except LlmcError as e:  # the hook's own recipes or state folder, not the delivery: said in the log only
            log(f"hook: delivery {delivery} for {source['uri']} not queued: {e.kind}: {e.message}")
            return jsonify(error="the hook could not queue the job; its log says why"), 500
        if not results:
            return jsonify(ignored=f"no route for {source['name']}"), 200
        for job, new in results:
            log(f"hook: delivery {delivery}: {source['uri']} -> job {job['id'][:12]} "
                + ("queued" if new else f"already {job['state']} (duplicate; nothing to do)"))
        wake.set()
        return jsonify(jobs=[{"id": j["id"], "new": new, "state": j["state"]} for j, new in results]), 202

    def refused(kind: str, reason: str):
        log(f"hook: refused {kind} delivery from {request.remote_addr}: {reason}")
        return jsonify(error="unauthorized"), 401

    def bad_payload(kind: str, delivery: str | None, e: payloads.PayloadError):
        log(f"hook: {kind} delivery {delivery} refused: {e.message}")
        return jsonify(error=f"not {kind} webhook payload: {e.message}"), 400

    @app.post("/webhooks/mlflow")
    def mlflow_webhook():
        if mlflow_secret is None:
            return jsonify(error=f"the MLflow receiver is off ({MLFLOW_SECRET} is not set)"), 404
        body = request.get_data(cache=True)
        reason = signatures.verify_mlflow(request.headers, body, mlflow_secret, now(), config.timestamp_tolerance_s)
        if reason:
            return refused("MLflow", reason)
        delivery = request.headers.get(signatures.MLFLOW_DELIVERY_ID_HEADER)
        try:
            event = payloads.mlflow_event(body)
            if event.kind != "model_version.created":
                return jsonify(ignored=f"event {event.kind}"), 200
            version = payloads.model_version_created(event)
        except payloads.PayloadError as e:
            return bad_payload("an MLflow", delivery, e)
        tags = version.tag_map
        if OWN_VERSION_TAG in tags:
            return jsonify(ignored="a version llmc registered"), 200
        try:
            source = mlflow_source(version.name, version.version, tags)
        except InputError as e:
            log(f"hook: delivery {delivery} refused: {e.message}")
            return jsonify(error=e.message), 400
        return queue_jobs(source, delivery)

    @app.post("/webhooks/huggingface")
    def hf_webhook():
        if hf_secret is None:
            return jsonify(error=f"the Hugging Face receiver is off ({HF_SECRET} is not set)"), 404
        reason = signatures.verify_hf(request.headers, hf_secret)
        if reason:
            return refused("Hugging Face", reason)
        try:
            event = payloads.hf_event(request.get_data(cache=True))
        except payloads.PayloadError as e:
            return bad_payload("a Hugging Face", request.headers.get("X-Request-Id"), e)
        scope, kind, revision = event.event.scope, event.repo.type, event.repo.headSha or "main"
        if not scope.startswith("repo") or kind != "model" or event.event.action == "delete":
            return jsonify(ignored=f"event {scope} on a {kind}"), 200
        try:
            source = hf_source(event.repo.name, revision)
        except InputError as e:
            return jsonify(error=e.message), 400
        return queue_jobs(source, request.headers.get("X-Request-Id") or f"hf:{event.repo.name}@{revision}")

    @app.get("/status")
    def status():
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), t.encode())
                                                 for t in status_tokens):
            log(f"hook: refused a status request from {request.remote_addr}")
            return jsonify(error="unauthorized: send Authorization: Bearer <secret>"), 401, {
                "WWW-Authenticate": 'Bearer realm="llmc-hook"'}
        return jsonify(jobs=_summary(queue.jobs()))

    @app.get("/health")
    def health():
        return jsonify(ok=True)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):  # 404, 405, 413...: JSON like every other answer
        return jsonify(error=f"{e.name}: {e.description}"), e.code

    return app


class Worker(threading.Thread):
    """Runs queued jobs one at a time while it holds the state folder's worker lock; with a cluster runner, submits
    them and follows them on the scheduler instead."""

    def __init__(self, config: HookConfig, queue: JobQueue, wake: threading.Event, runner: Runner | None = None
                 ) -> None:
        super().__init__(name="llmc-hook-worker", daemon=True)
        self.config, self.queue, self.wake, self.runner = config, queue, wake, runner
        self.stopping = threading.Event()

    def run(self) -> None:
        if self.runner is not None:
            return self._run_on_cluster(self.runner)
        with self.queue.worker_lock():
            for jid in self.queue.recover():
                log(f"hook: job {jid[:12]} was running when its worker died; queued again (resumes from the cache)")
            while not self.stopping.is_set():
                job = self.queue.take()
                if job is None:
                    self.wake.wait(1.0)
                    self.wake.clear()
                    continue
                done = run_job(job, self.config, self.queue)
                log(f"hook: job {job['id'][:12]} {done['state']}")

    def _run_on_cluster(self, runner: Runner) -> None:
        with self.queue.worker_lock():
            for jid in self.queue.recover():
                log(f"hook: job {jid[:12]} was being submitted when its worker died; queued again")
            while not self.stopping.is_set():
                job = self.queue.take()
                if job is not None:
                    done = dispatch(runner, job, self.queue)
                    log(f"hook: job {job['id'][:12]} " + (f"-> {runner.name} job {done['scheduler_id']}"
                                                         if done.get("scheduler_id") else done["state"]))
                    continue
                follow(runner, self.queue)
                self.wake.wait(self.config.slurm.poll_s if runner.name == "slurm" else 30)
                self.wake.clear()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()


def _stop_serving(*_) -> None:
    raise SystemExit(0)  # out of waitress's loop, which shuts its threads down


def serve(config: HookConfig, host: str, port: int, config_path: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM. The worker starts first, so a restart resumes what a killed hook left."""
    # lazy: waitress, optional (llmc[registry]); only `llmc hook serve` needs it
    from llmc.hook.http_server import HookServer

    if secret(MLFLOW_SECRET) is None and secret(HF_SECRET) is None:
        raise InputError(f"neither {MLFLOW_SECRET} nor {HF_SECRET} is set: the hook would accept no delivery",
                         fix=f"set {MLFLOW_SECRET} (or {MLFLOW_SECRET}_FILE) to the secret the MLflow webhook was "
                             "created with")
    queue = JobQueue(config.state, config.max_queued)
    wake = threading.Event()
    worker = Worker(config, queue, wake, runner_for(config, config_path))
    worker.start()
    server = HookServer(create_app(config, queue, wake), config.server, host, port)
    signal.signal(signal.SIGTERM, _stop_serving)
    log(f"hook: listening on http://{host}:{server.effective_port} (state {config.state})")
    try:
        server.run()
    finally:
        worker.stop()
        server.close()
