"""Gates: the recipe's thresholds applied to measured results, each a verdict with its reason.

Rule: a quality gate is evaluated on the 95% interval, on the side that protects the user — it
fails when the *upper* bound of the paired perplexity increase (or of mean KL divergence) exceeds
the limit, or the *lower* bound of top-1 agreement is under it — so noise cannot hide a regression. Throughput gates compare
the median against the minimum. An evaluation that is missing or crashed fails its gates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from llmc.recipe.schema import Gates

if TYPE_CHECKING:
    from llmc.result import Evaluation


@dataclass(frozen=True)
class Verdict:
    gate: str
    target: str
    passed: bool
    measured: str
    threshold: str
    kind: str  # "quality" | "performance" | "availability"

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_gates(gates: Gates, target: str, result: Evaluation) -> list[Verdict]:
    """The verdicts of every gate the recipe sets on one evaluation (a failed evaluation fails as unavailable)."""
    verdicts: list[Verdict] = []
    if result.error is not None:
        return [Verdict("artifact evaluated", target, False, result.error, "evaluation succeeds", "availability")]
    change = result.ppl_change
    if gates.max_ppl_increase_pct is not None:
        if change is None:
            verdicts.append(Verdict("max_ppl_increase_pct", target, False, "no perplexity change measured",
                                    f"<= {gates.max_ppl_increase_pct}%", "quality"))
        else:
            hi = change["ci_high_pct"]
            verdicts.append(
                Verdict(
                    "max_ppl_increase_pct",
                    target,
                    hi <= gates.max_ppl_increase_pct,
                    f"{change['delta_pct']:+.2f}% (95% CI {change['ci_low_pct']:+.2f}% .. {hi:+.2f}%)",
                    f"upper bound <= {gates.max_ppl_increase_pct:+.2f}%",
                    "quality",
                )
            )
    kld, top1 = result.kld, result.top1_agreement
    # a gate applies where the engine measures its metric (vLLM gives no full distributions: the
    # torch engine's row of the same artifact carries KL and top-1); "not measured" elsewhere fails
    measures = result.measures if result.measures is not None else ["kld", "top1_agreement"]
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
    tput = result.throughput or {}
    for gate_name, key in (
        ("min_prefill_tokens_per_s", "prefill_tokens_per_s"),
        ("min_decode_tokens_per_s", "decode_tokens_per_s"),
    ):
        limit = getattr(gates, gate_name)
        if limit is None:
            continue
        summary = tput.get(key)
        measured = summary["median"] if summary else None
        verdicts.append(
            Verdict(
                gate_name,
                target,
                measured is not None and measured >= limit,
                f"{measured:.1f} tok/s (median of {summary['n']})" if summary else "not measured",
                f">= {limit} tok/s",
                "performance",
            )
        )
    return verdicts


def _kld_kind_text(result: Evaluation) -> str:
    """What a measured KL is, when it is not the exact full-vocabulary KL (llmc.engines.agreement)."""
    if result.kld_kind != "topk_lower_bound":
        return ""
    k = (result.protocol or {}).get("top_k")
    return f"; top-k lower bound (k={k}) of the full-vocabulary KL"
