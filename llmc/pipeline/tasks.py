"""The tasks stage: eval.tasks through lm-evaluation-harness on the torch reference engine, for the baseline and
every artifact the torch engine scored, each cached under its model's content key.

Key: the tasks (their fingerprint), the limit, the dtype and the tokenizer; the scored model's content key. Cost
(llmc.eval.harness.tasks_cost): per scored model, from eval.task_limit or stated defaults; the torch reference loads
each model as the plan decided (`decide`, the evaluation's decision)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmc.data.sources import corpora_of
from llmc.engines import open_engine
from llmc.engines.registry import REFERENCE_ENGINE
from llmc.engines.torch_stream import TorchLoading, decide_torch_loading
from llmc.eval import harness  # imports lm-evaluation-harness itself only when a task runs
from llmc.pipeline.stage import Stage
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.evaluate import tokenizer_hash, torch_loading
from llmc.pipeline.export import Export
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.pipeline.runner import read_json
from llmc.result import BASELINE, EvalId
from llmc.storage.store import atomic_write_json, stage_key


class Tasks(Stage):
    id = StageId(Kind.TASKS)

    share = Share.MAIN

    def __init__(self, exports: Sequence[Export] = ()) -> None:
        self.exports = list(exports)  # the artifacts: those the torch reference reads get the tasks too

    def pending(self, b: Build) -> bool:
        return False  # no bytes in the plan's disk estimate (pending_parts says which tasks still run)

    def pending_parts(self, b: Build) -> list[StageId]:
        """The planned runs (`scored`) whose results are not in the cache yet."""
        if not b.recipe.eval.tasks:
            return []
        cfg = self._config(b)
        contents = [(BASELINE, b.result.source.sha256)] + [(e.label, e.cached_content_key(b)) for e in self.scored()]
        return [StageId(Kind.TASKS, (label,)) for label, content in contents
                if content is None or not b.runner.is_done(StageId(Kind.TASKS), stage_key("tasks", cfg, [content]))]

    def scored(self) -> list[Export]:
        """The artifacts the tasks run on besides the baseline: each the torch reference reads, one per set of
        files (their content is the same: the runner's cache serves the second)."""
        seen, out = set(), []
        for e in self.exports:
            if REFERENCE_ENGINE in e.format.read_by and e.same_files() not in seen:
                seen.add(e.same_files())
                out.append(e)
        return out

    def decide(self, c: Costing) -> TorchLoading:
        """How the torch reference loads each model the tasks run on: as the evaluate stage decides it
        (`decide_torch_loading`)."""
        return decide_torch_loading(c.shape.params * c.elem, c.machine.available)

    def cost(self, c: Costing) -> None:
        """A row per model the tasks run on (llmc.eval.harness.tasks_cost: the recipe does not say how large a task
        is, so eval.task_limit, else a stated default, sets it)."""
        ev = c.recipe.eval
        if not ev.tasks:
            return
        decision = self.decide(c)
        for label, model_bytes in [(BASELINE, float(c.shape.stored_bytes))] + [
                (e.label, e.artifact_bytes(c)) for e in self.scored()]:
            row = harness.tasks_cost(c.shape, tasks=ev.tasks, limit=ev.task_limit, streamed=decision.streamed,
                                     compute=c.compute, model_bytes=model_bytes)
            row.named(StageId(Kind.TASKS, (label,)))
            row.decision = decision
            c.rows.append(row)

    def _config(self, b: Build) -> dict:
        return {"tasks": harness.tasks_fingerprint(b.recipe.eval.tasks), "limit": b.recipe.eval.task_limit,
                "dtype": b.result.dtype, "tokenizer_sha256": tokenizer_hash(b.runner, b.result.source.folder)}

    def run(self, b: Build) -> None:
        ev, dtype = b.recipe.eval, b.result.dtype
        if not ev.tasks:
            return
        cfg = self._config(b)

        def run(folder: Path, content_key: str, label: str) -> dict:
            # the plan's decision (its row for the baseline: every model is loaded alike), else decided here
            streamed = torch_loading(b, StageId(Kind.TASKS, (BASELINE,)), folder).streamed

            def produce(out: Path) -> None:
                with open_engine(REFERENCE_ENGINE, folder, dtype=dtype, streamed=streamed) as eng:
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
