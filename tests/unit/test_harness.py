"""eval.tasks: a small local multiple-choice task through lm-evaluation-harness on llmc's torch engine, for the
baseline and the artifact, with intervals and the accuracy-ratio gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("lm_eval")

from llmc.build import build_until  # noqa: E402
from llmc.data.bos import bos_decision  # noqa: E402
from llmc.recipe.load import parse_recipe  # noqa: E402
from llmc.storage.store import Store  # noqa: E402
from llmc.result import EvalId  # noqa: E402

WORDS = "the jury said it did find that many of the voters had been registered in the county".split()


def _task(tmp_path: Path, n: int = 12) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    rows = [{"question": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)),
             "choices": [WORDS[(i + 6) % len(WORDS)], WORDS[(i * 5 + 1) % len(WORDS)], "0123"], "answer": i % 3}
            for i in range(n)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny_mc.yaml").write_text(yaml.safe_dump({
        "task": "llmc_tiny_mc", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / "mc.jsonl")}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    return folder / "tiny_mc.yaml"


def _expected_accuracy(model_dir: Path, rows: list[dict]) -> float:
    """Accuracy computed by hand: the choice with the highest summed log-prob after 'question' + ' '."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for r in rows:
        decision = bos_decision(tok)  # the windows' rule: a BOS only where the tokenizer adds one
        ctx = ([decision.token_id] if decision.used else []) + tok(r["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for c in r["choices"]:
            cont = tok(" " + c, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ctx + cont])).logits[0].float(), -1)
            scores.append(sum(logp[len(ctx) - 1 + k, t].item() for k, t in enumerate(cont)))
        right += int(max(range(len(scores)), key=scores.__getitem__) == r["answer"])
    return right / len(rows)


@pytest.mark.slow  # lm_eval import + two harness runs: ~1-3 min on 2 shared cores
def test_local_task_for_baseline_and_artifact_with_interval_and_gate(tiny_model: Path, tmp_path: Path) -> None:
    task = _task(tmp_path)
    recipe = parse_recipe(yaml.safe_dump({
        "name": "tiny-tasks", "model": {"source": str(tiny_model)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 48, "windows": 4, "decode_tokens": 0, "throughput_repeats": 1, "bootstrap_samples": 200,
                 "tasks": [str(task)]},
        "gates": {"min_task_accuracy_ratio": 0.5},
    }))
    result = build_until(recipe, Store(tmp_path / "cache"), "gate")
    base = result.evals[EvalId("torch", "baseline")].tasks["llmc_tiny_mc"]
    rows = [json.loads(x) for x in (task.parent / "mc.jsonl").read_text().splitlines()]
    assert base["acc"] == pytest.approx(_expected_accuracy(tiny_model, rows)) and base["n"] == 12
    assert base["ci_low"] <= base["acc"] <= base["ci_high"] and base["stderr"] > 0
    art = result.evals[EvalId("torch", "vllm-sm90-tp1")].tasks["llmc_tiny_mc"]
    gate = next(v for v in result.verdicts if v.gate == "min_task_accuracy_ratio:llmc_tiny_mc")
    assert gate.passed == (art["ci_low"] / base["acc"] >= 0.5)

    from llmc.eval.report import render_markdown

    assert "| torch:baseline | llmc_tiny_mc | acc" in render_markdown(result)


def test_tasks_need_the_torch_engine() -> None:
    from pydantic import ValidationError

    from llmc.recipe.schema import EvalSection

    with pytest.raises(ValidationError, match="add torch to eval.runtimes"):
        EvalSection(tasks=("x.yaml",), runtimes=("vllm",))
