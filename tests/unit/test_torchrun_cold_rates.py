"""torchrun builds on a cold rate cache (issue 50, item 9): the plan's probes run once, on rank 0 alone, and the other
ranks read what it cached; a calibration split that leaves a rank without a batch is refused by the plan on every
rank alike, before any weight loads. The probes are real here (not pinned): a fresh --cache-dir holds no rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import llmc
from llmc.errors import RecipeError
from llmc.planning import probes
from llmc.planning.plan import make_plan
from llmc.recipe.load import parse_recipe
from tests.unit.build_helpers import tiny_text_recipe

REPO = Path(llmc.__file__).resolve().parent.parent


def _recipe(samples: int, packing: str = "windows"):
    return parse_recipe(yaml.safe_dump({
        "name": "split", "model": {"source": "demo:smollm2-135m"},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                         "activations": {"format": "int8", "strategy": "tensor"}},
        "calibration": {"samples": samples, "packing": packing}, "targets": [{"runtime": "vllm"}]}))


def test_the_plan_refuses_a_split_that_leaves_a_rank_without_calibration_windows() -> None:
    """8a48c9f planned it (exit 0) and the build's rank 1 failed inside the quantize stage, rank 0 in gloo."""
    with pytest.raises(RecipeError) as e:
        make_plan(_recipe(8), nproc=3)  # 2 batches of 4 windows for 3 ranks
    assert e.value.exit_code == 2 and "8 calibration windows in batches of 4 leave 1 of 3 ranks" in e.value.message
    assert "--nproc" in e.value.fix and "12 calibration.samples" in e.value.fix
    make_plan(_recipe(8), nproc=2)  # one batch each
    make_plan(_recipe(8, "samples"), nproc=3)  # samples are split one by one
    with pytest.raises(RecipeError):
        make_plan(_recipe(2, "samples"), nproc=3)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "LLMC_REPROBE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, "OMP_NUM_THREADS": "1", "LLMC_PROGRESS_JSON": "0"}


def _build(recipe: Path, cache: Path, nproc: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc", "build", str(recipe), "--no-publish", "--cache-dir",
                           str(cache), "--nproc", str(nproc)], env=_env(), capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return tiny_text_recipe(tmp_path_factory.mktemp("coldrates"), "tiny-cold-rates", {
        "windows": 4, "batch_size": 2, "decode_tokens": 2, "throughput_repeats": 1, "throughput_batch_sizes": [1],
        "bootstrap_samples": 100})


@pytest.mark.heavy
def test_a_two_process_build_on_a_cold_rate_cache_probes_once_on_rank_0(recipe: Path, tmp_path: Path) -> None:
    """8a48c9f: rank 1 raised "4 calibration windows in batches of 4 leave rank 1 of 2 without any" inside the
    stream probe (exit 2) and rank 0 died in gloo (exit 70)."""
    cache = tmp_path / "cache"
    started = time.monotonic()
    r = _build(recipe, cache, 2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    rates = json.loads((cache / probes.RATES_FILE).read_text())["rates"]
    stream = [k for k in rates if k.startswith("stream layers calibrated")]
    assert stream, sorted(rates)
    # measured once (rank 0), not once per rank: one probe's runs under each key
    assert all(len(entry["runs"]) == 1 for entry in rates.values()), {k: len(v["runs"]) for k, v in rates.items()}
    assert time.monotonic() - started < 300


@pytest.mark.heavy
def test_every_rank_refuses_a_split_that_leaves_one_without_work_before_loading(recipe: Path, tmp_path: Path) -> None:
    few = tmp_path / "few.yaml"
    spec = yaml.safe_load(recipe.read_text())
    spec["calibration"]["samples"] = 4  # one batch of 4 windows for 2 ranks
    few.write_text(yaml.safe_dump(spec))
    r = _build(few, tmp_path / "cache", 2)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    refusals = [line for line in r.stderr.splitlines() if "leave 1 of 2 ranks without any" in line]
    assert len(refusals) == 2 and len(set(refusals)) == 1, r.stderr[-3000:]  # both ranks, the same words
    assert "Traceback" not in r.stderr and "gloo" not in r.stderr
    assert not (tmp_path / "cache" / "stages").exists() or not any((tmp_path / "cache" / "stages").rglob("*.safetensors"))
