"""One llm-compressor oneshot for benchmarks/gpu_calibration.py: its recipes (benchmarks/_llmcompressor_child.py) in
the calibration dtype, timed per decoder layer, with the layer floor measured in this same process first.

    python benchmarks/_llmcompressor_gpu_child.py MODEL_DIR TOKENS.safetensors SCHEME OUT_DIR GROUP DTYPE DEVICE

Imports nothing from llmc (it may run in llm-compressor's own venv). The model is loaded in host memory (what
llm-compressor 0.14 does: its sequential pipeline onloads each layer to the first GPU when there is one). Per layer: from
the previous decoder layer's last forward (the first layer: from the call) to this layer's last forward, the end of
its propagation pass — its onload, calibration pass, compression and propagation pass. llm-compressor's last subgraph
also carries the final norm and the LM head, so the last layer's time includes theirs. Prints one JSON line.
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
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)

    # Each decoder layer's last forward: the end of its propagation pass, after which the pipeline moves on to the
    # next layer's subgraph. Stamped without stalling the pipeline: a CUDA event per call, a clock read on the host.
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
    llmcompressor.oneshot(model=model, dataset=ds, recipe=recipe(scheme, int(group)), num_calibration_samples=n,
                          max_seq_length=seq, pipeline="sequential", shuffle_calibration_samples=False)
    if cuda:
        torch.cuda.synchronize()
    wall = time.monotonic() - t

    def since_begin(mark) -> float:
        return begin.elapsed_time(mark) / 1000 if cuda else mark - begin

    bounds = [0.0] + [since_begin(ends[i]) if i in ends else None for i in range(len(layers))]
    layer_s = [b - a if a is not None and b is not None else None for a, b in zip(bounds, bounds[1:])]
    peak_gpu = peak_gpu_mb(torch.device("cuda")) if torch.cuda.is_available() else None
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    print(json.dumps({"wall_s": wall, "layer_s": layer_s, "floor_s": floor, "peak_gpu_mb": peak_gpu,
                      "peak_rss_mb": peak_rss_mb(), "peer_scheme": scheme, "llmcompressor": llmcompressor.__version__,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
