"""A bounded structural check of a GGUF file before it is hashed and handed to transformers.

Every count and length in a GGUF header (key-value pairs, strings, arrays, tensors, dimensions) is
checked against the bytes left in the file before it is used, so a corrupted or hostile header is an
InputError after reading at most the header, never a loop over 2^64 items or an allocation of a
claimed size; every tensor's data must lie inside the file (a truncated download is named here).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt
from llmc.inputs.files import shown

MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_STRINGS = 1 << 23  # vocabularies are up to a few hundred thousand tokens
MAX_DIMS = 8
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_FIX = "re-download the .gguf, or check that this is the file you meant; it is truncated or corrupted"


class _Bad(Exception):
    pass


class _Reader:
    def __init__(self, f, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise _Bad(f"a length of {n} bytes at offset {self.pos} runs past the end of the {self.size}-byte file")
        data = self.f.read(n)
        if len(data) != n:
            raise _Bad(f"the file ends at offset {self.pos + len(data)}")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or n > self.size - self.pos:
            raise _Bad(f"a length of {n} bytes at offset {self.pos} runs past the end of the {self.size}-byte file")
        self.pos += n
        self.f.seek(self.pos)

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self, limit: int | None = None) -> bytes | None:
        n = self.u64()
        if limit is not None and n > limit:
            raise _Bad(f"a key of {n} bytes at offset {self.pos - 8}")
        if limit is None:
            self.skip(n)
            return None
        return self.take(n)


def check_gguf_header(path: Path) -> None:
    """InputError naming the first structural problem of the GGUF at path; None when its header and tensor extents
    are consistent (transformers may still refuse its architecture)."""
    size = os.stat(path).st_size
    try:
        with open(path, "rb") as f:
            _check(_Reader(f, size))
    except _Bad as e:
        raise InputError(f"could not read {shown(path)} as a GGUF model: {e}", fix=_FIX) from None
    except OSError as e:
        raise InputError(f"could not read {shown(path)}: {e.strerror}", fix=_FIX) from None


def _check(r: _Reader) -> None:
    import gguf  # lazy: gguf (~0.5 s cold), only once a file is a GGUF; importing llmc stays light

    magic = r.take(4)
    if magic != b"GGUF":
        raise _Bad(f"it starts with {excerpt(magic)}, not b'GGUF'")
    version = r.u32()
    if version not in (2, 3):
        raise _Bad(f"GGUF version {version} (2 and 3 are read)")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_kv > (r.size - r.pos) // 13 or n_tensors > (r.size - r.pos) // 28:  # smallest entry sizes
        raise _Bad(f"it claims {n_kv} key-value pairs and {n_tensors} tensors, more than its {r.size} bytes hold")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = r.string(MAX_KEY_BYTES)
        vtype = r.u32()
        value = _value(r, vtype)
        if key == b"general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1) or value > 1 << 20:
                raise _Bad(f"general.alignment is {excerpt(value)}, not a power of two")
            alignment = value
    tensors = []
    for _ in range(n_tensors):
        name = r.string(MAX_KEY_BYTES)
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise _Bad(f"tensor {excerpt(name)} has {n_dims} dimensions")
        dims = [r.u64() for _ in range(n_dims)]
        qtype, offset = r.u32(), r.u64()
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise _Bad(f"tensor {excerpt(name)} has unknown type {qtype}") from None
        numel = 1
        for d in dims:
            numel *= d
        if dims and dims[0] % block:
            raise _Bad(f"tensor {excerpt(name)}: {dims} is not a whole number of {block}-element blocks")
        tensors.append((name, offset, -(-numel // block) * type_bytes))
    data_start = -(-r.pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        if data_start + offset + nbytes > r.size:
            raise _Bad(f"tensor {excerpt(name)} needs bytes {data_start + offset}..{data_start + offset + nbytes}, "
                       f"the file has {r.size} (truncated?)")


def _value(r: _Reader, vtype: int) -> object:
    if vtype in _SCALARS:
        raw = r.take(_SCALARS[vtype])
        return int.from_bytes(raw, "little") if vtype in (4, 10) else None
    if vtype == _STRING:
        r.string()
        return None
    if vtype == _ARRAY:
        item, count = r.u32(), r.u64()
        if item in _SCALARS:
            r.skip(count * _SCALARS[item])
            return None
        if item == _STRING:
            if count > MAX_ARRAY_STRINGS or count * 8 > r.size - r.pos:
                raise _Bad(f"an array of {count} strings at offset {r.pos - 12}")
            for _ in range(count):
                r.string()
            return None
        raise _Bad(f"an array of value type {item} at offset {r.pos - 12} (nested arrays are not read)")
    raise _Bad(f"unknown value type {vtype} at offset {r.pos - 4}")
