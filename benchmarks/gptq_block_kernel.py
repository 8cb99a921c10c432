"""GPTQ's per-block column loop: on a GPU the fused Triton kernel, on a CPU the numba-compiled loop, each
against the eager torch loop.

    python benchmarks/gptq_block_kernel.py [--rows 2688 1536] [--width 128] [--repeats 20]
    python benchmarks/gptq_block_kernel.py --cpu [--rows 960 576 3072] [--threads 2]

Times one block (rows x width, SmolLM2's stacked q/k/v rows and its MLP rows by default) through
`gptq_block_eager` and `gptq_block_triton` for several row-tile sizes and warp counts, after a warm-up
(compilation excluded), with CUDA events; prints one JSON line per configuration and the share of codes
that differ from the eager loop's. `--cpu`: the same block through the eager loop and `gptq_block_cpu`
(numba compilation excluded by a warm-up), wall time per block with time.perf_counter.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def cpu(rows_list: list[int], width: int, repeats: int, threads: int) -> None:
    from llmc.quant.algorithms import gptq
    from llmc.quant.numerics import compute_qparams
    from llmc.quant.spec import TensorSpec

    torch.set_num_threads(threads)
    spec = TensorSpec("int4", "group", group_size=64)
    g = torch.Generator().manual_seed(0)
    for rows in rows_list:
        block = torch.randn(rows, width, generator=g)
        x = torch.randn(width, 4 * width, generator=g)
        h_chol, _ = gptq._prepare_inverse(x @ x.T / width, 0.01)
        scale, _ = compute_qparams(block, spec)
        s_cols = scale[:, torch.arange(width) // 64]
        results = {}
        for impl, fn in (("eager", gptq._integer_block), ("numba", gptq.gptq_block_cpu)):
            out = fn(block.clone(), s_cols, None, h_chol, spec)  # warm-up (numba compiles or loads its cache)
            t = time.perf_counter()
            for _ in range(repeats):
                fn(block.clone(), s_cols, None, h_chol, spec)
            results[impl] = ((time.perf_counter() - t) / repeats * 1000, out[0])
        (eager_ms, eager_codes), (ms, codes) = results["eager"], results["numba"]
        print(json.dumps({"rows": rows, "width": width, "threads": threads, "eager_ms": round(eager_ms, 3),
                          "numba_ms": round(ms, 3), "speedup": round(eager_ms / ms, 1),
                          "codes_differing": (codes != eager_codes).float().mean().item()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[2688, 1536])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiles", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--cpu", action="store_true", help="the numba loop against the eager loop, on this CPU")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.cpu:
        cpu(args.rows, args.width, args.repeats, args.threads)
        return
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
