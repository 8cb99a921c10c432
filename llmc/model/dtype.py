"""`model.dtype: auto`: compute in the checkpoint's own floating dtype (bf16/fp16/fp32), read from its headers.

A 70B checkpoint is stored in bfloat16; upcasting each streamed layer to float32 doubles the layer's memory and
the canonical form's unquantized tensors for nothing the arithmetic needs (Hessians, scale searches and
quantization upcast their own operands, llmc.quant.algorithms / llmc.quant.numerics). `auto` resolves to the
dtype most of the checkpoint's floating-point bytes are stored in; a GGUF source (already quantized) is unpacked
in float32 as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmc.model.checkpoint import check_safetensors_header, safetensors_files

if TYPE_CHECKING:
    import torch

SAFETENSORS_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float32"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AUTO = "auto"


def checkpoint_dtype(headers: list[dict]) -> str:
    """The floating dtype holding most bytes in these safetensors headers (float32 when there is none)."""
    by_dtype: dict[str, int] = {}
    for header in headers:
        for name, info in header.items():
            if name == "__metadata__" or info.get("dtype") not in SAFETENSORS_FLOATS:
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            name = SAFETENSORS_FLOATS[info["dtype"]]
            by_dtype[name] = by_dtype.get(name, 0) + size
    return max(by_dtype, key=by_dtype.get) if by_dtype else "float32"


def config_dtype(config: dict) -> str:
    """The dtype a config.json names (`dtype`, or transformers 4's `torch_dtype`), float32 when it names none."""
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in BYTES else "float32"


def resolve_dtype(requested: str, folder: Path | None = None, config: dict | None = None) -> str:
    """The dtype llmc computes and stores unquantized tensors in: `requested` unless it is `auto`; then the
    checkpoint's, from the safetensors headers of `folder` (or from `config` when planning without weights)."""
    if requested != AUTO:
        return requested
    if folder is not None:
        return checkpoint_dtype([check_safetensors_header(f) for f in safetensors_files(Path(folder))])
    return config_dtype(config or {})


def kept_dtype(stored: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype a tensor quantization does not touch (embeddings, final norm, LM head) is kept in: the source's
    where it is no wider than the compute dtype (a bf16 model computed in float32 keeps its bf16 embeddings and head:
    widening them added 2.2 GB at a 7B's 152k-row vocabulary and no information), else the compute dtype (a float32
    checkpoint computed in bf16 is written in bf16, as its layers are)."""
    return compute if stored.itemsize > compute.itemsize else stored


def kept_elem(stored_elem: int, compute: str) -> int:
    """Bytes per element of what `kept_dtype` keeps, for the planner (which knows the sizes, not the dtypes)."""
    return min(stored_elem, BYTES[compute])


def source_dtype(requested: str) -> str:
    """The dtype to unpack a GGUF source in: float32 for `auto` (the GGUF's own blocks are not a float dtype)."""
    return "float32" if requested == AUTO else requested
