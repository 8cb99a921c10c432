"""One llm-compressor oneshot for benchmarks/gpu_calibration.py: its recipes (benchmarks/_llmcompressor_child.py) in
the calibration dtype, timed per decoder layer, with the layer floor measured in this same process first.

    python benchmarks/_llmcompressor_gpu_child.py MODEL_DIR TOKENS.safetensors SCHEME OUT_DIR GROUP DTYPE DEVICE

Imports nothing from llmc (it may run in llm-compressor's own venv). The model is loaded in host memory (what
llm-compressor 0.14 does: its sequential pipeline onloads each layer to the first GPU when there is one). Per layer: from
the previous decoder layer's last forward (the first layer: from the call) to this layer's last forward, the end of
its propagation pass — its onload, calibration pass, compression and propagation pass. llm-compressor's last subgraph
also carries the final norm and the LM head, so the last layer's time includes theirs. Prints one JSON line per repeat.

BENCH_REPEATS=N (default 1): oneshot N times in this process, each on a freshly loaded model; only the first repeat's
output is saved (what the quality step scores). BENCH_ONESHOT_KWARGS (JSON): oneshot arguments beside the defaults,
e.g. the "tuned" row's {"batch_size": 4, "sequential_offload_device": "cuda:0", "sequential_prefetch": true,
"propagate_error": false}; each is checked against the installed llm-compressor (oneshot's signature and its
DatasetArguments fields) and one it lacks is left out and named in the row's `knobs_missing`, not guessed at.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    model_dir, tokens_file, scheme, out, group, dtype_name, device_name = sys.argv[1:8]
    import llmcompressor
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from _layer_floor import floor_seconds, peak_gpu_mb, peak_rss_mb
    from _llmcompressor_child import recipe

    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    if device.type == "cpu":
        # llm-compressor 0.14's AWQ pins its cached activations, which raises "Cannot access accelerator
        # device when none is available" on a CPU-only machine; pinning is only a transfer optimization.
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    ids = load_file(tokens_file)["input_ids"]
    n, seq = ids.shape
    floor = floor_seconds(Path(model_dir), n, seq, dtype, device)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq] * n})
    tok = AutoTokenizer.from_pretrained(model_dir)
    knobs, missing = checked_knobs(json.loads(os.environ.get("BENCH_ONESHOT_KWARGS") or "{}"))
    for repeat in range(int(os.environ.get("BENCH_REPEATS", "1"))):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        wall, layer_s = timed_oneshot(model, ds, recipe(scheme, int(group)), n, seq, knobs)
        peak_gpu = peak_gpu_mb(torch.device("cuda")) if torch.cuda.is_available() else None
        if repeat == 0:
            model.save_pretrained(out, save_compressed=True)
            tok.save_pretrained(out)
        print(json.dumps({"repeat": repeat, "wall_s": wall, "layer_s": layer_s, "floor_s": floor,
                          "peak_gpu_mb": peak_gpu, "peak_rss_mb": peak_rss_mb(), "peer_scheme": scheme,
                          "oneshot_kwargs": knobs, "knobs_missing": missing,
                          "llmcompressor": llmcompressor.__version__, "torch": torch.__version__}), flush=True)
        del model


def checked_knobs(requested: dict) -> tuple[dict, list[str]]:
    """The requested oneshot arguments this llm-compressor takes (a named parameter of oneshot, or a field of its
    DatasetArguments, which oneshot's **kwargs are parsed into), and the names of those it does not."""
    import dataclasses
    import inspect

    import llmcompressor
    from llmcompressor.args import DatasetArguments

    known = set(inspect.signature(llmcompressor.oneshot).parameters)
    known |= {f.name for f in dataclasses.fields(DatasetArguments)}
    return {k: v for k, v in requested.items() if k in known}, sorted(k for k in requested if k not in known)


def timed_oneshot(model, ds, recipe, n: int, seq: int, knobs: dict) -> tuple[float, list[float | None]]:
    """oneshot's wall time and each decoder layer's, from the end of one layer's last forward to the next's."""
    import llmcompressor
    import torch

    # Each decoder layer's last forward: the end of its propagation pass (or, with propagate_error off, of its one
    # pass), after which the pipeline moves on to the next layer's subgraph. Stamped without stalling the pipeline: a
    # CUDA event per call, a clock read on the host.
    cuda = torch.cuda.is_available()

    def stamp():
        if not cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    ends: dict[int, object] = {}
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda _m, _a, _o, i=i: ends.__setitem__(i, stamp()))
    if cuda:
        torch.cuda.synchronize()
    begin, t = stamp(), time.monotonic()
    llmcompressor.oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=n, max_seq_length=seq,
                          pipeline="sequential", shuffle_calibration_samples=False, **knobs)
    if cuda:
        torch.cuda.synchronize()
    wall = time.monotonic() - t

    def since_begin(mark) -> float:
        return begin.elapsed_time(mark) / 1000 if cuda else mark - begin

    bounds = [0.0] + [since_begin(ends[i]) if i in ends else None for i in range(len(layers))]
    return wall, [b - a if a is not None and b is not None else None for a, b in zip(bounds, bounds[1:])]


if __name__ == "__main__":
    main()
