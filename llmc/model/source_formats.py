"""Quantized originals llmc reads by decoding them, one tensor at a time as the layer stream reads it.

Frontier models ship no full-precision parent: DeepSeek-V3/R1 and Kimi-K2 are FP8 block-wise (config.json's
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`, an F8_E4M3 `X.weight` with one float32
`X.weight_scale_inv` per 128x128 block, edge blocks partial), gpt-oss's experts MXFP4 (`quant_method: mxfp4`,
`X_blocks` of packed E2M1 pairs and `X_scales` of E8M0 exponents, one per 32 elements). Each decoder here gives the
values the format's reference decoder gives, bit for bit (tests/unit/test_source_formats.py against transformers'
`Fp8Dequantize` / `_dequantize_fp8_weight` and `convert_moe_packed_tensors`): the product in float32, then rounded
once to the dtype the build computes in.

The packed formats are decoded the same way, Linear by Linear: compressed-tensors checkpoints (llm-compressor,
vLLM, llmc's `vllm` artifacts) by compressed-tensors' own decompressors, ModelOpt FP8 / NVFP4 exports, GPTQ and AWQ
(GEMM) checkpoints by the formulas of GPTQModel and AutoAWQ (tests/unit/test_packed_sources.py); a variant none of
them reads (another compressed-tensors format, ModelOpt's INT4 algorithms, GPTQ 3-bit, AWQ GEMV, ...) is refused
naming the field. `decode_rate` probes each decoder's speed for the plan.

`decoding_map` pairs the stored tensors from their names, dtypes and shapes alone (safetensors headers), so the plan
checks a source through the same view the stream reads (`decoded_header`). A `quantization_config` whose method is
not one of these stays refused (llmc.model.checks); one of these methods with a variant no decoder here reads (FP8
E5M2, a block that is not 2-D) is refused by `source_format`, naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt
from llmc.quant.spec import BLOCK_SHAPE
from llmc.quant.microscaling import (E8M0_NAN, NVFP4, BlockQuantized, dequantize_blocks, e2m1_decode, e8m0_decode,
                                     unpack_e2m1)

FP8_SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name: X.weight -> X.weight_scale_inv (fused experts: X -> X_scale_inv)
FP8_ACTIVATION_SUFFIX = ".activation_scale"  # a static-activation FP8 checkpoint's input scales: not weights
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
MXFP4_BYTES_PER_BLOCK = 16  # 32 E2M1 elements, two a byte
_FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # float scales; F8_E8M0: transformers' scale_fmt ue8m0
_FIX = "re-download the checkpoint; its config.json and its tensors disagree"


@dataclass(frozen=True)
class SourceFormat:
    """A quantized original llmc decodes: `fp8-block` (with `block`), `fp8-tensor`, `mxfp4`, `compressed-tensors`,
    `modelopt`, `gptq` or `awq` (`bits`, `group_size`, `zero_offset`: 1 for GPTQ's v1 zero points)."""

    name: str
    quant_method: str
    block: tuple[int, int] | None = None  # fp8-block: rows x columns one scale covers
    variant: str = ""  # the packed formats: what describe() names (compressed-tensors' formats, ModelOpt's algos)
    bits: int = 0
    group_size: int = 0
    zero_offset: int = 0
    qc: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # the quantization_config

    def describe(self) -> str:
        if self.name == "fp8-block":
            return "FP8 E4M3 block-wise ({}x{} blocks, a weight_scale_inv each)".format(*self.block)
        if self.name == "fp8-tensor":
            return "FP8 E4M3 with one weight_scale_inv per tensor"
        if self.name == "compressed-tensors":
            return f"compressed-tensors ({self.variant})"
        if self.name == "modelopt":
            return f"NVIDIA ModelOpt {self.variant} (weight codes with weight_scale beside them)"
        if self.name == "gptq":
            return (f"GPTQ {self.bits}-bit, {_groups_word(self.group_size)} ({self.variant}: qweight, qzeros, "
                    "scales, g_idx)")
        if self.name == "awq":
            return f"AWQ GEMM {self.bits}-bit, {_groups_word(self.group_size)} (qweight, qzeros, scales)"
        return "MXFP4 (E2M1 *_blocks with E8M0 *_scales per 32 elements)"


def _groups_word(group_size: int) -> str:
    return "per output channel (one group spans the input)" if group_size <= 0 else f"groups of {group_size}"


def source_format(config: dict, hf_quant_config: dict | None = None, strict: bool = True) -> SourceFormat | None:
    """The decoder config.json's quantization_config (or ModelOpt's hf_quant_config.json) asks for; None for a config
    without one or with a method no decoder here reads (llmc.model.checks refuses those by name). InputError for a
    config that is malformed or a variant llmc does not decode, naming the field; `strict` False: None for a packed
    format's (compressed-tensors, ModelOpt, GPTQ, AWQ) such variant instead, read as it is stored (llmc's own
    artifacts of every layout are read by the same CheckpointReader; the plan refuses them as sources)."""
    qc = config.get("quantization_config")
    try:
        if isinstance(hf_quant_config, dict) and not (isinstance(qc, dict) and str(qc.get("quant_method")).lower()
                                                      == "modelopt"):
            return _modelopt_format(hf_quant_config.get("quantization"), "hf_quant_config.json's quantization")
        packed = _PACKED_FORMATS.get(str(qc.get("quant_method") or "").lower()) if isinstance(qc, dict) else None
        if packed is not None:
            return packed(qc, "config.json's quantization_config")
    except InputError:
        if strict:
            raise
        return None
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method") or "").lower()
    where = "config.json's quantization_config"
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise InputError(f"{where} says quant_method 'fp8' with fmt {excerpt(fmt, 40)}; llmc decodes FP8 E4M3 "
                             "sources only", fix="point model.source at an E4M3 or full-precision checkpoint")
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise InputError(f"{where}: activation_scheme {excerpt(scheme, 40)} is neither dynamic nor static",
                             fix=_FIX)
        block = qc.get("weight_block_size")
        if block is None:
            return SourceFormat("fp8-tensor", method)
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 1 << 16
                                                                    for b in block)):
            raise InputError(f"{where}: weight_block_size is {excerpt(block, 40)}, not two positive whole numbers "
                             "(rows, columns)", fix=_FIX)
        return SourceFormat("fp8-block", method, (block[0], block[1]))
    if method == "mxfp4":
        return SourceFormat("mxfp4", method)
    return None


# --------------------------------------------------------------------------- the packed formats' configs

CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized", "nvfp4-pack-quantized")
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4")
_PARENT = "point model.source at the unquantized parent checkpoint (its model card's base_model)"


def _compressed_tensors_format(qc: dict, where: str) -> SourceFormat:
    """compressed-tensors (llm-compressor's and vLLM's checkpoints, llmc's `vllm` artifacts): each config group's
    format must be one compressed-tensors' own decompressors give the weights of; sparsity and transforms
    (rotations the runtime applies) are refused, since the decoded weights would not be the model."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InputError(f"{where} says quant_method 'compressed-tensors' but has no config_groups", fix=_FIX)
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise InputError(f"{where} has a {key}: llmc decodes quantized compressed-tensors weights, not "
                             f"{key.split('_')[0]} the runtime applies on top", fix=_PARENT)
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise InputError(f"{where}: quantization_status {excerpt(status, 40)}; llmc decodes 'compressed' "
                         "checkpoints (codes with their scales)", fix=_PARENT)
    formats = []
    for key, group in groups.items():
        fmt = (group.get("format") if isinstance(group, dict) else None) or qc.get("format")
        weights = group.get("weights") if isinstance(group, dict) else None
        if weights is None or fmt == "dense":
            continue  # a group quantizing activations only keeps float weights
        if fmt not in CT_FORMATS:
            raise InputError(f"{where}: config_groups.{excerpt(key, 40)} is compressed-tensors format "
                             f"{excerpt(fmt, 40)}; llmc decodes {', '.join(CT_FORMATS)}", fix=_PARENT)
        formats.append(f"{fmt} {weights.get('type', 'int')}{weights.get('num_bits', '?')} "
                       f"{weights.get('strategy', '?')}")
    return SourceFormat("compressed-tensors", "compressed-tensors", variant=", ".join(sorted(set(formats))),
                        qc=dict(qc))


def _modelopt_format(quantization: object, where: str) -> SourceFormat:
    """NVIDIA ModelOpt's export (hf_quant_config.json, or config.json's quantization_config with quant_method
    'modelopt'): FP8 (per tensor, per channel, 128x128 blocks) and NVFP4 weights; a mixed checkpoint's every layer
    one of those."""
    if not isinstance(quantization, dict):
        raise InputError(f"{where} is not an object", fix=_FIX)
    algo = str(quantization.get("quant_algo"))
    algos = {algo}
    if algo == "MIXED_PRECISION":
        layers = quantization.get("quantized_layers")
        if not isinstance(layers, dict):
            raise InputError(f"{where}: quant_algo MIXED_PRECISION without quantized_layers", fix=_FIX)
        algos = {str(v.get("quant_algo")) if isinstance(v, dict) else "?" for v in layers.values()}
    refused = sorted(a for a in algos if a not in MODELOPT_ALGOS)
    if refused:
        raise InputError(f"{where}: quant_algo {excerpt(refused[0], 40)}; llmc decodes ModelOpt "
                         f"{', '.join(MODELOPT_ALGOS)} checkpoints", fix=_PARENT)
    return SourceFormat("modelopt", "modelopt", variant="/".join(sorted(algos)), qc=dict(quantization))


def _modelopt_config(qc: dict, where: str) -> SourceFormat:
    return _modelopt_format(qc, where)


def _gptq_format(qc: dict, where: str) -> SourceFormat:
    """GPTQ (AutoGPTQ / GPTQModel, llmc's `gptq` artifacts): 2-, 4- or 8-bit codes packed along the input, zero
    points stored minus one in checkpoint_format 'gptq' (v1), as they are in 'gptq_v2'."""
    checkpoint = str(qc.get("checkpoint_format", "gptq")).lower()
    if checkpoint not in ("gptq", "gptq_v2"):
        raise InputError(f"{where}: checkpoint_format {excerpt(checkpoint, 40)}; llmc decodes GPTQ's 'gptq' and "
                         "'gptq_v2' layouts (a kernel's repacked layout is not its weights' layout)", fix=_PARENT)
    bits, group = _bits_and_group(qc, where, (2, 4, 8))
    return SourceFormat("gptq", "gptq", variant=f"checkpoint_format {checkpoint}", bits=bits, group_size=group,
                        zero_offset=1 if checkpoint == "gptq" else 0, qc=dict(qc))


def _awq_format(qc: dict, where: str) -> SourceFormat:
    """AWQ (AutoAWQ's GEMM layout, llmc's `awq` artifacts): 4-bit codes packed along the output, 0 2 4 6 1 3 5 7."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise InputError(f"{where}: AWQ version {excerpt(version, 40)}; llmc decodes AutoAWQ's GEMM layout",
                         fix=_PARENT)
    if qc.get("zero_point") is False:
        raise InputError(f"{where}: AWQ with zero_point false; llmc decodes AWQ GEMM checkpoints with zero points",
                         fix=_PARENT)
    bits, group = _bits_and_group(qc, where, (4,))
    return SourceFormat("awq", "awq", bits=bits, group_size=group, qc=dict(qc))


def _bits_and_group(qc: dict, where: str, allowed: tuple[int, ...]) -> tuple[int, int]:
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size", -1))
    if bits not in allowed:
        raise InputError(f"{where}: bits {excerpt(bits, 20)}; llmc decodes {'/'.join(map(str, allowed))}-bit "
                         f"{qc.get('quant_method')} checkpoints", fix=_PARENT)
    if type(group) is not int or group == 0 or group < -1:
        raise InputError(f"{where}: group_size {excerpt(group, 20)} is neither -1 nor a positive number", fix=_FIX)
    return bits, group


_PACKED_FORMATS = {"compressed-tensors": _compressed_tensors_format, "compressed_tensors": _compressed_tensors_format,
                   "modelopt": _modelopt_config, "gptq": _gptq_format, "awq": _awq_format}
PACKED = ("compressed-tensors", "modelopt", "gptq", "awq")  # SourceFormat names of the packed formats


def decoded_config(config: dict) -> dict:
    """The config of the model a decoded source is: without the quantization_config it no longer has."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def statement(fmt: SourceFormat, dtype: str) -> str:
    """What the plan (and the build's report) says about a decoded source."""
    rounding = "" if dtype == "float32" else f", rounded once to {dtype}"
    if fmt.name == "mxfp4":
        kept = (" (experts whose target is MXFP4 keep the source's codes, copied as stored, never decoded, where no "
                "forward pass runs; an NVFP4 target gets them cast with the "
                "codes kept, exactly wherever a block's exponent lies within 17 of its expert's largest: "
                "llmc.quant.mxfp4_source)")
    elif fmt.name.startswith("fp8"):
        kept = " (a weight whose target format is the source's keeps the source's codes)"
    elif fmt.name == "modelopt":
        kept = " (an FP8 weight whose target has the source's strategy keeps the source's codes)"
    elif fmt.name == "compressed-tensors":
        kept = (" (an FP8 weight whose target has the source's strategy, and an integer weight whose target has its "
                "scheme with algorithm rtn, keeps the source's codes: llmc.quant.int_source)")
    elif fmt.name in ("gptq", "awq"):
        kept = (" (a weight whose target has the source's integer scheme, with algorithm rtn, keeps the source's "
                "codes: llmc.quant.int_source)")
    else:
        kept = ""
    how = _HOW.get(fmt.name, "each code times its scale, in float32")
    baseline = "the baseline is the decoded original"
    if fmt.name == "compressed-tensors" and any(isinstance(g, dict) and g.get("input_activations")
                                                for g in fmt.qc.get("config_groups", {}).values()):
        # the torch engine cannot tell this folder from an artifact: it quantizes activations as the config says
        baseline += " with its activations quantized as its config_groups say (as its runtime runs it)"
    return (f"model.source is a quantized original, {fmt.describe()} (quantization_config quant_method "
            f"'{fmt.quant_method}'): llmc decodes it layer by layer ({how}{rounding}) and quantizes the decoded "
            f"weights{kept}; {baseline}")


_HOW = {"compressed-tensors": "by compressed-tensors' own decompressors, NVFP4 as code x block scale / global "
                              "scale in float32",
        "modelopt": "each code times weight_scale (and NVFP4's weight_scale_2), in float32",
        "gptq": "scales x (code - zero) per group of g_idx, in float32",
        "awq": "scales x (code - zero) per group, in float32"}


# --------------------------------------------------------------------------- pairing stored tensors

Header = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


@dataclass(frozen=True)
class Encoded:
    """One decoded tensor's stored parts."""

    codes: str
    scale: str
    shape: tuple[int, ...]  # of the decoded tensor
    extra: tuple[str, ...] = ()  # the packed formats' other stored parts (zero points, g_idx, global scales)
    group: str = ""  # compressed-tensors: the config group whose scheme decodes it

    @property
    def parts(self) -> list[str]:
        """Every stored tensor it is decoded from."""
        return [self.codes, self.scale, *self.extra]


def decoding_map(fmt: SourceFormat, header: Header) -> tuple[dict[str, Encoded], set[str]]:
    """(decoded name -> its stored parts, stored names no decoded tensor stands for any more: the parts, and a
    static FP8 checkpoint's activation scales). InputError naming the tensor when a part's dtype or shape is not
    what the format stores."""
    if fmt.name == "mxfp4":
        return _mxfp4_map(header)
    if fmt.name == "compressed-tensors":
        return _compressed_tensors_map(fmt, header)
    if fmt.name == "modelopt":
        return _modelopt_map(header)
    if fmt.name in ("gptq", "awq"):
        return _gptq_awq_map(fmt, header)
    return _fp8_map(fmt, header)


def _fp8_map(fmt: SourceFormat, header: Header) -> tuple[dict[str, Encoded], set[str]]:
    out, hidden = {}, set()
    for scale, (scale_dtype, scale_shape) in header.items():
        if not scale.endswith(FP8_SCALE_SUFFIX):
            continue
        codes = scale[: -len(FP8_SCALE_SUFFIX)]
        if codes not in header:
            raise InputError(f"model source: {excerpt(scale, 100)} scales a tensor {excerpt(codes, 100)} the "
                             "checkpoint does not hold", fix=_FIX)
        dtype, shape = header[codes]
        if dtype != "F8_E4M3" or len(shape) < 2:
            raise InputError(f"model source: {excerpt(codes, 100)} is {dtype} {list(shape)}; an FP8 source's scaled "
                             "weights are F8_E4M3 matrices", fix=_FIX)
        if scale_dtype not in _FP8_SCALE_DTYPES:
            raise InputError(f"model source: {excerpt(scale, 100)} is {scale_dtype}, not a float scale", fix=_FIX)
        want = fp8_scale_shape(fmt, tuple(shape))
        if fmt.name == "fp8-tensor" and math.prod(scale_shape) != 1 or fmt.name == "fp8-block" and tuple(
                scale_shape) != want:
            raise InputError(f"model source: {excerpt(scale, 100)} has shape {list(scale_shape)}, but "
                             f"{fmt.describe()} of the {list(shape)} weight has {list(want)}", fix=_FIX)
        out[codes] = Encoded(codes, scale, tuple(shape))
        hidden.add(scale)
        owner = codes.rsplit(".", 1)[0]
        if f"{owner}{FP8_ACTIVATION_SUFFIX}" in header:
            hidden.add(f"{owner}{FP8_ACTIVATION_SUFFIX}")
    return out, hidden


def fp8_scale_shape(fmt: SourceFormat, shape: tuple[int, ...]) -> tuple[int, ...]:
    if fmt.block is None:
        return ()
    *lead, rows, cols = shape
    return (*lead, -(-rows // fmt.block[0]), -(-cols // fmt.block[1]))


def _mxfp4_map(header: Header) -> tuple[dict[str, Encoded], set[str]]:
    out, hidden = {}, set()
    for blocks, (dtype, shape) in header.items():
        if not blocks.endswith(MXFP4_BLOCKS):
            continue
        name = blocks[: -len(MXFP4_BLOCKS)]
        scales = name + MXFP4_SCALES
        if scales not in header:
            raise InputError(f"model source: {excerpt(blocks, 100)} has no {excerpt(scales, 100)} beside it",
                             fix=_FIX)
        scale_dtype, scale_shape = header[scales]
        if (dtype != "U8" or scale_dtype != "U8" or len(shape) != 4 or shape[-1] != MXFP4_BYTES_PER_BLOCK
                or tuple(scale_shape) != tuple(shape[:-1])):
            raise InputError(f"model source: {excerpt(blocks, 100)} ({dtype} {list(shape)}) and its scales "
                             f"({scale_dtype} {list(scale_shape)}) are not MXFP4 experts (U8 [experts, rows, blocks, "
                             "16] and U8 [experts, rows, blocks])", fix=_FIX)
        experts, rows, n_blocks, _ = shape
        out[name] = Encoded(blocks, scales, (experts, n_blocks * 2 * MXFP4_BYTES_PER_BLOCK, rows))
        hidden |= {blocks, scales}
    return out, hidden


# tensors a packed checkpoint keeps for its runtime (activation and KV-cache scales): no weight of the model
RUNTIME_SCALES = (".input_scale", ".input_global_scale", ".input_zero_point", ".output_scale", ".k_scale",
                  ".v_scale")


def _runtime_scales(header: Header) -> set[str]:
    return {n for n in header if n.endswith(RUNTIME_SCALES)}


def _need(header: Header, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None, what: str) -> None:
    """InputError unless the stored part `name` is there, of one of `dtypes` (and of `shape` when given)."""
    if name not in header:
        raise InputError(f"model source: {excerpt(name, 100)} is missing beside the {what}", fix=_FIX)
    dtype, got = header[name]
    if dtype not in dtypes or shape is not None and tuple(got) != tuple(shape):
        want = f"{'/'.join(dtypes)}" + (f" {list(shape)}" if shape is not None else "")
        raise InputError(f"model source: {excerpt(name, 100)} is {dtype} {list(got)}; the {what} stores it as "
                         f"{want}", fix=_FIX)


def _ct_groups(qc: dict) -> list[tuple[str, tuple[str, ...], str]]:
    """(config group key, its targets, its compression format) of each group quantizing weights, in order."""
    out = []
    for key, group in qc["config_groups"].items():
        fmt = group.get("format") or qc.get("format")
        if group.get("weights") is not None and fmt != "dense":
            out.append((key, tuple(group.get("targets") or ("Linear",)), fmt))
    return out


def _ct_group_of(module: str, groups: list[tuple[str, tuple[str, ...], str]]) -> tuple[str, str] | None:
    """The (key, format) of the first group whose targets name `module` (a class name: every module with stored
    codes is a Linear), as compressed-tensors matches them."""
    from llmc.inputs.patterns import module_matches  # lazy: only a compressed-tensors source's targets need it

    for key, targets, fmt in groups:
        if any(t == "Linear" or module_matches(module, [t]) for t in targets):
            return key, fmt
    return None


def _compressed_tensors_map(fmt: SourceFormat, header: Header) -> tuple[dict[str, Encoded], set[str]]:
    groups = _ct_groups(fmt.qc)
    out, hidden = {}, _runtime_scales(header)
    for name, (dtype, shape) in header.items():
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
        elif name.endswith(".weight_scale") and header.get(name[: -len("_scale")], ("",))[0] in ("F8_E4M3", "I8"):
            module = name[: -len(".weight_scale")]
        else:
            continue
        found = _ct_group_of(module, groups)
        if found is None:
            raise InputError(f"model source: {excerpt(module, 100)} holds quantized weights, but no config_groups "
                             "entry of config.json's quantization_config targets it", fix=_FIX)
        key, group_format = found
        codes = f"{module}.weight_packed" if name.endswith("_packed") else f"{module}.weight"
        what = f"compressed-tensors {group_format} weight {module}"
        _need(header, f"{module}.weight_scale", ("F32", "BF16", "F16", "F8_E4M3", "U8"), None, what)
        code_dtype, code_shape = header[codes]
        if len(code_shape) != 2:
            raise InputError(f"model source: {excerpt(codes, 100)} is {list(code_shape)}; llmc decodes 2-D "
                             "compressed-tensors weights", fix=_FIX)
        if group_format == "nvfp4-pack-quantized":
            _need(header, codes, ("U8",), None, what)
            _need(header, f"{module}.weight_global_scale", ("F32", "BF16", "F16"), None, what)
            shape = (code_shape[0], code_shape[1] * 2)
        elif group_format == "pack-quantized":
            _need(header, codes, ("I32",), None, what)
            bits = _ct_bits(fmt.qc["config_groups"][key])
            shape = (code_shape[0], code_shape[1] * 32 // bits)  # in_features whole words (weight_shape checks it)
        else:
            _need(header, codes, ("F8_E4M3", "I8"), None, what)
            shape = tuple(code_shape)
        extra = tuple(f"{module}.{p}" for p in ("weight_zero_point", "weight_global_scale", "weight_shape")
                      if f"{module}.{p}" in header)
        decoded = f"{module}.weight"
        out[decoded] = Encoded(codes, f"{module}.weight_scale", shape, extra, key)
        hidden |= {codes, f"{module}.weight_scale", *extra} - {decoded}
    return out, hidden


def _ct_bits(group: dict) -> int:
    bits = (group.get("weights") or {}).get("num_bits")
    if bits not in (2, 4, 8):
        raise InputError(f"config.json's quantization_config: a pack-quantized group of num_bits {excerpt(bits, 20)}; "
                         "llmc decodes 2-, 4- and 8-bit packed weights", fix=_PARENT)
    return bits


MODELOPT_FP8_BLOCK = (128, 128)  # FP8_PB_WO's tiles


def _modelopt_map(header: Header) -> tuple[dict[str, Encoded], set[str]]:
    out, hidden = {}, _runtime_scales(header)
    for name, (scale_dtype, scale_shape) in header.items():
        if not name.endswith(".weight_scale"):
            continue
        module = name[: -len(".weight_scale")]
        codes = f"{module}.weight"
        if codes not in header:
            raise InputError(f"model source: {excerpt(name, 100)} scales a weight {excerpt(codes, 100)} the "
                             "checkpoint does not hold", fix=_FIX)
        if f"{module}.pre_quant_scale" in header:
            raise InputError(f"model source: {excerpt(module, 100)} has a pre_quant_scale (ModelOpt's AWQ "
                             "variants); llmc decodes ModelOpt FP8 and NVFP4 weights", fix=_PARENT)
        dtype, shape = header[codes]
        if dtype == "F8_E4M3" and len(shape) == 2:
            rows, cols = shape
            blocks = (-(-rows // MODELOPT_FP8_BLOCK[0]), -(-cols // MODELOPT_FP8_BLOCK[1]))
            if math.prod(scale_shape) != 1 and tuple(scale_shape) not in ((rows,), (rows, 1), blocks,
                                                                           (blocks[0], 1, blocks[1], 1)):
                raise InputError(f"model source: {excerpt(name, 100)} has shape {list(scale_shape)}: neither one "
                                 f"scale, one per row ({rows}) nor one per 128x128 tile {list(blocks)} of the "
                                 f"{list(shape)} FP8 weight", fix=_FIX)
            _need(header, name, ("F32", "BF16", "F16"), None, f"ModelOpt FP8 weight {module}")
            out[codes] = Encoded(codes, name, tuple(shape))
            hidden.add(name)
        elif dtype == "U8" and len(shape) == 2 and scale_dtype == "F8_E4M3":
            what = f"ModelOpt NVFP4 weight {module}"
            _need(header, name, ("F8_E4M3",), (shape[0], shape[1] * 2 // 16), what)
            _need(header, f"{module}.weight_scale_2", ("F32", "BF16", "F16"), None, what)
            out[codes] = Encoded(codes, name, (shape[0], shape[1] * 2), (f"{module}.weight_scale_2",))
            hidden |= {name, f"{module}.weight_scale_2"}
        else:
            raise InputError(f"model source: {excerpt(codes, 100)} is {dtype} {list(shape)} with a {scale_dtype} "
                             "weight_scale: not a ModelOpt FP8 or NVFP4 weight (ModelOpt's INT4/INT8 layouts are "
                             "not decoded)", fix=_PARENT)
    return out, hidden


def _gptq_awq_map(fmt: SourceFormat, header: Header) -> tuple[dict[str, Encoded], set[str]]:
    out, hidden = {}, set()
    per = 32 // fmt.bits
    for name, (dtype, shape) in header.items():
        if not name.endswith(".qweight"):
            continue
        module = name[: -len(".qweight")]
        what = f"{fmt.name.upper()} weight {module}"
        _need(header, name, ("I32",), None, what)
        if len(shape) != 2:
            raise InputError(f"model source: {excerpt(name, 100)} is {list(shape)}, not a matrix", fix=_FIX)
        rows_in, cols_out = (shape[0] * per, shape[1]) if fmt.name == "gptq" else (shape[0], shape[1] * per)
        groups = 1 if fmt.group_size < 0 else -(-rows_in // fmt.group_size)
        _need(header, f"{module}.scales", ("F16", "BF16", "F32"), (groups, cols_out), what)
        _need(header, f"{module}.qzeros", ("I32",), (groups, -(-cols_out // per)), what)
        extra = [f"{module}.qzeros"]
        if fmt.name == "gptq" and f"{module}.g_idx" in header:
            _need(header, f"{module}.g_idx", ("I32", "I64"), (rows_in,), what)
            extra.append(f"{module}.g_idx")
        if f"{module}.weight" in header:
            raise InputError(f"model source: {excerpt(module, 100)} holds both a qweight and a weight", fix=_FIX)
        out[f"{module}.weight"] = Encoded(name, f"{module}.scales", (cols_out, rows_in), tuple(extra))
        hidden |= {name, f"{module}.scales", *extra}
    return out, hidden


def decoded_header(fmt: SourceFormat, header: Header) -> Header:
    """The header of the checkpoint as the build reads it: each decoded tensor F32 of its decoded shape, its parts
    gone."""
    decoded, hidden = decoding_map(fmt, header)
    out = {n: v for n, v in header.items() if n not in hidden and n not in decoded}
    out.update({n: ("F32", e.shape) for n, e in decoded.items()})
    return out


# --------------------------------------------------------------------------- decoders

def decode_fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes [..., rows, cols] times their scale (one per `block`, edge blocks partial; None: one per tensor),
    in float32, then rounded once to `dtype`. The scales are expanded over rows only and broadcast over columns
    through a view (no second weight-sized float32 tensor)."""
    out = codes.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block is None:
        return out.mul_(scale.reshape(())).to(dtype)
    rows, cols = out.shape[-2:]
    full, rem = divmod(cols, block[1])
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(scale[..., :full, None])
    if rem:
        out[..., full * block[1]:].mul_(scale[..., full:])
    return out.to(dtype)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                 name: str = "an MXFP4 tensor") -> torch.Tensor:
    """gpt-oss's MXFP4 experts: blocks uint8 [experts, rows, n, 16] (element 2i in the low nibble) and E8M0 scales
    uint8 [experts, rows, n], decoded to [experts, n * 32, rows] (the layout transformers' GptOssExperts holds),
    one expert at a time in float32 and rounded once to `dtype`. A scale of 0xFF (NaN) is refused."""
    if bool((scales == E8M0_NAN).any()):
        raise InputError(f"model source: {name}'s scales hold E8M0 0xFF (NaN); no weight is NaN", fix=_FIX)
    experts, rows, n, _ = blocks.shape
    # each byte's two values looked up at once (twice as fast as unpacking the nibbles, then decoding them)
    pairs = e2m1_decode(unpack_e2m1(torch.arange(256, dtype=torch.uint8).unsqueeze(-1)))  # [256, 2]: low, high
    out = torch.empty(experts, n * 2 * MXFP4_BYTES_PER_BLOCK, rows, dtype=dtype)
    for e in range(experts):
        values = pairs[blocks[e].int()].reshape(rows, n, -1).mul_(e8m0_decode(scales[e]).unsqueeze(-1))
        out[e] = values.reshape(rows, -1).T
    return out


def decode_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group_size: int, zero_offset: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A GPTQ Linear's weight [out, in]: qweight int32 [in * bits / 32, out] (input row j*per + k at bits k*bits of
    word j), qzeros int32 [groups, out * bits / 32] (packed along the output the same way), scales [groups, out],
    g_idx [in] (absent: i // group_size). weight[o, i] = scales[g, o] * (q[i, o] - (z[g, o] + zero_offset)),
    g = g_idx[i], in float32: GPTQModel's torch kernel's formula (v1 checkpoints store the zero point minus one,
    added back unmasked as it adds it)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    q = ((qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(-1, qweight.shape[1])  # [in, out]
    z = ((qzeros.unsqueeze(-1) >> shifts) & mask).reshape(qzeros.shape[0], -1)[:, : q.shape[1]] + zero_offset
    return _scaled_codes(q, z, scales, g_idx, group_size, dtype)


# the bit offset of output column c (within 8) in an AWQ word: nibble k holds column (0 2 4 6 1 3 5 7)[k]
AWQ_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)


def decode_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An AWQ GEMM Linear's weight [out, in]: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], output
    columns interleaved 0 2 4 6 1 3 5 7 in each word's nibbles, scales [groups, out]. weight[o, i] = scales[g, o] *
    (q[i, o] - z[g, o]), g = i // group_size, in float32: AutoAWQ's dequantize_gemm formula."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32)
    q = ((qweight.unsqueeze(-1) >> shifts) & 0xF).reshape(qweight.shape[0], -1)  # [in, out]
    z = ((qzeros.unsqueeze(-1) >> shifts) & 0xF).reshape(qzeros.shape[0], -1)
    return _scaled_codes(q, z, scales, None, group_size, dtype)


def _scaled_codes(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                  group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """scales[g] * (q - z[g]) for codes q [in, out], g = g_idx[i] (None: i // group_size), in float32, transposed
    to [out, in] and rounded once. Groups in input order broadcast over views (no gathered [in, out] copies of the
    zeros and scales: ~2x faster than gathering them)."""
    rows = q.shape[0]
    size = group_size if group_size > 0 else rows
    ordered = g_idx is None or torch.equal(g_idx.long(), torch.arange(rows) // size)
    if ordered and rows % size == 0:
        grouped = q.view(-1, size, q.shape[1])
        w = grouped.sub_(z.unsqueeze(1)).float().mul_(scales.float().unsqueeze(1)).view(rows, -1)
    else:
        g = (torch.arange(rows) // size if g_idx is None else g_idx).long()
        w = q.sub_(z[g]).float().mul_(scales.float()[g])
    return w.t().to(dtype).contiguous()


def decode_modelopt(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ModelOpt weight: FP8 codes times weight_scale (one, one per row, or one per 128x128 tile), or NVFP4 (U8
    two E2M1 codes a byte, low nibble first) times weight_scale (E4M3, one per 16) x weight_scale_2, in float32."""
    if codes.dtype == torch.float8_e4m3fn:
        if scale.numel() == 1 or scale.numel() == codes.shape[0]:
            out = codes.to(torch.float32).mul_(scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float())
            return out.to(dtype)
        blocks = -(-codes.shape[0] // MODELOPT_FP8_BLOCK[0]), -(-codes.shape[1] // MODELOPT_FP8_BLOCK[1])
        return decode_fp8(codes, scale.reshape(blocks), MODELOPT_FP8_BLOCK, dtype)
    values = _E2M1_PAIRS[codes.int()].view(codes.shape[0], -1)  # [out, in]: a byte's two values looked up at once
    block = scale.float().mul_(scale_2.float().reshape(()))  # ModelOpt: per-block scale x per-tensor scale
    return values.view(values.shape[0], -1, 16).mul_(block.unsqueeze(-1)).reshape(values.shape).to(dtype)


_E2M1_PAIRS = e2m1_decode(unpack_e2m1(torch.arange(256, dtype=torch.uint8).unsqueeze(-1)))  # [256, 2]: low, high


_CT_SCHEMES: dict[str, object] = {}  # a config group (as JSON) -> its validated QuantizationScheme


def decode_compressed_tensors(fmt: SourceFormat, encoded: Encoded, parts: dict[str, torch.Tensor],
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One compressed-tensors Linear by compressed-tensors' own decompressor for its group's format (float32 where
    the scale is; a bf16 scale decodes in bf16, as compressed-tensors does). NVFP4: code x (block scale / global
    scale) in float32 (llmc.quant.microscaling), the values compressed-tensors' decompressor gives before it
    rounds them to bf16 (what llmc's own evaluation of NVFP4 artifacts decodes)."""
    from compressed_tensors.compressors import BaseCompressor  # lazy: ~3 s, only for these sources

    module = encoded.codes.rsplit(".", 1)[0]
    state = {n[len(module) + 1:]: t for n, t in parts.items()}
    group = fmt.qc["config_groups"][encoded.group]
    group_format = group.get("format") or fmt.qc.get("format")
    if group_format == "nvfp4-pack-quantized":
        q = BlockQuantized(codes=unpack_e2m1(state["weight_packed"]), scale=state["weight_scale"],
                           global_scale=state["weight_global_scale"].float().reshape(1), format=NVFP4)
        return dequantize_blocks(q).to(dtype)
    if "weight_shape" in state and tuple(state["weight_shape"].tolist()) != encoded.shape:
        raise InputError(f"model source: {excerpt(module, 100)}'s weight_shape is {state['weight_shape'].tolist()}, "
                         f"not the {list(encoded.shape)} its packed words hold (in_features not a whole number of "
                         "int32 words is not decoded)", fix=_PARENT)
    scheme = _ct_scheme(group, group_format)
    return BaseCompressor.get_value_from_registry(group_format).decompress(state, scheme)["weight"].to(dtype)


def _ct_scheme(group: dict, group_format: str):
    """The group's QuantizationScheme, validated once per distinct group."""
    from compressed_tensors.quantization import QuantizationScheme  # lazy: compressed-tensors, its sources only

    spec = {k: v for k, v in group.items() if k != "format"} | {"format": group_format}
    text = json.dumps(spec, sort_keys=True, default=str)
    cached = _CT_SCHEMES.get(text)
    if cached is None:
        cached = _CT_SCHEMES[text] = QuantizationScheme.model_validate(spec)
    return cached


def decode(fmt: SourceFormat, encoded: Encoded, parts: dict[str, torch.Tensor],
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One decoded tensor from its stored parts (keyed by their stored names)."""
    if fmt.name == "mxfp4":
        return decode_mxfp4(parts[encoded.codes], parts[encoded.scale], dtype, encoded.codes)
    if fmt.name == "compressed-tensors":
        return decode_compressed_tensors(fmt, encoded, parts, dtype)
    if fmt.name == "modelopt":
        scale_2 = parts[encoded.extra[0]] if encoded.extra else None
        return decode_modelopt(parts[encoded.codes], parts[encoded.scale], scale_2, dtype)
    if fmt.name == "gptq":
        g_idx = parts[encoded.extra[1]] if len(encoded.extra) > 1 else None
        return decode_gptq(parts[encoded.codes], parts[encoded.extra[0]], parts[encoded.scale], g_idx, fmt.bits,
                           fmt.group_size, fmt.zero_offset, dtype)
    if fmt.name == "awq":
        return decode_awq(parts[encoded.codes], parts[encoded.extra[0]], parts[encoded.scale], fmt.group_size, dtype)
    return decode_fp8(parts[encoded.codes], parts[encoded.scale], fmt.block, dtype)


# --------------------------------------------------------------------------- codes kept as they are

def fp8_strategy(fmt: SourceFormat, encoded: Encoded, codes: torch.Tensor, scale: torch.Tensor) -> str | None:
    """The FP8 scheme strategy ('tensor', 'channel', 'block' of 128x128) a decoded tensor's stored codes and scale
    already are, so a target of that strategy can keep them; None where they are not plain FP8 E4M3 codes times
    one float scale (zero points, a global scale, another block)."""
    if codes.dtype != torch.float8_e4m3fn or encoded.extra and fmt.name != "compressed-tensors":
        return None
    if fmt.name == "fp8-block":
        return "block" if fmt.block == BLOCK_SHAPE else None
    if fmt.name == "fp8-tensor":
        return "tensor"
    if fmt.name == "compressed-tensors":
        weights = fmt.qc["config_groups"][encoded.group].get("weights") or {}
        strategy = weights.get("strategy")
        plain = (weights.get("type") == "float" and weights.get("num_bits") == 8 and weights.get("symmetric", True)
                 and not encoded.extra)
        block = strategy != "block" or tuple(weights.get("block_structure") or ()) == BLOCK_SHAPE
        return strategy if plain and block and strategy in ("tensor", "channel", "block") else None
    if fmt.name == "modelopt":
        if scale.numel() == 1:
            return "tensor"
        return "channel" if scale.numel() == codes.shape[0] and scale.shape[-1] in (1, codes.shape[0]) else "block"
    return None


def canonical_fp8_scale(scale: torch.Tensor, strategy: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A stored FP8 scale in llmc's canonical shape (llmc.quant.numerics.QuantizedWeight), float32."""
    if strategy == "tensor":
        return scale.float().reshape(1)
    if strategy == "channel":
        return scale.float().reshape(shape[0], 1)
    return scale.float().reshape(-(-shape[0] // BLOCK_SHAPE[0]), -(-shape[1] // BLOCK_SHAPE[1]))


# --------------------------------------------------------------------------- the plan's decode time

DECODE_PROBE_SHAPE = (1024, 2048)  # one probe call decodes 2M elements (~0.1 s at the slowest format)


def decode_rate(fmt: SourceFormat) -> float:
    """Decoded elements per second of `fmt`'s decoder on this machine (probed: llmc.planning.probes, cached per
    machine), one Linear of DECODE_PROBE_SHAPE at a time in float32 as the layer stream decodes them."""
    from llmc.planning import probes  # lazy: only a plan that costs the decode

    key = f"source decode {fmt.name} {fmt.variant or ''} {fmt.bits or ''}".strip()
    return probes.rate(key, lambda: _decode_probe(fmt))


def _decode_probe(fmt: SourceFormat) -> float:
    from llmc.planning.probes import sustained_rate  # lazy: as above

    rows, cols = DECODE_PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    if fmt.name in ("gptq", "awq", "compressed-tensors") and (fmt.bits or "pack-quantized" in fmt.variant):
        bits = fmt.bits or 4
        words = torch.randint(-2**31, 2**31 - 1, (cols * bits // 32, rows), generator=g, dtype=torch.int32)
        zeros = torch.randint(-2**31, 2**31 - 1, (cols // 128, rows * bits // 32), generator=g, dtype=torch.int32)
        scales = torch.rand(cols // 128, rows, generator=g).half()
        call = lambda: decode_gptq(words, zeros, scales, None, bits, 128)  # noqa: E731 - the same unpack-and-scale
    elif fmt.name in ("mxfp4",) or "nvfp4" in fmt.variant.lower():
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
        scale = torch.rand(rows, cols // 16, generator=g).to(torch.float8_e4m3fn)
        call = lambda: decode_modelopt(packed, scale, torch.tensor(0.01))  # noqa: E731
    else:
        codes = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn)
        call = lambda: decode_fp8(codes, torch.rand(rows // 128, cols // 128, generator=g), (128, 128))  # noqa: E731
    return sustained_rate(rows * cols, call)
