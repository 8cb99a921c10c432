"""Every evaluation engine is planned (issue 44): each scoring in eval.runtimes has a plan row with its time, memory
and decision, costed by the engine's own module, counted in resources.max_hours; the torch reference's loading is
decided once, by a decide function, and passed to the engine."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from llmc.engines import engine_spec
from llmc.pipeline.ids import Kind
from llmc.planning.plan import make_plan
from llmc.recipe.load import parse_recipe
from tests.unit.test_plan_honest import pin_probes

REPO = Path(__file__).resolve().parents[2]
INT4 = {"weights": {"format": "int4", "strategy": "group", "group_size": 32, "symmetric": True}}
TARGETS = [{"runtime": "vllm", "gpu_arch": "sm90"}, {"runtime": "onnxruntime", "gpu_arch": "cpu"},
           {"runtime": "llama.cpp", "gpu_arch": "cpu"}, {"runtime": "exllamav2", "gpu_arch": "sm90"}]


def _recipe(source: Path, runtimes: list[str], **eval_keys) -> dict:
    return {"name": "engines", "model": {"source": str(source)}, "quantization": INT4, "targets": TARGETS,
            "eval": {"windows": 4, "seq_len": 64, "runtimes": runtimes, **eval_keys}}


def _eval_rows(plan) -> dict[tuple[str, ...], object]:
    return {r.id.of: r for r in plan.rows if r.id.kind is Kind.EVAL}


def test_each_eval_engine_plans_a_row_per_scoring_with_its_decision_in_plan_json(tiny_model: Path, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    from click.testing import CliRunner

    from llmc.cli import main

    pin_probes(monkeypatch)
    runtimes = ["torch", "onnxruntime", "llama.cpp", "gptqmodel", "vllm"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_model, runtimes)))
    result = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--json", "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    stages = {s["stage"]: s for s in json.loads(result.output)["estimates"]["stages"]}
    scheme = next(n.split()[-1] for n in stages if n.startswith("quantize "))
    expected = {"eval torch baseline", f"eval torch {scheme}", "eval onnxruntime onnxruntime-cpu-tp1",
                "eval llama.cpp llama.cpp-cpu-tp1", "eval gptqmodel exllamav2-sm90-tp1", "eval vllm baseline"}
    int4 = parse_recipe(recipe.read_text()).quantization.to_scheme()
    if engine_spec("vllm").cannot_run(int4) is None:  # vLLM-CPU's capability data decides whether it runs W4A16
        expected.add("eval vllm vllm-sm90-tp1")
    assert {n for n in stages if n.startswith("eval ")} == expected
    for name in expected - {"eval torch baseline", f"eval torch {scheme}"}:
        row = stages[name]
        engine = name.split()[1]
        assert row["seconds"] > 0 and row["host_gb"] > 0, row
        assert row["decision"] == {"engine": engine, "paired_with": engine_spec(engine).baseline_engine,
                                   "artifact": not name.endswith(" baseline")}
    assert stages["eval torch baseline"]["decision"] == {"streamed": False}
    # vLLM's start-up is not measured on this CPU: its row says so rather than passing an assumption off as measured
    assert "not measured" in stages["eval vllm baseline"]["why"]


def test_an_engine_paired_with_the_torch_baseline_plans_that_baseline_even_without_torch_in_eval_runtimes(
        tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    pin_probes(monkeypatch)
    plan = make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["onnxruntime"]))), tiny_model, tmp_path)
    assert set(_eval_rows(plan)) == {("torch", "baseline"), ("onnxruntime", "onnxruntime-cpu-tp1")}


def test_the_eval_rows_of_other_engines_count_toward_max_hours(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    from llmc.errors import ResourceError

    pin_probes(monkeypatch)
    torch_only = make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["torch"]))), tiny_model, tmp_path)
    both = make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["torch", "onnxruntime"]))), tiny_model, tmp_path)
    ort = _eval_rows(both)[("onnxruntime", "onnxruntime-cpu-tp1")]
    assert both.seconds == pytest.approx(torch_only.seconds + ort.seconds)
    assert both.eval_s == pytest.approx(torch_only.eval_s + ort.seconds)
    # a budget the torch rows fit in and the ONNX Runtime row pushes over
    budget = (torch_only.seconds + ort.seconds / 2) / 3600
    make_plan(parse_recipe(yaml.safe_dump({**_recipe(tiny_model, ["torch"]), "resources": {"max_hours": budget}})),
              tiny_model, tmp_path)
    with pytest.raises(ResourceError, match="resources.max_hours"):
        make_plan(parse_recipe(yaml.safe_dump({**_recipe(tiny_model, ["torch", "onnxruntime"]),
                                               "resources": {"max_hours": budget}})), tiny_model, tmp_path)


def test_each_eval_engine_costs_another_corpus_as_another_evaluation(tiny_model: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    pin_probes(monkeypatch)
    text = tmp_path / "austen.txt"
    text.write_text("It is a truth universally acknowledged. " * 400)
    one = make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["torch", "llama.cpp"], corpus="brown"))),
                    tiny_model, tmp_path)
    two = make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["torch", "llama.cpp"], corpus=[
        "brown", {"kind": "text", "path": str(text)}]))), tiny_model, tmp_path)
    key = ("llama.cpp", "llama.cpp-cpu-tp1")
    assert _eval_rows(two)[key].seconds == pytest.approx(2 * _eval_rows(one)[key].seconds)
    assert _eval_rows(two)[key].host_bytes == _eval_rows(one)[key].host_bytes


def test_eval_tasks_are_planned_per_scored_model_from_the_task_limit_or_a_stated_default(
        tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    pin_probes(monkeypatch)

    def tasks_rows(**keys):
        plan = make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["torch"], tasks=["arc_easy"], **keys))),
                         tiny_model, tmp_path)
        return plan, {r.id.of: r for r in plan.rows if r.id.kind is Kind.TASKS}

    plan, limited = tasks_rows(task_limit=5)
    # the baseline and each artifact the torch reference reads (the vLLM target's compressed-tensors)
    assert set(limited) == {("baseline",), ("vllm-sm90-tp1",)}
    assert all("eval.task_limit 5" in r.why and "assumed" in r.why for r in limited.values())
    # its loading is the evaluation's, decided once
    assert all(r.decision == plan.decision_of(_torch_baseline()) for r in limited.values())
    _, unlimited = tasks_rows()
    assert "a stated default" in unlimited[("baseline",)].why
    assert unlimited[("baseline",)].seconds > limited[("baseline",)].seconds
    assert not {r.id for r in make_plan(parse_recipe(yaml.safe_dump(_recipe(tiny_model, ["torch"]))), tiny_model,
                                        tmp_path).rows if r.id.kind is Kind.TASKS}


def _torch_baseline():
    from llmc.pipeline.ids import StageId

    return StageId(Kind.EVAL, ("torch", "baseline"))


# ------------------------------------------------------------------ the torch reference's loading, decided once


def _callers_of(name: str) -> list[tuple[str, str]]:
    """(file, enclosing function) of every call of `name` in llmc/."""
    found = []
    for f in sorted((REPO / "llmc").rglob("*.py")):
        text = f.read_text()
        if name not in text:  # parse only the files that name it
            continue
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    called = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) \
                        else None
                    if called == name:
                        found.append((f.relative_to(REPO).as_posix(), fn.name))
    return found


def test_choose_streamed_is_called_only_from_a_decide_function() -> None:
    callers = _callers_of("choose_streamed")
    assert callers and all(fn.startswith("decide") for _, fn in callers), callers


def test_the_torch_engine_takes_its_loading_from_its_caller(tiny_model: Path, monkeypatch) -> None:
    from llmc.engines import open_engine
    from llmc.engines.torch_stream import STRATEGY_VARIABLE, decide_torch_loading_of
    from llmc.eval.standalone import torch_streamed

    with pytest.raises(TypeError, match="decide_torch_loading"):
        open_engine("torch", tiny_model)
    with open_engine("torch", tiny_model, streamed=True) as eng:
        assert eng.streamed
    monkeypatch.setenv(STRATEGY_VARIABLE, "streamed")
    assert decide_torch_loading_of(tiny_model, "float32").streamed and torch_streamed("torch", tiny_model)
    assert torch_streamed("onnxruntime", tiny_model) is None  # other engines load as they load
    monkeypatch.setenv(STRATEGY_VARIABLE, "auto")
    monkeypatch.setattr("llmc.engines.torch_stream.memory_available", lambda: 10)  # too small for the dense model
    assert decide_torch_loading_of(tiny_model, "float32").streamed
    monkeypatch.setattr("llmc.engines.torch_stream.memory_available", lambda: 10**12)
    assert not torch_streamed("torch", tiny_model)
