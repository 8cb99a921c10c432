"""Quantized originals llmc reads by decoding them, one tensor at a time as the layer stream reads it.

Frontier models ship no full-precision parent: DeepSeek-V3/R1 and Kimi-K2 are FP8 block-wise (config.json's
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`, an F8_E4M3 `X.weight` with one float32
`X.weight_scale_inv` per 128x128 block, edge blocks partial), gpt-oss's experts MXFP4 (`quant_method: mxfp4`,
`X_blocks` of packed E2M1 pairs and `X_scales` of E8M0 exponents, one per 32 elements). Each decoder here gives the
values the format's reference decoder gives, bit for bit (tests/unit/test_source_formats.py against transformers'
`Fp8Dequantize` / `_dequantize_fp8_weight` and `convert_moe_packed_tensors`): the product in float32, then rounded
once to the dtype the build computes in.

`decoding_map` pairs the stored tensors from their names, dtypes and shapes alone (safetensors headers), so the plan
checks a source through the same view the stream reads (`decoded_header`). A `quantization_config` whose method is
not one of these stays refused (llmc.model.checks); one of these methods with a variant no decoder here reads (FP8
E5M2, a block that is not 2-D) is refused by `source_format`, naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt
from llmc.quant.microscaling import E8M0_NAN, e2m1_decode, e8m0_decode, unpack_e2m1

FP8_SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name: X.weight -> X.weight_scale_inv (fused experts: X -> X_scale_inv)
FP8_ACTIVATION_SUFFIX = ".activation_scale"  # a static-activation FP8 checkpoint's input scales: not weights
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
MXFP4_BYTES_PER_BLOCK = 16  # 32 E2M1 elements, two a byte
_FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # float scales; F8_E8M0: transformers' scale_fmt ue8m0
_FIX = "re-download the checkpoint; its config.json and its tensors disagree"


@dataclass(frozen=True)
class SourceFormat:
    """A quantized original llmc decodes: `fp8-block` (with `block`), `fp8-tensor` or `mxfp4`."""

    name: str
    quant_method: str
    block: tuple[int, int] | None = None  # fp8-block: rows x columns one scale covers

    def describe(self) -> str:
        if self.name == "fp8-block":
            return "FP8 E4M3 block-wise ({}x{} blocks, a weight_scale_inv each)".format(*self.block)
        if self.name == "fp8-tensor":
            return "FP8 E4M3 with one weight_scale_inv per tensor"
        return "MXFP4 (E2M1 *_blocks with E8M0 *_scales per 32 elements)"


def source_format(config: dict) -> SourceFormat | None:
    """The decoder config.json's quantization_config asks for; None for a config without one or with a method no
    decoder here reads (llmc.model.checks refuses those by name). InputError for an FP8 or MXFP4 config that is
    malformed or a variant llmc does not decode."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method") or "").lower()
    where = "config.json's quantization_config"
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise InputError(f"{where} says quant_method 'fp8' with fmt {excerpt(fmt, 40)}; llmc decodes FP8 E4M3 "
                             "sources only", fix="point model.source at an E4M3 or full-precision checkpoint")
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise InputError(f"{where}: activation_scheme {excerpt(scheme, 40)} is neither dynamic nor static",
                             fix=_FIX)
        block = qc.get("weight_block_size")
        if block is None:
            return SourceFormat("fp8-tensor", method)
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 1 << 16
                                                                    for b in block)):
            raise InputError(f"{where}: weight_block_size is {excerpt(block, 40)}, not two positive whole numbers "
                             "(rows, columns)", fix=_FIX)
        return SourceFormat("fp8-block", method, (block[0], block[1]))
    if method == "mxfp4":
        return SourceFormat("mxfp4", method)
    return None


def decoded_config(config: dict) -> dict:
    """The config of the model a decoded source is: without the quantization_config it no longer has."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def statement(fmt: SourceFormat, dtype: str) -> str:
    """What the plan (and the build's report) says about a decoded source."""
    rounding = "" if dtype == "float32" else f", rounded once to {dtype}"
    kept = (" (a weight whose target format is the source's keeps the source's codes)" if fmt.name != "mxfp4" else
            " (experts whose target is MXFP4 keep the source's codes; an NVFP4 target gets them cast with the codes "
            "kept, exactly wherever a block's exponent lies within 17 of its expert's largest: llmc.quant.mxfp4_source)")
    return (f"model.source is a quantized original, {fmt.describe()} (quantization_config quant_method "
            f"'{fmt.quant_method}'): llmc decodes it layer by layer (each code times its scale, in float32"
            f"{rounding}) and quantizes the decoded weights{kept}; the baseline is the decoded original")


# --------------------------------------------------------------------------- pairing stored tensors

Header = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


@dataclass(frozen=True)
class Encoded:
    """One decoded tensor's stored parts."""

    codes: str
    scale: str
    shape: tuple[int, ...]  # of the decoded tensor


def decoding_map(fmt: SourceFormat, header: Header) -> tuple[dict[str, Encoded], set[str]]:
    """(decoded name -> its stored parts, stored names no decoded tensor stands for any more: the parts, and a
    static FP8 checkpoint's activation scales). InputError naming the tensor when a part's dtype or shape is not
    what the format stores."""
    if fmt.name == "mxfp4":
        return _mxfp4_map(header)
    return _fp8_map(fmt, header)


def _fp8_map(fmt: SourceFormat, header: Header) -> tuple[dict[str, Encoded], set[str]]:
    out, hidden = {}, set()
    for scale, (scale_dtype, scale_shape) in header.items():
        if not scale.endswith(FP8_SCALE_SUFFIX):
            continue
        codes = scale[: -len(FP8_SCALE_SUFFIX)]
        if codes not in header:
            raise InputError(f"model source: {excerpt(scale, 100)} scales a tensor {excerpt(codes, 100)} the "
                             "checkpoint does not hold", fix=_FIX)
        dtype, shape = header[codes]
        if dtype != "F8_E4M3" or len(shape) < 2:
            raise InputError(f"model source: {excerpt(codes, 100)} is {dtype} {list(shape)}; an FP8 source's scaled "
                             "weights are F8_E4M3 matrices", fix=_FIX)
        if scale_dtype not in _FP8_SCALE_DTYPES:
            raise InputError(f"model source: {excerpt(scale, 100)} is {scale_dtype}, not a float scale", fix=_FIX)
        want = fp8_scale_shape(fmt, tuple(shape))
        if fmt.name == "fp8-tensor" and math.prod(scale_shape) != 1 or fmt.name == "fp8-block" and tuple(
                scale_shape) != want:
            raise InputError(f"model source: {excerpt(scale, 100)} has shape {list(scale_shape)}, but "
                             f"{fmt.describe()} of the {list(shape)} weight has {list(want)}", fix=_FIX)
        out[codes] = Encoded(codes, scale, tuple(shape))
        hidden.add(scale)
        owner = codes.rsplit(".", 1)[0]
        if f"{owner}{FP8_ACTIVATION_SUFFIX}" in header:
            hidden.add(f"{owner}{FP8_ACTIVATION_SUFFIX}")
    return out, hidden


def fp8_scale_shape(fmt: SourceFormat, shape: tuple[int, ...]) -> tuple[int, ...]:
    if fmt.block is None:
        return ()
    *lead, rows, cols = shape
    return (*lead, -(-rows // fmt.block[0]), -(-cols // fmt.block[1]))


def _mxfp4_map(header: Header) -> tuple[dict[str, Encoded], set[str]]:
    out, hidden = {}, set()
    for blocks, (dtype, shape) in header.items():
        if not blocks.endswith(MXFP4_BLOCKS):
            continue
        name = blocks[: -len(MXFP4_BLOCKS)]
        scales = name + MXFP4_SCALES
        if scales not in header:
            raise InputError(f"model source: {excerpt(blocks, 100)} has no {excerpt(scales, 100)} beside it",
                             fix=_FIX)
        scale_dtype, scale_shape = header[scales]
        if (dtype != "U8" or scale_dtype != "U8" or len(shape) != 4 or shape[-1] != MXFP4_BYTES_PER_BLOCK
                or tuple(scale_shape) != tuple(shape[:-1])):
            raise InputError(f"model source: {excerpt(blocks, 100)} ({dtype} {list(shape)}) and its scales "
                             f"({scale_dtype} {list(scale_shape)}) are not MXFP4 experts (U8 [experts, rows, blocks, "
                             "16] and U8 [experts, rows, blocks])", fix=_FIX)
        experts, rows, n_blocks, _ = shape
        out[name] = Encoded(blocks, scales, (experts, n_blocks * 2 * MXFP4_BYTES_PER_BLOCK, rows))
        hidden |= {blocks, scales}
    return out, hidden


def decoded_header(fmt: SourceFormat, header: Header) -> Header:
    """The header of the checkpoint as the build reads it: each decoded tensor F32 of its decoded shape, its parts
    gone."""
    decoded, hidden = decoding_map(fmt, header)
    out = {n: v for n, v in header.items() if n not in hidden and n not in decoded}
    out.update({n: ("F32", e.shape) for n, e in decoded.items()})
    return out


# --------------------------------------------------------------------------- decoders

def decode_fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes [..., rows, cols] times their scale (one per `block`, edge blocks partial; None: one per tensor),
    in float32, then rounded once to `dtype`. The scales are expanded over rows only and broadcast over columns
    through a view (no second weight-sized float32 tensor)."""
    out = codes.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block is None:
        return out.mul_(scale.reshape(())).to(dtype)
    rows, cols = out.shape[-2:]
    full, rem = divmod(cols, block[1])
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(scale[..., :full, None])
    if rem:
        out[..., full * block[1]:].mul_(scale[..., full:])
    return out.to(dtype)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                 name: str = "an MXFP4 tensor") -> torch.Tensor:
    """gpt-oss's MXFP4 experts: blocks uint8 [experts, rows, n, 16] (element 2i in the low nibble) and E8M0 scales
    uint8 [experts, rows, n], decoded to [experts, n * 32, rows] (the layout transformers' GptOssExperts holds),
    one expert at a time in float32 and rounded once to `dtype`. A scale of 0xFF (NaN) is refused."""
    if bool((scales == E8M0_NAN).any()):
        raise InputError(f"model source: {name}'s scales hold E8M0 0xFF (NaN); no weight is NaN", fix=_FIX)
    experts, rows, n, _ = blocks.shape
    # each byte's two values looked up at once (twice as fast as unpacking the nibbles, then decoding them)
    pairs = e2m1_decode(unpack_e2m1(torch.arange(256, dtype=torch.uint8).unsqueeze(-1)))  # [256, 2]: low, high
    out = torch.empty(experts, n * 2 * MXFP4_BYTES_PER_BLOCK, rows, dtype=dtype)
    for e in range(experts):
        values = pairs[blocks[e].int()].reshape(rows, n, -1).mul_(e8m0_decode(scales[e]).unsqueeze(-1))
        out[e] = values.reshape(rows, -1).T
    return out


def decode(fmt: SourceFormat, encoded: Encoded, parts: dict[str, torch.Tensor],
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One decoded tensor from its stored parts (keyed by their stored names)."""
    if fmt.name == "mxfp4":
        return decode_mxfp4(parts[encoded.codes], parts[encoded.scale], dtype, encoded.codes)
    return decode_fp8(parts[encoded.codes], parts[encoded.scale], fmt.block, dtype)
