"""Overhead of llmc's evaluation vs the bare runtime forward passes over the same windows.

    python benchmarks/eval_overhead.py [--windows 16] [--seq-len 512] [--repeats 3]

Both sides run the same SmolLM2-135M folder on the same token windows, interleaved, in one
process. "bare" is `model(input_ids=batch).logits` and nothing else; "llmc baseline" is
TorchEngine.score (NLL + the top-k reference log-probs and the output head's inputs it caches); "llmc artifact"
is TorchEngine.score against that reference (NLL + exact full-vocabulary KL + top-k bound + top-1); "artifact,
top-k bound only" is the same against the reference without its head (what llmc computed before the exact KL).
Prints medians and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    src = resolve_source("demo:smollm2-135m", Store.default())
    tok = AutoTokenizer.from_pretrained(src.folder)
    windows = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.windows, seed=None).ids
    engine = TorchEngine(src.folder, streamed=decide_torch_loading_of(src.folder, "float32").streamed)
    model = engine.model

    @torch.no_grad()
    def bare() -> None:
        for batch in windows.split(args.batch_size):
            _ = model(input_ids=batch, use_cache=False).logits

    from llmc.engines.agreement import split_head

    reference = engine.score(windows, args.batch_size)
    bound_only, _ = split_head(reference)
    runs = {
        "bare forward": bare,
        "llmc baseline score": lambda: engine.score(windows, args.batch_size),
        "llmc artifact score": lambda: engine.score(windows, args.batch_size, reference=reference),
        "artifact, top-k only": lambda: engine.score(windows, args.batch_size, reference=bound_only),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved so drift hits every side alike
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    floor = statistics.median(times["bare forward"])
    print(f"SmolLM2-135M fp32, {args.windows} windows x {args.seq_len} tokens, batch {args.batch_size}, "
          f"{args.threads} threads, {args.repeats} interleaved repeats")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} median {med:6.2f} s  (min {min(ts):.2f}, max {max(ts):.2f})  ratio {med / floor:.3f}x")


if __name__ == "__main__":
    main()
