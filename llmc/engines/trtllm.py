"""TensorRT-LLM engine: scores a ModelOpt-style checkpoint (or the unquantized baseline) in TensorRT-LLM.

TensorRT-LLM needs an NVIDIA GPU and pins its own torch/transformers, so it runs in its own environment
(LLMC_TRTLLM_PYTHON, .venv-trtllm, ...: llmc.engines.environments) as one child process per evaluation
(workers/trtllm_worker.py through llmc.engines.runner). Through the LLM API's context logits it gives full
distributions, so besides the NLL the build gets KL and top-1 agreement against the baseline's top-k
log-probs, computed here exactly as for the torch engine. The KL is the top-k lower bound: the baseline is
TensorRT-LLM's own run, and its LLM API returns logits, not the output head's inputs that the exact KL is
computed from (llmc.engines.agreement). The artifact's `llmc-trtllm.yaml` (tensor
parallel size, KV-cache dtype, ...) becomes the LLM arguments.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import yaml

from llmc.engines.environments import engine_python
from llmc.engines.registry import engine_spec
from llmc.engines.runner import WorkerEngine, run_worker, token_tensors
from llmc.engines.agreement import agreement
from llmc.errors import EngineUnavailable

SPEC = engine_spec("tensorrt-llm")
LLM_API_OPTIONS = "llmc-trtllm.yaml"


def trtllm_python() -> Path:
    path = engine_python(SPEC)
    if shutil.which("nvidia-smi") is None:
        raise EngineUnavailable("TensorRT-LLM needs an NVIDIA GPU and this machine has no nvidia-smi",
                                fix="evaluate this artifact on a GPU machine, or drop tensorrt-llm from eval.runtimes")
    return path


class TensorRtLlmEngine(WorkerEngine):
    name = "tensorrt-llm"

    def __init__(self, folder: Path, *, dtype: str = "float32") -> None:
        del dtype  # the checkpoint's own dtype (or TensorRT-LLM's default for the baseline) decides
        trtllm_python()
        self.folder = Path(folder)

    def _llm_args(self) -> dict:
        options = self.folder / LLM_API_OPTIONS
        return (yaml.safe_load(options.read_text()) or {}) if options.is_file() else {}

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256,
                throughput_batch_sizes=(1,)) -> tuple[dict, dict]:
        """(scores, throughput), the interface every engine offers the build."""
        del batch_size, throughput_batch_sizes
        request = {"model": str(self.folder), "llm_args": self._llm_args(), "top_k": top_k,
                   "decode_tokens": decode_tokens, "repeats": repeats}
        result, raw = run_worker(SPEC, request, token_tensors(windows, prompt, reference), about=str(self.folder))
        raw = {k: torch.from_numpy(v) for k, v in raw.items()}
        scores = {"nll": raw["nll"]}
        if reference is None:
            scores["topk_logprobs"], scores["topk_index"] = raw["topk_logprobs"], raw["topk_index"]
        else:
            scores.update(agreement(reference, raw["at_reference"], raw["argmax"]))
        tput = {**result["throughput"], "engine_version": result["version"], "engine_load_s": result["load_s"]}
        return scores, tput
