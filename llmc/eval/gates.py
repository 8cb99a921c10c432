"""Gates: the recipe's thresholds applied to measured results, each a verdict with its reason.

Rules (docs/evaluation.md, "Default gates"):
- A quality gate is evaluated on the 95% interval, on the side that protects the user — it fails when the *upper*
  bound of the paired perplexity increase (or of mean KL divergence) exceeds the limit, or the *lower* bound of
  top-1 agreement is under it — so noise cannot hide a regression. Throughput gates compare the median against
  the minimum, and read only a runtime's own speed (never llmc's emulation, `EngineSpec.speed_kind`).
- Gates are kept per artifact (target label): each engine that measures a gate's metric gives a verdict; a gate
  no engine measured fails (fail closed), unless the recipe says `gates: {allow_unevaluated: true}`, and then it
  passes marked as not measured, so "all passed" is never said of it.
- A crashed evaluation fails as unavailable; a non-finite metric (NaN/Inf perplexity, KL, agreement, tokens/s,
  the baseline's included) always fails, with or without gates in the recipe.
- A recipe without a `gates:` section gets the default quality gates of each variant's scheme family.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from llmc.data.sources import corpora_of
from llmc.engines import engine_spec
from llmc.quant.canonical import scheme_from_dict
from llmc.recipe.schema import Gates
from llmc.result import EvalId, Verdict
from llmc.runtimes.catalog import artifact_format

if TYPE_CHECKING:
    from llmc.engines.registry import SpeedKind
    from llmc.quant.spec import Scheme
    from llmc.recipe.schema import Recipe
    from llmc.result import BuildResult, Evaluation

# Default quality gates per scheme family, from measured numbers with a margin (docs/evaluation.md, "Default gates").
# 8-bit (W8A8 FP8/INT8, W8A16, FP8 KV): SmolLM2-135M measured at most +4.9% perplexity (upper bound), KLD <= 0.039,
# top-1 >= 87.0% (lower bounds); an FP8 build that moved the distribution (KLD 0.20, top-1 77%, perplexity -12%)
# must fail. 4-bit weights (W4A16, W4AFP8): at most +39% (RTN), KLD <= 0.39, top-1 >= 63.3%.
DEFAULT_GATES: dict[str, dict[str, float]] = {
    "8-bit": {"max_ppl_increase_pct": 10.0, "max_mean_kld": 0.1, "min_top1_agreement_pct": 80.0},
    "4-bit": {"max_ppl_increase_pct": 40.0, "max_mean_kld": 0.5, "min_top1_agreement_pct": 60.0},
}
QUALITY_GATES = ("max_ppl_increase_pct", "max_mean_kld", "min_top1_agreement_pct")
PERFORMANCE_GATES = {"min_prefill_tokens_per_s": "prefill_tokens_per_s", "min_decode_tokens_per_s": "decode_tokens_per_s"}
_METRIC = {"max_ppl_increase_pct": "perplexity", "max_mean_kld": "kld", "min_top1_agreement_pct": "top1_agreement"}

NON_FINITE_GATE = "finite metrics"
SUSPICIOUS_IMPROVEMENT = (
    "perplexity is significantly better than the baseline's (the paired 95% interval lies below zero). "
    "Quantization rarely improves a model: this usually means a protocol or baseline problem (baseline scored "
    "with another dtype, engine or tokenizer; evaluation text seen in calibration or training; a baseline that is "
    "not the model the artifact was made from), not a better model. Read the KLD and top-1 agreement: a "
    "distribution that moved while perplexity fell is a changed model"
)


# --------------------------------------------------------------------------- which gates apply


def scheme_family(scheme: Scheme) -> str:
    """'4-bit' when weights or activations have 4 bits or fewer, else '8-bit' (the DEFAULT_GATES keys); a mixed
    scheme: its lowest-bit group's."""
    bits = [t.bits for m in scheme.members().values() for t in (m.weights, m.activations) if t is not None]
    return "4-bit" if min(bits) <= 4 else "8-bit"


def gates_for_corpus(gates: Gates, corpus: str | None) -> Gates:
    """The recipe's gates on one evaluation corpus: `gates.corpora[<label>]` replaces the thresholds it sets."""
    override = gates.corpora.get(corpus) if corpus is not None else None
    if override is None:
        return gates
    return gates.model_copy(update={k: v for k, v in override.model_dump().items() if v is not None})


def effective_gates(gates: Gates, scheme: Scheme, corpus: str | None = None) -> Gates:
    """The recipe's gates for one variant (on one evaluation corpus, with its overrides): with `defaults: true`,
    the family defaults fill every quality gate the recipe leaves unset."""
    gates = gates_for_corpus(gates, corpus)
    if not gates.defaults:
        return gates
    fill = {k: v for k, v in DEFAULT_GATES[scheme_family(scheme)].items() if getattr(gates, k) is None}
    return gates.model_copy(update=fill)


def set_gates(gates: Gates) -> list[str]:
    """The names of the thresholds that are set."""
    return [k for k in (*QUALITY_GATES, *PERFORMANCE_GATES) if getattr(gates, k) is not None]


def describe_gates(gates: Gates, scheme: Scheme) -> str:
    """One line for the plan: the thresholds and where they come from."""
    eff = effective_gates(gates, scheme)
    names = {"max_ppl_increase_pct": "ppl <= +{}%", "max_mean_kld": "KLD <= {}", "min_top1_agreement_pct":
             "top-1 >= {}%", "min_prefill_tokens_per_s": "prefill >= {} tok/s",
             "min_decode_tokens_per_s": "decode >= {} tok/s"}
    parts = [names[k].format(getattr(eff, k)) for k in set_gates(eff)]
    origin = f" ({scheme_family(scheme)} defaults for unset keys)" if gates.defaults else ""
    unevaluated = "; allow_unevaluated" if gates.allow_unevaluated else ""
    per_corpus = "".join(f"; on {corpus}: " + ", ".join(names[k].format(v) for k, v in o.model_dump().items()
                                                         if v is not None)
                         for corpus, o in gates.corpora.items())
    return (", ".join(parts) or "none") + origin + unevaluated + per_corpus


def plan_warnings(recipe: Recipe, schemes: dict[str, Scheme], plan_targets: list[dict]) -> list[str]:
    """What the plan says about the gates: none at all, perplexity alone, and targets no engine here can measure."""
    by_message: dict[str, list[str]] = {}  # the same warning for several variants is said once
    for name, scheme in schemes.items():
        eff = effective_gates(recipe.gates, scheme)
        quality = [k for k in QUALITY_GATES if getattr(eff, k) is not None]
        family = scheme_family(scheme)
        defaults = ", ".join(f"{k}: {v}" for k, v in DEFAULT_GATES[family].items())
        if not set_gates(eff):
            by_message.setdefault(
                f"no gates: every artifact whose metrics are finite passes and is published; remove the gates "
                f"section for the {family} defaults ({defaults})", []).append(name)
        elif quality == ["max_ppl_increase_pct"]:
            by_message.setdefault(
                "gates on perplexity alone: perplexity can stay flat or even fall while the output distribution "
                "moves (measured: an FP8 build with perplexity -12%, KLD 0.20, top-1 agreement 77%); add "
                f"max_mean_kld and min_top1_agreement_pct ({family} defaults: {defaults}) or set defaults: true",
                []).append(name)
    warnings = [(f"{', '.join(names)}: " if any(names) else "") + msg for msg, names in by_message.items()]
    if recipe.gates.allow_unevaluated:
        return warnings
    for t in plan_targets:
        scheme = _scheme_of(t["label"], schemes)
        if not set_gates(effective_gates(recipe.gates, scheme)):
            continue
        fmt = artifact_format(t["exporter"])
        readers = [e for e in recipe.eval.runtimes if e in fmt.read_by]
        runnable = [e for e in readers if engine_spec(e).cannot_run(scheme) is None]
        if not runnable:
            why = (f"no engine in eval.runtimes loads {fmt.name}" if not readers else
                   "; ".join(f"{e} cannot run it here ({engine_spec(e).cannot_run(scheme)})" for e in readers))
            warnings.append(f"target {t['label']}: {why}, so its gates will fail as not measured; add an engine "
                            f"that reads {fmt.name} ({', '.join(fmt.read_by) or 'none exists yet'}) to "
                            "eval.runtimes, or set gates.allow_unevaluated: true to publish it unmeasured")
    return warnings


def _scheme_of(label: str, schemes: dict[str, Scheme]) -> Scheme:
    """The scheme of a plan target labelled "<variant>/<target>" (several variants) or "<target>" (one, keyed "")."""
    return schemes[""] if "" in schemes else schemes[label.split("/", 1)[0]]


def emulated_performance_gates(recipe: Recipe, schemes: dict[str, Scheme], plan_targets: list[dict]) -> str | None:
    """Why a performance gate can only ever read emulation timings for some target (None: it can read a runtime).
    The planner refuses such a recipe: the emulation's tokens/s is not the artifact's speed."""
    for t in plan_targets:
        scheme = _scheme_of(t["label"], schemes)
        perf = [k for k in PERFORMANCE_GATES if getattr(effective_gates(recipe.gates, scheme), k) is not None]
        if not perf:
            continue
        readers = [e for e in recipe.eval.runtimes if e in artifact_format(t["exporter"]).read_by]
        if readers and all(engine_spec(e).speed_kind(scheme) == "emulated" for e in readers):
            notes = "; ".join(f"{engine_spec(e).display}: {engine_spec(e).emulation_note}" for e in readers)
            return (f"gates.{perf[0]} on target {t['label']}: the only engines in eval.runtimes that read it "
                    f"({', '.join(readers)}) emulate {scheme.name}, so their tokens/s is not the artifact's speed "
                    f"({notes})")
    return None


# --------------------------------------------------------------------------- verdicts


def non_finite(m: Evaluation) -> list[str]:
    """The metrics of an evaluation that are NaN or infinite, by name."""
    bad: list[str] = []

    def walk(name: str, value: object) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                bad.append(f"{name} {value}")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{name}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)

    for field in ("perplexity", "ppl_ci95", "ppl_change", "kld", "top1_agreement"):
        walk(field, getattr(m, field))
    for key in PERFORMANCE_GATES.values():
        walk(f"throughput.{key}", ((m.throughput or {}).get(key) or {}).get("median"))
    return bad


def evaluate_gates(gates: Gates, target: EvalId, result: Evaluation, *, speed: SpeedKind = "runtime") -> list[Verdict]:
    """The verdicts of the gates one engine's evaluation measures (a failed evaluation fails as unavailable).
    Gates on metrics this engine does not measure give no verdict here: `gate_artifact` fails them when no
    engine measured them. `speed`: what the evaluation's tokens/s is; only a runtime's is gated."""
    if result.error is not None:
        return [Verdict("artifact evaluated", target, False, result.error, "evaluation succeeds", "availability")]
    verdicts: list[Verdict] = []
    change = result.ppl_change
    if gates.max_ppl_increase_pct is not None:
        if change is None:
            verdicts.append(Verdict("max_ppl_increase_pct", target, False, "no perplexity change measured",
                                    f"<= {gates.max_ppl_increase_pct}%", "quality"))
        else:
            hi = change["ci_high_pct"]
            verdicts.append(Verdict(
                "max_ppl_increase_pct", target, hi <= gates.max_ppl_increase_pct,  # NaN compares False: fails
                f"{change['delta_pct']:+.2f}% (95% CI {change['ci_low_pct']:+.2f}% .. {hi:+.2f}%)",
                f"upper bound <= {gates.max_ppl_increase_pct:+.2f}%", "quality"))
    kld, top1 = result.kld, result.top1_agreement
    # a gate applies where the engine measures its metric (vLLM gives no full distributions: the torch engine's
    # row of the same artifact carries KL and top-1); an engine that claims a metric but has none fails it
    measures = _measures(result)
    if gates.max_mean_kld is not None and "kld" in measures:
        verdicts.append(Verdict(
            "max_mean_kld", target, kld is not None and kld["ci_high"] <= gates.max_mean_kld,
            f"{kld['mean']:.5f} (95% CI {kld['ci_low']:.5f} .. {kld['ci_high']:.5f})" + _kld_kind_text(result)
            if kld else "not measured",
            f"upper bound <= {gates.max_mean_kld}", "quality"))
    if gates.min_top1_agreement_pct is not None and "top1_agreement" in measures:
        ok = top1 is not None and top1["ci_low"] * 100 >= gates.min_top1_agreement_pct
        verdicts.append(Verdict(
            "min_top1_agreement_pct", target, ok,
            f"{top1['mean'] * 100:.2f}% (95% CI {top1['ci_low'] * 100:.2f}% .. {top1['ci_high'] * 100:.2f}%)"
            if top1 else "not measured",
            f"lower bound >= {gates.min_top1_agreement_pct}%", "quality"))
    if speed == "runtime":
        tput = result.throughput or {}
        for gate_name, key in PERFORMANCE_GATES.items():
            limit = getattr(gates, gate_name)
            summary = tput.get(key)
            if limit is None or not summary:
                continue
            measured = summary["median"]
            verdicts.append(Verdict(gate_name, target, measured >= limit,
                                    f"{measured:.1f} tok/s (median of {summary['n']})", f">= {limit} tok/s",
                                    "performance"))
    return verdicts


def _measures(m: Evaluation) -> list[str]:
    return m.measures if m.measures is not None else ["perplexity", "kld", "top1_agreement", "throughput"]


def _threshold(gates: Gates, gate: str) -> str:
    value = getattr(gates, gate)
    return {"max_ppl_increase_pct": f"upper bound <= {value:+.2f}%", "max_mean_kld": f"upper bound <= {value}",
            "min_top1_agreement_pct": f"lower bound >= {value}%"}.get(gate, f">= {value} tok/s")


def gate_artifact(gates: Gates, target: EvalId, evaluations: Iterable[tuple[EvalId, Evaluation, SpeedKind, str]],
                  *, unevaluated_reason: str | None = None) -> list[Verdict]:
    """Every verdict on one artifact. `evaluations`: (eval id, evaluation, what its tokens/s is, why its tokens/s
    is not speed) for each engine that loaded it; `unevaluated_reason`: why none did, when none did."""
    verdicts: list[Verdict] = []
    wanted = set_gates(gates)
    measured: set[str] = set()
    why_not: dict[str, list[str]] = {g: [unevaluated_reason] if unevaluated_reason else [] for g in wanted}
    for eval_id, m, speed, speed_note in evaluations:
        engine = eval_id.engine
        own = [] if m.skipped is not None else evaluate_gates(gates, eval_id, m, speed=speed)
        verdicts += own
        if m.skipped is not None or m.error is not None:
            for g in wanted:
                why_not[g].append(f"{engine} skipped it: {m.skipped}" if m.error is None else f"{engine} failed")
            continue
        bad = non_finite(m)
        if bad:
            verdicts.append(Verdict(NON_FINITE_GATE, eval_id, False, ", ".join(bad), "every metric finite", "quality"))
        measured |= {v.gate for v in own}
        for g in (g for g in wanted if g not in {v.gate for v in own}):
            if g in PERFORMANCE_GATES and speed != "runtime":
                why_not[g].append(f"{engine} emulates this scheme, its tokens/s is not speed: {speed_note}")
            elif g in PERFORMANCE_GATES:
                why_not[g].append(f"{engine} measured no {PERFORMANCE_GATES[g]}")
            else:
                why_not[g].append(f"{engine} does not measure {_METRIC[g]}")
    for gate in wanted:
        if gate in measured:
            continue
        verdicts.append(Verdict(
            gate, target, gates.allow_unevaluated,
            "not measured on any engine" + (f" ({'; '.join(why_not[gate])})" if why_not[gate] else ""),
            _threshold(gates, gate) + (" (allow_unevaluated: passes unmeasured)" if gates.allow_unevaluated else ""),
            "performance" if gate in PERFORMANCE_GATES else "quality", evaluated=False))
    return verdicts


def gate_build(result: BuildResult) -> list[Verdict]:
    """Every verdict of a build, artifact by artifact and, when eval.corpus names several corpora, corpus by corpus:
    every gate applies on every corpus (with that corpus's overrides, `gates.corpora`), and a verdict's target
    names its corpus ("<engine>:<artifact>@<corpus>", or "<artifact>@<corpus>" for a gate no engine measured)."""
    verdicts: list[Verdict] = []
    for label, art in result.artifacts.items():
        scheme = scheme_from_dict(art.scheme_detail)
        for corpus in corpora_of(result.recipe.eval.corpus):
            gates = effective_gates(result.recipe.gates, scheme, corpus)
            evaluations = []
            for eval_id in result.target_evals.get(label, []):
                if eval_id.corpus == corpus:
                    spec = engine_spec(eval_id.engine)
                    evaluations.append((eval_id, result.evals[eval_id], spec.speed_kind(scheme), spec.emulation_note))
            reason = None
            if not evaluations:
                fmt = artifact_format(art.format)
                reason = (fmt.unevaluated or f"no engine in eval.runtimes loads {art.format}").removeprefix(
                    "not evaluated: ")
            verdicts += gate_artifact(gates, EvalId(None, label, corpus), evaluations, unevaluated_reason=reason)
            verdicts += _broken_baselines(result, evaluations)
    return verdicts


def _broken_baselines(result: BuildResult, evaluations: list) -> list[Verdict]:
    """A non-finite baseline breaks every comparison with it: a failed verdict on each."""
    verdicts = []
    for eval_id, m, _, _ in evaluations:
        base = result.evals.get(eval_id.baseline(m.baseline_engine)) if m.succeeded else None
        bad = non_finite(base) if base is not None else []
        if bad:
            verdicts.append(Verdict(NON_FINITE_GATE, eval_id, False, f"baseline ({m.baseline_engine}): "
                                    + ", ".join(bad), "every metric finite", "quality"))
    return verdicts




def _kld_kind_text(result: Evaluation) -> str:
    """What a measured KL is, when it is not the exact full-vocabulary KL (llmc.engines.agreement)."""
    if result.kld_kind != "topk_lower_bound":
        return ""
    k = (result.protocol or {}).get("top_k")
    return f"; top-k lower bound (k={k}) of the full-vocabulary KL"
