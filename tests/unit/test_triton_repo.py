"""Triton Inference Server model repositories: config.pbtxt parsed with Triton's own schema
(tritonclient's model_config.proto), backend arguments, files linked not copied."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from llmc.formats.compressed_tensors import export_compressed_tensors, vllm_serve_args
from llmc.formats.onnx_genai import export_onnx
from llmc.formats.triton_repo import model_name, write_triton_repo
from llmc.errors import IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_model_session: Path) -> QuantizedModel:
    out = tmp_path_factory.mktemp("triton") / "q"
    scheme = Scheme(TensorSpec("int4", "group", group_size=32))
    quantize_model(ModelSource(tiny_model_session, "t", "t"), scheme, out, None)
    return QuantizedModel.open(out)


def _parse(model_dir: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_vllm_backend_repository(quantized: QuantizedModel, tmp_path: Path) -> None:
    serve = vllm_serve_args(quantized, tensor_parallel=2, max_model_len=512)
    artifact = tmp_path / "ct"
    export_compressed_tensors(quantized, artifact, serve_args=serve)
    name = model_name("recipe-w4a16/vllm-sm90-tp2")
    assert name == "recipe-w4a16_vllm-sm90-tp2"
    model_dir = write_triton_repo(artifact, "vllm", name=name, serve=serve)

    cfg = _parse(model_dir)
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == (name, "vllm", 0)
    assert cfg.model_transaction_policy.decoupled  # the vLLM backend refuses anything else
    assert [i.name for i in cfg.input] == ["text_input", "stream", "sampling_parameters"]
    assert cfg.input[0].data_type == model_config_pb2.TYPE_STRING and cfg.output[0].name == "text_output"
    engine_args = json.loads((model_dir / "1" / "model.json").read_text())
    assert engine_args == {"model": f"/models/{name}/1", **serve["vllm"]}
    assert engine_args["tensor_parallel_size"] == 2 and engine_args["quantization"] == "compressed-tensors"
    for f in artifact.iterdir():  # every artifact file is in the version folder, as a hard link
        if f.is_file():
            linked = model_dir / "1" / f.name
            assert linked.is_file() and linked.stat().st_ino == f.stat().st_ino, f.name


def test_onnxruntime_backend_repository_lists_the_graph_tensors(quantized: QuantizedModel, tmp_path: Path) -> None:
    import onnx

    artifact = tmp_path / "onnx"
    export_onnx(quantized, artifact, accuracy_level=1)
    model_dir = write_triton_repo(artifact, "onnxruntime", name="m")
    cfg = _parse(model_dir)
    assert (cfg.platform, cfg.max_batch_size) == ("onnxruntime_onnx", 0)
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in cfg.input] == [i.name for i in graph.input]
    assert [o.name for o in cfg.output] == [o.name for o in graph.output]
    by_name = {i.name: i for i in cfg.input}
    assert by_name["input_ids"].data_type == model_config_pb2.TYPE_INT64
    assert list(by_name["input_ids"].dims) == [-1, -1]  # batch and sequence are dynamic
    past = by_name["past_key_values.0.key"]
    assert past.data_type == model_config_pb2.TYPE_FP32 and list(past.dims)[1] == quantized.config["num_key_value_heads"]
    assert {"model.onnx", "model.onnx.data", "genai_config.json"} <= {p.name for p in (model_dir / "1").iterdir()}


def test_triton_is_refused_where_there_is_no_backend_for_the_artifact() -> None:
    from llmc.planning.plan import check_target
    from llmc.recipe.schema import Target
    from llmc.runtimes.catalog import triton_backend

    with pytest.raises(IncompatibleTargetError) as e:
        triton_backend(Target(runtime="llama.cpp", gpu_arch="cpu"))
    assert "vllm" in e.value.fix and "gguf" in e.value.message
    assert triton_backend(Target(runtime="sglang")) == "vllm"
    assert triton_backend(Target(runtime="tensorrt")) == "onnxruntime"

    with pytest.raises(IncompatibleTargetError, match="triton"):
        check_target(Scheme(TensorSpec("int4", "group", group_size=32)),
                     Target(runtime="llama.cpp", gpu_arch="cpu", triton=True))
    check_target(Scheme(TensorSpec("int4", "group", group_size=32)),
                 Target(runtime="onnxruntime", gpu_arch="cpu", triton=True))
    check_target(Scheme(TensorSpec("int4", "group", group_size=32)),
                 Target(runtime="tensorrt-llm", gpu_arch="sm90", triton=True))
    with pytest.raises(IncompatibleTargetError, match="trtllm-checkpoint"):  # legacy: an engine must be built first
        check_target(Scheme(TensorSpec("int4", "group", group_size=32)),
                     Target(runtime="tensorrt-llm", version="<0.16", gpu_arch="sm90", triton=True))


class _Tensor:
    """The slice of triton_python_backend_utils.Tensor that llmc's model.py touches."""

    def __init__(self, name: str, array) -> None:
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _Response:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.output_tensors, self.error = output_tensors or [], error


def _stub_pb_utils(declared_inputs: set[str]) -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.InferenceResponse, pb.TritonError = _Tensor, _Response, RuntimeError

    def get_input_tensor_by_name(request: dict, name: str):
        # Triton only hands a model the inputs its config declares: reading another name is a bug here
        assert name in declared_inputs, f"model.py reads {name!r}, which config.pbtxt does not declare"
        return _Tensor(name, request[name]) if name in request else None

    pb.get_input_tensor_by_name = get_input_tensor_by_name
    return pb


def _stub_tensorrt_llm(calls: dict) -> types.ModuleType:
    trt = types.ModuleType("tensorrt_llm")

    class SamplingParams:
        def __init__(self, **fields) -> None:
            self.fields = fields

    class LLM:
        def __init__(self, model: str, **options) -> None:
            calls["model"], calls["options"] = model, options

        def generate(self, prompts: list[str], params: list[SamplingParams]) -> list:
            calls.setdefault("generate", []).append((prompts, [p.fields for p in params]))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"{p}|{s.fields}")])
                    for p, s in zip(prompts, params)]

        def shutdown(self) -> None:
            calls["shutdown"] = True

    trt.LLM, trt.SamplingParams = LLM, SamplingParams
    return trt


def _load_model_py(path: Path):
    spec = importlib.util.spec_from_file_location("llmc_triton_trtllm_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tensorrt_llm_python_backend_repository(quantized: QuantizedModel, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import yaml

    from llmc.formats.modelopt_hf import export_modelopt_hf

    artifact = tmp_path / "trt"
    export_modelopt_hf(quantized, artifact, tensor_parallel=2, max_batch_size=4)
    model_dir = write_triton_repo(artifact, "tensorrt_llm", name="m")
    cfg = _parse(model_dir)
    assert (cfg.backend, cfg.max_batch_size, cfg.model_transaction_policy.decoupled) == ("python", 0, False)
    inputs = {i.name: i for i in cfg.input}
    assert not inputs["text_input"].optional and inputs["text_input"].data_type == model_config_pb2.TYPE_STRING
    assert all(i.optional for n, i in inputs.items() if n != "text_input")
    assert [(o.name, o.data_type) for o in cfg.output] == [("text_output", model_config_pb2.TYPE_STRING)]
    version = model_dir / "1"
    assert {"model.py", "config.json", "hf_quant_config.json", "llmc-trtllm.yaml"} <= {p.name for p in version.iterdir()}

    # model.py against stand-ins for Triton's stub module and TensorRT-LLM: the plumbing, not the GPU
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stub_pb_utils(set(inputs)))
    monkeypatch.setitem(sys.modules, "tensorrt_llm", _stub_tensorrt_llm(calls))
    model = _load_model_py(version / "model.py").TritonPythonModel()
    model.initialize({"model_repository": str(model_dir), "model_version": "1"})
    assert calls["model"] == str(version)
    assert calls["options"] == yaml.safe_load((artifact / "llmc-trtllm.yaml").read_text())
    assert calls["options"]["tensor_parallel_size"] == 2

    requests = [
        {"text_input": np.array([b"Hello"], dtype=np.object_)},
        {"temperature": np.array([0.5], dtype=np.float32)},  # no text_input: this one fails alone
        {"text_input": np.array([b"Hi"], dtype=np.object_), "max_tokens": np.array([3], dtype=np.int32),
         "top_k": np.array([5], dtype=np.int32), "seed": np.array([7], dtype=np.uint64)},
    ]
    responses = model.execute(requests)
    assert len(calls["generate"]) == 1  # every good request in one generate call
    prompts, params = calls["generate"][0]
    assert prompts == ["Hello", "Hi"]
    assert params == [{"max_tokens": 64}, {"max_tokens": 3, "top_k": 5, "seed": 7}]
    assert responses[1].error is not None and not responses[1].output_tensors
    for response, prompt, fields in ((responses[0], "Hello", params[0]), (responses[2], "Hi", params[1])):
        (out,) = response.output_tensors
        assert response.error is None and out.name == "text_output"
        assert out.as_numpy().tolist() == [f"{prompt}|{fields}".encode()]
    model.finalize()
    assert calls["shutdown"]


@pytest.mark.gpu
def test_tensorrt_llm_python_backend_generates_on_a_gpu(quantized: QuantizedModel, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (GPU machines, its own environment)")
    from llmc.formats.modelopt_hf import export_modelopt_hf

    artifact = tmp_path / "trt"
    export_modelopt_hf(quantized, artifact)
    model_dir = write_triton_repo(artifact, "tensorrt_llm", name="m")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils",
                        _stub_pb_utils({i.name for i in _parse(model_dir).input}))
    model = _load_model_py(model_dir / "1" / "model.py").TritonPythonModel()
    model.initialize({"model_repository": str(model_dir), "model_version": "1"})
    try:
        (response,) = model.execute([{"text_input": np.array([b"Hello"], dtype=np.object_),
                                      "max_tokens": np.array([4], dtype=np.int32)}])
        assert response.error is None and response.output_tensors[0].as_numpy()[0]
    finally:
        model.finalize()
