"""Triton Inference Server model repositories: config.pbtxt parsed with Triton's own schema
(tritonclient's model_config.proto), backend arguments, files linked not copied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from llmc.compiler.compressed_tensors import export_compressed_tensors, vllm_serve_args
from llmc.compiler.onnx_genai import export_onnx
from llmc.compiler.triton_repo import check_exporter, model_name, write_triton_repo
from llmc.errors import IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_model_session: Path) -> QuantizedModel:
    out = tmp_path_factory.mktemp("triton") / "q"
    scheme = Scheme(TensorSpec("int4", "group", group_size=32))
    quantize_model(ModelSource(tiny_model_session, "t", "t"), scheme, out, calibration=None)
    return QuantizedModel.open(out)


def _parse(model_dir: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_vllm_backend_repository(quantized: QuantizedModel, tmp_path: Path) -> None:
    serve = vllm_serve_args(quantized, tensor_parallel=2, max_model_len=512)
    artifact = tmp_path / "ct"
    export_compressed_tensors(quantized, artifact, serve_args=serve)
    name = model_name("recipe-w4a16/vllm-sm90-tp2")
    assert name == "recipe-w4a16_vllm-sm90-tp2"
    model_dir = write_triton_repo(artifact, "compressed-tensors", "vllm", name=name, serve=serve)

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
    model_dir = write_triton_repo(artifact, "onnx", "onnxruntime", name="m")
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
    with pytest.raises(IncompatibleTargetError) as e:
        check_exporter("gguf", "llama.cpp")
    assert "vllm" in e.value.fix
    from llmc.plan import check_target
    from llmc.recipe.schema import Target

    with pytest.raises(IncompatibleTargetError, match="triton"):
        check_target(Scheme(TensorSpec("int4", "group", group_size=32)),
                     Target(runtime="llama.cpp", gpu_arch="cpu", triton=True))
    check_target(Scheme(TensorSpec("int4", "group", group_size=32)),
                 Target(runtime="onnxruntime", gpu_arch="cpu", triton=True))
