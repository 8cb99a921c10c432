"""What `llmc hook status` and `llmc hook run` do, as functions the CLI calls."""

from __future__ import annotations

from pathlib import Path

from llmc.errors import LlmcError, QualityGateError, InputError
from llmc.hook.config import HookConfig, MLFLOW_SECRET, secret
from llmc.hook.jobs import parse_model_uri, run_job
from llmc.hook.queue import JobQueue
from llmc.hook.runners import dispatch, runner_for
from llmc.hook.server import _summary, enqueue_for
from llmc.publish.mlflow import _call, client


def status_rows(config: HookConfig) -> tuple[list[dict], bool]:
    """(every job, summarized; whether a worker holds the state folder now)."""
    queue = JobQueue(config.state, config.max_queued)
    return _summary(queue.jobs()), queue.worker_alive()


def render_status(jobs: list[dict], worker: bool) -> str:
    counts = {s: sum(j["state"] == s for j in jobs) for s in ("queued", "running", "done", "failed")}
    lines = [f"worker: {'running' if worker else 'not running'}; "
             + ", ".join(f"{n} {s}" for s, n in counts.items())]
    for j in jobs:
        regs = ", ".join(f"{r['name']} v{r['version']}" for r in j.get("registrations") or [])
        lines.append(f"{j['id'][:12]}  {j['state']:<7}  {j['source']}  {Path(j['recipe_path']).name}"
                     + (f"  [{j['scheduler']} {j['scheduler_id']} {j.get('scheduler_state', '?')}]"
                        if j.get("scheduler_id") else "")
                     + (f"  -> {regs}" if regs else "") + (f"  ({j['error'][:160]})" if j.get("error") else ""))
    return "\n".join(lines)


def _source_tags(config: HookConfig, source: dict) -> dict:
    """The MLflow version's tags (routes may select by tag); {} when the registry cannot say."""
    if source["kind"] != "mlflow" or not any(r.tag for r in config.routes):
        return {}

    c = client(config.tracking_uri())
    return dict(_call("read the model version", c.get_model_version, source["name"], source["version"]).tags or {})


def run_now(config: HookConfig, uri: str, recipes: list[Path] | None, config_path: Path | None = None) -> list[dict]:
    """Queue `uri` for its routes (or `recipes`) and run those jobs here unless a serving hook holds the worker lock
    (then they wait for it); with a cluster runner, submit them to it. Jobs already done are not run again; failed
    ones are retried."""
    queue = JobQueue(config.state, config.max_queued)
    source = parse_model_uri(uri)
    source["tags"] = _source_tags(config, source)
    queued = enqueue_for(config, queue, source, f"cli:{uri}", recipes)
    if not queued:
        raise LlmcError(f"no route in the hook config builds {source['name']}",
                        fix="add a route for it, or pass --recipe")
    if queue.worker_alive():
        return [queue.get(j["id"]) for j, _ in queued]
    runner = runner_for(config, config_path)
    out = []
    with queue.worker_lock():
        queue.recover()
        for job, _ in queued:
            taken = queue.take(job["id"])
            if taken is None:
                out.append(queue.get(job["id"]))
            else:
                out.append(run_job(taken, config, queue) if runner is None else dispatch(runner, taken, queue))
    return out


def execute(config: HookConfig, jid: str) -> dict:
    """Build job `jid` in this process (a cluster node sharing the hook's state folder); a job already done is left
    as it is."""
    queue = JobQueue(config.state, config.max_queued)
    job = queue.get(jid)
    if job is None:
        raise InputError(f"no job {jid} in {queue.dir}", fix="pass an id `llmc hook status` lists")
    if job["state"] == "done":
        return job
    if job["state"] != "running":
        job = queue.update(jid, state="running")
    return run_job(job, config, queue)


def raise_for_jobs(jobs: list[dict]) -> None:
    failed = [j for j in jobs if j["state"] == "failed"]
    if not failed:
        return
    text = "; ".join(f"job {j['id'][:12]}: {j.get('error')}" for j in failed)
    if all(str(j.get("error", "")).startswith("gate failed") for j in failed):
        raise QualityGateError(text)
    raise LlmcError(text, fix="see `llmc hook status` and the log above")


def register_webhook(config: HookConfig, url: str, name: str = "llmc-hook") -> str:
    """Create the MLflow webhook that sends `model_version.created` to `url`, signed with the secret from
    LLMC_HOOK_MLFLOW_SECRET(_FILE); returns its id."""
    value = secret(MLFLOW_SECRET)
    if value is None:
        raise InputError(f"{MLFLOW_SECRET} is not set: a webhook without a secret cannot be verified",
                         fix=f"set {MLFLOW_SECRET} or {MLFLOW_SECRET}_FILE to the secret `llmc hook serve` will use")
    c = client(config.tracking_uri())
    hook = _call("create the webhook", c.create_webhook, name, url, events=["model_version.created"], secret=value,
                 description="llmc registry hook: build, gate and register deployment variants")
    return hook.webhook_id
