"""Block-scale search for NVFP4 / MXFP4 / MXFP8: per block, the scale on the format's own scale grid that minimises
the block's squared reconstruction error, instead of the one round-to-nearest derives from the block's absmax.

Candidates are the round-to-nearest scale and its neighbours on the grid the scale is stored in (consecutive E4M3
values for NVFP4, consecutive powers of two for MX): every candidate is exactly representable, so the codes export
as they are. A smaller scale clips the block's largest values and refines the rest; a larger one (MX: the next
power of two) stops the saturation OCP's floor(log2(amax)) exponent causes when amax's mantissa exceeds the
element's (1.5 for E2M1, 1.75 for E4M3). The round-to-nearest scale is a candidate and wins ties, so no block's
error grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmc.quant.microscaling import (
    BlockQuantized,
    MicroscalingFormat,
    dequantize_blocks,
    quantize_blocks,
    quantize_with_scales,
)

# Neighbours searched, in steps of the scale's grid. NVFP4: E4M3 values are 1/8 binade apart, so -2..+6 spans about
# 0.75x..1.75x the absmax scale; the winners cluster near 1x and near 1.5x (the block's absmax on E2M1's 4, where
# the grid below it is finer): benchmarks/fp4_scale_search.py. MX: half, the same, and twice the OCP scale.
DEFAULT_STEPS = {"e4m3": (-2, -1, 1, 2, 3, 4, 5, 6), "e8m0": (-1, 1)}
_LARGEST_FINITE_CODE = {"e4m3": 0x7E, "e8m0": 0xFE}  # 0x7F (E4M3) and 0xFF (E8M0) are NaN


def block_errors(x: torch.Tensor, q: BlockQuantized, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Squared reconstruction error per block [..., n // block_size], each element weighted by `importance` of its
    column (e.g. the mean squared activation of that input channel) when given."""
    err = (dequantize_blocks(q) - x.float()) ** 2
    if importance is not None:
        err = err * importance
    return err.unflatten(-1, (-1, q.format.block_size)).sum(dim=-1)


def search_block_scales(x: torch.Tensor, fmt: MicroscalingFormat, steps: Sequence[int] | None = None,
                        global_scale: torch.Tensor | None = None,
                        importance: torch.Tensor | None = None) -> BlockQuantized:
    """Codes and scales of x [..., n] in `fmt` with each block's scale chosen among the round-to-nearest scale and
    its neighbours `steps` grid points away, by (importance-weighted) squared error. NVFP4 keeps round-to-nearest's
    global scale (or the one given); `importance` is [n], non-negative."""
    if importance is not None:
        if importance.shape != (x.shape[-1],):
            raise ValueError(f"importance must hold one weight per column ({x.shape[-1]}), got {tuple(importance.shape)}")
        importance = importance.float().to(x.device)
    best = quantize_blocks(x, fmt, global_scale)
    best_err = block_errors(x, best, importance)
    base = best.scale.view(torch.uint8).to(torch.int16)
    top = _LARGEST_FINITE_CODE[fmt.scale]
    for step in DEFAULT_STEPS[fmt.scale] if steps is None else steps:
        encoded = (base + step).clamp(0, top).to(torch.uint8)
        scale = encoded.view(torch.float8_e4m3fn) if fmt.scale == "e4m3" else encoded
        candidate = quantize_with_scales(x, scale, fmt, best.global_scale)
        err = block_errors(x, candidate, importance)
        better = err < best_err
        best = BlockQuantized(
            codes=torch.where(better.repeat_interleave(fmt.block_size, dim=-1), candidate.codes.view(torch.uint8),
                              best.codes.view(torch.uint8)).view(best.codes.dtype),
            scale=torch.where(better, scale.view(torch.uint8), best.scale.view(torch.uint8)).view(best.scale.dtype),
            global_scale=best.global_scale, format=fmt)
        best_err = torch.where(better, err, best_err)
    return best
