"""The hook's durable job queue: one JSON file per job under `<state>/queue/`, written atomically.

A job's id hashes what makes it the same work: the source model version, the resolved recipe and the llmc version
(`job_id`). Enqueueing an id that is already there adds nothing (a re-delivered or duplicated webhook), whatever the
job's state. States: queued -> running -> done | failed. The queue is bounded (`max_queued` jobs queued or running;
beyond, `QueueFull`). One worker at a time holds `<state>/worker.lock`; a job left `running` when that lock is free
belonged to a worker that died (SIGKILL, power loss) and is queued again by the next worker (`recover`): the build
resumes from the stage cache. Transitions hold `<state>/queue.lock`, so `llmc hook run` and a running
`llmc hook serve` on one state folder never take the same job twice.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from filelock import FileLock, Timeout

from llmc import __version__
from llmc.errors import InputError, ResourceError
from llmc.storage.paths import confined
from llmc.storage.store import atomic_write_json

_ID_CHARS = set("0123456789abcdef")


class QueueFull(ResourceError):
    """The queue holds max_queued unfinished jobs."""


def job_id(source_uri: str, recipe: dict, llmc_version: str = __version__) -> str:
    """The id of building `recipe` (resolved, as JSON, its model source left out) from `source_uri`."""
    blob = json.dumps({"source": source_uri, "recipe": recipe, "llmc": llmc_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class JobQueue:
    def __init__(self, state: Path, max_queued: int = 100) -> None:
        self.state = Path(state)
        self.dir = self.state / "queue"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_queued = max_queued
        self._lock = FileLock(str(self.state / "queue.lock"), is_singleton=True)

    def worker_lock(self) -> FileLock:
        return FileLock(str(self.state / "worker.lock"), is_singleton=True)

    def _path(self, jid: str) -> Path:
        if len(jid) != 64 or not set(jid) <= _ID_CHARS:
            raise InputError(f"{ascii(jid)[:80]} is not a job id", fix="pass an id `llmc hook status` lists")
        return confined(self.dir, f"{jid}.json", what="job file")

    def get(self, jid: str) -> dict | None:
        try:
            return json.loads(self._path(jid).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def jobs(self) -> list[dict]:
        """Every job, oldest first."""
        out = []
        for p in self.dir.glob("*.json"):
            try:
                out.append(json.loads(p.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue  # a file that is not a job (atomic writes leave no half job)
        return sorted(out, key=lambda j: (j.get("received", 0), j["id"]))

    def _write(self, job: dict) -> None:
        atomic_write_json(self._path(job["id"]), job)

    def enqueue(self, job: dict, delivery: str | None = None) -> tuple[dict, bool]:
        """(the job as stored, whether it is new). A job whose id exists is left as it is."""
        with self._lock:
            existing = self.get(job["id"])
            if existing is not None:
                if delivery and delivery not in existing.setdefault("deliveries", []):
                    existing["deliveries"] = (existing["deliveries"] + [delivery])[-20:]  # bounded record
                    self._write(existing)
                return existing, False
            unfinished = sum(j["state"] in ("queued", "running") for j in self.jobs())
            if unfinished >= self.max_queued:
                raise QueueFull(f"the hook's queue holds {unfinished} unfinished jobs (max_queued {self.max_queued})",
                                fix="wait for the worker, or raise max_queued in the hook config")
            job = {**job, "state": "queued", "received": time.time(), "attempts": 0,
                   "deliveries": [delivery] if delivery else []}
            self._write(job)
            return job, True

    def update(self, jid: str, **fields) -> dict:
        with self._lock:
            job = self.get(jid)
            if job is None:
                raise InputError(f"no job {jid} in {self.dir}", fix="pass an id `llmc hook status` lists")
            job.update(fields, updated=time.time())
            self._write(job)
            return job

    def take(self, jid: str | None = None) -> dict | None:
        """Mark the oldest queued job (or job `jid` if queued or failed) running and return it; None if none."""
        with self._lock:
            if jid is not None:
                job = self.get(jid)
                candidates = [job] if job and job["state"] in ("queued", "failed") else []
            else:
                candidates = [j for j in self.jobs() if j["state"] == "queued"]
            if not candidates:
                return None
            job = candidates[0]
            job.update(state="running", attempts=job.get("attempts", 0) + 1, started=time.time(), error=None)
            self._write(job)
            return job

    def recover(self) -> list[str]:
        """Queue again the jobs a dead worker left running. Call only while holding `worker_lock()`. A job a cluster
        scheduler holds (its `scheduler_id` recorded) is not: the new worker follows it by that id."""
        requeued = []
        with self._lock:
            for job in self.jobs():
                if job["state"] == "running" and not job.get("scheduler_id"):
                    job["state"] = "queued"
                    self._write(job)
                    requeued.append(job["id"])
        return requeued

    def worker_alive(self) -> bool:
        lock = self.worker_lock()
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        lock.release()
        return False
