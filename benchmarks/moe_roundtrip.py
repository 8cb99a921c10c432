"""docs/models.md "Mixture-of-Experts": for a tiny random Mixtral, Qwen3-MoE, gpt-oss and Llama-4 text (4 experts,
top-2, hidden 64, 2 layers; tests/unit/families.py) and each scheme, the max |logits| difference between the compressed-tensors export
reloaded by llmc's torch engine and the fake-quantized reference, beside the quantization's own effect (the
computation tests/unit/test_moe.py asserts on); then the cost of `calibration.moe_calibrate_all_experts`: the
quantize call's wall time with and without it (median of `--repeats`), and the MoE block's own calibration forward
(statistics hooks on every expert Linear, 2048 tokens; min and median of 15).

    PYTHONPATH=. python benchmarks/moe_roundtrip.py [--repeats 3] [--windows 16] [--seq 128] [--only-block]
        [--families gpt_oss,llama4_text | --families deepseek_v3 glm4_moe] [--table-only]

DeepSeek-V3's cells are quantized without the FP8 KV cache (llmc refuses its latent cache: tests/unit/test_moe.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llmc.model.source import ModelSource
from llmc.telemetry.progress import set_quiet
from llmc.quant import moe, stream
from tests.unit.families import LLAMA4, MOE_FAMILIES, make_tiny
from tests.unit.test_families import SCHEMES, roundtrip
from tests.unit.test_moe import _scheme


def cost(folder: Path, scheme_name: str, work: Path, windows: int, seq: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the quantize call, routed statistics vs every expert on every token."""
    ids = torch.randint(3, 200, (windows, seq), generator=torch.Generator().manual_seed(7))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats):
        for all_experts in (False, True):
            out = work / f"{scheme_name}-{all_experts}-{r}"
            t = time.perf_counter()
            stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES[scheme_name], out,
                                  stream.Calibration(ids, moe_all_experts=all_experts))
            times[all_experts].append(time.perf_counter() - t)
    return statistics.median(times[False]), statistics.median(times[True])


def block_cost(folder: Path, tokens: int = 2048, repeats: int = 15) -> dict[bool, list[float]]:
    """Seconds of layer 0's MoE block forward while statistics are observed, routed vs every expert on every token."""
    from transformers import AutoModelForCausalLM

    from llmc.quant.observe import LayerStats, observing

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    moe.unfuse_experts(model)
    layer = model.model.layers[0]
    _name, block, _experts = next(moe.routed_blocks(layer))
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n}
    x = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    times: dict[bool, list[float]] = {False: [], True: []}
    for all_tokens in (False, True):
        for _ in range(repeats):
            with torch.no_grad(), observing(layer, linears, LayerStats(), {}), \
                    moe.observing_experts(layer, all_tokens, {}):
                t = time.perf_counter()
                block(x)
                times[all_tokens].append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--only-block", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="the round-trip table, not the costs")
    parser.add_argument("--skip-cost", action="store_true", help="the same as --table-only")
    parser.add_argument("--families", nargs="+", default=list(MOE_FAMILIES),
                        help=f"space- or comma-separated, of {', '.join({**MOE_FAMILIES, **LLAMA4})}")
    args = parser.parse_args()
    set_quiet(True)
    with tempfile.TemporaryDirectory() as tmp:
        families = [f for arg in args.families for f in arg.split(",")]
        folders = {f: make_tiny(f, Path(tmp) / f / "model") for f in families}
        if args.only_block:
            print("| family | routed: min / median (ms) | every expert on every token: min / median (ms) | ratio of mins |")
            print("|---|---|---|---|")
            for family, folder in folders.items():
                t = block_cost(folder)
                routed, every = min(t[False]), min(t[True])
                print(f"| {family} | {routed * 1e3:.1f} / {statistics.median(t[False]) * 1e3:.1f} | {every * 1e3:.1f} / "
                      f"{statistics.median(t[True]) * 1e3:.1f} | {every / routed:.2f}x |")
            return
        if not args.skip_table:
            print("| family | scheme | quantized Linears | reload max-abs-diff | quantization effect (max-abs) |")
            print("|---|---|---|---|---|")
            for family, folder in folders.items():
                for name in SCHEMES:
                    diff, effect, n = roundtrip(folder, _scheme(family, name), Path(tmp) / family / name,
                                                moe.unfuse_experts)
                    print(f"| {family} | {name} | {n} | {diff:.1e} | {effect:.3f} |", flush=True)
        if args.table_only or args.skip_cost:
            return
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
