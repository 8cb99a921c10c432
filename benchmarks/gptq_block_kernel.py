"""GPTQ's per-block column loop on a GPU: the fused Triton kernel against the eager torch loop.

    python benchmarks/gptq_block_kernel.py [--rows 2688 1536] [--width 128] [--repeats 20]

Times one block (rows x width, SmolLM2's stacked q/k/v rows and its MLP rows by default) through
`gptq_block_eager` and `gptq_block_triton` for several row-tile sizes and warp counts, after a warm-up
(compilation excluded), with CUDA events; prints one JSON line per configuration and the share of codes
that differ from the eager loop's.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[2688, 1536])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiles", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    import llmc.quant.algorithms.gptq_triton as kernel
    from llmc.quant.algorithms import gptq
    from llmc.quant.numerics import compute_qparams
    from llmc.quant.spec import TensorSpec

    spec = TensorSpec("int4", "group", group_size=64)
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        n = args.width
        block = torch.randn(rows, n, generator=g).cuda()
        x = torch.randn(n, 4 * n, generator=g).cuda()
        h_chol, _ = gptq._prepare_inverse(x @ x.T / n, 0.01)
        scale, _ = compute_qparams(block, spec)
        s_cols = scale[:, torch.arange(n, device="cuda") // 64]

        def timed(fn) -> tuple[float, torch.Tensor]:
            out = fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / args.repeats, out[0]

        eager_ms, eager_codes = timed(lambda: gptq.gptq_block_eager(block.clone(), s_cols, None, h_chol, spec))
        print(json.dumps({"rows": rows, "width": n, "impl": "eager", "ms": round(eager_ms, 3)}), flush=True)
        for tile in args.tiles:
            for warps in args.warps:
                kernel.ROWS_PER_PROGRAM, kernel.NUM_WARPS = tile, warps
                ms, codes = timed(lambda: gptq.gptq_block_triton(block.clone(), s_cols, None, h_chol, spec))
                print(json.dumps({"rows": rows, "width": n, "impl": "triton", "rows_per_program": tile,
                                  "warps": warps, "ms": round(ms, 3), "speedup": round(eager_ms / ms, 1),
                                  "codes_differing": (codes != eager_codes).float().mean().item()}), flush=True)


if __name__ == "__main__":
    main()
