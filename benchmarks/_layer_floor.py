"""The floor a calibration's time per decoder layer is measured against: one plain forward of every calibration token
through one decoder layer of the model's shape, in the calibration's dtype, on the calibration's device (random
weights and inputs: the time depends on shapes, not values). Imported by both tools' child processes of
benchmarks/gpu_calibration.py, so it needs nothing but torch and transformers (llm-compressor's side imports no llmc).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _timing import best_seconds  # a sibling: benchmarks run as scripts from this folder

# tokens per forward: enough to fill a GPU's matmuls, small enough that the layer's MLP intermediate stays modest
FLOOR_BATCH_TOKENS = 16384


@torch.no_grad()
def floor_seconds(model_dir: Path, samples: int, seq_len: int, dtype: torch.dtype, device: torch.device,
                  repeats: int = 2) -> float:
    """Best of `repeats` timed passes (after one untimed pass) of samples x seq_len tokens through one decoder layer
    built from `model_dir`'s config.json. GPU memory it used is released before returning."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**json.loads((Path(model_dir) / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    layer = layer.to_empty(device=device).to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    batch = max(1, FLOOR_BATCH_TOKENS // seq_len)
    hidden = torch.randn(samples, seq_len, config.hidden_size, dtype=dtype, device=device)
    positions = torch.arange(seq_len, device=device)[None]
    rotary = LlamaRotaryEmbedding(config).to(device)
    position_embeddings = rotary(hidden[:1], positions)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def one_pass() -> None:
        for chunk in hidden.split(batch):
            layer(chunk, position_embeddings=position_embeddings, attention_mask=None, position_ids=positions)
        sync()

    best = best_seconds(one_pass, repeats, warmup=True)
    del layer, hidden, position_embeddings
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return best


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM); ru_maxrss would include the parent's memory at fork."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


def peak_gpu_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
