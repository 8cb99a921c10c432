"""docs/results.md "Mixture-of-Experts": for a tiny random Mixtral and Qwen3-MoE (4 experts, top-2, hidden 64, 2
layers; tests/unit/families.py) and each scheme, the max |logits| difference between the compressed-tensors export
reloaded by llmc's torch engine and the fake-quantized reference, beside the quantization's own effect (the
computation tests/unit/test_moe.py asserts on); then the cost of `calibration.moe_calibrate_all_experts`: the
quantize call's wall time with and without it (median of `--repeats`).

    PYTHONPATH=. python benchmarks/moe_roundtrip.py [--repeats 3] [--windows 16] [--seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llmc.model.source import ModelSource
from llmc.progress import set_quiet
from llmc.quant import moe, stream
from tests.unit.families import MOE_FAMILIES, make_tiny
from tests.unit.test_families import SCHEMES, roundtrip


def cost(folder: Path, scheme_name: str, work: Path, windows: int, seq: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the quantize call, routed statistics vs every expert on every token."""
    ids = torch.randint(3, 200, (windows, seq), generator=torch.Generator().manual_seed(7))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats):
        for all_experts in (False, True):
            out = work / f"{scheme_name}-{all_experts}-{r}"
            t = time.perf_counter()
            stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES[scheme_name], out, calibration=ids,
                                  moe_calibrate_all_experts=all_experts)
            times[all_experts].append(time.perf_counter() - t)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--skip-table", action="store_true")
    args = parser.parse_args()
    set_quiet(True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {f: make_tiny(f, Path(tmp) / f / "model") for f in MOE_FAMILIES}
        if not args.skip_table:
            print("| family | scheme | quantized Linears | reload max-abs-diff | quantization effect (max-abs) |")
            print("|---|---|---|---|---|")
            for family, folder in folders.items():
                for name, scheme in SCHEMES.items():
                    diff, effect, n = roundtrip(folder, scheme, Path(tmp) / family / name, moe.unfuse_experts)
                    print(f"| {family} | {name} | {n} | {diff:.1e} | {effect:.3f} |", flush=True)
        print(f"\nquantize call, {args.windows} windows x {args.seq} tokens, median of {args.repeats} "
              f"(torch threads {torch.get_num_threads()}):")
        print("| family | scheme | routed (s) | every expert on every token (s) | ratio |")
        print("|---|---|---|---|---|")
        for family, folder in folders.items():
            for name in ("fp8-static-kv", "int4-gptq"):
                routed, every = cost(folder, name, Path(tmp) / family / "cost", args.windows, args.seq, args.repeats)
                print(f"| {family} | {name} | {routed:.2f} | {every:.2f} | {every / routed:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
