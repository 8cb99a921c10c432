"""Block-scaled 4- and 8-bit floats (NVFP4, MXFP4, MXFP8) as pure functions over tensors.

Each format is data (`MicroscalingFormat`): an element type, how many consecutive elements along the last dimension
share one scale, and how that scale is encoded.

  - Elements. E2M1 (4 bits: sign, 2 exponent bits, 1 mantissa bit) holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; its code is
    the magnitude's index in that list, bit 3 the sign. E4M3 is torch.float8_e4m3fn (max 448, subnormals down to
    2^-9). Rounding is to nearest, ties to even, saturating at ±6 / ±448 (OCP Microscaling spec v1.0, §5.3).
  - MX scales (MXFP4, MXFP8: 32 elements per scale) are E8M0, 2^(e - 127), 0xFF = NaN. The shared exponent is
    floor(log2(amax)) - emax_elem (emax_elem 2 for E2M1, 8 for E4M3), clamped to the E8M0 range (spec §6.3).
  - NVFP4 (16 elements per scale): an E4M3 block scale times a float32 per-tensor scale. `global_scale` is kept as
    compressed-tensors stores it, a divisor: global_scale = 448 * 6 / amax(tensor), block scale =
    e4m3(amax(block) / 6 * global_scale), value = code * (block scale / global_scale). ModelOpt (and llama.cpp's
    GGUF `.scale` tensor) store its reciprocal as a multiplier, `weight_scale_2` (`modelopt_weight_scale_2`).

Every temporary is created on the input's device. Non-finite inputs are refused (an E4M3 cast would silently
saturate an inf to 448).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmc.errors import InputError
from llmc.quant.spec import FP8_E4M3_MAX

E2M1_MAX = 6.0
# Magnitude of each E2M1 code 0..7 (codes 8..15 are the same magnitudes, negative).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Smallest positive E4M3 value (a subnormal).
E4M3_MIN_SUBNORMAL = 2.0**-9


@dataclass(frozen=True)
class MicroscalingFormat:
    name: str
    element: Literal["e2m1", "e4m3"]
    block_size: int  # consecutive elements along the last dimension that share one scale
    scale: Literal["e8m0", "e4m3"]  # "e4m3" scales come with a float32 per-tensor global scale (NVFP4)

    @property
    def element_max(self) -> float:
        return E2M1_MAX if self.element == "e2m1" else FP8_E4M3_MAX

    @property
    def element_emax(self) -> int:
        """Exponent of the element type's largest normal power of two (OCP MX: emax_elem)."""
        return 2 if self.element == "e2m1" else 8

    @property
    def bits_per_element(self) -> float:
        """Stored bits per element, scales included (the per-tensor global scale aside)."""
        return (4 if self.element == "e2m1" else 8) + 8 / self.block_size


NVFP4 = MicroscalingFormat("nvfp4", element="e2m1", block_size=16, scale="e4m3")
MXFP4 = MicroscalingFormat("mxfp4", element="e2m1", block_size=32, scale="e8m0")
MXFP8 = MicroscalingFormat("mxfp8", element="e4m3", block_size=32, scale="e8m0")
MICROSCALING_FORMATS = {f.name: f for f in (NVFP4, MXFP4, MXFP8)}


@dataclass
class BlockQuantized:
    codes: torch.Tensor  # x's shape; uint8 E2M1 codes (0..15, unpacked) or float8_e4m3fn
    scale: torch.Tensor  # [..., n // block_size]: uint8 E8M0 exponents or float8_e4m3fn block scales
    global_scale: torch.Tensor | None  # NVFP4: float32 [1], compressed-tensors' divisor; None for MX
    format: MicroscalingFormat


# --------------------------------------------------------------------------- elements


def require_finite(amax: torch.Tensor, what: str) -> None:
    """Refuse NaN/Inf inputs, seen through their absolute maxima (NaN propagates into amax). Meta tensors hold no
    values, so they pass."""
    if amax.device.type != "meta" and not bool(torch.isfinite(amax).all()):
        raise InputError(f"{what} holds NaN or infinite values; no block-scaled format can represent them",
                         fix="find where the non-finite values come from (a corrupt checkpoint, an overflowed "
                             "fp16 weight) and quantize finite weights")


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """y rounded to the nearest E2M1 value, ties to even, saturating at ±6 (float32, sign kept, so -0.1 -> -0).

    The grid step is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; torch.round rounds halves to even, and an even multiple
    of the step is an E2M1 value with an even mantissa."""
    a = y.float().abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign((torch.round(a / step) * step).clamp(max=E2M1_MAX), y.float())


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, bit 3 the sign) of y rounded to nearest even with saturation."""
    r = e2m1_round(y)
    a = r.abs()
    # Magnitude -> index in E2M1_MAGNITUDES: 2a below 2 (0, .5, 1, 1.5 -> 0..3), a + 2 in [2, 4), a / 2 + 4 above.
    index = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    return index | (torch.signbit(r).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8).bool(), -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte along the last dimension, element 2i in the low nibble and 2i + 1 in the high one
    (compressed-tensors' `weight_packed`, ModelOpt's packed `weight`)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing E2M1 codes needs an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e8m0_decode(exponents: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) of E8M0 exponents (uint8); 0xFF is NaN."""
    e = exponents.to(torch.int32)
    one = torch.ones((), dtype=torch.float32, device=exponents.device)
    value = torch.ldexp(one, (e - E8M0_BIAS).float())
    return torch.where(e == E8M0_NAN, torch.nan, value)


def e8m0_shared_exponent(amax: torch.Tensor, element_emax: int) -> torch.Tensor:
    """E8M0 exponent (uint8) of the OCP MX shared scale 2^(floor(log2(amax)) - element_emax), clamped to the
    representable 2^-127..2^127; a block of zeros gets the smallest scale (exponent 0)."""
    _, e = torch.frexp(amax.float())  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    shared = (e - 1 - element_emax).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(amax > 0, shared + E8M0_BIAS, 0).to(torch.uint8)


# --------------------------------------------------------------------------- scales


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4 global scale 448 * 6 / amax (float32 [1]): the largest block's scale lands on
    E4M3's maximum. 1 for an all-zero tensor; at most float32's largest value (an amax below 2688 / 3.4e38)."""
    amax = amax.float().reshape(1)
    scale = ((FP8_E4M3_MAX * E2M1_MAX) / amax).clamp(max=torch.finfo(torch.float32).max)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def shared_nvfp4_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One NVFP4 global scale for weights a runtime fuses into one matmul (q/k/v, gate/up): from their joint amax.

    vLLM and SGLang load fused siblings with a single global scale, the largest stored one, so siblings stored with
    different global scales decode wrong there; llm-compressor's observers share the scale across such groups."""
    if not weights:
        raise ValueError("a shared global scale needs at least one weight")
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    require_finite(amax, "a weight quantized to nvfp4")
    return nvfp4_global_scale(amax)


# Sibling Linears that vLLM and SGLang load as one fused matmul with one NVFP4 global scale (the largest stored
# one): their global scales must be equal. llm-compressor 0.14's FUSED_LAYER_NAMES, which its observers share.
FUSED_PROJECTIONS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek's multi-latent attention
    ("w1", "w3"),  # MoE experts named Mixtral's way
)

def fused_groups(names: list[str]) -> list[list[str]]:
    """Module names grouped as runtimes fuse them: the members of one `FUSED_PROJECTIONS` set under one parent
    module form a group when all of them are present; every other name is a group of its own. Order follows
    `names` (a group sits where its first member does)."""
    by_parent: dict[str, dict[str, str]] = {}
    for name in names:
        parent, _, local = name.rpartition(".")
        by_parent.setdefault(parent, {})[local] = name
    group_of: dict[str, list[str]] = {}
    for parent, children in by_parent.items():
        for siblings in FUSED_PROJECTIONS:
            if all(s in children for s in siblings):
                group = [children[s] for s in siblings]
                for member in group:
                    group_of[member] = group
    groups, seen = [], set()
    for name in names:
        group = group_of.get(name, [name])
        if group[0] not in seen:
            seen.add(group[0])
            groups.append(group)
    return groups


def nvfp4_global_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The NVFP4 global scale of each Linear's weight (keyed by module name), shared within `fused_groups`: what a
    compressed-tensors or ModelOpt checkpoint must store for vLLM / SGLang to decode fused siblings right. Pass
    each to `quantize_blocks(w, NVFP4, global_scale=...)`."""
    scales = {}
    for group in fused_groups(list(weights)):
        shared = shared_nvfp4_global_scale([weights[name] for name in group])
        scales.update({name: shared.clone() for name in group})  # a tensor each: safetensors stores no aliases
    return scales


def modelopt_weight_scale_2(global_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor `weight_scale_2` (and llama.cpp's GGUF `.scale`): the multiplier 1 / global_scale."""
    return 1.0 / global_scale.float()


def global_scale_from_modelopt(weight_scale_2: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' divisor from ModelOpt's multiplier."""
    return 1.0 / weight_scale_2.float()


def _blocks(x: torch.Tensor, fmt: MicroscalingFormat) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % fmt.block_size:
        raise ValueError(f"{fmt.name} scales blocks of {fmt.block_size} elements along the last dimension; "
                         f"shape {tuple(x.shape)} does not divide into them")
    return x.unflatten(-1, (-1, fmt.block_size))


def nvfp4_block_scale(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales e4m3(amax / 6 * global_scale), saturating at 448. A block that is not all zero never gets
    scale 0 (its values would all round to 0): its scale is at least E4M3's smallest subnormal."""
    s = (block_amax.float() / E2M1_MAX * global_scale).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    floor = torch.full_like(s, E4M3_MIN_SUBNORMAL)
    return torch.where((block_amax > 0) & (s.float() == 0), floor, s)


def scale_values(scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """float32 scale each block's codes are multiplied by: 2^(e - 127) for E8M0 exponents (uint8), block scale /
    global scale for NVFP4."""
    if scale.dtype == torch.uint8:
        return e8m0_decode(scale)
    return scale.float() / global_scale


# --------------------------------------------------------------------------- quantize / dequantize


def encode_elements(x: torch.Tensor, step: torch.Tensor, fmt: MicroscalingFormat) -> torch.Tensor:
    """Element codes of x under the float32 scale `step` (broadcast against x): x / step rounded to the nearest
    element value, ties to even, saturating. Where `step` is 0 the code is 0. Uint8 E2M1 codes or float8_e4m3fn."""
    y = torch.where(step > 0, x.float() / torch.where(step > 0, step, 1.0), 0.0)
    if fmt.element == "e2m1":
        return e2m1_encode(y)
    return y.clamp(-fmt.element_max, fmt.element_max).to(torch.float8_e4m3fn)


def decode_elements(codes: torch.Tensor, fmt: MicroscalingFormat) -> torch.Tensor:
    """float32 element values of codes (before their scale)."""
    return e2m1_decode(codes) if fmt.element == "e2m1" else codes.float()


def quantize_with_scales(x: torch.Tensor, scale: torch.Tensor, fmt: MicroscalingFormat,
                         global_scale: torch.Tensor | None = None) -> BlockQuantized:
    """Codes of x for the given encoded block scales (round to nearest even, saturating). A block whose scale is 0
    gets zero codes."""
    codes = encode_elements(_blocks(x, fmt), scale_values(scale, global_scale).unsqueeze(-1), fmt)
    return BlockQuantized(codes=codes.flatten(-2), scale=scale, global_scale=global_scale, format=fmt)


def block_scales(block_amax: torch.Tensor, fmt: MicroscalingFormat,
                 global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest encoded scales of blocks with absolute maxima `block_amax`: E8M0 exponents (uint8, OCP's
    rule) for MX formats, E4M3 block scales under `global_scale` (broadcast against `block_amax`) for NVFP4."""
    if fmt.scale == "e8m0":
        if global_scale is not None:
            raise ValueError(f"{fmt.name} has no global scale")
        return e8m0_shared_exponent(block_amax, fmt.element_emax)
    if global_scale is None:
        raise ValueError(f"{fmt.name} block scales need the tensor's global scale")
    return nvfp4_block_scale(block_amax, global_scale)


def quantize_blocks(x: torch.Tensor, fmt: MicroscalingFormat,
                    global_scale: torch.Tensor | None = None) -> BlockQuantized:
    """Round-to-nearest codes and scales of x [..., n] in `fmt` (n a multiple of fmt.block_size).

    NVFP4 computes the global scale from x's absolute maximum unless one is given (a calibrated activation scale:
    then blocks beyond the calibrated range saturate; or [..., 1], one per row of stacked tensors, as GPTQ's loop
    passes them). MX formats take no global scale."""
    amax = _blocks(x.detach(), fmt).abs().amax(dim=-1)
    require_finite(amax, f"a tensor quantized to {fmt.name}")
    if fmt.scale == "e4m3":
        if global_scale is None:
            global_scale = nvfp4_global_scale(amax.amax() if amax.numel() else amax.new_zeros(()))
        global_scale = global_scale.float().to(x.device)
        global_scale = global_scale.reshape(1) if global_scale.numel() == 1 else global_scale
    return quantize_with_scales(x, block_scales(amax, fmt, global_scale), fmt, global_scale)


def dequantize_blocks(q: BlockQuantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values the codes stand for: float32 code * scale (compressed-tensors' order for NVFP4: code *
    (block scale / global scale)), then rounded once to `dtype` if given."""
    values = decode_elements(q.codes, q.format)
    out = (_blocks(values, q.format) * scale_values(q.scale, q.global_scale).unsqueeze(-1)).flatten(-2)
    return out if dtype is None else out.to(dtype)


# --------------------------------------------------------------------------- MXFP4 -> NVFP4 without re-rounding

# E4M3 holds every power of two from its smallest subnormal 2^-9 to 2^8 (448 is not a power of two): 18 of them.
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8


@dataclass
class Mxfp4Cast:
    """MXFP4 codes cast to NVFP4 (`nvfp4`), with how many 16-element blocks kept their codes exactly and how many
    were requantized from their decoded values (their MX scale lay below what E4M3 reaches under the global scale)."""

    nvfp4: BlockQuantized
    exact_blocks: int
    requantized_blocks: int


def mxfp4_cast_global_scale(blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The NVFP4 global scale (compressed-tensors' divisor, float32 [1]) an exact cast of these MXFP4 tensors uses,
    shared by all of them (fused siblings: gate and up). Each MX block's value is code * 2^(s - 127); NVFP4's is
    code * b / G. With G = 2^k and b = 2^(s - 127 + k) both are powers of two, so b / G is 2^(s - 127) exactly in
    float32 and the codes carry over unchanged, provided b is an E4M3 power of two: -9 <= s - 127 + k <= 8. k puts
    the largest non-zero block's scale on 2^8 (nothing can lie above it), so every block within 17 exponents of it
    casts exactly; one further below is requantized (`mxfp4_to_nvfp4`). `blocks`: (codes [..., n] uint8 E2M1
    unpacked, E8M0 exponents [..., n / 32] uint8) per tensor. All-zero tensors get 1, as `nvfp4_global_scale`."""
    top = None
    for codes, exponents in blocks:
        live = _blocks(codes, MXFP4).bitwise_and(0x7).amax(dim=-1) > 0  # a block holding a non-zero code
        if bool(live.any()):
            s = int(exponents[live].max())
            top = s if top is None else max(top, s)
    if top is None:
        return torch.ones(1, dtype=torch.float32)
    k = min(E4M3_POW2_MAX - (top - E8M0_BIAS), E8M0_BIAS)  # 2^k stays a finite float32
    return torch.ldexp(torch.ones(1), torch.tensor([float(k)]))


def mxfp4_to_nvfp4(codes: torch.Tensor, exponents: torch.Tensor, global_scale: torch.Tensor) -> Mxfp4Cast:
    """MXFP4 (E2M1 codes [..., n] unpacked, E8M0 exponents [..., n / 32]) as NVFP4 under `global_scale` (a power of
    two: `mxfp4_cast_global_scale`). Each 32-element block's two 16-element halves take the block scale
    2^(s - 127) * global_scale and keep their codes, bit for bit, wherever that is an E4M3 power of two; the value
    each element decodes to is then the MXFP4 one exactly. A half whose scale falls below E4M3's 2^-9 (and that
    holds a non-zero code) is requantized from its decoded values under the same global scale (round to nearest,
    `nvfp4_block_scale`): the only rounding, reported in `requantized_blocks`."""
    g = global_scale.float().reshape(1)
    _, e = torch.frexp(g)
    if not bool((torch.ldexp(torch.ones(1), e - 1) == g).all()):
        raise ValueError(f"an exact MXFP4 -> NVFP4 cast needs a power-of-two global scale, got {float(g)}")
    k = int(e) - 1
    t = (exponents.to(torch.int32) - E8M0_BIAS + k).repeat_interleave(MXFP4.block_size // NVFP4.block_size, dim=-1)
    live = _blocks(codes, NVFP4).bitwise_and(0x7).amax(dim=-1) > 0
    exact = (t >= E4M3_POW2_MIN) & (t <= E4M3_POW2_MAX)
    scale = torch.ldexp(torch.ones_like(t, dtype=torch.float32), t.clamp(E4M3_POW2_MIN, E4M3_POW2_MAX).float())
    # a block of zeros keeps its MX scale too where E4M3 holds it (requantizing then gives its codes back, -0 too)
    scale = torch.where(exact, scale, 0.0).to(torch.float8_e4m3fn)
    out = codes.clone()
    redo = live & ~exact
    if bool(redo.any()):
        values = (_blocks(e2m1_decode(codes), MXFP4) * e8m0_decode(exponents).unsqueeze(-1)).flatten(-2)
        values = _blocks(values, NVFP4)[redo]  # [blocks, 16]
        redo_scale = nvfp4_block_scale(values.abs().amax(dim=-1), g)
        _blocks(out, NVFP4)[redo] = encode_elements(values, scale_values(redo_scale, g).unsqueeze(-1), NVFP4)
        scale[redo] = redo_scale
    n_redo = int(redo.sum())
    return Mxfp4Cast(BlockQuantized(codes=out, scale=scale, global_scale=g.to(codes.device), format=NVFP4),
                     exact_blocks=int(live.sum()) - n_redo, requantized_blocks=n_redo)
