"""The one wire format between llmc and an engine worker. Standard library and numpy only: every engine
environment has numpy, not necessarily torch or safetensors, and none has llmc.

A request folder holds
    request.json   plain values (paths, counts, options)
    tensors.npz    arrays: windows [n, seq] and prompt [p] token ids, reference_index [n, seq-1, k] when scoring
                   against a reference, and when that reference recorded its output head (for the exact KL:
                   llmc.engines.agreement, computed by _agreement.py) also
                     reference_head_input  [n, seq-1, hidden] float32  what entered the baseline's head per token
                     reference_head_weight [vocab, hidden] float32     the head's weight
                     reference_head_bias   [vocab] float32             its bias, when it has one
                     reference_head_post   [2] float64                 scale, soft-cap (0: none) after the head
                   (the worker holds the weight and the head inputs, then a bounded chunk of tokens at a time)
and the worker answers in the same folder with
    scores.npz     per-token arrays (nll [n, seq-1], and whatever else the engine measures; kl_exact [n, seq-1]
                   when it was sent a reference head)
    result.json    plain values (throughput, engine version, load time); written last, so that its presence
                   means the worker finished.
or, when the worker failed with an exception,
    error.json     {"types": the exception's class names (MRO), "errno": int or null, "message": str}, for llmc
                   to tell a resource failure (disk full, out of memory) from any other (llmc.storage.resource_errors).

llmc imports this file as llmc.engines.workers._wire; a worker imports it as `_wire` (its own folder is on
sys.path when it runs as a script).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import numpy as np

REQUEST, TENSORS, SCORES, RESULT, ERROR = "request.json", "tensors.npz", "scores.npz", "result.json", "error.json"


def write_request(folder: Path, request: dict, tensors: dict[str, np.ndarray]) -> None:
    np.savez(Path(folder) / TENSORS, **tensors)
    (Path(folder) / REQUEST).write_text(json.dumps(request))


def read_request(folder: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads((Path(folder) / REQUEST).read_text()), _load_npz(Path(folder) / TENSORS)


def write_result(folder: str | Path, result: dict, scores: dict[str, np.ndarray]) -> None:
    folder = Path(folder)
    np.savez(folder / SCORES, **scores)
    (folder / (RESULT + ".tmp")).write_text(json.dumps(result))
    os.replace(folder / (RESULT + ".tmp"), folder / RESULT)


def run(main, folder: str) -> None:
    """A worker's entry point: `main(folder)`; an exception is also described in error.json, then re-raised
    (its traceback goes to the worker's log and the exit status is non-zero)."""
    try:
        main(folder)
    except BaseException as e:
        err = getattr(e, "errno", None)
        try:
            (Path(folder) / ERROR).write_text(json.dumps({
                "types": [c.__name__ for c in type(e).__mro__],
                "errno": err if isinstance(err, int) else None,
                "message": str(e)[:2000],
            }))
        except OSError:
            pass  # the disk may be the thing that failed; llmc then reads the log instead
        raise


def read_error(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / ERROR).read_text())
    except (OSError, ValueError):
        return None


def has_result(folder: Path) -> bool:
    return (Path(folder) / RESULT).is_file()


def read_result(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads((Path(folder) / RESULT).read_text()), _load_npz(Path(folder) / SCORES)


def summary(xs: list[float]) -> dict | None:
    """Median, min, max and count of repeated timings (None when nothing was timed)."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        return {}
    with np.load(path) as z:
        return {k: z[k] for k in z.files}
