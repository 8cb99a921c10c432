"""`llmc build --nproc 2`: the build's evaluation stage split over two gloo ranks on CPU (llmc.engines.split).

One tiny random model, one static-INT8 recipe whose torch-reference evaluation runs 4 batches of 2 windows (two per
rank). Checked: the per-window NLL, KL and top-1 of every evaluation and the intervals in the report are bit-identical
to `--nproc 1`; the eval stages carry the same keys, so a one-process rerun on the two-rank cache finds every stage;
a rank SIGKILLed while scoring the artifact fails the job (non-zero, naming the rank and the signal), the rerun takes
the baseline's evaluation from the cache and completes with the one-process results. The agreement on failures is
checked in two real gloo processes (seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import llmc
from llmc import distributed
from tests.unit.build_helpers import tiny_text_recipe

REPO = Path(llmc.__file__).resolve().parent.parent

# Loaded by every Python process the test starts (its folder is first on PYTHONPATH): the rank named by
# LLMC_TEST_KILL_EVAL_RANK SIGKILLs itself when it starts scoring for the LLMC_TEST_KILL_EVAL_AT-th time.
_KILLER = """
import os
if os.environ.get("LLMC_TEST_KILL_EVAL_RANK") == os.environ.get("RANK", "0") and "LOCAL_RANK" in os.environ:
    import signal
    from llmc.engines import torch_ref

    left = [int(os.environ["LLMC_TEST_KILL_EVAL_AT"])]
    real = torch_ref.TorchEngine._score_block

    def score_block(self, *args, **kwargs):
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    torch_ref.TorchEngine._score_block = score_block
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, "OMP_NUM_THREADS": "1", "LLMC_PROGRESS_JSON": "0", **extra}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return tiny_text_recipe(tmp_path_factory.mktemp("distbuild"), "tiny-dist-eval", {
        "windows": 8, "batch_size": 2, "decode_tokens": 2, "throughput_repeats": 1, "throughput_batch_sizes": [1],
        "bootstrap_samples": 100})


def _build(recipe: Path, cache: Path, nproc: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc", "build", str(recipe), "--no-publish", "--cache-dir",
                           str(cache), "--report-dir", str(cache / "report"), "--nproc", str(nproc)],
                          env=_env(**env), capture_output=True, text=True, timeout=600, check=False)


def _eval_stages(cache: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every eval stage's stored per-token scores (and head inputs), by stage key."""
    out = {}
    for stage in sorted((cache / "stages" / "eval").iterdir()):
        if (stage / "metrics.json").is_file():
            out[stage.name] = {f.name + ":" + k: v for f in sorted(stage.glob("*.safetensors"))
                               for k, v in load_file(str(f)).items()}
    return out


def _intervals(cache: Path) -> dict[str, dict]:
    """Per evaluation: perplexity, its interval, the paired change, KLD and top-1 with their intervals."""
    evals = json.loads((cache / "report" / "report.json").read_text())["evals"]
    keep = ("perplexity", "ppl_ci95", "ppl_change", "kld", "top1_agreement", "key")
    return {name: {k: e.get(k) for k in keep} for name, e in evals.items()}


def _ranks_recorded(cache: Path) -> list[int]:
    return sorted(json.loads((s / "metrics.json").read_text())["hardware"]["ranks"]
                  for s in (cache / "stages" / "eval").iterdir() if (s / "metrics.json").is_file())


@pytest.fixture(scope="module")
def one_process(recipe: Path, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("one") / "cache"
    r = _build(recipe, cache, 1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cache


@pytest.mark.slow
def test_build_nproc_2_evaluates_across_ranks_bit_identical_to_one_process(recipe: Path, one_process: Path,
                                                                            tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    two = _build(recipe, cache, 2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "eval: torch scores the windows split over 2 ranks" in two.stderr + two.stdout
    assert _ranks_recorded(cache) == [2, 2] and _ranks_recorded(one_process) == [1, 1]  # baseline and artifact
    a, b = _eval_stages(one_process), _eval_stages(cache)
    assert a.keys() == b.keys()  # the same eval stage keys: the number of ranks enters none of them
    for key in a:
        assert a[key].keys() == b[key].keys() and any(k.endswith(":nll") for k in a[key])
        for name in a[key]:  # per-window NLL, KL, top-1, top-k, head inputs: every bit
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    assert any(k.endswith(":kl") for s in b.values() for k in s) and any(k.endswith(":top1") for s in b.values()
                                                                           for k in s)
    assert _intervals(cache) == _intervals(one_process)
    # a one-process rerun on the two-rank cache: every stage found, the same report
    again = _build(recipe, cache, 1)
    assert again.returncode == 0, again.stderr[-3000:]
    stages = json.loads((cache / "report" / "report.json").read_text())["stages"]
    assert stages and all(s["cached"] for s in stages), stages
    assert _intervals(cache) == _intervals(one_process)


@pytest.mark.slow
def test_a_rank_killed_while_scoring_fails_the_job_and_the_rerun_resumes(recipe: Path, one_process: Path,
                                                                          tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_KILLER)
    cache = tmp_path / "cache"
    # rank 1 scores the baseline (1st), then dies as it starts on the artifact (2nd)
    killed = _build(recipe, cache, 2, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}",
                    LLMC_TEST_KILL_EVAL_RANK="1", LLMC_TEST_KILL_EVAL_AT="2")
    message = killed.stdout + killed.stderr
    assert killed.returncode == 4, message[-3000:]  # SIGKILL: most often the out-of-memory killer
    assert "rank 1" in message and "SIGKILL" in message and "resumes" in message
    assert len(_eval_stages(cache)) == 1  # the baseline's evaluation was committed, the artifact's not
    resumed = _build(recipe, cache, 2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    stages = {s["name"]: s["cached"] for s in json.loads((cache / "report" / "report.json").read_text())["stages"]}
    assert stages["eval:torch:baseline"] is True and [c for n, c in stages.items() if n.startswith("eval:")] == \
        [True, False]
    assert _intervals(cache) == _intervals(one_process)


# --------------------------------------------------------------------------- failures agreed (two gloo processes)


def _agreement(rank: int, world: int, init_file: str, out: str) -> None:
    from llmc.errors import EngineFailed

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    caught = []
    cases = [None,  # nobody failed
             EngineFailed("artifact unreadable", fix="inspect it") if rank == 1 else None,
             MemoryError("cannot allocate") if rank == 0 else None,
             KeyError("boom") if rank == 1 else None]
    for failure in cases:
        try:
            distributed.agree(failure)
            caught.append(None)
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            caught.append((type(e).__name__, str(e), getattr(e, "ranks_agreed", False)))
    served = []
    distributed.open_commands()
    if rank == 0:
        with distributed.leading({"n": 1}):
            distributed.agree(None)  # rank 0's part of the command: the same collectives as the followers'
        try:
            with distributed.leading({"n": 2}):
                distributed.agree(EngineFailed("rank 0 cannot open it"))
        except EngineFailed as e:
            served.append(str(e))
        distributed.release()
    else:
        def handle(command: dict) -> None:
            served.append(command["n"])
            distributed.agree(None)

        distributed.follow(handle)
        distributed.destroy()
    torch.save({"caught": caught, "served": served, "active": distributed.active()}, f"{out}.{rank}")


@pytest.mark.heavy  # two ranks in subprocesses: 5 s of CPU on the 2-core EPYC (load ~15)
def test_failures_are_raised_on_every_rank_and_followers_serve_until_released(tmp_path: Path) -> None:
    mp.spawn(_agreement, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    zero, one = (torch.load(tmp_path / f"out.{r}") for r in range(2))
    assert zero["caught"][0] is None and one["caught"][0] is None
    # an llmc error on rank 1: rank 1 raises its own, rank 0 the same class naming rank 1 (same exit code)
    assert zero["caught"][1] == ("EngineFailed", "rank 1: artifact unreadable\n  fix: inspect it", True)
    assert one["caught"][1] == ("EngineFailed", "artifact unreadable\n  fix: inspect it", True)
    # out of memory on rank 0: the other rank reports it as a resource error (exit 4), as rank 0 will
    assert zero["caught"][2][0] == "MemoryError" and one["caught"][2][0] == "ResourceError"
    assert one["caught"][2][1].startswith("rank 0: ")
    # anything else: an internal error on every rank
    assert zero["caught"][3][0] == "RankError" and "rank 1 failed: KeyError" in zero["caught"][3][1]
    assert one["caught"][3][0] == "KeyError"
    # rank 1 served both commands (the second failed on rank 0, agreed: it went on waiting), then was released
    assert one["served"] == [1, 2] and zero["served"] == ["rank 0 cannot open it"]
    assert not zero["active"] and not one["active"]
