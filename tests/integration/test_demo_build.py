"""The README's main job on the real SmolLM2-135M: `llmc build recipes/smollm2-fp8.yaml`, twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _llmc(args: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMC_CACHE": str(cache), "LLMC_PROGRESS_JSON": "0"}
    return subprocess.run([sys.executable, "-m", "llmc.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)


# The default run builds the demo with fewer calibration samples and evaluation windows (the same stages, models,
# engines and gates; a few minutes); the README's own build, exactly as a user runs it, is in the slow suite.
SHORTER = ["--set", "calibration.samples=8", "--set", "eval.windows=6", "--set", "eval.decode_tokens=4"]


@pytest.mark.parametrize("overrides", [pytest.param(SHORTER, id="shorter"),
                                       pytest.param([], id="as-in-the-readme", marks=pytest.mark.slow)])
def test_demo_build_end_to_end_then_fully_cached(tmp_path: Path, overrides: list[str]) -> None:
    shutil.copy(REPO / "recipes" / "smollm2-fp8.yaml", tmp_path / "recipe.yaml")
    cache = tmp_path / "cache"
    first = _llmc(["build", "recipe.yaml", *overrides], tmp_path, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "ppl base" in out and "vllm-sm90-tp1" in out and "pass" in out
    assert "published: registry/smollm2-fp8/" in out

    entry = next((tmp_path / "registry" / "smollm2-fp8").iterdir())
    manifest = json.loads((entry / "manifest.json").read_text())
    report = manifest["report"]
    ev = report["evals"]["torch:vllm-sm90-tp1"]
    base = report["evals"]["torch:baseline"]
    # real numbers, on the real model: FP8 moves perplexity by a few percent, not by 0 or 100
    assert 20 < base["perplexity"] < 80
    assert 0.1 < ev["ppl_change"]["delta_pct"] < 10
    assert ev["ppl_change"]["ci_low_pct"] <= ev["ppl_change"]["delta_pct"] <= ev["ppl_change"]["ci_high_pct"]
    cfg = json.loads((entry / "artifacts" / "vllm-sm90-tp1" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "float-quantized"

    second = _llmc(["build", "recipe.yaml", *overrides], tmp_path, cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(6 cached)" in second.stdout and "no-op" in second.stdout

    inspected = _llmc(["inspect", str(entry)], tmp_path, cache)
    assert inspected.returncode == 0 and "all sha256 match" in inspected.stdout
