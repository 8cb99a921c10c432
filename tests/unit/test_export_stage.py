"""The export stage (llmc.pipeline.export): what it asks the artifact formats to write beyond the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmc.build import build_until
from llmc.pipeline.export import served_context
from llmc.pipeline.ids import Kind
from llmc.recipe.load import parse_recipe
from llmc.storage.store import Store


def test_vllm_serves_the_models_context_not_the_evaluation_window(tiny_model_session: Path, tmp_path: Path) -> None:
    context = json.loads((tiny_model_session / "config.json").read_text())["max_position_embeddings"]
    recipe = parse_recipe(yaml.safe_dump({
        "name": "served-context", "model": {"source": str(tiny_model_session)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"}},  # no calibration: seconds
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 32, "windows": 2},
    }))
    result = build_until(recipe, Store(tmp_path / "cache"), Kind.EXPORT)
    (artifact,) = result.artifacts.values()
    serve = json.loads((artifact.dir / "llmc-serve.json").read_text())
    assert serve["vllm"]["max_model_len"] == context != recipe.eval.seq_len
    assert f"--max-model-len {context}" in serve["command"]


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 8192}, 8192),
    ({"model_type": "gemma3", "text_config": {"max_position_embeddings": 32768}}, 32768),  # multimodal: nested
    ({"max_position_embeddings": 256}, 512),  # never below the window the build evaluated (plan refuses this)
    ({}, 512), ({"max_position_embeddings": None}, 512), ({"max_position_embeddings": "8192"}, 512),
    ({"max_position_embeddings": 0}, 512), ({"max_position_embeddings": True}, 512),
])
def test_served_context_from_the_config_else_the_window(config: dict, expected: int) -> None:
    assert served_context(config, 512) == expected
