"""The hook's Slurm runner against a real one-node Slurm cluster on loopback (Debian's slurmctld, slurmd and munge,
started here with their config, key and state in a temporary folder, stopped at the end):
- a job queued for a tiny model is planned, submitted with `sbatch`, run by `srun llmc hook execute` on the node (a
  real build of the tiny model) and followed with `squeue` until it is done; dispatching it again submits nothing;
- the whole path: a real MLflow server's webhook -> `llmc hook serve` -> one `sbatch` job that builds the tiny model
  and registers it in MLflow; the same version delivered again submits nothing; the hook SIGKILLed mid-job and
  restarted follows the job by its id, and the variant is registered once.

Needs root and the packages (`scripts/setup.sh` installs them where apt can); skipped, saying which is missing,
without them. The whole path is in the default run (heavy: 148 s and 158 s with its setup, at load ~10-13 on the
shared 2-core AMD EPYC host, `pytest -m "not slow" tests/integration/test_hook_slurm.py`); the first test, whose
steps it covers, stays slow (75 s at load ~13).
"""

from __future__ import annotations

import os
import shutil
import socket as socket_module
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmc.hook.config import load_hook_config
from llmc.hook.jobs import COMPLETE, hf_source, new_job
from llmc.hook.queue import JobQueue
from llmc.hook.runners import TERMINAL, SlurmRunner, dispatch, follow
from llmc.recipe.load import load_recipe
from tests.unit.hook_helpers import REPO, free_port, tiny_recipe


DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "srun")


def _missing() -> str | None:
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install slurmctld slurmd munge, or scripts/setup.sh as root)"
    if os.geteuid() != 0:
        return "a one-node Slurm cluster started by the test needs root (slurmd launches jobs as their user)"
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _wait(predicate, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}" for p in logs if p.is_file())
            raise AssertionError(f"{what} within {timeout} s\n{tails}")
        time.sleep(0.5)


@pytest.fixture
def slurm_cluster(tmp_path: Path, monkeypatch):
    """A one-node cluster (node `llmcnode`, partition `debug`, 2 CPUs) on 127.0.0.1; SLURM_CONF points at it."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "slurm"
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, mode=0o700)
    (root / "munge").chmod(0o711)  # munged: its socket's folder must be searchable by every client
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket = root / "munge" / "munge.sock"
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=llmctest
SlurmctldHost={socket_module.gethostname()}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
SlurmdLogFile={root / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
NodeName=llmcnode NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=llmcnode Default=YES MaxTime=60 State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    monkeypatch.setenv("SLURM_CONF", str(conf))
    logs = [root / "log" / "munged.log", root / "log" / "slurmctld.log", root / "log" / "slurmd.log"]
    procs = []
    try:
        procs.append(subprocess.Popen([_sbin("munged"), "-F", "-f", f"--socket={socket}", f"--key-file={key}",
                                       f"--log-file={logs[0]}", f"--pid-file={root / 'munge' / 'munged.pid'}",
                                       f"--seed-file={root / 'munge' / 'seed'}"], env=env))
        _wait(socket.exists, 20, "munged did not open its socket", logs)
        procs.append(subprocess.Popen([_sbin("slurmctld"), "-D", "-i"], env=env))
        procs.append(subprocess.Popen([_sbin("slurmd"), "-D", "-N", "llmcnode"], env=env))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "--noheader", "--format=%t"], env=env, capture_output=True, text=True)
            return out.stdout.strip() == "idle"

        _wait(idle, 60, "the node did not come up idle", logs)
        yield root
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.slow
def test_a_queued_job_is_built_by_a_real_slurm_job_and_submitted_once(slurm_cluster: Path, tmp_path: Path,
                                                                      tiny_model_session: Path) -> None:
    recipe = tiny_recipe(tmp_path / "recipe.yaml", tmp_path / "registry")
    llmc = tmp_path / "llmc"  # the node's llmc: this checkout, in this venv
    llmc.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m llmc \"$@\"\n")
    llmc.chmod(0o755)
    path = tmp_path / "hook.yaml"
    path.write_text(yaml.safe_dump({
        "state_dir": str(tmp_path / "state"), "cache_dir": str(tmp_path / "cache"), "runner": "slurm",
        "slurm": {"partitions": [{"name": "debug", "memory_gb": 3.9, "max_time_h": 1}], "llmc": str(llmc),
                  "poll_s": 1},
        "routes": [{"models": "org/tiny*", "recipes": [str(recipe)]}]}))
    config = load_hook_config(path)
    source = hf_source("org/tiny", "main")  # a Hub source: built and published locally, no registry server needed
    fetched = config.state / "sources" / "hf" / "org" / "tiny" / "main"
    shutil.copytree(tiny_model_session, fetched)
    (fetched / COMPLETE).write_text(source["uri"])
    # the tiny recipe evaluates on CPU-sized work; "auto" devices would ask this GPU-less node for a GPU
    recorded = load_recipe(recipe)
    recorded = recorded.model_copy(update={
        "calibration": recorded.calibration.model_copy(update={"device": "cpu"}),
        "eval": recorded.eval.model_copy(update={"device": "cpu"})})
    queue = JobQueue(config.state)
    job, _ = queue.enqueue(new_job(recorded, recipe, source))
    runner = SlurmRunner(config, config_path=path)

    submitted = dispatch(runner, queue.take(job["id"]), queue)
    assert submitted["state"] == "running", submitted.get("error")
    sid = submitted["scheduler_id"]
    assert sid.isdigit()
    again = dispatch(runner, queue.get(job["id"]), queue)  # a second delivery while it is on the cluster
    assert again["scheduler_id"] == sid

    def ended() -> bool:
        follow(runner, queue)
        return queue.get(job["id"]).get("scheduler_state") in TERMINAL

    _wait(ended, 300, f"slurm job {sid} did not end", [config.state / "slurm" / f"{sid}.out",
                                                       slurm_cluster / "log" / "slurmd.log"])
    final = queue.get(job["id"])
    log = runner.logs(sid)
    assert final["scheduler_state"] == "COMPLETED", log[-3000:]
    assert final["state"] == "done", (final.get("error"), log[-3000:])
    assert Path(final["published"]).is_dir()
    # one Slurm job in all: squeue still lists the finished one (MinJobAge), and only it
    names = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%i %j"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    assert [n for n in names if n.strip()] == [f"{sid} llmc-{job['id'][:16]}"]


# ---------------------------------------------------------------- MLflow -> llmc hook serve -> sbatch, across a kill

VARIANT = "tiny-w8.vllm-sm90-tp1"  # <recipe>.<target label>, after the source model's name

# the node's llmc: this checkout in this venv, reading the small corpus file (as the hook's own child does)
_NODE_LLMC = """#!/bin/sh
exec {python} -c 'import sys; sys.path.insert(0, "{repo}")
from tests.unit.build_helpers import use_corpus_file
use_corpus_file("{corpus}")
from llmc.cli import main
sys.argv[0] = "llmc"
main()' "$@"
"""


def _slurm_jobs() -> list[str]:
    out = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%i %j %T"], capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def _queued(state: Path) -> list[dict]:
    import json

    return [json.loads(p.read_text()) for p in sorted((state / "queue").glob("*.json"))]


def _serve(config: Path, corpus: Path, log: Path, client) -> tuple[subprocess.Popen, str, str]:
    from tests.unit.hook_helpers import SECRET, start_hook

    proc, url = start_hook(config, corpus, log)
    webhook = client.create_webhook(f"llmc-slurm-{proc.pid}", f"{url}/webhooks/mlflow",
                                    events=["model_version.created"], secret=SECRET)
    return proc, url, webhook.webhook_id


def _kill(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)


def _seed_rates(cache: Path, recipe: Path, source: Path) -> None:
    """Plan the recipe here on `cache`: the session's rates (tests/conftest.py replays them) are written to its rates
    file, which the hook's plan and the node's build then read as a cache shared with earlier plans, instead of
    probing for ~30 s each (the hook's own plan_needs keeps what it probes there too: test_hook_runners)."""
    from llmc.planning import probes
    from llmc.planning.plan import make_plan

    recorded = load_recipe(recipe)
    probes.use_cache(cache)
    make_plan(recorded.model_copy(update={"model": recorded.model.model_copy(update={"source": str(source)})}),
              source, refuse=False)


@pytest.mark.heavy  # an MLflow server, the Slurm daemons, two hooks, a build on the node: timed in the docstring
def test_an_mlflow_delivery_is_built_on_slurm_once_across_a_redelivery_and_a_hook_kill(
        slurm_cluster: Path, tmp_path: Path, tiny_model_session: Path) -> None:
    import signal

    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from tests.unit.build_helpers import small_corpus_file
    from tests.unit.hook_helpers import (post, register_source_version, signed_delivery, start_mlflow,
                                         version_created, wait_jobs)

    mlflow_proc, mlflow_uri = start_mlflow(tmp_path / "mlflow")
    corpus = small_corpus_file(tmp_path / "corpus.json")
    recipe = tiny_recipe(tmp_path / "recipe.yaml", tmp_path / "unused-registry")
    spec = yaml.safe_load(recipe.read_text())  # this node has no GPU: "auto" devices would make the plan ask for one
    spec["calibration"], spec["eval"] = {"device": "cpu"}, {**spec["eval"], "device": "cpu"}
    recipe.write_text(yaml.safe_dump(spec))
    llmc = tmp_path / "llmc"
    llmc.write_text(_NODE_LLMC.format(python=sys.executable, repo=REPO, corpus=corpus))
    llmc.chmod(0o755)
    config = tmp_path / "hook.yaml"
    config.write_text(yaml.safe_dump({
        "mlflow": {"tracking_uri": mlflow_uri}, "state_dir": str(tmp_path / "state"),
        "cache_dir": str(tmp_path / "cache"), "runner": "slurm",
        "slurm": {"partitions": [{"name": "debug", "memory_gb": 3.9, "max_time_h": 1}], "llmc": str(llmc),
                  "poll_s": 1},
        "routes": [{"models": "tiny-s*", "recipes": [str(recipe)]}]}))
    source = tmp_path / "source"
    shutil.copytree(tiny_model_session, source)
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    _seed_rates(tmp_path / "cache", recipe, source)
    client = MlflowClient(mlflow_uri)
    log, state = tmp_path / "hook.log", tmp_path / "state"
    hook, url, webhook = _serve(config, corpus, log, client)
    try:
        version = register_source_version(mlflow_uri, "tiny-s", source)  # MLflow delivers model_version.created

        def submitted() -> bool:
            return any(j.get("scheduler_id") for j in _queued(state))

        _wait(submitted, 120, "the hook did not submit the delivery to Slurm", [log])
        [job] = _queued(state)
        sid = job["scheduler_id"]
        # the same version delivered again while its job is on the cluster: answered, nothing submitted
        body, headers = signed_delivery(version_created("tiny-s", version), delivery_id="again-while-running")
        status, answer = post(f"{url}/webhooks/mlflow", body, headers)
        assert status == 202 and answer["jobs"][0]["new"] is False, answer
        # the hook killed mid-job (SIGKILL: no cleanup), the Slurm job running on; a new hook follows it by its id
        _kill(hook, signal.SIGKILL)
        client.delete_webhook(webhook)
        assert [line.split()[0] for line in _slurm_jobs()] == [sid]
        hook, url, webhook = _serve(config, corpus, log, client)
        [final] = wait_jobs(url, 1, 240, hook)
        assert final["state"] == "done", (final, (state / "slurm" / f"{sid}.out").read_text()[-3000:])
        assert final["scheduler_id"] == sid and final["attempts"] == 1
        node_log = (state / "slurm" / f"{sid}.out").read_text()
        assert "read from the cache" in node_log and "probed now" not in node_log, node_log[-3000:]
        # the node records `done` before its Slurm job ends; the job then ends COMPLETED (not TIMEOUT: --time holds
        # the job's start, upload and registration besides the plan's stages, llmc.hook.config.TIME_OVERHEAD_S)
        _wait(lambda: _slurm_jobs()[0].split()[2] in TERMINAL, 120, f"slurm job {sid} did not end",
              [state / "slurm" / f"{sid}.out", slurm_cluster / "log" / "slurmctld.log"])
        assert _slurm_jobs()[0].split()[2] == "COMPLETED", _slurm_jobs()
        # delivered once more after it is done: nothing queued, nothing submitted
        body, headers = signed_delivery(version_created("tiny-s", version), delivery_id="again-when-done")
        status, answer = post(f"{url}/webhooks/mlflow", body, headers)
        assert status == 202 and answer["jobs"][0]["new"] is False and answer["jobs"][0]["state"] == "done"
        [line] = _slurm_jobs()  # one Slurm job in all (squeue keeps finished ones for MinJobAge)
        assert line.split()[:2] == [sid, f"llmc-{job['id'][:16]}"]
        [mv] = client.search_model_versions(f"name = 'tiny-s.{VARIANT}'")  # registered exactly once
        assert mv.tags["llmc.source.uri"] == f"models:/tiny-s/{version}" and mv.tags["llmc.gates"] == "passed"
    finally:
        _kill(hook, signal.SIGTERM)
        _kill(mlflow_proc, signal.SIGTERM)
