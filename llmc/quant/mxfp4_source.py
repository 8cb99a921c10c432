"""An MXFP4 original's expert codes kept where the target's scheme allows it, instead of quantizing the decoded values
a second time (issue 46, "no needless rounding").

gpt-oss ships its routed experts as MXFP4 (`<block>.experts.gate_up_proj_blocks` / `_scales`: E2M1 codes two a byte
and one E8M0 exponent per 32 inputs, rows = output features; llmc.model.source_formats decodes them). The layer
stream splits the decoded experts into per-expert Linears (llmc.quant.moe); here the stored codes and exponents are
split the same way (`split_experts` on the stored tensors, viewed in the decoded layout), so each per-expert Linear
finds its own codes, and:

  - an MXFP4 target (W4A16-MXFP4) takes them as they are: codes and exponents bit for bit;
  - an NVFP4 target (W4A16-NVFP4, W4A4-NVFP4) gets them cast (llmc.quant.microscaling.mxfp4_to_nvfp4): the codes
    unchanged, each 16-element half of an MX block scaled by the E4M3 power of two 2^(s - 127 + k) under the
    global scale 2^k, shared by an expert's gate and up (a runtime fuses them under one global scale). This is exact
    wherever a non-zero block's exponent lies within 17 of the largest one's (E4M3 holds 2^-9 .. 2^8); a block
    further below is requantized from its decoded values under the same global scale, and counted.

A Linear whose weight an algorithm changed (it no longer equals the decoded original in the compute dtype) keeps the
quantizer's own codes, as the FP8 pass-through does (llmc.quant.stream._pass_through_source_codes); so does every
member of a gate/up pair when one of them changed (their global scale must stay shared).

Where nothing could change them (every routed expert targets MXFP4 g32 and no forward pass runs: the layer loop's
`experts_kept` decision, llmc.quant.loop_plan.decide_experts_kept, from `source_codes_fact`), the experts are
neither decoded nor quantized at all: `pass_through_layer_codes` copies their stored codes and exponents into the
canonical form (issue 44: the stream did the whole decode + RTN + check, ~34 min a layer planned at 120B widths, to
write the bytes it had read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from llmc.errors import InputError
from llmc.model.checkpoint import CheckpointReader
from llmc.model.families import MoeLayout, linear_role
from llmc.model.skeleton import return_free_heap_to_os
from llmc.quant.microscaling import (MXFP4, BlockQuantized, dequantize_blocks, fused_groups, mxfp4_cast_global_scale,
                                     mxfp4_to_nvfp4, unpack_e2m1)
from llmc.quant.moe import split_experts
from llmc.quant.groups import resolve as resolve_groups, site_of
from llmc.quant.loop_plan import SourceCodes
from llmc.quant.numerics import QuantizedWeight
from llmc.quant.spec import Scheme, TensorSpec

KEPT_FORMATS = ("mxfp4", "nvfp4")  # the target weight formats an MXFP4 source's codes carry over to


@dataclass
class Kept:
    """What the MXFP4 source's codes became, summed over the layers."""

    passed_through: int = 0  # Linears written with the source's MXFP4 codes and exponents, bit for bit
    cast: int = 0  # Linears cast to NVFP4
    exact_blocks: int = 0  # of theirs, 16-element blocks whose codes were kept (values equal to the source's)
    requantized_blocks: int = 0  # blocks requantized from their decoded values (below E4M3's reach)

    def add(self, other: Kept) -> None:
        self.passed_through += other.passed_through
        self.cast += other.cast
        self.exact_blocks += other.exact_blocks
        self.requantized_blocks += other.requantized_blocks

    def describe(self) -> str:
        parts = []
        if self.passed_through:
            parts.append(f"{self.passed_through} expert Linear(s) kept the MXFP4 source's codes and E8M0 scales, "
                         "bit for bit (their target is MXFP4)")
        if self.cast:
            redo = (f"; {self.requantized_blocks} block(s) lay below E4M3's reach under the global scale and were "
                    "requantized from their decoded values") if self.requantized_blocks else ""
            parts.append(f"{self.cast} expert Linear(s) cast from MXFP4 to NVFP4 with their codes kept: "
                         f"{self.exact_blocks} 16-element block(s) exact{redo}")
        return "; ".join(parts)


def keep_layer_codes(quantized: dict[str, QuantizedWeight], weights: dict[str, torch.Tensor],
                     specs: dict[str, TensorSpec], reader: CheckpointReader, prefix: str, layout: MoeLayout) -> Kept:
    """`keep_source_codes` for one decoder layer (`prefix`) of an MXFP4 source; the stored codes are read only when
    a Linear of the layer targets MXFP4 or NVFP4."""
    if not any(specs.get(n) is not None and specs[n].format in KEPT_FORMATS for n in quantized):
        return Kept()
    return keep_source_codes(quantized, weights, specs, source_expert_codes(reader, prefix, layout))


def source_expert_codes(reader: CheckpointReader, prefix: str, layout: MoeLayout) -> SourceExpertCodes:
    """Per-expert Linear name (under `prefix`, a decoder layer's) -> its stored (packed E2M1 codes [out, in / 2],
    E8M0 exponents [out, in / 32]), read one expert at a time as they are asked for (`SourceExpertCodes`)."""
    fused = {n: reader.encoded(n) for n in reader.names() if n.startswith(prefix) and reader.encoded(n) is not None}
    blocks: dict[str, tuple[str, int, str]] = {}  # per-expert Linear -> (the block's base, expert, projection)
    for gate_up in [n for n in fused if n.endswith(".experts.gate_up_proj")]:
        base = gate_up[: -len("gate_up_proj")]
        if base + "down_proj" not in fused:
            continue  # half a fused block: the stream's own checks name what is missing
        experts = fused[gate_up].shape[0]
        for e in range(experts):
            for proj, local in (("gate", layout.gate), ("up", layout.up), ("down", layout.down)):
                blocks[f"{base}{e}.{local}"] = (base, e, proj)
    return SourceExpertCodes(reader, fused, blocks, replace(layout, bias=False))


class SourceExpertCodes(Mapping):
    """The stored MXFP4 codes and exponents of each per-expert Linear of a layer, split from the fused tensors as
    the stream splits the decoded ones (`split_experts` on the stored tensors viewed in the decoded layout). An
    expert's slices are read when one of its Linears is asked for and kept until another expert's is (the cast goes
    expert by expert), so the layer's stored codes are never held whole beside its quantized ones."""

    def __init__(self, reader: CheckpointReader, fused: dict, blocks: dict[str, tuple[str, int, str]],
                 layout: MoeLayout) -> None:
        self._reader, self._fused, self._blocks, self._layout = reader, fused, blocks, layout
        self._expert: tuple[tuple[str, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._blocks

    def __iter__(self):
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        base, e, proj = self._blocks[name]
        if self._expert is None or self._expert[0] != (base, e):
            self._expert = None
            return_free_heap_to_os()  # the last expert's slices and cast temporaries: heap holes otherwise
            gate_up, down = self._fused[base + "gate_up_proj"], self._fused[base + "down_proj"]
            read = {n: _decoded_layout(self._reader.expert_slice(n, e))
                    for n in (gate_up.codes, gate_up.scale, down.codes, down.scale)}
            (p,) = split_experts(self._layout, read[gate_up.codes], read[down.codes], None, None)
            (s,) = split_experts(self._layout, read[gate_up.scale], read[down.scale], None, None)
            self._expert = ((base, e), {k: (p[f"{k}.weight"], s[f"{k}.weight"]) for k in ("gate", "up", "down")})
        return self._expert[1][proj]


def _decoded_layout(stored: torch.Tensor) -> torch.Tensor:
    """A stored MXFP4 part ([E, out, blocks, 16] bytes or [E, out, blocks] exponents) viewed as the decoded tensor is
    laid out ([E, in-direction, out], llmc.model.source_formats.decode_mxfp4), so `split_experts` picks its rows."""
    if stored.dim() == 4:
        stored = stored.reshape(*stored.shape[:2], -1)
    return stored.transpose(1, 2)


def keep_source_codes(quantized: dict[str, QuantizedWeight], weights: dict[str, torch.Tensor],
                      specs: dict[str, TensorSpec], source: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Kept:
    """Replace, in `quantized`, the codes of each expert Linear whose target format is MXFP4 or NVFP4 and whose
    weight (`weights`, in the compute dtype) still equals its decoded source, by the source's codes: passed through
    (MXFP4) or cast (NVFP4, one global scale per gate/up pair). One fused group at a time, so at most one pair's
    unpacked codes exist beside the layer's quantized ones."""
    kept = Kept()
    names = [n for n in quantized if n in source and specs.get(n) is not None and specs[n].format in KEPT_FORMATS
             and specs[n].info.microscaling]
    for fmt in KEPT_FORMATS:
        # NVFP4 siblings share a global scale (fused_groups); MXFP4 has none to share, each Linear stands alone
        mine = [n for n in names if specs[n].format == fmt]
        for group in (fused_groups(mine) if fmt == "nvfp4" else [[n] for n in mine]):
            unpacked = {n: _unchanged_source_codes(source[n], weights[n]) for n in group}
            if any(u is None for u in unpacked.values()):
                continue  # an algorithm changed a member: the quantizer's codes stand for the whole group
            if fmt == "mxfp4":
                (name,) = group
                codes, exponents = unpacked[name]
                device = quantized[name].codes.device
                quantized[name] = QuantizedWeight(codes=codes.to(device), scale=exponents.to(device), zero_point=None)
                kept.passed_through += 1
                continue
            global_scale = mxfp4_cast_global_scale(list(unpacked.values()))
            for name in group:
                cast = mxfp4_to_nvfp4(*unpacked[name], global_scale)
                device, q = quantized[name].codes.device, cast.nvfp4
                quantized[name] = QuantizedWeight(codes=q.codes.to(device), scale=q.scale.to(device), zero_point=None,
                                                  global_scale=q.global_scale.clone().to(device))
                kept.cast += 1
                kept.exact_blocks += cast.exact_blocks
                kept.requantized_blocks += cast.requantized_blocks
    return kept


def source_codes_fact(source_format: str | None, scheme: Scheme, linears: Mapping[str, tuple[int, int]],
                      n_layers: int, model_type: str | None) -> SourceCodes | None:
    """`LoopFacts.source_codes` for an MXFP4 original (`source_format`, its name) whose routed experts (the `experts`
    role of `model_type`'s table, among `linears`: module name -> (out, in)) all target MXFP4 in groups of 32, the
    format it stores them in: the largest decoder layer's expert weights, and its other Linears the scheme still
    quantizes (routers never are). None for another source, or where any expert is left unquantized or gets another
    format (those are decoded). `llmc plan` passes config.json's Linears, the stream its skeleton's: the same facts."""
    if source_format != "mxfp4":
        return None
    members = scheme.members()
    experts: dict[int, int] = {}
    others: dict[int, int] = {}
    for name, group in resolve_groups(scheme, linears, n_layers, model_type).items():
        layer, local = site_of(name)
        role = linear_role(model_type, local)
        size = linears[name][0] * linears[name][1]
        if role == "experts":
            spec = members[group].weights if group is not None else None
            if spec is None or spec.format != "mxfp4" or spec.group_size != MXFP4.block_size:
                return None
            experts[layer] = experts.get(layer, 0) + size
        elif group is not None and role != "router":
            others[layer] = others.get(layer, 0) + size
    if not experts:
        return None
    largest = max(experts, key=lambda i: experts[i] + others.get(i, 0))
    return SourceCodes("mxfp4", experts[largest], others.get(largest, 0))


def pass_through_layer_codes(reader: CheckpointReader, prefix: str, layout: MoeLayout,
                             names: Iterable[str]) -> dict[str, QuantizedWeight]:
    """The canonical codes (E2M1, one a byte) and E8M0 exponents of the routed expert Linears `names` of one decoder
    layer (`prefix`), copied from the MXFP4 original as stored, one expert's slices read at a time: the layer loop's
    `experts_kept` decision, the weights never decoded and the quantizer never run. The tensors `keep_source_codes`
    puts in place of the quantizer's codes where it finds a weight unchanged, byte for byte."""
    source = source_expert_codes(reader, prefix, layout)
    wanted = set(names)
    missing = sorted(wanted - set(source))
    if missing:
        raise InputError(f"{reader.folder}: no MXFP4 codes for {missing[0]}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                         + ": the layer's fused `experts.gate_up_proj_blocks` / `down_proj_blocks` and their `_scales` "
                         "are not all in the checkpoint",
                         fix="point model.source at the complete checkpoint as gpt-oss ships it")
    out = {}
    for name in source:  # the source's order: expert by expert, each expert's slices read once
        if name in wanted:
            packed, exponents = source[name]
            out[name] = QuantizedWeight(codes=unpack_e2m1(packed), scale=exponents.clone(), zero_point=None)
    return out


def _unchanged_source_codes(stored: tuple[torch.Tensor, torch.Tensor],
                            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(E2M1 codes unpacked, E8M0 exponents) of a Linear whose weight still equals its decoded source in the compute
    dtype (no algorithm changed it); None otherwise."""
    packed, exponents = stored
    codes = unpack_e2m1(packed)
    decoded = dequantize_blocks(BlockQuantized(codes, exponents, None, MXFP4), weight.dtype)
    if not torch.equal(decoded, weight.detach().cpu()):
        return None
    return codes, exponents.clone()  # its own tensor: safetensors stores no aliases



# --------------------------------------------------------------------------- the plan's time for it

KEPT_PROBE_SHAPE = (1024, 2048)  # each of a probed gate/up/down group (6M weights a call)


def passed_through_seconds(params: int) -> float:
    """What `pass_through_layer_codes` adds to a layer beside reading its stored bytes (priced as the layer's read)
    and writing its canonical file (the layer's write): `params` expert weights' codes unpacked to one a byte and
    their exponents copied, at this machine's probed rate (llmc.pipeline.quantize.quantize_cost, where the layer
    loop decided `experts_kept`)."""
    return params / passed_through_rate() if params > 0 else 0.0


def passed_through_rate() -> float:
    """Weights per second `pass_through_layer_codes` copies (unpacks) once read, probed once per machine and cached
    (llmc.planning.probes), on one gpt-oss expert at PASSED_THROUGH_PROBE_WIDTH viewed as the stream views it."""
    from llmc.planning import probes  # lazy: only a plan that costs it

    return probes.rate(f"mxfp4 source codes passed through {PASSED_THROUGH_PROBE_WIDTH}",
                       lambda: _passed_through_probe())


# gpt-oss's expert width (hidden = intermediate = 2880 in -20b and -120b), viewed as the stream views it: in one run
# on the shared 2-core Xeon (2026-12-03 14:30 UTC, load ~4) a 1024 x 512-byte Linear unpacked at 32-38 M weights/s,
# gpt-oss's 2880 x 1440 at 237-244 M/s, back to back, so the probe runs at the experts' own width
PASSED_THROUGH_PROBE_WIDTH = 2880


def _passed_through_probe() -> float:
    from llmc.model.families import LAYOUTS
    from llmc.planning.probes import sustained_rate  # lazy: as above

    width = PASSED_THROUGH_PROBE_WIDTH
    g = torch.Generator().manual_seed(0)
    blocks = width // MXFP4.block_size
    # one expert as the checkpoint stores it ([1, out, blocks, 16] codes, [1, out, blocks] exponents), split as
    # SourceExpertCodes splits it
    gate_up, down = (torch.randint(0, 256, (1, rows, blocks, 16), generator=g, dtype=torch.uint8)
                     for rows in (2 * width, width))
    gate_up_e, down_e = (torch.randint(112, 126, (1, rows, blocks), generator=g, dtype=torch.uint8)
                         for rows in (2 * width, width))
    layout = replace(LAYOUTS["gpt_oss"], bias=False)
    (packed,) = split_experts(layout, _decoded_layout(gate_up), _decoded_layout(down), None, None)
    (scales,) = split_experts(layout, _decoded_layout(gate_up_e), _decoded_layout(down_e), None, None)

    def copy() -> None:  # what pass_through_layer_codes does per Linear once its slices are read
        for k in ("gate.weight", "up.weight", "down.weight"):
            QuantizedWeight(codes=unpack_e2m1(packed[k]), scale=scales[k].clone(), zero_point=None)

    return sustained_rate(3 * width * width, copy)


def kept_codes_seconds(source_format: object, weights: TensorSpec, params: int) -> float:
    """What `keep_layer_codes` adds to a layer of `params` MXFP4 expert weights whose target is `weights`: per
    Linear the check that its weight is still the decoded original (its codes unpacked and decoded again), and the
    cast to NVFP4 (or the pass-through to MXFP4), at this machine's probed rate. Zero for another source or target
    (llmc.pipeline.quantize.quantize_cost adds it to the layer's time; the quantizer's own pass is priced apart)."""
    if getattr(source_format, "name", None) != "mxfp4" or weights.format not in KEPT_FORMATS or params <= 0:
        return 0.0
    return params / kept_codes_rate(weights.format)


def kept_codes_rate(fmt: str) -> float:
    """Weights per second `keep_source_codes` gets through to a target of format `fmt` (llmc.planning.probes:
    probed once per machine and cached), on one gate/up/down group of KEPT_PROBE_SHAPE in bf16."""
    from llmc.planning import probes  # lazy: only a plan that costs it

    return probes.rate(f"mxfp4 source codes kept {fmt}", lambda: _kept_codes_probe(fmt))


def _kept_codes_probe(fmt: str) -> float:
    from llmc.planning.probes import sustained_rate  # lazy: as above
    from llmc.quant.microscaling import pack_e2m1

    rows, cols = KEPT_PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    spec = TensorSpec(fmt, "group", group_size=16 if fmt == "nvfp4" else MXFP4.block_size)
    source, weights, quantized = {}, {}, {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
        exponents = torch.randint(112, 126, (rows, cols // MXFP4.block_size), generator=g, dtype=torch.uint8)
        name = f"mlp.experts.0.{proj}"
        source[name] = (pack_e2m1(codes), exponents)
        weights[name] = dequantize_blocks(BlockQuantized(codes, exponents, None, MXFP4), torch.bfloat16)
        quantized[name] = QuantizedWeight(codes=codes, scale=exponents, zero_point=None)
    specs = dict.fromkeys(weights, spec)
    kept = keep_source_codes(dict(quantized), weights, specs, source)
    if kept.cast + kept.passed_through != len(weights):  # the probe must time the work, not the early return
        raise RuntimeError(f"the {fmt} kept-codes probe kept {kept.cast + kept.passed_through} of {len(weights)}")
    return sustained_rate(len(weights) * rows * cols,
                          lambda: keep_source_codes(dict(quantized), weights, specs, source))
