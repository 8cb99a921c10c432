"""Recipe validation: every error class is one RecipeError naming key, value and fix — never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmc.errors import RecipeError
from llmc.recipe.load import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "name": "r",
    "model": {"source": "demo:smollm2-135m"},
    "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
    "targets": [{"runtime": "vllm"}],
}


def with_(path: str, value) -> str:
    r = yaml.safe_load(yaml.safe_dump(BASE))
    node = r
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {}) if not p.isdigit() else node[int(p)]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return yaml.safe_dump(r)


_DELETE = object()

CASES = {
    # id: (recipe text, substrings the one message must contain)
    "unknown key with did-you-mean": (with_("model.dtyp", "float32"), ["model.dtyp", "did you mean 'dtype'", "fix:"]),
    "missing key": (with_("targets", _DELETE) if False else yaml.safe_dump({k: v for k, v in BASE.items() if k != "model"}),
                    ["missing key 'model'", "fix:"]),
    "wrong type": (with_("calibration.samples", "many"), ["calibration.samples", "'many'", "whole number", "fix:"]),
    "bad literal": (with_("targets", [{"runtime": "vlm"}]), ["targets[0].runtime", "'vlm'", "'vllm'", "fix:"]),
    "group without size": (with_("quantization.weights", {"format": "int4", "strategy": "group"}),
                           ["quantization.weights", "needs group_size", "fix:"]),
    "group size not multiple of 16": (with_("quantization.weights", {"format": "int4", "strategy": "group", "group_size": 100}),
                                      ["group_size 100", "fix:"]),
    "group size without group strategy": (with_("quantization.weights", {"format": "int8", "strategy": "channel", "group_size": 64}),
                                          ["only meaningful with strategy 'group'", "fix:"]),
    "int4 activations": (with_("quantization.activations", {"format": "int4", "strategy": "tensor"}),
                         ["quantization.activations", "4-bit integer activations", "fix:"]),
    "token without dynamic": (with_("quantization.activations", {"format": "int8", "strategy": "token"}),
                              ["per-token", "dynamic: true", "fix:"]),
    "weight/activation pair": (with_("quantization.activations", {"format": "fp8_e4m3", "strategy": "tensor"}),
                               ["weights int8 with activations fp8_e4m3", "fix:", "W8A8-INT8"]),
    "smoothquant without activations": (with_("quantization.algorithm", "smoothquant"),
                                        ["smoothquant", "activations", "fix:"]),
    "awq on int8": (with_("quantization.algorithm", "awq"), ["awq is a 4-bit", "fix:"]),
    "tp not power of two": (with_("targets", [{"runtime": "vllm", "tensor_parallel": 3}]),
                            ["targets[0].tensor_parallel", "tensor_parallel 3", "fix:"]),
    "bad version range": (with_("targets", [{"runtime": "vllm", "version": "newest"}]),
                          ["targets[0].version", "'newest' is not a version range", "fix:"]),
    "duplicate targets": (with_("targets", [{"runtime": "vllm"}, {"runtime": "vllm"}]), ["targets repeat", "fix:"]),
    "fp8 asymmetric": (with_("quantization.weights", {"format": "fp8_e4m3", "strategy": "channel", "symmetric": False}),
                       ["fp8_e4m3 is symmetric only", "fix:"]),
    "nvfp4 group": (with_("quantization.weights", {"format": "nvfp4", "strategy": "group", "group_size": 32}),
                    ["nvfp4 uses 16-element groups", "fix:"]),
    "weights token strategy": (with_("quantization.weights", {"format": "int8", "strategy": "token"}),
                               ["weights have no 'token' strategy", "fix:"]),
    "fp8_row scales on int8 weights": (with_("quantization.weights", {"format": "int8", "strategy": "channel",
                                                                      "scale_grid": "fp8_row"}),
                                       ["scale_grid fp8_row is for symmetric int4 group scales", "fix:"]),
    "bad name": (with_("name", "has spaces"), ["'name'", "'has spaces'", "fix:"]),
    "empty targets": (with_("targets", []), ["'targets'", "at least 1", "fix:"]),
    "quantization and variants": (with_("variants", [{"name": "a", "quantization": BASE["quantization"]}]),
                                  ["either 'quantization'", "fix:"]),
    "neither quantization nor variants": (with_("quantization", _DELETE), ["either 'quantization'", "fix:"]),
}


@pytest.mark.parametrize("case", CASES)
def test_each_error_class_is_one_clear_message(case: str) -> None:
    text, needles = CASES[case]
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, source="r.yaml")
    msg = str(e.value)
    assert msg.startswith("r.yaml"), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert e.value.exit_code == 2


def test_several_problems_are_reported_together() -> None:
    text = with_("model.dtyp", "x").replace("runtime: vllm", "runtime: vlm")
    with pytest.raises(RecipeError) as e:
        parse_recipe(text)
    assert "2 problems" in str(e.value) and "model.dtyp" in str(e.value) and "'vlm'" in str(e.value)


def test_duplicate_variant_names() -> None:
    r = {k: v for k, v in BASE.items() if k != "quantization"}
    r["variants"] = [{"name": "a", "quantization": BASE["quantization"]}] * 2
    with pytest.raises(RecipeError, match="variant names repeat"):
        parse_recipe(yaml.safe_dump(r))


@pytest.mark.parametrize("text, needle", [
    ("name: [unclosed", "not valid YAML at line 1"),
    ("- just\n- a list\n", "a recipe is a YAML mapping"),
    ("", "a recipe is a YAML mapping"),
])
def test_not_a_recipe_at_all(text: str, needle: str) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(text)
    assert needle in str(e.value) and "fix:" in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


W4 = {"format": "int4", "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("activations, scale_grid, algorithm, expected", [
    ({"format": "fp8_e4m3", "strategy": "token", "dynamic": True}, None, "gptq", "fp8_row"),  # vLLM's W4AFP8
    ({"format": "fp8_e4m3", "strategy": "token", "dynamic": True}, None, "rtn", "fp8_row"),
    ({"format": "fp8_e4m3", "strategy": "token", "dynamic": True}, None, "awq", None),  # measured worse on the grid
    ({"format": "fp8_e4m3", "strategy": "token", "dynamic": True}, "fp8_row", "awq", "fp8_row"),
    ({"format": "fp8_e4m3", "strategy": "token", "dynamic": True}, "float", "gptq", None),
    ({"format": "fp8_e4m3", "strategy": "tensor"}, None, "gptq", None),  # TensorRT-LLM's W4A8_AWQ rounds the weight
    (None, None, "gptq", None),
    (None, "fp8_row", "rtn", "fp8_row"),
])
def test_w4afp8_for_vllm_defaults_to_fp8_row_group_scales(activations, scale_grid, algorithm, expected) -> None:
    q = {"weights": {**W4, **({"scale_grid": scale_grid} if scale_grid else {})}, "algorithm": algorithm}
    if activations:
        q["activations"] = activations
    recipe = parse_recipe(with_("quantization", q))
    assert recipe.quantization.to_scheme().weights.scale_grid == expected


EXPECTED_SCHEMES = {
    "smollm2-fp8": ["W8A8-FP8"],
    "smollm2-fp8-dynamic": ["W8A8-FP8"],
    "smollm2-w8a8-int8": ["W8A8-INT8"],
    "smollm2-w4a16": ["W4A16-INT"],
    "smollm2-variants": ["W8A8-FP8", "W8A8-INT8", "W4A16-INT"],
}


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_parse_and_plan(path: Path) -> None:
    from llmc.planning.plan import make_plan

    recipe = load_recipe(path)
    assert recipe.name == path.stem
    schemes = [q.to_scheme().name for _, q in recipe.variant_sections()]
    if path.stem in EXPECTED_SCHEMES:
        assert schemes == EXPECTED_SCHEMES[path.stem]
    make_plan(recipe)  # every shipped recipe is compatible with its targets
