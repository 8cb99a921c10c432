"""How much of the planner's matmul probe a decoder layer's forward reaches (llmc.planning.machine.forward_efficiency):
one Llama decoder layer at the real width of SmolLM2-135M, Llama-3.1-8B and Llama-3.3-70B (random weights), its
forward over one sequence of `seq` tokens timed (best of 2 after a warm-up), against what the planner predicts for it
(`forward_seconds`: `matmul_rate` probed at the model's width and tokens as `llmc plan` probes it). Efficiency =
(GEMM FLOPs + causal attention FLOPs) / time / probe rate.

    python benchmarks/forward_efficiency.py                      # every (model, dtype, seq) below
    python benchmarks/forward_efficiency.py --models smollm2 --seqs 512 2048

One JSON line per case; the planner's constant is the one in llmc.planning.machine.forward_efficiency.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from _timing import best_seconds

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"smollm2": None, "8b": "Llama-3.1-8B", "70b": "Llama-3.3-70B-Instruct"}
# the longest sequence timed per width (a 70B-width layer at 512 tokens is ~40 s in bf16 here)
MAX_SEQ = {"smollm2": 2048, "8b": 512, "70b": 32}


def config_of(name: str):
    from transformers import AutoConfig, LlamaConfig

    if CONFIGS[name] is None:  # SmolLM2-135M's shapes (shared/DATA.md), no file needed
        return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, vocab_size=49152)
    return AutoConfig.from_pretrained(ROOT / "recipes" / "configs" / CONFIGS[name])


def main() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from llmc.planning.machine import forward_efficiency, forward_seconds, matmul_rate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[32, 512, 2048])
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for name in args.models:
        config = config_of(name)
        config._attn_implementation = "sdpa"
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            with torch.device("meta"):
                layer = LlamaDecoderLayer(config, 0)
            layer = layer.to_empty(device="cpu").to(dtype)
            for p in layer.parameters():
                p.data.normal_(0, 0.02)
            params = sum(p.numel() for p in layer.parameters())
            attn_width = config.num_attention_heads * config.head_dim
            for seq in [s for s in args.seqs if s <= MAX_SEQ[name]]:
                hidden = torch.randn(1, seq, config.hidden_size, dtype=dtype)
                position = LlamaRotaryEmbedding(config)(hidden, torch.arange(seq)[None])

                def forward(layer=layer, hidden=hidden, position=position) -> None:
                    with torch.no_grad():
                        layer(hidden, position_embeddings=position, attention_mask=None)

                seconds = best_seconds(forward, 2, warmup=True)
                gemm, attention = 2 * seq * params, 2 * seq * seq * attn_width
                flops = gemm + attention
                probe = matmul_rate(dtype_name, "cpu", config.hidden_size, seq)
                predicted = forward_seconds(gemm, attention, compute=dtype_name, device="cpu",
                                            width=config.hidden_size, rows=seq)
                print(json.dumps({
                    "model": name, "dtype": dtype_name, "seq": seq, "layer_params": params,
                    "forward_s": round(seconds, 4), "layer_gflops": round(flops / seconds / 1e9, 2),
                    "probe_gflops": round(probe / 1e9, 2), "efficiency": round(flops / seconds / probe, 3),
                    "planner_efficiency": forward_efficiency(dtype_name, "cpu"),
                    "predicted_s": round(predicted, 4), "predicted_over_measured": round(predicted / seconds, 3),
                    "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
