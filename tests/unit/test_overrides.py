"""`--set key.path=value`: applied before validation, validated like the recipe, recorded in the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from llmc.cli import main
from llmc.errors import RecipeError
from llmc.recipe.load import load_recipe, parse_recipe
from llmc.recipe.overrides import apply_overrides, parse_override

RECIPE = {"name": "o", "model": {"source": "demo:smollm2-135m"},
          "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
          "targets": [{"runtime": "vllm"}, {"runtime": "vllm", "gpu_arch": "sm89"}]}


def test_paths_and_values_parse_as_yaml() -> None:
    assert parse_override("targets[0].tensor_parallel=8") == (["targets", 0, "tensor_parallel"], 8)
    assert parse_override("eval.runtimes=[torch, vllm]") == (["eval", "runtimes"], ["torch", "vllm"])
    assert parse_override("model.name='8'") == (["model", "name"], "8")
    assert parse_override("model.source=/ckpts/a=b") == (["model", "source"], "/ckpts/a=b")


def test_overrides_change_the_recipe_and_later_ones_win() -> None:
    r = parse_recipe(yaml.safe_dump(RECIPE), overrides=["targets[1].tensor_parallel=4", "calibration.samples=8",
                                                         "calibration.samples=16", "model.source=/x/y"])
    assert r.targets[1].tensor_parallel == 4 and r.targets[0].tensor_parallel == 1
    assert r.calibration.samples == 16 and r.model.source == "/x/y"
    assert RECIPE["targets"][1] == {"runtime": "vllm", "gpu_arch": "sm89"}  # the caller's data is not modified


@pytest.mark.parametrize("override, expected", [
    ("targets[0].tensor_parallel=3", "tensor_parallel"),  # validated like the recipe: not a power of two
    ("targets[0].tensor_paralel=2", "did you mean 'tensor_parallel'"),
    ("calibration.samples=many", "calibration.samples"),
    ("targets[5].tensor_parallel=2", "targets[5] does not exist"),
    ("model.source.path=x", "not a mapping"),
    ("=3", "no key=value"),
    ("targets.0=3", "is not a key"),
    ("model=[unclosed", "not valid YAML"),
])
def test_bad_overrides_are_recipe_errors_naming_the_key(override: str, expected: str) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(yaml.safe_dump(RECIPE), overrides=[override])
    assert expected in e.value.message + (e.value.fix or "")
    assert e.value.exit_code == 2


def test_too_many_overrides_are_refused() -> None:
    with pytest.raises(RecipeError, match="at most"):
        apply_overrides({}, [f"a{i}=1" for i in range(100)])


def test_cli_plan_takes_set_and_exits_2_on_a_bad_value(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    res = CliRunner().invoke(main, ["plan", str(path), "--set", "targets[0].tensor_parallel=6"])
    assert res.exit_code == 2 and "tensor_parallel 6 is not a power of two" in res.output
    assert load_recipe(path, ["targets[0].gpu_arch=sm80"]).targets[0].gpu_arch == "sm80"
