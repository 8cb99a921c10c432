"""GPTQ's column loop over one block as a single Triton kernel (GPU; imported only where triton is).

On a GPU the eager loop (`gptq.gptq_block_eager`) is bound by kernel launches, about a dozen tiny ones
per column: measured 0.19 s per decoder layer of SmolLM2 on an H100, which made llmc's GPTQ 3x
llm-compressor's. Rows are independent given H, so one program carries a tile of rows through all of
a block's columns in registers, the same arithmetic in the same order: one launch per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.quant.spec import TensorSpec

ROWS_PER_PROGRAM = 8  # measured best with 4 warps on an H100 (benchmarks/gptq_block_kernel.py)
NUM_WARPS = 4


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (ties to even), which libdevice's rint gives too but the interpreter lacks."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _gptq_block_kernel(W, S, Z, H, CODES, ERRORS, n_out,
                       B: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, HAS_ZP: tl.constexpr,
                       ROWS: tl.constexpr, WIDTH: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    mask = (rows[:, None] < n_out) & (cols[None, :] < B)
    offs = rows[:, None] * B + cols[None, :]
    w = tl.load(W + offs, mask=mask, other=0.0)
    s = tl.load(S + offs, mask=mask, other=1.0)
    z = tl.load(Z + offs, mask=mask, other=0.0) if HAS_ZP else tl.zeros((ROWS, WIDTH), dtype=tl.float32)
    codes = tl.zeros((ROWS, WIDTH), dtype=tl.float32)
    errors = tl.zeros((ROWS, WIDTH), dtype=tl.float32)
    for i in range(0, B):
        here = cols[None, :] == i
        wi = tl.sum(tl.where(here, w, 0.0), axis=1)
        si = tl.sum(tl.where(here, s, 0.0), axis=1)
        zi = tl.sum(tl.where(here, z, 0.0), axis=1)
        qi = tl.minimum(tl.maximum(_round_half_even(wi / si) + zi, QMIN), QMAX)
        deq = (qi - zi) * si
        h_row = tl.load(H + i * B + cols, mask=cols < B, other=0.0)  # upper factor: zero left of i
        d = tl.sum(tl.where(cols == i, h_row, 0.0), axis=0)
        err = (wi - deq) / d
        w = w - err[:, None] * h_row[None, :]
        codes = tl.where(here, qi[:, None], codes)
        errors = tl.where(here, err[:, None], errors)
    tl.store(CODES + offs, codes, mask=mask)
    tl.store(ERRORS + offs, errors, mask=mask)


def gptq_block(
    block: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, h_blk: torch.Tensor, spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq.gptq_block_eager` for integer codes: (codes int8 [out, b], scaled errors [out, b])."""
    if spec.info.is_float:
        raise ValueError("the Triton GPTQ block serves integer formats; FP8 runs the eager loop")
    n_out, b = block.shape
    qmin, qmax = spec.info.int_range(spec.symmetric)
    codes = torch.empty(n_out, b, dtype=torch.float32, device=block.device)
    errors = torch.empty(n_out, b, dtype=torch.float32, device=block.device)
    z = scale if zp is None else zp.float().contiguous()  # any tensor: unread without a zero point
    _gptq_block_kernel[(triton.cdiv(n_out, ROWS_PER_PROGRAM),)](
        block.float().contiguous(), scale.float().contiguous(), z, h_blk.float().contiguous(), codes, errors, n_out,
        B=b, QMIN=qmin, QMAX=qmax, HAS_ZP=zp is not None, ROWS=ROWS_PER_PROGRAM,
        WIDTH=triton.next_power_of_2(max(b, 16)), num_warps=NUM_WARPS,
    )
    return codes.to(torch.int8), errors
