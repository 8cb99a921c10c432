"""What every exporter writes the same way: sharded safetensors with an index, and the tokenizer files."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmc.model.tokenizer_files import copy_tokenizer_file
from llmc.quant.numerics import dequantize
from llmc.quant.spec import probe_text
from llmc.storage.store import atomic_save_safetensors, atomic_write_json, fsync_dir

if TYPE_CHECKING:
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import TensorSpec

MAX_SHARD_BYTES = 2 << 30
# Every artifact's runtime arguments and build facts (serve command, engine options, graph summary).
SERVE_FILE = "llmc-serve.json"


def write_shards(out: Path, parts: Iterable[dict[str, torch.Tensor]], max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write `parts` (one dict per canonical file, in order) as model.safetensors, or as
    model-0000i-of-0000n.safetensors + model.safetensors.index.json when they exceed `max_bytes`.

    Each shard is written as soon as the next part would overflow it, so at most one shard's tensors are held at
    a time: the tensors an exporter creates (packed int4 codes) and the mmapped pages of the canonical files it
    passes through. (Collecting every shard before writing the first held the whole artifact: 5.2 GB of mapped
    pages measured at 70B width, one layer; a packing exporter would have held every packed tensor.) The shard
    count is known only at the end: shards written early get a temporary name and are renamed then."""
    from llmc.telemetry.progress import Meter

    out = Path(out)
    meter = Meter("export: shards written", None, unit="shard")
    early: list[tuple[Path, list[str]]] = []  # shards written before the last one: temporary names
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    for t in parts:
        nbytes = sum(v.numel() * v.element_size() for v in t.values())
        if size and size + nbytes > max_bytes:
            path = out / f".model-{len(early) + 1:05d}.incomplete.safetensors"
            atomic_save_safetensors(path, shard, metadata={"format": "pt"})
            meter.advance()
            early.append((path, list(shard)))
            shard, size = {}, 0
        shard.update(t)
        size += nbytes
        total += nbytes
    if not early:
        atomic_save_safetensors(out / "model.safetensors", shard, metadata={"format": "pt"})
        meter.advance()
        meter.close()
        return [out / "model.safetensors"]
    last = out / f".model-{len(early) + 1:05d}.incomplete.safetensors"
    atomic_save_safetensors(last, shard, metadata={"format": "pt"})
    meter.advance()
    meter.close()
    early.append((last, list(shard)))
    del shard
    written, weight_map = [], {}
    for i, (path, names) in enumerate(early):
        final = out / f"model-{i + 1:05d}-of-{len(early):05d}.safetensors"
        os.replace(path, final)
        written.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    fsync_dir(out)
    atomic_write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    return written


# Not tokenizer files: the quantized form's own, and the shard index, which write_shards writes for the artifact's
# shards (a source's index copied over it names the source's shards: the artifact would not load).
_NOT_TOKENIZER = ("quantized.json", "config.json", "model.safetensors.index.json")


def copy_tokenizer_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in _NOT_TOKENIZER:
            copy_tokenizer_file(f, out / f.name)  # tokenizer_config.json without an auto_map


def write_model_files(out: Path, config: dict, source: Path, serve_args: dict | None = None, *, dtype: str) -> None:
    """The files every Hugging Face-layout export writes beside its weights: config.json (`config`, which already
    holds the format's `quantization_config`, with `dtype` set and the deprecated `torch_dtype` dropped so the two
    cannot disagree), the tokenizer files of the `source` folder and, when given, the runtime arguments (SERVE_FILE).
    `config` is changed in place."""
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    atomic_write_json(out / "config.json", config)
    copy_tokenizer_files(source, out)
    if serve_args is not None:
        atomic_write_json(out / SERVE_FILE, serve_args)


# A repacked Linear is converted a block of this many canonical elements at a time (whole output rows): the int64
# packing and float32 decoding temporaries of a whole 70B-width MLP projection were ~2 GB each (the AWQ-layout export
# peaked at 9.27 GB and took 144 s at 70B width, one layer).
REPACK_BLOCK_ELEMENTS = 1 << 20


def _rows(p: torch.Tensor | None, start: int, stop: int, out_features: int) -> torch.Tensor | None:
    """Output rows [start, stop) of a canonical scale / zero point; a per-tensor one is the same for every row."""
    return p if p is None or p.dim() == 0 or p.shape[0] != out_features else p[start:stop]


def repack_linear(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    weights: TensorSpec,
    *,
    repack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]],
    decode: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    output_dims: dict[str, int | None],
    block_elements: int | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """One Linear's canonical codes / scale / zero point as `repack`'s tensors, a block of whole output rows at a
    time, each block decoded again and compared with the canonical weight; returns (tensors, largest change of a
    weight relative to the largest weight). What `write_repacked_checkpoint` does per Linear (and what the plan
    times per weight: `repack_rate`)."""
    out_features, in_features = codes.shape
    step = max(8, (block_elements or REPACK_BLOCK_ELEMENTS) // max(in_features, 1) // 8 * 8)
    blocks: list[dict[str, torch.Tensor]] = []
    largest_change = largest_weight = 0.0
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        rows = (codes[start:stop], _rows(scale, start, stop, out_features), _rows(zero, start, stop, out_features))
        packed = repack(*rows)
        ref = dequantize(*rows, weights).float()
        largest_change = max(largest_change, (decode(packed) - ref).abs().max().item())
        largest_weight = max(largest_weight, ref.abs().max().item())
        blocks.append(packed)
    tensors = {k: blocks[0][k] if dim is None else torch.cat([b[k] for b in blocks], dim=dim)
               for k, dim in output_dims.items()}
    return tensors, largest_change / max(largest_weight, 1e-30)


def write_repacked_checkpoint(
    qm: QuantizedModel,
    out: Path,
    *,
    repack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]],
    decode: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    output_dims: dict[str, int | None],
    quantization_config: dict,
    dtype: str,
    serve: dict | None = None,
    block_elements: int | None = None,
) -> tuple[list[Path], float]:
    """A Hugging Face folder in another tool's weight-only layout (GPTQ, AWQ): every quantized Linear's
    canonical codes / scale / zero point become `repack`'s tensors (named `<module>.<key>`), everything
    else is copied; plus config.json with `quantization_config`, the tokenizer and, when given, the
    runtime arguments (llmc-serve.json). Returns the weight files and the largest relative change of a
    weight, `decode(repacked)` against the canonical weight (the layouts' float16 scales).

    `repack` and `decode` see a block of whole output rows (a multiple of 8, so packed words never straddle two
    blocks); `output_dims` names, per repacked tensor, the dimension its blocks are joined along (None: the tensor
    does not depend on the output rows, e.g. GPTQ's g_idx, and the first block's is kept)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    worst = 0.0

    def repack_module(tensors: dict[str, torch.Tensor], m: str) -> dict[str, torch.Tensor]:
        nonlocal worst
        repacked, change = repack_linear(
            tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"], tensors.get(f"{m}.weight_zero_point"),
            qm.scheme.weights, repack=repack, decode=decode, output_dims=output_dims, block_elements=block_elements)
        worst = max(worst, change)
        return {f"{m}.{k}": v for k, v in repacked.items()}

    def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converted: dict[str, torch.Tensor] = {}
        modules = [m for m in qm.quantized_modules if f"{m}.weight" in tensors]
        for m in modules:
            converted.update(repack_module(tensors, m))
        replaced = {f"{m}.{s}" for m in modules for s in ("weight", "weight_scale", "weight_zero_point")}
        converted.update({k: v for k, v in tensors.items() if k not in replaced})
        return converted

    written = write_shards(out, (convert(t) for t in qm.iter_files()))
    config = dict(qm.config)
    config["quantization_config"] = quantization_config
    write_model_files(out, config, qm.root, serve, dtype=dtype)
    return written, worst


# What the repacking exporters (GPTQ, AWQ; the onnxruntime int4 export's GPTQ intermediate) pay per quantized weight:
# `repack_linear` with the format's own codec, timed in this process on one Linear of the scheme of REPACK_PROBE_SHAPE
# (out, in): a SmolLM2-width MLP projection, large enough that the per-weight work is what is timed (one call:
# 0.5-4 s on the shared 2-core VM at load 11-16). It replaced the constant REPACK_RATE (issue 44).
REPACK_PROBE_SHAPE = (1536, 576)


def probe_shape(weights: TensorSpec) -> tuple[int, int]:
    """REPACK_PROBE_SHAPE with its inputs rounded up to whole groups of `weights` (group 128: 640 inputs; a group
    that did not divide them could not be quantized: llama31-8b-int4-awq's plan failed on it)."""
    out, inp = REPACK_PROBE_SHAPE
    group = weights.group_size if weights.strategy == "group" and weights.group_size else 1
    return out, -(-inp // group) * group


def probe_linear(weights: TensorSpec) -> dict[str, torch.Tensor]:
    """Canonical codes / scale / zero point of one `probe_shape` Linear quantized to `weights` (a TensorSpec)."""
    from llmc.quant.numerics import quantize_weight

    with torch.random.fork_rng(devices=[]):  # the build's own random state stays as it was
        torch.manual_seed(0)
        w = torch.randn(*probe_shape(weights))
    q = quantize_weight(w, weights)
    return {"codes": q.codes, "scale": q.scale, "zero": q.zero_point}


def repack_rate(codec: str, weights: TensorSpec, *,
                repack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]],
                decode: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                output_dims: dict[str, int | None]) -> float:
    """Quantized weight elements/s `repack_linear` repacks into the layout of `codec` (a format's name: the probe's
    key) and checks, with that format's `repack` / `decode` / `output_dims`, on one REPACK_PROBE_SHAPE Linear of
    `weights` (llmc.planning.probes: timed, cached per machine)."""
    from llmc.planning import probes

    out, inp = probe_shape(weights)
    return probes.rate(f"{codec} repack {probe_text(weights)} elements={out * inp}",
                       _repack_timer(weights, repack, decode, output_dims))


def _repack_timer(weights: TensorSpec, repack: Callable, decode: Callable, output_dims: dict[str, int | None]):
    """A function timing `repack_linear` on the probe's Linear (built on first call: a cached rate builds none)."""
    state: dict = {}

    def run_once() -> float:
        from llmc.planning import probes

        if not state:
            state.update(probe_linear(weights))
        return probes.sustained_rate(
            state["codes"].numel(),
            lambda: repack_linear(state["codes"], state["scale"], state["zero"], weights, repack=repack,
                                  decode=decode, output_dims=output_dims))

    return run_once
