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
    """Running H = 2/n Σ x xᵀ over the n token rows of x ([..., in]), in float32; returns (H, n)."""
    x = x.reshape(-1, x.shape[-1]).float()
    m = x.shape[0]
    if hessian is None:
        hessian = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32)
    hessian = hessian * (seen / (seen + m)) + (x.T @ x) * (2.0 / (seen + m))
    return hessian, seen + m


def _row_qparams(weight: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (zero points) fixed from the original weight, broadcast to one row each: [out, 1 or groups]."""
    scale, zp = compute_qparams(weight, spec)
    if spec.strategy == "tensor":
        scale = scale.reshape(1, 1).expand(weight.shape[0], 1)
        zp = None if zp is None else zp.reshape(1, 1).expand(weight.shape[0], 1)
    return scale, zp


def _column_qparams(scale: torch.Tensor, zp: torch.Tensor | None, col: int, spec: TensorSpec):
    """The scale (and zero point) column that applies to input column `col`, shaped [out, 1]."""
    j = col // spec.group_size if spec.strategy == "group" else 0
    return scale[:, j : j + 1], None if zp is None else zp[:, j : j + 1]


def _prepare_inverse(hessian: torch.Tensor, dampening: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of H⁻¹ (after damping; factorized in float64, returned in float32) and the
    mask of dead (never active) inputs."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    damp = dampening * torch.mean(torch.diag(h))
    h += damp * torch.eye(h.shape[0], dtype=h.dtype)
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(h_inv, upper=True).float(), dead


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, spec: TensorSpec, options: GptqOptions = GptqOptions()
) -> tuple[QuantizedWeight, float]:
    """GPTQ-quantize `weight` [out, in] given the input Hessian [in, in].

    Returns the quantized weight and the layer-wise loss Σ err² / d (the objective GPTQ minimizes,
    in units of H)."""
    quantized, loss = gptq_quantize_shared([weight], hessian, spec, options)
    return quantized[0], loss


def gptq_quantize_shared(
    weights: list[torch.Tensor], hessian: torch.Tensor, spec: TensorSpec, options: GptqOptions = GptqOptions()
) -> tuple[list[QuantizedWeight], float]:
    """GPTQ for Linears that read the same input (q/k/v; gate/up): rows are independent given H, so
    their rows are stacked and the column loop runs once for all of them."""
    qparams = [_row_qparams(w, spec) for w in weights]
    scale = torch.cat([s for s, _ in qparams])
    zp = None if qparams[0][1] is None else torch.cat([z for _, z in qparams])
    codes, loss = _gptq_rows(torch.cat([w.detach().float() for w in weights]), hessian, scale, zp, spec, options)
    out, start = [], 0
    for w, (s, z) in zip(weights, qparams):
        rows = slice(start, start + w.shape[0])
        start += w.shape[0]
        if spec.strategy == "tensor":
            s, z = s[:1].reshape(1), None if z is None else z[:1].reshape(1)
        out.append(QuantizedWeight(codes=codes[rows].contiguous(), scale=s.contiguous(),
                                   zero_point=None if z is None else z.contiguous()))
    return out, loss


def _gptq_rows(
    w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: TensorSpec,
    options: GptqOptions,
) -> tuple[torch.Tensor, float]:
    """The column loop over a float32 weight [out, in] with per-row scales [out, 1 or groups]."""
    w = w.clone()
    n_out, n_in = w.shape
    column_spec = replace(spec, strategy="channel", group_size=None)

    h_inv_chol, dead = _prepare_inverse(hessian, options.dampening)
    w[:, dead] = 0.0
    order = torch.arange(n_in)
    if options.act_order:
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        h = hessian[order][:, order]
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
            q = dequantize(q_codes, s, z, column_spec)[:, 0]
            codes[:, col] = q_codes[:, 0]
            d = h_blk[i, i]
            err = (block[:, i] - q) / d
            block[:, i:] -= err[:, None] * h_blk[i, i:][None, :]
            errors[:, i] = err
        loss += (errors.double() ** 2).sum() / 2
        w[:, i2:] -= errors @ h_inv_chol[i1:i2, i2:]
    return codes, float(loss)
