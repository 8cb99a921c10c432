"""GPTQ: quantize a weight column by column, moving each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer-wise objective ||W X - Q X||².

Scales (and zero points) are fixed from the original weight before the first column is rounded, as
llm-compressor does; so activation ordering never changes which columns share a scale and the
result stores no `g_idx`.

Microscaling weights (NVFP4, MXFP4, MXFP8) are quantized by the format's own quantizer instead
(`gptq_microscaling_rows`): each block's scale (E4M3 under the tensor's global scale, or E8M0) is computed when the
loop reaches the block's first column, from the block's weights as the earlier columns' errors left them (the
original GPTQ's group rule), and the codes are the format's elements; the result has round-to-nearest's layout.
With `act_order` they follow llm-compressor's static activation order instead (`_microscaling_act_order`): every
block's scale fixed from the original weight first, then the columns in decreasing Hessian diagonal.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from llmc.quant.algorithms.registry import AlgorithmOptions, Context, register
from llmc.quant.microscaling import (
    MICROSCALING_FORMATS,
    block_scales,
    decode_elements,
    encode_elements,
    require_finite,
    scale_values,
)
from llmc.quant.numerics import (
    QuantizedWeight,
    compute_qparams,
    dequantize,
    quantize_with,
    weight_global_scales,
)
from llmc.quant.scale_search import search_block_scales
from llmc.quant.spec import TensorSpec


class GptqOptions(AlgorithmOptions):
    block_size: int = Field(default=128, ge=1, description="the number of columns quantized between updates of the "
                            "columns after them, a whole number >= 1")
    dampening: float = Field(default=0.01, ge=0, description="the fraction of the mean Hessian diagonal added to "
                             "the diagonal, a number >= 0")
    act_order: bool = Field(default=False, description="true (quantize columns in order of decreasing Hessian "
                            "diagonal; microscaling formats: every block's scale fixed from the original weight "
                            "first) or false")
    true_sequential: bool = Field(default=True, description="true or false (quantize each Linear inside the "
                                  "forward that makes the next layer's inputs)")
    block_scales: Literal["absmax", "search"] = Field(
        default="absmax", description="'absmax' (each microscaling block's round-to-nearest scale) or 'search' (the "
        "scale on the format's grid with the least squared error weighted by the Hessian's diagonal, "
        "llmc.quant.scale_search), chosen as GPTQ reaches the block")

    def resolve(self, context: Context) -> GptqOptions:
        """Whether GPTQ quantizes each Linear on inputs through the layer's already-quantized Linears, inside the
        forward that makes the next layer's inputs (`llmc.quant.true_sequential`; `options.true_sequential`
        turns it off). The default for GPTQ alone with quantized propagation (a transform first needs the whole
        layer's statistics): one forward per layer instead of two (docs/calibration.md has the measured time and
        perplexity against the two-forward order)."""
        applies = context.propagate == "quantized" and not context.after_transform
        return self.model_copy(update={"true_sequential": self.true_sequential and applies})

    def check(self, context: Context) -> None:
        w = context.scheme.weights
        if w.strategy == "block":
            raise ValueError("gptq does not quantize block-wise FP8 weights (one scale per 128x128 tile) in this llmc "
                             "version; fix: algorithm rtn")
        if self.block_scales == "search" and not w.info.microscaling:
            raise ValueError(f"options.block_scales search chooses nvfp4, mxfp4 or mxfp8 block scales, not "
                             f"{w.describe()}'s; fix: drop block_scales")
        asked = "true_sequential" in self.model_fields_set and self.true_sequential
        if asked and not self.resolve(context).true_sequential:
            raise ValueError("options.true_sequential quantizes each Linear inside the forward that makes the next "
                             "layer's quantized inputs: it needs algorithm gptq alone with propagate quantized; "
                             "fix: drop true_sequential, or the propagate option")

    def stage_key(self) -> dict | None:
        # GPTQ's in-layer order changed its result: not the older cache entries
        key = {"true_sequential": True} if self.true_sequential else {}
        if self.block_scales != "absmax":
            key["block_scales"] = self.block_scales
        return key or None

    def extra_calibration_passes(self) -> float:
        return 1.0  # Hessians (x xᵀ per input) and the column loop, about one forward's worth at this width

    def quantizes_in_forward(self) -> bool:
        return self.true_sequential


def accumulate_hessian(hessian: torch.Tensor | None, seen: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running H = 2/n Σ x xᵀ over the n token rows of x ([..., in]), in float32; returns (H, n)."""
    x = x.reshape(-1, x.shape[-1])
    m = x.shape[0]
    if x.is_cuda:  # one fused update in place: a d x d temporary less per batch (d = 14336 at 8B: 0.8 GB)
        if hessian is None:
            hessian = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        # each product rounded as below: the same numbers from the same gram
        return hessian.mul_(seen / (seen + m)).add_(gram_float32(x).mul_(2.0 / (seen + m))), seen + m
    x = x.float()
    if hessian is None:
        hessian = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    hessian = hessian * (seen / (seen + m)) + gram(x) * (2.0 / (seen + m))
    return hessian, seen + m


_HALF = (torch.bfloat16, torch.float16)
_mm_out_dtype: list[bool] = [True]  # whether this torch's CUDA mm takes out_dtype (tried once)


def gram_float32(x: torch.Tensor) -> torch.Tensor:
    """xᵀx in float32 for x [n, d]. On a GPU a bf16/fp16 x is multiplied as it is, accumulating in float32 (cuBLAS's
    half-precision GEMM with a float32 result): each product of two bf16 or fp16 values is exact in float32, so the
    result is the float32 product's up to summation order, on tensor cores (~15x float32's rate on an H100) and
    without a float32 copy of x. A torch without that GEMM multiplies x's float32 copy in TF32 instead: TF32 holds
    every bf16 and fp16 value exactly, so the same holds. Elsewhere (the CPU, float32 x): `gram` in float32."""
    half = x.is_cuda and x.dtype in _HALF
    if half and _mm_out_dtype[0]:
        try:
            return torch.mm(x.T, x, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm(out_dtype) for this device
            _mm_out_dtype[0] = False
    x = x.float()
    if half:
        with _tf32_matmuls():
            return gram(x)
    return gram(x)


@contextlib.contextmanager
def _tf32_matmuls():
    """CUDA float32 matmuls in TF32 inside, as they were after (torch >= 2.9 names it fp32_precision; reading the
    older allow_tf32 after the newer was set is an error there)."""
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    previous = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, previous)


def gram(x: torch.Tensor) -> torch.Tensor:
    """xᵀx for x [n, d], from three of its four quadrants (it is symmetric): 0.65-0.75x the time of one
    GEMM at d = 1536 on this CPU, the same values (each entry is the same dot product over n)."""
    d = x.shape[1]
    if d < 512:
        return x.T @ x
    h = d // 2
    a, b = x[:, :h], x[:, h:]
    out = torch.empty(d, d, dtype=x.dtype, device=x.device)
    out[:h, :h] = a.T @ a
    out[h:, h:] = b.T @ b
    out[h:, :h] = b.T @ a
    out[:h, h:] = out[h:, :h].T
    return out


def _row_qparams(weight: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (zero points) fixed from the original weight, broadcast to one row each: [out, 1 or groups]."""
    scale, zp = compute_qparams(weight, spec)
    if spec.strategy == "tensor":
        scale = scale.reshape(1, 1).expand(weight.shape[0], 1)
        zp = None if zp is None else zp.reshape(1, 1).expand(weight.shape[0], 1)
    return scale, zp


def _prepare_inverse(hessian: torch.Tensor, dampening: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of H⁻¹ (after damping; factorized in float64, returned in float32) and the
    mask of dead (never active) inputs."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    damp = dampening * torch.mean(torch.diag(h))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    h += damp * eye
    # With J the order reversal and J H J = K Kᵀ (K lower), H⁻¹ = (J K⁻¹ J)ᵀ (J K⁻¹ J) and J K⁻¹ J is upper
    # triangular with a positive diagonal: the upper Cholesky factor of H⁻¹, from one factorization and
    # one triangular solve instead of factorize, invert, factorize again (0.11 s instead of 0.17 s at 1536).
    k = torch.linalg.cholesky(h.flip(0, 1))
    return torch.linalg.solve_triangular(k, eye, upper=False).flip(0, 1).float(), dead


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, spec: TensorSpec, options: GptqOptions = GptqOptions()
) -> tuple[QuantizedWeight, float]:
    """GPTQ-quantize `weight` [out, in] given the input Hessian [in, in].

    Returns the quantized weight and the layer-wise loss Σ err² / d (the objective GPTQ minimizes,
    in units of H)."""
    quantized, loss = gptq_quantize_shared([weight], hessian, spec, options)
    return quantized[0], loss


def gptq_quantize_shared(
    weights: list[torch.Tensor], hessian: torch.Tensor, spec: TensorSpec, options: GptqOptions = GptqOptions(),
    names: list[str] | None = None,
) -> tuple[list[QuantizedWeight], float]:
    """GPTQ for Linears that read the same input (q/k/v; gate/up): rows are independent given H, so
    their rows are stacked and the column loop runs once for all of them. `names` (the Linears' module names) let
    NVFP4's fused siblings share one global scale, as round-to-nearest's do (`weight_global_scales`)."""
    if spec.info.microscaling:
        return _gptq_microscaling_shared(weights, hessian, spec, options, names)
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


def _gptq_microscaling_shared(
    weights: list[torch.Tensor], hessian: torch.Tensor, spec: TensorSpec, options: GptqOptions,
    names: list[str] | None,
) -> tuple[list[QuantizedWeight], float]:
    names = names or [str(i) for i in range(len(weights))]  # no names: no fused siblings, a global scale each
    global_scales = weight_global_scales(dict(zip(names, weights)), spec)
    for w in weights:
        require_finite(w.detach().abs().amax(), f"a weight quantized to {spec.format}")
    row_global = None
    if global_scales:  # NVFP4: each row's tensor's global scale, [out]
        row_global = torch.cat([global_scales[n].float().to(w.device).expand(w.shape[0])
                                for n, w in zip(names, weights)])
    codes, scale, loss = gptq_microscaling_rows(torch.cat([w.detach().float() for w in weights]), hessian,
                                                spec.format, row_global, options)
    out, start = [], 0
    for name, w in zip(names, weights):
        rows = slice(start, start + w.shape[0])
        start += w.shape[0]
        out.append(QuantizedWeight(codes=codes[rows].contiguous(), scale=scale[rows].contiguous(), zero_point=None,
                                   global_scale=global_scales.get(name)))
    return out, loss


def gptq_microscaling_rows(
    w: torch.Tensor, hessian: torch.Tensor, format: str, global_scale: torch.Tensor | None,
    options: GptqOptions = GptqOptions(),
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """GPTQ's column loop over a float32 weight [out, in] in a microscaling format (`MICROSCALING_FORMATS`): codes
    [out, in] and encoded block scales [out, in // block] exactly as `microscaling.quantize_blocks` lays them out,
    and the layer-wise loss. Each block's scale is round-to-nearest's (`block_scales`) of the block's weights when
    the loop reaches its first column, so it sees the errors the earlier columns moved onto it; NVFP4 blocks under
    `global_scale` ([out]: each row's tensor's global scale; fixed from the original weights). With
    `options.block_scales` "search" the block's scale is instead the one `search_block_scales` picks among
    round-to-nearest's and its grid neighbours, by squared error weighted by the Hessian's diagonal."""
    fmt = MICROSCALING_FORMATS[format]
    n_out, n_in = w.shape
    if n_in % fmt.block_size:
        raise ValueError(f"{fmt.name} scales blocks of {fmt.block_size} inputs; {n_in} does not divide into them")
    if options.act_order:
        return _microscaling_act_order(w, hessian, fmt, global_scale, options)
    w = w.clone()
    h_inv_chol, dead = _prepare_inverse(hessian, options.dampening)
    w[:, dead] = 0.0
    code_dtype = torch.uint8 if fmt.element == "e2m1" else torch.float8_e4m3fn
    codes = torch.empty(n_out, n_in, dtype=code_dtype, device=w.device)
    scales = []
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    # whole scale blocks per column block: a block's scale is set from columns that are all up to date
    bs = max(1, options.block_size // fmt.block_size) * fmt.block_size
    for i1 in range(0, n_in, bs):
        i2 = min(i1 + bs, n_in)
        importance = torch.diagonal(hessian)[i1:i2] if options.block_scales == "search" else None
        block_codes, block_scale, errors = _microscaling_block(w[:, i1:i2], h_inv_chol[i1:i2, i1:i2], fmt,
                                                               global_scale, importance)
        codes[:, i1:i2] = block_codes
        scales.append(block_scale)
        loss += (errors.double() ** 2).sum() / 2
        w[:, i2:] -= errors @ h_inv_chol[i1:i2, i2:]
    return codes, torch.cat(scales, dim=1), float(loss)


def _microscaling_block(block: torch.Tensor, h_blk: torch.Tensor, fmt, global_scale: torch.Tensor | None,
                        importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The columns of `block` [out, b] (b a multiple of the format's block size) in order: codes [out, b], encoded
    scales [out, b // block size] and the scaled errors [out, b] moved onto the later columns through the upper
    Cholesky factor `h_blk` of H⁻¹. `importance` [b] given: each scale searched (`search_block_scales`)."""
    cols = block.t().float().contiguous()  # one column per contiguous row, as `_integer_block`
    codes = torch.empty(cols.shape, dtype=torch.uint8 if fmt.element == "e2m1" else torch.float8_e4m3fn,
                        device=cols.device)
    errors = torch.empty_like(cols)
    scales = []
    diag = torch.diagonal(h_blk)
    step = None
    for i in range(cols.shape[0]):
        if i % fmt.block_size == 0:  # the block's scale, from its columns as the earlier errors left them
            group = cols[i : i + fmt.block_size]
            if importance is None:
                scale = block_scales(group.abs().amax(dim=0), fmt, global_scale)
            else:
                scale = search_block_scales(group.t(), fmt, global_scale=None if global_scale is None else
                                            global_scale[:, None], importance=importance[i : i + fmt.block_size]
                                            ).scale[:, 0]
            scales.append(scale)
            step = scale_values(scale, global_scale)
        c = encode_elements(cols[i], step, fmt)
        codes[i] = c
        err = (cols[i] - decode_elements(c, fmt) * step) / diag[i]
        errors[i] = err
        cols[i:].sub_(h_blk[i, i:, None] * err[None, :])
    return codes.t(), torch.stack(scales, dim=1), errors.t()


def _microscaling_act_order(w: torch.Tensor, hessian: torch.Tensor, fmt, global_scale: torch.Tensor | None,
                            options: GptqOptions) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`gptq_microscaling_rows` in activation order, as llm-compressor's static order: every block's scale fixed from
    the original weight first (round-to-nearest's, or with `options.block_scales` "search" the one with the least
    squared error weighted by the Hessian's diagonal), then the columns quantized in decreasing Hessian diagonal,
    each at its own block's scale. The blocks keep their columns, so the layout is round-to-nearest's."""
    n_out, n_in = w.shape
    order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True)
    h_inv_chol, dead = _prepare_inverse(hessian[order][:, order], options.dampening)
    w = w.clone()
    w[:, order[dead]] = 0.0
    row_global = None if global_scale is None else global_scale[:, None]
    block_amax = w.reshape(n_out, -1, fmt.block_size).abs().amax(dim=-1)
    if options.block_scales == "search":
        scale = search_block_scales(w, fmt, global_scale=row_global, importance=torch.diagonal(hessian)).scale
    else:
        scale = block_scales(block_amax, fmt, row_global)
    # a block of zeros stays zeros (E8M0 has no zero scale): the errors moved onto it pass on to later columns
    steps = torch.where(block_amax > 0, scale_values(scale, row_global), 0.0)
    steps = steps.repeat_interleave(fmt.block_size, dim=1)[:, order]
    w = w[:, order]
    codes = torch.empty(n_out, n_in, dtype=torch.uint8 if fmt.element == "e2m1" else torch.float8_e4m3fn,
                        device=w.device)
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    for i1 in range(0, n_in, options.block_size):
        i2 = min(i1 + options.block_size, n_in)
        cols, col_steps = w[:, i1:i2].t().contiguous(), steps[:, i1:i2].t()  # one column per contiguous row
        h_blk = h_inv_chol[i1:i2, i1:i2]
        errors = torch.empty_like(cols)
        for i in range(cols.shape[0]):
            c = encode_elements(cols[i], col_steps[i], fmt)
            codes[:, order[i1 + i]] = c
            errors[i] = (cols[i] - decode_elements(c, fmt) * col_steps[i]) / h_blk[i, i]
            cols[i:].sub_(h_blk[i, i:, None] * errors[i][None, :])
        loss += (errors.double() ** 2).sum() / 2
        w[:, i2:] -= errors.t() @ h_inv_chol[i1:i2, i2:]
    return codes, scale, float(loss)


def _gptq_rows(
    w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: TensorSpec,
    options: GptqOptions,
) -> tuple[torch.Tensor, float]:
    """The column loop over a float32 weight [out, in] with per-row scales [out, 1 or groups]."""
    w = w.clone()
    n_out, n_in = w.shape

    h_inv_chol, dead = _prepare_inverse(hessian, options.dampening)
    w[:, dead] = 0.0
    order = torch.arange(n_in, device=w.device)
    if options.act_order:
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        h = hessian[order][:, order]
        h_inv_chol, _ = _prepare_inverse(h, options.dampening)
        w = w[:, order]
    # The scale (zero point) of each column, in processing order: [out, in].
    group = order // spec.group_size if spec.strategy == "group" else torch.zeros_like(order)
    scale_cols = scale.float()[:, group]
    zp_cols = None if zp is None else zp.float()[:, group]

    block_fn = gptq_block_triton if use_triton(w, spec) else gptq_block_cpu if use_numba(w, spec) else gptq_block_eager
    codes = torch.empty(n_out, n_in, dtype=torch.float8_e4m3fn if spec.info.is_float else torch.int8, device=w.device)
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    bs = options.block_size
    for i1 in range(0, n_in, bs):
        i2 = min(i1 + bs, n_in)
        z_blk = None if zp_cols is None else zp_cols[:, i1:i2]
        block_codes, errors = block_fn(w[:, i1:i2].clone(), scale_cols[:, i1:i2], z_blk, h_inv_chol[i1:i2, i1:i2], spec)
        codes[:, order[i1:i2]] = block_codes
        loss += (errors.double() ** 2).sum() / 2
        w[:, i2:] -= errors @ h_inv_chol[i1:i2, i2:]
    return codes, float(loss)


def gptq_block_eager(
    block: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, h_blk: torch.Tensor, spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the columns of `block` [out, b] in order (scales/zero points per column, [out, b]), each
    column's error moved onto the later columns through the upper Cholesky factor `h_blk` [b, b] of H⁻¹.
    Returns the codes [out, b] and the scaled errors [out, b]. May modify `block`."""
    if not spec.info.is_float:
        return _integer_block(block, scale, zp, h_blk, spec)
    column_spec = replace(spec, strategy="channel", group_size=None)
    codes = torch.empty(block.shape, dtype=torch.float8_e4m3fn, device=block.device)
    errors = torch.zeros_like(block)
    for i in range(block.shape[1]):
        s, z = scale[:, i : i + 1], None if zp is None else zp[:, i : i + 1]
        q_codes = quantize_with(block[:, i : i + 1], s, z, column_spec)
        q = dequantize(q_codes, s, z, column_spec)[:, 0]
        codes[:, i] = q_codes[:, 0]
        err = (block[:, i] - q) / h_blk[i, i]
        block[:, i:] -= err[:, None] * h_blk[i, i:][None, :]
        errors[:, i] = err
    return codes, errors


def block_columns(
    block: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A block [out, b] and its per-column scales/zero points as float32 [b, out], one column per contiguous
    row: the integer column loops read a column and update the columns after it."""
    cols, col_scale = block.t().float().contiguous(), scale.t().float().contiguous()
    return cols, col_scale, None if zp is None else zp.t().float().contiguous()


def _integer_block(
    block: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, h_blk: torch.Tensor, spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq_block_eager` for integer codes, the same arithmetic in half the time on a CPU: columns made
    contiguous (the loop reads one column and updates the rows after it), codes kept as floats until the end,
    no per-column spec dispatch. Every column costs a handful of small kernels; their launch overhead, not
    their arithmetic, is the time at these sizes."""
    qmin, qmax = spec.info.int_range(spec.symmetric)
    cols, col_scale, col_zp = block_columns(block, scale, zp)
    codes, errors = torch.empty_like(cols), torch.empty_like(cols)
    diag = torch.diagonal(h_blk)
    for i in range(cols.shape[0]):
        x, s = cols[i], col_scale[i]
        q = torch.round(x / s)
        if col_zp is not None:
            q += col_zp[i]
        q.clamp_(qmin, qmax)
        codes[i] = q
        dq = (q - col_zp[i]) * s if col_zp is not None else q * s
        err = (x - dq) / diag[i]
        errors[i] = err
        cols[i:].sub_(h_blk[i, i:, None] * err[None, :])
    return codes.t().to(torch.int8), errors.t()


def use_triton(w: torch.Tensor, spec: TensorSpec) -> bool:
    """The fused kernel (`gptq_triton`) serves integer codes on CUDA, or anywhere under TRITON_INTERPRET=1
    (how its tests run without a GPU)."""
    import os

    if spec.info.is_float or not (w.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_numba(w: torch.Tensor, spec: TensorSpec) -> bool:
    """The compiled CPU loop (`gptq_cpu`) serves integer codes of CPU tensors where numba imports
    (LLMC_GPTQ_EAGER=1 keeps the eager loop, e.g. to compare them)."""
    import os

    if spec.info.is_float or w.device.type != "cpu" or os.environ.get("LLMC_GPTQ_EAGER") == "1":
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def gptq_block_cpu(
    block: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, h_blk: torch.Tensor, spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    from llmc.quant.algorithms.gptq_cpu import gptq_block

    return gptq_block(block, scale, zp, h_blk, spec)


def gptq_block_triton(
    block: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, h_blk: torch.Tensor, spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    from llmc.quant.algorithms.gptq_triton import gptq_block

    return gptq_block(block, scale, zp, h_blk, spec)


@register("gptq", kind="quantizer", options=GptqOptions, propagate="quantized", hessians=True, block_scaled=True)
def gptq_layer(linears: dict[str, nn.Linear], stats, weights: TensorSpec,
               options: GptqOptions) -> dict[str, QuantizedWeight]:
    """GPTQ for every target Linear of a layer, Linears that read one input stacked (one Hessian, one loop)."""
    by_input: dict[str, list[str]] = {}
    for name in linears:
        by_input.setdefault(stats.hessian_of[name], []).append(name)
    out = {}
    for key, names in by_input.items():
        results, _ = gptq_quantize_shared([linears[n].weight.data for n in names], stats.hessians[key], weights,
                                          options, names)
        out.update(zip(names, results))
    return out
