"""Block-scale search beats round-to-nearest on weight reconstruction, block by block, with exportable scales."""

from __future__ import annotations

import pytest
import torch

from llmc.quant.microscaling import MXFP4, MXFP8, NVFP4, dequantize_blocks, e2m1_decode, quantize_blocks
from llmc.quant.scale_search import block_errors, search_block_scales


def _heavy_tailed(rows: int = 128, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Student-t (5 degrees of freedom): the heavy tails of trained LLM weights, unlike a Gaussian."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(5, rows, cols, generator=g).pow(2).sum(0)
    w = normal / (chi2 / 5).sqrt() * 0.02
    w[0] = 0.0
    return w


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4, MXFP8], ids=lambda f: f.name)
def test_search_never_loses_to_round_to_nearest_and_wins_overall(fmt) -> None:
    w = _heavy_tailed()
    rtn, found = quantize_blocks(w, fmt), search_block_scales(w, fmt)
    rtn_err, found_err = block_errors(w, rtn), block_errors(w, found)
    assert (found_err <= rtn_err).all()  # round-to-nearest's scale is a candidate and wins ties
    assert found_err.sum() < 0.97 * rtn_err.sum()  # and most blocks do better than it
    # The result is an ordinary quantized tensor: codes x its own scales, same global scale, zero rows exact.
    assert found.scale.dtype == rtn.scale.dtype and found.codes.dtype == rtn.codes.dtype
    if fmt.scale == "e4m3":
        assert torch.equal(found.global_scale, rtn.global_scale)
        step = (found.scale.float() / found.global_scale).repeat_interleave(16, -1)
        assert torch.equal(dequantize_blocks(found), e2m1_decode(found.codes) * step)
    assert torch.equal(dequantize_blocks(found)[0], torch.zeros(w.shape[1]))


def test_importance_moves_error_away_from_important_columns() -> None:
    w = _heavy_tailed(seed=1)
    importance = torch.ones(w.shape[1])
    importance[::16] = 100.0  # one column per NVFP4 block matters far more (an outlier input channel)
    plain, weighted = search_block_scales(w, NVFP4), search_block_scales(w, NVFP4, importance=importance)
    col_err = lambda q: ((dequantize_blocks(q) - w) ** 2)[:, ::16].sum()  # noqa: E731
    assert col_err(weighted) < col_err(plain)
    assert block_errors(w, weighted, importance).sum() <= block_errors(w, plain, importance).sum()
    with pytest.raises(ValueError, match="one weight per column"):
        search_block_scales(w, NVFP4, importance=torch.ones(3))


def test_search_stays_on_the_inputs_device() -> None:
    w = torch.empty(32, 64, device="meta")
    for fmt in (NVFP4, MXFP4):
        q = search_block_scales(w, fmt, importance=torch.ones(64))
        assert q.codes.device == q.scale.device == w.device
