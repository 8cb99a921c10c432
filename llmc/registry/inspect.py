"""`llmc inspect`: say what a path is and which runtimes accept it."""

from __future__ import annotations

import json
from pathlib import Path

from llmc.compiler.capabilities import RULES, arch_span, scheme_keys
from llmc.compiler.files import SERVE_FILE
from llmc.errors import InputError
from llmc.quant.canonical import META_FILE, QuantizedModel
from llmc.quant.spec import Scheme


def _scheme_from_ct(qcfg: dict) -> Scheme:
    from llmc.engines.torch_ref import _spec_from_args

    group = next(iter(qcfg["config_groups"].values()))
    return Scheme(
        weights=_spec_from_args(group["weights"]),
        activations=_spec_from_args(group["input_activations"]) if group.get("input_activations") else None,
        kv_cache=_spec_from_args(qcfg["kv_cache_scheme"]) if qcfg.get("kv_cache_scheme") else None,
        ignore=tuple(qcfg.get("ignore") or ()),
    )


def accepting_runtimes(scheme: Scheme) -> list[str]:
    """'runtime (arch)' for each runtime whose rules admit every capability the scheme needs."""
    out = []
    keys = scheme_keys(scheme)
    for runtime in sorted({r for r, _ in RULES}):
        rules = [RULES.get((runtime, k)) for k in keys]
        if any(r is None for r in rules):
            continue
        native = max((r.native_from for r in rules if r.native_from), default=None, key=_arch_rank)
        until = min((r.native_until for r in rules if r.native_until), default=None, key=_arch_rank)
        where = arch_span(native, until) if native else ""
        if all(r.cpu for r in rules):
            where += (", " if where else "") + "cpu"
        degraded = [r.degraded_from for r in rules if r.degraded_from]
        if degraded:
            where += f"; degraded from {max(degraded, key=_arch_rank)}"
        out.append(f"{runtime} ({where})")
    return out


def _arch_rank(a: str | None) -> int:
    from llmc.compiler.capabilities import ARCH_ORDER

    return ARCH_ORDER.index(a) if a else -1


def _describe_gguf(path: Path) -> str:
    from gguf import GGUFReader

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
    arch = field("general.architecture")
    return "\n".join([
        f"GGUF file {path} ({arch}, {len(reader.tensors)} tensors: "
        + ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1])) + ")",
        f"  scheme {field('llmc.scheme') or '?'}; linear weights {field('llmc.gguf.weight_type') or '?'} "
        f"({field('llmc.gguf.weight_method') or 'not written by llmc'})",
        "  accepted by: llama.cpp (CPU and GPU builds), Ollama (with the Modelfile beside it)",
    ])


def _serve_line(path: Path) -> list[str]:
    serve = path / SERVE_FILE
    return [f"  serve with: {json.loads(serve.read_text())['command']}"] if serve.is_file() else []


def _describe_onnx(path: Path) -> str:
    from collections import Counter

    import onnx

    cfg = json.loads((path / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    graph = onnx.load(str(path / dec["filename"]), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    blocks = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name in ("bits",)}
    serve = path / SERVE_FILE
    extra = json.loads(serve.read_text()) if serve.is_file() else {}
    return "\n".join([
        f"ONNX Runtime model folder (onnxruntime-genai) at {path} ({cfg.get('type')}, {dec['num_hidden_layers']} layers)",
        "  ops: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        + (f"; MatMulNBits bits {sorted(blocks)}" if blocks else ""),
        f"  {extra.get('weights', 'not written by llmc')}"
        + (f"; accuracy_level {extra['accuracy_level']} ({extra['activations']})" if "accuracy_level" in extra else ""),
        "  accepted by: onnxruntime (CPU EP here; CUDA/DML EPs run MatMulNBits too), onnxruntime-genai "
        f"(og.Model('{path}'))",
    ])


def _describe_onnx_qdq(path: Path) -> str:
    from collections import Counter

    import onnx

    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    serve = path / SERVE_FILE
    extra = json.loads(serve.read_text()) if serve.is_file() else {}
    return "\n".join([
        f"ONNX Q/DQ graph at {path} (input_ids -> logits, no KV cache)",
        f"  ops: {ops['DequantizeLinear']} DequantizeLinear, {ops['QuantizeLinear']} QuantizeLinear, "
        f"{ops['MatMul']} MatMul, {sum(ops.values())} nodes in all",
        f"  scheme {extra.get('scheme', '?')}: weights {extra.get('weights', 'not written by llmc')}; "
        f"activations {extra.get('activations', '?')}",
        "  accepted by: onnxruntime (CPU EP here), TensorRT (engine: "
        + extra.get("tensorrt", {}).get("build", "trtexec --onnx=model.onnx --stronglyTyped") + ")",
    ])


def describe(path: Path) -> str:
    path = Path(path)
    if (path / "manifest.json").is_file():
        from llmc.registry.local import verify_entry

        m = json.loads((path / "manifest.json").read_text())
        bad = verify_entry(path)
        rep = m["report"]
        lines = [
            f"registry entry {path}",
            f"  build {m['build_id']} of recipe '{m['recipe']['name']}', scheme {rep['scheme']}, llmc {m['llmc_version']}",
            f"  model {m['model']['source']} (sha256 {m['model']['sha256']})",
            f"  gates: {'all passed' if rep['passed'] else 'FAILED'}; files: {len(m['files'])}, "
            + ("all sha256 match the manifest" if not bad else f"MODIFIED/MISSING: {', '.join(bad)}"),
        ]
        for label, t in rep["targets"].items():
            lines.append(f"  artifact {label}: {t['exporter']} at artifacts/{label}")
        return "\n".join(lines)
    if (path / META_FILE).is_file():
        qm = QuantizedModel.open(path)
        s = qm.scheme
        return "\n".join([
            f"llmc canonical quantized form at {path}",
            f"  scheme {s.name} ({s.algorithm}): weights {s.weights.describe()}"
            + (f", activations {s.activations.describe()}" if s.activations else "")
            + (f", KV cache {s.kv_cache.format}" if s.kv_cache else ""),
            f"  {len(qm.quantized_modules)} quantized Linear modules in {len(qm.files()) - 1} layers; "
            f"source {qm.meta['source']['origin']} ({qm.meta['source']['sha256']})",
            "  exporters read this; runtimes do not",
        ])
    if (path / "genai_config.json").is_file():
        return _describe_onnx(path)
    if (path / "model.onnx").is_file():
        return _describe_onnx_qdq(path)
    gguf_file = path if path.suffix == ".gguf" else path / "model.gguf"
    if gguf_file.is_file():
        return _describe_gguf(gguf_file)
    if (path / "config.json").is_file() and (path / "rank0.safetensors").is_file():
        cfg = json.loads((path / "config.json").read_text())
        q, m = cfg.get("quantization") or {}, cfg.get("mapping") or {}
        return "\n".join([
            f"TensorRT-LLM checkpoint (legacy, per rank) at {path} ({cfg.get('architecture')}, dtype {cfg.get('dtype')})",
            f"  quant_algo {q.get('quant_algo')}, KV cache {q.get('kv_cache_quant_algo') or 'unquantized'}; "
            f"tp_size {m.get('tp_size')}, pp_size {m.get('pp_size')}: "
            + ", ".join(sorted(p.name for p in path.glob("rank*.safetensors"))),
            f"  accepted by: trtllm-build (TensorRT-LLM < 0.17 and later) on an NVIDIA GPU: "
            f"trtllm-build --checkpoint_dir {path} --output_dir <engine dir>",
        ])
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        q = cfg.get("quantization_config")
        arch = ", ".join(cfg.get("architectures", []) or ["?"])
        if q is None:
            return f"unquantized Hugging Face checkpoint at {path} ({arch}, dtype {cfg.get('dtype') or cfg.get('torch_dtype')})"
        if q.get("quant_method") == "modelopt" and (path / "hf_quant_config.json").is_file():
            hq = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
            lines = [
                f"ModelOpt unified Hugging Face checkpoint (TensorRT-LLM) at {path} ({arch})",
                f"  quant_algo {hq['quant_algo']}, KV cache {hq.get('kv_cache_quant_algo') or 'unquantized'}"
                + (f", group {hq['group_size']}" if hq.get("group_size") else "")
                + f"; not quantized: {hq.get('exclude_modules')}",
                "  accepted by: TensorRT-LLM (LLM API / trtllm-serve) on an NVIDIA GPU; transformers loads this format "
                "silently wrong (ignores the scales): do not evaluate it there",
            ]
            if (path / "llmc-trtllm.yaml").is_file():
                lines.append(f"  serve with: trtllm-serve {path} --extra_llm_api_options {path / 'llmc-trtllm.yaml'}")
            return "\n".join(lines)
        if q.get("quant_method") == "gptq" and "llmc" in (q.get("meta") or {}).get("quantizer", []):
            return "\n".join([
                f"GPTQ-format checkpoint (v1 layout, written by llmc) at {path} ({arch})",
                f"  {q['bits']}-bit, group {q['group_size']}, {'symmetric' if q.get('sym') else 'asymmetric'}, "
                f"desc_act {q.get('desc_act')}; algorithm {(q.get('meta') or {}).get('algorithm')}",
                "  accepted by: ExLlamaV2, transformers + GPTQModel, vLLM (gptq/marlin), onnxruntime-genai's model builder",
            ] + _serve_line(path))
        if q.get("quant_method") == "awq":
            return "\n".join([
                f"AWQ checkpoint ({q.get('version', 'gemm').upper()} layout) at {path} ({arch})",
                f"  {q.get('bits')}-bit, group {q.get('group_size')}, zero point {q.get('zero_point')}",
                "  accepted by: LMDeploy TurboMind (--model-format awq), vLLM (awq/awq_marlin), transformers + AutoAWQ/"
                "GPTQModel, onnxruntime-genai's model builder; all need an NVIDIA GPU except the builder",
            ] + _serve_line(path))
        if q.get("quant_method") != "compressed-tensors":
            return f"Hugging Face checkpoint at {path} ({arch}) quantized with {q.get('quant_method')} (not produced by llmc)"
        s = _scheme_from_ct(q)
        lines = [
            f"compressed-tensors checkpoint at {path} ({arch})",
            f"  scheme {s.name}: format {q.get('format')}, weights {s.weights.describe()}"
            + (f", activations {s.activations.describe()}" if s.activations else "")
            + (f", KV cache {s.kv_cache.format}" if s.kv_cache else "")
            + f"; ignore {list(s.ignore)}; written with compressed-tensors {q.get('version')}",
            "  accepted by: " + "; ".join(r for r in accepting_runtimes(s) if r.split()[0] in ("vllm", "sglang", "tgi")),
        ]
        if (path / SERVE_FILE).is_file():
            lines.append("  serve with: " + json.loads((path / SERVE_FILE).read_text())["command"])
        return "\n".join(lines)
    raise InputError(f"{path} is not an llmc artifact, quantized form or registry entry",
                     fix="pass a folder with config.json, quantized.json or manifest.json")
