"""Block-wise FP8 (DeepSeek-V3 style) as pure functions over tensors.

Weights [out, in] get one float32 scale per 128x128 block ([ceil(out/128), ceil(in/128)]; edge blocks are partial,
as compressed-tensors' `block` strategy and DeepSeek's `weight_scale_inv` have them); activations get one scale per
token per 128 consecutive channels, computed at run time (a 1x128 block of the tokens-by-channels matrix). Scale =
amax / 448, codes = e4m3(x / scale), saturating; an all-zero block gets scale 1 (llmc's convention, `numerics.py`).
"""

from __future__ import annotations

import torch

from llmc.quant.microscaling import require_finite
from llmc.quant.spec import FP8_E4M3_MAX

WEIGHT_BLOCK = (128, 128)
ACTIVATION_GROUP = 128


def _padded_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [rows, cols] zero-padded to whole blocks, viewed [row blocks, block rows, col blocks, block cols]."""
    rows, cols = x.shape
    br, bc = block
    padded = torch.nn.functional.pad(x, (0, -cols % bc, 0, -rows % br))
    return padded.unflatten(0, (-1, br)).unflatten(2, (-1, bc))


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize_fp8_blocks(x: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes [rows, cols] and float32 scales [ceil(rows/br), ceil(cols/bc)] of a 2-D x."""
    if x.dim() != 2:
        raise ValueError(f"block-wise FP8 takes a 2-D tensor, got shape {tuple(x.shape)}")
    amax = _padded_blocks(x.detach().float(), block).abs().amax(dim=(1, 3))
    require_finite(amax, "a tensor quantized to block-wise FP8")
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)
    codes = (x.float() / _expand(scale, x.shape, block)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return codes.to(torch.float8_e4m3fn), scale


def dequantize_fp8_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """float32 codes * block scale (then rounded once to `dtype` if given)."""
    out = codes.float() * _expand(scale, codes.shape, block)
    return out if dtype is None else out.to(dtype)


def quantize_fp8_groups(x: torch.Tensor, group: int = ACTIVATION_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization, one scale per token per `group` channels: codes x.shape, float32 scales
    [..., ceil(channels / group)]."""
    flat = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_fp8_blocks(flat, (1, group))
    return codes.reshape(x.shape), scale.reshape(*x.shape[:-1], -1)


def dequantize_fp8_groups(codes: torch.Tensor, scale: torch.Tensor, group: int = ACTIVATION_GROUP,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    flat = dequantize_fp8_blocks(codes.reshape(-1, codes.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                                 (1, group), dtype)
    return flat.reshape(codes.shape)
