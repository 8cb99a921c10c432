"""TensorRT-LLM: the ModelOpt-style unified checkpoint (llmc.formats.modelopt_hf) from 0.17 on, the legacy
per-rank checkpoint for trtllm-build (llmc.formats.trtllm_legacy) for targets pinned below it."""

from __future__ import annotations

from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llmc.runtimes.base import (
    ArtifactFormat,
    ExportRequest,
    MatrixRow,
    Rule,
    Runtime,
    architectures,
    quantization_config,
    read_json,
    target_key,
)
from llmc.runtimes.registry import register_format, register_runtime

# TensorRT-LLM reads the unified (ModelOpt HF) checkpoint from this version; a target pinned below it gets the
# legacy per-rank checkpoint for trtllm-build.
UNIFIED_SINCE = "0.17.0"
_NEEDS_GPU = ("not evaluated here: TensorRT-LLM needs an NVIDIA GPU (layout conformance-tested against ModelOpt; "
              "on a GPU machine add tensorrt-llm to eval.runtimes)")


@register_format
class ModelOptCheckpoint(ArtifactFormat):
    name = "modelopt-hf"
    passes_8bit_codes = True
    outer_weights_as_stored = True  # llmc.formats.files.write_shards
    # TensorRT-LLM's PyTorch-backend model list (docs, 1.x): Gemma 2 and OLMo 2 are not in it
    families = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text", "phi3", "granite"})
    families_source = "TensorRT-LLM's PyTorch-backend model list"
    read_by = ("tensorrt-llm",)
    triton_backend = "tensorrt_llm"
    mixed_precision = True  # quant_algo MIXED_PRECISION + quantized_layers, as ModelOpt writes it (modelopt_hf.py)
    fuses_projections = True  # vLLM's / TensorRT-LLM's qkv_proj and gate_up_proj: one scheme per fused GEMM
    unevaluated = _NEEDS_GPU
    proof = ("conformance only (TensorRT-LLM needs a GPU): tensor names, dtypes, shapes and config keys equal "
             "NVIDIA ModelOpt 0.47's own export of the same model for FP8(+KV), INT8-SQ, INT4-AWQ, W4A8-AWQ, NVFP4 "
             "and block FP8 (tests marked peers); values decode to the canonical weights exactly (NVFP4: within the "
             "float32 rounding of ModelOpt's reciprocal global scale)")

    def check_scheme(self, scheme) -> None:
        from llmc.formats.modelopt_hf import quant_algo

        quant_algo(scheme)  # raises for schemes ModelOpt's format has no quant_algo for

    def check_mixed(self, scheme) -> None:
        from llmc.formats.modelopt_hf import group_algos

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
        from llmc.formats.modelopt_hf import export_modelopt_hf

        export_modelopt_hf(request.quantized, out, **self._options(request))

    def recognizes(self, path: Path) -> bool:
        q = quantization_config(path) or {}
        return q.get("quant_method") == "modelopt" and (path / "hf_quant_config.json").is_file()

    def describe(self, path: Path) -> str:
        from llmc.formats.modelopt_hf import HF_QUANT_CONFIG, LLM_API_OPTIONS

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


@register_format
class LegacyCheckpoint(ArtifactFormat):
    name = "trtllm-checkpoint"
    shards_by_tp = True  # rank{N}.safetensors per tensor-parallel rank
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = "llmc's legacy per-rank layout maps Llama-family weights only"
    unevaluated = _NEEDS_GPU
    triton_refusal = (
        "triton: true is not available for the legacy TensorRT-LLM per-rank checkpoint (trtllm-checkpoint): "
        "Triton cannot serve it until trtllm-build compiles it into an engine on the target GPU",
        "let the tensorrt-llm target's version range include >=0.17 (ModelOpt checkpoint, served by the "
        "LLM API), or drop triton: true and run trtllm-build on the serving machine")
    proof = ("conformance only (GPU): per-rank layout and config keys equal ModelOpt 0.47's "
             "export_tensorrt_llm_checkpoint at TP=2 (FP8+KV); TP shards re-merge exactly into the TP=1 tensors "
             "(tests marked peers)")

    def check_scheme(self, scheme) -> None:
        from llmc.formats.trtllm_legacy import check_scheme

        check_scheme(scheme)

    @staticmethod
    def _options(request: ExportRequest) -> dict:
        return {"tensor_parallel": request.target.tensor_parallel, "dtype": "float16"}

    def stage_config(self, request: ExportRequest) -> dict:
        return {"target": target_key(request.target), "options": self._options(request)}

    def write(self, request: ExportRequest, out: Path) -> None:
        from llmc.formats.trtllm_legacy import export_trtllm_legacy

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


class TensorRtLlm(Runtime):
    def format_for(self, version: str | None) -> str:
        """A version range that admits no release from UNIFIED_SINCE on gets the legacy checkpoint."""
        if version:
            spec = SpecifierSet(version)
            if not any(Version(v) >= Version(UNIFIED_SINCE) and v in spec for v in self.known_versions):
                return LegacyCheckpoint.name
        return self.format

    def matrix_rows(self) -> list[MatrixRow]:
        newer = tuple(v for v in self.known_versions if Version(v) >= Version(UNIFIED_SINCE))
        older = tuple(v for v in self.known_versions if Version(v) < Version(UNIFIED_SINCE))
        return [MatrixRow(self.name, self.format, newer),
                MatrixRow(f"{self.name} (pinned <{UNIFIED_SINCE})", LegacyCheckpoint.name, older)]


_TRTLLM_MATRIX = "NVIDIA/TensorRT-LLM: docs/source/reference/support-matrix.md (quantization by GPU arch)"

register_runtime(TensorRtLlm(
    name="tensorrt-llm",
    format=ModelOptCheckpoint.name,
    rules={
        "W8A8-FP8": Rule("sm89", since="0.9.0",
                         refuse_reason="TensorRT-LLM has no FP8 GEMM before Ada (sm89); on A100 "
                         "use W8A8-INT8 (SmoothQuant) or W4A16 (AWQ)", source=_TRTLLM_MATRIX),
        "W8A8-INT8": Rule("sm80", since="0.7.0", refuse_reason="SmoothQuant INT8 kernels need sm80+", source=_TRTLLM_MATRIX),
        "W8A16-INT8": Rule("sm80", since="0.7.0", refuse_reason="weight-only kernels need sm80+", source=_TRTLLM_MATRIX),
        "W4A16-INT": Rule("sm80", since="0.7.0", refuse_reason="INT4 AWQ kernels need sm80+", source=_TRTLLM_MATRIX),
        "W4AFP8": Rule("sm89", since="0.10.0", refuse_reason="W4A8 AWQ needs FP8 tensor cores (sm89+)", source=_TRTLLM_MATRIX),
        "W4A4-NVFP4": Rule("sm100", since="0.17.0", refuse_reason="NVFP4 needs Blackwell (sm100+)", source=_TRTLLM_MATRIX),
        # ModelOpt's fp8_pb_wo read as FP8_BLOCK_SCALES (its 4-D weight_scale squeezed) from release 1.0 on
        "W8A8-FP8-BLOCK": Rule("sm90", since="1.0.0",
                               refuse_reason="TensorRT-LLM's block-scaled FP8 GEMM (FP8_BLOCK_SCALES) needs Hopper "
                               "(sm90+); on Ada use W8A8-FP8", source=_TRTLLM_MATRIX),
        "KV-FP8": Rule("sm89", since="0.9.0", refuse_reason="FP8 KV cache needs sm89+", source=_TRTLLM_MATRIX),
        "KV-INT8": Rule("sm80", since="0.7.0", refuse_reason="INT8 KV cache needs sm80+", source=_TRTLLM_MATRIX),
    },
    known_versions=("0.7.0", "0.9.0", "0.10.0", "0.12.0", "0.17.0", "0.20.0", "1.0.0"),
))
