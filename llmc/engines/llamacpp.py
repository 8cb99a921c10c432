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
from llmc.errors import EngineFailed

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
