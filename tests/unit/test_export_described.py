"""Every export's quantization_config describes exactly the tensors it wrote (llmc.formats.described), and a Linear
outside the decoder layers, which the stream never quantizes (Gemma-4's per_layer_model_projection), is listed as
unquantized by every format (issue 50, item 7)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from llmc.build import build, build_until
from llmc.formats.described import ConfigMismatch, check_export, mismatches
from llmc.pipeline.ids import Kind
from llmc.planning.plan import make_plan
from llmc.recipe.load import parse_recipe
from llmc.storage.store import COMPLETE_MARKER, Store
from llmc.result import EvalId
from tests.unit.families import make_tiny

PROJECTION = "model.per_layer_model_projection"
FP8_STATIC = {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
              "activations": {"format": "fp8_e4m3", "strategy": "tensor", "dynamic": False}}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> Path:
    return make_tiny("gemma4", tmp_path_factory.mktemp("gemma4") / "model")


def _text(root: Path) -> dict:
    words = ["the", "jury", "said", "it", "did", "find", "that", "many", "of", "voters", "had", "been"]
    rng = random.Random(0)
    (root / "text").mkdir(exist_ok=True)
    for d in range(12):
        (root / "text" / f"doc{d:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)))
    return {"kind": "text", "path": str(root / "text"), "holdout": 3}


def _recipe(model: Path, root: Path, quantization: dict, targets: list[dict], ignore: tuple[str, ...] = ("lm_head",)):
    source = _text(root)
    return parse_recipe(yaml.safe_dump({
        "name": "described", "model": {"source": str(model)}, "quantization": {**quantization, "ignore": list(ignore)},
        "calibration": {"dataset": source, "samples": 8, "seq_len": 32, "seed": 0},
        "targets": targets,
        "eval": {"corpus": source, "seq_len": 32, "windows": 4, "runtimes": ["torch"], "decode_tokens": 2,
                 "throughput_repeats": 1, "bootstrap_samples": 100},
        "gates": {"max_ppl_increase_pct": 50.0},
        "publish": {"registry": str(root / "registry")},
    }))


def test_gemma4_fp8_static_build_is_measured_and_its_config_ignores_the_outer_linear(gemma4: Path,
                                                                                    tmp_path: Path) -> None:
    """On 8a48c9f the config claimed per_layer_model_projection (targets Linear, ignore lm_head) while it was stored
    F32 without scales: the torch engine refused the artifact, no gate was measured, the build failed (exit 5)."""
    recipe = _recipe(gemma4, tmp_path, FP8_STATIC, [{"runtime": "vllm", "gpu_arch": "sm90"}])
    plan = make_plan(recipe, gemma4)
    assert any(w.startswith(f"{PROJECTION}: Linear outside the decoder layers, kept in the model's dtype")
               for w in plan.warnings), plan.warnings
    result = build(recipe, Store(tmp_path / "cache"), publish=False)
    (artifact,) = result.artifacts.values()
    q = json.loads((artifact.dir / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head", PROJECTION]
    quantized = result.evals[EvalId("torch", artifact.label)]
    assert quantized.error is None and quantized.perplexity is not None and quantized.kld is not None, quantized.error
    assert result.verdicts and all(v.passed and v.evaluated for v in result.verdicts), result.verdicts


@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("llama") / "model", tie_word_embeddings=False)


def test_w4a16_gemma4_lists_the_outer_linear(gemma4: Path, tmp_path: Path) -> None:
    recipe = _recipe(gemma4, tmp_path, {"weights": {"format": "int4", "strategy": "channel"}},
                     [{"runtime": "vllm", "gpu_arch": "sm90"}])
    (artifact,) = build_until(recipe, Store(tmp_path / "cache"), Kind.EXPORT).artifacts.values()
    q = json.loads((artifact.dir / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head", PROJECTION]


def test_an_output_head_left_out_of_ignore_is_listed_by_modelopt(untied_llama: Path, tmp_path: Path) -> None:
    """TensorRT-LLM takes no Gemma-4; an untied lm_head the recipe does not ignore is the same case there: the
    stream quantizes the decoder layers only, so the head stays in its dtype and exclude_modules must say so."""
    recipe = _recipe(untied_llama, tmp_path, {
        "weights": {"format": "fp8_e4m3", "strategy": "tensor"},
        "activations": {"format": "fp8_e4m3", "strategy": "tensor", "dynamic": False}},
        [{"runtime": "tensorrt-llm", "gpu_arch": "sm90"}], ignore=())
    assert any(w.startswith("lm_head: Linear outside the decoder layers") for w in make_plan(recipe,
                                                                                            untied_llama).warnings)
    (artifact,) = build_until(recipe, Store(tmp_path / "cache"), Kind.EXPORT).artifacts.values()
    q = json.loads((artifact.dir / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "modelopt" and "lm_head" in q["ignore"]
    hq = json.loads((artifact.dir / "hf_quant_config.json").read_text())["quantization"]
    assert "lm_head" in hq["exclude_modules"]
    check_export(artifact.dir, json.loads((untied_llama / "config.json").read_text()))


def test_the_check_names_a_claimed_linear_without_scales() -> None:
    fp8 = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}}}
    linears = ["lm_head", "model.layers.0.mlp.down_proj", PROJECTION]
    stored = {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale",
              "model.layers.0.mlp.down_proj.input_scale", f"{PROJECTION}.weight", "model.embed_tokens.weight"}
    (line,) = mismatches(fp8, linears, stored)
    assert line.startswith(f"{PROJECTION}: the config quantizes it but the files lack {PROJECTION}.weight_scale")
    assert f"{PROJECTION}.input_scale" in line
    assert mismatches({**fp8, "ignore": ["lm_head", PROJECTION]}, linears, stored) == []
    # a Linear neither targeted nor ignored, and an ignored one that holds scales
    only_mlp = {**fp8, "config_groups": {"g": {**fp8["config_groups"]["group_0"], "targets": ["re:.*mlp.*"]}}}
    assert mismatches(only_mlp, linears, stored) == [f"{PROJECTION}: neither targeted by a config group nor in ignore"]
    assert mismatches({**fp8, "ignore": ["lm_head", PROJECTION, "model.layers.0.mlp.down_proj"]}, linears, stored) == [
        "model.layers.0.mlp.down_proj: the config leaves it unquantized but the files hold input_scale, weight_scale"]
    gptq = {"quant_method": "gptq", "bits": 4}
    assert mismatches(gptq, linears, {f"{PROJECTION}.weight"})[-1] == (
        f"{PROJECTION}: the config quantizes it but the files lack {PROJECTION}.qweight, {PROJECTION}.qzeros, "
        f"{PROJECTION}.scales")
    assert mismatches({**gptq, "dynamic": {rf"-:{PROJECTION}$": {}}}, [PROJECTION], {f"{PROJECTION}.weight"}) == []
    awq = {"quant_method": "awq", "modules_to_not_convert": ["lm_head", PROJECTION]}
    assert mismatches(awq, ["lm_head", PROJECTION], {f"{PROJECTION}.weight"}) == []


def test_an_export_whose_config_misdescribes_it_is_never_recorded(tiny_model_session: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A writer that drops one Linear's scale (a stand-in for any exporter bug): the export stage fails naming the
    Linear, and no complete export is left in the cache for a later build to pick up."""
    from llmc.runtimes import catalog

    fmt = catalog.artifact_format("compressed-tensors")
    write = type(fmt).write
    dropped = "model.layers.1.self_attn.o_proj"

    def lossy(self, request, out: Path) -> None:
        write(self, request, out)
        for shard in out.glob("*.safetensors"):
            tensors = load_file(shard)
            if f"{dropped}.weight_scale" in tensors:
                del tensors[f"{dropped}.weight_scale"]
                save_file(tensors, shard, metadata={"format": "pt"})

    monkeypatch.setattr(type(fmt), "write", lossy)
    recipe = parse_recipe(yaml.safe_dump({
        "name": "lossy", "model": {"source": str(tiny_model_session)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"}},  # data-free: seconds
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}], "eval": {"seq_len": 32, "windows": 2}}))
    with pytest.raises(ConfigMismatch, match=rf"{dropped}: the config quantizes it but the files lack "
                                             rf"{dropped}\.weight_scale"):
        build_until(recipe, Store(tmp_path / "cache"), Kind.EXPORT)
    exports = tmp_path / "cache" / "stages" / "export"
    assert not [d for d in exports.glob("*") if (d / COMPLETE_MARKER).is_file()]
