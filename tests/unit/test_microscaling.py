"""NVFP4 / MXFP4 / MXFP8 and block-wise FP8 numerics, bit for bit against the formats' definitions.

References are built here from the definitions, not from llmc's code: E2M1 and E4M3 values from their bit fields
(OCP Microscaling spec v1.0 §5.3), round-to-nearest-even by brute force over every representable value, E8M0 as
2^(e - 127), the MX shared exponent as floor(log2(amax)) - emax_elem (§6.3), NVFP4's scales as compressed-tensors
and ModelOpt compute them."""

from __future__ import annotations

import math

import pytest
import torch

from llmc.errors import InputError
from llmc.quant.block_fp8 import (
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from llmc.quant.microscaling import (
    MXFP4,
    MXFP8,
    NVFP4,
    dequantize_blocks,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    e8m0_decode,
    e8m0_shared_exponent,
    global_scale_from_modelopt,
    modelopt_weight_scale_2,
    nvfp4_global_scale,
    pack_e2m1,
    quantize_blocks,
    quantize_with_scales,
    unpack_e2m1,
)


def _e2m1_from_bits(code: int) -> float:
    """E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal (0.m × 2^0)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _e4m3_from_bits(byte: int) -> float:
    """E4M3 (fn): bias 7, exponent 0 subnormal (m/8 × 2^-6), S.1111.111 NaN, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    return sign * (man / 8 * 2.0**-6 if exp == 0 else 2.0 ** (exp - 7) * (1 + man / 8))


def _nearest_even(y: torch.Tensor, codes: list[int], value) -> torch.Tensor:
    """Brute-force round to nearest over the given codes (ties to the even code), saturating at the extremes:
    returns the chosen code for every y."""
    grid = torch.tensor([value(c) for c in codes], dtype=torch.float64)
    code_t = torch.tensor(codes)
    dist = (y.double().unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    # Among the nearest, prefer an even code (its mantissa's last bit is 0); a unique nearest has no choice.
    even = tied & (code_t % 2 == 0)
    pick = torch.where(even.any(dim=-1, keepdim=True), even, tied).float().argmax(dim=-1)
    return code_t[pick]


E2M1_POSITIVE = list(range(8))
E4M3_POSITIVE = list(range(0x7F))  # 0x7F is NaN


def _probe_points(grid: list[float]) -> torch.Tensor:
    """Every representable value, every midpoint between neighbours, and points just either side of each."""
    g = sorted(set(grid))
    mids = [(a + b) / 2 for a, b in zip(g, g[1:])]
    pts = g + mids + [m * (1 + 1e-6) for m in mids] + [m * (1 - 1e-6) for m in mids if m > 0]
    pts += [g[-1] * 1.01, g[-1] * 1000]  # beyond the largest value: saturates
    return torch.tensor(sorted(pts), dtype=torch.float32)


# --------------------------------------------------------------------------- E2M1


def test_e2m1_codes_decode_to_their_bit_fields() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == [_e2m1_from_bits(c) for c in range(16)]
    assert [_e2m1_from_bits(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)  # -0 keeps its sign bit: code 8


def test_e2m1_rounds_to_nearest_even_and_saturates() -> None:
    pts = _probe_points([_e2m1_from_bits(c) for c in E2M1_POSITIVE])
    for y in (pts, -pts):
        expected = _nearest_even(y.abs(), E2M1_POSITIVE, _e2m1_from_bits) | (8 * torch.signbit(y))
        got = e2m1_encode(y)
        assert torch.equal(got.long(), expected.long()), y[got.long() != expected.long()]
        assert torch.equal(e2m1_round(y), e2m1_decode(got))
    # The ties, spelled out: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_round(ties).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert e2m1_round(torch.tensor([6.5, 1e30, -7.0])).tolist() == [6, 6, -6]


def test_e2m1_packing_puts_the_even_element_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15, 8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x8F]]
    assert torch.equal(unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(codes[:, :5])


# --------------------------------------------------------------------------- E8M0 and the MX shared exponent


def test_e8m0_is_a_biased_power_of_two_and_0xff_is_nan() -> None:
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_decode(e)
    assert v[:255].tolist() == [2.0 ** (i - 127) for i in range(255)]  # 2^-127 (a float32 subnormal) .. 2^127
    assert math.isnan(v[255].item())


def test_mx_shared_exponent_is_floor_log2_amax_less_emax_elem() -> None:
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([
        torch.exp2(torch.randn(2000, generator=g) * 30),
        torch.tensor([1.0, 2.0, 0.5, 6.0, 448.0, 1.9999999, 2.0**-130, 2.0**-149, 3e38]),
    ])
    for emax in (2, 8):
        got = e8m0_shared_exponent(amax, emax).long()
        expected = [min(max(math.floor(math.log2(a)) - emax, -127), 127) + 127 for a in amax.double().tolist()]
        assert got.tolist() == expected
    assert e8m0_shared_exponent(torch.tensor([0.0]), 2).tolist() == [0]  # a zero block: the smallest scale


@pytest.mark.parametrize("fmt", [MXFP4, MXFP8], ids=lambda f: f.name)
def test_mx_codes_are_the_nearest_even_element_of_x_over_the_shared_scale(fmt) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4 * fmt.block_size, generator=g) * torch.exp2(torch.randint(-20, 20, (8, 1), generator=g))
    x[2] = 0.0
    x[3, :fmt.block_size] = torch.linspace(-1.95, 1.95, fmt.block_size)  # amax / 2^(0 - emax) > max: saturates
    q = quantize_blocks(x, fmt)
    assert q.global_scale is None and q.scale.dtype == torch.uint8
    assert q.scale.shape == (8, 4)
    blocks = x.unflatten(-1, (-1, fmt.block_size))
    exps = [[math.floor(math.log2(a)) - fmt.element_emax if a > 0 else -127 for a in row]
            for row in blocks.abs().amax(-1).double().tolist()]
    assert (q.scale.long() - 127).tolist() == exps
    y = blocks / torch.exp2(torch.tensor(exps, dtype=torch.float32)).unsqueeze(-1)
    if fmt.element == "e2m1":
        expected = _nearest_even(y.abs(), E2M1_POSITIVE, _e2m1_from_bits) | (8 * torch.signbit(y))
        assert torch.equal(q.codes.unflatten(-1, (-1, fmt.block_size)).long(), expected.long())
    else:
        expected = _nearest_even(y.abs(), E4M3_POSITIVE, _e4m3_from_bits) | (0x80 * torch.signbit(y))
        got = q.codes.view(torch.uint8).unflatten(-1, (-1, fmt.block_size)).long()
        assert torch.equal(got, expected.long())
    # value = element × 2^shared, exactly
    dq = dequantize_blocks(q)
    elem = e2m1_decode(q.codes) if fmt.element == "e2m1" else q.codes.float()
    assert torch.equal(dq, (elem.unflatten(-1, (-1, fmt.block_size)) * y.new_tensor(exps).exp2().unsqueeze(-1))
                       .flatten(-2))
    assert torch.equal(dq[2], torch.zeros_like(dq[2]))


def test_mxfp8_elements_round_to_nearest_even_at_every_e4m3_midpoint() -> None:
    """Every E4M3 value, every midpoint (the ties) and points beside them, quantized at scale 1 (exponent 127)."""
    pts = _probe_points([_e4m3_from_bits(b) for b in E4M3_POSITIVE])
    pts = torch.cat([pts, -pts, torch.zeros(-2 * len(pts) % 32)]).reshape(1, -1)
    scale = torch.full((1, pts.shape[1] // 32), 127, dtype=torch.uint8)
    got = quantize_with_scales(pts, scale, MXFP8).codes.view(torch.uint8).long()
    expected = _nearest_even(pts.abs(), E4M3_POSITIVE, _e4m3_from_bits) | (0x80 * torch.signbit(pts))
    assert torch.equal(got, expected.long())


def test_mxfp8_subnormal_elements_round_to_nearest_even() -> None:
    """A block whose amax sets the exponent with small companions: those land on E4M3's subnormals (2^-9 steps)."""
    x = torch.zeros(1, 32)
    x[0, 0] = 256.0  # shared scale 2^(8 - 8) = 1
    x[0, 1:9] = torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-9, 5 * 2.0**-10, 7 * 2.0**-10, 2.0**-7, 2.0**-6, 1e-9])
    q = quantize_blocks(x, MXFP8)
    assert q.scale.tolist() == [[127]]
    assert dequantize_blocks(q)[0, 1:9].tolist() == [0.0, 2.0**-9, 2.0**-9, 2.0**-8, 4 * 2.0**-9, 2.0**-7,
                                                       2.0**-6, 0.0]


# --------------------------------------------------------------------------- NVFP4


def _weight(rows: int = 32, cols: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[1] = 0.0
    w[2, :16] = 0.0  # one all-zero block in a live row
    w[3, 16:32] *= 1e-4  # a block with subnormal E4M3 scale
    w[4, 5] = 0.7  # an outlier: sets the global scale
    return w


def test_nvfp4_scales_follow_compressed_tensors_convention() -> None:
    w = _weight()
    q = quantize_blocks(w, NVFP4)
    amax = w.abs().amax()
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (1,)
    assert q.global_scale.item() == pytest.approx(448 * 6 / amax.item(), rel=1e-7)
    block_amax = w.unflatten(-1, (-1, 16)).abs().amax(-1)
    expected = (block_amax / 6 * q.global_scale).to(torch.float8_e4m3fn)
    live = block_amax > 0
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (32, 8)
    assert torch.equal(q.scale.float()[live], expected.float()[live])
    assert q.scale.float().max().item() == 448.0  # the largest block uses the top of E4M3
    assert q.scale[3, 1].float().item() < 2.0**-6  # a subnormal block scale, decoded exactly
    assert torch.equal(q.scale.float()[~live], torch.zeros(int((~live).sum())))
    dq = dequantize_blocks(q)
    assert torch.equal(dq[1], torch.zeros(128)) and torch.equal(dq[2, :16], torch.zeros(16))
    # Every element is within half an E2M1 step (at most 1 × block scale, at the 4..6 step) of the input, or,
    # where the block scale rounded down, saturated at 6 × block scale; and exactly code × (scale / global scale).
    step = (q.scale.float() / q.global_scale).repeat_interleave(16, -1)
    saturated = block_amax.repeat_interleave(16, -1) - 6 * step
    assert ((dq - w).abs() <= torch.maximum(step, saturated) + 1e-12).all()
    normal = (q.scale.float() >= 2.0**-6).repeat_interleave(16, -1)  # E4M3 normals: 3 mantissa bits, no saturation
    assert ((dq - w).abs()[normal] <= step[normal]).all()
    assert torch.equal(dq, e2m1_decode(q.codes) * step)


def test_nvfp4_hand_checked_case_follows_the_spec() -> None:
    """Three 16-element blocks worked by hand from NVIDIA's definition: global scale 448 · 6 / amax, block scale
    e4m3(block amax / 6 · global scale), codes the E2M1 nearest (ties to even) of x / (block scale / global)."""
    w = torch.zeros(1, 48)
    w[0, :8] = torch.tensor([6.0, -3.0, 1.5, 0.25, 0.75, 2.5, 5.0, -0.1])  # amax 6: global scale 448
    w[0, 16:20] = torch.tensor([0.75, 0.1875, -0.0625, 0.3125])  # scale 0.75 / 6 · 448 = 56: step 1/8
    w[0, 32:34] = torch.tensor([1.0, -0.5])  # 1 / 6 · 448 = 74.67 rounds to E4M3 72: step 72/448, 1.0 saturates
    q = quantize_blocks(w, NVFP4)
    assert q.global_scale.item() == 448.0
    assert modelopt_weight_scale_2(q.global_scale).item() == pytest.approx(1 / 448, rel=1e-7)
    assert q.scale.float().tolist() == [[448.0, 56.0, 72.0]]
    # 0.25 and 0.75, 2.5, 5 are E2M1 midpoints: they go to the even mantissa (0, 1, 2, 4); -0.1 to -0 (code 8).
    assert q.codes[0, :8].tolist() == [7, 13, 3, 0, 2, 4, 6, 8]
    assert q.codes[0, 16:20].tolist() == [7, 3, 9, 4]
    assert q.codes[0, 32:34].tolist() == [7, 13]
    assert int(q.codes[0, 8:16].sum() + q.codes[0, 20:32].sum() + q.codes[0, 34:].sum()) == 0
    expected = torch.zeros(1, 48)
    expected[0, :8] = torch.tensor([6.0, -3.0, 1.5, 0.0, 1.0, 2.0, 4.0, -0.0])
    expected[0, 16:20] = torch.tensor([0.75, 0.1875, -0.0625, 0.25])
    expected[0, 32:34] = torch.tensor([6.0, -3.0]) * (72.0 / 448.0)
    assert torch.allclose(dequantize_blocks(q), expected, rtol=2.0**-23, atol=0)
    assert pack_e2m1(q.codes)[0, :4].tolist() == [0xD7, 0x03, 0x42, 0x86]  # even element in the low nibble


def test_nvfp4_block_scale_never_underflows_to_zero_for_a_live_block() -> None:
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0
    w[0, 16] = 1e-6  # amax / 6 × global scale ≈ 4.5e-4 < 2^-10: rounds to 0 in E4M3
    q = quantize_blocks(w, NVFP4)
    assert q.scale[0, 1].float().item() == 2.0**-9
    step = 2.0**-9 / q.global_scale.item()  # 1e-6 is 1.375 steps: code 1.5, where a zero scale would give 0
    assert dequantize_blocks(q)[0, 16].item() == pytest.approx(1.5 * step, rel=1e-6)


def test_nvfp4_global_scale_stays_finite_for_a_subnormal_tensor() -> None:
    w = torch.full((1, 16), 1e-39)  # 448 * 6 / 1e-39 overflows float32
    q = quantize_blocks(w, NVFP4)
    assert torch.isfinite(q.global_scale).all() and q.global_scale.item() == torch.finfo(torch.float32).max
    assert torch.isfinite(dequantize_blocks(q)).all()
    assert nvfp4_global_scale(torch.tensor(0.0)).item() == 1.0


def test_nvfp4_activations_with_a_calibrated_global_scale_saturate_beyond_it() -> None:
    calibrated = nvfp4_global_scale(torch.tensor(1.0))
    x = torch.tensor([[0.1] * 15 + [3.0]])  # three times the calibrated range
    q = quantize_blocks(x, NVFP4, global_scale=calibrated)
    assert q.scale.float().item() == 448.0
    assert e2m1_decode(q.codes)[0, -1].item() == 6.0
    assert dequantize_blocks(q)[0, -1].item() == pytest.approx(1.0)


def test_modelopt_weight_scale_2_is_the_reciprocal_and_both_conventions_decode_alike() -> None:
    w = _weight(seed=3)
    q = quantize_blocks(w, NVFP4)
    ws2 = modelopt_weight_scale_2(q.global_scale)
    assert ws2.item() == pytest.approx(w.abs().amax().item() / (6 * 448), rel=1e-7)
    assert global_scale_from_modelopt(ws2).item() == pytest.approx(q.global_scale.item(), rel=1e-7)
    # ModelOpt decodes code × (weight_scale × weight_scale_2); compressed-tensors code × (weight_scale / global):
    # the same up to float32 rounding of the reciprocal.
    modelopt = e2m1_decode(q.codes) * (q.scale.float() * ws2).repeat_interleave(16, -1)
    dq = dequantize_blocks(q)
    assert ((modelopt - dq).abs() <= dq.abs() * 2.0**-22).all()


# --------------------------------------------------------------------------- common


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4, MXFP8], ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(fmt, bad) -> None:
    w = _weight()
    w[7, 9] = bad
    with pytest.raises(InputError, match="NaN or infinite"):
        quantize_blocks(w, fmt)


def test_block_fp8_refuses_non_finite_input() -> None:
    w = _weight()
    w[0, 0] = math.inf
    with pytest.raises(InputError, match="NaN or infinite"):
        quantize_fp8_blocks(w)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4, MXFP8], ids=lambda f: f.name)
def test_width_must_divide_into_blocks(fmt) -> None:
    with pytest.raises(ValueError, match=f"blocks of {fmt.block_size}"):
        quantize_blocks(torch.ones(2, fmt.block_size + 8), fmt)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4, MXFP8], ids=lambda f: f.name)
def test_higher_rank_inputs_scale_along_the_last_dimension(fmt) -> None:
    x = _weight().reshape(4, 8, 128)
    q = quantize_blocks(x, fmt)
    flat = quantize_blocks(x.reshape(32, 128), fmt, global_scale=q.global_scale)
    assert torch.equal(q.codes.reshape(32, 128).view(torch.uint8), flat.codes.view(torch.uint8))
    assert torch.equal(dequantize_blocks(q).reshape(32, 128), dequantize_blocks(flat))


def test_everything_stays_on_the_inputs_device() -> None:
    """No host temporaries: the meta device stands in for a GPU (a host tensor mixed in would raise)."""
    w = torch.empty(64, 256, device="meta")
    for fmt in (NVFP4, MXFP4, MXFP8):
        q = quantize_blocks(w, fmt)
        assert q.codes.device == q.scale.device == w.device
        assert dequantize_blocks(q, torch.bfloat16).device == w.device
        if fmt.element == "e2m1":
            assert unpack_e2m1(pack_e2m1(q.codes)).device == w.device
    act = quantize_blocks(w, NVFP4, global_scale=torch.ones(1, device="meta"))
    assert act.global_scale.device == w.device
    codes, scale = quantize_fp8_blocks(w)
    assert codes.device == scale.device == dequantize_fp8_blocks(codes, scale).device == w.device
    codes, scale = quantize_fp8_groups(w.reshape(2, 32, 256))
    assert codes.device == scale.device == w.device


# --------------------------------------------------------------------------- block-wise FP8


def test_block_fp8_weight_scales_are_block_amax_over_448_with_partial_edges() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 200, generator=g) * 0.05
    w[128:256, 128:] = 0.0  # an all-zero (partial) block
    codes, scale = quantize_fp8_blocks(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = block.abs().max().item()
            assert scale[i, j].item() == (pytest.approx(amax / 448, rel=1e-7) if amax else 1.0)
            # each block's codes are e4m3(x / its own scale)
            expected = (block / scale[i, j]).to(torch.float8_e4m3fn)
            got = codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    dq = dequantize_fp8_blocks(codes, scale)
    assert dq.shape == w.shape and dequantize_fp8_blocks(codes, scale, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert ((dq - w).abs() <= w.abs() * 2.0**-4 + scale.max() * 2.0**-10).all()
    assert codes.float().abs().max().item() == 448.0


def test_block_fp8_activation_groups_are_per_token_per_128_channels() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 256, generator=g)
    x[1, 2, 128:] *= 100.0
    codes, scale = quantize_fp8_groups(x)
    assert scale.shape == (2, 3, 2)
    assert torch.allclose(scale, x.unflatten(-1, (2, 128)).abs().amax(-1) / 448, rtol=1e-7, atol=0)
    dq = dequantize_fp8_groups(codes, scale)
    assert dq.shape == x.shape
    assert ((dq - x).abs() <= x.abs() * 2.0**-4 + scale.repeat_interleave(128, -1) * 2.0**-10).all()
