"""The hook's cluster runners without a cluster: the config's `runner`, the plan -> sbatch request (pure), the Slurm
runner against fake `sbatch`/`squeue`/`sacct`/`scancel` on PATH that record their argv (exact arguments asserted),
idempotence across a restart, and the Kubernetes Job manifest validated by the official client's models.
A real one-node Slurm cluster: tests/integration/test_hook_slurm.py (-m slow)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from llmc.errors import LlmcError, RecipeError, ResourceError
from llmc.hook.commands import render_status
from llmc.hook.config import KubernetesSection, Partition, load_hook_config
from llmc.hook.jobs import COMPLETE, mlflow_source, new_job
from llmc.hook.queue import JobQueue
from llmc.hook.runners import (Needs, SlurmRunner, dispatch, follow, job_manifest, plan_needs, sbatch_request,
                               slurm_time)
from llmc.hook.server import _summary
from llmc.recipe.load import load_recipe
from tests.unit.hook_helpers import tiny_recipe

GPU = Partition(name="gpu", gpus_per_node=8, gpu_memory_gb=80, memory_gb=1000, max_time_h=48, max_nodes=4)
CPU = Partition(name="cpu", memory_gb=256, max_time_h=168)


def _config(tmp: Path, **extra) -> Path:
    recipe = tiny_recipe(tmp / "recipe.yaml", tmp / "registry")
    path = tmp / "hook.yaml"
    path.write_text(yaml.safe_dump({"state_dir": str(tmp / "state"), "cache_dir": str(tmp / "cache"),
                                    "routes": [{"models": "tiny*", "recipes": [str(recipe)]}], **extra}))
    return path


# --------------------------------------------------------------------------- the config


def test_the_runner_is_local_unless_the_config_names_another(tmp_path: Path) -> None:
    assert load_hook_config(_config(tmp_path)).runner == "local"
    config = load_hook_config(_config(tmp_path, runner="slurm", slurm={"partitions": [GPU.model_dump()]}))
    assert config.runner == "slurm" and config.slurm.partitions == (GPU,)


def test_a_bad_runner_is_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as e:
        load_hook_config(_config(tmp_path, runner="pbs"))
    assert "runner" in e.value.message and "'local', 'slurm' or 'kubernetes'" in e.value.message
    assert e.value.fix == "set runner: to local, slurm or kubernetes"
    with pytest.raises(RecipeError, match="runner slurm needs slurm.partitions"):
        load_hook_config(_config(tmp_path, runner="slurm"))
    with pytest.raises(RecipeError, match="runner kubernetes needs kubernetes.image"):
        load_hook_config(_config(tmp_path, runner="kubernetes"))
    with pytest.raises(RecipeError, match="slurm.ranks above 1"):
        load_hook_config(_config(tmp_path, runner="slurm", slurm={"partitions": [CPU.model_dump()], "ranks": 2}))


# --------------------------------------------------------------------------- plan -> sbatch (pure)


def test_slurm_time_rounds_up_to_the_minute() -> None:
    assert slurm_time(1) == "0-00:01:00"
    assert slurm_time(3601) == "0-01:01:00"
    assert slurm_time(90_000) == "1-01:00:00"


def test_a_gpu_build_gets_one_gpu_per_rank_with_margins_on_memory_and_time() -> None:
    needs = Needs(host_gb=20, gpu_gb=30, disk_gb=200, seconds=10 * 3600, gpus_per_rank=1)
    request = sbatch_request(needs, [CPU, GPU], time_margin=1.5, memory_margin=1.25)
    assert request.partition == "gpu"  # cpu has no GPUs: skipped
    assert request.args == ("--partition=gpu", "--nodes=1", "--ntasks-per-node=1", f"--mem={25 * 1024}M",
                            "--time=0-15:10:00", "--gres=gpu:1")  # 10 h x 1.5 + 10 min outside the stages


def test_ranks_fill_nodes_of_the_partition_and_split_across_nodes() -> None:
    eight = sbatch_request(Needs(10, None, 1, 3600, 1, ranks=8), [GPU])
    assert (eight.nodes, eight.ranks_per_node) == (1, 8)
    assert "--gres=gpu:8" in eight.args and f"--mem={100 * 1024}M" in eight.args  # 10 GB x 8 ranks x 1.25
    sixteen = sbatch_request(Needs(10, None, 1, 3600, 1, ranks=16), [GPU])
    assert (sixteen.nodes, sixteen.ranks_per_node) == (2, 8) and "--nodes=2" in sixteen.args


def test_a_cpu_build_asks_for_no_gpu_and_node_local_disk_when_the_partition_has_it() -> None:
    scratch = Partition(name="scratch", memory_gb=64, max_time_h=4, tmp_disk_gb=100)
    request = sbatch_request(Needs(2, None, 3.5, 60, 0), [scratch])
    assert request.args == ("--partition=scratch", "--nodes=1", "--ntasks-per-node=1", "--mem=2560M",
                            "--time=0-00:12:00", "--tmp=3584M")  # 60 s x 1.5 + 600 s, up to the minute


def test_no_partition_that_fits_is_refused_with_each_ones_reason() -> None:
    small = Partition(name="small", gpus_per_node=1, gpu_memory_gb=24, memory_gb=64, max_time_h=2)
    with pytest.raises(ResourceError) as e:
        sbatch_request(Needs(host_gb=100, gpu_gb=40, disk_gb=1, seconds=3 * 3600, gpus_per_rank=1),
                       [CPU, small, GPU.model_copy(update={"max_time_h": 4})])
    assert e.value.message == (
        "no Slurm partition fits the build: cpu: it has no GPUs; small: 125.0 GB of host memory per node needed, "
        "it gives 64 GB; gpu: 4.7 h needed (the plan's slowest estimate x 1.5 + 10 min outside its stages), its "
        "MaxTime is 4 h")
    assert "slurm.partitions" in e.value.fix
    with pytest.raises(ResourceError, match="40.0 GB per GPU needed, its GPUs have 24 GB"):
        sbatch_request(Needs(1, 40, 1, 60, 1), [small])
    with pytest.raises(ResourceError, match="16 ranks need 2 nodes, it allows 1"):
        sbatch_request(Needs(1, None, 1, 60, 1, ranks=16), [GPU.model_copy(update={"max_nodes": 1})])


def test_a_build_the_plan_times_at_zero_still_gets_the_time_outside_its_stages() -> None:
    """The plan times the stages only; the job also starts Python, probes a fresh node, uploads and registers (~1 min
    for the tiny model on a loaded 2-core host): a 0 s plan asked for 1 min and Slurm ended the job TIMEOUT."""
    nothing = Needs(host_gb=1, gpu_gb=None, disk_gb=0, seconds=0, gpus_per_rank=0)
    assert "--time=0-00:10:00" in sbatch_request(nothing, [CPU]).args
    assert "--time=0-00:02:00" in sbatch_request(nothing, [CPU], time_overhead_s=90).args
    short = Partition(name="short", memory_gb=8, max_time_h=0.1)  # MaxTime 6 min: the overhead alone exceeds it
    with pytest.raises(ResourceError, match=r"short: 0\.2 h needed \(the plan's slowest estimate x 1\.5 \+ 10 min "
                                            r"outside its stages\), its MaxTime is 0\.1 h"):
        sbatch_request(nothing, [short])
    k8s = KubernetesSection(image="x", state_claim="s", time_overhead_s=300)
    assert job_manifest({"id": "ab" * 32}, nothing, k8s)["spec"]["activeDeadlineSeconds"] == 300


@pytest.fixture
def queued(tmp_path: Path, tiny_model_session: Path):
    """(config path, queue, job): one job for models:/tiny/3 queued and taken, its source already fetched."""
    path = _config(tmp_path, runner="slurm", slurm={"partitions": [CPU.model_dump(), GPU.model_dump()]})
    config = load_hook_config(path)
    fetched = config.state / "sources" / "mlflow" / "tiny" / "3"
    shutil.copytree(tiny_model_session, fetched)
    (fetched / COMPLETE).write_text("models:/tiny/3")
    queue = JobQueue(config.state)
    job, _ = queue.enqueue(new_job(load_recipe(tmp_path / "recipe.yaml"), tmp_path / "recipe.yaml",
                                   mlflow_source("tiny", 3)))
    return path, queue, queue.take(job["id"])


def test_the_needs_are_the_plans_rows(queued) -> None:
    path, _, job = queued
    from llmc.planning.plan import make_plan
    from llmc.recipe.schema import Recipe

    config = load_hook_config(path)
    needs = plan_needs(job, config)
    recipe = Recipe.model_validate(job["recipe"])
    folder = config.state / "sources" / "mlflow" / "tiny" / "3"
    rows = make_plan(recipe.model_copy(update={"model": recipe.model.model_copy(update={"source": str(folder)})}),
                     folder, refuse=False).rows
    assert needs.host_gb == pytest.approx(max(r.host_bytes for r in rows) / 1e9, rel=1e-6)
    assert needs.disk_gb == pytest.approx(sum(r.disk_bytes for r in rows) / 1e9, rel=1e-6)
    assert needs.seconds >= sum(r.seconds for r in rows) > 0  # the slowest estimate
    # the recipe's devices are "auto": a node's GPU is asked for; this CPU machine's plan says nothing of GPU memory
    assert needs.gpus_per_rank == 1 and needs.gpu_gb is None


def test_the_rates_the_hook_probes_are_kept_in_its_cache_for_the_nodes(queued, monkeypatch) -> None:
    """A node of the same machine reads the hook's probed rates from the shared cache instead of probing inside its
    allocation (~26 s of a 64 s job on the loaded 2-core host); a process starting afresh reads them too."""
    from llmc.planning import probes

    path, _, job = queued
    config = load_hook_config(path)
    monkeypatch.setattr(probes, "_book", probes.RateBook())  # this process has probed nothing yet
    plan_needs(job, config)
    rates = config.path(config.cache_dir) / probes.RATES_FILE
    assert rates.is_file() and json.loads(rates.read_text())["rates"]
    monkeypatch.setattr(probes, "_book", probes.RateBook())  # a fresh process (the node's `llmc hook execute`)
    plan_needs(job, config)
    assert probes.book().path == rates and probes.book().measured_now == []
    assert "read from the cache" in probes.book().describe() and "probed now" not in probes.book().describe()


def test_the_needs_are_planned_for_the_nodes_machine_when_the_config_names_one(queued) -> None:
    path, _, job = queued
    from llmc.planning import target
    from llmc.planning.plan import make_plan
    from llmc.recipe.schema import Recipe

    config = load_hook_config(path)
    config = config.model_copy(update={"slurm": config.slurm.model_copy(update={"machine": "h100-sxm:8"})})
    needs = plan_needs(job, config)
    recipe = Recipe.model_validate(job["recipe"])
    folder = config.state / "sources" / "mlflow" / "tiny" / "3"
    with target.planning_for(target.load("h100-sxm:8")):
        rows = make_plan(recipe.model_copy(update={"model": recipe.model.model_copy(update={"source": str(folder)})}),
                         folder, refuse=False).rows
    assert any(str(r.device).startswith("cuda") for r in rows)  # planned on the profile's GPU, not on this CPU
    assert needs.gpu_gb == pytest.approx(max(r.gpu_bytes for r in rows) / 1e9, rel=1e-6) and needs.gpu_gb > 0
    assert needs.seconds == pytest.approx(sum((r.seconds_range or (r.seconds, r.seconds))[1] for r in rows))
    bad = config.model_copy(update={"slurm": config.slurm.model_copy(update={"machine": "h200-nope:8"})})
    with pytest.raises(LlmcError, match="h200-nope:8: no such profile or machine file"):
        plan_needs(job, bad)


# --------------------------------------------------------------------------- Slurm against recording fakes

FAKE = """#!/bin/sh
# records its argv (one JSON list a line) and answers as Slurm would
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "{log}/$(basename "$0").argv"
case "$(basename "$0")" in
  sbatch) echo "4242;cluster" ;;
  squeue) cat "{log}/squeue.out" 2>/dev/null || true ;;
  sacct) cat "{log}/sacct.out" 2>/dev/null || true ;;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch) -> Path:
    bin_dir, log = tmp_path / "fake-bin", tmp_path / "fake-log"
    bin_dir.mkdir()
    log.mkdir()
    for name in ("sbatch", "squeue", "sacct", "scancel"):
        exe = bin_dir / name
        exe.write_text(FAKE.format(log=log))
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _argv(log: Path, name: str) -> list[list[str]]:
    path = log / f"{name}.argv"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


NEEDS = Needs(host_gb=2, gpu_gb=None, disk_gb=1, seconds=600, gpus_per_rank=1)


def test_a_job_is_submitted_once_with_the_plans_request_and_followed(queued, fake_slurm: Path) -> None:
    path, queue, job = queued
    config = load_hook_config(path)
    runner = SlurmRunner(config, needs_for=lambda j: NEEDS, config_path=path)
    done = dispatch(runner, job, queue)
    state = config.state
    assert _argv(fake_slurm, "squeue") == [["--noheader", f"--name=llmc-{job['id'][:16]}", "--format=%i"]]
    assert _argv(fake_slurm, "sbatch") == [[
        "--parsable", "--partition=gpu", "--nodes=1", "--ntasks-per-node=1", "--mem=2560M", "--time=0-00:25:00",
        "--gres=gpu:1", f"--job-name=llmc-{job['id'][:16]}", f"--output={state / 'slurm' / '%j.out'}",
        str(state / "slurm" / f"{job['id']}.sh")]]
    script = (state / "slurm" / f"{job['id']}.sh").read_text()
    assert f"exec srun llmc hook execute --config {path} {job['id']}" in script
    assert (done["state"], done["scheduler"], done["scheduler_id"], done["scheduler_state"]) == \
        ("running", "slurm", "4242", "PENDING")
    assert json.loads((queue.dir / f"{job['id']}.json").read_text())["scheduler_id"] == "4242"  # on disk

    # delivered again while it is on the cluster: nothing submitted
    dispatch(runner, queue.get(job["id"]), queue)
    assert len(_argv(fake_slurm, "sbatch")) == 1

    # the hook restarts: the job is followed by its id, not queued again
    assert queue.recover() == [] and queue.get(job["id"])["state"] == "running"
    (fake_slurm / "squeue.out").write_text("RUNNING\n")
    follow(runner, queue)
    assert queue.get(job["id"])["scheduler_state"] == "RUNNING"
    assert _argv(fake_slurm, "squeue")[-1] == ["--noheader", "--states=all", "--jobs=4242", "--format=%T"]
    line = render_status(_summary(queue.jobs()), True).splitlines()[1]
    assert "[slurm 4242 RUNNING]" in line and "running" in line

    # it ends without the node recording a result: failed with the scheduler's state and its log's end
    (fake_slurm / "squeue.out").write_text("")
    (fake_slurm / "sacct.out").write_text("CANCELLED by 0\n")
    (state / "slurm" / "4242.out").write_text("slurmstepd: error: *** JOB 4242 CANCELLED ***\n")
    follow(runner, queue)
    ended = queue.get(job["id"])
    assert _argv(fake_slurm, "sacct")[-1] == ["--noheader", "--parsable2", "-X", "--jobs=4242", "--format=State"]
    assert ended["state"] == "failed" and ended["scheduler_state"] == "CANCELLED"
    assert "the slurm job 4242 ended CANCELLED without a result" in ended["error"] and "JOB 4242" in ended["error"]

    # retried as a local failure is: taken again, submitted anew
    dispatch(runner, queue.take(job["id"]), queue)
    assert len(_argv(fake_slurm, "sbatch")) == 2


def test_a_submission_the_hook_did_not_record_is_found_by_its_name(queued, fake_slurm: Path) -> None:
    path, queue, job = queued
    (fake_slurm / "squeue.out").write_text("977\n")  # sbatch ran, then the hook died before writing the job file
    done = dispatch(SlurmRunner(load_hook_config(path), needs_for=lambda j: NEEDS), job, queue)
    assert done["scheduler_id"] == "977" and _argv(fake_slurm, "sbatch") == []


def test_a_job_no_partition_fits_fails_with_the_reason_and_submits_nothing(queued, fake_slurm: Path) -> None:
    path, queue, job = queued
    huge = Needs(host_gb=5000, gpu_gb=None, disk_gb=1, seconds=60, gpus_per_rank=0)
    done = dispatch(SlurmRunner(load_hook_config(path), needs_for=lambda j: huge), job, queue)
    assert done["state"] == "failed" and "no Slurm partition fits the build: cpu: 6250.0 GB" in done["error"]
    assert _argv(fake_slurm, "sbatch") == [] and "scheduler_id" not in done


def test_the_slurm_request_comes_from_the_plan_by_default(queued, fake_slurm: Path) -> None:
    path, queue, job = queued
    dispatch(SlurmRunner(load_hook_config(path), config_path=path), job, queue)
    (argv,) = _argv(fake_slurm, "sbatch")
    assert "--partition=gpu" in argv and "--gres=gpu:1" in argv  # "auto" devices: a GPU node


# --------------------------------------------------------------------------- Kubernetes


def test_the_job_manifest_is_a_valid_v1_job(tmp_path: Path) -> None:
    client = pytest.importorskip("kubernetes.client")
    k8s = KubernetesSection(image="ghcr.io/example/llmc:1", state_claim="llmc-state", cache_claim="llmc-cache")
    job = {"id": "ab" * 32}
    manifest = job_manifest(job, Needs(host_gb=12, gpu_gb=None, disk_gb=200, seconds=3600, gpus_per_rank=1), k8s)

    class Response:  # what ApiClient.deserialize reads: the API server's JSON
        data = json.dumps(manifest)

    api = client.ApiClient()
    v1 = api.deserialize(Response(), "V1Job")  # the client's models check required fields and enum values
    assert isinstance(v1, client.V1Job)
    # deserialize drops keys the schema does not know: the round trip is equal only if every key is a real field
    assert api.sanitize_for_serialization(v1) == manifest
    container = v1.spec.template.spec.containers[0]
    assert container.resources.limits == {"memory": f"{15 * 1024}Mi", "nvidia.com/gpu": "1"}
    assert container.command == ["llmc", "hook", "execute", "--config", "/llmc/state/hook.yaml", job["id"]]
    assert v1.spec.active_deadline_seconds == 5400 + 600 and v1.spec.backoff_limit == 0  # 1 h x 1.5 + the overhead
    assert [v.persistent_volume_claim.claim_name for v in v1.spec.template.spec.volumes] == \
        ["llmc-state", "llmc-cache"]

    broken = dict(manifest, spec={**manifest["spec"], "template": {"spec": {"containers": [{"image": "x"}]}}})

    class Broken:
        data = json.dumps(broken)

    with pytest.raises(ValueError, match="name"):  # a container without its required name
        api.deserialize(Broken(), "V1Job")


class _Status:
    def __init__(self, **counts):
        self.status = type("S", (), {"succeeded": None, "failed": None, "active": None, **counts})()


class _FakeBatch:
    """BatchV1Api's three calls the runner makes, recording their arguments."""

    def __init__(self, conflict: bool = False):
        self.calls, self.conflict = [], conflict
        self.status = _Status(active=1)

    def create_namespaced_job(self, namespace, body):
        from kubernetes.client.exceptions import ApiException

        self.calls.append(("create", namespace, body["metadata"]["name"]))
        if self.conflict:
            raise ApiException(status=409, reason="Conflict")

    def read_namespaced_job_status(self, name, namespace):
        self.calls.append(("read", namespace, name))
        return self.status

    def delete_namespaced_job(self, name, namespace, propagation_policy):
        self.calls.append(("delete", namespace, name, propagation_policy))


class _FakeCore:
    def list_namespaced_pod(self, namespace, label_selector):
        pod = type("Pod", (), {"metadata": type("M", (), {"name": "llmc-x-abcde"})()})()
        assert label_selector.startswith("job-name=llmc-")
        return type("PodList", (), {"items": [pod]})()

    def read_namespaced_pod_log(self, name, namespace, _preload_content=True):
        assert not _preload_content  # the raw body (see test_hook_k8s_schema: the client's own answer)
        return type("Response", (), {"data": f"{name}: OOMKilled".encode()})()


def test_the_kubernetes_runner_submits_once_follows_and_cancels(queued) -> None:
    pytest.importorskip("kubernetes.client")
    from llmc.hook.runners import KubernetesRunner

    path, queue, job = queued
    config = load_hook_config(path).model_copy(update={"kubernetes": KubernetesSection(
        namespace="ml", image="llmc:1", state_claim="state")})
    batch = _FakeBatch()
    runner = KubernetesRunner(config, needs_for=lambda j: NEEDS, api=(batch, _FakeCore()))
    name = f"llmc-{job['id'][:16]}"
    assert dispatch(runner, job, queue)["scheduler_id"] == name
    dispatch(runner, queue.get(job["id"]), queue)  # on the cluster already: not created again
    assert batch.calls == [("create", "ml", name)]
    follow(runner, queue)
    assert queue.get(job["id"])["scheduler_state"] == "RUNNING"
    batch.status = _Status(failed=1)
    follow(runner, queue)
    ended = queue.get(job["id"])
    assert ended["state"] == "failed" and "the kubernetes job" in ended["error"] and "ended FAILED" in ended["error"]
    assert ended["error"].endswith("its log ends: llmc-x-abcde: OOMKilled")
    runner.cancel(name)
    assert batch.calls[-1] == ("delete", "ml", name, "Background")
    # a Job of that name exists (created before a crash): adopted, not an error
    assert KubernetesRunner(config, needs_for=lambda j: NEEDS, api=(_FakeBatch(conflict=True), None)).submit(job) \
        == name


@pytest.mark.heavy
def test_execute_builds_a_queued_job_here_and_leaves_a_done_one(tmp_path: Path, tiny_model_session: Path) -> None:
    """What `srun llmc hook execute` does on a node: the local build, recorded in the shared job file."""
    from llmc.hook.commands import execute
    from llmc.hook.jobs import hf_source

    path = _config(tmp_path)
    config = load_hook_config(path)
    source = hf_source("org/tiny", "main")  # a Hub source: no registry server needed
    fetched = config.state / "sources" / "hf" / "org" / "tiny" / "main"
    shutil.copytree(tiny_model_session, fetched)
    (fetched / COMPLETE).write_text(source["uri"])
    queue = JobQueue(config.state)
    job, _ = queue.enqueue(new_job(load_recipe(tmp_path / "recipe.yaml"), tmp_path / "recipe.yaml", source))
    done = execute(config, job["id"])
    assert done["state"] == "done", done.get("error")
    assert Path(done["published"]).is_dir() and queue.get(job["id"])["state"] == "done"
    assert execute(config, job["id"])["updated"] == done["updated"]  # done: not built again
