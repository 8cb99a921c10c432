"""Peak memory of streamed quantization does not grow with depth.

    python benchmarks/memory_depth.py [--layers 30] [--algorithms rtn-static gptq awq] [--samples 32]

Writes two synthetic models with SmolLM2-135M's width (hidden 576, 9/3 heads, intermediate 1536,
vocab 49152) and random weights to disk, one `--layers` deep and one twice as deep, then quantizes
each in a fresh child process (`llmc.quant.stream.quantize_model`, the code `llmc build` runs) and
reads the child's peak RSS (VmHWM of its own address space: ru_maxrss would also count the parent's
memory at fork, which Linux carries across exec). Prints one JSON line per (algorithm, depth) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCHEMES = {
    "rtn-static": "Scheme(TensorSpec('int8', 'channel'), TensorSpec('int8', 'tensor'), TensorSpec('fp8_e4m3', 'tensor'))",
    "gptq": "Scheme(TensorSpec('int4', 'group', group_size=64), algorithm='gptq')",
    "awq": "Scheme(TensorSpec('int4', 'group', group_size=64), algorithm='awq')",
    "smoothquant": "Scheme(TensorSpec('int8', 'channel'), TensorSpec('int8', 'token', dynamic=True), algorithm='smoothquant')",
}

CHILD = """
import json, sys, time, torch
from pathlib import Path
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model
folder, out, scheme, samples, seq = sys.argv[1], sys.argv[2], eval(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(2)
calib = torch.randint(0, 49152, (samples, seq), generator=torch.Generator().manual_seed(0))
t = time.monotonic()
quantize_model(ModelSource(Path(folder), "synthetic", "synthetic"), scheme, Path(out), Calibration(calib))
print(json.dumps({"wall_s": time.monotonic() - t, "peak_rss_mb": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024}))
"""


def write_model(folder: Path, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    del model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--algorithms", nargs="+", default=["rtn-static", "gptq"], choices=sorted(SCHEMES))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmc-depth-") as tmp:
        depths = (args.layers, 2 * args.layers)
        for d in depths:
            write_model(Path(tmp) / f"m{d}", d)
        for algo in args.algorithms:
            peaks = {}
            for d in depths:
                out = Path(tmp) / f"q-{algo}-{d}"
                t = time.monotonic()
                r = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / f"m{d}"), str(out), SCHEMES[algo],
                                    str(args.samples), str(args.seq_len)], capture_output=True, text=True, check=True)
                m = json.loads(r.stdout.strip().splitlines()[-1])
                peaks[d] = m["peak_rss_mb"]
                print(json.dumps({"algorithm": algo, "layers": d, **m, "total_s": time.monotonic() - t}), flush=True)
            print(json.dumps({"algorithm": algo, "peak_ratio_2x_depth": peaks[depths[1]] / peaks[depths[0]]}), flush=True)


if __name__ == "__main__":
    main()
