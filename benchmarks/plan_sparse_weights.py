"""`llmc plan` reads config and safetensors headers only: its time does not grow with the weights' size.

    python benchmarks/plan_sparse_weights.py [--vocab-log2 24] [--repeats 2]

Writes a tiny random llama (hidden 64, 2 layers, tied embeddings) whose embedding is 2^vocab-log2 x 64 float32
(4.3 GB at 24) with its data sparse (no disk used), then times `llmc plan` on it in a fresh process with an empty
cache, `--repeats` times; prints one JSON line per run (wall seconds, exit code: the plan's verdict, e.g. exit 4
when the machine's memory cannot hold the evaluation, which the plan reaches from the headers alone).
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_model(folder: Path, vocab: int) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    big = "model.embed_tokens.weight"
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        if name != big:
            data = t.contiguous().numpy().tobytes()
            header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
            offset, blobs = offset + len(data), blobs + [data]
    size = vocab * 64 * 4
    header[big] = {"dtype": "F32", "shape": [vocab, 64], "data_offsets": [offset, offset + size]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
        f.truncate(8 + len(text) + offset + size)  # the embedding's data: a hole
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab-log2", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmc-plan-sparse-"))
    write_model(root / "model", 1 << args.vocab_log2)
    recipe = root / "recipe.yaml"
    recipe.write_text(f"name: sparse\nmodel: {{source: {root / 'model'}}}\n"
                      "quantization: {weights: {format: int8, strategy: channel}}\ntargets: [{runtime: vllm}]\n")
    weights = (root / "model" / "model.safetensors").stat().st_size
    for i in range(args.repeats):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "llmc", "plan", "--cache-dir", str(root / f"cache{i}"),
                               str(recipe)], capture_output=True, text=True)
        print(json.dumps({"weights_gb": round(weights / 1e9, 2), "plan_s": round(time.monotonic() - start, 2),
                          "exit": done.returncode}), flush=True)


if __name__ == "__main__":
    main()
