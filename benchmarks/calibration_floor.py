"""Quantization wall time against its floor: one plain forward pass of the calibration tokens.

    python benchmarks/calibration_floor.py [--samples 32] [--seq-len 512] [--repeats 2]

Same model (SmolLM2-135M fp32), same calibration windows, same batch size, interleaved in one
process. "floor" runs the whole model (transformers, sdpa) over the windows; each scheme runs
llmc.quant.stream.quantize_model into a fresh directory (weights read from safetensors, layer by
layer, results written), so the ratio includes everything quantization costs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.model.source import resolve_source
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, quantize_model
    from llmc.storage.store import Store

    src = resolve_source("demo:smollm2-135m", Store.default())
    tok = AutoTokenizer.from_pretrained(src.folder)
    calib = make_windows(tok, load_corpus("brown", "calibration"), args.seq_len, args.samples, seed=0).ids
    model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32).eval()

    @torch.no_grad()
    def floor() -> None:
        for b in calib.split(4):
            model(input_ids=b, use_cache=False)

    schemes = {
        "FP8 static + FP8 KV": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                                     kv_cache=TensorSpec("fp8_e4m3", "tensor")),
        "INT8 W8A8 static": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor")),
        "W4A16 g64 (no data)": Scheme(TensorSpec("int4", "group", group_size=64)),
    }
    work = Path(tempfile.mkdtemp())

    def run(scheme: Scheme) -> None:
        out = work / "q"
        shutil.rmtree(out, ignore_errors=True)
        quantize_model(src, scheme, out, Calibration(calib) if scheme.needs_calibration else None)

    runs = {"floor (plain forward)": floor, **{k: (lambda s=s: run(s)) for k, s in schemes.items()}}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(times["floor (plain forward)"])
    ntok = args.samples * args.seq_len
    print(f"SmolLM2-135M fp32, {args.samples} x {args.seq_len} calibration tokens, {args.threads} threads, "
          f"{args.repeats} interleaved repeats; floor = {ntok / base:.0f} tok/s")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:24s} median {med:6.2f} s (min {min(ts):.2f}, max {max(ts):.2f})  {med / base:.2f}x floor")


if __name__ == "__main__":
    main()
