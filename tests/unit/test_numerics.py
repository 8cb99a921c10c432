"""RTN numerics: ranges, error bounds, and bit-exact agreement with compressed-tensors' quantizer."""

from __future__ import annotations

import pytest
import torch

from llmc.quant.numerics import (
    compute_qparams,
    dequantize_weight,
    fake_quantize,
    quantize_weight,
    static_scale,
)
from llmc.quant.spec import TensorSpec

SPECS = {
    "fp8-tensor": TensorSpec("fp8_e4m3", "tensor"),
    "fp8-channel": TensorSpec("fp8_e4m3", "channel"),
    "int8-channel": TensorSpec("int8", "channel"),
    "int8-channel-asym": TensorSpec("int8", "channel", symmetric=False),
    "int4-g32": TensorSpec("int4", "group", group_size=32),
    "int4-g32-asym": TensorSpec("int4", "group", group_size=32, symmetric=False),
    "int4-channel": TensorSpec("int4", "channel"),
}


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 128, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row must stay exact
    w[5, 7] = 1.5  # an outlier
    return w


@pytest.mark.parametrize("name", SPECS)
def test_codes_in_range_and_error_bounded(name: str) -> None:
    spec = SPECS[name]
    w = _weight()
    q = quantize_weight(w, spec)
    deq = dequantize_weight(q, spec)
    assert deq.shape == w.shape
    assert torch.equal(deq[3], torch.zeros_like(deq[3]))
    if spec.format == "fp8_e4m3":
        assert q.codes.dtype == torch.float8_e4m3fn
        assert q.codes.float().abs().max() <= 448
        rel = ((deq - w).abs() / w.abs().clamp_min(1e-3)).median()
        assert rel < 0.07  # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values
    else:
        lo, hi = (-8, 7) if spec.format == "int4" else (-128, 127)
        assert q.codes.dtype == torch.int8
        assert lo <= q.codes.min() and q.codes.max() <= hi
        scale = q.scale.repeat_interleave(spec.group_size, -1) if spec.strategy == "group" else q.scale
        # round-to-nearest: error at most half a step, except the clamped positive absmax of a
        # symmetric grid (absmax / 7.5 * 7.5 rounds to 8 -> clamped to 7: one full step)
        assert ((deq - w).abs() <= scale * 1.0 + 1e-7).all()
        inner = (deq - w).abs() <= scale * 0.5 + 1e-6
        assert inner.float().mean() > 0.97
    expected_scale_shape = {"tensor": (1,), "channel": (48, 1), "group": (48, 128 // 32)}[spec.strategy]
    assert tuple(q.scale.shape) == expected_scale_shape
    assert (q.zero_point is not None) == (not spec.symmetric)


@pytest.mark.parametrize("name", SPECS)
def test_matches_compressed_tensors_quantizer_bit_exactly(name: str) -> None:
    """Our codes are what compressed-tensors (the format vLLM reads) computes for our scales."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    spec = SPECS[name]
    w = _weight(1)
    q = quantize_weight(w, spec)
    args = QuantizationArgs(
        num_bits=spec.bits,
        type="float" if spec.info.is_float else "int",
        strategy=spec.strategy,
        group_size=spec.group_size,
        symmetric=spec.symmetric,
    )
    dtype = torch.float8_e4m3fn if spec.info.is_float else torch.int8
    theirs = quantize(x=w, scale=q.scale, zero_point=q.zero_point, args=args, dtype=dtype)
    assert torch.equal(theirs.float(), q.codes.float())
    their_deq = dequantize(x_q=q.codes, scale=q.scale, zero_point=q.zero_point, args=args)
    assert torch.allclose(their_deq.float(), dequantize_weight(q, spec), atol=0, rtol=1e-6)


def test_symmetric_int_scale_convention() -> None:
    """Symmetric int scale = absmax / ((qmax - qmin) / 2): absmax/7.5 for int4, absmax/127.5 for int8."""
    x = torch.tensor([[-3.0, 1.0, 2.0, 0.5]])
    s4, _ = compute_qparams(x, TensorSpec("int4", "channel"))
    s8, _ = compute_qparams(x, TensorSpec("int8", "channel"))
    assert s4.item() == pytest.approx(3.0 / 7.5)
    assert s8.item() == pytest.approx(3.0 / 127.5)


def test_asymmetric_range_includes_zero() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # all positive: range must still include 0
    spec = TensorSpec("int4", "channel", symmetric=False)
    q = quantize_weight(x, spec)
    assert q.scale.item() == pytest.approx(4.0 / 15)
    assert dequantize_weight(q, spec)[0, 0].item() == pytest.approx(1.0, abs=4.0 / 30)
    assert q.zero_point.item() == -8  # qmin - round(0 / scale)


def test_dynamic_per_token_fake_quant_uses_each_tokens_range() -> None:
    spec = TensorSpec("int8", "token", dynamic=True)
    x = torch.stack([torch.linspace(-1, 1, 64), torch.linspace(-100, 100, 64)])
    y = fake_quantize(x, spec)
    assert (y[0] - x[0]).abs().max() <= 1 / 127 / 2 + 1e-6
    assert (y[1] - x[1]).abs().max() <= 100 / 127 / 2 + 1e-4
    # like vLLM's dynamic int8 quantizer (absmax / 127), each token's absmax is exact, not clipped
    assert y[1].abs().max().item() == 100.0 and y[0].abs().max().item() == 1.0


def test_static_scale_is_idempotent_fake_quant() -> None:
    spec = TensorSpec("fp8_e4m3", "tensor")
    x = torch.randn(4, 32)
    s = static_scale(x.abs().amax(), spec)
    once = fake_quantize(x, spec, s)
    assert torch.equal(fake_quantize(once, spec, s), once)
    assert s.item() == pytest.approx(x.abs().max().item() / 448)


def test_group_size_must_divide() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(torch.randn(4, 96), TensorSpec("int4", "group", group_size=64))


W4_FP8_ROW = TensorSpec("int4", "group", group_size=32, scale_grid="fp8_row")


def _w4afp8_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 0.1
    w[:, 7] *= 20.0  # an outlier input: its group's scale sets most rows' maximum
    w[3, :32] = 0.0  # an all-zero group
    w[5] *= 1e-6  # a row below vLLM's smallest FP8 row scale (1 / (448 * 512) per group maximum)
    w[9] = 0.0  # an all-zero row
    return w


def test_fp8_row_scales_are_unchanged_by_vllms_w4a8_conversion() -> None:
    """Served = scored: the group scales llmc stores on the fp8_row grid are exactly what vLLM's W4A8-FP8 kernel
    multiplies by after its load-time conversion (bf16, per-row FP8, /8 repack); plain scales are not."""
    from llmc.quant.numerics import fp8_row_group_scales

    w = _w4afp8_weight()
    snapped, _ = compute_qparams(w, W4_FP8_ROW)
    plain, _ = compute_qparams(w, TensorSpec("int4", "group", group_size=32))
    assert torch.equal(fp8_row_group_scales(snapped), snapped)
    assert torch.equal(fp8_row_group_scales(snapped.to(torch.bfloat16)), snapped)  # as vLLM holds them: bf16
    assert not torch.equal(fp8_row_group_scales(plain), plain)
    assert bool((snapped > 0).all())
    # nearest grid point: within half an FP8 step (2^-4 relative, + bf16's 2^-9) for groups not far below the
    # row's maximum, where the FP8 value is normal even after the kernel's /8
    live = w.reshape(64, 8, 32).abs().amax(dim=-1) > 0  # an all-zero group's plain scale is 1, not a range
    row_max = torch.where(live, plain, 0).amax(dim=-1, keepdim=True)
    normal = live & (plain >= row_max / 32) & (row_max > 1e-3)
    assert float(((snapped - plain).abs() / plain)[normal].max()) <= 2**-4 + 2**-9
    # the all-zero row and group quantize to zero codes and stay exact
    q = quantize_weight(w, W4_FP8_ROW)
    assert torch.equal(dequantize_weight(q, W4_FP8_ROW)[9], w[9]) and bool((q.codes[3, :32] == 0).all())


def test_fp8_row_grid_loses_less_than_vllm_converting_plain_scales() -> None:
    from llmc.quant.numerics import dequantize, fp8_row_group_scales

    w = _w4afp8_weight()[10:]
    plain_spec = TensorSpec("int4", "group", group_size=32)
    plain = quantize_weight(w, plain_spec)
    served_plain = dequantize(plain.codes, fp8_row_group_scales(plain.scale), None, plain_spec)
    snapped = dequantize_weight(quantize_weight(w, W4_FP8_ROW), W4_FP8_ROW)

    def err(x: torch.Tensor) -> float:
        return float((x - w).norm() / w.norm())

    assert err(snapped) < err(served_plain)
    assert err(snapped) < 1.01 * err(dequantize_weight(plain, plain_spec))  # the grid itself costs under 1%


@pytest.mark.parametrize("name", [*SPECS, "int4-g32-fp8-row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_quantized_in_blocks_of_rows_is_bit_identical_to_the_whole(name: str, dtype: torch.dtype) -> None:
    """Large weights are quantized and dequantized a block of rows at a time (one block's float32 temporaries):
    codes, scales, zero points and the dequantized weight must not change by a bit, whatever the block size
    (blocks of one row, of rows that do not divide the weight's, and of more than one row)."""
    spec = SPECS.get(name) or TensorSpec("int4", "group", group_size=32, scale_grid="fp8_row")
    w = _weight(3).to(dtype)
    w[10:13] *= 40.0  # the block holding these rows alone sets a per-tensor range
    whole = quantize_weight(w, spec, block_elements=w.numel())
    for block in (128, 5 * 128, 7 * 128 + 1):
        q = quantize_weight(w, spec, block_elements=block)
        assert torch.equal(q.codes.view(torch.int8), whole.codes.view(torch.int8)), block
        assert torch.equal(q.scale, whole.scale) and q.scale.shape == whole.scale.shape
        assert (q.zero_point is None) == (whole.zero_point is None)
        if q.zero_point is not None:
            assert torch.equal(q.zero_point, whole.zero_point)
        for out in (None, torch.bfloat16):
            expected = dequantize_weight(whole, spec, out, block_elements=w.numel())
            assert torch.equal(dequantize_weight(q, spec, out, block_elements=block), expected)
            assert expected.dtype == (out or torch.float32)


@pytest.mark.parametrize("name", ["fp8-tensor", "int4-g32-asym"])
def test_blocked_codes_and_weights_stay_on_the_weights_device(name: str) -> None:
    """The blocked path allocates its outputs itself: on the weight's device (a GPU in calibration), not the host.
    The meta device stands in for a GPU here."""
    w = torch.empty(64, 128, device="meta")
    q = quantize_weight(w, SPECS[name], block_elements=500)
    assert q.codes.device == q.scale.device == w.device
    assert dequantize_weight(q, SPECS[name], torch.bfloat16, block_elements=500).device == w.device
