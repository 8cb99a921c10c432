"""Quantization formats as plain data.

A `TensorSpec` says how one kind of tensor (weights, input activations, KV cache) is quantized:
number format, scale granularity, symmetry, static or dynamic. A `Scheme` groups the three with the
algorithm and the modules left alone. Nothing here touches a tensor; `numerics.py` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

NumberFormat = Literal["fp8_e4m3", "int8", "int4", "nvfp4"]
Strategy = Literal["tensor", "channel", "group", "token"]
# "fp8_row": every group scale is a per-row float32 scale times an FP8 e4m3 value (the row scale is the row's
# largest group scale / 448), the form vLLM's W4A8-FP8 kernel converts group scales to at load; scales already
# on that grid convert without loss. None: plain float32 scales.
ScaleGrid = Literal["fp8_row"]

FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class FormatInfo:
    bits: int
    is_float: bool
    implemented: bool = True  # False: recipes may name it, this llmc version cannot quantize to it

    def int_range(self, symmetric: bool) -> tuple[int, int]:
        """Code range; signed for both symmetric and asymmetric (compressed-tensors convention)."""
        del symmetric
        return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1


FORMATS: dict[str, FormatInfo] = {
    "fp8_e4m3": FormatInfo(bits=8, is_float=True),
    "int8": FormatInfo(bits=8, is_float=False),
    "int4": FormatInfo(bits=4, is_float=False),
    "nvfp4": FormatInfo(bits=4, is_float=True, implemented=False),
}


# Every scheme a runtime executes, one line each: (weight format, activation format or None) -> its name. The name
# is the scheme's capability key in the runtimes' rules (docs/compatibility.md), what messages call it, and part of
# stage keys and records: a spelling never changes. The recipe accepts these pairs only.
SCHEMES: dict[tuple[NumberFormat, NumberFormat | None], str] = {
    ("fp8_e4m3", "fp8_e4m3"): "W8A8-FP8",
    ("fp8_e4m3", None): "W8A16-FP8",
    ("int8", "int8"): "W8A8-INT8",
    ("int8", None): "W8A16-INT8",
    ("int4", None): "W4A16-INT",
    ("int4", "fp8_e4m3"): "W4AFP8",
    ("nvfp4", "nvfp4"): "W4A4-NVFP4",
    ("nvfp4", None): "W4A16-NVFP4",
}
KV_CACHE_SCHEMES: dict[NumberFormat, str] = {"fp8_e4m3": "KV-FP8", "int8": "KV-INT8"}  # capability keys too


def pair_name(weights: NumberFormat, activations: NumberFormat | None) -> str:
    """How messages spell a weight/activation pair: "int4+none"."""
    return f"{weights}+{activations or 'none'}"


@dataclass(frozen=True)
class TensorSpec:
    format: NumberFormat
    strategy: Strategy
    group_size: int | None = None
    symmetric: bool = True
    dynamic: bool = False
    scale_grid: ScaleGrid | None = None

    @property
    def info(self) -> FormatInfo:
        return FORMATS[self.format]

    @property
    def bits(self) -> int:
        return self.info.bits

    def describe(self) -> str:
        grain = f"g{self.group_size}" if self.strategy == "group" else self.strategy
        sym = "sym" if self.symmetric else "asym"
        mode = "dynamic" if self.dynamic else "static"
        grid = f"/{self.scale_grid}-scales" if self.scale_grid else ""
        return f"{self.format}/{grain}/{sym}/{mode}{grid}"


@dataclass(frozen=True)
class Scheme:
    weights: TensorSpec
    activations: TensorSpec | None = None
    kv_cache: TensorSpec | None = None
    algorithm: str = "rtn"  # "+"-joined registered steps, e.g. "smoothquant+gptq" (`llmc.quant.algorithms`)
    ignore: tuple[str, ...] = ("lm_head",)
    algorithm_options: tuple[tuple[str, object], ...] = field(default_factory=tuple)

    @property
    def stores_ranges(self) -> bool:
        """True when the written form holds scales measured on activations (static activation or KV-cache)."""
        static_acts = self.activations is not None and not self.activations.dynamic
        return static_acts or self.kv_cache is not None

    @property
    def needs_calibration(self) -> bool:
        """True when any scale depends on activations, so calibration data must be run."""
        from llmc.quant.algorithms.registry import algorithm_calibrates  # the registry imports this module

        return self.stores_ranges or algorithm_calibrates(self.algorithm)

    @property
    def name(self) -> str:
        """The scheme's name in `SCHEMES`: W8A8-FP8, W4A16-INT, W4AFP8 (int4 weights, fp8 activations), ...; a pair
        no runtime executes (only a Scheme built in code, never a recipe's) is named by its formats: "int4+int8"."""
        pair = (self.weights.format, self.activations.format if self.activations else None)
        return SCHEMES.get(pair) or pair_name(*pair)

    def to_dict(self) -> dict:
        return asdict(self)
