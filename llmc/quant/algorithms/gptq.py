"""GPTQ: quantize a weight column by column, moving each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer-wise objective ||W X - Q X||².

Scales (and zero points) are fixed from the original weight before the first column is rounded, as
llm-compressor does; so activation ordering never changes which columns share a scale and the
result stores no `g_idx`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmc.quant.numerics import (
    QuantizedWeight,
    compute_qparams,
    dequantize,
    quantize_with,
)
from llmc.quant.spec import TensorSpec


@dataclass(frozen=True)
class GptqOptions:
    block_size: int = 128
    dampening: float = 0.01  # fraction of the mean Hessian diagonal added to the diagonal
    act_order: bool = False  # quantize columns in order of decreasing Hessian diagonal


def accumulate_hessian(hessian: torch.Tensor | None, seen: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running H = 2/n Σ x xᵀ over the n token rows of x ([..., in]); returns (H, n)."""
    x = x.reshape(-1, x.shape[-1]).double()
    m = x.shape[0]
    if hessian is None:
        hessian = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    hessian = hessian * (seen / (seen + m)) + (x.T @ x) * (2.0 / (seen + m))
    return hessian, seen + m


def _column_qparams(scale: torch.Tensor, zp: torch.Tensor | None, col: int, spec: TensorSpec):
    """The scale (and zero point) column that applies to input column `col`, shaped [out, 1]."""
    if spec.strategy == "tensor":
        return scale.reshape(1, 1), None if zp is None else zp.reshape(1, 1)
    j = col // spec.group_size if spec.strategy == "group" else 0
    return scale[:, j : j + 1], None if zp is None else zp[:, j : j + 1]


def _prepare_inverse(hessian: torch.Tensor, dampening: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of H⁻¹ (after damping) and the mask of dead (never active) inputs."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    damp = dampening * torch.mean(torch.diag(h))
    h += damp * torch.eye(h.shape[0], dtype=h.dtype)
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(h_inv, upper=True), dead


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, spec: TensorSpec, options: GptqOptions = GptqOptions()
) -> tuple[QuantizedWeight, float]:
    """GPTQ-quantize `weight` [out, in] given the input Hessian [in, in].

    Returns the quantized weight and the layer-wise loss Σ err² / d (the objective GPTQ minimizes,
    in units of H)."""
    w = weight.detach().double().clone()
    n_out, n_in = w.shape
    scale, zp = compute_qparams(weight, spec)
    column_spec = replace(spec, strategy="channel", group_size=None)

    h_inv_chol, dead = _prepare_inverse(hessian, options.dampening)
    w[:, dead] = 0.0
    order = torch.arange(n_in)
    if options.act_order:
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        h = hessian.double()[order][:, order]
        h_inv_chol, _ = _prepare_inverse(h, options.dampening)
        w = w[:, order]

    codes = torch.empty(n_out, n_in, dtype=torch.float8_e4m3fn if spec.info.is_float else torch.int8)
    loss = torch.zeros((), dtype=torch.float64)
    bs = options.block_size
    for i1 in range(0, n_in, bs):
        i2 = min(i1 + bs, n_in)
        block = w[:, i1:i2].clone()
        errors = torch.zeros_like(block)
        h_blk = h_inv_chol[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(order[i1 + i])
            s, z = _column_qparams(scale, zp, col, spec)
            q_codes = quantize_with(block[:, i : i + 1], s, z, column_spec)
            q = dequantize(q_codes, s, z, column_spec).double()[:, 0]
            codes[:, col] = q_codes[:, 0]
            d = h_blk[i, i]
            err = (block[:, i] - q) / d
            loss += (err**2).sum() / 2
            block[:, i:] -= err[:, None] * h_blk[i, i:][None, :]
            errors[:, i] = err
        w[:, i2:] -= errors @ h_inv_chol[i1:i2, i2:]
    return QuantizedWeight(codes=codes, scale=scale, zero_point=zp), float(loss)
