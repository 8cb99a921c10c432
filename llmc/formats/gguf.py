"""Export the canonical quantized form as a GGUF file plus an Ollama Modelfile (llama.cpp, Ollama).

Written with the `gguf` library's GGUFWriter, streaming: tensor infos come from the files' headers,
then each canonical file (one decoder layer) is converted and appended, so peak memory is one layer.

Type mapping (GGUF block formats hold 32 weights along the input dimension with one fp16 scale):

    canonical weights                       GGUF      how
    int8 symmetric, per-tensor/channel or   Q8_0      codes copied, block scale = the canonical scale in fp16
      group with group % 32 == 0
    int4 symmetric, same granularities      Q4_0      nibble = code + 8, block scale = canonical scale in fp16
    int4 asymmetric, same granularities     Q4_1      nibble = code + 8, d = scale, m = -(zero_point + 8) * scale
    any other int8 / int4 grid              Q8_0/Q4_0/Q4_1, requantized in blocks of 32 from the dequantized
      (group not a multiple of 32,            canonical weights with gguf.quants (adds rounding error; reported)
      asymmetric int8)
    mxfp4 (E2M1, E8M0 per 32)               MXFP4     codes and exponents repacked into ggml's blocks, exact
    nvfp4 (E2M1, E4M3 per 16, FP32 global)  NVFP4     codes and E4M3 scales repacked (64-element blocks), exact;
                                                      the global scale as the F32 tensor `<name>.scale` (its
                                                      reciprocal, ModelOpt's multiplier), which llama.cpp
                                                      multiplies each matmul's output by
    fp8, mxfp8, block-wise fp8              refused: llama.cpp has no such weight type here
    norms, biases                           F32 (exact)
    token_embd / untied output              F16 by default (the lm_head is left unquantized by the scheme and a
                                            tied lm_head *is* token_embd in llama.cpp), or Q8_0 / F32 on request

Re-packing the codes is exact except for rounding each scale to fp16 (relative error <= 2^-11, well below
the quantization step); requantizing from dequantized weights instead would add up to half a Q-step of
fresh rounding per weight. Every written block is decoded again with gguf.quants and the added error
against the canonical dequantized weights is measured, logged and stored in llmc-serve.json; the type
plan itself is in the GGUF's `llmc.*` metadata.

A mixed-precision scheme (`Scheme.groups`) gets each group's type plan, per tensor (GGUF types every tensor on its
own, as llama-quantize's mixes do): e.g. attention W8A16-INT8 -> Q8_0 and MLP W4A16-MXFP4 -> MXFP4 in one file; the
file type and the headline plan are the group with the fewest weight bits. A group whose scheme has no GGUF type
(FP8) is refused at plan time, as a plain scheme is.

Llama's q_proj/k_proj rows are permuted the way llama.cpp's convert_hf_to_gguf.py does (Hugging Face
keeps each head's rotary pairs as [first half | second half]; llama.cpp's rotary kernel wants them
interleaved). Row permutation commutes with row-blocked quantization, so codes and scales permute alike.

Mixture-of-Experts (llmc.formats.gguf_arch: Mixtral, Qwen2/3-MoE, DeepSeek-V3, GLM-4.5, MiniMax-M2, gpt-oss,
Qwen3-Next, Qwen3.5-MoE, Llama-4 text): llama.cpp
holds a layer's experts as one 3-D tensor per projection (`ffn_{gate,up,down}_exps`, [E, rows, cols]); each expert's
canonical tensor is converted as above and the E results stacked in expert order, so every expert's codes and scales
are copied as a dense Linear's are. Routers (and Qwen2-MoE's shared-expert gate) stay F32 as convert_hf_to_gguf.py
keeps them; DeepSeek's `e_score_correction_bias` is `exp_probs_b.bias`. The per-architecture keys (expert counts,
shared experts, leading dense layers, gating function, MLA ranks) are `FAMILY_KEYS` rows, the head widths `HEADS`
rows. DeepSeek-V3's MLA is written in the decompressed form llama.cpp still runs for deepseek2 (`attn_kv_b`, no
key_length_mla). DeepSeek-V3.2 (deepseek32, whose loader requires the absorbed form) gets it: kv_b_proj's rows split
into `attn_v_b` (each head's value rows, codes copied) and `attn_k_b` (each head's key rows transposed, F16 from the
dequantized weights: its rows cross the canonical scales), one latent KV head, key_length_mla / value_length_mla, and
the lightning indexer's tensors and keys (`ROW_SPLITS`, `PER_HEAD`, `HEADS`, `FAMILY_KEYS` rows).

gpt-oss: biased experts and router (F32, merged like the weights), attention sinks (`attn_sinks.weight`), the sliding
layers as a per-layer pattern, YaRN keys (ggml rounds YaRN's correction range; a truncate=false config is said in the
notes). Gated-DeltaNet linear attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) as convert_hf_to_gguf.py writes it, each
fact a table row: `ROW_SPLITS` (Qwen3-Next's in_proj_qkvz rows into attn_qkv + attn_gate; Qwen3.5's value heads from
grouped to tiled order), `COLUMN_ORDERS` (Qwen3.5's out_proj), `TENSOR_TRANSFORMS` (A = -exp(A_log), the conv kernel
[C, 1, K] -> [C, K]); rows and columns move codes and scales together, so the quantized values are copied exactly.

Activations: llama.cpp quantizes activations itself (dynamic, blocks of 32) for Q8_0/Q4 matmuls, so a
W8A8 scheme's activation settings are not carried. FP4 weights of a weight-only scheme are listed with
`general.tensor_extra.prec_a4` false: llama.cpp's CUDA build on Blackwell otherwise quantizes their activations to
FP4 (as convert_hf_to_gguf.py marks ModelOpt's W4A16_NVFP4 layers); a KV-cache scheme maps to llama.cpp's runtime
`--cache-type-k/v q8_0` option (noted in llmc-serve.json), fp8 KV is refused.

Gemma-4 text (conversion/gemma.py Gemma4Model): the per-layer input embeddings (`per_layer_token_embd`,
`per_layer_model_proj`, each layer's `inp_gate`/`proj`/`post_norm`), the sliding layers' head width as
`key_length_swa` beside the full layers' `key_length`, their own KV heads (attention_k_eq_v: a per-layer
`head_count_kv`, no v_proj: llama.cpp takes V from K as transformers does), the KV-shared trailing layers
(`shared_kv_layers`, no k/v tensors; `_gemma4_kv_sharers` checks they read the layers llama.cpp's reuse rule reads),
double-wide MLPs as a per-layer `feed_forward_length`, the full layers' proportional rope as the `rope_freqs` tensor
(ROPE_FREQS). Its MoE variant: each layer's experts as one `ffn_gate_up_exps` (gate rows, then up rows, per expert:
GATE_UP_EXPERTS) and `ffn_down_exps`, the router's input scale and per-expert output scales under the names
src/models/gemma4.cpp loads (DIRECT_NAMES), beside the dense MLP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from llmc import __version__

from llmc.formats.base import ArtifactFormat, ExportRequest, ExportWork, WrittenTensors, target_key
from llmc.formats.registry import register_format
from llmc.telemetry import events
from llmc.formats.files import SERVE_FILE
from llmc.formats.gguf_arch import (GGUF_FAMILIES, GGUF_PACKAGE_GAPS, GGUF_REFUSED, MOE_MODEL_TYPES, GgufFamily,
                                    fixed_fact_violations, unwritten_violations)
from llmc.formats.microscaling_export import gguf_mxfp4_blocks, gguf_nvfp4_blocks
from llmc.errors import IncompatibleTargetError, InputError
from llmc.telemetry.progress import log
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import MICROSCALING_FORMATS, BlockQuantized, modelopt_weight_scale_2
from llmc.model.families import expert_count, experts_per_token, kept_in_dtype
from llmc.planning import probes
from llmc.planning.rows import CostRow
from llmc.planning.target import host_work_seconds
from llmc.quant.numerics import quantize_weight
from llmc.model.shape_rows import layer_attention
from llmc.quant.spec import Scheme, TensorSpec, probe_text
from llmc.storage.store import atomic_write_json, atomic_write_text, fsync_dir, resource_errors

GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"
BLOCK = 32  # Q8_0 / Q4_0 / Q4_1 block size
EMBEDDING_TYPES = ("f16", "q8_0", "f32")
GGUF_OPTIONS = {"embedding_type": "f16", "requantize": False}  # what `llmc build` uses (part of its cache key)


SUPPORTED_MODEL_TYPES = tuple(GGUF_FAMILIES)
_CANONICAL_EXTRAS = (".weight_scale", ".weight_zero_point", ".input_scale", ".k_scale", ".v_scale",
                     ".weight_global_scale", ".input_global_scale")
TENSOR_SCALE_SUFFIX = ".scale"  # llama.cpp's per-tensor scale of `<name>.weight`: `<name>.scale` (F32 [1])
PREC_A4_KEYS = ("general.tensor_extra.name", "general.tensor_extra.prec_a4")  # llama.cpp's per-tensor A4 switch


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a core dependency
        raise InputError("the GGUF exporter needs the `gguf` package", fix="pip install gguf") from None
    return gguf


# --------------------------------------------------------------------------- q/k permutation


def llama_permute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection (or its scales, codes, bias) from HF's rotary layout to llama.cpp's.

    Within each head the rows [x_0..x_{d/2-1} | y_0..y_{d/2-1}] become [x_0, y_0, x_1, y_1, ...].
    `n_head` is the number of heads the rows hold: attention heads for q, KV heads for k.
    """
    rows = t.shape[0]
    if rows % (2 * n_head):
        raise InputError(f"cannot permute {rows} rows into {n_head} rotary heads")
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def llama_unpermute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `llama_permute`."""
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# --------------------------------------------------------------------------- block packing


def _block_scales(scale: torch.Tensor, shape: tuple[int, int], spec: TensorSpec) -> np.ndarray:
    """The canonical scale (or zero point) of every 32-block: [rows, cols // 32]."""
    rows, cols = shape
    nb = cols // BLOCK
    s = scale.reshape(scale.shape[0] if scale.dim() > 1 else 1, -1)
    if spec.strategy == "group":
        s = s.repeat_interleave(spec.group_size // BLOCK, dim=1)
    return s.expand(rows, nb).numpy() if s.shape != (rows, nb) else s.numpy()


def _fp16(x: np.ndarray, what: str) -> np.ndarray:
    h = x.astype(np.float16)
    if not np.isfinite(h).all():
        raise InputError(f"{what}: a block scale does not fit fp16 (|scale| > 65504); GGUF blocks store fp16 scales")
    return h


def pack_q8_0(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int8 codes [rows, cols] with one scale per 32-block [rows, cols//32] -> Q8_0 bytes [rows, cols//32*34]."""
    rows, cols = codes.shape
    nb = cols // BLOCK
    out = np.empty((rows, nb, 2 + BLOCK), dtype=np.uint8)
    out[..., :2] = _fp16(scales, "Q8_0").reshape(rows, nb, 1).view(np.uint8)
    out[..., 2:] = codes.astype(np.int8).reshape(rows, nb, BLOCK).view(np.uint8)
    return out.reshape(rows, nb * (2 + BLOCK))


def _nibbles(codes: np.ndarray) -> np.ndarray:
    rows, cols = codes.shape
    nib = (codes.astype(np.int16) + 8).astype(np.uint8).reshape(rows, cols // BLOCK, BLOCK)
    return nib[..., : BLOCK // 2] | (nib[..., BLOCK // 2 :] << np.uint8(4))


def pack_q4_0(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Signed int4 codes in [-8, 7] -> Q4_0 (value = (nibble - 8) * d), 18 bytes per block."""
    rows, cols = codes.shape
    nb = cols // BLOCK
    out = np.empty((rows, nb, 2 + BLOCK // 2), dtype=np.uint8)
    out[..., :2] = _fp16(scales, "Q4_0").reshape(rows, nb, 1).view(np.uint8)
    out[..., 2:] = _nibbles(codes)
    return out.reshape(rows, -1)


def pack_q4_1(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> np.ndarray:
    """Asymmetric int4 ((code - zp) * s, codes and zp signed) -> Q4_1 (value = nibble * d + m), 20 bytes/block."""
    rows, cols = codes.shape
    nb = cols // BLOCK
    out = np.empty((rows, nb, 4 + BLOCK // 2), dtype=np.uint8)
    out[..., :2] = _fp16(scales, "Q4_1").reshape(rows, nb, 1).view(np.uint8)
    m = -(zero_points.astype(np.float32) + 8.0) * scales
    out[..., 2:4] = _fp16(m, "Q4_1").reshape(rows, nb, 1).view(np.uint8)
    out[..., 4:] = _nibbles(codes)
    return out.reshape(rows, -1)


# --------------------------------------------------------------------------- microscaling block types


@dataclass(frozen=True)
class MicroscalingGguf:
    """How one of llmc's microscaling weight formats is written as a ggml block type, from its codes and scales."""

    ggml_type: str  # GGMLQuantizationType name
    file_type: str  # LlamaFileType name (general.file_type: descriptive, llama.cpp reads the tensors' types)
    row_multiple: int  # elements per ggml block: an input width must be a multiple of it
    # BlockQuantized [rows, cols] -> (block bytes [rows, cols / row_multiple * bytes], per-tensor `.scale` or None)
    blocks: Callable[[BlockQuantized], tuple[np.ndarray, np.ndarray | None]]


def _mxfp4_blocks(q: BlockQuantized) -> tuple[np.ndarray, None]:
    return gguf_mxfp4_blocks(q), None  # MX has no per-tensor scale


# ggml-common.h's block_mxfp4 (32 elements) and block_nvfp4 (64: four NVFP4 blocks of 16). MOSTLY_MXFP4_MOE is
# llama.cpp's only MXFP4 file type (gpt-oss's); llama.cpp loads a tensor by its own type whatever general.file_type.
MICROSCALING_GGUF: dict[str, MicroscalingGguf] = {
    "mxfp4": MicroscalingGguf("MXFP4", "MOSTLY_MXFP4_MOE", 32, _mxfp4_blocks),
    "nvfp4": MicroscalingGguf("NVFP4", "MOSTLY_NVFP4", 64, gguf_nvfp4_blocks),
}
_FP4_TYPES = {m.ggml_type: fmt for fmt, m in MICROSCALING_GGUF.items()}


# --------------------------------------------------------------------------- the type plan


@dataclass(frozen=True)
class TypePlan:
    """What the scheme's weights become in GGUF, and how."""

    weight_type: str  # GGMLQuantizationType name: Q8_0, Q4_0, Q4_1
    method: str  # "repacked" (codes copied, scales to fp16) or "requantized" (from dequantized weights)
    file_type: str  # LlamaFileType name
    embedding_type: str  # F16, Q8_0, F32
    reason: str
    row_multiple: int = BLOCK  # a quantized weight's input width must be a multiple of this (else F16)

    def describe(self) -> str:
        return f"linear weights {self.weight_type} ({self.method}: {self.reason}); embeddings {self.embedding_type}"


def type_plan(spec: TensorSpec, embedding_type: str = "f16", requantize: bool = False) -> TypePlan:
    fp4 = MICROSCALING_GGUF.get(spec.format) if spec.strategy == "group" else None
    if spec.format not in ("int8", "int4") and fp4 is None:
        raise IncompatibleTargetError(
            f"GGUF has no {spec.format} weight type that llama.cpp runs; llama.cpp/Ollama cannot take this scheme",
            fix="quantize for llama.cpp/Ollama with int8 (W8A16-INT8 -> Q8_0), int4 (W4A16 -> Q4_0/Q4_1), "
                "mxfp4 or nvfp4 weights",
        )
    if embedding_type not in EMBEDDING_TYPES:
        raise InputError(f"unknown GGUF embedding type {embedding_type!r}", fix=f"use one of {EMBEDDING_TYPES}")
    if fp4 is not None:
        if requantize:
            raise InputError(f"requantize applies to the integer GGUF types; {spec.format} weights are written "
                             f"from llmc's own codes and scales", fix="leave requantize off")
        why = f"{spec.format} codes and block scales copied into ggml's {fp4.ggml_type} blocks of {fp4.row_multiple}"
        if fp4.ggml_type == "NVFP4":
            why += "; global scale as each weight's F32 `.scale`"
        return TypePlan(fp4.ggml_type, "repacked", fp4.file_type, embedding_type.upper(), why, fp4.row_multiple)
    aligned = spec.strategy in ("tensor", "channel") or (spec.strategy == "group" and spec.group_size % BLOCK == 0)
    if spec.format == "int8":
        wtype, ftype = "Q8_0", "MOSTLY_Q8_0"
        repack = spec.symmetric and aligned
        why = ("per-" + spec.strategy if spec.strategy != "group" else f"group {spec.group_size}") + " int8 grid"
        if not spec.symmetric:
            why = "Q8_0 has no zero point; asymmetric int8 requantized"
    else:
        wtype, ftype = ("Q4_0", "MOSTLY_Q4_0") if spec.symmetric else ("Q4_1", "MOSTLY_Q4_1")
        repack = aligned
        why = f"int4 {'group ' + str(spec.group_size) if spec.strategy == 'group' else spec.strategy} grid"
        if spec.strategy == "group" and not aligned:
            why = f"canonical group size {spec.group_size} differs from GGUF's blocks of {BLOCK}: requantized"
    if repack and requantize:
        why += "; requantization forced"
    elif repack:
        why += f" fits {wtype} blocks of {BLOCK} exactly"
    elif "requantized" not in why:
        why += f" does not fit {wtype} blocks of {BLOCK}: requantized from the dequantized weights"
    method = "repacked" if repack and not requantize else "requantized"
    return TypePlan(wtype, method, ftype, embedding_type.upper(), why)


# --------------------------------------------------------------------------- model metadata


@dataclass
class _Arch:
    n_layers: int
    hidden: int
    n_head: int
    n_head_kv: int | list[int]  # attention.head_count_kv: per layer where layers differ (Gemma-4's full layers)
    head_dim: int
    ffn: int | list[int]  # feed_forward_length: per layer where layers differ (Gemma-4's double-wide MLPs)
    ctx: int
    rope_theta: float
    rms_eps: float
    vocab: int
    tied: bool
    rope_scaling: tuple[str, float] | None
    family: GgufFamily
    config: dict
    rope: dict = field(default_factory=dict)  # the rope parameters (rope_parameters with rope_scaling over them)
    value_dim: int = 0  # attention.value_length (0: head_dim)
    rope_dim: int = 0  # rope.dimension_count (0: head_dim)

    @property
    def gguf_arch(self):
        """The gguf package's MODEL_ARCH member whose tensor-name table this architecture uses (its own, or the
        stand-in GGUF_PACKAGE_GAPS names while the package lacks it)."""
        gguf = _gguf()
        if not hasattr(gguf.MODEL_ARCH, self.family.arch) and self.family.arch in GGUF_PACKAGE_GAPS:
            return gguf.MODEL_ARCH[GGUF_PACKAGE_GAPS[self.family.arch][1]]
        return gguf.MODEL_ARCH[self.family.arch]

    @property
    def arch_name(self) -> str:
        """llama.cpp's name of the architecture (general.architecture, the prefix of its keys)."""
        gguf = _gguf()
        if not hasattr(gguf.MODEL_ARCH, self.family.arch) and self.family.arch in GGUF_PACKAGE_GAPS:
            return GGUF_PACKAGE_GAPS[self.family.arch][0]
        return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[self.family.arch]]

    def tensor_names(self):
        """The gguf package's Hugging Face -> llama.cpp tensor-name table for this architecture."""
        return _gguf().get_tensor_name_map(self.gguf_arch, self.n_layers)


def _arch(config: dict) -> _Arch:
    mt = config.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        why = f": {GGUF_REFUSED[mt]}" if mt in GGUF_REFUSED else ""
        raise IncompatibleTargetError(
            f"the GGUF exporter writes the families {', '.join(SUPPORTED_MODEL_TYPES)}; this model is {mt!r}{why}",
            fix="target a compressed-tensors runtime (vllm, sglang, tgi) for this architecture",
        )
    if violations := fixed_fact_violations(config):
        raise IncompatibleTargetError(
            f"llama.cpp's {GGUF_FAMILIES[mt].arch.lower()} graph would compute this {mt} model differently: "
            + "; ".join(violations), fix="target a compressed-tensors runtime (vllm, sglang) for this model")
    if unwritten := unwritten_violations(config):
        raise IncompatibleTargetError(
            f"llama.cpp has the {GGUF_FAMILIES[mt].arch.lower()} architecture, but llmc's GGUF exporter does not write "
            "this model: " + "; ".join(unwritten),
            fix="target a compressed-tensors runtime (vllm, sglang) for this model")
    if config.get("mlp_bias"):
        raise IncompatibleTargetError("the GGUF exporter does not write MLP biases (mlp_bias=true)")
    family = GGUF_FAMILIES[mt]
    rope = dict(config.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): llama.cpp's base is the global one
        rope = dict(rope["full_attention"])
    scaling = config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default"
    factor = scaling.get("factor", rope.get("factor"))
    if rope_type == "proportional" and family.arch in ROPE_FREQS:  # the rope_freqs tensor carries it (ARCH_CHECKS)
        rope_type, factor = "default", None
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise IncompatibleTargetError(
            f"rope scaling type {rope_type!r} is not written by llmc's GGUF exporter yet (default, linear, llama3 and "
            "yarn are)", fix="target a compressed-tensors runtime for this model",
        )
    if rope_type == "yarn" and (unread := yarn_unread({**rope, **scaling})):
        raise IncompatibleTargetError(
            "llama.cpp's YaRN would compute this model's rotary embedding differently: " + "; ".join(unread),
            fix="target a compressed-tensors runtime (vllm, sglang) for this model")
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    k_dim, v_dim, rope_dim, n_head_kv = HEADS.get(family.arch, _plain_heads)(config, head_dim, rope)
    for archs, check in ARCH_CHECKS:
        if family.arch in archs and (why := check(config, k_dim)):
            raise IncompatibleTargetError(f"llama.cpp cannot run this {mt} model: {why}",
                                          fix="target a compressed-tensors runtime (vllm, sglang) for this model")
    return _Arch(
        n_layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=k_dim,
        value_dim=v_dim,
        rope_dim=rope_dim,
        ffn=(FFN_WIDTHS[family.arch](config) if family.arch in FFN_WIDTHS
             else config[FFN_WIDTH_KEY.get(family.arch, "intermediate_size")]),
        ctx=config.get("max_position_embeddings", 2048),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=(rope_type, float(factor or 1.0)) if rope_type in ("linear", "llama3", "yarn") else None,
        family=family,
        config=config,
        rope={**rope, **scaling},
    )


# YaRN as llama.cpp computes it (src/llama-context.cpp, src/llama-hparams.h): beta_fast 32 and beta_slow 1 fixed (no
# architecture llmc writes reads them from the file), the attention factor computed from the factor alone (0.1 ln
# factor + 1, transformers' default); (parameter, the value llama.cpp computes with, transformers' default)
YARN_FIXED: tuple[tuple[str, object, object], ...] = (
    ("beta_fast", 32.0, 32.0),
    ("beta_slow", 1.0, 1.0),
    ("attention_factor", None, None),
    ("mscale", None, None),
    ("mscale_all_dim", None, None),
)


def yarn_unread(rope: dict) -> list[str]:
    """The YaRN parameters of this config that llama.cpp would not compute with, one line each."""
    return [f"{key} = {rope.get(key, default)!r}, llama.cpp computes with {want!r}"
            for key, want, default in YARN_FIXED if rope.get(key, default) != want]


def yarn_notes(arch: _Arch) -> list[str]:
    """What llama.cpp's YaRN rounds that transformers' does not (said, not refused: llama.cpp's own converter
    writes gpt-oss this way)."""
    if arch.rope_scaling is None or arch.rope_scaling[0] != "yarn" or arch.rope.get("truncate", True):
        return []
    return ["YaRN: the config says truncate=false, but ggml rounds the correction range to whole dimensions "
            "(ggml_rope_yarn_corr_dims: floor/ceil), as transformers does with truncate=true: the rotary frequencies "
            "inside that range differ slightly from the torch model's"]


def _mrope_sections(c: dict) -> list[int]:
    """Qwen3.5's multimodal rope sections as llama.cpp reads them (four; conversion/qwen.py's default)."""
    return [*(c.get("rope_parameters") or {}).get("mrope_section", [11, 11, 10]), 0][:4]


def _mrope_sections_fit(c: dict, head_dim: int) -> str | None:
    sections = _mrope_sections(c)
    if sum(sections) <= head_dim:
        return None
    return (f"its rope sections {sections} (rope_parameters.mrope_section) add up to {sum(sections)} > the head width "
            f"{head_dim}, which ggml's multi-section rope asserts against (ggml-cpu/ops.cpp: sect_dims <= ne0)")


def _llama4_layers(c: dict, head_dim: int) -> str | None:
    """llama.cpp's llama4 graph: no rope on every 4th layer (n_no_rope_layer_step), q/k L2-normed unless the model
    has 128 experts (use_kq_norm), chunked attention on the others (load_swa_pattern's 3 chunked, 1 full)."""
    n = c["num_hidden_layers"]
    if n < 4:  # measured: llama.cpp 0.3.36 aborts in the first decode (ggml-backend.cpp: "tensor buffer not set")
        return (f"{n} layers: llama.cpp's llama4 graph builds the attention-temperature input of its no-rope layers "
                "(every 4th) and aborts when there is none")
    want = [int((i + 1) % 4 != 0) for i in range(n)]
    if (got := c.get("no_rope_layers") or want) != want:
        return f"no_rope_layers = {got}, but llama.cpp skips rope on every 4th layer ({want})"
    if bool(c.get("use_qk_norm", True)) != (c.get("num_local_experts") != 128):
        return (f"use_qk_norm = {c.get('use_qk_norm')}, but llama.cpp L2-normalises q/k exactly when the model does "
                "not have 128 experts (src/models/llama4.cpp use_kq_norm)")
    return None


def _gemma4_layer_values(c: dict, key: str) -> list[int]:
    return layer_attention(c, key)  # llmc.model.shape_rows: as transformers' Gemma4TextConfig resolves it


def _gemma4_full(c: dict, key: str) -> int:
    """The full-attention layers' `key` (_gemma4_checks refuses full layers that differ among themselves)."""
    values = _gemma4_layer_values(c, key)
    return int(next(v for v, t in zip(values, c["layer_types"]) if t == "full_attention"))


def _gemma4_heads(c: dict, head_dim: int, rope: dict) -> tuple[int, int, int, int | list[int]]:
    """llama.cpp's gemma4 keys: key/value length = the full layers' head width (rope over all of it, the unrotated
    dims given rope_freqs 1e30), the sliding layers' own width as *_length_swa (FAMILY_KEYS); the KV heads per layer
    where the full layers have their own (attention_k_eq_v: num_global_key_value_heads, as conversion/gemma.py
    writes the array)."""
    del head_dim, rope
    full = _gemma4_full(c, "head_dim")
    kv = _gemma4_layer_values(c, "num_key_value_heads")
    return full, full, full, kv[0] if len(set(kv)) == 1 else kv


def _gemma4_kv_sharers(c: dict) -> str | None:
    """llama.cpp's KV-shared layers (src/llama-model.cpp, the gemma4 reuse callback) read the cache of layer
    n_layer_kv_from_start - 2 (sliding) or - 1 (full); transformers' read the last unshared layer of their type."""
    n, shared, types = c["num_hidden_layers"], int(c.get("num_kv_shared_layers") or 0), c["layer_types"]
    if not shared:
        return None
    first = n - shared
    last = {t: max((i for i in range(first) if types[i] == t), default=-1) for t in set(types)}
    want = {"sliding_attention": first - 2, "full_attention": first - 1}
    if any(last.get(t, -1) != i for t, i in want.items()) or set(types) - set(want):
        return (f"num_kv_shared_layers = {shared}: its shared layers read the KV of layers {last}, but llama.cpp "
                f"reads layer {first - 2} (sliding) and {first - 1} (full)")
    return None


def _gemma4_layers(c: dict, head_dim: int) -> str | None:
    """What llama.cpp's gemma4 graph (src/models/gemma4.cpp) fixes that this config could say otherwise."""
    del head_dim
    rope = c.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    types = c["layer_types"]
    checks = [
        (c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
         f"hidden_activation = {c.get('hidden_activation')!r}, but llama.cpp's gelu is the tanh approximation"),
        (bool(c.get("attention_bias")), "attention_bias = True, but llama.cpp's gemma4 has no attention biases"),
        (c.get("use_bidirectional_attention") == "all",
         "use_bidirectional_attention = 'all', but llama.cpp runs the text causally"),
        (bool(c.get("hidden_size_per_layer_input")) and c.get("vocab_size_per_layer_input") != c["vocab_size"],
         f"vocab_size_per_layer_input = {c.get('vocab_size_per_layer_input')}, but llama.cpp's per_layer_token_embd "
         f"has vocab_size ({c['vocab_size']}) rows"),
        (sliding.get("rope_type", "default") != "default",
         f"the sliding layers' rope_type = {sliding.get('rope_type')!r}; llama.cpp runs plain rope there"),
        (full.get("rope_type", "default") not in ("default", "proportional") or float(full.get("factor", 1.0)) != 1.0,
         f"the full layers' rope {full.get('rope_type')!r} (factor {full.get('factor', 1.0)}); llama.cpp's gemma4 "
         "takes proportional rope as the rope_freqs tensor, factor 1"),
        (any(v != c.get("head_dim") for v, t in zip(_gemma4_layer_values(c, "head_dim"), types)
             if t == "sliding_attention"), "a sliding layer's head_dim differs from head_dim (key_length_swa)"),
        (len({v for v, t in zip(_gemma4_layer_values(c, "head_dim"), types) if t == "full_attention"}) > 1,
         "the full layers' head widths differ (llama.cpp reads one key_length)"),
        (any(v != (c.get("num_key_value_heads") or c["num_attention_heads"])
             for v, t in zip(_gemma4_layer_values(c, "num_key_value_heads"), types) if t == "sliding_attention"),
         "a sliding layer's KV head count differs from num_key_value_heads"),
        (len({v for v, t in zip(_gemma4_layer_values(c, "num_key_value_heads"), types) if t == "full_attention"}) > 1,
         "the full layers' KV head counts differ"),
    ]
    why = [w for bad, w in checks if bad]
    if kv := _gemma4_kv_sharers(c):
        why.append(kv)
    return "; ".join(why) or None


def _smollm3_layers(c: dict, head_dim: int) -> str | None:
    """llama.cpp's smollm3 graph skips rope on every 4th layer whatever the file says (src/models/smollm3.cpp:
    n_no_rope_layer_step = 4); transformers' SmolLM3 reads no_rope_layers (1: rope), every 4th 0 by default."""
    del head_dim
    want = [int((i + 1) % 4 != 0) for i in range(c["num_hidden_layers"])]
    if (got := list(c.get("no_rope_layers") or want)) != want:
        return f"no_rope_layers = {got}, but llama.cpp skips rope on every 4th layer ({want})"
    return None


def _rope_type(c: dict) -> str:
    """The rope scaling type transformers applies (the full layers' where rope_parameters is per layer type)."""
    rope = c.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    scaling = c.get("rope_scaling") or {}
    return scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default"


def _no_rope_factors(c: dict, head_dim: int) -> str | None:
    """src/models/smollm3.cpp, seed-oss.cpp, olmo2.cpp rope with no frequency factors (ggml_rope_ext(..., nullptr,
    ...)) and their loaders create no rope_freqs tensor: Llama-3.1's rope scaling cannot be given to them."""
    del head_dim
    if (rope_type := _rope_type(c)) == "llama3":
        return (f"rope_type = {rope_type!r}: its graph applies no rope frequency factors (the rope_freqs tensor "
                "Llama-3.1's scaling is written as)")
    return None


def _sliding_pattern(c: dict) -> list[bool] | None:
    """Which layers slide, where the config has a sliding window (as conversion/olmo.py, exaone.py write it)."""
    return _sliding_layers(c) if c.get("sliding_window") else None


def _olmo3_layers(c: dict, head_dim: int) -> str | None:
    """src/models/olmo2.cpp: the sliding layers run plain rope at rope_freq_base_swa (no scaling), whatever the
    config's sliding_attention rope says."""
    del head_dim
    sliding = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
    if c.get("sliding_window") and sliding.get("rope_type", "default") != "default":
        return (f"the sliding layers' rope_type = {sliding['rope_type']!r}; llama.cpp's olmo2 runs plain rope there "
                "(src/models/olmo2.cpp: freq_scale 1, ext_factor 0 on sliding layers)")
    return None


EXAONE4_SWA_LAYERS = 64  # src/models/exaone4.cpp: swa_type STANDARD only `if (hparams.n_layer() == 64)`


def _exaone4_layers(c: dict, head_dim: int) -> str | None:
    """llama.cpp's exaone4 runs sliding-window layers (rope on them, none on the full ones) only in a 64-layer model
    (EXAONE 4.0 32B), and then always; any other model it runs with every layer full and roped, as transformers runs
    a model without sliding_window."""
    n, sliding = c["num_hidden_layers"], bool(c.get("sliding_window"))
    slides = sliding and "sliding_attention" in (c.get("layer_types") or [])
    if slides and n != EXAONE4_SWA_LAYERS:
        return (f"sliding_window = {c['sliding_window']} with sliding layers in a {n}-layer model, but llama.cpp runs "
                f"sliding-window attention only when the model has {EXAONE4_SWA_LAYERS} layers "
                "(src/models/exaone4.cpp): every layer would attend to the whole context and take rope")
    if n == EXAONE4_SWA_LAYERS and not slides:
        return (f"{n} layers without sliding layers, but llama.cpp's exaone4 gives every {EXAONE4_SWA_LAYERS}-layer "
                "model a sliding window (src/models/exaone4.cpp)")
    if head_dim * c["num_attention_heads"] != c["hidden_size"]:
        return (f"head_dim {head_dim} x {c['num_attention_heads']} heads != hidden_size {c['hidden_size']}: "
                "llama.cpp's exaone4 creates attn_output as [hidden, hidden]")
    return None


def _indexer_rotation_fits(c: dict, head_dim: int) -> str | None:
    """llama.cpp rotates DeepSeek-V3.2's indexer q/k by a Hadamard matrix at least 64 wide (src/llama-kv-cache.cpp,
    build_input_k_rot): an index_head_dim that 64 does not divide aborts its first matmul (ggml_can_mul_mat)."""
    del head_dim
    width = int(c.get("index_head_dim") or 0)
    return (f"index_head_dim {width} is not a multiple of 64, the width of the Hadamard rotation llama.cpp applies to "
            "the indexer's queries and keys" if width % 64 else None)


# (GGUF architectures, check of config.json and the key head width -> why llama.cpp cannot run it, or None)
ARCH_CHECKS: tuple[tuple[tuple[str, ...], Callable[[dict, int], str | None]], ...] = (
    (("QWEN35", "QWEN35MOE"), _mrope_sections_fit),
    (("LLAMA4",), _llama4_layers),
    (("GEMMA4",), _gemma4_layers),
    (("SMOLLM3",), _smollm3_layers),
    (("SMOLLM3", "SEED_OSS", "OLMO2"), _no_rope_factors),
    (("OLMO2",), _olmo3_layers),
    (("EXAONE4",), _exaone4_layers),
    (("DEEPSEEK32",), _indexer_rotation_fits),
)
# the dense MLP's width where config.json names it otherwise (Llama-4's intermediate_size is its experts')
FFN_WIDTH_KEY = {"LLAMA4": "intermediate_size_mlp"}


def _gemma4_ffn(c: dict) -> int | list[int]:
    """Gemma-4's KV-shared layers have MLPs twice as wide with use_double_wide_mlp (conversion/gemma.py: a per-layer
    feed_forward_length array)."""
    ff, shared = int(c["intermediate_size"]), int(c.get("num_kv_shared_layers") or 0)
    if not (c.get("use_double_wide_mlp") and shared):
        return ff
    first = c["num_hidden_layers"] - shared
    return [ff if i < first else 2 * ff for i in range(c["num_hidden_layers"])]


# feed_forward_length from config.json where it is per layer
FFN_WIDTHS: dict[str, Callable[[dict], int | list[int]]] = {"GEMMA4": _gemma4_ffn}


def _plain_heads(c: dict, head_dim: int, rope: dict) -> tuple[int, int, int, int]:
    return head_dim, head_dim, head_dim, c.get("num_key_value_heads") or c["num_attention_heads"]


def _partial_rotary(c: dict, head_dim: int, rope: dict) -> tuple[int, int, int, int]:
    """Rotary on the first dims of each head only (GLM-4.5's partial_rotary_factor, MiniMax-M2's rotary_dim)."""
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
    rope_dim = c.get("rotary_dim") or int(head_dim * factor)
    return head_dim, head_dim, rope_dim, c.get("num_key_value_heads") or c["num_attention_heads"]


def _mla_decompressed(c: dict, head_dim: int, rope: dict) -> tuple[int, int, int, int]:
    """DeepSeek's multi-head latent attention as llama.cpp's deepseek2 graph runs it without key_length_mla
    (hparams.is_mla() false: src/models/deepseek2.cpp builds k/v per head from attn_kv_b, the `else` branch): every
    head a key of qk_nope + qk_rope dims and a value of v_head_dim, so kv_b_proj's codes are copied unchanged. The
    absorbed form convert_hf_to_gguf.py writes (attn_k_b stored transposed per head, a latent KV cache) would put
    k_b's quantization blocks along another axis: requantized, so not written here."""
    del head_dim, rope
    return (c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], c["qk_rope_head_dim"],
            c["num_attention_heads"])


def _mla_absorbed(c: dict, head_dim: int, rope: dict) -> tuple[int, int, int, int]:
    """DeepSeek's multi-head latent attention in the absorbed form llama.cpp's deepseek32 graph requires
    (hparams.is_mla(): key_length_mla set; src/models/deepseek32.cpp): one KV head holding the latent, a key of the
    normed kv_lora_rank latent plus the shared rope key, a value of the latent itself. Each head's own widths are
    key_length_mla / value_length_mla (FAMILY_KEYS); attn_k_b / attn_v_b, split from kv_b_proj (ROW_SPLITS,
    PER_HEAD), map the latent to them inside the graph."""
    del head_dim, rope
    return c["kv_lora_rank"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"], 1


# GGUF architecture -> (key length, value length, rotary dims, KV heads) from config.json where they are not the
# plain head_dim / num_key_value_heads
HEADS: dict[str, Callable[[dict, int, dict], tuple[int, int, int, int]]] = {
    "DEEPSEEK2": _mla_decompressed,
    "DEEPSEEK32": _mla_absorbed,
    "GLM4_MOE": _partial_rotary,  # conversion/glm.py: rope dims = head_dim * partial_rotary_factor (0.5)
    "MINIMAXM2": _partial_rotary,  # conversion/minimax.py: rope dims = rotary_dim
    "QWEN3NEXT": _partial_rotary,  # conversion/qwen.py: rope dims = head_dim * partial_rotary_factor (0.25)
    "QWEN35": _partial_rotary,
    "QWEN35MOE": _partial_rotary,
    "GEMMA4": _gemma4_heads,
}


# architectures whose loader requires output.weight, with no fallback to token_embd for a tied head (src/models/
# minimax-m2.cpp, qwen2moe.cpp, olmo2.cpp, openai-moe.cpp, apertus.cpp create `output` with flags 0; the others
# duplicate token_embd)
OUTPUT_REQUIRED = ("MINIMAXM2", "QWEN2MOE", "OLMO2", "GPT_OSS", "APERTUS")
# llama.cpp tensors kept F32 whatever their rank, as convert_hf_to_gguf.py keeps them (ModelBase.prepare_tensors):
# MoE routers and the shared-expert gate, whose rounding would move tokens to other experts
KEPT_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp",
            # gated DeltaNet's gate projections (Qwen3.5's apart) and convolution (ggml_ssm_conv takes F32)
            "ssm_ba", "ssm_alpha", "ssm_beta", "ssm_conv1d",
            # DeepSeek-V3.2's indexer head weights (conversion/base.py: "DSA indexer weights should be F32"; float32
            # in transformers too, _keep_in_fp32_modules): they weigh the scores the top-k keys are picked by
            "indexer.proj")
# Hugging Face names renamed before the gguf.TensorNameMap lookup, as convert_hf_to_gguf.py renames them (the table
# keys the bias as `<module>.bias`)
HF_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.e_score_correction_bias$", ".e_score_correction.bias"),  # DeepSeek-V3, GLM-4.5, MiniMax-M2 router bias
    (r"\.self_attn\.sinks$", ".self_attn.sinks.weight"),  # gpt-oss: llama.cpp reads `attn_sinks.weight`
    (r"\.linear_attn\.dt_bias$", ".linear_attn.dt_proj.bias"),  # Qwen3-Next: llama.cpp's `ssm_dt.bias`
    (r"\.layer_scalar$", ".layer_scalar.weight"),  # Gemma-4: llama.cpp's `layer_output_scale.weight`
)


@dataclass(frozen=True)
class TensorTransform:
    """How an unquantized tensor's values become the ones llama.cpp's graph computes with."""

    why: str
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    value: Callable[[torch.Tensor], torch.Tensor]


# (GGUF architectures, llama.cpp tensor kind) -> its transform, as convert_hf_to_gguf.py applies it
# (conversion/qwen.py Qwen3NextModel.modify_tensors); one fact a row
TENSOR_TRANSFORMS: tuple[tuple[tuple[str, ...], str, TensorTransform], ...] = (
    (("QWEN3NEXT", "QWEN35", "QWEN35MOE"), "ssm_a", TensorTransform(
        "A = -exp(A_log): the graph multiplies softplus(alpha + dt_bias) by ssm_a itself", lambda s: s,
        lambda t: -torch.exp(t))),
    (("QWEN3NEXT", "QWEN35", "QWEN35MOE"), "ssm_conv1d", TensorTransform(
        "the depthwise kernel [channels, 1, width] as ggml_ssm_conv's [channels, width]",
        lambda s: (s[0], s[-1]), lambda t: t.reshape(t.shape[0], t.shape[-1]))),
)


def tensor_kind(name: str) -> str:
    """llama.cpp's tensor kind: `blk.3.ssm_conv1d.weight` -> ssm_conv1d, `blk.3.ssm_a` -> ssm_a."""
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    return parts[0]


def _kept_f32(name: str) -> bool:
    """A KEPT_F32 tensor: its kind, or its name inside the block (`blk.3.indexer.proj.weight` -> indexer.proj)."""
    local = name.split(".", 2)[2] if name.startswith("blk.") else name
    return tensor_kind(name) in KEPT_F32 or local.rsplit(".", 1)[0] in KEPT_F32


def _qwen3next_qkvz(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-Next's in_proj_qkvz rows, [q, k, v, z] per key head, as llama.cpp's attn_qkv (every q, every k, every
    v) and attn_gate (every z), the split conversion/qwen.py Qwen3NextModel.modify_tensors writes."""
    hk, hv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    vz = nv // nk * hv
    group = 2 * hk + 2 * vz

    def part(start: int, width: int) -> list[int]:
        return [g * group + start + i for g in range(nk) for i in range(width)]

    return [("attn_qkv", tuple(part(0, hk) + part(hk, hk) + part(2 * hk, vz))),
            ("attn_gate", tuple(part(2 * hk + vz, vz)))]


def _tiled_v_heads(c: dict, width: int, lead: int = 0) -> tuple[int, ...]:
    """Qwen3.5's value heads from Hugging Face's order (grouped by key head: G0v0, G0v1, G1v0, ...) to the tiled
    order llama.cpp's qwen35 graph broadcasts key heads in (G0v0, G1v0, G0v1, ...), `width` rows a head, after
    `lead` rows kept in place (conversion/qwen.py _LinearAttentionVReorderBase._reorder_v_heads)."""
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    r = nv // nk
    heads = [g * r + j for j in range(r) for g in range(nk)]
    return tuple(range(lead)) + tuple(lead + h * width + i for h in heads for i in range(width))


def _qk_rows(c: dict) -> int:
    return 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]


_QWEN35_V_ROWS: dict[str, Callable[[dict], list[tuple[str, tuple[int, ...]]]]] = {
    ".linear_attn.in_proj_qkv.weight": lambda c: [("attn_qkv", _tiled_v_heads(c, c["linear_value_head_dim"],
                                                                               _qk_rows(c)))],
    ".linear_attn.in_proj_z.weight": lambda c: [("attn_gate", _tiled_v_heads(c, c["linear_value_head_dim"]))],
    ".linear_attn.in_proj_a.weight": lambda c: [("ssm_alpha", _tiled_v_heads(c, 1))],
    ".linear_attn.in_proj_b.weight": lambda c: [("ssm_beta", _tiled_v_heads(c, 1))],
    ".linear_attn.A_log": lambda c: [("ssm_a", _tiled_v_heads(c, 1))],
    ".linear_attn.dt_bias": lambda c: [("ssm_dt", _tiled_v_heads(c, 1))],
    ".linear_attn.conv1d.weight": lambda c: [("ssm_conv1d", _tiled_v_heads(c, c["linear_value_head_dim"],
                                                                            _qk_rows(c)))],
}


def _mla_kv_b(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """kv_b_proj's rows (per head: qk_nope_head_dim key rows, then v_head_dim value rows) as the absorbed MLA form's
    attn_k_b (every head's key rows) and attn_v_b (every head's value rows), the split conversion/deepseek.py writes
    (kv_b_proj itself is not written)."""
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    per = nope + v
    heads = range(c["num_attention_heads"])
    return [("attn_k_b", tuple(h * per + i for h in heads for i in range(nope))),
            ("attn_v_b", tuple(h * per + nope + i for h in heads for i in range(v)))]


# (GGUF architecture, Hugging Face tensor suffix) -> the llama.cpp tensors its rows become, from config.json. Row
# selection commutes with row-wise quantization: each part's codes and scales are the canonical ones, copied
ROW_SPLITS: dict[tuple[str, str], Callable[[dict], list[tuple[str, tuple[int, ...]]]]] = {
    ("QWEN3NEXT", ".linear_attn.in_proj_qkvz.weight"): _qwen3next_qkvz,
    ("DEEPSEEK32", ".self_attn.kv_b_proj.weight"): _mla_kv_b,
    **{(a, suffix): f for a in ("QWEN35", "QWEN35MOE") for suffix, f in _QWEN35_V_ROWS.items()},
}
# (GGUF architecture, llama.cpp kind of a ROW_SPLITS part) -> the part is 3-D, one slice per attention head, and
# whether llama.cpp multiplies by each head's transpose. src/models/deepseek32.cpp's loader: wv_b {kv_lora_rank,
# v_head_dim, n_head} (ggml order: each head's value rows as kv_b_proj holds them: codes copied), wk_b {qk_nope,
# kv_lora_rank, n_head} (each head's key rows transposed: a row of it is a column of kv_b_proj, running across the
# canonical form's per-row scales and groups, so it is written F16 from the dequantized weights, exact up to fp16
# rounding; Q8_0 blocks along that axis would add a second rounding)
PER_HEAD: dict[tuple[str, str], bool] = {("DEEPSEEK32", "attn_k_b"): True, ("DEEPSEEK32", "attn_v_b"): False}
# (GGUF architecture, Hugging Face tensor suffix) -> its input columns in llama.cpp's order (codes copied; a group
# scale's groups move with their columns where the head width is a multiple of the group)
COLUMN_ORDERS: dict[tuple[str, str], Callable[[dict], tuple[int, ...]]] = {
    (a, ".linear_attn.out_proj.weight"): lambda c: _tiled_v_heads(c, c["linear_value_head_dim"])
    for a in ("QWEN35", "QWEN35MOE")
}


def _row_split(arch: _Arch, hf_name: str) -> list[tuple[str, tuple[int, ...]]] | None:
    return next((split(arch.config) for (a, suffix), split in ROW_SPLITS.items()
                 if a == arch.family.arch and hf_name.endswith(suffix)), None)


def _column_order(arch: _Arch, hf_name: str) -> tuple[int, ...] | None:
    return next((order(arch.config) for (a, suffix), order in COLUMN_ORDERS.items()
                 if a == arch.family.arch and hf_name.endswith(suffix)), None)


def _renamed(name: str, kind: str, new_kind: str) -> str:
    """`blk.3.ssm_in.weight` with kind ssm_in as new_kind: `blk.3.attn_qkv.weight`."""
    parts = name.split(".")
    parts[parts.index(kind)] = new_kind
    return ".".join(parts)


def _transform(arch: str, kind: str) -> TensorTransform | None:
    return next((t for archs, k, t in TENSOR_TRANSFORMS if arch in archs and k == kind), None)


# architectures whose experts' gate and up are one merged tensor `ffn_gate_up_exps` [E, 2 x I, H] (each expert's gate
# rows, then its up rows), as Gemma-4's checkpoint holds them and conversion/gemma.py writes them; src/models/gemma4.cpp
# load_arch_tensors creates it (gguf-py's GEMMA4 table lists no separate ffn_gate_exps / ffn_up_exps)
GATE_UP_EXPERTS = ("GEMMA4",)
# (GGUF architecture, tensor name inside a decoder layer) -> llama.cpp's name in its block where the gguf package's
# table names none: Gemma-4's router scale (multiplies the router's normalised input: ffn_gate_inp_s) and per-expert
# output scales (ffn_down_exps_s, [n_expert]) in src/models/gemma4.cpp
DIRECT_NAMES: dict[tuple[str, str], str] = {("GEMMA4", "router.scale"): "ffn_gate_inp.scale",
                                            ("GEMMA4", "router.per_expert_scale"): "ffn_down_exps.scale"}
# one expert's tensor in a Hub checkpoint: <block>.experts.<index>.<projection>.<weight|bias>
_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<index>\d+)\.(?P<rest>.+)$")


def gguf_name(hf_name: str, names) -> str | None:
    """llama.cpp's name for a Hugging Face tensor, from the architecture's gguf.TensorNameMap (None: none). One
    expert's tensor (`...experts.<i>.gate_proj.weight`) gets the name of the merged 3-D tensor it is a slice of."""
    for pattern, repl in HF_RENAMES:
        hf_name = re.sub(pattern, repl, hf_name)
    if m := _EXPERT.match(hf_name):
        hf_name = f"{m['block']}.{m['rest']}"
    return names.get_name(hf_name, try_suffixes=(".weight", ".bias"))


# --------------------------------------------------------------------------- tokenizer


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    special: dict[str, int]  # bos / eos / unk / pad -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    notes: list[str] = field(default_factory=list)
    model: str = "gpt2"  # llama.cpp's tokenizer model: gpt2 (byte-level BPE) or llama (SentencePiece-style)
    scores: list[float] | None = None  # per token, for the llama model


def _pre_tokenizer_kind(pre: dict | None) -> str | None:
    """llama.cpp's `tokenizer.ggml.pre` for the byte-level pre-tokenizers it names, from tokenizer.json."""
    if not pre:
        return None

    def is_bytelevel(p: dict) -> bool:
        return p.get("type") == "ByteLevel" and p.get("use_regex", True)

    if is_bytelevel(pre):
        return "gpt-2"  # the GPT-2 split regex (llama.cpp spells it with a hyphen)
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits")
                and is_bytelevel(parts[1])):
            return "smollm"  # single digits, then the GPT-2 regex (starcoder / smollm family)
    return None


def _has_bytelevel(pre: dict | None) -> bool:
    if not pre:
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(_has_bytelevel(p) for p in pre.get("pretokenizers", []))


def read_vocab(root: Path, config: dict) -> Vocab:
    """The canonical folder's tokenizer.json as llama.cpp's `gpt2` (byte-level BPE) or `llama` (byte-fallback BPE,
    SentencePiece-style) tokenizer model."""
    path = root / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{root} has no tokenizer.json; GGUF embeds the tokenizer and llmc needs it to write one")
    tj = json.loads(path.read_text())
    tc_path = root / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    model = tj.get("model", {})
    n_vocab = int(config.get("vocab_size") or len(model["vocab"]))
    notes: list[str] = []
    scores = None
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        # SentencePiece-style (Gemma, Llama 2, Mistral v0.1): the gguf package's own reader of such tokenizer.json
        kind, pre, merges = "llama", None, []
        tokens, scores, types = _spm_tokens(root, n_vocab)
    elif model.get("type") == "BPE" and _has_bytelevel(tj.get("pre_tokenizer")):
        kind, pre = "gpt2", _pre_tokenizer_kind(tj.get("pre_tokenizer"))
        if pre is None:
            pre = "default"
            notes.append("pre-tokenizer not recognised: tokenizer.ggml.pre=default (llama.cpp may split text "
                         "differently from the Hugging Face tokenizer)")
        tokens, types = _bpe_tokens(tj, n_vocab)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    else:
        raise IncompatibleTargetError(
            "the GGUF exporter writes byte-level BPE (llama.cpp's `gpt2`) and byte-fallback BPE (`llama`) "
            f"tokenizers; this tokenizer is {model.get('type')} with pre-tokenizer "
            f"{(tj.get('pre_tokenizer') or {}).get('type')}",
            fix="target a compressed-tensors runtime for this model",
        )
    ids = {t: i for i, t in enumerate(tokens)}

    def token_id(kind: str) -> int | None:
        tok = tc.get(f"{kind}_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tok in ids:
            return ids[tok]
        v = config.get(f"{kind}_token_id")
        if isinstance(v, list):
            v = v[0] if v else None
        return int(v) if v is not None else None

    special = {k: v for k in ("bos", "eos", "unk", "pad") if (v := token_id(k)) is not None}
    add_bos, add_eos = _adds_special(tj, tc, special)
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = root / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    return Vocab(tokens, types, merges, pre, special, add_bos, add_eos, template, notes, kind, scores)


def _bpe_tokens(tj: dict, n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens and token types of a byte-level BPE tokenizer.json, padded to the model's vocab_size."""
    gguf = _gguf()
    by_id: dict[int, str] = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    if by_id and max(by_id) >= n_vocab:
        raise InputError(f"tokenizer has token id {max(by_id)} >= the model's vocab_size {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types


def _spm_tokens(root: Path, n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a byte-fallback BPE tokenizer.json through gguf.vocab.LlamaHfVocab (what
    convert_hf_to_gguf.py uses for these), padded to the model's vocab_size."""
    gguf = _gguf()
    tokens, scores, types = [], [], []
    for text, score, toktype in gguf.vocab.LlamaHfVocab(root).all_tokens():
        tokens.append(text.decode("utf-8") if isinstance(text, bytes) else text)
        scores.append(float(score))
        types.append(int(toktype))
    if len(tokens) > n_vocab:
        raise InputError(f"tokenizer has {len(tokens)} tokens > the model's vocab_size {n_vocab}")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, scores, types


def _adds_special(tj: dict, tc: dict, special: dict[str, int]) -> tuple[bool, bool]:
    """Whether the Hugging Face tokenizer adds BOS / EOS when encoding (llama.cpp must do the same)."""
    post = tj.get("post_processor") or {}
    single = []
    if post.get("type") == "TemplateProcessing":
        single = post.get("single", [])
    elif post.get("type") == "Sequence":
        for p in post.get("processors", []):
            if p.get("type") == "TemplateProcessing":
                single = p.get("single", [])
    first = "SpecialToken" in single[0] if single else False
    last = "SpecialToken" in single[-1] if single else False
    add_bos = bool(tc.get("add_bos_token", first and "bos" in special))
    add_eos = bool(tc.get("add_eos_token", last and len(single) > 1 and "eos" in special))
    return add_bos, add_eos


# --------------------------------------------------------------------------- Ollama Modelfile

_CHATML_TEMPLATE = (
    "{{- if .Messages }}\n"
    "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}\n"
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
    "{{ else }}\n"
    "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
    "{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}"
)


def ollama_modelfile(vocab: Vocab, header: str) -> tuple[str, dict]:
    """The Modelfile text and what it maps: TEMPLATE for ChatML chat templates, SYSTEM, stop tokens."""
    lines = [f"# {line}" for line in header.splitlines()] + [f"FROM ./{GGUF_FILE}"]
    info: dict = {"template": None, "system": None, "stop": []}
    t = vocab.chat_template
    stops: list[str] = []
    if t and "<|im_start|>" in t and "<|im_end|>" in t:
        info["template"] = "chatml"
        lines.append(f'TEMPLATE """{_CHATML_TEMPLATE}"""')
        m = re.search(r"<\|im_start\|>system(?:\\n|\n)(.+?)<\|im_end\|>", t)
        if m and "{{" not in m.group(1) and '"' not in m.group(1):
            info["system"] = m.group(1)
            lines.append(f'SYSTEM """{m.group(1)}"""')
        stops += ["<|im_start|>", "<|im_end|>"]
    elif t:
        info["template"] = "not mapped"
        lines.append("# the chat template is not a form llmc maps to Ollama's TEMPLATE; Ollama reads the GGUF's "
                     "tokenizer.chat_template instead")
    eos = vocab.special.get("eos")
    if eos is not None and vocab.tokens[eos] not in stops:
        stops.append(vocab.tokens[eos])
    for s in stops:
        quoted = s.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'PARAMETER stop "{quoted}"')
    info["stop"] = stops
    return "\n".join(lines) + "\n", info


# --------------------------------------------------------------------------- the export


@dataclass
class GGUFExport:
    path: Path
    modelfile: Path
    plan: TypePlan
    tensors: dict[str, str]  # gguf name -> type name
    weight_error: dict[str, float]  # added error of the linear weights vs the canonical dequantized ones
    notes: list[str]

    def summary(self) -> dict:
        return {
            "file": self.path.name,
            "type_plan": {
                "linear_weights": self.plan.weight_type,
                "method": self.plan.method,
                "reason": self.plan.reason,
                "embeddings": self.plan.embedding_type,
                "norms": "F32",
                "file_type": self.plan.file_type,
            },
            "tensor_types": _count(self.tensors.values()),
            "added_error_vs_canonical": self.weight_error,
            "notes": self.notes,
        }


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


@dataclass
class _Item:
    hf: str  # canonical (HF) tensor name
    name: str  # gguf name
    shape: tuple[int, ...]
    qtype: str  # GGMLQuantizationType name
    permute_heads: int | None  # rotary permutation of rows with this many heads
    norm_offset: float = 0.0  # added to a norm weight (Gemma)
    transform: TensorTransform | None = None  # an unquantized tensor's values as llama.cpp computes with them
    rows: tuple[int, ...] | None = None  # the canonical tensor's rows this GGUF tensor holds (a split tensor)
    head_transposed: bool = False  # [heads, cols, rows per head]: each head's rows transposed (PER_HEAD)
    cols: tuple[int, ...] | None = None  # its input columns in llama.cpp's order (Qwen3.5's out_proj)
    generated: np.ndarray | None = None  # a tensor llama.cpp needs that no checkpoint holds (rope_freqs)
    # a merged expert tensor: each expert's canonical tensor in expert order (`hf` is expert 0's); shape [E, ...]
    parts: tuple[str, ...] = ()
    per_expert: int = 1  # canonical tensors per expert in `parts`, their rows concatenated (Gemma-4's gate, up)


def _plan_tensors(qm: QuantizedModel, arch: _Arch, plan: TypePlan,
                  plan_of: Callable[[str], TypePlan]) -> list[list[_Item]]:
    """Per canonical file, the tensors it becomes (from the safetensors headers; no data read); `plan_of`: a quantized
    module's type plan (its group's)."""
    per_file: list[list[_Item]] = []
    for f in qm.files():
        with safe_open(str(f), framework="pt") as h:
            shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}  # noqa: SIM118 (a handle)
        per_file.append(tensor_items(shapes, arch, plan, plan_of, qm.quantized_modules, where=str(qm.root)))
    if (rope := rope_freqs_item(arch)) is not None:
        per_file[-1].append(rope)
    return per_file


def tensor_items(shapes: dict[str, tuple[int, ...]], arch: _Arch, plan: TypePlan, plan_of: Callable[[str], TypePlan],
                 quantized: Collection[str], *, where: str = "", unnamed: str = "refuse") -> list[_Item]:
    """The GGUF tensors (name, shape, ggml type, how each is made) that canonical tensors `shapes` (checkpoint name ->
    shape, in file order) become, `quantized` naming the quantized modules: the one decision of each tensor's type,
    which `export_gguf` writes and `Gguf.written_bytes` counts. `unnamed`: "refuse" a tensor llama.cpp has no name
    for (the exporter), or "skip" it (the planner, whose header list may hold tensors the canonical form drops)."""
    names = arch.tensor_names()
    items: list[_Item] = []
    experts = _expert_parts(shapes)
    paired = _merge_gate_up(experts) if arch.family.arch in GATE_UP_EXPERTS else set()
    for k in shapes:
        if k.endswith(_CANONICAL_EXTRAS):
            continue
        parts = experts.get(k)
        if parts == ():  # a later expert's tensor: written inside expert 0's merged one
            continue
        if k == "lm_head.weight" and arch.tied:
            continue
        if _tensor_key(arch, k):  # a per-layer scalar llama.cpp reads as a key (TENSOR_KEYS)
            continue
        name = _direct_name(arch, k) or gguf_name(
            k.replace(".gate_proj.", ".gate_up_proj.") if k in paired else k, names)
        if name is None and unnamed == "skip":
            continue
        if name is None:
            raise IncompatibleTargetError(
                f"{where}: tensor {k} has no counterpart in llama.cpp's {arch.family.arch.lower()} "
                "architecture (the gguf package's tensor-name table); cannot write GGUF",
                fix="target a compressed-tensors runtime (vllm, sglang, tgi) for this model")
        shape = shapes[k]
        module = k.rsplit(".", 1)[0]
        kind = tensor_kind(name)
        if (transform := _transform(arch.family.arch, kind)) is not None:
            shape = transform.shape(shape)
        if len(shape) == 1:
            qtype = "F32"
        elif module in quantized:
            mine = plan_of(module)
            qtype = mine.weight_type if shape[-1] % mine.row_multiple == 0 else "F16"
        elif _kept_f32(name):
            qtype = "F32"
        elif name in ("token_embd.weight", "output.weight"):
            qtype = plan.embedding_type if (plan.embedding_type != "Q8_0" or shape[-1] % BLOCK == 0) else "F16"
        else:
            qtype = "F16"  # an ignored (unquantized) linear
        heads = None
        if arch.family.permute_qk and name.split(".")[-2] == "attn_q":
            heads = arch.n_head
        elif arch.family.permute_qk and name.split(".")[-2] == "attn_k":
            heads = arch.n_head_kv
        offset = arch.family.norm_offset if (len(shape) == 1 and "norm" in name.split(".")[-2]
                                             and kind not in arch.family.norm_offset_skip) else 0.0
        if parts:
            modules = [p.rsplit(".", 1)[0] for p in parts]
            mixed = {plan_of(m).weight_type for m in modules if m in quantized}
            if len(mixed) > 1 or (mixed and not all(m in quantized for m in modules)):
                raise IncompatibleTargetError(
                    f"{name}: llama.cpp holds a layer's experts in one tensor of one type, but this scheme "
                    f"gives {k.rsplit('.experts.', 1)[0]}'s experts different types",
                    fix="give every expert of a layer the same scheme for llama.cpp/Ollama targets")
            shape = ((len(parts) // 2, 2 * shape[0], *shape[1:]) if k in paired
                     else (len(parts), *shape))
        if (split := _row_split(arch, k)) is not None:  # one Hugging Face tensor, several llama.cpp ones
            for part, rows in split:
                part_shape, part_type = (len(rows), *shape[1:]), qtype
                transposed = PER_HEAD.get((arch.family.arch, part))
                if transposed is not None:  # 3-D, a slice per head
                    per = len(rows) // arch.n_head
                    part_shape = (arch.n_head, shape[1], per) if transposed else (arch.n_head, per, shape[1])
                    part_type = "F16" if transposed and qtype != "F32" else qtype
                items.append(_Item(k, _renamed(name, kind, part), part_shape, part_type, None, offset,
                                   transform=transform, rows=rows, head_transposed=bool(transposed)))
            continue
        if (order := _column_order(arch, k)) is not None:
            items.append(_Item(k, name, shape, qtype, None, offset, cols=order))
            continue
        items.append(_Item(k, name, shape, qtype, heads, offset, parts=parts or (), transform=transform,
                           per_expert=2 if k in paired else 1))
        if name == "token_embd.weight" and arch.tied and arch.family.arch in OUTPUT_REQUIRED:
            items.append(_Item(k, "output.weight", shape, qtype, None))  # the tied head, written twice
        if qtype == "NVFP4":  # its global scale, which llama.cpp reads beside the weight
            items.append(_Item(f"{module}.weight_global_scale",
                               name.removesuffix(".weight") + TENSOR_SCALE_SUFFIX, (1,), "F32", None))
    return items


def rope_freqs_item(arch: _Arch) -> _Item | None:
    """The `rope_freqs` tensor llama.cpp reads for Llama-3.1's rope scaling or the architecture's own (ROPE_FREQS),
    written after every canonical tensor; None where the architecture reads none."""
    factors = None
    if arch.rope_scaling and arch.rope_scaling[0] == "llama3":
        factors = llama3_rope_factors(arch)
    elif arch.family.arch in ROPE_FREQS:
        factors = ROPE_FREQS[arch.family.arch](arch)
    return None if factors is None else _Item("", "rope_freqs.weight", tuple(factors.shape), "F32", None,
                                              generated=factors)


def _expert_parts(keys) -> dict[str, tuple[str, ...]]:
    """Per-expert tensors grouped for llama.cpp's merged expert tensors: expert 0's key -> every expert's key in
    expert order; a later expert's key -> () (written inside expert 0's)."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for k in keys:
        if (m := _EXPERT.match(k)) and not k.endswith(_CANONICAL_EXTRAS):
            groups.setdefault((m["block"], m["rest"]), {})[int(m["index"])] = k
    out: dict[str, tuple[str, ...]] = {}
    for (block, rest), by_index in groups.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise InputError(f"{block}.*.{rest}: experts {sorted(by_index)} are not 0..{len(by_index) - 1}; "
                             "llama.cpp's merged expert tensor needs every expert")
        ordered = tuple(by_index[i] for i in range(len(by_index)))
        out.update({k: () for k in ordered[1:]})
        out[ordered[0]] = ordered
    return out


def _merge_gate_up(experts: dict[str, tuple[str, ...]]) -> set[str]:
    """Each layer's gate and up expert tensors as one group for llama.cpp's `ffn_gate_up_exps` (GATE_UP_EXPERTS):
    expert 0's gate key -> (gate 0, up 0, gate 1, up 1, ...), the up group's keys -> (). Returns the merged keys."""
    paired = set()
    for k, parts in list(experts.items()):
        if not parts or ".gate_proj." not in k:
            continue
        ups = tuple(p.replace(".gate_proj.", ".up_proj.") for p in parts)
        if experts.get(ups[0]) != ups:
            raise InputError(f"{k}: Gemma-4's merged gate/up expert tensor needs every expert's up_proj beside its "
                             f"gate_proj; {ups[0]} is missing or incomplete")
        experts[k] = tuple(t for pair in zip(parts, ups) for t in pair)
        experts[ups[0]] = ()
        paired.add(k)
    return paired


def _direct_name(arch: _Arch, hf_name: str) -> str | None:
    """llama.cpp's name for a tensor the gguf package's table does not name (DIRECT_NAMES), else None."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if m is None:
        return None
    kind = DIRECT_NAMES.get((arch.family.arch, m.group(2)))
    return None if kind is None else f"blk.{m.group(1)}.{kind}"


def llama3_rope_factors(arch: _Arch) -> np.ndarray:
    """Llama-3.1's rope scaling as llama.cpp takes it: one divisor per rotary frequency, the `rope_freqs` tensor
    (as convert_hf_to_gguf.py computes it from the config's factor, low/high frequency factors and original
    context length)."""
    import math

    c = arch.config.get("rope_scaling") or arch.config.get("rope_parameters") or {}
    factor, low, high = (float(c.get("factor", 8.0)), float(c.get("low_freq_factor", 1.0)),
                         float(c.get("high_freq_factor", 4.0)))
    old_ctx = float(c.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (arch.rope_theta ** (np.arange(0, arch.head_dim, 2, dtype=np.float64) / arch.head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def proportional_rope_freqs(arch: _Arch) -> np.ndarray:
    """Gemma-4's proportional rope on its full layers as llama.cpp takes it (conversion/gemma.py Gemma4Model
    generate_extra_tensors): ggml's NeoX rope over the whole head, a frequency divisor of 1 on the rotated pairs and
    1e30 (no rotation) on the rest, as transformers' inv_freq is 0 there (modeling_rope_utils proportional)."""
    full = (arch.config.get("rope_parameters") or {}).get("full_attention") or {}
    factor = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    rotated = int(factor * arch.head_dim // 2)
    return np.asarray([1.0] * rotated + [1e30] * (arch.head_dim // 2 - rotated), dtype=np.float32)


# GGUF architecture -> the rope_freqs tensor its graph reads whatever the rope scaling
ROPE_FREQS: dict[str, Callable[[_Arch], np.ndarray]] = {"GEMMA4": proportional_rope_freqs}


def _nbytes(shape: tuple[int, ...], qtype: str) -> int:
    gguf = _gguf()
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    n = int(np.prod(shape))
    return n // block * size


def _convert(qm: QuantizedModel, tensors: dict[str, torch.Tensor], item: _Item, plan_of: Callable[[str], TypePlan],
             errors: dict[str, tuple[float, float, float]]) -> np.ndarray:
    """One canonical tensor -> the GGUF tensor's data (numpy; bytes for block types)."""
    gguf = _gguf()
    if item.generated is not None:
        return item.generated
    if item.parts:  # a merged expert tensor: each expert converted as its own tensor, stacked in expert order
        return _convert_experts(qm, tensors, item, plan_of, errors)
    module = item.hf.rsplit(".", 1)[0]
    is_quantized = module in qm.quantized_modules and item.hf.endswith(".weight")
    spec = qm.scheme_of(module).weights if is_quantized else None
    plan = plan_of(module) if is_quantized else None

    def perm(t: torch.Tensor | None) -> torch.Tensor | None:
        # rows only: a per-tensor scale ([1]) is shared by every row and needs no permutation
        if t is not None and item.rows is not None and t.dim() > 0 and t.shape[0] > 1:
            t = t[list(item.rows)]  # this GGUF tensor's rows of a split one (codes, scales, zero points alike)
        if t is None or item.permute_heads is None or t.shape[0] != item.shape[0]:
            return t
        return llama_permute(t, item.permute_heads)

    def cols(t: torch.Tensor, per_group: int = 1) -> torch.Tensor:
        """Input columns in llama.cpp's order: a weight's columns, or (per_group > 1) a group scale's groups."""
        if item.cols is None or t.dim() < 2 or t.shape[1] == 1:
            return t
        order = list(item.cols)
        if per_group > 1:
            groups = [order[g] // per_group for g in range(0, len(order), per_group)]
            if any(order[g:g + per_group] != list(range(o * per_group, (o + 1) * per_group))
                   for g, o in zip(range(0, len(order), per_group), groups)):
                raise IncompatibleTargetError(
                    f"{item.hf}: llama.cpp's column order moves columns across quantization groups of {per_group}",
                    fix="use a group size that divides the linear-attention head width, or per-channel scales")
            order = groups
        return t[:, order]

    if item.hf.endswith(".weight_global_scale"):  # NVFP4's `.scale`: the multiplier llama.cpp applies
        return modelopt_weight_scale_2(tensors[item.hf]).reshape(1).numpy()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        """A PER_HEAD part transposed within each head: [heads x per, cols] -> [heads, cols, per]."""
        return t.reshape(item.shape[0], -1, t.shape[-1]).transpose(1, 2).contiguous() if item.head_transposed else t

    if not is_quantized:
        x = per_head(perm(tensors[item.hf].float()))
        if item.transform is not None:
            x = item.transform.value(x)
        if item.norm_offset:
            x = x + item.norm_offset
        if item.qtype == "F32":
            return x.numpy().astype(np.float32)
        if item.qtype == "F16":
            return x.numpy().astype(np.float16)
        return gguf.quants.quantize(x.numpy().astype(np.float32), gguf.GGMLQuantizationType[item.qtype])

    canonical = per_head(cols(perm(qm.dequantized_weight(tensors, module).float()))).numpy()
    group = spec.group_size if spec.strategy == "group" else 1
    if item.qtype == "F16":  # input dimension not a multiple of 32: no block type fits
        data = canonical.astype(np.float16)
        decoded = data.astype(np.float32)
    else:
        qtype = gguf.GGMLQuantizationType[item.qtype]
        if item.qtype in _FP4_TYPES:
            if item.cols is not None:
                raise IncompatibleTargetError(f"{item.hf}: llmc does not reorder FP4 blocks' columns for llama.cpp",
                                              fix="use int8 or int4 weights for llama.cpp with this model")
            q = BlockQuantized(codes=perm(tensors[f"{module}.weight"]), scale=perm(tensors[f"{module}.weight_scale"]),
                               global_scale=tensors.get(f"{module}.weight_global_scale"),
                               format=MICROSCALING_FORMATS[_FP4_TYPES[item.qtype]])
            data, tensor_scale = MICROSCALING_GGUF[_FP4_TYPES[item.qtype]].blocks(q)
            decoded = gguf.quants.dequantize(data, qtype)
            if tensor_scale is not None:  # llama.cpp multiplies the matmul's output by it, in float32
                decoded = decoded * tensor_scale
            diff = (decoded - canonical).astype(np.float64)
            errors[item.name] = (float((diff**2).sum()), float((canonical.astype(np.float64) ** 2).sum()),
                                 float(np.abs(diff).max()))
            return data
        if plan.method == "repacked":
            codes = cols(perm(tensors[f"{module}.weight"])).numpy()
            shape2d = tuple(codes.shape)
            scales = _block_scales(cols(perm(tensors[f"{module}.weight_scale"].float()), group), shape2d, spec)
            if item.qtype == "Q8_0":
                data = pack_q8_0(codes, scales)
            elif item.qtype == "Q4_0":
                data = pack_q4_0(codes, scales)
            else:
                zp = _block_scales(cols(perm(tensors[f"{module}.weight_zero_point"].float()), group), shape2d, spec)
                data = pack_q4_1(codes, scales, zp)
        else:
            data = gguf.quants.quantize(canonical.astype(np.float32), qtype)
        decoded = gguf.quants.dequantize(data, qtype)
    diff = (decoded - canonical).astype(np.float64)
    errors[item.name] = (float((diff**2).sum()), float((canonical.astype(np.float64) ** 2).sum()),
                         float(np.abs(diff).max()))
    return data


def _convert_experts(qm: QuantizedModel, tensors: dict[str, torch.Tensor], item: _Item,
                     plan_of: Callable[[str], TypePlan], errors: dict[str, tuple[float, float, float]]) -> np.ndarray:
    """The experts' tensors, converted one by one, as llama.cpp's [E, rows, row bytes] tensor; their added errors
    summed under the merged tensor's name."""
    part_errors: dict[str, tuple[float, float, float]] = {}
    rows = item.shape[1] // item.per_expert  # each canonical tensor's rows (gate's, up's: half a gate_up row block)
    one = [dataclasses.replace(item, hf=p, name=f"{item.name}#{e}", shape=(rows, *item.shape[2:]), parts=(),
                               per_expert=1) for e, p in enumerate(item.parts)]
    data = np.stack([_convert(qm, tensors, expert, plan_of, part_errors) for expert in one])
    if item.per_expert > 1:  # [E x k, rows, ...] -> [E, k x rows, ...]: one expert's tensors' rows in turn
        data = data.reshape(item.shape[0], item.shape[1], *data.shape[2:])
    if part_errors:
        errs = part_errors.values()
        errors[item.name] = (sum(e[0] for e in errs), sum(e[1] for e in errs), max(e[2] for e in errs))
    return data


def export_gguf(
    qm: QuantizedModel,
    out: Path,
    *,
    embedding_type: str = "f16",
    requantize: bool = False,
    name: str | None = None,
) -> GGUFExport:
    """Write `model.gguf`, an Ollama `Modelfile` and `llmc-serve.json` under `out` (each atomically)."""
    gguf = _gguf()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scheme = qm.scheme
    plan = type_plan(scheme.weights, embedding_type, requantize)  # a mixed scheme's: its fewest-bits group's
    plans = {g: type_plan(m.weights, embedding_type, requantize) for g, m in scheme.members().items()}

    def plan_of(module: str) -> TypePlan:
        return plans[qm.quantized_modules[module].get("group", "")]

    notes: list[str] = []
    if scheme.kv_cache is not None and scheme.kv_cache.info.is_float:
        raise IncompatibleTargetError(
            "llama.cpp has no fp8 KV cache; this scheme's KV-cache format cannot be honoured",
            fix="drop kv_cache for llama.cpp/Ollama targets, or use an int8 KV cache (llama.cpp's q8_0 cache type)",
        )
    for member in {m.activations for m in scheme.members().values()} - {None}:
        notes.append(f"activations ({member.describe()}) are not carried: llama.cpp quantizes "
                     "activations itself, dynamically in blocks of 32, for Q8_0/Q4 matmuls")
    if scheme.mixed:
        notes.append("mixed precision: " + "; ".join(f"group {g}: {p.describe()}" for g, p in plans.items()))
    if scheme.kv_cache is not None:
        notes.append("KV-cache quantization is a llama.cpp runtime option: run with --cache-type-k q8_0 "
                     "--cache-type-v q8_0 (dynamic blocks of 32, not the scheme's static scales)")
    arch = _arch(qm.config)
    notes += yarn_notes(arch)
    if any(p.weight_type == "NVFP4" for p in plans.values()) and not arch.family.tensor_scales:
        raise IncompatibleTargetError(
            f"llama.cpp's {arch.family.arch.lower()} graph does not apply per-tensor scales to every Linear (its FFN "
            "passes none), so an NVFP4 GGUF of this model would compute wrong outputs there",
            fix=f"use MXFP4 or int4 weights for llama.cpp with this model, or NVFP4 for "
                f"{', '.join(sorted(k for k, f in GGUF_FAMILIES.items() if f.tensor_scales))} models")
    vocab = read_vocab(qm.root, qm.config)
    notes += vocab.notes
    per_file = _plan_tensors(qm, arch, plan, plan_of)
    items = [i for f in per_file for i in f]
    n_f16_fallback = sum(1 for i in items if i.hf.rsplit(".", 1)[0] in qm.quantized_modules and i.qtype == "F16"
                         and not i.head_transposed)
    if n_f16_fallback:
        notes.append(f"{n_f16_fallback} quantized weights have an input dimension not divisible by "
                     f"{plan.row_multiple}: written as F16 from the dequantized canonical weights")
    if n_transposed := sum(1 for i in items if i.head_transposed and i.hf.rsplit(".", 1)[0] in qm.quantized_modules):
        notes.append(f"{n_transposed} per-head transposed parts of quantized weights (MLA's attn_k_b, split from "
                     "kv_b_proj) written F16 from the dequantized canonical weights: their rows run across the "
                     "canonical scales")
    if arch.tied and any(i.hf == "lm_head.weight" for i in items):
        raise InputError("tie_word_embeddings is set but lm_head.weight is present")
    notes.append("lm_head tied to token_embd (llama.cpp reuses it for the output)" if arch.tied
                 else f"output (lm_head) written as {next(i.qtype for i in items if i.name == 'output.weight')}")

    writer = gguf.GGUFWriter(path=None, arch=arch.arch_name)
    model_name = name or qm.config.get("_name_or_path") or qm.config.get("_model_name_or_path") or \
        str(qm.meta.get("source", {}).get("origin", "model"))
    _write_metadata(writer, gguf, arch, vocab, plan, qm, model_name, notes)
    # weight-only FP4 (each tensor's group's scheme): keep llama.cpp from running them W4A4
    fp4_names = [i.name for i in items if i.qtype in _FP4_TYPES
                 and qm.scheme_of(i.hf.rsplit(".", 1)[0]).activations is None]
    if fp4_names:
        writer.add_array(PREC_A4_KEYS[0], fp4_names)
        writer.add_array(PREC_A4_KEYS[1], [False] * len(fp4_names))
    for i in items:
        t = gguf.GGMLQuantizationType[i.qtype]
        np_dtype = {"F32": np.float32, "F16": np.float16}.get(i.qtype, np.uint8)
        shape = i.shape if np_dtype is not np.uint8 else gguf.quant_shape_to_byte_shape(i.shape, t)
        writer.add_tensor_info(i.name, shape, np.dtype(np_dtype), _nbytes(i.shape, i.qtype),
                               raw_dtype=t if np_dtype is np.uint8 else None)

    final = out / GGUF_FILE
    tmp = out / f".{GGUF_FILE}.{os.getpid()}.tmp"
    errors: dict[str, tuple[float, float, float]] = {}
    with resource_errors(GGUF_FILE, out):
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for tensors, file_items in zip(qm.iter_files(), per_file):
                for i in file_items:
                    writer.write_tensor_data(_convert(qm, tensors, i, plan_of, errors))
                del tensors
            writer.close()
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    fsync_dir(out)
    events.emit(f"file:{GGUF_FILE}")

    sq = sum(e[0] for e in errors.values())
    ref = sum(e[1] for e in errors.values())
    weight_error = {
        "relative_rms": (sq / ref) ** 0.5 if ref else 0.0,
        "worst_tensor_relative_rms": max(((e[0] / e[1]) ** 0.5 if e[1] else 0.0 for e in errors.values()),
                                         default=0.0),
        "max_abs": max((e[2] for e in errors.values()), default=0.0),
    }
    tensor_types = {i.name: i.qtype for i in items}
    log(f"gguf: {plan.describe()}; norms F32; added error vs canonical weights: relative RMS "
        f"{weight_error['relative_rms']:.2e} (max abs {weight_error['max_abs']:.2e})")
    for n in notes:
        log(f"gguf: {n}")

    header = (f"Ollama Modelfile written by llmc {__version__} for {model_name}\n"
              f"scheme {scheme.name} ({scheme.weights.describe()}); {plan.describe()}\n"
              f"create: ollama create <name> -f Modelfile")
    modelfile_text, modelfile_info = ollama_modelfile(vocab, header)
    atomic_write_text(out / MODELFILE, modelfile_text)
    result = GGUFExport(final, out / MODELFILE, plan, tensor_types, weight_error, notes)
    serve = {
        "llama.cpp": {"model": GGUF_FILE, "n_ctx": arch.ctx,
                      "command": f"llama-cli -m {GGUF_FILE} -c {arch.ctx}"
                      + (" --cache-type-k q8_0 --cache-type-v q8_0" if scheme.kv_cache else "")},
        "ollama": {"modelfile": MODELFILE, "command": "ollama create <name> -f Modelfile", **modelfile_info},
        "gguf": result.summary(),
    }
    atomic_write_json(out / SERVE_FILE, serve)
    return result


def _write_vocab(writer, vocab: Vocab) -> None:
    """The tokenizer's keys: its tokens, types, scores and merges (most of a GGUF's metadata, and of the time writing
    it takes: gguf-py packs each entry on its own)."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
    for kind, tid in vocab.special.items():
        adders[kind](tid)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def _write_metadata(writer, gguf, arch: _Arch, vocab: Vocab, plan: TypePlan, qm: QuantizedModel, model_name: str,
                    notes: list[str]) -> None:
    writer.add_type("model")
    writer.add_name(str(model_name))
    writer.add_quantized_by(f"llmc {__version__}")
    writer.add_context_length(arch.ctx)
    writer.add_embedding_length(arch.hidden)
    writer.add_block_count(arch.n_layers)
    writer.add_feed_forward_length(arch.ffn)
    writer.add_head_count(arch.n_head)
    writer.add_head_count_kv(arch.n_head_kv)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_rope_dimension_count(arch.rope_dim or arch.head_dim)
    if arch.head_dim * arch.n_head != arch.hidden or "head_dim" in arch.config or arch.value_dim != arch.head_dim:
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.value_dim or arch.head_dim)
    if arch.rope_scaling is not None and arch.rope_scaling[0] == "linear":  # llama3: the rope_freqs tensor
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(arch.rope_scaling[1])
    if arch.rope_scaling is not None and arch.rope_scaling[0] == "yarn":  # as conversion/base.py writes YaRN
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(arch.rope_scaling[1])
        writer.add_rope_scaling_orig_ctx_len(int(arch.rope["original_max_position_embeddings"]))
    writer.add_layer_norm_rms_eps(arch.rms_eps)
    _write_family_metadata(writer, arch)
    for adder, values in tensor_key_values(qm, arch).items():
        getattr(writer, adder)(values)
    writer.add_vocab_size(arch.vocab)
    writer.add_file_type(int(gguf.LlamaFileType[plan.file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    _write_vocab(writer, vocab)

    scheme = qm.scheme
    writer.add_string("llmc.version", __version__)
    writer.add_string("llmc.scheme", scheme.name)
    writer.add_string("llmc.scheme.weights", scheme.weights.describe())
    writer.add_string("llmc.source.sha256", str(qm.meta.get("source", {}).get("sha256", "")))
    writer.add_string("llmc.gguf.weight_type", plan.weight_type)
    writer.add_string("llmc.gguf.weight_method", plan.method)
    writer.add_string("llmc.gguf.type_plan", plan.describe())
    if notes:
        writer.add_array("llmc.gguf.notes", list(notes))


def _write_family_metadata(writer, arch: _Arch) -> None:
    """The keys a family's llama.cpp architecture reads beyond the common ones: each FAMILY_KEYS row whose
    architecture this is and whose value the config gives."""
    for archs, adder, value in FAMILY_KEYS:
        if arch.family.arch in archs and (v := value(arch.config)) is not None:
            if adder.startswith("."):  # `<arch><key>`, an array the gguf package's writer has no method for
                writer.add_array(writer.arch + adder, v)
            else:
                getattr(writer, adder)(v)


def _key(name: str, cast: Callable = lambda v: v) -> Callable[[dict], object]:
    return lambda c: None if c.get(name) is None else cast(c[name])


def _routed_experts(c: dict) -> int | None:
    n = expert_count(c)
    return n if n > 1 else None


def _linear_attention_layers(c: dict) -> list[bool] | None:
    types = c.get("layer_types")
    return None if types is None else [t == "linear_attention" for t in types]


def _sliding_layers(c: dict) -> list[bool] | None:
    types = c.get("layer_types")
    return None if types is None else [t == "sliding_attention" for t in types]


def _sliding_rope_theta(c: dict) -> float | None:
    theta = ((c.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta")
    return None if theta is None else float(theta)


def _sigmoid_gating(c: dict) -> object:
    return _gguf().ExpertGatingFuncType.SIGMOID


_MOE_ARCHS = ("LLAMA", "QWEN2MOE", "QWEN3MOE", "DEEPSEEK2", "DEEPSEEK32", "GLM4_MOE", "MINIMAXM2", "GPT_OSS",
              "QWEN3NEXT", "QWEN35MOE", "LLAMA4", "GEMMA4")
_DELTANET = ("QWEN3NEXT", "QWEN35", "QWEN35MOE")  # gated-DeltaNet linear attention in the layers layer_types names
# shared experts, dense lead layers, grouped scaled sigmoid routing
_DEEPSEEK_ROUTER = ("DEEPSEEK2", "DEEPSEEK32", "GLM4_MOE")

# (GGUF architectures, GGUFWriter method or `.<key>` of an array under the architecture, its value from config.json;
# None: not written): each key an architecture's
# loader reads beyond the common ones (llama.cpp src/models/<arch>.cpp load_arch_hparams), with the value
# convert_hf_to_gguf.py gives it (conversion/<family>.py), one fact a row
FAMILY_KEYS: tuple[tuple[tuple[str, ...], str, Callable[[dict], object]], ...] = (
    (("GEMMA2", "GEMMA3", "GPT_OSS", "GEMMA4"), "add_sliding_window",
     lambda c: int(c["sliding_window"]) if c.get("sliding_window") else None),
    (("GEMMA2",), "add_attn_logit_softcapping", lambda c: float(c.get("attn_logit_softcapping") or 50.0)),
    (("GEMMA2",), "add_final_logit_softcapping", lambda c: float(c.get("final_logit_softcapping") or 30.0)),
    (("GRANITE",), "add_embedding_scale", _key("embedding_multiplier", float)),
    (("GRANITE",), "add_residual_scale", _key("residual_multiplier", float)),
    (("GRANITE",), "add_attention_scale", _key("attention_multiplier", float)),
    (("GRANITE",), "add_logit_scale", _key("logits_scaling", float)),
    (_MOE_ARCHS, "add_expert_count", _routed_experts),
    (_MOE_ARCHS, "add_expert_used_count", lambda c: experts_per_token(c) if _routed_experts(c) else None),
    (("QWEN2MOE", "QWEN3MOE", "DEEPSEEK2", "DEEPSEEK32", "GLM4_MOE", "QWEN3NEXT", "QWEN35MOE", "GEMMA4"),
     "add_expert_feed_forward_length",
     _key("moe_intermediate_size", int)),
    (("MINIMAXM2", "GPT_OSS", "LLAMA4"), "add_expert_feed_forward_length", _key("intermediate_size", int)),  # experts'
    (("LLAMA4",), "add_interleave_moe_layer_step", _key("interleave_moe_layer_step", int)),
    # gpt-oss: which layers slide, per layer (openai-moe.cpp load_swa_pattern reads the array before its default)
    (("GPT_OSS", "GEMMA4"), "add_sliding_window_pattern", _sliding_layers),
    # Gemma-4 (conversion/gemma.py Gemma4Model.set_gguf_parameters; src/models/gemma4.cpp load_arch_hparams)
    (("GEMMA4",), "add_final_logit_softcapping", _key("final_logit_softcapping", float)),
    (("GEMMA4",), "add_embedding_length_per_layer_input", lambda c: int(c.get("hidden_size_per_layer_input") or 0)),
    (("GEMMA4",), "add_shared_kv_layers", lambda c: int(c.get("num_kv_shared_layers") or 0)),
    (("GEMMA4",), "add_key_length_swa", _key("head_dim", int)),  # the sliding layers' head width
    (("GEMMA4",), "add_value_length_swa", _key("head_dim", int)),
    (("GEMMA4",), "add_rope_dimension_count_swa", _key("head_dim", int)),  # plain rope over the whole head
    (("GEMMA4",), "add_rope_freq_base_swa", _sliding_rope_theta),
    # OLMo 3 (conversion/olmo.py Olmo2Model) and EXAONE 4 (conversion/exaone.py): the window and which layers slide
    # (src/models/olmo2.cpp, exaone4.cpp load_swa_pattern read the array); OLMo 3's sliding layers' own rope base
    (("OLMO2", "EXAONE4"), "add_sliding_window", lambda c: int(c["sliding_window"]) if c.get("sliding_window") else None),
    (("OLMO2", "EXAONE4"), "add_sliding_window_pattern", _sliding_pattern),
    (("OLMO2",), "add_rope_freq_base_swa", lambda c: _sliding_rope_theta(c) if c.get("sliding_window") else None),
    (("QWEN2MOE", "QWEN3NEXT", "QWEN35MOE"), "add_expert_shared_feed_forward_length",
     _key("shared_expert_intermediate_size", int)),
    # gated DeltaNet (conversion/qwen.py Qwen3NextModel.set_gguf_parameters; src/models/qwen3next.cpp derives the
    # head widths from these: key heads = group count, value heads = time-step rank)
    (_DELTANET, "add_ssm_conv_kernel", _key("linear_conv_kernel_dim", int)),
    (_DELTANET, "add_ssm_state_size", _key("linear_key_head_dim", int)),
    (_DELTANET, "add_ssm_group_count", _key("linear_num_key_heads", int)),
    (_DELTANET, "add_ssm_time_step_rank", _key("linear_num_value_heads", int)),
    (_DELTANET, "add_ssm_inner_size", lambda c: int(c["linear_value_head_dim"]) * int(c["linear_num_value_heads"])),
    # which layers are linear attention (gguf 0.19's writer has no adder for it: the key llama-arch.cpp names)
    (_DELTANET, ".attention.recurrent_layers", _linear_attention_layers),
    # Qwen3.5's interleaved multimodal rope (src/models/qwen35.cpp requires the sections; text positions are equal
    # in each section, so it is the plain rope; conversion/qwen.py _Qwen35MRopeMixin's default)
    (("QWEN35", "QWEN35MOE"), "add_rope_dimension_sections", _mrope_sections),
    (_DEEPSEEK_ROUTER, "add_expert_shared_count", _key("n_shared_experts", int)),
    (_DEEPSEEK_ROUTER, "add_leading_dense_block_count", _key("first_k_dense_replace", int)),
    (_DEEPSEEK_ROUTER, "add_expert_weights_scale", _key("routed_scaling_factor", float)),
    (_DEEPSEEK_ROUTER, "add_expert_weights_norm", _key("norm_topk_prob", bool)),
    (_DEEPSEEK_ROUTER, "add_expert_group_count", _key("n_group", int)),
    (_DEEPSEEK_ROUTER, "add_expert_group_used_count", _key("topk_group", int)),
    # transformers' DeepSeek-V3, GLM-4.5 and MiniMax-M2 routers score experts with a sigmoid (+ e_score_correction_bias)
    (_DEEPSEEK_ROUTER + ("MINIMAXM2",), "add_expert_gating_func", _sigmoid_gating),
    (("DEEPSEEK2", "DEEPSEEK32"), "add_q_lora_rank", _key("q_lora_rank", int)),
    (("DEEPSEEK2", "DEEPSEEK32"), "add_kv_lora_rank", _key("kv_lora_rank", int)),
    # the absorbed MLA form (HEADS _mla_absorbed): each head's own key and value widths
    (("DEEPSEEK32",), "add_key_length_mla", lambda c: int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])),
    (("DEEPSEEK32",), "add_value_length_mla", _key("v_head_dim", int)),
    # DeepSeek-V3.2's lightning indexer (src/models/deepseek32.cpp; transformers' DeepseekV32Indexer)
    (("DEEPSEEK32",), "add_indexer_head_count", _key("index_n_heads", int)),
    (("DEEPSEEK32",), "add_indexer_key_length", _key("index_head_dim", int)),
    (("DEEPSEEK32",), "add_indexer_top_k", _key("index_topk", int)),
)

# (GGUF architectures, a decoder layer's tensor, GGUFWriter method of the per-layer array llama.cpp reads instead of
# the tensor, the value transformers uses where the checkpoint holds none): one scalar a layer that the checkpoint
# stores as a tensor and llama.cpp as a key. Apertus' xIELU (transformers' XIELUActivation: alpha_p, alpha_n
# trainable, beta, eps buffers; conversion ApertusModel writes each layer's raw value, src/models/apertus.cpp reads
# xielu.* per layer and ggml_xielu applies the softplus: alpha_p = softplus(alpha_p), alpha_n = beta +
# softplus(alpha_n), as transformers does). Not written as tensors.
TENSOR_KEYS: tuple[tuple[tuple[str, ...], str, str, float | None], ...] = (
    (("APERTUS",), "mlp.act_fn.alpha_p", "add_xielu_alpha_p", None),
    (("APERTUS",), "mlp.act_fn.alpha_n", "add_xielu_alpha_n", None),
    (("APERTUS",), "mlp.act_fn.beta", "add_xielu_beta", 0.5),
    (("APERTUS",), "mlp.act_fn.eps", "add_xielu_eps", -1e-6),
)
_LAYER_TENSOR = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


def _tensor_key(arch: _Arch, hf_name: str) -> bool:
    """Whether this tensor is a TENSOR_KEYS row's (written as a key, not as a tensor)."""
    m = _LAYER_TENSOR.match(hf_name)
    return m is not None and any(arch.family.arch in archs and m["rest"] == rest for archs, rest, _, _ in TENSOR_KEYS)


def tensor_key_values(qm: QuantizedModel, arch: _Arch) -> dict[str, list[float]]:
    """Each TENSOR_KEYS row of this architecture: GGUFWriter method -> its per-layer values, read from the canonical
    files (one scalar a layer), transformers' value where a layer holds none."""
    rows = [(rest, adder, default) for archs, rest, adder, default in TENSOR_KEYS if arch.family.arch in archs]
    if not rows:
        return {}
    found: dict[str, dict[int, float]] = {rest: {} for rest, _, _ in rows}
    for f in qm.files():
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if (m := _LAYER_TENSOR.match(k)) and m["rest"] in found:
                    t = h.get_tensor(k)
                    if t.numel() != 1:
                        raise InputError(f"{k}: llama.cpp reads one value a layer; this tensor has {t.numel()}")
                    found[m["rest"]][int(m["layer"])] = float(t.float().reshape(()))
    out: dict[str, list[float]] = {}
    for rest, adder, default in rows:
        values = [found[rest].get(i, default) for i in range(arch.n_layers)]
        if (missing := [i for i, v in enumerate(values) if v is None]):
            raise InputError(f"{qm.root}: layers {missing} have no {rest}, which llama.cpp's "
                             f"{arch.family.arch.lower()} reads", fix="re-quantize from a complete checkpoint")
        out[adder] = values
    return out


# --------------------------------------------------------------------------- what the plan counts: bytes and time
#
# The plan's count of an export runs the exporter's own choice of each tensor's type (`tensor_items`) on the tensors
# it knows by name (WrittenTensors.linear_names / other_tensors): the bytes are ggml's blocks of those types, and the
# time is each type's elements at the probed rate of `_convert` itself on a small tensor of that type (packing,
# decoding every block again with gguf.quants and the error sums; F16/F32 copies too) plus the vocabulary at the
# probed rate of reading a tokenizer.json and writing its keys (`read_vocab`, `_write_vocab`: gguf-py packs each
# token and merge on its own): benchmarks/results/planner-log.md, "The GGUF export's packing and its check".

ALIGNMENT = 32  # GGUFWriter starts each tensor's data at a multiple of this (gguf.GGUF_DEFAULT_ALIGNMENT)
# The conversion probe's tensor (out, in): its per-element work is what is timed (a probe run repeats `_convert` for
# at least probes.MIN_SAMPLE_S), and building it takes milliseconds
CONVERT_PROBE_SHAPE = (256, 1024)
CONVERT_PROBE_REPEATS = 3  # timed runs per type: each export writes 2-4 types, and a plan probes each once a machine
# The vocabulary probe's tokenizer: byte-level BPE with as many merges as tokens (SmolLM2, Llama-3, Qwen: 48.9k
# merges for 49.2k tokens), so the plan prices a model's vocab_size tokens with their merges
VOCAB_PROBE_TOKENS = 1024


@dataclass(frozen=True)
class ConvertWork:
    """One kind of `_convert` call: a quantized module's weights as ggml type `qtype` (`method`, from `weights`), or
    an unquantized tensor copied or converted to `qtype` from `dtype`."""

    qtype: str
    method: str  # "repacked" | "requantized" (quantized weights) | "copy"
    weights: TensorSpec | None  # the scheme's weights (quantized), else None
    dtype: str = "float32"  # the canonical tensor's dtype (unquantized)


def planned_items(w: WrittenTensors) -> tuple[list[_Item], set[str]] | None:
    """The GGUF tensors one `WrittenTensors` entry becomes (`tensor_items`, the exporter's own decision) and the
    quantized modules among them; None where the plan knows no tensor names or the family is not one GGUF writes."""
    if not (w.linear_names or w.other_tensors) or not w.config:
        return None
    # a plan asks for each entry several times (bytes, time, each end of the range; 45k tensors take ~2 s for a
    # DeepSeek-V3): kept for the last few entries asked
    return _planned(w.linear_names, w.linears, w.other_tensors, w.weights, json.dumps(w.config, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _planned(linear_names: tuple[str, ...], linears: tuple[tuple[int, int], ...],
             other_tensors: tuple[tuple[str, tuple[int, ...]], ...], weights: TensorSpec,
             config_json: str) -> tuple[list[_Item], set[str]] | None:
    w = WrittenTensors(linears=linears, weights=weights, layer_unquantized=0, outer=0, elem=0, kept_elem=0,
                       linear_names=linear_names, other_tensors=other_tensors, config=json.loads(config_json))
    try:
        arch = _arch(dict(w.config))
        plan = type_plan(w.weights, GGUF_OPTIONS["embedding_type"], GGUF_OPTIONS["requantize"])
    except (IncompatibleTargetError, InputError):
        return None
    model_type = w.config.get("model_type")
    quantized = {n for n in w.linear_names if not kept_in_dtype(model_type, n)}  # the stream leaves the others
    shapes = {f"{n}.weight": tuple(s) for n, s in zip(w.linear_names, w.linears)} | dict(w.other_tensors)
    try:
        items = tensor_items(shapes, arch, plan, lambda module: plan, quantized, unnamed="skip")
    except (IncompatibleTargetError, InputError):
        return None
    if w.other_tensors and (rope := rope_freqs_item(arch)) is not None:
        items.append(rope)
    return items, quantized


def _info_bytes(item: _Item) -> int:
    """A tensor's entry in the GGUF header: its name (length-prefixed), dimensions, type and offset."""
    return 8 + len(item.name.encode()) + 4 + 8 * len(item.shape) + 4 + 8


def gguf_bytes(w: WrittenTensors) -> float | None:
    """Bytes model.gguf holds for `w`'s tensors as `export_gguf` writes them (data aligned, header entries), None where
    the plan knows no names (`planned_items`)."""
    planned = planned_items(w)
    if planned is None:
        return None
    return sum(-(-_nbytes(i.shape, i.qtype) // ALIGNMENT) * ALIGNMENT + _info_bytes(i) for i in planned[0])


def converted_elements(w: WrittenTensors) -> dict[ConvertWork, int]:
    """Elements `_convert` handles per kind of call for `w`'s tensors: from `planned_items` where the plan knows
    names, else from the counts (the Linears at the scheme's type, the rest copied to F32 in the layers and to the
    embedding type outside)."""
    plan = type_plan(w.weights, GGUF_OPTIONS["embedding_type"], GGUF_OPTIONS["requantize"])
    dtype = {2: "bfloat16", 4: "float32"}.get(w.elem, "float32")
    quant = ConvertWork(plan.weight_type, plan.method, w.weights)
    out: dict[ConvertWork, int] = {}

    def add(kind: ConvertWork, n: int) -> None:
        if n:
            out[kind] = out.get(kind, 0) + n

    planned = planned_items(w)
    if planned is None:
        for o, i in w.linears:
            add(quant, o * i)  # a width no block fits is written F16 from the same decode: priced alike
        add(ConvertWork("F32", "copy", None, dtype), w.layer_unquantized)
        add(ConvertWork(plan.embedding_type, "copy", None, dtype), w.outer)
        return out
    items, quantized = planned
    for item in items:
        if item.generated is not None:
            continue
        n = int(np.prod(item.shape))
        module = item.hf.rsplit(".", 1)[0]
        if module in quantized and item.hf.endswith(".weight"):
            add(quant, n)  # F16 parts of a quantized weight (attn_k_b) are decoded as the codes are: priced alike
        else:
            add(ConvertWork(item.qtype, "copy", None, dtype), n)
    return out


def convert_rate(kind: ConvertWork) -> float:
    """Elements/s `_convert` turns into GGUF data of `kind`, timed on a CONVERT_PROBE_SHAPE tensor and cached per
    machine (llmc.planning.probes)."""
    out, inp = CONVERT_PROBE_SHAPE
    what = f"{kind.method} {probe_text(kind.weights)}" if kind.weights is not None else f"copy from={kind.dtype}"
    return probes.rate(f"gguf convert {kind.qtype} {what} elements={out * inp}", _convert_timer(kind),
                       repeats=CONVERT_PROBE_REPEATS)


def vocabulary_rate() -> float:
    """Tokens/s (each with a merge) of reading a byte-level BPE tokenizer.json and writing its keys into a GGUF
    (`read_vocab`, `_write_vocab`, GGUFWriter's key-value data), timed on VOCAB_PROBE_TOKENS and cached per machine."""
    return probes.rate(f"gguf vocabulary tokens={VOCAB_PROBE_TOKENS}", _vocabulary_timer(),
                       repeats=CONVERT_PROBE_REPEATS)


def convert_seconds(work: ExportWork) -> float:
    """Seconds `export_gguf` spends beyond writing its file: every tensor through `_convert` at its kind's probed
    rate, and the vocabulary (the model's vocab_size) at the probed rate; 0 for a named profile."""
    def seconds() -> float:
        total = 0.0
        for w in work.written:
            for kind, n in converted_elements(w).items():
                total += n / convert_rate(kind)
        vocab = int(work.config.get("vocab_size") or work.shape.vocab or 0)
        return total + (vocab / vocabulary_rate() if vocab else 0.0)

    return host_work_seconds(seconds)


def _convert_timer(kind: ConvertWork):
    """A function timing `_convert` on one CONVERT_PROBE_SHAPE tensor of `kind` (a canonical form of one Linear held
    in memory), repeated for at least probes.MIN_SAMPLE_S of its own time, returning elements/s."""
    state: dict = {}

    def run_once() -> float:
        if not state:
            out, inp = CONVERT_PROBE_SHAPE
            with torch.random.fork_rng(devices=[]):  # the build's own random state stays as it was
                torch.manual_seed(0)
                w = torch.randn(out, inp) * 0.02
            if kind.weights is None:
                tensors = {"n.weight": w.to(getattr(torch, kind.dtype))}
                meta = {"scheme": Scheme(TensorSpec("int8", "channel")).to_dict(), "modules": {}, "config": {}}
                item = _Item("n.weight", "blk.0.ffn_up.weight", (out, inp), kind.qtype, None)
                plan = None
            else:
                q = quantize_weight(w, kind.weights)
                tensors = {"l.weight": q.codes,
                           "l.weight_scale": q.scale if kind.weights.info.microscaling else q.scale.float()}
                if q.zero_point is not None:
                    tensors["l.weight_zero_point"] = q.zero_point
                if q.global_scale is not None:
                    tensors["l.weight_global_scale"] = q.global_scale
                meta = {"scheme": Scheme(kind.weights).to_dict(), "modules": {"l": {}}, "config": {}}
                item = _Item("l.weight", "blk.0.ffn_up.weight", (out, inp), kind.qtype, None)
                plan = type_plan(kind.weights, GGUF_OPTIONS["embedding_type"], kind.method == "requantized")
            state.update(qm=QuantizedModel(Path("."), meta), tensors=tensors, item=item, plan=plan)
        elapsed, n = 0.0, 0
        while elapsed < probes.MIN_SAMPLE_S:
            start = time.perf_counter()
            _convert(state["qm"], state["tensors"], state["item"], lambda module: state["plan"], {})
            elapsed += time.perf_counter() - start
            n += 1
        return n * CONVERT_PROBE_SHAPE[0] * CONVERT_PROBE_SHAPE[1] / elapsed

    return run_once


def _vocabulary_timer():
    """A function timing `read_vocab` of a VOCAB_PROBE_TOKENS-token byte-level BPE tokenizer.json (as many merges)
    and GGUFWriter writing its keys (`_write_vocab`) into a file, returning tokens/s."""
    import tempfile

    def run_once() -> float:
        gguf = _gguf()
        n = VOCAB_PROBE_TOKENS
        with tempfile.TemporaryDirectory(prefix="llmc-gguf-probe-") as folder:
            root = Path(folder)
            vocab = {f"t{i:05d}x": i for i in range(n)}
            tj = {"model": {"type": "BPE", "vocab": vocab, "merges": [f"t{i:05d} x" for i in range(n)]},
                  "pre_tokenizer": {"type": "ByteLevel"}, "added_tokens": []}
            (root / "tokenizer.json").write_text(json.dumps(tj))
            elapsed, runs = 0.0, 0
            while elapsed < probes.MIN_SAMPLE_S:
                start = time.perf_counter()
                v = read_vocab(root, {"vocab_size": n})
                writer = gguf.GGUFWriter(path=None, arch="llama")
                _write_vocab(writer, v)
                writer.write_header_to_file(root / "probe.gguf")
                writer.write_kv_data_to_file()
                writer.close()
                elapsed += time.perf_counter() - start
                runs += 1
        return runs * n / elapsed

    return run_once


@register_format
class Gguf(ArtifactFormat):
    name = "gguf"
    libraries = ("gguf",)
    read_by = ("llama.cpp",)
    unevaluated = "not evaluated: add llama.cpp to eval.runtimes (bash scripts/setup-llama.sh)"
    proof = ("loaded and scored in llama.cpp here (Q8_0, Q4_0; tests marked llama); read back with the gguf "
             "library and compared tensor by tensor in the default test run (MXFP4, NVFP4 too: decoded to llmc's "
             "values, and by ggml's own C dequantizers; MXFP4 scored in llama.cpp on gpt-oss's experts passed "
             "through from its MXFP4 original, NVFP4 not yet); the MoE families (Mixtral, "
             "Qwen2/3-MoE, DeepSeek-V3, DeepSeek-V3.2 (absorbed MLA, indexer), GLM-4.5, MiniMax-M2, gpt-oss, Qwen3-Next, "
             "Qwen3.5, Qwen3.5-MoE and Llama-4: Q8_0), Gemma-4 (per-layer embeddings, KV-shared layers, its MoE "
             "variant: Q8_0) and SmolLM3, OLMo 3, EXAONE 4, Seed-OSS and Apertus (Q8_0) loaded "
             "and scored in llama.cpp 0.3.36 against the torch reference (tests/integration/test_gguf_moe_llamacpp.py); "
             "Ollama itself (which embeds "
             "llama.cpp) is not run here")

    mixed_precision = True  # each group's GGUF type, per tensor (llmc.formats.gguf)
    # the families llmc.formats.gguf_arch maps to a llama.cpp architecture (its MoE ones: experts merged into
    # llama.cpp's 3-D tensors, tests/unit/test_gguf_moe.py); the others are refused at plan time, those llama.cpp has
    # with the reason (GGUF_REFUSED, the runtimes' refused_families)
    families = frozenset(GGUF_FAMILIES)
    families_source = ("llmc.formats.gguf_arch: the families whose llama.cpp architecture (src/models/<arch>.cpp in "
                       "the llama.cpp llama-cpp-python 0.3.36 vendors) llmc's GGUF exporter writes")
    moe_families = MOE_MODEL_TYPES

    def check_config(self, config: dict) -> None:
        _arch(config)  # the family's llama.cpp facts (GGUF_FAMILIES, ARCH_CHECKS, rope): refused before weights load

    def check_scheme(self, scheme) -> None:
        type_plan(scheme.weights)  # raises for weights GGUF has no llama.cpp type for (fp8, mxfp8)

    copies_tokenizer_files = False  # the vocabulary and merges go into the GGUF's metadata (counted as their size)

    def linear_weight_bytes(self, shape: tuple[int, int], weights: TensorSpec | None, elem: int) -> Fraction:
        """What model.gguf holds for one decoder-layer Linear, exactly as `export_gguf` writes it: ggml's blocks of its
        type (Q4_0 18 bytes per 32 weights: 4.5 bits; Q8_0 34 per 32: 8.5; MXFP4 17 per 32: 4.25; NVFP4 36 per 64:
        4.5, plus its F32 `.scale`), F16 where the input width is no multiple of the type's block and for a Linear
        left unquantized (whatever the model's dtype: the exporter writes ignored Linears as F16)."""
        del elem  # GGUF writes unquantized Linears as F16 whatever the canonical form holds
        if weights is None:
            return Fraction(2 * shape[0] * shape[1])
        plan = type_plan(weights, GGUF_OPTIONS["embedding_type"], GGUF_OPTIONS["requantize"])
        if shape[1] % plan.row_multiple:
            return Fraction(2 * shape[0] * shape[1])
        return Fraction(_nbytes(shape, plan.weight_type) + (4 if plan.weight_type == "NVFP4" else 0))

    def written_bytes(self, w: WrittenTensors) -> float:
        """model.gguf: each quantized Linear in its ggml type's blocks (F16 where its input width is no multiple
        of the blocks), norms and biases F32, the embedding and head at the embedding type, the vocabulary."""

        if (named := gguf_bytes(w)) is not None:  # each tensor at the type export_gguf gives it (`tensor_items`)
            return named + w.side_files
        plan = type_plan(w.weights, GGUF_OPTIONS["embedding_type"], GGUF_OPTIONS["requantize"])
        total = sum(_nbytes((o, i), plan.weight_type) if i % plan.row_multiple == 0 else 2 * o * i
                    for o, i in w.linears)
        embedding = {"F32": 4, "F16": 2}.get(plan.embedding_type, 34 / 32)  # Q8_0: 34 bytes a block of 32
        return total + w.layer_unquantized * 4 + w.outer * embedding + w.side_files

    def cost(self, label: str, work: ExportWork) -> CostRow:
        """The files' write (ArtifactFormat.cost) plus converting every tensor and writing the vocabulary
        (`convert_seconds`, at probed rates)."""
        row = super().cost(label, work)
        row.seconds += convert_seconds(work)
        return row

    def stage_config(self, request: ExportRequest) -> dict:
        return {"target": target_key(request.target), "options": GGUF_OPTIONS}

    def write(self, request: ExportRequest, out: Path) -> None:
        export_gguf(request.quantized, out, **GGUF_OPTIONS)

    def recognizes(self, path: Path) -> bool:
        return _gguf_file(path).is_file()

    def describe(self, path: Path) -> str:
        from gguf import GGUFReader  # lazy: the gguf package is the exporter's (ArtifactFormat.libraries)

        path = _gguf_file(path)
        reader = GGUFReader(str(path))

        def field(name: str):
            f = reader.fields.get(name)
            if f is None:
                return None
            v = f.parts[f.data[0]]
            return bytes(v).decode() if f.types and f.types[0].name == "STRING" else v.tolist()[0]

        types: dict[str, int] = {}
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        return "\n".join([
            f"GGUF file {path} ({field('general.architecture')}, {len(reader.tensors)} tensors: "
            + ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1])) + ")",
            f"  scheme {field('llmc.scheme') or '?'}; linear weights {field('llmc.gguf.weight_type') or '?'} "
            f"({field('llmc.gguf.weight_method') or 'not written by llmc'})",
            "  accepted by: llama.cpp (CPU and GPU builds), Ollama (with the Modelfile beside it)",
        ])


def _gguf_file(path: Path) -> Path:
    return path if path.suffix == ".gguf" else path / "model.gguf"
