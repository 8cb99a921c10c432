"""Perplexity and its uncertainty, from per-token NLLs over equal-length windows.

ppl = exp(mean token NLL). Intervals are percentile bootstraps over windows (seeded, so the same
NLLs always give the same interval). Baseline and artifact are evaluated on the same windows, so
their difference is paired: the interval of the perplexity change resamples window-level NLL
*differences*, which is much tighter than comparing two independent intervals.
"""

from __future__ import annotations

import math

import torch


def _exp(x: float) -> float:
    """exp that gives inf instead of raising for a huge mean NLL (a broken model: the gates fail it as non-finite)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def perplexity(token_nll: torch.Tensor) -> float:
    return _exp(token_nll.double().mean().item())


def _bootstrap_means(values: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = values.shape[0]
    idx = torch.randint(0, n, (samples, n), generator=g)
    return values.double()[idx].mean(dim=1)


def perplexity_interval(token_nll: torch.Tensor, samples: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    window_means = token_nll.double().mean(dim=1)
    means = _bootstrap_means(window_means, samples, seed)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return _exp(lo.item()), _exp(hi.item())


def paired_ppl_change(
    base_nll: torch.Tensor, new_nll: torch.Tensor, samples: int = 1000, seed: int = 0, level: float = 0.95
) -> dict:
    """Relative perplexity change in percent, with a paired bootstrap interval over windows."""
    if base_nll.shape != new_nll.shape:
        raise ValueError(f"baseline and artifact were evaluated on different windows: {base_nll.shape} vs {new_nll.shape}")
    diff = (new_nll.double() - base_nll.double()).mean(dim=1)
    means = _bootstrap_means(diff, samples, seed)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))

    def pct(x: float) -> float:
        return (_exp(x) - 1) * 100

    return {
        "delta_pct": pct(diff.mean().item()),
        "ci_low_pct": pct(lo.item()),
        "ci_high_pct": pct(hi.item()),
        "level": level,
        "bootstrap_samples": samples,
        "windows": int(diff.shape[0]),
    }


def mean_interval(per_window: torch.Tensor, samples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean of a per-token metric ([n, t]) with a bootstrap interval over windows."""
    w = per_window.double().mean(dim=1)
    means = _bootstrap_means(w, samples, seed)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return {"mean": w.mean().item(), "ci_low": lo.item(), "ci_high": hi.item(), "level": level}
