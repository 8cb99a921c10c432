"""The tasks stage: eval.tasks through lm-evaluation-harness on the torch reference engine, for the baseline and
every artifact the torch engine scored, each cached under its model's content key.

Key: the tasks (their fingerprint), the limit, the dtype and the tokenizer; the scored model's content key."""

from __future__ import annotations

from pathlib import Path

from llmc.data.sources import corpora_of
from llmc.engines import open_engine
from llmc.eval import harness  # imports lm-evaluation-harness itself only when a task runs
from llmc.pipeline.stage import Stage
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.evaluate import tokenizer_hash
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.pipeline.runner import read_json
from llmc.result import BASELINE, EvalId
from llmc.storage.store import atomic_write_json, stage_key


class Tasks(Stage):
    id = StageId(Kind.TASKS)

    share = Share.MAIN

    def pending(self, b: Build) -> bool:
        return False  # no row in the plan's disk estimate

    def cost(self, c: Costing) -> None:
        pass  # not planned yet: lm-evaluation-harness's tasks vary too much to predict from the recipe

    def run(self, b: Build) -> None:
        ev, dtype = b.recipe.eval, b.result.dtype
        if not ev.tasks:
            return
        cfg = {"tasks": harness.tasks_fingerprint(ev.tasks), "limit": ev.task_limit, "dtype": dtype,
               "tokenizer_sha256": tokenizer_hash(b.runner, b.result.source.folder)}

        def run(folder: Path, content_key: str, label: str) -> dict:
            def produce(out: Path) -> None:
                with open_engine("torch", folder, dtype=dtype) as eng:
                    atomic_write_json(out / "tasks.json", harness.run_tasks(eng, b.tokenizer, ev.tasks,
                                                                            limit=ev.task_limit))

            done = b.runner.run(StageId(Kind.TASKS, (label,)), stage_key("tasks", cfg, [content_key]), produce,
                                announce=f"tasks: {', '.join(ev.tasks)} on {label} (lm-evaluation-harness, "
                                         "torch engine)")
            return read_json(done, "tasks.json")

        first = first_corpus(b)  # tasks read no corpus: their results sit on the first corpus's rows
        base = b.result.evals.get(EvalId("torch", BASELINE, first))
        if base is not None:
            base.tasks = run(b.result.source.folder, b.result.source.sha256, BASELINE)
        for target_label, art in b.result.artifacts.items():
            m = b.result.evals.get(EvalId("torch", target_label, first))
            if m is not None and m.succeeded:
                m.tasks = run(art.dir, art.content_key, target_label)


def first_corpus(b: Build) -> str | None:
    """The corpus whose evaluation rows carry the tasks' results."""
    return next(iter(corpora_of(b.recipe.eval.corpus)))
