"""TensorRT engine: builds a TensorRT engine from an ONNX Q/DQ artifact (llmc.formats.onnx_qdq) with the
`tensorrt` Python API and scores it on the GPU.

The network is created strongly typed, so TensorRT keeps the graph's types: float32 where the graph is
float, and INT8 / FP8 GEMMs (or INT4/INT8 weight-only kernels) exactly where the Q/DQ nodes put them,
instead of choosing precisions itself. One optimization profile covers batch 1..`max_batch` and
sequence 1..`max_sequence`. The engine is built in memory for evaluation; `build_engine` writes it to
a `.plan` file for serving (`trtexec --loadEngine`, Triton's `tensorrt_plan` platform).

Needs an NVIDIA GPU and the `tensorrt` package (pip install tensorrt-cu12 on the GPU machine; not
installable on the CPU machines llmc's CI runs on): imported only here, and reported as
EngineUnavailable with the fix otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from llmc.formats.files import SERVE_FILE
from llmc.formats.onnx_qdq import MODEL_FILE
from llmc.engines.base import EngineBase
from llmc.engines.agreement import reference_rows, score_logits
from llmc.engines.torch_ref import summary
from llmc.errors import EngineFailed, EngineUnavailable
from llmc.storage.store import atomic_write_bytes


def _tensorrt():
    if not torch.cuda.is_available():
        raise EngineUnavailable("TensorRT needs an NVIDIA GPU and torch sees none",
                                fix="evaluate the tensorrt target on a GPU machine (the ONNX Q/DQ artifact is scored "
                                    "by onnxruntime here: add onnxruntime to eval.runtimes)")
    try:
        import tensorrt  # lazy: GPU-only package, absent here -> EngineUnavailable
    except ImportError as e:
        raise EngineUnavailable(f"the tensorrt package is not importable: {e}",
                                fix="pip install tensorrt-cu12 (matching the machine's CUDA) on the GPU machine") from None
    return tensorrt


def build_serialized(folder: Path, *, max_batch: int = 8, opt_sequence: int = 512,
                     max_sequence: int | None = None) -> tuple[bytes, str]:
    """(serialized engine, TensorRT version) for the Q/DQ graph in `folder`."""
    trt = _tensorrt()
    folder = Path(folder)
    model = folder / MODEL_FILE
    if not model.is_file():
        raise EngineFailed(f"{folder} has no {MODEL_FILE}", fix="export the artifact for a tensorrt target")
    serve = json.loads((folder / SERVE_FILE).read_text()) if (folder / SERVE_FILE).is_file() else {}
    max_sequence = max_sequence or min(int(serve.get("graph", {}).get("max_sequence", 2048)), 4096)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model)):  # reads model.onnx.data beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineFailed(f"TensorRT's ONNX parser rejected {model}: {errors}",
                           fix="check the TensorRT version against the compatibility matrix (llmc matrix)")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    opt = min(opt_sequence, max_sequence)
    profile.set_shape("input_ids", (1, 1), (1, opt), (max_batch, max_sequence))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise EngineFailed(f"TensorRT could not build an engine from {model} (see the log above)",
                           fix="check the scheme against the GPU arch in the compatibility matrix")
    return bytes(engine), trt.__version__


def build_engine(folder: Path, out: Path | None = None, **kwargs) -> Path:
    """Build the engine for the artifact in `folder` and write it to `out` (default: <folder>/model.plan)."""
    data, _ = build_serialized(folder, **kwargs)
    out = Path(out) if out else Path(folder) / "model.plan"
    atomic_write_bytes(out, data)
    return out


class TensorRtEngine(EngineBase):
    name = "tensorrt"

    def __init__(self, folder: Path, *, dtype: str = "float32") -> None:
        del dtype  # the graph's own types decide the arithmetic (strongly typed network)
        trt = _tensorrt()
        data, self.version = build_serialized(folder)
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(data)
        if self.engine is None:
            raise EngineFailed("TensorRT could not deserialize the engine it just built", fix="report this as an llmc bug")
        self.context = self.engine.create_execution_context()

    @torch.no_grad()
    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to("cuda", torch.int64).contiguous()
        self.context.set_input_shape("input_ids", tuple(ids.shape))
        out = torch.empty(tuple(self.context.get_tensor_shape("logits")), dtype=torch.float32, device="cuda")
        self.context.set_tensor_address("input_ids", ids.data_ptr())
        self.context.set_tensor_address("logits", out.data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise EngineFailed("TensorRT's execute_async_v3 failed", fix="see the TensorRT log above")
        stream.synchronize()
        return out

    def score(self, windows: torch.Tensor, reference: dict | None = None, top_k: int = 256,
              batch_size: int = 1) -> dict[str, torch.Tensor]:
        """Per-token NLL, and either top-k log-probs or KL / top-1 against `reference`; one window at a time."""
        del batch_size
        parts: dict[str, list[torch.Tensor]] = {}
        for w in range(windows.shape[0]):
            ids = windows[w : w + 1]
            logits = self._logits(ids)[:, :-1].float().cpu()
            ref = None if reference is None else reference_rows(reference, w, w + 1)
            for k, v in score_logits(logits, ids[:, 1:], top_k, ref).items():
                parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}

    def throughput(self, prompt: torch.Tensor, decode_tokens: int, repeats: int,
                   batch_sizes: Sequence[int] = (1,)) -> dict:
        """Prefill tok/s of the prompt's first row. No KV cache in the Q/DQ graph: no decode figures."""
        del decode_tokens, batch_sizes
        prompt = prompt[:1]
        self._logits(prompt[:, :8])  # warm-up
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            self._logits(prompt)
            rates.append(prompt.numel() / (time.perf_counter() - t))
        return {"prefill_tokens_per_s": summary(rates), "decode_tokens_per_s": None,
                "prompt_tokens": int(prompt.shape[1]), "decode_tokens": 0, "repeats": repeats,
                "engine_version": self.version}
