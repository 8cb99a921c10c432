"""Safe, lazy access to a Hugging Face safetensors checkpoint.

Only safetensors are read: pickled weights (pytorch_model.bin, *.pt) can execute code when loaded
and are refused with the command that converts them. Headers are checked up front so a truncated
or corrupted file is reported by name before any work starts.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt, shorten
from llmc.inputs.files import file_kind, read_input_json, shown, stat_input
from llmc.model.confine import source_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def safetensors_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not os.path.lexists(folder / "config.json"):
        raise InputError(
            f"{shown(folder)} is not a Hugging Face model folder: config.json is missing",
            fix="point model.source at the folder save_pretrained() wrote, or at a .gguf file",
        )
    if os.path.lexists(folder / INDEX_FILE):
        return _indexed_files(folder, read_index(source_file(folder, INDEX_FILE, "shard index")))
    files = [source_file(folder, f.name, "weights file") for f in sorted(folder.glob("*.safetensors"))]
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise InputError(
                f"{shown(folder)} holds only pickled weights ({shorten(', '.join(pickles), 200)}); llmc does not unpickle "
                "checkpoints because loading a pickle can run arbitrary code",
                fix="convert once where you trust the file: "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, safe_serialization=True)",
            )
        raise InputError(f"{shown(folder)} has no *.safetensors weights", fix="save the model with safe_serialization=True")
    for f in files:
        check_safetensors_header(f)
    return files


INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a weight_map of ~10^6 tensors; real ones are KBs to a few MB
_INDEX_FIX = "re-download the checkpoint, or re-save it with save_pretrained(); its index and shards disagree"


@dataclass(frozen=True)
class ShardIndex:
    """model.safetensors.index.json: which shard holds each tensor."""

    path: Path
    weight_map: dict[str, str]  # tensor name -> shard file name (in the index's folder)

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def read_index(path: Path) -> ShardIndex:
    """The index, checked: a JSON object whose weight_map maps tensor names to plain safetensors file names in the
    same folder (no path separators, so an index cannot point llmc at a file elsewhere)."""
    index = read_input_json(path, "shard index", MAX_INDEX_BYTES, _INDEX_FIX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"shard index {shown(path)} has no weight_map object naming the shards", fix=_INDEX_FIX)
    for name, shard in weight_map.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors")
                and "/" not in shard and "\\" not in shard and not shard.startswith(".")):
            raise InputError(f"shard index {shown(path)} maps tensor {excerpt(name)} to {excerpt(shard)}, not a "
                             "*.safetensors file name in the same folder", fix=_INDEX_FIX)
    return ShardIndex(Path(path), weight_map)


def _indexed_files(folder: Path, index: ShardIndex) -> list[Path]:
    """The shards the index names (other *.safetensors in the folder, e.g. a consolidated copy, are not read), each
    present with a valid header holding exactly the tensors the index assigns to it."""
    expected: dict[str, set[str]] = {}
    for name, shard in index.weight_map.items():
        expected.setdefault(shard, set()).add(name)
    missing = [s for s in index.shards if not os.path.lexists(folder / s)]
    if missing:
        raise InputError(
            f"{shown(folder)}: {len(missing)} of the {len(index.shards)} shards {INDEX_FILE} lists "
            f"{'is' if len(missing) == 1 else 'are'} missing: {shorten(', '.join(missing), 200)}",
            fix="download the missing shards (an interrupted download leaves some out), or re-save the checkpoint",
        )
    files = []
    for shard in index.shards:
        path = source_file(folder, shard, "weights file")
        held = {n for n in check_safetensors_header(path) if n != "__metadata__"}
        absent, unlisted = sorted(expected[shard] - held), sorted(held - expected[shard])
        if absent:
            raise InputError(f"{shown(path)} lacks {len(absent)} tensor(s) that {INDEX_FILE} places there "
                             f"({shorten(', '.join(absent), 160)})", fix=_INDEX_FIX)
        if unlisted:
            raise InputError(f"{shown(path)} holds {len(unlisted)} tensor(s) that {INDEX_FILE} does not list for it "
                             f"({shorten(', '.join(unlisted), 160)})", fix=_INDEX_FIX)
        files.append(path)
    return files


MAX_HEADER_BYTES = 32 << 20  # safetensors' own reader takes up to 100 MB; real headers are KBs to a few MB
MAX_CONFIG_BYTES = 4 << 20
_DTYPE_BITS = {"F64": 64, "I64": 64, "U64": 64, "C64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16,
               "I16": 16, "U16": 16, "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
               "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}  # every dtype safetensors 0.8 reads
_REDOWNLOAD = "re-download or re-save the checkpoint; the file is truncated or corrupted"


def check_safetensors_header(path: Path) -> dict:
    """Validate the header (a regular file; entries with dtype, shape and offsets that tile the data exactly) and that
    the file is as long as the header says; return the header. Reads at most 8 + MAX_HEADER_BYTES bytes."""
    st = stat_input(path, "weights file", _REDOWNLOAD)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"weights file {shown(path)} is {file_kind(st.st_mode)}, not a regular file", fix=_REDOWNLOAD)
    size = st.st_size
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            # the length is the file's first 8 bytes: never printed (a file that is no safetensors would be quoted)
            if n <= 0 or n > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"the header length its first 8 bytes give does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except UnicodeDecodeError:  # its message quotes the byte
        raise InputError(f"{shown(path)} is not a readable safetensors file (its header is not UTF-8)",
                         fix=_REDOWNLOAD) from None
    except json.JSONDecodeError as e:  # e.msg is the parser's words, with no byte of the file
        raise InputError(f"{shown(path)} is not a readable safetensors file (its header is not JSON: "
                         f"{shorten(e.msg, 60)} at character {e.pos})", fix=_REDOWNLOAD) from None
    except (struct.error, ValueError, RecursionError, OSError) as e:
        raise InputError(
            f"{shown(path)} is not a readable safetensors file ({shorten(str(e), 120)})", fix=_REDOWNLOAD
        ) from None
    data_bytes = size - 8 - n
    _check_entries(path, header, data_bytes)
    return header


def _check_entries(path: Path, header: object, data_bytes: int) -> None:
    def bad(what: str) -> InputError:
        return InputError(f"{shown(path)} is not a readable safetensors file ({what})", fix=_REDOWNLOAD)

    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise bad(f"tensor {excerpt(name)} has no dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 16
                and all(type(d) is int and 0 <= d < 1 << 48 for d in shape)):
            raise bad(f"tensor {excerpt(name)} has shape {excerpt(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {excerpt(name)} has data_offsets {excerpt(offsets)}")
        numel = 1
        for d in shape:
            numel *= d
        bits = _DTYPE_BITS.get(info["dtype"])
        if bits is None:
            raise bad(f"tensor {excerpt(name)} has unknown dtype {excerpt(info['dtype'])}")
        if numel * bits != 8 * (offsets[1] - offsets[0]):
            raise bad(f"tensor {excerpt(name)}: {info['dtype']} {shape} is {numel * bits / 8:g} bytes, its offsets "
                      f"span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {excerpt(name)} starts at byte {begin} of the data, after {end}: data overlap or a gap")
        end = stop
    if end != data_bytes:
        raise InputError(
            f"{shown(path)} is truncated or padded: the header describes {end} bytes of data, the file has {data_bytes}",
            fix="re-download or re-save the checkpoint",
        )


# config.json fields llmc reads, as whole numbers in [1, bound]; the first four must be present
_REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_SIZE_BOUNDS = {"hidden_size": 1 << 18, "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 14,
                "vocab_size": 1 << 24, "num_key_value_heads": 1 << 14, "intermediate_size": 1 << 20,
                "head_dim": 1 << 14, "max_position_embeddings": 1 << 27}


def read_model_config(folder: Path) -> dict:
    """The folder's config.json, checked: a JSON object naming model_type, with the sizes llmc computes with as
    whole numbers in a sane range (an absurd hidden_size would become a nonsense estimate or a huge allocation)."""
    path = source_file(Path(folder), "config.json", "model config")
    fix = "point model.source at the folder save_pretrained() wrote (its config.json describes the model)"
    config = read_input_json(path, "model config", MAX_CONFIG_BYTES, fix)
    if not isinstance(config, dict):
        raise InputError(f"model config {shown(path)} is a JSON {type(config).__name__}, not an object", fix=fix)
    if not isinstance(config.get("model_type"), str):
        raise InputError(f"model config {shown(path)} has no model_type", fix=fix)
    for key, bound in _SIZE_BOUNDS.items():
        value = config.get(key)
        if value is None and key not in _REQUIRED_SIZES:
            continue
        if value is None:
            raise InputError(f"model config {shown(path)} has no {key}", fix=fix)
        if type(value) is not int or not 1 <= value <= bound:
            raise InputError(f"model config {shown(path)}: {key} is {excerpt(value)}, not a whole number in "
                             f"[1, {bound:,}]", fix=fix)
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        raise InputError(f"model config {shown(path)}: tie_word_embeddings is "
                         f"{excerpt(config['tie_word_embeddings'])}, not true or false", fix=fix)
    where = _non_finite(config)
    if where is not None:  # Python's json reads NaN/Infinity (and 1e999 as inf); JSON has no such number
        raise InputError(f"model config {shown(path)}: {shorten(where, 120)} is not a finite number (NaN or "
                         "Infinity is not JSON, and no model is defined by one)", fix=fix)
    # auto_map names remote code (trust_remote_code), which llmc never runs: no artifact carries it on
    config.pop("auto_map", None)
    config["architectures"] = transformers_architectures(config, path)
    return config


@functools.cache
def _transformers_names() -> frozenset[str]:
    """Every name transformers exports (its lazy module lists them without importing them; ~0.5 s, once)."""
    import transformers  # lazy: transformers (~1 s), only to read its class names

    return frozenset(dir(transformers))


def transformers_architectures(config: dict, path: Path) -> list[str]:
    """config.json's `architectures` as an artifact must name them: classes transformers has. A class only the
    folder's own code defines (what a dropped auto_map pointed at) loads in no runtime, so it is replaced by
    transformers' causal-LM class for the config's model_type, the model llmc builds and quantizes; InputError
    when transformers has none."""
    names = config.get("architectures")
    known = _transformers_names()
    if isinstance(names, list) and names and all(isinstance(n, str) and n in known for n in names):
        return names
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: as above

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
    if causal_lm is None:
        raise InputError(
            f"model config {shown(path)}: architectures {excerpt(names, 80)} names no class transformers has, and "
            f"transformers has no causal-LM class for model_type {excerpt(config['model_type'], 40)}, so no runtime "
            "could load an artifact of it",
            fix="use a model_type transformers builds with AutoModelForCausalLM (llmc never runs a model folder's "
            "own code)")
    return [causal_lm]


HF_QUANT_CONFIG = "hf_quant_config.json"  # NVIDIA ModelOpt's export writes its quantization here


def folder_source_format(folder: Path, config: dict | None = None, strict: bool = False):
    """The quantized original `folder` is (`llmc.model.source_formats.SourceFormat`, from config.json and ModelOpt's
    hf_quant_config.json), or None; `strict` as `source_format` takes it (False: a packed format's variant no
    decoder reads is read as stored)."""
    from llmc.model.source_formats import source_format  # lazy: it imports llmc.quant

    hf = None
    path = Path(folder) / HF_QUANT_CONFIG
    if os.path.lexists(path):
        path = source_file(Path(folder), HF_QUANT_CONFIG, "ModelOpt quantization config")
        hf = read_input_json(path, "ModelOpt quantization config", MAX_CONFIG_BYTES,
                             "replace hf_quant_config.json with the one ModelOpt wrote")
        hf = hf if isinstance(hf, dict) else None
    return source_format(read_model_config(Path(folder)) if config is None else config, hf, strict)


def _non_finite(value: object) -> str | None:
    """The dotted key of the first float in `value` that is NaN or infinite, else None (iterative: any depth)."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return where or "the value"
        if isinstance(v, dict):
            stack += [(f"{where}.{k}" if where else str(k), x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
    return None


WIDENED = (torch.bfloat16, torch.float16)


def widened(t: torch.Tensor, widen_to: torch.dtype | None) -> torch.Tensor:
    """A copy of `t` (a tensor of a mapped file), in `widen_to` where `t` is a 16-bit float and `widen_to` a wider
    float: one conversion out of the mapped pages instead of a copy as stored and a conversion of that copy, so a
    bf16 layer computed in float32 never exists as a bf16 copy (the same values: widening is exact)."""
    if (widen_to is not None and t.dtype in WIDENED and widen_to.is_floating_point
            and widen_to.itemsize > t.element_size()):
        return t.to(widen_to)
    return t.clone()


def read_elem(stored_elem: int, compute_elem: int) -> int:
    """Bytes a weight stored in `stored_elem` bytes takes once read with `widen_to` the compute dtype of
    `compute_elem` bytes (`widened`'s rule on sizes: a 16-bit float read into a wider dtype)."""
    return compute_elem if stored_elem == 2 and compute_elem > 2 else stored_elem


def widened_bytes(params: float, stored_elem: int, compute_elem: int, decoded: bool = False) -> float:
    """Bytes `params` weights are widened into as they are read (`read_elem`), 0 where they are read as stored or
    `decoded` (a quantized original's decoder makes its own copy): what a plan times as a conversion out of the
    mapped file (llmc.planning.disk.converted_read_seconds)."""
    return params * compute_elem if read_elem(stored_elem, compute_elem) != stored_elem and not decoded else 0.0


class CheckpointReader:
    """Tensor name -> file index over a folder's safetensors.

    Files are opened per read and closed right after: an open safetensors handle keeps its memory map,
    and every page read through it stays resident in this process, so a reader held open for a whole
    run would grow with the model (measured: peak RSS 1.28x for a model twice as deep).

    A quantized original llmc decodes (`llmc.model.source_formats`: FP8 block-wise or per-tensor, MXFP4) is read as
    the model it stands for: `names()` lists the decoded tensors (not their codes and scales), `get_many` decodes each
    as it is read, in float32 rounded once to `dtype`, and `config()` has no quantization_config. `get_stored`
    reads the stored tensors as they are (codes passed through to a target of the same format)."""

    def __init__(self, folder: Path, dtype: torch.dtype = torch.float32, as_stored: tuple[str, ...] = ()) -> None:
        """`as_stored`: source formats (SourceFormat names) read as they are stored, not decoded (the torch engine
        decodes a compressed-tensors artifact itself, with its runtime's activation quantization)."""
        from llmc.model.source_formats import decoding_map  # lazy: it imports llmc.quant

        self.folder = Path(folder)
        self.files = safetensors_files(self.folder)
        self.dtype = dtype
        self._where: dict[str, Path] = {}
        self._header: dict[str, tuple[str, tuple[int, ...]]] = {}
        header = self._header
        for f in self.files:
            for name, info in check_safetensors_header(f).items():
                if name != "__metadata__":
                    self._where[name] = f
                    header[name] = (info["dtype"], tuple(info["shape"]))
        fmt = folder_source_format(self.folder)
        self.source_format = None if fmt is None or fmt.name in as_stored else fmt
        self._decoded, self._hidden = (decoding_map(self.source_format, header) if self.source_format
                                       else ({}, set()))

    def names(self) -> list[str]:
        return [n for n in self._where if n not in self._hidden and n not in self._decoded] + list(self._decoded)

    def __contains__(self, name: str) -> bool:
        return name in self._decoded or (name in self._where and name not in self._hidden)

    def stored_like(self, name: str) -> torch.Tensor | None:
        """A meta tensor of the dtype and shape `name` is stored in (read as it is stored: not decoded), None for a
        decoded tensor or a dtype torch lacks."""
        from safetensors import torch as st  # lazy: as the module's other safetensors readers

        if name in self._decoded or name not in self._where:
            return None
        dtype = st._TYPES.get(self._header[name][0])
        return torch.empty(self._header[name][1], dtype=dtype, device="meta") if dtype is not None else None

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def encoded(self, name: str):
        """The stored parts (`source_formats.Encoded`) a decoded tensor is read from; None for a tensor stored as
        it is read."""
        return self._decoded.get(name)

    def get_many(self, names: list[str], widen_to: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The named tensors (copies; decoded ones decoded), each file opened once and closed before returning;
        `widen_to`: as `get_stored`'s."""
        from llmc.model.source_formats import decode  # lazy: as in __init__

        encoded = {n: self._decoded[n] for n in names if n in self._decoded}
        if not encoded:
            return self.get_stored(names, widen_to)
        out = {}
        stored = [n for n in names if n not in encoded]
        if stored:
            out.update(self.get_stored(stored, widen_to))
        for name, parts in encoded.items():  # one decoded tensor's parts at a time: its float32 copy is the peak
            out[name] = decode(self.source_format, parts, self.get_stored(parts.parts), self.dtype)
        return {n: out[n] for n in names}

    def get_stored(self, names: list[str], widen_to: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The named tensors as the files store them (copies), each file opened once and closed before returning;
        `widen_to` (a compute dtype): a 16-bit float converted to it where it is wider (`widened`)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            f = self._where.get(name)
            if f is None:
                raise InputError(f"tensor {name} is not in the checkpoint at {self.folder}")
            by_file.setdefault(f, []).append(name)
        out = {}
        for f, group in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for name in group:
                    out[name] = widened(h.get_tensor(name), widen_to)
        return out

    def mapped(self, name: str) -> torch.Tensor:
        """`name` as stored, without a copy: its storage is the file's read-only mapping, which lives as long as the
        tensor (its pages are the page cache's, none of them new memory; the caller must not write to it). For a
        tensor copied out as it is (rest.safetensors' embedding and head: a 7B's are 2.2 GB of bf16)."""
        if name in self._decoded or name not in self._where:
            raise InputError(f"tensor {name} is not stored as it is read in the checkpoint at {self.folder}")
        with safe_open(str(self._where[name]), framework="pt") as h:
            return h.get_tensor(name)

    def expert_slices(self, name: str, widen_to: torch.dtype | None = None) -> Iterator[torch.Tensor]:
        """A fused [experts, ...] tensor (`name` as `names()` lists it, or a stored part of one) one expert at a time:
        `expert_slice(name, e)` for each. Neither the fused tensor nor its decoded copy exists whole, so a layer
        split into per-expert tensors as it is read holds the copies alone (whole, gpt-oss-120b's 6.4 GB layer was
        held twice while it was split: llmc.quant.moe.read_layer)."""
        parts = self._decoded.get(name)
        first = parts.parts[0] if parts is not None else name
        for e in range(self._header[first][1][0]):
            yield self.expert_slice(name, e, widen_to)

    def expert_slice(self, name: str, e: int, widen_to: torch.dtype | None = None) -> torch.Tensor:
        """Expert `e` of a fused [experts, ...] tensor, [1, ...] and its own copy, decoded where the source is
        encoded: only its slice of the stored bytes is read (each file opened and closed around it, as every read
        here). Equal to `get(name)[e: e + 1]` (`widen_to`: as `get_stored`'s, for a tensor stored as it is read)."""
        from llmc.model.source_formats import decode  # lazy: as in __init__

        parts = self._decoded.get(name)
        got = {}
        for n in (parts.parts if parts is not None else [name]):
            f = self._where.get(n)
            if f is None:
                raise InputError(f"tensor {n} is not in the checkpoint at {self.folder}")
            with safe_open(str(f), framework="pt") as h:
                got[n] = h.get_slice(n)[e: e + 1]
                got[n] = widened(got[n], widen_to) if parts is None else got[n].clone()
        return decode(self.source_format, parts, got, self.dtype) if parts is not None else got[name]

    def with_prefix(self, prefix: str, widen_to: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        names = [n for n in self.names() if n.startswith(prefix)]
        return {n[len(prefix):]: t for n, t in self.get_many(names, widen_to).items()}

    def config(self) -> dict:
        """config.json; for a decoded source, the decoded model's (no quantization_config)."""
        config = read_model_config(self.folder)
        return {k: v for k, v in config.items() if k != "quantization_config"} if self.source_format else config
