"""What every exporter writes the same way: sharded safetensors with an index, and the tokenizer files."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmc.store import atomic_save_safetensors, atomic_write_json

if TYPE_CHECKING:
    from llmc.quant.canonical import QuantizedModel

MAX_SHARD_BYTES = 2 << 30
# Every artifact's runtime arguments and build facts (serve command, engine options, graph summary).
SERVE_FILE = "llmc-serve.json"


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


# Not tokenizer files: the quantized form's own, and the shard index, which write_shards writes for the artifact's
# shards (a source's index copied over it names the source's shards: the artifact would not load).
_NOT_TOKENIZER = ("quantized.json", "config.json", "model.safetensors.index.json")


def copy_tokenizer_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in _NOT_TOKENIZER:
            shutil.copyfile(f, out / f.name)


def write_repacked_checkpoint(
    qm: QuantizedModel,
    out: Path,
    *,
    repack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]],
    decode: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    quantization_config: dict,
    dtype: str,
    serve: dict | None = None,
) -> tuple[list[Path], float]:
    """A Hugging Face folder in another tool's weight-only layout (GPTQ, AWQ): every quantized Linear's
    canonical codes / scale / zero point become `repack`'s tensors (named `<module>.<key>`), everything
    else is copied; plus config.json with `quantization_config`, the tokenizer and, when given, the
    runtime arguments (llmc-serve.json). Returns the weight files and the largest relative change of a
    weight, `decode(repacked)` against the canonical weight (the layouts' float16 scales)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    worst = 0.0

    def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nonlocal worst
        converted: dict[str, torch.Tensor] = {}
        modules = [m for m in qm.quantized_modules if f"{m}.weight" in tensors]
        for m in modules:
            packed = repack(tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"], tensors.get(f"{m}.weight_zero_point"))
            ref = qm.dequantized_weight(tensors, m).float()
            worst = max(worst, (decode(packed) - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
            converted.update({f"{m}.{k}": v for k, v in packed.items()})
        replaced = {f"{m}.{s}" for m in modules for s in ("weight", "weight_scale", "weight_zero_point")}
        converted.update({k: v for k, v in tensors.items() if k not in replaced})
        return converted

    written = write_shards(out, (convert(t) for t in qm.iter_files()))
    config = dict(qm.config)
    config["quantization_config"] = quantization_config
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    atomic_write_json(out / "config.json", config)
    copy_tokenizer_files(qm.root, out)
    if serve is not None:
        atomic_write_json(out / SERVE_FILE, serve)
    return written, worst
