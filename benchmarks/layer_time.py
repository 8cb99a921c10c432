"""Where one full-width decoder layer's quantize time goes, part by part, beside what the planner predicts for each
part (llmc.pipeline.quantize.layer_seconds): read the layer from safetensors, the calibration forward, the quantizer's
arithmetic (RTN, the recipe's weight spec), write the layer's codes (fsync). One Llama decoder layer at the real
width of `--model` (recipes/configs/<model>/config.json), random weights in `--dtype`.

    python benchmarks/layer_time.py --model Llama-3.3-70B-Instruct --tokens 32

One JSON line: measured seconds per part (best of `--repeats`), the probe rates, the predicted parts, the load.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from _timing import best_seconds

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    from llmc.pipeline.quantize import layer_seconds
    from llmc.planning.machine import matmul_rate
    from llmc.quant.numerics import quantize_rate
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import TensorSpec
    from llmc.storage.store import atomic_save_safetensors

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Llama-3.3-70B-Instruct")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="fp8_e4m3:tensor", help="format:strategy of the weight spec")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(ROOT / "recipes" / "configs" / args.model)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    params = sum(p.numel() for p in layer.parameters())
    largest = max(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    fmt, strategy = args.weights.split(":")
    # the planner's probes run first, in a fresh process, as `llmc plan` and the build run them before any weight
    width, attn_width = config.hidden_size, config.num_attention_heads * config.head_dim
    predicted = layer_seconds(params, stored_bytes=params * dtype.itemsize, tokens=args.tokens, passes=1.0,
                                  active=1.0, compute=args.dtype, code_bytes=1.0, device="cpu", width=width,
                                  seq_len=args.tokens, attn_width=attn_width, batch_tokens=args.tokens,
                                  largest_linear=largest, weights=TensorSpec(fmt, strategy))
    layer = layer.to_empty(device="cpu").to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    spec = TensorSpec(fmt, strategy)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=str(Path.home())) as tmp:
        stored = Path(tmp) / "layer.safetensors"
        atomic_save_safetensors(stored, {n: p.data for n, p in layer.named_parameters()})

        def read() -> None:  # as CheckpointReader + materialize: mapped tensors copied into the layer's parameters
            with safe_open(str(stored), framework="pt") as f:
                for n, p in layer.named_parameters():
                    p.data.copy_(f.get_tensor(n))

        hidden = torch.randn(1, args.tokens, config.hidden_size, dtype=dtype)
        rotary = LlamaRotaryEmbedding(config)
        position = rotary(hidden, torch.arange(args.tokens)[None])

        def forward() -> None:
            with torch.no_grad():
                layer(hidden, position_embeddings=position, attention_mask=None)

        codes: dict[str, torch.Tensor] = {}

        def quantize() -> None:
            for n, m in linears.items():
                q = quantize_weight(m.weight.data, spec)
                codes[f"{n}.weight"], codes[f"{n}.weight_scale"] = q.codes, q.scale

        def write() -> None:
            atomic_save_safetensors(Path(tmp) / "codes.safetensors", codes)

        measured = {"read": best_seconds(read, args.repeats), "forward": best_seconds(forward, args.repeats),
                    "quantize": best_seconds(quantize, args.repeats)}
        measured["write"] = best_seconds(write, args.repeats)
    print(json.dumps({
        "model": args.model, "layer_params": params, "tokens": args.tokens, "dtype": args.dtype,
        "measured_s": measured, "measured_total_s": sum(measured.values()),
        "predicted_s": predicted, "predicted_total_s": sum(predicted.values()),
        "matmul_rate_gflops": matmul_rate(args.dtype, "cpu", width, args.tokens) / 1e9,
        "quantize_rate_gelem": quantize_rate(TensorSpec(fmt, strategy), args.dtype, elements=largest) / 1e9,
        "load_before": load, "load_after": os.getloadavg(), "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
