"""What a build produced, typed: its stages, artifacts, evaluations and gate verdicts.

`llmc.build` fills a BuildResult; the reports (`llmc.eval`), the registry (`llmc.publish`) and the CLI read it.
They import this module, never the orchestrator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from llmc.model.source import ModelSource
    from llmc.pipeline.ids import StageId
    from llmc.quant.spec import Scheme
    from llmc.recipe.schema import Recipe


BASELINE = "baseline"  # the label of the unquantized source's evaluations


@dataclass(frozen=True)
class EvalId:
    """Which evaluation: `engine`'s measurement of artifact `label` (or of the unquantized BASELINE) on eval corpus
    `corpus` (None when the recipe has one corpus). A gate verdict no engine measured names the artifact alone:
    `engine` is None.

    Its string form, written wherever a string must stand for it (report.json's keys, junit names, report.md), is
    "<engine>:<label>", plus "@<corpus>" when eval.corpus names several corpora, or "<label>[@<corpus>]" without an
    engine: the form reports always had, so old reports still read. Artifact and corpus labels are safe names,
    which never hold ':' or '@'."""

    engine: str | None
    label: str
    corpus: str | None = None

    def __str__(self) -> str:
        return ((f"{self.engine}:" if self.engine is not None else "") + self.label
                + (f"@{self.corpus}" if self.corpus is not None else ""))

    @classmethod
    def parse(cls, text: str) -> EvalId:
        """The id whose string form is `text` (the inverse of str())."""
        engine, colon, rest = text.partition(":")
        label, _, corpus = (rest if colon else text).partition("@")
        if not label or (colon and not engine):
            raise ValueError(f"not an evaluation id: {text!r} (expected '<engine>:<label>[@<corpus>]')")
        return cls(engine if colon else None, label, corpus or None)

    @property
    def is_baseline(self) -> bool:
        return self.label == BASELINE

    def baseline(self, engine: str | None = None) -> EvalId:
        """The baseline evaluation on the same corpus, by `engine` (default: this id's engine) — the one a change
        is paired with."""
        return EvalId(engine or self.engine, BASELINE, self.corpus)


@dataclass(frozen=True)
class StageRecord:
    name: str
    key: str
    cached: bool
    seconds: float
    decision: dict | None = None  # the decision the stage executed (the quantize stage's layer loop), as planned


@dataclass(frozen=True)
class Artifact:
    """One exported artifact: a target's files in the stage cache."""

    label: str  # "<target label>" or "<variant>/<target label>"
    dir: Path
    key: str  # the export stage key
    files: dict[str, str]  # top-level file name -> sha256
    content_key: str  # hash of the files that evaluation reads (targets sharing weights share evaluations)
    format: str  # the artifact format's name in `llmc.runtimes`
    target: dict  # the recipe target as it enters stage keys
    scheme: str  # the scheme's name, e.g. W8A8-FP8
    scheme_detail: dict  # Scheme.to_dict()


@dataclass
class Evaluation:
    """One engine's measurement of one model folder (an artifact, or the baseline), or why there is none.

    Intervals are dicts as `llmc.eval.metrics` makes them ({mean, ci_low, ci_high} and the paired perplexity
    change's {delta_pct, ci_low_pct, ci_high_pct})."""

    engine: str
    corpus: str | None = None  # the eval.corpus label it was scored on; None when the recipe has one corpus
    protocol: dict | None = None  # what entered the eval stage key (windows, seq_len, dtype, ...)
    load_s: float | None = None
    score_s: float | None = None
    throughput: dict | None = None  # prefill/decode tokens/s summaries, engine version, threads
    hardware: dict | None = None
    key: str | None = None  # the eval stage key
    perplexity: float | None = None
    ppl_ci95: list[float] | None = None
    measures: list[str] | None = None  # metrics this engine measures (gates apply only to those)
    kld: dict | None = None
    kld_kind: str | None = None  # which KL `kld` is: "exact" (full vocabulary) | "topk_lower_bound" (llmc.engines.agreement)
    kld_bound: dict | None = None  # the top-k lower bound beside an exact `kld`, for comparison
    output_head: dict | None = None  # baseline: whether its output head reproduced its logits (exact KL), or why not
    top1_agreement: dict | None = None
    ppl_change: dict | None = None  # paired against the baseline (artifacts only)
    baseline_engine: str | None = None  # the engine whose baseline the change is paired with
    error: str | None = None  # the evaluation failed: why
    skipped: str | None = None  # the engine cannot run this artifact here: why (not gated)
    tasks: dict | None = None  # eval.tasks (lm-evaluation-harness): {task: {metric, acc, stderr, ci_low, ci_high, n}}
    measured_files: dict | None = None  # artifact file -> sha256 of the bytes this evaluation measured
    nll: torch.Tensor | None = field(default=None, repr=False)  # per-token NLL [windows, seq-1]; not serialized

    @property
    def succeeded(self) -> bool:
        return self.error is None and self.skipped is None

    def to_dict(self) -> dict:
        """The JSON form (report.json, manifest): every field that is set, except the tensors."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "nll" and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Verdict:
    gate: str
    target: EvalId  # the evaluation it judged; engine None where no engine measured the gate
    passed: bool
    measured: str
    threshold: str
    kind: str  # "quality" | "performance" | "availability"
    evaluated: bool = True  # False: no engine measured the metric (passes only under gates.allow_unevaluated)

    def to_dict(self) -> dict:
        """The JSON form (report.json): the target as its string."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"target": str(self.target)}


class PlanOfBuild(Protocol):
    """What a build's result keeps of the plan it executed (`llmc.planning.plan.Plan` is one). Named by what is read
    of it, not by the planner's class: the planner imports the stages, which fill this result, so importing it here
    would close a circle (docs/architecture.md, "Layers")."""

    @property
    def schemes(self) -> dict[str, Scheme]: ...  # variant name ("" when single) -> scheme

    @property
    def warnings(self) -> list[str]: ...

    def decision_of(self, id: StageId) -> object | None: ...  # the decision the plan costs for stage `id`


@dataclass
class BuildResult:
    recipe: Recipe
    build_id: str
    plan: PlanOfBuild
    source: ModelSource
    stages: list[StageRecord] = field(default_factory=list)
    calibration: dict | None = None
    artifacts: dict[str, Artifact] = field(default_factory=dict)  # by label
    evals: dict[EvalId, Evaluation] = field(default_factory=dict)
    target_evals: dict[str, list[EvalId]] = field(default_factory=dict)  # artifact label -> its evaluations
    verdicts: list[Verdict] = field(default_factory=list)
    quantized_dirs: dict[str, Path] = field(default_factory=dict)  # variant name -> canonical form
    published: Path | None = None
    publish_noop: bool = False
    dtype: str = "float32"  # recipe.model.dtype resolved (auto: the checkpoint's own, llmc.model.dtype)
    overrides: tuple[str, ...] = ()  # the command line's --set key.path=value, already applied to `recipe`
    bos: dict | None = None  # whether windows start with a BOS, which id and why (llmc.data.bos)
    search: dict[str, dict] = field(default_factory=dict)  # variant -> its searched mix (llmc.quant.search.summary)

    @property
    def passed(self) -> bool:
        """No verdict failed (publishable). Not "every gate measured": see `gates_status`."""
        return all(v.passed for v in self.verdicts)

    @property
    def gates_status(self) -> tuple[str, str]:
        """('passed' | 'passed-unmeasured' | 'failed' | 'none', a sentence): "all passed" only when every gate
        was measured."""
        return gates_summary(self.verdicts)


def gates_summary(verdicts: list[Verdict] | list[dict]) -> tuple[str, str]:
    """(status, sentence): 'failed', 'none', 'passed' (every gate measured and passed) or 'passed-unmeasured'
    (some gate passed only under allow_unevaluated) — "all passed" is said only of the third."""
    vs = [v if isinstance(v, dict) else v.to_dict() for v in verdicts]
    failed = [v for v in vs if not v["passed"]]
    unmeasured = [v for v in vs if not v.get("evaluated", True)]
    if failed:
        names = ", ".join(dict.fromkeys(f"{v['target']} {v['gate']}" for v in failed))
        return "failed", f"FAILED: {len(failed)} of {len(vs)} ({names})"
    if not vs:
        return "none", "no gates set (nothing was gated)"
    if unmeasured:
        return "passed-unmeasured", (f"passed, but {len(unmeasured)} of {len(vs)} not measured on any engine "
                                     "(allowed by gates.allow_unevaluated)")
    return "passed", f"all {len(vs)} passed (every gate measured)"
