"""Quantization formats as plain data.

A `TensorSpec` says how one kind of tensor (weights, input activations, KV cache) is quantized:
number format, scale granularity, symmetry, static or dynamic. A `Scheme` groups the three with the
algorithm and the modules left alone. Nothing here touches a tensor; `numerics.py` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal

NumberFormat = Literal["fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "mxfp8"]
# "block": one scale per 128x128 tile of a weight (`BLOCK_SHAPE`; DeepSeek-style block-wise FP8)
Strategy = Literal["tensor", "channel", "group", "token", "block"]
# "fp8_row": every group scale is a per-row float32 scale times an FP8 e4m3 value (the row scale is the row's
# largest group scale / 448), the form vLLM's W4A8-FP8 kernel converts group scales to at load; scales already
# on that grid convert without loss. None: plain float32 scales.
ScaleGrid = Literal["fp8_row"]
# Asymmetric integer zero points kept off the code range's lowest value (unsigned zero never 0): GPTQ's v1 layout
# stores zero - 1, and its readers disagree on a stored 2^b - 1 (docs/model-sources.md). An artifact format asks
# for it (`ArtifactFormat.zero_grid`); the plan sets it on the scheme, so the one quantizer honours it.
ZeroGrid = Literal["nonzero"]

FP8_E4M3_MAX = 448.0
BLOCK_SHAPE = (128, 128)  # strategy "block": the weight tile one scale covers, the only one runtimes' kernels load


@dataclass(frozen=True)
class FormatInfo:
    bits: int
    is_float: bool
    implemented: bool = True  # False: recipes may name it, this llmc version cannot quantize to it
    # Microscaling formats (llmc.quant.microscaling): the format fixes how many consecutive elements share one scale
    # and how that scale is stored; None for formats whose scales the strategy chooses (float32 each).
    scale_block: int | None = None
    scale_bits: int = 32

    @property
    def microscaling(self) -> bool:
        return self.scale_block is not None

    def int_range(self, symmetric: bool) -> tuple[int, int]:
        """Code range; signed for both symmetric and asymmetric (compressed-tensors convention)."""
        del symmetric
        return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1


FORMATS: dict[str, FormatInfo] = {
    "fp8_e4m3": FormatInfo(bits=8, is_float=True),
    "int8": FormatInfo(bits=8, is_float=False),
    "int4": FormatInfo(bits=4, is_float=False),
    "nvfp4": FormatInfo(bits=4, is_float=True, scale_block=16, scale_bits=8),  # E4M3 scales (+ fp32 per tensor)
    "mxfp4": FormatInfo(bits=4, is_float=True, scale_block=32, scale_bits=8),  # E8M0 scales
    "mxfp8": FormatInfo(bits=8, is_float=True, scale_block=32, scale_bits=8),  # E8M0 scales
}


# Every scheme a runtime executes, one line each: (weight format, activation format or None) -> its name. The name
# is the scheme's capability key in the runtimes' rules (docs/compatibility.md), what messages call it, and part of
# stage keys and records: a spelling never changes. The recipe accepts these pairs only.
SCHEMES: dict[tuple[str, NumberFormat | None], str] = {
    ("fp8_e4m3", "fp8_e4m3"): "W8A8-FP8",
    ("fp8_e4m3", None): "W8A16-FP8",
    ("int8", "int8"): "W8A8-INT8",
    ("int8", None): "W8A16-INT8",
    ("int4", None): "W4A16-INT",
    ("int4", "fp8_e4m3"): "W4AFP8",
    ("nvfp4", "nvfp4"): "W4A4-NVFP4",
    ("nvfp4", None): "W4A16-NVFP4",
    ("mxfp4", None): "W4A16-MXFP4",
    ("mxfp8", "mxfp8"): "W8A8-MXFP8",  # activations dynamic MXFP8, as vLLM's MXFP8 kernel quantizes them
    ("fp8_e4m3/block", "fp8_e4m3"): "W8A8-FP8-BLOCK",  # 128x128 weight blocks, dynamic 1x128 activation groups
}
KV_CACHE_SCHEMES: dict[NumberFormat, str] = {"fp8_e4m3": "KV-FP8", "int8": "KV-INT8"}  # capability keys too


def weight_kind(format: NumberFormat, strategy: Strategy) -> str:
    """The weights' side of a `SCHEMES` key: the format, "/block" added for block-wise scales (a scheme of its own:
    other kernels)."""
    return f"{format}/block" if strategy == "block" else format


def pair_name(weights: str, activations: NumberFormat | None) -> str:
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
    zero_grid: ZeroGrid | None = None  # asymmetric integer weights only; None: any zero point in the code range

    @property
    def info(self) -> FormatInfo:
        return FORMATS[self.format]

    @property
    def bits(self) -> int:
        return self.info.bits

    @property
    def stored_bits(self) -> float:
        """Bits a weight takes once stored, its scale's share included where the format fixes it (microscaling);
        the plain code bits for the others (their scales are counted apart, if at all)."""
        info = self.info
        return info.bits + info.scale_bits / info.scale_block if info.microscaling else info.bits

    def describe(self) -> str:
        grain = {"group": f"g{self.group_size}", "block": "block{}x{}".format(*BLOCK_SHAPE)}.get(self.strategy,
                                                                                             self.strategy)
        sym = "sym" if self.symmetric else "asym"
        mode = "dynamic" if self.dynamic else "static"
        grid = f"/{self.scale_grid}-scales" if self.scale_grid else ""
        zeros = f"/{self.zero_grid}-zeros" if self.zero_grid else ""
        return f"{self.format}/{grain}/{sym}/{mode}{grid}{zeros}"



# The fields every probe key has listed since `zero_grid` came (repr(TensorSpec) then, 2026-12-03): `probe_text`
# lists these always, as repr did, so the rates cached under those keys stay valid.
_PROBE_KEY_FIELDS = ("format", "strategy", "group_size", "symmetric", "dynamic", "scale_grid", "zero_grid")


def probe_text(spec: TensorSpec) -> str:
    """`spec` as a probe's cache key names it (llmc.planning.probes): repr(TensorSpec) of the fields of
    _PROBE_KEY_FIELDS, and any field added since only where it differs from its default, so adding a field with a
    default re-keys no cached rate (repr did: every `fake_quantize` rate was measured again when `zero_grid` came),
    while two specs that quantize differently still key differently."""
    parts = [f"{f.name}={getattr(spec, f.name)!r}" for f in fields(spec)
             if f.name in _PROBE_KEY_FIELDS or getattr(spec, f.name) != f.default]
    return f"TensorSpec({', '.join(parts)})"

# What a decoder layer's Linear does there, named per family in one table (llmc.model.families.LINEAR_ROLES):
# mixed-precision groups select Linears by role.
Role = Literal["attention", "mlp", "experts", "shared_experts", "router"]
ROLES: tuple[str, ...] = ("attention", "mlp", "experts", "shared_experts", "router")


@dataclass(frozen=True)
class ModuleTargets:
    """Which Linears of the decoder layers a module group selects: all of the given criteria at once (a Linear
    matching a name, with one of the roles, in one of the layers and in none of the excluded ones); an empty
    criterion selects every Linear."""

    names: tuple[str, ...] = ()  # exact module name, a trailing part of it, or 're:<regex>' (as `ignore`)
    roles: tuple[str, ...] = ()  # `ROLES`
    layers: tuple[str, ...] = ()  # "first N", "last N", "I" or "I-J" (inclusive); () = every layer
    exclude_layers: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [f"{k} {', '.join(v)}" for k, v in (("names", self.names), ("roles", self.roles),
                                                   ("layers", self.layers), ("except layers", self.exclude_layers))
                 if v]
        return "; ".join(parts) or "every Linear"


@dataclass(frozen=True)
class ModuleGroup:
    """One group of a mixed-precision scheme: the Linears it selects and their weight/activation formats
    (weights None: the group's Linears are left unquantized, in the model's dtype)."""

    name: str
    targets: ModuleTargets
    weights: TensorSpec | None = None
    activations: TensorSpec | None = None

    @property
    def quantized(self) -> bool:
        return self.weights is not None


@dataclass(frozen=True)
class Scheme:
    """One scheme for every quantized Linear, or (`groups` non-empty) a mixed-precision scheme: each group of
    Linears has its own weights/activations (`member`), while algorithm, options, KV cache and `ignore` are shared.
    A mixed scheme's own `weights`/`activations` are those of its member with the fewest weight bits (what the
    default gates go by); code that writes or reads tensors asks `member_of` a module's group."""

    weights: TensorSpec
    activations: TensorSpec | None = None
    kv_cache: TensorSpec | None = None
    algorithm: str = "rtn"  # "+"-joined registered steps, e.g. "smoothquant+gptq" (`llmc.quant.algorithms`)
    ignore: tuple[str, ...] = ("lm_head",)
    algorithm_options: tuple[tuple[str, object], ...] = field(default_factory=tuple)
    groups: tuple[ModuleGroup, ...] = ()

    @property
    def mixed(self) -> bool:
        return bool(self.groups)

    def member(self, group: ModuleGroup) -> Scheme:
        """The plain (one-group) scheme `group`'s Linears are quantized with."""
        return replace(self, weights=group.weights, activations=group.activations, groups=())

    def members(self) -> dict[str, Scheme]:
        """Group name -> its plain scheme, for every quantized group; {"": self} for a plain scheme."""
        if not self.groups:
            return {"": self}
        return {g.name: self.member(g) for g in self.groups if g.quantized}

    def group(self, name: str) -> ModuleGroup:
        return next(g for g in self.groups if g.name == name)

    @property
    def stores_ranges(self) -> bool:
        """True when the written form holds scales measured on activations (static activation or KV-cache)."""
        if self.groups:
            return any(m.stores_ranges for m in self.members().values())
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
        if self.groups:  # "MIXED-W4A16-NVFP4+W8A8-FP8": its members' names, each once, sorted
            return "MIXED-" + "+".join(sorted({m.name for m in self.members().values()}))
        pair = (weight_kind(self.weights.format, self.weights.strategy),
                self.activations.format if self.activations else None)
        return SCHEMES.get(pair) or pair_name(*pair)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.groups:  # plain schemes dump (stage keys, records) as before groups existed
            del d["groups"]
        # and specs without a zero grid as before it existed (the same stage keys, the same quantized.json)
        for spec in [d.get("weights"), d.get("activations"), d.get("kv_cache"),
                     *(x for g in d.get("groups", ()) for x in (g.get("weights"), g.get("activations")))]:
            if spec is not None and spec.get("zero_grid") is None:
                spec.pop("zero_grid", None)
        return d


def with_zero_grid(scheme: Scheme, grid: ZeroGrid | None) -> Scheme:
    """`scheme` with `grid` on the weights of every member with asymmetric integer weights (plain and mixed); the
    scheme itself where none has them or `grid` is None."""
    if grid is None:
        return scheme

    def spec(s: TensorSpec | None) -> TensorSpec | None:
        takes = s is not None and not s.symmetric and not s.info.is_float and not s.info.microscaling
        return replace(s, zero_grid=grid) if takes else s

    groups = tuple(replace(g, weights=spec(g.weights)) for g in scheme.groups)
    return replace(scheme, weights=spec(scheme.weights), groups=groups)
