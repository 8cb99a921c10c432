"""On-disk tensors of NVFP4 / MXFP4 / MXFP8 / block-wise FP8 weights, from llmc's codes, never re-rounded.

compressed-tensors (vLLM, SGLang), per Linear module (local names):
  nvfp4-pack-quantized   weight_packed uint8 [out, in/2] (element 2i in the low nibble), weight_scale float8_e4m3fn
                         [out, in/16], weight_global_scale float32 [1] (the divisor 448 * 6 / amax)
  mxfp4-pack-quantized   weight_packed as above, weight_scale uint8 E8M0 exponents [out, in/32]
  mxfp8-quantized        weight float8_e4m3fn [out, in], weight_scale uint8 E8M0 [out, in/32]
  float-quantized, block weight float8_e4m3fn [out, in], weight_scale float32 [ceil(out/128), ceil(in/128)]
ModelOpt's unified HF checkpoint (TensorRT-LLM, and vLLM's modelopt loader), NVFP4: weight uint8 packed the same way,
weight_scale float8_e4m3fn [out, in/16], weight_scale_2 float32 () (the multiplier amax / (448 * 6)), W4A4 also
input_scale float32 () (the same reciprocal of compressed-tensors' input_global_scale); block FP8 (quant_algo
fp8_pb_wo): weight float8_e4m3fn [out, in], weight_scale float32 [ceil(out/128), 1, ceil(in/128), 1] (a scalar when
the weight is one block), which TensorRT-LLM squeezes back to [ceil(out/128), ceil(in/128)].
GGUF (llama.cpp's ggml-common.h `block_mxfp4` / `block_nvfp4`; gguf-py 0.19 decodes both), per row of `in`:
  MXFP4  17 bytes per 32 elements: the E8M0 exponent, then 16 bytes, byte j = element j | element j + 16 << 4
  NVFP4  36 bytes per 64 elements: 4 UE4M3 scales (E4M3 bits, sign clear) for its 16-element sub-blocks, then
         8 bytes per sub-block, byte j = element j | element j + 8 << 4. The per-tensor scale is not in the
         blocks: llama.cpp reads it as the F32 tensor `<name>.scale` (ModelOpt's multiplier) and multiplies the
         matmul's output by it.
The schemes are compressed-tensors' own presets, so the config names exactly what its compressors decode.
"""

from __future__ import annotations

import numpy as np
import torch

from llmc.quant.microscaling import (
    MXFP4,
    NVFP4,
    BlockQuantized,
    dequantize_blocks,
    modelopt_weight_scale_2,
    pack_e2m1,
    unpack_e2m1,
)

GGUF_NVFP4_BLOCK = 64  # elements per GGML NVFP4 block (4 sub-blocks of NVFP4's 16)

# llmc format name -> (compressed-tensors compression format, preset with weights only, preset with activations)
COMPRESSED_TENSORS_FORMATS: dict[str, tuple[str, str, str]] = {
    "nvfp4": ("nvfp4-pack-quantized", "NVFP4A16", "NVFP4"),
    "mxfp4": ("mxfp4-pack-quantized", "MXFP4A16", "MXFP4"),
    "mxfp8": ("mxfp8-quantized", "MXFP8A16", "MXFP8"),
    "fp8_block": ("float-quantized", "FP8_BLOCK", "FP8_BLOCK"),
}


def compressed_tensors_scheme(format_name: str, targets: list[str], with_activations: bool = False):
    """compressed-tensors' QuantizationScheme for `format_name` (its preset), targeting `targets`, naming its
    compression format as llm-compressor's groups do (a `mixed-precision` checkpoint's loaders read each group's
    own). Block FP8's preset always carries dynamic 1x128 activations (what vLLM's block-FP8 kernels run)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    compression, weights_only, with_acts = COMPRESSED_TENSORS_FORMATS[format_name]
    scheme = preset_name_to_scheme(with_acts if with_activations else weights_only, targets)
    scheme.format = compression
    return scheme


def compressed_tensors_tensors(q: BlockQuantized) -> dict[str, torch.Tensor]:
    """One Linear's stored tensors (local names) for an NVFP4 / MXFP4 / MXFP8 weight."""
    if q.format.element == "e2m1":
        out = {"weight_packed": pack_e2m1(q.codes), "weight_scale": q.scale}
    else:
        out = {"weight": q.codes, "weight_scale": q.scale}
    if q.global_scale is not None:
        out["weight_global_scale"] = q.global_scale
    return out


def nvfp4_from_compressed_tensors(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight one Linear's `nvfp4-pack-quantized` tensors stand for, code * (block scale / global
    scale) as compressed-tensors computes it but without its rounding to bfloat16 (its NVFP4 decompressor unpacks
    into bf16 whatever the model's dtype): what llmc's reference evaluates."""
    q = BlockQuantized(codes=unpack_e2m1(state["weight_packed"]), scale=state["weight_scale"],
                       global_scale=state["weight_global_scale"].float().reshape(1), format=NVFP4)
    return dequantize_blocks(q)


def compressed_tensors_fp8_block_tensors(codes: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """One Linear's stored tensors for block-wise FP8 (`llmc.quant.block_fp8.quantize_fp8_blocks`' output)."""
    return {"weight": codes, "weight_scale": scale}


def modelopt_nvfp4_tensors(q: BlockQuantized) -> dict[str, torch.Tensor]:
    """One Linear's stored tensors in ModelOpt's NVFP4 layout; weight_scale_2 is the reciprocal of the global
    scale, so ModelOpt's decode (code * weight_scale * weight_scale_2) differs from compressed-tensors' only by
    float32 rounding of that reciprocal."""
    if q.format.name != "nvfp4":
        raise ValueError(f"ModelOpt's NVFP4 layout holds nvfp4 weights, not {q.format.name}")
    return {"weight": pack_e2m1(q.codes), "weight_scale": q.scale,
            "weight_scale_2": modelopt_weight_scale_2(q.global_scale).reshape(())}


def modelopt_nvfp4_input_scale(input_global_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 activation `input_scale` (float32 scalar): like weight_scale_2, the multiplier amax / (448 * 6),
    the reciprocal of compressed-tensors' `input_global_scale` (TensorRT-LLM inverts it back at load)."""
    return modelopt_weight_scale_2(input_global_scale).reshape(())


def modelopt_fp8_block_tensors(codes: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """One Linear's stored tensors for block-wise FP8 in ModelOpt's `fp8_pb_wo` layout: the codes as they are, the
    float32 tile scales [ob, ib] as ModelOpt 0.47 writes them, [ob, 1, ib, 1], or a scalar for a one-tile weight."""
    blocks_out, blocks_in = scale.shape
    shape = (blocks_out, 1, blocks_in, 1) if scale.numel() > 1 else ()
    return {"weight": codes, "weight_scale": scale.float().reshape(shape)}


def _halves_packed(codes: torch.Tensor, block: int) -> torch.Tensor:
    """E2M1 codes [rows, cols] -> [rows, cols // block, block // 2] bytes, byte j = element j | element j + block/2."""
    blocks = codes.reshape(codes.shape[0], -1, block)
    return blocks[..., : block // 2] | (blocks[..., block // 2:] << 4)


def _gguf_input(q: BlockQuantized, fmt_name: str, width_multiple: int) -> None:
    if q.format.name != fmt_name or q.codes.dim() != 2 or q.codes.shape[1] % width_multiple:
        raise ValueError(f"GGUF {fmt_name.upper()} takes a 2-D {fmt_name} weight whose rows are a multiple of "
                         f"{width_multiple} elements; got {q.format.name} of shape {tuple(q.codes.shape)}")


def gguf_mxfp4_blocks(q: BlockQuantized) -> np.ndarray:
    """GGML MXFP4 bytes [rows, cols // 32 * 17] of an MXFP4 weight [rows, cols]."""
    _gguf_input(q, "mxfp4", MXFP4.block_size)
    blocks = torch.cat([q.scale.unsqueeze(-1), _halves_packed(q.codes, MXFP4.block_size)], dim=-1)
    return blocks.reshape(q.codes.shape[0], -1).cpu().numpy()


def gguf_nvfp4_blocks(q: BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    """GGML NVFP4 bytes [rows, cols // 64 * 36] of an NVFP4 weight [rows, cols], and the F32 per-tensor scale
    ([1], ModelOpt's multiplier) llama.cpp applies to the product."""
    _gguf_input(q, "nvfp4", GGUF_NVFP4_BLOCK)
    rows = q.codes.shape[0]
    per_block = GGUF_NVFP4_BLOCK // NVFP4.block_size
    scales = q.scale.view(torch.uint8).reshape(rows, -1, per_block)  # E4M3 bits of positive scales: UE4M3 as is
    nibbles = _halves_packed(q.codes, NVFP4.block_size).reshape(rows, -1, GGUF_NVFP4_BLOCK // 2)
    blocks = torch.cat([scales, nibbles], dim=-1).reshape(rows, -1)
    return blocks.cpu().numpy(), modelopt_weight_scale_2(q.global_scale).reshape(1).cpu().numpy()
