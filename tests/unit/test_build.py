"""`llmc build` end to end on a tiny random model: caching, publish, gates (resume after a kill: test_kill_anywhere.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmc.build import build
from llmc.pipeline.gate import raise_for_gates
from llmc.errors import QualityGateError
from llmc.recipe.load import parse_recipe
from llmc.publish.local import verify_entry
from llmc.storage.store import Store
from llmc.result import EvalId

pytestmark = pytest.mark.heavy  # whole builds, up to a minute each


def recipe_text(model: Path, registry: Path, **overrides) -> str:
    r = {
        "name": "tiny-fp8",
        "model": {"source": str(model)},
        "quantization": {
            "weights": {"format": "fp8_e4m3", "strategy": "channel"},
            "activations": {"format": "fp8_e4m3", "strategy": "tensor"},
            "kv_cache": {"format": "fp8_e4m3"},
        },
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 64, "windows": 6, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 200},
        "gates": {"max_ppl_increase_pct": 50.0},
        "publish": {"registry": str(registry)},
    }
    for dotted, value in overrides.items():
        node = r
        *path, last = dotted.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return yaml.safe_dump(r)


def _artifact_hashes(result) -> dict[str, str]:
    return {label: json.dumps(a.files, sort_keys=True) for label, a in result.artifacts.items()}


def test_build_caches_publishes_and_reruns_nothing(tiny_model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    recipe = parse_recipe(recipe_text(tiny_model, tmp_path / "registry"))
    first = build(recipe, store)
    assert first.passed and first.published is not None and not first.publish_noop
    assert not any(s.cached for s in first.stages)
    assert verify_entry(first.published) == []
    manifest = json.loads((first.published / "manifest.json").read_text())
    assert manifest["calibration"]["window_index"] and manifest["calibration"]["seed"] == 0
    assert manifest["model"]["sha256"] == first.source.sha256
    assert any(k.startswith("artifacts/") and k.endswith("model.safetensors") for k in manifest["files"])
    assert manifest["report"]["verdicts"][0]["gate"] == "max_ppl_increase_pct"
    assert "torch" in manifest["packages"] and manifest["packages"]["llmc"]

    second = build(recipe, store)
    assert all(s.cached for s in second.stages)
    assert second.build_id == first.build_id and second.publish_noop
    assert _artifact_hashes(second) == _artifact_hashes(first)


def test_changing_only_gates_recomputes_no_stage(tiny_model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    build(parse_recipe(recipe_text(tiny_model, tmp_path / "r")), store, publish=False)
    stricter = parse_recipe(recipe_text(tiny_model, tmp_path / "r", **{"gates.max_ppl_increase_pct": 0.001}))
    result = build(stricter, store)
    assert all(s.cached for s in result.stages)
    assert not result.passed and result.published is None  # failed gate: not published
    with pytest.raises(QualityGateError) as e:
        raise_for_gates(result)
    assert "max_ppl_increase_pct" in str(e.value) and "+0.00%" in str(e.value)
    assert e.value.exit_code == 5


def test_changing_calibration_seed_recomputes_calibration_and_downstream(tiny_model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    build(parse_recipe(recipe_text(tiny_model, tmp_path / "r")), store, publish=False)
    result = build(parse_recipe(recipe_text(tiny_model, tmp_path / "r", **{"calibration.seed": 1})), store, publish=False)
    cached = {s.name: s.cached for s in result.stages}
    assert cached["calibrate"] is False and cached["quantize:W8A8-FP8"] is False
    assert cached["eval:torch:baseline"] is True  # the baseline does not depend on calibration


def test_one_quantization_exports_every_target_and_measures_batch_sizes(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM + TensorRT-LLM (unified and legacy TP=2) + llama.cpp targets from one quantize stage; tokens/s
    at two batch sizes."""
    from llmc.eval.report import render_markdown

    text = recipe_text(
        tiny_model, tmp_path / "registry",
        **{"quantization.weights": {"format": "fp8_e4m3", "strategy": "tensor"},
           "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}, {"runtime": "tensorrt-llm", "gpu_arch": "sm90"},
                       {"runtime": "tensorrt-llm", "gpu_arch": "sm90", "version": "<0.17", "tensor_parallel": 2}],
           "eval.throughput_batch_sizes": [1, 2]},
    )
    result = build(parse_recipe(text), Store(tmp_path / "cache"), publish=False)
    assert [s.name for s in result.stages].count("calibrate") == 1
    assert sum(s.name.startswith("quantize") for s in result.stages) == 1
    exporters = sorted(a.format for a in result.artifacts.values())
    assert exporters == ["compressed-tensors", "modelopt-hf", "trtllm-checkpoint"]
    legacy = next(a for a in result.artifacts.values() if a.format == "trtllm-checkpoint")
    assert {"rank0.safetensors", "rank1.safetensors", "config.json"} <= set(legacy.files)
    by_batch = result.evals[EvalId("torch", "baseline")].throughput["by_batch_size"]
    assert set(by_batch) == {"1", "2"} and by_batch["2"]["prefill_tokens_per_s"]["median"] > 0
    assert "Throughput by batch size" in render_markdown(result)


def test_artifacts_no_engine_here_loads_say_why(tiny_model: Path, tmp_path: Path) -> None:
    from llmc.eval.report import summary_rows

    text = recipe_text(tiny_model, tmp_path / "registry",
                       **{"quantization.weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                          "targets": [{"runtime": "tensorrt-llm", "gpu_arch": "sm90"}]})
    result = build(parse_recipe(text), Store(tmp_path / "cache"), publish=False)
    rows = summary_rows(result)
    assert len(rows) == 1 and "TensorRT-LLM needs an NVIDIA GPU" in rows[0][-1]


def test_int4_targets_for_lmdeploy_exllamav2_and_triton_published_without_copies(tiny_model: Path, tmp_path: Path) -> None:
    from llmc.eval.report import summary_rows

    text = recipe_text(
        tiny_model, tmp_path / "registry",
        **{"quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 32}},
           "targets": [{"runtime": "vllm", "gpu_arch": "sm90", "triton": True},
                       {"runtime": "lmdeploy", "gpu_arch": "sm80"}, {"runtime": "exllamav2", "gpu_arch": "sm80"},
                       {"runtime": "tensorrt-llm", "gpu_arch": "sm90", "triton": True}],
           # three of the four need a GPU to be evaluated: publishing them unmeasured must be asked for
           "gates": {"max_ppl_increase_pct": 50.0, "allow_unevaluated": True}},
    )
    result = build(parse_recipe(text), Store(tmp_path / "cache"))
    assert result.gates_status[0] == "passed-unmeasured"
    assert sorted(a.format for a in result.artifacts.values()) == ["awq", "compressed-tensors", "gptq", "modelopt-hf"]
    entry = result.published / "artifacts"
    vllm_label = next(label for label, a in result.artifacts.items() if a.format == "compressed-tensors")
    version = next((entry / vllm_label / "triton").iterdir()) / "1"
    weights = entry / vllm_label / "model.safetensors"
    assert (version / "model.json").is_file()
    assert (version / "model.safetensors").stat().st_ino == weights.stat().st_ino  # linked in the registry too
    trt_label = next(label for label, a in result.artifacts.items() if a.format == "modelopt-hf")
    trt_version = next((entry / trt_label / "triton").iterdir()) / "1"
    assert (trt_version / "model.py").is_file() and (trt_version / "llmc-trtllm.yaml").is_file()
    assert verify_entry(result.published) == []
    reasons = [r[-1] for r in summary_rows(result) if r[1] == "-"]
    assert len(reasons) == 3 and sum("LMDeploy / ExLlamaV2 need an NVIDIA GPU" in r for r in reasons) == 2
    assert all("pass unmeasured (allow_unevaluated): max_ppl_increase_pct not measured" in r for r in reasons)


def test_tensorrt_llm_engine_without_a_gpu_fails_its_artifact_with_the_fix(tiny_model: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """Asking for an engine this machine cannot run is a failure of its own ("artifact evaluated"), naming
    what is missing, never a silent pass."""
    monkeypatch.setenv("LLMC_TRTLLM_PYTHON", str(tmp_path / "no-such-python"))
    text = recipe_text(tiny_model, tmp_path / "registry",
                       **{"quantization.weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                          "targets": [{"runtime": "tensorrt-llm", "gpu_arch": "sm90"}],
                          "eval.runtimes": ["torch", "tensorrt-llm"]})
    result = build(parse_recipe(text), Store(tmp_path / "cache"), publish=False)
    errors = [e.error for e in result.evals.values() if e.error]
    assert errors and "TensorRT-LLM engine's Python, set by $LLMC_TRTLLM_PYTHON, does not exist" in errors[0]
    assert ".venv-trtllm" in errors[0]  # the fix
    assert not result.passed
    failed = [v for v in result.verdicts if not v.passed]
    assert failed and failed[0].gate == "artifact evaluated"
