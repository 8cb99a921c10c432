"""The evaluation protocol `llmc build` (llmc.pipeline.evaluate) and `llmc eval` (llmc.eval.standalone) share: how a
model's per-token scores on the evaluation windows become its metrics, paired with the baseline's scores on the same
windows (the windows themselves come from llmc.data.stages.eval_tokens, the baseline's engine from the engine
registry's `baseline_engine`, for both)."""

from __future__ import annotations

import torch

from llmc.engines.agreement import KL_BOUND, kld_kind
from llmc.eval.metrics import mean_interval, paired_ppl_change, perplexity, perplexity_interval
from llmc.result import Evaluation


def evaluation_of(engine: str, scores: dict[str, torch.Tensor], *, bootstrap_samples: int,
                  baseline_nll: torch.Tensor | None = None, measures_speed: bool = False, **recorded) -> Evaluation:
    """One model's metrics from its per-token `scores` in `engine`: perplexity with its 95% interval over windows;
    with the baseline's per-token NLL (`baseline_nll`, an artifact's scoring), the paired change in perplexity; where
    the engine scored against the baseline's reference (vLLM returns only the actual tokens' log-probs), KL from the
    baseline (with its top-k lower bound beside an exact KL) and top-1 agreement. Every interval is a bootstrap of
    `bootstrap_samples` over windows. `measures_speed`: the engine also measured its throughput. `recorded`: the
    Evaluation's other fields (a build's stage key, timings, throughput; the KL kind, else read from the scores)."""
    nll = scores["nll"]
    recorded.setdefault("kld_kind", kld_kind(scores))
    m = Evaluation(engine, **recorded, perplexity=perplexity(nll),
                   ppl_ci95=list(perplexity_interval(nll, bootstrap_samples)), nll=nll,
                   measures=["perplexity"] + (["throughput"] if measures_speed else [])
                   + (["kld", "top1_agreement"] if "kl" in scores else []))
    if baseline_nll is not None:
        m.ppl_change = paired_ppl_change(baseline_nll, nll, bootstrap_samples)
    if "kl" in scores:
        m.kld = mean_interval(scores["kl"], bootstrap_samples)
        if KL_BOUND in scores:
            m.kld_bound = mean_interval(scores[KL_BOUND], bootstrap_samples)
        m.top1_agreement = mean_interval(scores["top1"], bootstrap_samples)
    return m
