"""llama.cpp engine: scores a GGUF artifact's windows and times prefill/decode in llama.cpp.

llama-cpp-python is built from source (`bash scripts/setup-llama.sh` -> .venv-llama) and kept out of
llmc's environment; each evaluation runs `_llama_worker.py` in a child process. llama.cpp returns full
logits, so besides the NLL it measures KL and top-1 agreement against a reference's top-k log-probs.
(This module is not called llama_cpp: the worker runs from this folder and must import the real one.)
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

import numpy as np
import torch

from llmc.engines.torch_ref import agreement
from llmc.engines.environments import runtime_python
from llmc.errors import EngineFailed, EngineUnavailable

WORKER = Path(__file__).with_name("_llama_worker.py")


def llama_python() -> Path:
    return runtime_python("LLMC_LLAMA_PYTHON", ".venv-llama", "llama.cpp",
                          fix="bash scripts/setup-llama.sh (or set LLMC_LLAMA_PYTHON to a python that can import llama_cpp)")


@lru_cache(maxsize=1)
def llama_cpp_version() -> str | None:
    try:
        py = llama_python()
    except EngineUnavailable:
        return None
    r = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, folder: Path, *, dtype: str = "float32", timeout_s: float = 3600, threads: int | None = None) -> None:
        del dtype  # the GGUF's tensor types decide the arithmetic
        folder = Path(folder)
        self.gguf = folder if folder.suffix == ".gguf" else folder / "model.gguf"
        if not self.gguf.is_file():
            raise EngineFailed(f"no GGUF file at {self.gguf}", fix="export the artifact for a llama.cpp target")
        if llama_cpp_version() is None:
            raise EngineUnavailable("llama_cpp is not importable in its environment", fix="bash scripts/setup-llama.sh")
        self.timeout_s = timeout_s
        self.threads = threads or os.cpu_count() or 1

    def run(self, windows: torch.Tensor, prompt: torch.Tensor, decode_tokens: int, repeats: int,
            reference_index: torch.Tensor | None) -> dict[str, np.ndarray]:
        with tempfile.TemporaryDirectory(prefix="llmc-llama-") as tmp:
            req, resp = Path(tmp) / "request.json", Path(tmp) / "response.npz"
            ref_path = None
            if reference_index is not None:
                ref_path = str(Path(tmp) / "reference_index.npy")
                np.save(ref_path, reference_index.numpy().astype(np.int64))
            req.write_text(json.dumps({
                "gguf": str(self.gguf), "windows": windows.tolist(), "reference_index": ref_path,
                "prompt": prompt[0].tolist(), "decode_tokens": decode_tokens, "repeats": repeats,
                "threads": self.threads,
            }))
            proc = subprocess.Popen([str(llama_python()), str(WORKER), str(req), str(resp)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                _, stderr = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"llama.cpp did not finish evaluating {self.gguf} within {self.timeout_s:.0f} s") from None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.returncode != 0 or not resp.is_file():
                tail = "\n".join((stderr or "").strip().splitlines()[-40:])
                raise EngineFailed(f"llama.cpp failed on {self.gguf} (exit {proc.returncode}):\n{tail}",
                                   fix="check the GGUF with `llmc inspect`; a crash (-11) at the first eval "
                                       "usually means a llama.cpp build for another CPU (bash scripts/setup-llama.sh)")
            with np.load(resp) as z:
                return {k: z[k] for k in z.files}

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict | None = None, top_k: int = 256) -> tuple[dict, dict]:
        """(scores, throughput), as the torch engine: NLL, and KL / top-1 against `reference`."""
        del batch_size, top_k
        ref_index = reference["topk_index"].long() if reference is not None else None
        out = self.run(windows, prompt, decode_tokens, repeats, ref_index)
        scores = {"nll": torch.from_numpy(out["nll"]).double()}
        if reference is not None:
            scores.update(agreement(reference, torch.from_numpy(out["logprobs_at_reference"]),
                                    torch.from_numpy(out["top1_index"])))
        meta = json.loads(str(out["meta"]))
        tput = {**meta["throughput"], "engine_version": meta["version"], "engine_load_s": meta["load_s"],
                "threads": self.threads}
        return scores, tput
