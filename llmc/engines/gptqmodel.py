"""GPTQModel engine: scores llmc's GPTQ-format (ExLlama layout) and AutoAWQ-format (LMDeploy layout) checkpoints with
GPTQModel's own CPU kernels, and times prefill/decode.

GPTQModel pins numpy, transformers and torchao versions of its own, so it lives in a separate virtual environment
(`bash scripts/setup-gptqmodel.sh` -> .venv-gptqmodel; llmc.engines.environments says where else it may be) and
runs as one child process per evaluation (llmc.engines.runner). Its CPU kernels take bfloat16 or float16
activations only, so every artifact runs in bfloat16 there (the torch reference baseline stays float32: the
bf16 arithmetic is part of what the KL and perplexity change measure, and the protocol records the dtype).
It returns full logits, so besides the NLL it measures top-1 agreement and KL divergence against the torch baseline,
exact over the full vocabulary where the baseline recorded its output head.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from llmc.engines.agreement import agreement, with_exact_kl
from llmc.engines.base import Scoring, protocol_seconds, read_seconds, scores_bytes, window_logits_bytes
from llmc.engines.environments import engine_version, require_engine
from llmc.engines.registry import engine_spec
from llmc.engines.runner import WorkerEngine, run_worker, token_tensors
from llmc.planning.machine import PROCESS_BYTES
from llmc.planning.rows import CostRow
from llmc.errors import EngineFailed

SPEC = engine_spec("gptqmodel")
CPU_DTYPE = "bfloat16"  # GPTQModel's CPU QuantLinear kernels accept bfloat16 / float16 only
BACKEND_VARIABLE = "LLMC_GPTQMODEL_BACKEND"  # a GPTQModel BACKEND value; "auto" lets GPTQModel pick its CPU kernel


def gptqmodel_version() -> str | None:
    return engine_version(SPEC)


def gptqmodel_available() -> bool:
    return gptqmodel_version() is not None


class GptqModelEngine(WorkerEngine):
    name = "gptqmodel"

    def __init__(self, folder: Path, *, dtype: str = "float32", backend: str | None = None,
                 threads: int | None = None) -> None:
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise EngineFailed(f"no checkpoint at {self.folder} (config.json missing)",
                               fix="export the artifact for an exllamav2 (GPTQ) or lmdeploy (AWQ) target")
        self.dtype = CPU_DTYPE if dtype == "float32" else dtype
        self.backend = backend or os.environ.get(BACKEND_VARIABLE) or "auto"
        self.threads = threads or os.cpu_count() or 1
        require_engine(SPEC)

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256,
                throughput_batch_sizes=(1,)) -> tuple[dict, dict]:
        """(scores, throughput), as the torch engine: NLL, and KL / top-1 against `reference`."""
        del batch_size, top_k, throughput_batch_sizes
        request = {"model": str(self.folder), "dtype": self.dtype, "backend": self.backend, "threads": self.threads,
                   "decode_tokens": decode_tokens, "repeats": repeats}
        env = {"TOKENIZERS_PARALLELISM": "false"}
        result, out = run_worker(SPEC, request, token_tensors(windows, prompt, reference), about=str(self.folder),
                                 env=env)
        scores = {"nll": torch.from_numpy(out["nll"]).double()}
        if reference is not None:
            scores.update(agreement(reference, torch.from_numpy(out["logprobs_at_reference"]),
                                    torch.from_numpy(out["top1_index"])))
            with_exact_kl(scores, torch.from_numpy(out["kl_exact"]) if "kl_exact" in out else None)
        tput = {**result["throughput"], "engine_version": result["version"], "engine_load_s": result["load_s"],
                "engine_dtype": self.dtype, "threads": result["threads"],
                "kernels": result["kernels"], "backend": self.backend}
        return scores, tput


# GPTQModel's start in its worker (imports, kernel selection, the checkpoint's load): 19-20 s recorded for SmolLM2-135M
# on the 2-core VM (docs/formats-and-runtimes.md, "Runtimes on this CPU"; docs/planner-constants.md#engine-start-up)
START_S = 20.0


def scoring_cost(s: Scoring) -> CostRow:
    """One scoring in GPTQModel (its own process): the checkpoint's weights as stored, bfloat16 activations at the
    machine's probed bfloat16 matmul rate (its int4 kernels are not probed: an estimate; its recorded decode was far
    slower than its prefill, not understood)."""
    score_s, throughput_s = protocol_seconds(s, CPU_DTYPE)
    parts = {"worker process": PROCESS_BYTES, "weights": s.model_bytes, "window logits": window_logits_bytes(s),
             "scores and reference": scores_bytes(s)}
    return CostRow("gptqmodel", "cpu", sum(parts.values()), 0.0, 0.0,
                   START_S + read_seconds(s) + score_s + throughput_s, "its own process, bfloat16",
                   f"start ~{START_S:g} s (recorded), scoring ~{score_s:.0f} s and throughput ~{throughput_s:.0f} s at "
                   "the probed bfloat16 matmul rate (GPTQModel's kernels are not probed: an estimate)", parts)
