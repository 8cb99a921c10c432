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
from llmc.errors import EngineFailed, EngineUnavailable, LlmcError, ResourceError
from llmc.storage.resource_errors import DISK_FULL, IO_ERROR, OUT_OF_MEMORY, QUOTA, error_for, kind_from_description
from llmc.storage.store import resource_errors

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
        with resource_errors(f"{spec.display}'s request (TMPDIR)", folder):
            _wire.write_request(folder, request, tensors)
        oom_kills = _oom_kills()
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
            if (resource := _resource_failure(spec, about, folder, proc.returncode, tail, oom_kills)) is not None:
                raise resource
            raise EngineFailed(f"{spec.display} failed on {about} (exit {proc.returncode}):\n{tail}",
                               fix=spec.environment.failure_fix)
        return _wire.read_result(folder)


def _resource_failure(spec: EngineSpec, about: str, folder: Path, returncode: int, tail: str,
                      oom_kills_before: int | None) -> ResourceError | None:
    """A worker that ran out of memory or disk is a resource failure (exit 4), not a runtime failure: as told by
    its error.json, by its log when it could not write one, or by a SIGKILL that llmc did not send (the kernel's
    out-of-memory killer sends it; the cgroup's oom_kill count says so where it is readable)."""
    what = f"{spec.display} evaluating {about}"
    error = _wire.read_error(folder)
    if error is not None:
        kind = kind_from_description(error.get("types", []), error.get("errno"), error.get("message", ""))
    else:
        kind = kind_from_description([], None, tail)
    if kind is not None:
        detail = (error or {}).get("message") or (tail.splitlines() or [""])[-1]
        if kind in (DISK_FULL, QUOTA, IO_ERROR):
            return error_for(kind, f"{spec.display}'s files while evaluating {about}",
                             f"{folder.parent} (TMPDIR) or the engine's own folders", " ".join(detail.split())[:200])
        return error_for(kind, what, None, " ".join(detail.split())[:200])
    if returncode == -signal.SIGKILL:
        after = _oom_kills()
        confirmed = oom_kills_before is not None and after is not None and after > oom_kills_before
        return error_for(OUT_OF_MEMORY, what, None,
                         "the worker was killed by the kernel's out-of-memory killer" if confirmed else
                         "the worker was killed by SIGKILL from outside llmc, which the out-of-memory killer sends")
    return None


def _oom_kills() -> int | None:
    """How many processes the out-of-memory killer has killed in this cgroup (v2), where that is readable."""
    try:
        for line in Path("/sys/fs/cgroup/memory.events").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


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
