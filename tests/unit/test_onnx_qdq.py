"""8-bit schemes as Q/DQ ONNX: the standard-op graph TensorRT builds engines from (llmc.formats.onnx_qdq,
no KV cache) and the onnxruntime-genai folder with the codes put back as Q/DQ (llmc.formats.onnx_genai,
KV cache + fused attention): codes in the graph, numerics against the torch reference of the same
canonical form, refusals, and the build wiring. Tiny random llama; onnxruntime runs on the CPU in the
default test run; the TensorRT engine test needs a GPU with the tensorrt package."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from llmc.runtimes.catalog import runtime
from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.formats.onnx_qdq import check_scheme, export_onnx_qdq
from llmc.engines.onnxrt import OnnxRuntimeEngine
from llmc.engines.torch_ref import TorchEngine
from llmc.errors import IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model
from llmc.result import EvalId

SCHEMES = {
    "w8a8-int8-static": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor")),
    "w4a16-g32-asym": Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False)),
    "w8a8-fp8-static": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
    "w8a16-int8": Scheme(TensorSpec("int8", "channel")),
}
CODE_TYPES = {"int8": TensorProto.INT8, "int4": TensorProto.INT4, "fp8_e4m3": TensorProto.FLOAT8E4M3FN}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_session: Path) -> dict[str, tuple[QuantizedModel, Path, Path]]:
    """scheme -> (canonical form, Q/DQ ONNX folder, compressed-tensors export of the same form)."""
    root = tmp_path_factory.mktemp("qdq")
    calib = torch.randint(3, 300, (8, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, scheme in SCHEMES.items():
        q = root / f"q-{name}"
        quantize_model(ModelSource(tiny_model_session, "test", "test"), scheme, q,
                       Calibration(calib) if scheme.needs_calibration else None)
        qm = QuantizedModel.open(q)
        export_onnx_qdq(qm, root / f"onnx-{name}")
        export_compressed_tensors(qm, root / f"ct-{name}")
        out[name] = (qm, root / f"onnx-{name}", root / f"ct-{name}")
    return out


def _session(folder: Path, level):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    return ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_graph_holds_the_canonical_codes(exported, name: str) -> None:
    qm, folder, _ = exported[name]
    model = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    scheme = qm.scheme
    tensors: dict[str, torch.Tensor] = {}
    for t in qm.iter_files():
        tensors.update(t)
    checked = 0
    for node in model.graph.node:
        dq = producers.get(node.input[1]) if node.op_type == "MatMul" else None
        if dq is None or dq.op_type != "DequantizeLinear":
            continue  # attention's MatMuls, the lm_head (unquantized)
        codes = inits[dq.input[0]]
        module = dq.input[0].removesuffix(".weight_q")
        assert codes.data_type == CODE_TYPES[scheme.weights.format], module
        got = numpy_helper.to_array(codes)
        want = tensors[f"{module}.weight"].t()
        if scheme.weights.format == "fp8_e4m3":
            got, want = got.astype(np.float32), want.float().numpy()
        assert np.array_equal(got.astype(np.float32), np.asarray(want, dtype=np.float32)), module
        if scheme.activations is not None:  # Q -> DQ with the calibrated scale on the MatMul's input
            act = producers[node.input[0]]
            assert act.op_type == "DequantizeLinear" and producers[act.input[0]].op_type == "QuantizeLinear"
            scale = numpy_helper.to_array(inits[act.input[1]])
            assert scale == pytest.approx(tensors[f"{module}.input_scale"].item(), rel=0)
        checked += 1
    assert checked == len(qm.quantized_modules)
    # no float copy of a quantized weight is left behind: the data file is about the codes' size
    float_bytes = sum(4 * np.prod(m["shape"]) for m in qm.quantized_modules.values())
    data = (folder / "model.onnx.data").stat().st_size
    other = data - sum(len(inits[n].raw_data) for n in inits if n.endswith(".weight_q"))
    assert other < float_bytes / 2


@pytest.mark.parametrize("name", list(SCHEMES))
def test_onnxruntime_reproduces_the_torch_reference(exported, name: str) -> None:
    """The graph's own semantics (ORT without its kernel fusions) equal the torch reference of the same
    canonical form, which applies the same static activation quantization."""
    import onnxruntime as ort

    _, folder, ct = exported[name]
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = torch.log_softmax(TorchEngine(ct, streamed=False).model(ids).logits.float(), -1)
    got = _session(folder, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC).run(None, {"input_ids": ids.numpy()})[0]
    got = torch.log_softmax(torch.from_numpy(got), -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert kl < 2e-5, (name, kl)
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.99


def test_engine_scores_the_qdq_folder_with_default_optimizations(exported) -> None:
    _, folder, ct = exported["w4a16-g32-asym"]
    windows = torch.randint(3, 300, (3, 32), generator=torch.Generator().manual_seed(2))
    reference = TorchEngine(ct, streamed=False).score(windows, top_k=16)
    engine = OnnxRuntimeEngine(folder)
    scores = engine.score(windows, reference=reference, top_k=16)
    assert scores["nll"].shape == (3, 31)
    assert torch.allclose(scores["nll"], reference["nll"], atol=0.05)
    assert scores["kl"].mean() < 1e-3 and scores["top1"].float().mean() > 0.95
    tput = engine.throughput(windows[:1], decode_tokens=4, repeats=1)
    assert tput["prefill_tokens_per_s"]["median"] > 0 and tput["decode_tokens_per_s"] is None


def test_serve_file_says_what_the_graph_is(exported) -> None:
    _, folder, _ = exported["w8a8-int8-static"]
    serve = json.loads((folder / "llmc-serve.json").read_text())
    assert serve["kind"] == "onnx-qdq" and serve["graph"]["kv_cache"] is False
    assert serve["quantized_matmuls"] == 14 and serve["activation_qdq"] is True
    assert "trtexec --onnx=model.onnx --stronglyTyped" in serve["tensorrt"]["build"]
    assert (folder / "tokenizer.json").is_file()
    # int8 activations: the session config that runs the graph exactly on CPUs whose int8 kernel saturates
    assert serve["onnxruntime"]["exact_session_config"] == {"session.disable_quant_qdq": "1"}
    assert "onnxruntime" not in json.loads((exported["w8a8-fp8-static"][1] / "llmc-serve.json").read_text())


def test_graph_records_no_build_paths(exported) -> None:
    """torch.onnx's per-node stack traces (absolute paths of the checkout and the venv, source line numbers) are
    dropped, so the artifact's bytes do not depend on where it was built; the name scopes stay."""
    import llmc
    import onnx

    _, folder, _ = exported["w8a8-int8-static"]
    data = (folder / "model.onnx").read_bytes()
    assert str(Path(llmc.__file__).resolve().parent.parent).encode() not in data and b"stack_trace" not in data
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert any(p.key == "pkg.torch.onnx.name_scopes" for n in graph.node for p in n.metadata_props)
    # nor on which llmc module holds the wrapper: the metadata names it llmc.Logits (moving the code changed it)
    from llmc.formats import onnx_qdq

    assert b"onnx_qdq" not in data and onnx_qdq.WRAPPER_NAME.encode() in data


def test_exact_session_config_turns_off_the_int8_kernel_fusion(exported) -> None:
    """With the serve file's session config, ORT runs DequantizeLinear -> float MatMul (the torch
    reference's function); by default it fuses the Q/DQ MatMuls into its int8 kernel."""
    _, folder, ct = exported["w8a8-int8-static"]
    windows = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(4))
    reference = TorchEngine(ct, streamed=False).score(windows, top_k=16)
    config = json.loads((folder / "llmc-serve.json").read_text())["onnxruntime"]["exact_session_config"]
    exact = OnnxRuntimeEngine(folder, session_config=config).score(windows, reference, 16)
    assert exact["kl"].mean() < 2e-5 and torch.allclose(exact["nll"], reference["nll"], atol=1e-3)


def test_refusals_name_the_fix() -> None:
    dynamic = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True))
    with pytest.raises(IncompatibleTargetError, match="static activation scales") as e:
        check_scheme(dynamic)
    assert "static activations" in e.value.fix
    with pytest.raises(IncompatibleTargetError, match="KV cache"):
        check_scheme(Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                            kv_cache=TensorSpec("fp8_e4m3", "tensor")))
    with pytest.raises(IncompatibleTargetError, match="NVFP4"):
        check_scheme(Scheme(TensorSpec("nvfp4", "group", group_size=16)))
    for scheme in SCHEMES.values():
        check_scheme(scheme)


def test_targets_route_to_the_qdq_exporters_and_the_planner_checks_them() -> None:
    from llmc.planning.plan import check_target
    from llmc.recipe.schema import Target

    assert runtime("onnxruntime").format_for(None) == "onnx"  # onnxruntime-genai folder (MatMulNBits or Q/DQ)
    assert runtime("tensorrt").format_for(None) == "onnx-qdq"
    ort_cpu = Target(runtime="onnxruntime", gpu_arch="cpu")
    assert check_target(SCHEMES["w8a8-int8-static"], ort_cpu)[0] == "cpu"
    dynamic = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True))
    with pytest.raises(IncompatibleTargetError, match="static activation scales"):
        check_target(dynamic, ort_cpu)
    assert check_target(SCHEMES["w8a8-fp8-static"], Target(runtime="tensorrt", gpu_arch="sm90"))[0] == "native"
    with pytest.raises(IncompatibleTargetError, match="sm89"):
        check_target(SCHEMES["w8a8-fp8-static"], Target(runtime="tensorrt", gpu_arch="sm80"))
    with pytest.raises(IncompatibleTargetError, match="no CPU support"):
        check_target(SCHEMES["w8a8-int8-static"], Target(runtime="tensorrt", gpu_arch="cpu"))


def test_inspect_and_triton_read_the_qdq_folder(exported, tmp_path: Path) -> None:
    import shutil

    from tritonclient.grpc import model_config_pb2
    from google.protobuf import text_format

    from llmc.formats.triton_repo import write_triton_repo
    from llmc.publish.inspect import describe
    from llmc.runtimes.catalog import artifact_format

    _, folder, _ = exported["w8a8-int8-static"]
    text = describe(folder)
    assert "ONNX Q/DQ graph" in text and "28 DequantizeLinear, 14 QuantizeLinear" in text and "TensorRT" in text
    artifact = tmp_path / "artifact"
    shutil.copytree(folder, artifact)
    model_dir = write_triton_repo(artifact, artifact_format("onnx-qdq").triton_backend, name="m")
    cfg = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.platform == "onnxruntime_onnx"
    assert [(i.name, list(i.dims)) for i in cfg.input] == [("input_ids", [-1, -1])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT needs an NVIDIA GPU")
def test_tensorrt_engine_from_the_qdq_graph_matches_the_torch_reference(exported) -> None:
    pytest.importorskip("tensorrt", reason="the tensorrt package is not installed on this GPU machine")
    from llmc.engines.tensorrt import TensorRtEngine

    for name in ("w8a8-int8-static", "w4a16-g32-asym", "w8a16-int8"):
        _, folder, ct = exported[name]
        windows = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(3))
        reference = TorchEngine(ct, streamed=False).score(windows, top_k=16)
        scores = TensorRtEngine(folder).score(windows, reference, 16)
        assert scores["kl"].mean() < 1e-3 and scores["top1"].float().mean() > 0.95, name


@pytest.mark.slow  # ~85 s in the default run of 2026-12-02; the layouts' graphs are checked by the fast tests above
def test_build_exports_both_onnx_layouts_and_scores_them_in_onnxruntime(tiny_model: Path, tmp_path: Path) -> None:
    import yaml

    from llmc.build import build
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store

    recipe = parse_recipe(yaml.safe_dump({
        "name": "tiny-w8a8-static",
        "model": {"source": str(tiny_model)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                         "activations": {"format": "int8", "strategy": "tensor"}, "algorithm": "smoothquant"},
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0},
        "targets": [{"runtime": "onnxruntime", "gpu_arch": "cpu"}, {"runtime": "tensorrt", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 64, "windows": 4, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 200,
                 "runtimes": ["torch", "onnxruntime"]},
        "gates": {"max_ppl_increase_pct": 50.0},
        "publish": {"registry": str(tmp_path / "registry")},
    }))
    result = build(recipe, Store(tmp_path / "cache"))
    assert result.passed
    arts = result.artifacts
    assert {label: a.format for label, a in arts.items()} == {"onnxruntime-cpu-tp1": "onnx",
                                                                     "tensorrt-sm90-tp1": "onnx-qdq"}
    genai = result.evals[EvalId("onnxruntime", "onnxruntime-cpu-tp1")]  # KV cache: decode measured
    assert genai.baseline_engine == "torch" and genai.kld is not None
    assert genai.throughput["decode_tokens_per_s"]["median"] > 0
    trt_graph = result.evals[EvalId("onnxruntime", "tensorrt-sm90-tp1")]  # TensorRT's graph, scored by ORT here
    assert trt_graph.kld is not None and trt_graph.throughput["decode_tokens_per_s"] is None
    # one quantization behind both: ORT computes nearly the same function from both graphs
    assert abs(genai.perplexity / trt_graph.perplexity - 1) < 0.02


@pytest.fixture(scope="module")
def genai_folders(tmp_path_factory, exported) -> dict[str, Path]:
    """The onnxruntime-genai folder (builder graph + llmc's Q/DQ) for two of the schemes."""
    from llmc.formats.onnx_genai import export_onnx

    root = tmp_path_factory.mktemp("genai-qdq")
    out = {}
    for name in ("w8a8-int8-static", "w8a8-fp8-static"):
        export_onnx(exported[name][0], root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ["w8a8-int8-static", "w8a8-fp8-static"])
def test_genai_folder_with_qdq_reproduces_the_torch_reference_with_a_kv_cache(exported, genai_folders,
                                                                             name: str) -> None:
    """The builder's graph (GroupQueryAttention, KV cache) with llmc's codes put back: the packed q/k/v
    MatMul holds the three modules' codes, ORT (fusion off) computes the torch reference's function, and
    decoding through the cache works."""
    qm, _, ct = exported[name]
    folder = genai_folders[name]
    model = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    tensors = {}
    for t in qm.iter_files():
        tensors.update(t)
    packed = numpy_helper.to_array(inits["model.layers.0.attn.qkv_proj.MatMul.weight_q"])
    want = torch.cat([tensors[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]).t()
    if qm.scheme.weights.format == "fp8_e4m3":
        packed, want = packed.astype(np.float32), want.float()
    assert np.array_equal(packed.astype(np.float32), want.float().numpy())
    assert not [n for n in inits if n.endswith("MatMul.weight") and "lm_head" not in n]  # no float copies left
    windows = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(5))
    reference = TorchEngine(ct, streamed=False).score(windows, top_k=16)
    engine = OnnxRuntimeEngine(folder, session_config={"session.disable_quant_qdq": "1"})
    scores = engine.score(windows, reference, 16)
    assert scores["kl"].mean() < 1e-6 and torch.allclose(scores["nll"], reference["nll"], atol=1e-3)
    assert engine.throughput(windows[:1], decode_tokens=3, repeats=1)["decode_tokens_per_s"]["median"] > 0
