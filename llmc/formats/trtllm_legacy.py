"""Export the canonical quantized form as a legacy TensorRT-LLM checkpoint (`trtllm-build` input): one
config.json with the parallel mapping and rank{N}.safetensors per tensor-parallel rank.

Layout as NVIDIA ModelOpt 0.47's `export_tensorrt_llm_checkpoint` writes it for Llama-family models
(the conformance test compares with it at TP=2):

    Hugging Face                      TensorRT-LLM                  split across ranks
    embed_tokens                      transformer.vocab_embedding   rows (vocab), padded to a multiple of TP
    q_proj | k_proj | v_proj          attention.qkv (fused)         each part by heads, then concatenated
    o_proj                            attention.dense               columns (row-parallel)
    gate_proj                         mlp.fc                        rows (column-parallel)
    up_proj                           mlp.gate                      rows
    down_proj                         mlp.proj                      columns
    input/post_attention_layernorm    input_layernorm/post_layernorm   replicated
    norm, lm_head                     transformer.ln_f, lm_head     replicated / rows (vocab)

FP8 only (per-tensor weights, static per-tensor activations, optional FP8 KV cache): every quantized
Linear has `weights_scaling_factor` and `activation_scaling_factor` of shape (1,), and attention a
`kv_cache_scaling_factor` (max of K and V) with `k_cache_scaling_factor` / `v_cache_scaling_factor`.
TensorRT-LLM fuses q/k/v (and gate/up) into one GEMM with one weight scale, so their codes are re-rounded
onto the largest of their scales (ModelOpt does the same); the added q/k/v error is measured and returned.
INT8-SQ / INT4-AWQ for TensorRT-LLM go through the unified checkpoint (`modelopt_hf.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.formats.base import ArtifactFormat, ExportLayout, ExportRequest, read_json, target_key
from llmc.formats.registry import register_format
from llmc.formats.modelopt_hf import NEEDS_GPU
from llmc.formats.files import copy_tokenizer_files
from llmc.formats.modelopt_hf import MODELOPT_LAYOUT_VERSION
from llmc.errors import IncompatibleTargetError
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import FP8_E4M3_MAX, Scheme
from llmc.storage.store import atomic_save_safetensors, atomic_write_json

_LINEARS = {  # HF suffix -> (TRT-LLM name, split dim: 0 column-parallel, 1 row-parallel)
    "self_attn.o_proj": ("attention.dense", 1),
    "mlp.gate_proj": ("mlp.fc", 0),
    "mlp.up_proj": ("mlp.gate", 0),
    "mlp.down_proj": ("mlp.proj", 1),
}
_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_layernorm"}


@dataclass
class LegacyExport:
    ranks: int
    files: list[Path]
    qkv_requantization_error: float  # max relative RMS change of fused q/k/v weights


def check_scheme(scheme: Scheme) -> None:
    w, a = scheme.weights, scheme.activations
    ok = (w.format == "fp8_e4m3" and w.strategy == "tensor" and a is not None and a.format == "fp8_e4m3"
          and a.strategy == "tensor" and not a.dynamic and (scheme.kv_cache is None or scheme.kv_cache.format == "fp8_e4m3"))
    if not ok:
        raise IncompatibleTargetError(
            f"the legacy TensorRT-LLM checkpoint exporter writes FP8 (per-tensor weights + static activations) only, "
            f"not {scheme.name}",
            fix="use the unified checkpoint (runtime tensorrt-llm, version >=0.17) or an FP8 per-tensor scheme",
        )


def _fp8_requantize(codes: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    return (codes.float() * (scale / new_scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _split(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise IncompatibleTargetError(f"dimension {t.shape[dim]} does not split over tensor_parallel {tp}",
                                      fix="choose a tensor_parallel that divides the model's head and MLP sizes")
    return t.chunk(tp, dim=dim)[rank].contiguous()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _heads_split(t: torch.Tensor, n_heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rows of `rank`'s heads; KV heads fewer than TP are replicated (each rank gets its group's head)."""
    if n_heads >= tp:
        return _split(t, 0, tp, rank)
    if tp % n_heads:
        raise IncompatibleTargetError(f"{n_heads} KV heads cannot be replicated over tensor_parallel {tp}",
                                      fix="choose a tensor_parallel that divides or is a multiple of the KV heads")
    head = rank * n_heads // tp
    return t[head * head_dim : (head + 1) * head_dim].contiguous()


def rank_tensors(qm: QuantizedModel, tensors: dict[str, torch.Tensor], layers_prefix: str, tp: int, rank: int,
                 dtype: torch.dtype, errors: list[float]) -> dict[str, torch.Tensor]:
    """One canonical file (a decoder layer, or the rest) as rank `rank`'s TensorRT-LLM tensors."""
    cfg = qm.config
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    out: dict[str, torch.Tensor] = {}
    layers = {int(k[len(layers_prefix) + 1 :].split(".")[0]) for k in tensors if k.startswith(layers_prefix + ".")}
    for i in sorted(layers):
        hf, trt = f"{layers_prefix}.{i}.", f"transformer.layers.{i}."
        parts = [hf + f"self_attn.{p}_proj" for p in "qkv"]
        common = torch.stack([tensors[p + ".weight_scale"].reshape(()) for p in parts]).amax()
        fused = []
        for p, heads in zip(parts, (n_heads, n_kv, n_kv)):
            codes, scale = tensors[p + ".weight"], tensors[p + ".weight_scale"].reshape(())
            requantized = _fp8_requantize(codes, scale, common)
            before, after = codes.float() * scale, requantized.float() * common
            errors.append(float((after - before).pow(2).mean().sqrt() / before.pow(2).mean().sqrt().clamp_min(1e-30)))
            fused.append(_heads_split(requantized, heads, head_dim, tp, rank))
        out[trt + "attention.qkv.weight"] = torch.cat(fused)
        out[trt + "attention.qkv.weights_scaling_factor"] = common.reshape(1).float()
        out[trt + "attention.qkv.activation_scaling_factor"] = torch.stack(
            [tensors[p + ".input_scale"].reshape(()) for p in parts]).amax().reshape(1).float()
        # gate_proj and up_proj run as one fused GEMM too: one weight scale for both (as ModelOpt does)
        mlp_scale = torch.maximum(tensors[hf + "mlp.gate_proj.weight_scale"].reshape(()),
                                  tensors[hf + "mlp.up_proj.weight_scale"].reshape(()))
        for suffix, (name, dim) in _LINEARS.items():
            codes, scale = tensors[hf + suffix + ".weight"], tensors[hf + suffix + ".weight_scale"].reshape(())
            if suffix in ("mlp.gate_proj", "mlp.up_proj"):
                codes, scale = _fp8_requantize(codes, scale, mlp_scale), mlp_scale
            out[trt + name + ".weight"] = _split(codes, dim, tp, rank)
            out[trt + name + ".weights_scaling_factor"] = scale.reshape(1).float().clone()
            out[trt + name + ".activation_scaling_factor"] = tensors[hf + suffix + ".input_scale"].reshape(1).float()
        for suffix, name in _NORMS.items():
            out[trt + name + ".weight"] = tensors[hf + suffix + ".weight"].to(dtype)
        if hf + "self_attn.k_scale" in tensors:
            k, v = tensors[hf + "self_attn.k_scale"].reshape(1).float(), tensors[hf + "self_attn.v_scale"].reshape(1).float()
            out[trt + "attention.kv_cache_scaling_factor"] = torch.maximum(k, v)  # older runtimes: one scale
            out[trt + "attention.k_cache_scaling_factor"] = k
            out[trt + "attention.v_cache_scaling_factor"] = v
    embed = next((t for k, t in tensors.items() if k.endswith("embed_tokens.weight")), None)
    if embed is not None:
        out["transformer.vocab_embedding.weight"] = _split(_pad_rows(embed.to(dtype), tp), 0, tp, rank)
        head = tensors.get("lm_head.weight", embed)  # tied: TensorRT-LLM keeps its own lm_head copy
        out["lm_head.weight"] = _split(_pad_rows(head.to(dtype), tp), 0, tp, rank)
    norm = next((t for k, t in tensors.items() if k.endswith(".norm.weight") and not k.startswith(layers_prefix + ".")), None)
    if norm is not None:
        out["transformer.ln_f.weight"] = norm.to(dtype)
    return out


def legacy_config(qm: QuantizedModel, tp: int, dtype: str) -> dict:
    cfg = qm.config
    n_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    config = {
        "producer": {"name": "modelopt", "version": MODELOPT_LAYOUT_VERSION},
        "architecture": "LlamaForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float16" if dtype == "bfloat16" else dtype,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", n_heads),
        "hidden_size": cfg["hidden_size"],
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "head_size": cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        "intermediate_size": cfg["intermediate_size"],
        "position_embedding_type": "rope_gpt_neox",
        "share_embedding_table": False,
        "residual_mlp": False,
        "bias": bool(cfg.get("attention_bias", False)),
        "rotary_pct": 1.0,
        "rank": 0,
        "decoder": "llama",
        "rmsnorm": True,
        "lm_head_bias": False,
        # ModelOpt 0.47 under transformers 5 leaves this out (it reads rope_theta where transformers 5 no
        # longer keeps it); TensorRT-LLM would then assume 10000, wrong for e.g. SmolLM2 (100000).
        "rotary_base": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8" if qm.scheme.kv_cache else None,
            # TensorRT-LLM names: the embedding is never a quantization candidate there
            "exclude_modules": sorted(set(qm.scheme.ignore)),
        },
    }
    return config


def export_trtllm_legacy(qm: QuantizedModel, out: Path, *, tensor_parallel: int = 1, dtype: str = "float16") -> LegacyExport:
    """Write config.json + rank{N}.safetensors for `tensor_parallel` ranks.

    safetensors files cannot be appended to, so the rank files are assembled in memory: peak memory is
    the quantized model (not the source model), unlike the other exporters, which stream per layer."""
    check_scheme(qm.scheme)
    if qm.config.get("model_type") not in ("llama", "mistral", "qwen2"):
        raise IncompatibleTargetError(f"the legacy TensorRT-LLM layout here covers Llama-family models, not "
                                      f"{qm.config.get('model_type')}", fix="use the unified checkpoint")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    prefix = next(iter(qm.quantized_modules)).split(".layers.")[0] + ".layers"
    errors: list[float] = []
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tensor_parallel)]
    for tensors in qm.iter_files():
        for r in range(tensor_parallel):
            ranks[r].update(rank_tensors(qm, tensors, prefix, tensor_parallel, r, torch_dtype, errors if r == 0 else []))
    files = []
    for r, t in enumerate(ranks):
        atomic_save_safetensors(out / f"rank{r}.safetensors", t)
        files.append(out / f"rank{r}.safetensors")
    atomic_write_json(out / "config.json", legacy_config(qm, tensor_parallel, dtype))
    copy_tokenizer_files(qm.root, out)
    return LegacyExport(ranks=tensor_parallel, files=files, qkv_requantization_error=max(errors, default=0.0))


@register_format
class LegacyCheckpoint(ArtifactFormat):
    name = "trtllm-checkpoint"
    layout = ExportLayout(shards_by_tp=True)  # rank{N}.safetensors per tensor-parallel rank
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = "llmc's legacy per-rank layout maps Llama-family weights only"
    unevaluated = NEEDS_GPU
    triton_refusal = (
        "triton: true is not available for the legacy TensorRT-LLM per-rank checkpoint (trtllm-checkpoint): "
        "Triton cannot serve it until trtllm-build compiles it into an engine on the target GPU",
        "let the tensorrt-llm target's version range include >=0.17 (ModelOpt checkpoint, served by the "
        "LLM API), or drop triton: true and run trtllm-build on the serving machine")
    proof = ("conformance only (GPU): per-rank layout and config keys equal ModelOpt 0.47's "
             "export_tensorrt_llm_checkpoint at TP=2 (FP8+KV); TP shards re-merge exactly into the TP=1 tensors "
             "(tests marked peers)")

    def check_scheme(self, scheme) -> None:
        check_scheme(scheme)

    @staticmethod
    def _options(request: ExportRequest) -> dict:
        return {"tensor_parallel": request.target.tensor_parallel, "dtype": "float16"}

    def stage_config(self, request: ExportRequest) -> dict:
        return {"target": target_key(request.target), "options": self._options(request)}

    def write(self, request: ExportRequest, out: Path) -> None:
        export_trtllm_legacy(request.quantized, out, **self._options(request))

    def recognizes(self, path: Path) -> bool:
        return (path / "config.json").is_file() and (path / "rank0.safetensors").is_file()

    def describe(self, path: Path) -> str:
        cfg = read_json(path / "config.json") or {}
        q, m = cfg.get("quantization") or {}, cfg.get("mapping") or {}
        return "\n".join([
            f"TensorRT-LLM checkpoint (legacy, per rank) at {path} ({cfg.get('architecture')}, dtype {cfg.get('dtype')})",
            f"  quant_algo {q.get('quant_algo')}, KV cache {q.get('kv_cache_quant_algo') or 'unquantized'}; "
            f"tp_size {m.get('tp_size')}, pp_size {m.get('pp_size')}: "
            + ", ".join(sorted(p.name for p in path.glob("rank*.safetensors"))),
            f"  accepted by: trtllm-build (TensorRT-LLM < 0.17 and later) on an NVIDIA GPU: "
            f"trtllm-build --checkpoint_dir {path} --output_dir <engine dir>",
        ])
