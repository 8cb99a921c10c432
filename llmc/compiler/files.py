"""What every exporter writes the same way: sharded safetensors with an index, and the tokenizer files."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from llmc.store import atomic_save_safetensors, atomic_write_json

MAX_SHARD_BYTES = 2 << 30


def write_shards(out: Path, parts: Iterable[dict[str, torch.Tensor]], max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write `parts` (one dict per canonical file, in order) as model.safetensors, or as
    model-0000i-of-0000n.safetensors + model.safetensors.index.json when they exceed `max_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for t in parts:
        nbytes = sum(v.numel() * v.element_size() for v in t.values())
        if sizes[-1] and sizes[-1] + nbytes > max_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1].update(t)
        sizes[-1] += nbytes
    written, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_save_safetensors(out / name, shard, metadata={"format": "pt"})
        written.append(out / name)
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        atomic_write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))},
        )
    return written


def copy_tokenizer_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in ("quantized.json", "config.json"):
            shutil.copyfile(f, out / f.name)
