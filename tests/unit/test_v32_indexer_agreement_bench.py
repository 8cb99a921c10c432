"""benchmarks/v32_indexer_agreement.py's key-by-key comparison (docs/models.md, DeepSeek-V3.2 in llama.cpp): a tie at
score 0 broken the other way is counted as a tie, a near-tie swap by its torch score gap, and the early queries (all
their causal keys kept) not at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.bench_modules import benchmark_module

K = 8


def _scores() -> np.ndarray:
    """One window, one layer: key j of query t scores 7 - j (keys 0..7 kept, key 7 at exactly 0), future keys -inf;
    query 20's key 8 ties key 7 at 0, query 30's key 8 is 0.03 below it."""
    s = np.full((1, 1, 64, 64), -np.inf, dtype=np.float32)
    for t in range(64):
        s[0, 0, t, : t + 1] = 7.0 - np.arange(t + 1)
    s[0, 0, 20, 8] = 0.0
    s[0, 0, 30, 8] = -0.03
    return s


def test_compare_counts_a_zero_tie_and_measures_a_near_tie_swap() -> None:
    bench = benchmark_module("v32_indexer_agreement")
    scores = _scores()
    # transformers' choice, as its indexer makes it (torch.topk; masked keys fill the early queries' rows)
    torch_sel = torch.from_numpy(scores).topk(K, dim=-1).indices.numpy()
    llama_sel = torch_sel.copy()
    kept_20 = set(torch_sel[0, 0, 20].tolist())
    llama_sel[0, 0, 20] = sorted((kept_20 - {7, 8}) | ({7, 8} - kept_20))  # the tie broken the other way
    llama_sel[0, 0, 30] = [0, 1, 2, 3, 4, 5, 6, 8]  # key 8 (0.03 below) in place of key 7
    llama_sel[0, 0, 3, -1] = 60  # an early query naming a masked key: not a different causal selection
    layer = bench.compare(scores, torch_sel, scores, llama_sel, K)["layers"][0]
    assert layer["queries"] == 64 - K
    assert layer["differ"] == 2
    assert (layer["exact_ties"], layer["ties_at_zero"]) == (1, 1)
    # query 30's spread is 7 - (7 - 30) = 30: the swapped keys 0.03 apart are 0.001 of it
    assert layer["gap_median"] == pytest.approx(0.001, rel=1e-4) and layer["gap_max"] == layer["gap_median"]
    assert layer["score_noise_p99"] == 0.0


def test_compare_sees_no_swap_where_llama_cpp_keeps_torchs_keys_in_another_order() -> None:
    bench = benchmark_module("v32_indexer_agreement")
    scores = _scores()
    torch_sel = torch.from_numpy(scores).topk(K, dim=-1).indices.numpy()
    layer = bench.compare(scores, torch_sel, scores + 1e-3, torch_sel[..., ::-1], K)["layers"][0]
    assert layer["differ"] == 0 and layer["gap_median"] is None
    assert layer["score_noise_median"] > 0  # llama.cpp's scores moved, its selection did not
