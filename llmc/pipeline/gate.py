"""The gate stage: the recipe's gates applied to the build's evaluations (re-applied on every run: gates enter no
key, so changing a threshold recomputes nothing). A failed gate fails the build (`raise_for_gates`)."""

from __future__ import annotations

from llmc.data.sources import corpora_of
from llmc.errors import PerformanceGateError, QualityGateError
from llmc.eval.gates import gate_build
from llmc.eval.harness import task_verdicts
from llmc.pipeline.stage import Stage
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.result import BASELINE, BuildResult, EvalId


class Gate(Stage):
    id = StageId(Kind.GATE)

    share = Share.MAIN

    def pending(self, b: Build) -> bool:
        return False  # no row in the plan's disk estimate

    def cost(self, c: Costing) -> None:
        pass  # arithmetic on the evaluations

    def run(self, b: Build) -> None:
        apply_gates(b.result)


def apply_gates(result: BuildResult) -> None:
    """Append the build's verdicts: per artifact, failing closed on what no engine measured; then eval.tasks'
    accuracy against the baseline's (llmc.eval.harness)."""
    result.verdicts += gate_build(result)
    if result.recipe.eval.tasks:
        first = next(iter(corpora_of(result.recipe.eval.corpus)))  # where the tasks stage put the results
        base_id = EvalId("torch", BASELINE, first)
        base = result.evals.get(base_id)
        for this, m in result.evals.items():
            if m.engine == "torch" and m.corpus == first and this != base_id and m.succeeded:
                result.verdicts += task_verdicts(result.recipe.gates.min_task_accuracy_ratio, this,
                                                 base.tasks if base else None, m.tasks)


def raise_for_gates(result: BuildResult) -> None:
    failed = [v for v in result.verdicts if not v.passed]
    if not failed:
        return
    msg = "; ".join(f"{v.target} {v.gate}: measured {v.measured}, threshold {v.threshold}" for v in failed)
    fix = "inspect report.md; relax the gate only if the loss is acceptable"
    if any(not v.evaluated for v in failed):
        fix = ("add an engine that measures the gate for that artifact to eval.runtimes (see the reason), or set "
               "gates.allow_unevaluated: true to publish it unmeasured; " + fix)
    if any(v.kind in ("quality", "availability") for v in failed):
        raise QualityGateError(f"gate failed, build not published: {msg}", fix=fix)
    raise PerformanceGateError(f"gate failed, build not published: {msg}", fix=fix)
