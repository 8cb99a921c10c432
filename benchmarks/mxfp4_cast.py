"""The exact MXFP4 -> NVFP4 cast against round-to-nearest NVFP4 of the decoded values, at gpt-oss-120b's expert
widths (hidden = intermediate = 2880; per expert gate and up 2880x2880 each under one global scale, down 2880x2880).

    PYTHONPATH=. python benchmarks/mxfp4_cast.py [--experts N]

Random E2M1 codes and E8M0 exponents in gpt-oss's range (112..125, within 17 of each other: every block casts
exactly). Prints the seconds per expert of each, and the cast's exact and requantized 16-element blocks.
"""

from __future__ import annotations

import argparse
import time

import torch

from llmc.quant.microscaling import (MXFP4, NVFP4, BlockQuantized, dequantize_blocks, mxfp4_cast_global_scale,
                                     mxfp4_to_nvfp4, quantize_blocks, shared_nvfp4_global_scale)

WIDTH = 2880


def _expert(g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """gate, up, down: (codes [out, in], exponents [out, in / 32])."""
    return [(torch.randint(0, 16, (WIDTH, WIDTH), generator=g, dtype=torch.uint8),
             torch.randint(112, 126, (WIDTH, WIDTH // 32), generator=g, dtype=torch.uint8)) for _ in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    cast_s = rtn_s = 0.0
    exact = redo = 0
    for _ in range(args.experts):
        gate, up, down = _expert(g)
        t = time.perf_counter()
        pair = mxfp4_cast_global_scale([gate, up])
        for codes, exponents, scale in (*gate, pair), (*up, pair), (*down, mxfp4_cast_global_scale([down])):
            cast = mxfp4_to_nvfp4(codes, exponents, scale)
            exact, redo = exact + cast.exact_blocks, redo + cast.requantized_blocks
        cast_s += time.perf_counter() - t
        values = [dequantize_blocks(BlockQuantized(c, s, None, MXFP4)) for c, s in (gate, up, down)]
        t = time.perf_counter()
        shared = shared_nvfp4_global_scale(values[:2])
        for v in values[:2]:
            quantize_blocks(v, NVFP4, shared)
        quantize_blocks(values[2], NVFP4)
        rtn_s += time.perf_counter() - t
    n = args.experts
    print(f"{n} experts of gpt-oss-120b's width: cast {cast_s / n:.2f} s/expert, round-to-nearest NVFP4 of the "
          f"decoded values {rtn_s / n:.2f} s/expert; cast blocks exact {exact}, requantized {redo}")


if __name__ == "__main__":
    main()
