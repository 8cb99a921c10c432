"""Data-parallel calibration and evaluation (llmc.distributed) against one process.

The default run checks the reductions in two real gloo processes (seconds). The slow tests launch torchrun with two
CPU ranks on a tiny random model: RTN-static/KV scales and SmoothQuant factors bit-identical to one process; GPTQ and
AWQ within a stated tolerance of one process; a rank killed mid-layer fails the job and the rerun resumes; the torch
engine's scores identical.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import llmc
from llmc import distributed

CHILD = Path(__file__).with_name("dist_child.py")
REPO = Path(llmc.__file__).resolve().parent.parent


# --------------------------------------------------------------------------- shards (no processes)


@pytest.mark.parametrize("items,unit,world", [(16, 4, 2), (10, 4, 2), (10, 2, 3), (5, 1, 4), (7, 4, 2)])
def test_shards_cover_the_windows_in_order_on_batch_boundaries(items: int, unit: int, world: int) -> None:
    bounds = [distributed.shard_bounds(items, unit, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == items
    for (lo, hi), (next_lo, _) in itertools.pairwise(bounds):
        assert hi == next_lo and lo % unit == 0  # contiguous, each block starts on a batch
    batches = [-(-(hi - lo) // unit) for lo, hi in bounds]
    assert max(batches) - min(batches) <= 1  # balanced to within one batch


def test_without_torchrun_everything_is_one_process(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.world_from_env() == distributed.World(0, 1, 0) and not distributed.launched()
    assert distributed.init("cpu").size == 1 and not distributed.active()
    x = torch.rand(5, 3)
    assert torch.equal(distributed.reduce_maxima([x])[0], x)
    assert distributed.spread([["a"], ["b"]], {"a": 1, "b": 2}, lambda names: {n: n for n in names}) == \
        {"a": "a", "b": "b"}


# --------------------------------------------------------------------------- reductions in two gloo processes


def _reductions(rank: int, world: int, init_file: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(11, 6, generator=g)  # every rank builds all rows, then keeps its block
    lo, hi = distributed.shard_bounds(len(rows), 1)
    mine = rows[lo:hi]
    hessian, tokens = None, 0
    from llmc.quant.algorithms.gptq import accumulate_hessian

    hessian, tokens = accumulate_hessian(None, 0, mine)
    result = {
        "max": distributed.reduce_maxima([mine.amax(dim=0)])[0],
        "sum": distributed.sum_in_rank_order(mine.sum(dim=0)),
        "mean": distributed.mean_rows(mine),
        "hessian": distributed.combine_running_means(hessian, tokens),
        "rows": distributed.evenly_spaced_rows(mine, 4),
        "all_rows": distributed.evenly_spaced_rows(mine, 100),
        "spread": distributed.spread([["a", "b"], ["c"], ["d"]], {"a": 3, "b": 3, "c": 4, "d": 1},
                                     lambda names: {n: (n, distributed.rank()) for n in names}),
        "any": (distributed.any_rank(distributed.rank() == 1), distributed.any_rank(False)),
    }
    torch.save(result, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.heavy  # two ranks in subprocesses: 5 s of CPU on the 2-core EPYC (load ~15)
def test_reductions_match_one_process_and_every_rank_agrees(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_reductions, args=(world, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"out.{r}") for r in range(world)]
    rows = torch.rand(11, 6, generator=torch.Generator().manual_seed(0))
    blocks = [rows[slice(*distributed.shard_bounds(11, 1, r, world))] for r in range(world)]
    from llmc.quant.algorithms.gptq import accumulate_hessian

    for res in results:  # identical on every rank, and what one process holding every row computes
        assert torch.equal(res["max"], rows.amax(dim=0))
        assert torch.equal(res["sum"], blocks[0].sum(dim=0).double() + blocks[1].sum(dim=0).double())
        assert torch.equal(res["mean"], distributed.mean_rows(rows))  # float64 accumulation: the same float32
        one_h, one_n = accumulate_hessian(None, 0, rows)
        assert res["hessian"][1] == one_n == 11
        torch.testing.assert_close(res["hessian"][0], one_h, rtol=1e-6, atol=1e-7)
        assert torch.equal(res["rows"], rows[torch.linspace(0, 10, 4).long()])
        assert torch.equal(res["all_rows"], rows)
        assert set(res["spread"]) == {"a", "b", "c", "d"}
        assert res["spread"]["a"][1] == res["spread"]["b"][1]  # a group stays on one rank
        assert res["any"] == (True, False)
    assert results[0]["spread"] == results[1]["spread"]
    assert {rank for _, rank in results[0]["spread"].values()} == {0, 1}  # both ranks computed some


# --------------------------------------------------------------------------- torchrun, two CPU ranks (slow)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _run(args: list[str], ranks: int, **env: str) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    return subprocess.run([*launcher, str(CHILD), *args], env=_env(**env), capture_output=True, text=True,
                          timeout=900, check=False)


def _layer_files(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "layers").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


SCHEMES = ["rtn-static-kv", "smoothquant", "gptq", "awq"]


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory) -> tuple[Path, Path, Path]:
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("dist")
    model = make_tiny_model(root / "model", layers=3)
    for ranks, out in ((1, root / "one"), (2, root / "two")):
        r = _run([str(model), str(out), ",".join(SCHEMES)], ranks)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return model, root / "one", root / "two"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["rtn-static-kv", "smoothquant"])
def test_ranges_and_smoothing_bit_identical_to_one_process(scheme: str, one_and_two) -> None:
    _, one, two = one_and_two
    a, b = _layer_files(one / scheme), _layer_files(two / scheme)
    assert a.keys() == b.keys() and any(k.endswith("input_scale") for k in a) and any(k.endswith("k_scale") for k in a)
    for k in a:  # input/k/v scales, codes and (SmoothQuant) the smoothed norms: every bit
        assert torch.equal(a[k], b[k]), k
    assert json.loads((one / scheme / "quantized.json").read_text())["modules"] == \
        json.loads((two / scheme / "quantized.json").read_text())["modules"]
    assert not (two / scheme / "state").exists()  # rank 0 cleaned the per-rank inputs away


@pytest.mark.slow
@pytest.mark.parametrize("scheme,min_equal_codes", [("gptq", 0.999), ("awq", 0.99)])
def test_gptq_and_awq_within_tolerance_of_one_process(scheme: str, min_equal_codes: float, one_and_two) -> None:
    """Quantity: the share of int4 codes equal to one process's, and the weight scales. Why not bits: Hessians,
    AWQ's Gram matrices and search losses are sums the ranks add in another association (each its block, then
    the blocks in float64), so they may differ from one process's in the last bits; that can move a weight
    across a rounding boundary (GPTQ) or flip a near-tie in AWQ's grid search. Measured on this model: every code
    and scale equal for both (so the bounds are slack kept for other hardware and thread counts)."""
    _, one, two = one_and_two
    a, b = _layer_files(one / scheme), _layer_files(two / scheme)
    assert a.keys() == b.keys()
    codes = [k for k in a if k.endswith(".weight") and a[k].dtype == torch.int8]
    equal = sum(int((a[k] == b[k]).sum()) for k in codes) / sum(a[k].numel() for k in codes)
    assert equal >= min_equal_codes
    for k in a:
        if k.endswith("weight_scale"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5 if scheme == "gptq" else 0.6, atol=0)


@pytest.mark.slow
def test_a_rank_killed_mid_layer_fails_the_job_and_the_rerun_resumes(one_and_two, tmp_path: Path) -> None:
    model, one, _ = one_and_two
    out = tmp_path / "q"
    killed = _run([str(model), str(out), "rtn-static-kv"], 2, LLMC_TEST_KILL_RANK="1", LLMC_TEST_KILL_LAYER="1")
    report = killed.stdout + killed.stderr
    assert killed.returncode != 0
    assert "Signal 9 (SIGKILL)" in report and "rank" in report  # torchrun names the failed rank and why
    progress = json.loads((out / "rtn-static-kv" / "state" / "progress.json").read_text())
    assert progress == {"next_layer": 1, "world_size": 2}  # layer 0 committed on both ranks, layer 1 not
    resumed = _run([str(model), str(out), "rtn-static-kv"], 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming quantization at layer 1/3" in resumed.stdout + resumed.stderr
    a, b = _layer_files(one / "rtn-static-kv"), _layer_files(out / "rtn-static-kv")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_evaluation_split_over_ranks_is_identical(one_and_two, tmp_path: Path) -> None:
    model, _, _ = one_and_two
    windows = torch.randint(3, 200, (10, 20), generator=torch.Generator().manual_seed(3))
    torch.save(windows, tmp_path / "windows.pt")
    results = []
    for ranks in (1, 2):  # 5 batches of 2: rank 0 scores 3, rank 1 scores 2
        r = _run(["--eval", str(model), str(tmp_path / "windows.pt"), str(tmp_path / f"scores{ranks}.pt")], ranks)
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(torch.load(tmp_path / f"scores{ranks}.pt"))
    for part in ("base", "scored"):
        one, two = results[0][part], results[1][part]
        assert one.keys() == two.keys() and "nll" in one
        for k in one:  # per-window NLL, KL, top-1, top-k and head inputs: every bit, in window order
            assert torch.equal(one[k], two[k]), (part, k)
    from llmc.eval.metrics import perplexity_interval

    assert perplexity_interval(results[0]["base"]["nll"]) == perplexity_interval(results[1]["base"]["nll"])


@pytest.mark.slow
def test_llmc_build_nproc_2_gives_the_single_process_build(tmp_path: Path) -> None:
    from tests.unit.build_helpers import tiny_text_recipe

    recipe = tiny_text_recipe(tmp_path, "tiny-dist", {"windows": 4, "decode_tokens": 2, "throughput_repeats": 1,
                                                      "bootstrap_samples": 100})
    runs = {}
    for nproc in (1, 2):
        cache = tmp_path / f"cache{nproc}"
        r = subprocess.run([sys.executable, "-m", "llmc", "build", str(recipe), "--no-publish", "--cache-dir",
                            str(cache), "--nproc", str(nproc)], env=_env(), capture_output=True, text=True,
                           timeout=900, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[nproc] = (r.stdout, sorted((cache / "stages" / "quantize").glob("*/layers")))
    assert runs[2][0].count("ppl base") == 1  # one table: rank 0 reports, rank 1 stayed quiet
    (one,), (two,) = runs[1][1], runs[2][1]
    assert one.parent.name == two.parent.name  # same stage key: maxima do not depend on the ranks
    a, b = _layer_files(one.parent), _layer_files(two.parent)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- planner, volumes, failures (no processes)


def test_plan_with_nproc_gives_per_rank_estimates_and_exact_hessian_volume(tiny_model: Path, tmp_path: Path) -> None:
    import yaml

    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    r = parse_recipe(yaml.safe_dump({
        "name": "p", "model": {"source": str(tiny_model)},
        "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 16}, "algorithm": "gptq"},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}], "calibration": {"device": "cpu"}}))
    assert not make_plan(r, tiny_model, tmp_path).distributed  # one process: no distributed line
    plan = make_plan(r, tiny_model, tmp_path, nproc=4)
    d = plan.distributed
    # tiny model: q/k/v and gate/up read hidden (64) inputs, o_proj 64, down_proj 128: Hessians 3·64² + 128²
    assert d["bytes_per_layer"]["Hessians (all-gather, fp32)"] == 3 * 4 * (3 * 64 * 64 + 128 * 128)
    assert 1 < d["speedup"] <= 4 and d["memory_gb_per_rank"] > 0
    assert "distributed: 4 ranks" in plan.render() and "Hessians" in plan.render()


def test_llama_70b_down_proj_hessian_volume_is_28672_squared_floats() -> None:
    from llmc.planning import scaling

    shapes = {"mlp.down_proj": (8192, 28672)}
    work = scaling.Workload(ranges=False, hessians=True, module_calls=False, solve_on_rank0=True)
    assert scaling.bytes_per_layer(shapes, 2, work)["Hessians (all-gather, fp32)"] == 28672 ** 2 * 4
    assert scaling.amdahl_fit(745.0, 264.0, 4) == pytest.approx((641.33, 103.67), abs=0.01)


def test_a_killed_rank_is_reported_with_its_signal_and_the_resume_fix() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from llmc.errors import EXIT_CODES, ResourceError

    def failure(code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=1, pid=4242, exitcode=code, error_file="/nonexistent")

    codes = set(EXIT_CODES.values())
    killed = distributed.launch_failure({1: failure(-9)}, codes)
    assert isinstance(killed, ResourceError) and "rank 1 (pid 4242) was killed by SIGKILL" in killed.message
    assert "resumes" in killed.fix
    gate = distributed.launch_failure({0: failure(5), 1: failure(-15)}, codes)
    assert isinstance(gate, distributed.RankFailed) and gate.exit_code == 5  # rank 0's own llmc code
    other = distributed.launch_failure({1: failure(-15)}, codes)
    assert isinstance(other, distributed.JobFailed) and "SIGTERM" in other.message
    # torchrun lists the survivor it SIGTERMed, or a survivor failed on losing its peer: the SIGKILLed rank is named
    for survivor in (-15, 70):
        cause = distributed.launch_failure({0: failure(survivor), 1: failure(-9)}, codes)
        assert isinstance(cause, ResourceError) and "rank 1 (pid 4242) was killed by SIGKILL" in cause.message
