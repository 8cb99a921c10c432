"""A GPTQ, AWQ or compressed-tensors integer original's codes kept where the target's scheme is the source's, instead
of quantizing the decoded values a second time (issue 46, "no needless rounding").

The decoded weight of such a source is `scale x (code - zero)` per group. Where the recipe's weights are the source's
integer scheme (the same bits, scale strategy and group size, the same symmetry) and nothing changes the weights
(algorithm rtn: a GPTQ or AWQ run on the decoded weights, or SmoothQuant, chooses its own codes), the source's codes,
scales and zero points are written as llmc's canonical form holds them (signed codes, signed zero points, float32
scales): every exporter's re-layout (compressed-tensors pack-quantized, the GPTQ and AWQ formats, GGUF Q4_0 / Q8_0 /
Q4_1) then writes the source's codes again, and its scales where the format stores them as the source did
(float16 GPTQ/AWQ scales; compressed-tensors artifacts hold float32 scales of the same values). Requantizing instead
would round a second time: llmc's RTN scale (a group's range / 15 or / 255) is rarely the source's.

What passes, per source (`decide`, made once per scheme and stated by the plan; `kept_codes` per Linear):

  - GPTQ 4/8-bit (`gptq` v1 and `gptq_v2`): the unsigned code q becomes q - 2^(b-1), the zero point z (v1 stores
    z - 1) becomes z - 2^(b-1). `sym: true` passes to a symmetric target when every zero point is 2^(b-1) (as GPTQ
    writes them); `sym: false` to an asymmetric one. A Linear whose g_idx is not in input order (desc_act) and a v1
    Linear with a stored zero of 2^b - 1 (vLLM and ExLlamaV2 read it as 2^b, onnxruntime-genai as 0, GPTQModel as 0
    with the next column's zero one higher: no zero point the target holds means all of them) are requantized from
    their decoded values, and counted. group_size -1 is per channel. A target in the `gptq` format (v1) holds no
    zero of 0 (`TensorSpec.zero_grid`): a kept Linear with one (AWQ, gptq_v2, compressed-tensors) is requantized.
  - AWQ GEMM (4-bit, zero points): to an asymmetric int4 target of the same group size.
  - compressed-tensors pack-quantized / int-quantized / naive-quantized int4 and int8 groups (tensor, channel, group
    strategies; not actorder "group", whose g_idx reorders the groups): to the same scheme, group by group.

Each kept Linear is checked: llmc's own dequantization of the kept codes (rounded as the source's decoder rounds)
must equal the weight the layer holds, so a weight an algorithm changed, or a layout read wrongly, keeps the
quantizer's codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmc.model.source_formats import AWQ_SHIFTS
from llmc.quant.numerics import QuantizedWeight, dequantize
from llmc.quant.spec import Scheme, TensorSpec

INT_FORMATS = ("int4", "int8")  # the target weight formats an integer source's codes carry over to
_CT_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class Decision:
    """Whether a scheme's weights keep an integer source's codes, and why (the plan's words)."""

    keeps: bool
    why: str


def source_specs(fmt) -> dict[str, TensorSpec | str]:
    """The integer scheme each part of the source's codes are (llmc's TensorSpec), keyed by compressed-tensors config
    group ("" for GPTQ and AWQ); a string instead says why that part's codes can never pass (act-order groups).
    {} for a source holding no integer codes (FP8, MXFP4, NVFP4, ModelOpt, GPTQ 2-bit)."""
    if fmt is None:
        return {}
    if fmt.name in ("gptq", "awq"):
        if f"int{fmt.bits}" not in INT_FORMATS:
            return {}
        symmetric = bool(fmt.qc.get("sym", True)) if fmt.name == "gptq" else False
        strategy, size = ("group", fmt.group_size) if fmt.group_size > 0 else ("channel", None)
        return {"": TensorSpec(f"int{fmt.bits}", strategy, size, symmetric=symmetric)}
    if fmt.name != "compressed-tensors":
        return {}
    out: dict[str, TensorSpec | str] = {}
    for key, group in fmt.qc.get("config_groups", {}).items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict) or (group.get("format") or fmt.qc.get("format")) not in _CT_INT_FORMATS:
            continue
        strategy = w.get("strategy") or "tensor"
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8) or strategy not in (
                "tensor", "channel", "group"):
            continue
        if str(w.get("actorder")).lower() == "group":
            out[key] = "its actorder 'group' reorders the groups by g_idx, which llmc's groups (in input order) " \
                       "cannot hold"
            continue
        out[key] = TensorSpec(f"int{w['num_bits']}", strategy, w.get("group_size") if strategy == "group" else None,
                              symmetric=bool(w.get("symmetric", True)))
    return out


def _same(a: TensorSpec, b: TensorSpec) -> bool:
    """The same integer codes and scales: bits, strategy, group size, symmetry (not dynamic: a weight is static)."""
    return (a.format, a.strategy, a.symmetric) == (b.format, b.strategy, b.symmetric) and (
        a.strategy != "group" or a.group_size == b.group_size) and a.scale_grid is None


def _differences(target: TensorSpec, source: TensorSpec) -> str:
    if target.format != source.format:
        return f"the recipe's weights are {target.format}, the source's codes {source.format}"
    if target.strategy != source.strategy:
        return f"the recipe's scales are per {target.strategy}, the source's per {source.strategy}"
    if target.strategy == "group" and target.group_size != source.group_size:
        return f"the recipe's group size is {target.group_size}, the source's {source.group_size}"
    if target.symmetric != source.symmetric:
        sym = {True: "symmetric", False: "asymmetric (zero points)"}
        return f"the recipe's weights are {sym[target.symmetric]}, the source's {sym[source.symmetric]}"
    return f"the recipe's weights put their scales on the {target.scale_grid} grid"


def decide(fmt, scheme: Scheme, group: str = "") -> Decision | None:
    """Whether `scheme`'s weights (a plain scheme: a mixed scheme's member) keep the source's integer codes of
    config group `group`; None where the question does not arise (no integer source, no integer target)."""
    from llmc.quant.algorithms.registry import steps_of  # lazy: the registry imports llmc.quant

    source = source_specs(fmt).get(group)
    target = scheme.weights
    if source is None or target is None or target.format not in INT_FORMATS:
        return None
    if isinstance(source, str):
        return Decision(False, source)
    if not _same(target, source):
        return Decision(False, _differences(target, source))
    steps = [a.name for a in steps_of(scheme.algorithm)]
    if steps != ["rtn"]:
        return Decision(False, f"algorithm {scheme.algorithm} chooses its own codes for the decoded weights "
                               "(algorithm rtn keeps the source's)")
    return Decision(True, "the target's scheme is the source's and algorithm rtn changes no weight")


def plan_notes(fmt, schemes: dict[str, Scheme]) -> list[str]:
    """What the plan says, per variant and group with integer weights, about an integer source's codes: passed
    through bit for bit, or requantized from the decoded values and why."""
    specs = source_specs(fmt)
    if not specs:
        return []
    notes = []
    for variant, scheme in schemes.items():
        for group, member in scheme.members().items():
            for key, source in specs.items():
                d = decide(fmt, member, key)
                if d is None:
                    continue
                who = " ".join(p for p in (f"variant {variant}" if variant else "",
                                           f"group {group}" if group else "") if p)
                part = f"config group {key} " if key else ""
                described = source.describe().replace("/static", "") if isinstance(source, TensorSpec) else ""
                head = (f"{who + ': ' if who else ''}{member.name} weights {member.weights.describe()}: the source's "
                        f"{part}{described + ' ' if described else ''}integer codes")
                if d.keeps:
                    kept = "scales" if member.weights.symmetric else "scales and zero points"
                    notes.append(f"{head} pass through bit for bit with their {kept} ({d.why})"
                                 + _caveat(fmt, member.weights))
                else:
                    fix = (f" (weights {described} keep them)" if isinstance(source, TensorSpec)
                           and not _same(member.weights, source) else "")
                    notes.append(f"{head} are requantized from their decoded values: {d.why}{fix}")
    return notes


def _caveat(fmt, target: TensorSpec | None = None) -> str:
    said = []
    if target is not None and target.zero_grid == "nonzero" and not target.symmetric:
        said.append("a Linear with a zero point of 0 is requantized (a gptq-format target's v1 layout cannot store it "
                    "so that every reader agrees)")
    if fmt.name != "gptq":
        return "; " + "; ".join(said) if said else ""
    if fmt.qc.get("desc_act"):
        said.append("a Linear whose g_idx is not in input order (desc_act) is requantized")
    if fmt.zero_offset and not fmt.qc.get("sym", True):
        said.append(f"a v1 Linear with a stored zero point of {(1 << fmt.bits) - 1} (vLLM and ExLlamaV2 read "
                    f"{1 << fmt.bits}, onnxruntime-genai and GPTQModel 0) is requantized")
    return "; " + "; ".join(said) if said else ""


@dataclass
class Tally:
    """What the integer source's codes became, summed over the layers: kept, or requantized although the scheme
    matched (and why)."""

    kept: int = 0
    requantized: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.requantized:
            return ""
        why = "; ".join(f"{n}: {reason}" for reason, n in sorted(self.requantized.items()))
        return (f"{sum(self.requantized.values())} Linear(s) whose target scheme is the source's were requantized "
                f"from their decoded values ({why})")


def kept_codes(fmt, scheme: Scheme, encoded, reader, weight: torch.Tensor, tally: Tally) -> QuantizedWeight | None:
    """The source's codes of one Linear in llmc's canonical form, where `decide` keeps them and they give exactly
    the layer's `weight` (its compute dtype, as the source's decoder rounds it); None otherwise (its quantizer's codes
    stand; a mismatch in a kept scheme is counted in `tally`)."""
    d = decide(fmt, scheme, encoded.group)
    if d is None or not d.keeps:
        return None
    stored = reader.get_stored(encoded.parts)
    spec = scheme.weights
    q, why = _canonical(fmt, encoded, stored, spec)
    if q is not None:
        values = dequantize(q.codes, q.scale, q.zero_point, spec)  # exact in float32: 8-bit codes x a 16-bit scale
        scale_dtype = stored[encoded.scale].dtype
        if fmt.name == "compressed-tensors" and scale_dtype in (torch.float16, torch.bfloat16):
            values = values.to(scale_dtype)  # compressed-tensors decodes in its scale's dtype
        if not torch.equal(values.to(weight.dtype), weight.cpu()):
            q, why = None, "the weight no longer equals its source's codes"
        elif spec.zero_grid == "nonzero" and q.zero_point is not None and bool(
                (q.zero_point == -(1 << (spec.bits - 1))).any()):
            # e.g. an AWQ or gptq_v2 zero of 0 bound for a GPTQ v1 artifact, which would store it as 2^b - 1
            q, why = None, "a zero point of 0 (unsigned), which a GPTQ v1 artifact cannot store unambiguously"
    if q is None:
        tally.requantized[why] = tally.requantized.get(why, 0) + 1
        return None
    tally.kept += 1
    return QuantizedWeight(codes=q.codes.to(weight.device), scale=q.scale.to(weight.device),
                           zero_point=None if q.zero_point is None else q.zero_point.to(weight.device))


def _unpack(words: torch.Tensor, bits: int, shifts: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words [n, m] -> their codes [n, m * per] (along the last dim; `shifts`: AWQ's interleaved order)."""
    s = torch.tensor(list(shifts if shifts is not None else range(0, 32, bits)), dtype=torch.int32)
    return ((words.unsqueeze(-1) >> s) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def _canonical(fmt, encoded, stored: dict[str, torch.Tensor], spec: TensorSpec
               ) -> tuple[QuantizedWeight | None, str]:
    out_f, in_f = encoded.shape
    if fmt.name == "compressed-tensors":
        return _ct_canonical(fmt, encoded, stored, spec)
    bits = fmt.bits
    scales = stored[encoded.scale]  # [groups, out]
    if fmt.name == "gptq":
        g_idx = stored[encoded.extra[1]] if len(encoded.extra) > 1 else None
        size = fmt.group_size if fmt.group_size > 0 else in_f
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // size):
            return None, "g_idx not in input order (desc_act)"
        q = _unpack(stored[encoded.codes].t().contiguous(), bits).t()[:in_f]  # [in, out]: packed along the input
        zeros = _unpack(stored[encoded.extra[0]], bits)[:, :out_f]  # [groups, out]
        if fmt.zero_offset and bool((zeros == (1 << bits) - 1).any()):
            return None, f"a v1 stored zero point of {(1 << bits) - 1}, read differently by GPTQ's readers"
        zeros = zeros + fmt.zero_offset
    else:  # AWQ GEMM: packed along the output, columns interleaved
        q = _unpack(stored[encoded.codes], bits, AWQ_SHIFTS)[:, :out_f]
        zeros = _unpack(stored[encoded.extra[0]], bits, AWQ_SHIFTS)[:, :out_f]
    offset = 1 << (bits - 1)
    if spec.strategy == "group" and in_f % spec.group_size or scales.shape[0] != (
            in_f // spec.group_size if spec.strategy == "group" else 1):
        return None, "scales not one per group of the target"
    codes = (q - offset).t().contiguous().to(torch.int8)
    zero = (zeros - offset).t().contiguous()  # [out, groups], signed
    if spec.symmetric:
        if bool((zero != 0).any()):
            return None, f"zero points other than {offset} in a symmetric source"
        zp = None
    else:
        if bool((zero < -offset).any() or (zero >= offset).any()):
            return None, "a zero point outside the target's signed range"
        zp = zero.to(torch.int8)
    return QuantizedWeight(codes=codes, scale=scales.float().t().contiguous(), zero_point=zp), ""


def _ct_canonical(fmt, encoded, stored: dict[str, torch.Tensor], spec: TensorSpec
                  ) -> tuple[QuantizedWeight | None, str]:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # lazy: its sources only

    module = encoded.codes.rsplit(".", 1)[0]
    out_f, in_f = encoded.shape
    bits = spec.bits
    codes = stored[encoded.codes]
    scale = stored[encoded.scale].float()
    groups = {"tensor": 1, "channel": 1, "group": in_f // spec.group_size if spec.group_size else 0}[spec.strategy]
    want = (1,) if spec.strategy == "tensor" else (out_f, groups)
    if scale.numel() != (1 if spec.strategy == "tensor" else out_f * groups):
        return None, "scales not one per group of the target"
    zp = stored.get(f"{module}.weight_zero_point")
    if codes.dtype == torch.int32:  # pack-quantized: signed codes + 2^(b-1), packed along the input
        codes = unpack_from_int32(codes, bits, torch.Size((out_f, in_f)))
        if zp is not None and zp.dtype == torch.int32:
            zp = unpack_from_int32(zp, bits, torch.Size((out_f, groups)), packed_dim=0)
    if codes.dtype != torch.int8 or tuple(codes.shape) != (out_f, in_f):
        return None, "codes not int8 of the weight's shape"
    if zp is not None:
        zp = zp.to(torch.int8).reshape(want)
        if spec.symmetric:
            if bool((zp != 0).any()):
                return None, "zero points in a symmetric source"
            zp = None
    elif not spec.symmetric:
        return None, "no zero points in an asymmetric source"
    return QuantizedWeight(codes=codes.contiguous(), scale=scale.reshape(want).contiguous(), zero_point=zp), ""
