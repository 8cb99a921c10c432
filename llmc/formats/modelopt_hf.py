"""Export the canonical quantized form as a ModelOpt-style unified Hugging Face checkpoint, the format
TensorRT-LLM (LLM API, `trtllm-serve`) loads, plus an LLM-API options YAML.

Layout as NVIDIA ModelOpt 0.47 writes it (`export_hf_checkpoint`; the conformance test compares names,
dtypes, shapes and config keys with ModelOpt's own export of the same tiny model):

    scheme (canonical)                         quant_algo            per Linear
    fp8 per-tensor W + static per-tensor A     FP8                   weight fp8_e4m3fn, weight_scale (), input_scale ()
    int8 per-channel W + static per-tensor A   W8A8_SQ_PER_CHANNEL   weight int8, weight_scale [out], input_scale (),
                                                                     pre_quant_scale [in]
    int4 symmetric group W, no A               W4A16_AWQ             weight uint8 [out/2, in] (two output rows per
                                                                     byte, low nibble = even row), weight_scale [out, in/g]
    int4 symmetric g128 W + static per-tensor  W4A8_AWQ              as W4A16_AWQ, plus weight_scale_2 () and input_scale ()
      FP8 A
    NVFP4 W + static NVFP4 A (W4A4-NVFP4)      NVFP4                 weight uint8 [out, in/2] (E2M1, element 2i low
                                                                     nibble), weight_scale float8_e4m3fn [out, in/16],
                                                                     weight_scale_2 (), input_scale ()
    fp8 128x128 block W + dynamic 1x128 fp8 A  fp8_pb_wo             weight fp8_e4m3fn, weight_scale float32
      (W8A8-FP8-BLOCK)                                               [out/128, 1, in/128, 1] (() for a one-tile weight)
    KV cache fp8 / int8                        kv_cache_quant_algo   k_proj.k_scale (), v_proj.v_scale ()

Dequantized values are code × scale in every case, so our codes and scales are written as computed
(ModelOpt derives int4 scales as absmax/7, compressed-tensors as absmax/7.5: a different choice of
scale, the same arithmetic at load). SmoothQuant and AWQ scales are already folded into the norms /
previous Linears in the canonical form, so the `pre_quant_scale` tensors ModelOpt writes (every Linear for
SQ; o_proj/down_proj for AWQ) are ones.

NVFP4's per-tensor scales follow ModelOpt's convention, a multiplier: weight_scale_2 = amax / (448 * 6), the reciprocal
of the canonical form's (compressed-tensors') divisor weight_global_scale, so ModelOpt's decode code × weight_scale ×
weight_scale_2 differs from the canonical code × (weight_scale / weight_global_scale) only by the float32 rounding of
that reciprocal (≤ 2⁻²³ relative); input_scale likewise for input_global_scale. Fused siblings (q/k/v, gate/up)
already share one global scale in the canonical form, as TensorRT-LLM asserts at load. Weight-only NVFP4 has no
TensorRT-LLM layout: ModelOpt writes it as W4A16_NVFP4, which TensorRT-LLM's QuantAlgo does not have. Block FP8 is
what ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG exports, `fp8_pb_wo`, which TensorRT-LLM (1.0 on) reads as
FP8_BLOCK_SCALES, whose GEMM quantizes the activations to FP8 per 1 × 128 at run time: llmc's W8A8-FP8-BLOCK.

A mixed-precision scheme (`Scheme.groups`) is written as ModelOpt writes a model whose layers differ
(`modelopt.torch.export.quant_utils.process_layer_quant_config`): quant_algo MIXED_PRECISION and `quantized_layers`,
each quantized Linear -> its own layer config ({"quant_algo": "FP8"}, {"quant_algo": "W4A16_AWQ", "group_size": ..,
"has_zero_point": false, "pre_quant_scale": true}, {"quant_algo": "NVFP4", "group_size": 16}, ...); a Linear it does
not list is not quantized. Each group's scheme must be one of the quant_algos above but block FP8 (TensorRT-LLM
translates `fp8_pb_wo` only at the top level, not in `quantized_layers`), and Linears TensorRT-LLM fuses (q/k/v,
gate/up) one group's. The same table also goes to quant_cfg.json, where TensorRT-LLM's loader reads it.

W4A8_AWQ's GEMM runs in FP8: the kernel scales the int4 codes by weight_scale / weight_scale_2 into FP8 and
multiplies by the FP8 activations, so the weight it really uses is fp8(code × weight_scale / weight_scale_2) ×
weight_scale_2 (ModelOpt's own simulation of it, checked against ModelOpt 0.47). weight_scale_2 is
max|code × weight_scale| / 448 over the Linears TensorRT-LLM fuses into one GEMM (q/k/v, gate/up), as ModelOpt
writes it; `fp8_weight_operand` computes that weight for evaluating the scheme the way the kernel runs it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmc.formats.base import (
    ArtifactFormat,
    ExportLayout,
    ExportRequest,
    architectures,
    quantization_config,
    read_json,
    target_key,
)
from llmc.formats.registry import register_format
from llmc.formats.files import write_model_files, write_shards
from llmc.formats.microscaling_export import (
    modelopt_fp8_block_tensors,
    modelopt_nvfp4_input_scale,
    modelopt_nvfp4_tensors,
)
from llmc.errors import IncompatibleTargetError
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import NVFP4, BlockQuantized
from llmc.quant.spec import Scheme
from llmc.storage.store import atomic_write_json, atomic_write_text

MODELOPT_LAYOUT_VERSION = "0.47.0"
HF_QUANT_CONFIG = "hf_quant_config.json"
LLM_API_OPTIONS = "llmc-trtllm.yaml"
# TensorRT-LLM (`tensorrt_llm/_torch/model_config.py` load_modelopt_quant_config) takes a MIXED_PRECISION checkpoint's
# kv_cache_quant_algo and quantized_layers from this file, as ModelOpt's legacy TensorRT-LLM export writes it; ModelOpt
# 0.47's export_hf_checkpoint does not write it (its layers are in hf_quant_config.json, where vLLM reads them)
MIXED_QUANT_CONFIG = "quant_cfg.json"
_NOT_NORM_FED = ("o_proj", "down_proj")  # Linears whose input comes from another Linear, not a norm
FP8_PB_WO = "fp8_pb_wo"  # ModelOpt's name for 128x128 block FP8 weights (TensorRT-LLM: FP8_BLOCK_SCALES)


def quant_algo(scheme: Scheme) -> str:
    """ModelOpt's name for the scheme, or IncompatibleTargetError naming the closest supported one."""
    w, a = scheme.weights, scheme.activations
    if w.format == "fp8_e4m3" and w.strategy == "tensor" and a and a.format == "fp8_e4m3" and a.strategy == "tensor" and not a.dynamic:
        return "FP8"
    if w.format == "int8" and w.strategy == "channel" and a and a.format == "int8" and a.strategy == "tensor" and not a.dynamic:
        return "W8A8_SQ_PER_CHANNEL"
    if w.format == "int4" and w.strategy == "group" and w.symmetric and a is None:
        return "W4A16_AWQ"
    if scheme.name == "W4AFP8":
        if w.strategy == "group" and w.group_size == 128 and w.symmetric and a.strategy == "tensor" and not a.dynamic:
            return "W4A8_AWQ"
        raise IncompatibleTargetError(
            f"TensorRT-LLM's W4A8_AWQ takes symmetric int4 weights in groups of 128 and FP8 activations with one "
            f"static scale per tensor; this scheme has weights {w.describe()}, activations {a.describe()}",
            fix="weights {format: int4, strategy: group, group_size: 128}, activations {format: fp8_e4m3, "
            "strategy: tensor} (static: calibrated)",
        )
    if scheme.name == "W4A4-NVFP4":
        if a.dynamic:
            raise IncompatibleTargetError(
                "TensorRT-LLM's NVFP4 GEMM takes the activations' global scale from the checkpoint (input_scale); "
                f"this scheme's NVFP4 activations are dynamic ({a.describe()})",
                fix="activations {format: nvfp4, strategy: group, group_size: 16} (static: calibrated)")
        return "NVFP4"
    if scheme.name == "W4A16-NVFP4":
        raise IncompatibleTargetError(
            "TensorRT-LLM cannot load weight-only NVFP4: ModelOpt writes it as quant_algo W4A16_NVFP4, which "
            "TensorRT-LLM's QuantAlgo does not have (its NVFP4 GEMM quantizes the activations to NVFP4 as well)",
            fix="W4A4-NVFP4 (activations {format: nvfp4, strategy: group, group_size: 16}, sm100+), or a vLLM "
            "target for weight-only NVFP4")
    if scheme.name == "W8A8-FP8-BLOCK":
        if a.strategy == "group" and a.group_size == 128 and a.dynamic:
            return FP8_PB_WO
        raise IncompatibleTargetError(
            "TensorRT-LLM's block-FP8 GEMM (FP8_BLOCK_SCALES) quantizes the activations to FP8 per 1 x 128 at run "
            f"time; this scheme's activations are {a.describe()}",
            fix="activations {format: fp8_e4m3, strategy: group, group_size: 128, dynamic: true}")
    raise IncompatibleTargetError(
        f"TensorRT-LLM's ModelOpt checkpoint has no layout for {scheme.name} ({w.describe()}"
        f"{', activations ' + a.describe() if a else ''})",
        fix="use FP8 per-tensor weights + static per-tensor FP8 activations, INT8 per-channel weights + static "
        "per-tensor INT8 activations (SmoothQuant), symmetric INT4 group weights (AWQ/GPTQ), W4A4-NVFP4 or "
        "W8A8-FP8-BLOCK",
    )


MIXED_PRECISION = "MIXED_PRECISION"


def layer_algos(qm: QuantizedModel) -> dict[str, str]:
    """Each quantized Linear's quant_algo (a plain scheme: all the same)."""
    if not qm.scheme.mixed:
        algo = quant_algo(qm.scheme)
        return dict.fromkeys(qm.quantized_modules, algo)
    by_group = group_algos(qm.scheme)
    algos = {name: by_group[entry["group"]] for name, entry in qm.quantized_modules.items()}
    for name, algo in algos.items():  # TensorRT-LLM runs fused siblings as one GEMM: one quant_algo
        mixed = sorted({algos[m] for m in fused_gemm_of(name, algos)})
        if len(mixed) > 1:
            raise IncompatibleTargetError(
                f"TensorRT-LLM fuses {', '.join(fused_gemm_of(name, algos))} into one GEMM, but they are quantized "
                f"as {' and '.join(mixed)}", fix="put the Linears of one attention (q/k/v) or MLP (gate/up) in one "
                "group")
    return algos


def group_algos(scheme: Scheme) -> dict[str, str]:
    """A mixed scheme's group -> quant_algo in `quantized_layers`, or IncompatibleTargetError for a group ModelOpt's
    mixed precision cannot hold in a form TensorRT-LLM loads."""
    by_group = {g: quant_algo(m) for g, m in scheme.members().items()}
    for group, algo in by_group.items():
        if algo == FP8_PB_WO:
            raise IncompatibleTargetError(
                f"group {group}: TensorRT-LLM reads ModelOpt's block FP8 ({FP8_PB_WO}) as FP8_BLOCK_SCALES only as a "
                "whole checkpoint's quant_algo; its mixed-precision loader takes each layer's quant_algo as written",
                fix="give the group another scheme (W8A8-FP8, W4A4-NVFP4, ...), or quantize the whole model "
                "W8A8-FP8-BLOCK")
    return by_group


def layer_config(algo: str, group_size: int | None) -> dict:
    """One entry of `quantized_layers`, as ModelOpt's process_layer_quant_config writes it for `algo`."""
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        return {"quant_algo": algo, "group_size": group_size, "has_zero_point": False, "pre_quant_scale": True}
    if algo == "NVFP4":
        return {"quant_algo": algo, "group_size": group_size}
    return {"quant_algo": algo}


def quantized_layers(qm: QuantizedModel, algos: dict[str, str]) -> dict[str, dict]:
    return {name: layer_config(algo, qm.scheme_of(name).weights.group_size) for name, algo in sorted(algos.items())}


def kv_cache_algo(scheme: Scheme) -> str | None:
    if scheme.kv_cache is None:
        return None
    return "FP8" if scheme.kv_cache.format == "fp8_e4m3" else "INT8"


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [out, in] (int8 storage, -8..7) -> uint8 [out/2, in]: row 2j in the low nibble, 2j+1 high."""
    if codes.shape[0] % 2:
        raise IncompatibleTargetError(f"INT4 packing needs an even output dimension, got {codes.shape[0]}",
                                      fix="leave this module unquantized (quantization.ignore)")
    nib = (codes.to(torch.int16) & 0x0F).to(torch.uint8)
    return (nib[0::2] | (nib[1::2] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_rows."""
    low, high = (packed & 0x0F).to(torch.int8), (packed >> 4).to(torch.int8)
    low, high = torch.where(low > 7, low - 16, low), torch.where(high > 7, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1])


# Linears TensorRT-LLM runs as one GEMM, so they share the GEMM's per-tensor scales.
FUSED_GEMMS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_gemm_of(name: str, quantized: list[str] | dict) -> list[str]:
    """The quantized Linears fused with `name` into one GEMM (itself included)."""
    parent, _, leaf = name.rpartition(".")
    for group in FUSED_GEMMS:
        if leaf in group:
            return [m for m in (f"{parent}.{g}" for g in group) if m in quantized]
    return [name]


def fp8_weight_operand(weight: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """The dequantized int4 weight as W4A8's FP8 GEMM uses it: rounded to FP8 on the per-tensor grid."""
    return (weight.float() / weight_scale_2).to(torch.float8_e4m3fn).float() * weight_scale_2


def w4a8_weight_scale_2(qm: QuantizedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """weight_scale_2 (float32 scalar) of every quantized Linear in one canonical file: max|code × scale| / 448
    over its fused GEMM."""
    from llmc.quant.spec import FP8_E4M3_MAX

    peak = {name: qm.dequantized_weight(tensors, name).abs().amax()
            for name in qm.quantized_modules if f"{name}.weight" in tensors and qm.scheme_of(name).name == "W4AFP8"}
    return {name: torch.stack([peak[m] for m in fused_gemm_of(name, peak)]).amax().float() / FP8_E4M3_MAX
            for name in peak}


def modelopt_tensors(qm: QuantizedModel, tensors: dict[str, torch.Tensor],
                     algos: dict[str, str]) -> dict[str, torch.Tensor]:
    """One canonical file's tensors under ModelOpt's names, dtypes and packing; `algos`: each quantized Linear's
    quant_algo (`layer_algos`)."""
    out = dict(tensors)
    dtype = getattr(torch, qm.meta.get("dtype", "float32"))
    scale_2 = w4a8_weight_scale_2(qm, tensors) if "W4A8_AWQ" in algos.values() else {}
    for name, info in qm.quantized_modules.items():
        if f"{name}.weight" not in out:
            continue
        algo = algos[name]
        if algo == "NVFP4":
            out.update(_nvfp4_tensors(out, name))
            continue
        if algo == FP8_PB_WO:
            codes, scale = out.pop(f"{name}.weight"), out.pop(f"{name}.weight_scale")
            out.update({f"{name}.{k}": t for k, t in modelopt_fp8_block_tensors(codes, scale).items()})
            continue
        scale = out.pop(f"{name}.weight_scale").float()
        if algo == "FP8":
            out[f"{name}.weight_scale"] = scale.reshape(())
            out[f"{name}.input_scale"] = out.pop(f"{name}.input_scale").float().reshape(())
        elif algo == "W8A8_SQ_PER_CHANNEL":
            out[f"{name}.weight_scale"] = scale.reshape(-1)
            out[f"{name}.input_scale"] = out.pop(f"{name}.input_scale").float().reshape(())
            out[f"{name}.pre_quant_scale"] = torch.ones(info["shape"][1], dtype=dtype)
        else:
            out[f"{name}.weight"] = pack_int4_rows(out[f"{name}.weight"])
            out[f"{name}.weight_scale"] = scale
            if algo == "W4A8_AWQ":
                out[f"{name}.weight_scale_2"] = scale_2[name].reshape(())
                out[f"{name}.input_scale"] = out.pop(f"{name}.input_scale").float().reshape(())
            if name.endswith(_NOT_NORM_FED):
                # ModelOpt keeps AWQ scales it cannot fold into a norm as pre_quant_scale on these;
                # ours are folded into the previous Linear already, so the multiplier is one.
                out[f"{name}.pre_quant_scale"] = torch.ones(info["shape"][1], dtype=dtype)
    for attn in qm.kv_cache_modules:
        for kind, proj in (("k", "k_proj"), ("v", "v_proj")):
            t = out.pop(f"{attn}.{kind}_scale", None)
            if t is not None:
                out[f"{attn}.{proj}.{kind}_scale"] = t.float().reshape(())
    return out


def _nvfp4_tensors(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Pop one NVFP4 Linear's canonical tensors (E2M1 codes, E4M3 block scales, global scale divisors) from `tensors`;
    return them in ModelOpt's layout and convention (`modelopt_nvfp4_tensors`, `modelopt_nvfp4_input_scale`)."""
    q = BlockQuantized(codes=tensors.pop(f"{name}.weight"), scale=tensors.pop(f"{name}.weight_scale"),
                       global_scale=tensors.pop(f"{name}.weight_global_scale"), format=NVFP4)
    out = {f"{name}.{k}": t for k, t in modelopt_nvfp4_tensors(q).items()}
    out[f"{name}.input_scale"] = modelopt_nvfp4_input_scale(tensors.pop(f"{name}.input_global_scale"))
    return out


def excluded_modules(qm: QuantizedModel) -> list[str]:
    """What ModelOpt lists as not quantized: the scheme's ignore list, the token embedding and every Linear left in
    the model's dtype (outside the decoder layers too)."""
    from safetensors import safe_open

    with safe_open(str(qm.root / "rest.safetensors"), "pt") as f:
        embeddings = [k.removesuffix(".weight") for k in f.keys() if k.endswith("embed_tokens.weight")]  # noqa: SIM118
    return sorted(set(qm.scheme.ignore) | set(embeddings) | set(qm.unquantized_linears))


def hf_quant_config(scheme: Scheme, algo: str, excluded: list[str], layers: dict[str, dict] | None = None) -> dict:
    """hf_quant_config.json; a mixed scheme: `layers` (`quantized_layers`), and no exclude_modules, as ModelOpt."""
    quantization: dict = {"quant_algo": algo, "kv_cache_quant_algo": kv_cache_algo(scheme)}
    if layers is not None:
        quantization["quantized_layers"] = layers
        return {"producer": {"name": "modelopt", "version": MODELOPT_LAYOUT_VERSION}, "quantization": quantization}
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        quantization.update({"group_size": scheme.weights.group_size, "has_zero_point": False, "pre_quant_scale": True})
    if algo == "NVFP4":
        quantization["group_size"] = scheme.weights.group_size
    quantization["exclude_modules"] = excluded
    return {"producer": {"name": "modelopt", "version": MODELOPT_LAYOUT_VERSION}, "quantization": quantization}


def config_quantization(scheme: Scheme, algo: str, excluded: list[str], layers: dict[str, dict] | None = None) -> dict:
    """config.json's quantization_config, as ModelOpt writes it beside hf_quant_config.json (a mixed scheme: with
    its `quantized_layers`, which vLLM's ModelOpt mixed-precision loader reads from here)."""
    q: dict = {}
    if layers is not None:
        q["quantized_layers"] = layers
    if algo == "FP8":
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        q["config_groups"] = {"group_0": {"input_activations": fp8, "weights": fp8, "targets": ["Linear"]}}
    elif algo == "NVFP4":
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": scheme.weights.group_size}
        q["config_groups"] = {"group_0": {"input_activations": fp4, "weights": dict(fp4), "targets": ["Linear"]}}
    q["ignore"] = excluded
    q["quant_algo"] = algo
    if scheme.kv_cache is not None:
        q["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8,
                                "type": "float" if scheme.kv_cache.format == "fp8_e4m3" else "int"}
    q["producer"] = {"name": "modelopt", "version": MODELOPT_LAYOUT_VERSION}
    q["quant_method"] = "modelopt"
    return q


def llm_api_options(scheme: Scheme, *, tensor_parallel: int, max_batch_size: int, max_num_tokens: int) -> str:
    """TensorRT-LLM LLM-API options (`trtllm-serve <dir> --extra_llm_api_options llmc-trtllm.yaml`)."""
    lines = [
        "# TensorRT-LLM LLM-API options written by llmc for this checkpoint",
        f"tensor_parallel_size: {tensor_parallel}",
        f"max_batch_size: {max_batch_size}",
        f"max_num_tokens: {max_num_tokens}",
    ]
    kv = kv_cache_algo(scheme)
    if kv:
        lines += ["kv_cache_config:", f"  dtype: {kv.lower()}"]
    return "\n".join(lines) + "\n"


def export_modelopt_hf(qm: QuantizedModel, out: Path, *, tensor_parallel: int = 1, max_batch_size: int = 8,
                       max_num_tokens: int = 8192) -> list[Path]:
    """Write the unified checkpoint (config.json, hf_quant_config.json, safetensors, tokenizer) + LLM-API YAML."""
    algos = layer_algos(qm)
    algo = MIXED_PRECISION if qm.scheme.mixed else quant_algo(qm.scheme)
    layers = quantized_layers(qm, algos) if qm.scheme.mixed else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = write_shards(out, (modelopt_tensors(qm, t, algos) for t in qm.iter_files()))
    config = dict(qm.config)
    excluded = excluded_modules(qm)
    config["quantization_config"] = config_quantization(qm.scheme, algo, excluded, layers)
    write_model_files(out, config, qm.root, dtype=qm.meta.get("dtype", "float32"))
    hq = hf_quant_config(qm.scheme, algo, excluded, layers)
    atomic_write_json(out / HF_QUANT_CONFIG, hq)
    if layers is not None:  # TensorRT-LLM's PyTorch loader reads a MIXED_PRECISION checkpoint's layers from here
        atomic_write_json(out / MIXED_QUANT_CONFIG, hq["quantization"])
    atomic_write_text(out / LLM_API_OPTIONS, llm_api_options(qm.scheme, tensor_parallel=tensor_parallel,
                                                             max_batch_size=max_batch_size, max_num_tokens=max_num_tokens))
    return written


# why llmc does not score a TensorRT-LLM artifact here (the report's and the gates' reason)
NEEDS_GPU = ("not evaluated here: TensorRT-LLM needs an NVIDIA GPU (layout conformance-tested against ModelOpt; "
             "on a GPU machine add tensorrt-llm to eval.runtimes)")


@register_format
class ModelOptCheckpoint(ArtifactFormat):
    name = "modelopt-hf"
    layout = ExportLayout(passes_8bit_codes=True, outer_weights_as_stored=True)  # llmc.formats.files.write_shards
    describes_linears = True  # its quantization_config is checked against the Linears (check_export)
    # TensorRT-LLM's PyTorch-backend model list (docs, 1.x): Gemma 2 and OLMo 2 are not in it
    families = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text", "phi3", "granite"})
    families_source = "TensorRT-LLM's PyTorch-backend model list"
    read_by = ("tensorrt-llm",)
    triton_backend = "tensorrt_llm"
    mixed_precision = True  # quant_algo MIXED_PRECISION + quantized_layers, as ModelOpt writes it (modelopt_hf.py)
    fuses_projections = True  # vLLM's / TensorRT-LLM's qkv_proj and gate_up_proj: one scheme per fused GEMM
    unevaluated = NEEDS_GPU
    proof = ("conformance only (TensorRT-LLM needs a GPU): tensor names, dtypes, shapes and config keys equal "
             "NVIDIA ModelOpt 0.47's own export of the same model for FP8(+KV), INT8-SQ, INT4-AWQ, W4A8-AWQ, NVFP4 "
             "and block FP8 (tests marked peers); values decode to the canonical weights exactly (NVFP4: within the "
             "float32 rounding of ModelOpt's reciprocal global scale)")

    def check_scheme(self, scheme) -> None:
        quant_algo(scheme)  # raises for schemes ModelOpt's format has no quant_algo for

    def check_mixed(self, scheme) -> None:
        super().check_mixed(scheme)
        if scheme.mixed:
            group_algos(scheme)  # raises for a group quantized_layers cannot hold (block FP8)

    @staticmethod
    def _options(request: ExportRequest) -> dict:
        return {"tensor_parallel": request.target.tensor_parallel, "max_batch_size": request.max_batch_size,
                "max_num_tokens": 8192}

    def stage_config(self, request: ExportRequest) -> dict:
        return {"target": target_key(request.target), "options": self._options(request)}

    def write(self, request: ExportRequest, out: Path) -> None:
        export_modelopt_hf(request.quantized, out, **self._options(request))

    def recognizes(self, path: Path) -> bool:
        q = quantization_config(path) or {}
        return q.get("quant_method") == "modelopt" and (path / "hf_quant_config.json").is_file()

    def describe(self, path: Path) -> str:
        config = read_json(path / "config.json") or {}
        arch = architectures(config)
        hq = read_json(path / HF_QUANT_CONFIG)["quantization"]
        lines = [
            f"ModelOpt unified Hugging Face checkpoint (TensorRT-LLM) at {path} ({arch})",
            f"  quant_algo {hq['quant_algo']}, KV cache {hq.get('kv_cache_quant_algo') or 'unquantized'}"
            + (f", group {hq['group_size']}" if hq.get("group_size") else "")
            + (f"; {len(hq['quantized_layers'])} quantized layers: " + ", ".join(
                f"{n} {algo}" for algo, n in sorted(_count(x["quant_algo"] for x in hq["quantized_layers"].values()).items()))
               if "quantized_layers" in hq else f"; not quantized: {hq.get('exclude_modules')}"),
            "  accepted by: TensorRT-LLM (LLM API / trtllm-serve) on an NVIDIA GPU; transformers loads this format "
            "silently wrong (ignores the scales): do not evaluate it there",
        ]
        if (path / LLM_API_OPTIONS).is_file():
            lines.append(f"  serve with: trtllm-serve {path} --extra_llm_api_options {path / LLM_API_OPTIONS}")
        return "\n".join(lines)


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
