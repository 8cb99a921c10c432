"""Where a hook job runs: here (`local`, the worker thread builds it), or on a cluster's scheduler (`slurm`,
`kubernetes`), which runs `llmc hook execute <job>` on a node that shares the hook's state folder.

Every runner answers the same four calls: submit(job) -> the scheduler's id, state(id), logs(id), cancel(id).
What a cluster job asks for comes from the recipe's plan (llmc.planning): `needs_from_plan` reduces it to host
memory, GPU memory, disk and time, and `sbatch_request` / `job_manifest` turn that into the scheduler's request —
both pure functions, so the request is tested without a cluster.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmc.errors import LlmcError, ResourceError
from llmc.hook.config import TIME_OVERHEAD_S, HookConfig, KubernetesSection, Partition

# Slurm's terminal job states (squeue/sacct %T); anything else is still pending or running
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


class Runner(Protocol):
    name: str

    def submit(self, job: dict) -> str: ...

    def state(self, scheduler_id: str) -> str: ...

    def logs(self, scheduler_id: str) -> str: ...

    def cancel(self, scheduler_id: str) -> None: ...


@dataclass(frozen=True)
class Needs:
    """What one build asks of the machine that runs it, from its plan (one process: a rank)."""
    host_gb: float  # the largest stage's host memory
    gpu_gb: float | None  # per GPU; None when the plan was made on a CPU (GPU memory not estimated)
    disk_gb: float  # new bytes in the cache, all stages
    seconds: float  # the plan's slowest estimate, all stages
    gpus_per_rank: int  # 0: the recipe calibrates and evaluates on the CPU
    ranks: int = 1


def needs_from_plan(plan, ranks: int = 1) -> Needs:
    """The plan's rows (llmc.planning.plan.Plan.rows) as one build's needs."""
    rows = plan.rows
    if not rows:
        raise ResourceError("the plan has no stage estimates (it was made without the model's config)",
                            fix="give the recipe a model source or model.config the hook can read")
    recipe = plan.recipe
    on_gpu = recipe.calibration.device != "cpu" or recipe.eval.device != "cpu"
    planned_on_gpu = any(str(r.device).startswith("cuda") for r in rows)
    return Needs(host_gb=max(r.host_bytes for r in rows) / 1e9,
                 gpu_gb=max(r.gpu_bytes for r in rows) / 1e9 if planned_on_gpu else None,
                 disk_gb=sum(r.disk_bytes for r in rows) / 1e9,
                 seconds=sum((r.seconds_range or (r.seconds, r.seconds))[1] for r in rows),
                 gpus_per_rank=1 if on_gpu else 0, ranks=ranks)


@dataclass(frozen=True)
class SbatchRequest:
    partition: str
    args: tuple[str, ...]
    ranks_per_node: int
    nodes: int


def slurm_time(seconds: float) -> str:
    """`--time` as D-HH:MM:SS, rounded up to the minute."""
    minutes = max(1, math.ceil(seconds / 60))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def _fit(needs: Needs, p: Partition, time_margin: float, memory_margin: float,
         time_overhead_s: float) -> SbatchRequest | str:
    """The request on partition `p`, or why it does not fit."""
    gpus = needs.ranks * needs.gpus_per_rank
    if gpus and p.gpus_per_node == 0:
        return "it has no GPUs"
    per_node = min(needs.ranks, p.gpus_per_node // needs.gpus_per_rank) if gpus else needs.ranks
    nodes = math.ceil(needs.ranks / per_node)
    if needs.ranks % per_node:
        return f"{needs.ranks} ranks do not split evenly over nodes of {per_node}"
    if nodes > p.max_nodes:
        return f"{needs.ranks} ranks need {nodes} nodes, it allows {p.max_nodes}"
    mem_gb = needs.host_gb * per_node * memory_margin
    if mem_gb > p.memory_gb:
        return f"{mem_gb:.1f} GB of host memory per node needed, it gives {p.memory_gb:g} GB"
    if gpus and needs.gpu_gb is not None and p.gpu_memory_gb is not None and needs.gpu_gb > p.gpu_memory_gb:
        return f"{needs.gpu_gb:.1f} GB per GPU needed, its GPUs have {p.gpu_memory_gb:g} GB"
    seconds = needs.seconds * time_margin + time_overhead_s
    if seconds > p.max_time_h * 3600:
        return f"{seconds / 3600:.1f} h needed (the plan's slowest estimate x {time_margin:g} + " \
               f"{time_overhead_s / 60:g} min outside its stages), its MaxTime is {p.max_time_h:g} h"
    if p.tmp_disk_gb is not None and needs.disk_gb > p.tmp_disk_gb:
        return f"{needs.disk_gb:.1f} GB of disk needed, its nodes have {p.tmp_disk_gb:g} GB"
    args = [f"--partition={p.name}", f"--nodes={nodes}", "--ntasks-per-node=1",  # one launcher per node
            f"--mem={math.ceil(mem_gb * 1024)}M", f"--time={slurm_time(seconds)}"]
    if gpus:
        args.append(f"--gres=gpu:{per_node * needs.gpus_per_rank}")
    if p.tmp_disk_gb is not None:
        args.append(f"--tmp={math.ceil(needs.disk_gb * 1024)}M")
    return SbatchRequest(p.name, tuple(args), per_node, nodes)


def sbatch_request(needs: Needs, partitions: Sequence[Partition], time_margin: float = 1.5,
                   memory_margin: float = 1.25, time_overhead_s: float = TIME_OVERHEAD_S) -> SbatchRequest:
    """The `sbatch` arguments on the first partition that fits; ResourceError naming each one's reason if none.
    `--time` is the plan's slowest estimate x `time_margin` + `time_overhead_s` (the job's start, probes and
    registration, which no stage row times)."""
    reasons = []
    for p in partitions:
        fit = _fit(needs, p, time_margin, memory_margin, time_overhead_s)
        if isinstance(fit, SbatchRequest):
            return fit
        reasons.append(f"{p.name}: {fit}")
    raise ResourceError("no Slurm partition fits the build: " + "; ".join(reasons),
                        fix="add a partition that fits to slurm.partitions, or lower what the recipe asks "
                            "(calibration.samples, eval.windows)")


def plan_needs(job: dict, config: HookConfig, ranks: int = 1) -> Needs:
    """Plan the job's recipe on its fetched source (headers only, no weights loaded), for the runner's `machine` when
    the config names one, and reduce it to its needs."""
    from llmc.hook.jobs import cache_store, fetch_source  # lazy: jobs imports the build stack
    from llmc.planning import probes, target  # lazy: as make_plan
    from llmc.planning.plan import make_plan  # lazy: the planner imports torch; `llmc hook serve` never needs it
    from llmc.recipe.schema import Recipe  # lazy: with the planner, only when a job is sized

    # the nodes' machine (`llmc plan --machine`), not the hook host's: a CPU-only hook host would plan CPU times
    spec = (config.slurm if config.runner == "slurm" else config.kubernetes).machine
    machine = target.load(spec) if spec else None
    # the rates this host probes are kept in the cache the nodes share: a node of the same machine (fingerprint) reads
    # them instead of probing again inside its allocation, and a restarted hook does not probe again either
    probes.use_cache(cache_store(config).root)
    folder = fetch_source(job["source"], config)
    recorded = Recipe.model_validate(job["recipe"])
    recipe = recorded.model_copy(update={"model": recorded.model.model_copy(update={"source": str(folder)})})
    with target.planning_for(machine):
        return needs_from_plan(make_plan(recipe, folder, refuse=False), ranks)


def scheduler_name(job: dict) -> str:
    """The name a job carries on the scheduler: found again by it after a crash between submitting and recording."""
    return f"llmc-{job['id'][:16]}"


class SlurmRunner:
    name = "slurm"

    def __init__(self, config: HookConfig, needs_for: Callable[[dict], Needs] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run, config_path: Path | None = None):
        self.config, self.run = config, run
        self.needs_for = needs_for or (lambda job: plan_needs(job, config, config.slurm.ranks))
        self.config_path = config_path
        self.dir = config.state / "slurm"

    def _call(self, argv: list[str]) -> str:
        try:
            done = self.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except FileNotFoundError:
            raise LlmcError(f"{argv[0]} is not on PATH", fix="run the hook on a Slurm submit host") from None
        except subprocess.TimeoutExpired:
            raise LlmcError(f"{argv[0]} did not answer within 60 s", fix="check slurmctld") from None
        if done.returncode != 0:
            raise LlmcError(f"{shlex.join(argv[:2])} exited {done.returncode}: {done.stderr.strip()[:500]}",
                            fix="see the Slurm controller's answer above")
        return done.stdout

    def find(self, job: dict) -> str | None:
        """The id of a pending or running Slurm job carrying this job's name, if any."""
        out = self._call(["squeue", "--noheader", f"--name={scheduler_name(job)}", "--format=%i"]).split()
        return out[0] if out else None

    def script(self, job: dict) -> str:
        config = self.config_path or self.config.base / "hook.yaml"
        return ("#!/bin/sh\n# written by llmc hook serve: build one job on this node\n"
                f"exec srun {shlex.quote(self.config.slurm.llmc)} hook execute "
                f"--config {shlex.quote(str(config))} {job['id']}\n")

    def submit(self, job: dict) -> str:
        existing = self.find(job)
        if existing:
            return existing  # submitted before the hook could record it: followed, not submitted again
        slurm = self.config.slurm
        request = sbatch_request(self.needs_for(job), slurm.partitions, slurm.time_margin, slurm.memory_margin,
                                 slurm.time_overhead_s)
        self.dir.mkdir(parents=True, exist_ok=True)
        script = self.dir / f"{job['id']}.sh"
        script.write_text(self.script(job))
        out = self._call(["sbatch", "--parsable", *request.args, f"--job-name={scheduler_name(job)}",
                          f"--output={self.dir / '%j.out'}", str(script)])
        sid = out.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"
        if not re.fullmatch(r"[0-9]+(_[0-9]+)?", sid):
            raise LlmcError(f"sbatch answered {out.strip()[:200]!r}, not a job id", fix="check the Slurm version")
        return sid

    def state(self, scheduler_id: str) -> str:
        # --states=all: a finished job stays listed (COMPLETED, FAILED...) for the controller's MinJobAge
        out = self._call(["squeue", "--noheader", "--states=all", f"--jobs={scheduler_id}", "--format=%T"]).split()
        if out:
            return out[0]
        # gone from squeue: finished; sacct remembers how (the first line is the allocation, -X)
        lines = self._call(["sacct", "--noheader", "--parsable2", "-X", f"--jobs={scheduler_id}",
                            "--format=State"]).split("\n")
        return lines[0].split()[0] if lines and lines[0].strip() else "UNKNOWN"

    def logs(self, scheduler_id: str) -> str:
        path = self.dir / f"{scheduler_id}.out"
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""

    def cancel(self, scheduler_id: str) -> None:
        self._call(["scancel", scheduler_id])


def job_manifest(job: dict, needs: Needs, k8s: KubernetesSection, state_dir: str = "/llmc/state",
                 cache_dir: str = "/llmc/cache") -> dict:
    """The Kubernetes batch/v1 Job that runs `llmc hook execute` for `job`, sized from its needs."""
    memory = f"{math.ceil(needs.host_gb * k8s.memory_margin * 1024)}Mi"
    resources = {"requests": {"memory": memory, "ephemeral-storage": "1Gi"}, "limits": {"memory": memory}}
    if needs.gpus_per_rank:
        resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = str(needs.gpus_per_rank)
    name = scheduler_name(job)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": k8s.namespace,
                     "labels": {"app.kubernetes.io/name": "llmc-hook", "llmc.job": job["id"][:63]}},
        "spec": {
            "backoffLimit": 0,  # a failed build is retried by the hook, as the local runner's are
            "activeDeadlineSeconds": max(60, math.ceil(needs.seconds * k8s.time_margin + k8s.time_overhead_s)),
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "llmc-hook"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{
                        "name": "build", "image": k8s.image,
                        "command": ["llmc", "hook", "execute", "--config", f"{state_dir}/hook.yaml", job["id"]],
                        "env": [{"name": "LLMC_CACHE", "value": cache_dir}],
                        "resources": resources,
                        "volumeMounts": [{"name": "state", "mountPath": state_dir}]
                        + ([{"name": "cache", "mountPath": cache_dir}] if k8s.cache_claim else []),
                    }],
                    "volumes": [{"name": "state", "persistentVolumeClaim": {"claimName": k8s.state_claim}}]
                    + ([{"name": "cache", "persistentVolumeClaim": {"claimName": k8s.cache_claim}}]
                       if k8s.cache_claim else []),
                },
            },
        },
    }


class KubernetesRunner:
    """Jobs through the official client (`pip install kubernetes`; in-cluster or ~/.kube/config credentials)."""
    name = "kubernetes"

    def __init__(self, config: HookConfig, needs_for: Callable[[dict], Needs] | None = None, api=None):
        self.config, self.k8s = config, config.kubernetes
        self.needs_for = needs_for or (lambda job: plan_needs(job, config))
        self._api = api

    def api(self):
        if self._api is None:
            try:
                from kubernetes import client, config as kube_config  # lazy: optional (llmc[cluster]), this runner's
            except ImportError:
                raise LlmcError("runner kubernetes needs the kubernetes client",
                                fix="pip install 'llmc[cluster]'") from None
            try:
                kube_config.load_incluster_config()
            except kube_config.ConfigException:
                kube_config.load_kube_config()
            self._api = (client.BatchV1Api(), client.CoreV1Api())
        return self._api

    def submit(self, job: dict) -> str:
        from kubernetes.client.exceptions import ApiException  # lazy: optional (llmc[cluster]), this runner's

        batch, _ = self.api()
        manifest = job_manifest(job, self.needs_for(job), self.k8s)
        try:
            batch.create_namespaced_job(self.k8s.namespace, manifest)
        except ApiException as e:
            if e.status != 409:  # 409: a Job of that name exists: submitted before, followed
                raise LlmcError(f"the Kubernetes API refused the Job: {e.status} {e.reason}",
                                fix="see the API server's answer") from None
        return manifest["metadata"]["name"]

    def state(self, scheduler_id: str) -> str:
        batch, _ = self.api()
        status = batch.read_namespaced_job_status(scheduler_id, self.k8s.namespace).status
        if status.succeeded:
            return "COMPLETED"
        if status.failed:
            return "FAILED"
        return "RUNNING" if status.active else "PENDING"

    def logs(self, scheduler_id: str) -> str:
        _, core = self.api()
        pods = core.list_namespaced_pod(self.k8s.namespace, label_selector=f"job-name={scheduler_id}").items
        # the raw body: client 36's deserializer returns a log as the repr of its bytes ("b'...'")
        return "\n".join(core.read_namespaced_pod_log(p.metadata.name, self.k8s.namespace, _preload_content=False)
                         .data.decode(errors="replace") for p in pods)

    def cancel(self, scheduler_id: str) -> None:
        batch, _ = self.api()
        batch.delete_namespaced_job(scheduler_id, self.k8s.namespace, propagation_policy="Background")


def runner_for(config: HookConfig, config_path: Path | None = None) -> Runner | None:
    """The cluster runner the config names; None for `local` (the worker builds in its own process, as always)."""
    if config.runner == "slurm":
        return SlurmRunner(config, config_path=config_path)
    if config.runner == "kubernetes":
        return KubernetesRunner(config)
    return None


def dispatch(runner: Runner, job: dict, queue) -> dict:
    """Submit a job taken from the queue (state running) unless the scheduler already has it; record the scheduler's
    id in the job file (written atomically). A refusal (no partition fits) fails the job with the reason."""
    if job.get("scheduler_id") and job.get("scheduler_state") not in TERMINAL:
        return job  # queued or running on the cluster: never submitted twice
    try:
        sid = runner.submit(job)
    except LlmcError as e:
        return queue.update(job["id"], state="failed", error=f"{e.kind}: {e.message}"[:2000])
    except Exception as e:  # noqa: BLE001 - one job's crash must not stop the worker (as run_job)
        return queue.update(job["id"], state="failed", error=f"internal error: {type(e).__name__}: {e}"[:2000])
    return queue.update(job["id"], scheduler=runner.name, scheduler_id=sid, scheduler_state="PENDING")


def follow(runner: Runner, queue) -> None:
    """Ask the scheduler about every job it holds; a job it ended without the node recording a result is failed
    (and retried as a local failure is: `llmc hook run`)."""
    for job in queue.jobs():
        sid = job.get("scheduler_id")
        if not sid or job.get("scheduler_state") in TERMINAL:
            continue
        try:
            now = runner.state(sid)
        except LlmcError:
            continue  # the controller is unreachable now: asked again next time
        if now == job.get("scheduler_state"):
            continue
        fields = {"scheduler_state": now}
        current = queue.get(job["id"])
        if now in TERMINAL and current["state"] == "running":
            try:
                tail = runner.logs(sid)[-500:]
            except Exception:  # noqa: BLE001 - the log is a courtesy; the job's end is recorded without it
                tail = ""
            fields.update(state="failed", error=f"the {runner.name} job {sid} ended {now} without a result"
                          + (f"; its log ends: {tail}" if tail else ""))
        queue.update(job["id"], **fields)
