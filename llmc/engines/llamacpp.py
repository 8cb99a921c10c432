"""llama.cpp engine: scores a GGUF artifact's windows and times prefill/decode in llama.cpp.

llama-cpp-python is built from source (`bash scripts/setup-llama.sh` -> .venv-llama; llmc.engines.environments
says where else it may be) and kept out of llmc's environment; each evaluation runs workers/llama_worker.py in a
child process (llmc.engines.runner). llama.cpp returns full logits, so besides the NLL it measures top-1 agreement
and KL divergence against the torch baseline: exact over the full vocabulary where the baseline recorded its output
head (the worker re-applies it: llmc.engines.agreement), else the top-k lower bound.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from llmc.engines.environments import engine_version, require_engine
from llmc.engines.registry import engine_spec
from llmc.engines.runner import WorkerEngine, run_worker, token_tensors
from llmc.engines.agreement import agreement, with_exact_kl
from llmc.engines.base import Scoring, protocol_seconds, read_seconds, scores_bytes, window_logits_bytes
from llmc.errors import EngineFailed
from llmc.planning.machine import PROCESS_BYTES
from llmc.planning.rows import CostRow

SPEC = engine_spec("llama.cpp")


def llama_cpp_version() -> str | None:
    return engine_version(SPEC)


class LlamaCppEngine(WorkerEngine):
    name = "llama.cpp"

    def __init__(self, folder: Path, *, dtype: str = "float32", threads: int | None = None) -> None:
        del dtype  # the GGUF's tensor types decide the arithmetic
        folder = Path(folder)
        self.gguf = folder if folder.suffix == ".gguf" else folder / "model.gguf"
        if not self.gguf.is_file():
            raise EngineFailed(f"no GGUF file at {self.gguf}", fix="export the artifact for a llama.cpp target")
        require_engine(SPEC)
        self.threads = threads or os.cpu_count() or 1

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256,
                throughput_batch_sizes=(1,)) -> tuple[dict, dict]:
        """(scores, throughput), as the torch engine: NLL, and KL / top-1 against `reference`."""
        del batch_size, top_k, throughput_batch_sizes
        request = {"gguf": str(self.gguf), "decode_tokens": decode_tokens, "repeats": repeats, "threads": self.threads}
        result, out = run_worker(SPEC, request, token_tensors(windows, prompt, reference), about=str(self.gguf))
        scores = {"nll": torch.from_numpy(out["nll"]).double()}
        if reference is not None:
            scores.update(agreement(reference, torch.from_numpy(out["logprobs_at_reference"]),
                                    torch.from_numpy(out["top1_index"])))
            with_exact_kl(scores, torch.from_numpy(out["kl_exact"]) if "kl_exact" in out else None)
        tput = {**result["throughput"], "engine_version": result["version"], "engine_load_s": result["load_s"],
                "threads": self.threads}
        return scores, tput


# The worker's start (a Python that imports llama_cpp) and the GGUF's load, as recorded: llama.cpp's own load 0.21-1.22
# s and the engine's opening (its version check) 0.0007-1.6 s for SmolLM2-135M and Gemma-3-270M on the 2-core VM:
# docs/planner-constants.md#engine-start-up
START_S = 2.8


def scoring_cost(s: Scoring) -> CostRow:
    """One scoring in llama.cpp (its own process): the GGUF mapped (file pages), every window's logits kept for the
    window (logits_all), its quantized kernels timed at the machine's probed float32 matmul rate (llama.cpp's own
    rates are not probed: an estimate)."""
    score_s, throughput_s = protocol_seconds(s, "float32")
    parts = {"worker process": PROCESS_BYTES, "window logits": window_logits_bytes(s),
             "scores and reference": scores_bytes(s)}
    return CostRow("llama.cpp", "cpu", sum(parts.values()), 0.0, 0.0,
                   START_S + read_seconds(s) + score_s + throughput_s, "its own process, the GGUF mapped",
                   f"start ~{START_S:g} s (recorded), scoring ~{score_s:.0f} s and throughput ~{throughput_s:.0f} s "
                   "at the probed float32 matmul rate (llama.cpp's kernels are not probed: an estimate)", parts,
                   mapped_bytes=s.model_bytes)
