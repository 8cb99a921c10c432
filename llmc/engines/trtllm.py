"""TensorRT-LLM engine: scores a ModelOpt-style checkpoint (or the unquantized baseline) in TensorRT-LLM.

TensorRT-LLM needs an NVIDIA GPU and pins its own torch/transformers, so it runs in its own environment
(LLMC_TRTLLM_PYTHON, default .venv-trtllm) as one child process per evaluation (`_trtllm_worker.py`).
Through the LLM API's context logits it gives full distributions, so besides the NLL the build gets KL
and top-1 agreement against the baseline's top-k log-probs, computed here exactly as for the torch engine.
The artifact's `llmc-trtllm.yaml` (tensor parallel size, KV-cache dtype, ...) becomes the LLM arguments.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from llmc.engines.torch_ref import agreement
from llmc.engines.environments import runtime_python
from llmc.errors import EngineFailed, EngineUnavailable

WORKER = Path(__file__).with_name("_trtllm_worker.py")
LLM_API_OPTIONS = "llmc-trtllm.yaml"


def trtllm_python() -> Path:
    path = runtime_python(
        "LLMC_TRTLLM_PYTHON", ".venv-trtllm", "TensorRT-LLM",
        fix="on a GPU machine: python -m venv .venv-trtllm && .venv-trtllm/bin/pip install tensorrt-llm "
            "(or set LLMC_TRTLLM_PYTHON to a python that can import tensorrt_llm)",
    )
    if shutil.which("nvidia-smi") is None:
        raise EngineUnavailable("TensorRT-LLM needs an NVIDIA GPU and this machine has no nvidia-smi",
                                fix="evaluate this artifact on a GPU machine, or drop tensorrt-llm from eval.runtimes")
    return path


class TensorRtLlmEngine:
    name = "tensorrt-llm"

    def __init__(self, folder: Path, *, dtype: str = "float32", timeout_s: float = 3600) -> None:
        del dtype  # the checkpoint's own dtype (or TensorRT-LLM's default for the baseline) decides
        self.python = trtllm_python()
        self.folder, self.timeout_s = Path(folder), timeout_s

    def _llm_args(self) -> dict:
        options = self.folder / LLM_API_OPTIONS
        return (yaml.safe_load(options.read_text()) or {}) if options.is_file() else {}

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256) -> tuple[dict, dict]:
        """(scores, throughput), the interface every engine offers the build."""
        del batch_size
        with tempfile.TemporaryDirectory(prefix="llmc-trtllm-") as tmp:
            tmp = Path(tmp)
            tensors = {"windows": windows.contiguous(), "prompt": prompt[:1].contiguous()}
            if reference is not None:
                tensors["reference_index"] = reference["topk_index"].contiguous()
            save_file(tensors, str(tmp / "tensors.safetensors"))
            request = {"model": str(self.folder), "llm_args": self._llm_args(), "tensors": str(tmp / "tensors.safetensors"),
                       "top_k": top_k, "decode_tokens": decode_tokens, "repeats": repeats}
            (tmp / "request.json").write_text(json.dumps(request))
            try:
                proc = subprocess.run([str(self.python), str(WORKER), str(tmp / "request.json"), str(tmp)],
                                      capture_output=True, text=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"TensorRT-LLM did not finish evaluating {self.folder} within {self.timeout_s:.0f} s") from None
            if proc.returncode != 0 or not (tmp / "result.json").is_file():
                tail = "\n".join(proc.stderr.strip().splitlines()[-40:])
                raise EngineFailed(f"TensorRT-LLM failed on {self.folder} (exit {proc.returncode}):\n{tail}",
                                   fix="check that this TensorRT-LLM version accepts the artifact (llmc inspect)")
            raw = load_file(str(tmp / "scores.safetensors"))
            result = json.loads((tmp / "result.json").read_text())
        scores = {"nll": raw["nll"]}
        if reference is None:
            scores["topk_logprobs"], scores["topk_index"] = raw["topk_logprobs"], raw["topk_index"]
        else:
            scores.update(agreement(reference, raw["at_reference"], raw["argmax"]))
        tput = {**result["throughput"], "engine_version": result["version"], "engine_load_s": result["load_s"]}
        return scores, tput
