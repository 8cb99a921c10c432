"""The one way llmc runs an engine that lives in its own environment (vLLM, llama.cpp, TensorRT-LLM, ...).

Each evaluation is one child process, `<engine python> llmc/engines/workers/<worker>.py <request folder>`,
speaking the wire format of llmc/engines/workers/_wire.py. The child runs in its own session (process group)
and the whole group is killed with SIGKILL when the call ends: on timeout, on KeyboardInterrupt or any other
exception, and after a normal exit too, so that no engine helper (vLLM forks an engine core and workers)
outlives the evaluation and keeps a CPU or a GPU busy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from llmc.engines.agreement import HEAD_INPUT, OutputHead
from llmc.engines.base import EngineBase
from llmc.engines.environments import engine_python, environment_fix
from llmc.engines.registry import EngineSpec
from llmc.engines.workers import _wire
from llmc.errors import EngineFailed, EngineUnavailable, LlmcError

WORKERS = Path(__file__).with_name("workers")
TIMEOUT_VARIABLE = "LLMC_ENGINE_TIMEOUT_S"
OUTPUT_TAIL_LINES = 40


def worker_timeout(spec: EngineSpec) -> float:
    """Seconds one worker run may take: $LLMC_ENGINE_TIMEOUT_S, else the engine's own default."""
    value = os.environ.get(TIMEOUT_VARIABLE)
    if not value:
        return spec.environment.timeout_s
    try:
        return float(value)
    except ValueError:
        raise LlmcError(f"{TIMEOUT_VARIABLE}={value!r} is not a number of seconds") from None


def run_worker(spec: EngineSpec, request: dict, tensors: dict[str, np.ndarray], *, about: str,
               env: dict[str, str] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Run `spec`'s worker on one request; its (result.json, scores.npz). `about` names the model in messages,
    `env` adds environment variables for the child."""
    python, timeout_s = engine_python(spec), worker_timeout(spec)
    with tempfile.TemporaryDirectory(prefix=f"llmc-{spec.name}-") as tmp:
        folder = Path(tmp)
        _wire.write_request(folder, request, tensors)
        log = folder / "output.log"  # a file, not a pipe: a lingering grandchild cannot hold the call open
        with log.open("wb") as out:
            try:
                proc = subprocess.Popen([str(python), str(WORKERS / spec.environment.worker), str(folder)],
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, start_new_session=True)
            except OSError as e:  # not an executable, wrong architecture, ...
                raise EngineUnavailable(f"cannot start {spec.display}'s Python {python}: {e}",
                                        fix=environment_fix(spec)) from None
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"{spec.display} did not finish evaluating {about} within {timeout_s:.0f} s",
                                   fix=f"set {TIMEOUT_VARIABLE} (seconds) higher if the model is only slow") from None
            finally:
                _kill_group(proc)
        if proc.returncode != 0 or not _wire.has_result(folder):
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-OUTPUT_TAIL_LINES:])
            raise EngineFailed(f"{spec.display} failed on {about} (exit {proc.returncode}):\n{tail}",
                               fix=spec.environment.failure_fix)
        return _wire.read_result(folder)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group may already be gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class WorkerEngine(EngineBase):
    """An engine whose every `measure` is one worker run: loading the engine is the expensive part, so
    scores and throughput come from the same run. `score` and `throughput` alone are such a run with the
    other half cut down (no timing repeats; the prompt scored as the only window)."""

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict[str, torch.Tensor] | None = None, top_k: int = 256,
                throughput_batch_sizes: Sequence[int] = (1,)) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError  # each engine builds its request and reads its result

    def score(self, windows: torch.Tensor, batch_size: int = 4, reference: dict[str, torch.Tensor] | None = None,
              top_k: int = 256) -> dict[str, torch.Tensor]:
        return self.measure(windows, windows[:1], decode_tokens=0, repeats=0, batch_size=batch_size,
                            reference=reference, top_k=top_k)[0]

    def throughput(self, prompt: torch.Tensor, decode_tokens: int, repeats: int,
                   batch_sizes: Sequence[int] = (1,)) -> dict:
        return self.measure(prompt[:1], prompt, decode_tokens=decode_tokens, repeats=repeats, top_k=1,
                            throughput_batch_sizes=batch_sizes)[1]  # the scores are dropped: keep them small


def token_tensors(windows: torch.Tensor, prompt: torch.Tensor, reference: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, np.ndarray]:
    """The arrays every worker request carries: windows [n, seq], the prompt's first row, and when the engine scores
    against a reference, its top-k token ids and, where it recorded one, its output head (for the exact KL)."""
    tensors = {"windows": windows.long().numpy(), "prompt": prompt[0].long().numpy()}
    if reference is not None:
        tensors["reference_index"] = reference["topk_index"].long().numpy()
        head = OutputHead.from_reference(reference)
        if head is not None:  # float32: numpy has no bfloat16
            tensors["reference_head_input"] = reference[HEAD_INPUT].float().numpy()
            tensors["reference_head_weight"] = head.weight.float().numpy()
            tensors["reference_head_post"] = np.array([head.post.scale, head.post.softcap or 0.0])
            if head.bias is not None:
                tensors["reference_head_bias"] = head.bias.float().numpy()
    return tensors
