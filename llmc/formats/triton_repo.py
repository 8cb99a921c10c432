"""A Triton Inference Server model repository around an exported artifact.

    <artifact>/triton/<model>/config.pbtxt   the backend and its tensors
    <artifact>/triton/<model>/1/             the artifact's files (hard links: no second copy on disk)
                                             + the backend's engine arguments where it takes them

Backends, by the artifact the target already gets (each format's `triton_backend` in `llmc.runtimes`):

- compressed-tensors -> Triton's vLLM backend: `1/model.json` holds vLLM engine arguments (the same ones
  `llmc-serve.json` gives `vllm serve`); the backend passes them to vLLM verbatim, so `model` is the
  version folder's path *inside Triton's container*: the repository is expected at `/models`
  (`docker run -v <artifact>/triton:/models ... tritonserver --model-repository=/models`).
- onnx, onnx-qdq -> Triton's ONNX Runtime backend (`platform: onnxruntime_onnx`): inputs and outputs, with their
  types and dynamic dims, read from the graph itself. The model is stateless under Triton: the client
  passes `past_key_values.*` and receives `present.*`, as onnxruntime-genai does in-process.

- modelopt-hf (TensorRT-LLM, LLM API) -> Triton's Python backend with llmc's own `1/model.py`
  (llmc/formats/_triton_trtllm_model.py, copied verbatim): it builds `tensorrt_llm.LLM` on the version folder
  with `llmc-trtllm.yaml`'s options, as `trtllm-serve` would, and answers text_input -> text_output. It needs
  Triton's TensorRT-LLM container (`nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3`), where
  tensorrt_llm is importable. The legacy per-rank checkpoint (trtllm-checkpoint) gets no repository: it is
  not servable until `trtllm-build` compiles it on the target GPU.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


CONTAINER_REPOSITORY = "/models"
BACKENDS = ("vllm", "onnxruntime", "tensorrt_llm")
TRTLLM_MODEL_SOURCE = Path(__file__).with_name("_triton_trtllm_model.py")
_ONNX_TO_TRITON = {1: "TYPE_FP32", 10: "TYPE_FP16", 16: "TYPE_BF16", 7: "TYPE_INT64", 6: "TYPE_INT32",
                   9: "TYPE_BOOL", 3: "TYPE_INT8", 2: "TYPE_UINT8"}


def model_name(label: str) -> str:
    """Triton model names are folder names: keep letters, digits, '-', '_' and '.'."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def write_triton_repo(artifact: Path, backend: str, *, name: str, serve: dict | None = None) -> Path:
    """Write `<artifact>/triton/<name>/` for the artifact in `artifact`, served by `backend` (one of BACKENDS; the
    target registry says which backend each artifact format gets); returns the model folder."""
    if backend not in BACKENDS:
        raise ValueError(f"no Triton backend {backend!r}; llmc writes {', '.join(BACKENDS)}")
    model_dir = Path(artifact) / "triton" / name
    version = model_dir / "1"
    shutil.rmtree(model_dir, ignore_errors=True)
    version.mkdir(parents=True)
    for f in sorted(Path(artifact).iterdir()):
        if f.is_file() and not f.name.startswith("."):
            _link_or_copy(f, version / f.name)
    if backend == "vllm":
        engine_args = {"model": f"{CONTAINER_REPOSITORY}/{name}/1", **((serve or {}).get("vllm") or {})}
        (version / "model.json").write_text(json.dumps(engine_args, indent=2) + "\n")
        config = _vllm_config(name)
    elif backend == "tensorrt_llm":
        shutil.copyfile(TRTLLM_MODEL_SOURCE, version / "model.py")
        config = _trtllm_config(name)
    else:
        config = _onnx_config(name, version / "model.onnx")
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def _vllm_config(name: str) -> str:
    # Requests carry text; vLLM batches them itself, hence max_batch_size 0 and a decoupled
    # (streaming-capable) transaction policy, which the vLLM backend requires.
    return f'''name: "{name}"
backend: "vllm"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] }}
]
instance_group [ {{ count: 1, kind: KIND_MODEL }} ]
'''


def _trtllm_config(name: str) -> str:
    # One prompt per request (max_batch_size 0); the LLM API batches concurrent requests in flight itself.
    # KIND_MODEL: TensorRT-LLM places the model on its GPUs (tensor_parallel_size from llmc-trtllm.yaml).
    return f'''name: "{name}"
backend: "python"
max_batch_size: 0
input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "seed", data_type: TYPE_UINT64, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }}
]
instance_group [ {{ count: 1, kind: KIND_MODEL }} ]
'''


def _onnx_config(name: str, model_file: Path) -> str:
    import onnx

    graph = onnx.load(str(model_file), load_external_data=False).graph

    def tensors(values) -> str:
        rows = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            rows.append(f'  {{ name: "{v.name}", data_type: {_ONNX_TO_TRITON[t.elem_type]}, '
                        f"dims: [ {', '.join(map(str, dims))} ] }}")
        return ",\n".join(rows)

    initializers = {i.name for i in graph.initializer}
    inputs = [v for v in graph.input if v.name not in initializers]
    # max_batch_size 0: the batch dimension is part of every tensor's dims (the graph's own shapes).
    return f'''name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [
{tensors(inputs)}
]
output [
{tensors(graph.output)}
]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
'''
