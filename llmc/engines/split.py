"""A build's evaluation split over torchrun's ranks.

Rank 0 runs the build's evaluation stage: it looks the stages up, writes them, gates and publishes. For an engine
that scores its share of the windows (`EngineSpec.splits_over_ranks`: the torch reference) it calls the other ranks
in (`scoring_ranks`); they wait in `follow_scoring`, open the same model folder, score their block of whole batches
and gather the per-window values back in window order (`TorchEngine.score`), so every interval rank 0 computes is a
single process's. Throughput is measured on rank 0 alone. Engines in their own processes (vLLM, llama.cpp, ONNX
Runtime, ...) run on rank 0 while the others wait.

What travels: the windows (token ids), the model folder's path and the reference's stage folder (every rank reads
the same cache: docs/distributed.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from llmc import distributed
from llmc.engines.registry import engine_spec, open_engine
from llmc.engines.agreement import load_reference
from llmc.engines.torch_stream import decide_torch_loading_of


def splits(engine: str) -> bool:
    """Whether `engine` scores on every rank of the job this process belongs to."""
    return distributed.active() and engine_spec(engine).splits_over_ranks


def ranks_scoring(engine: str) -> int:
    """How many processes score windows in `engine` here (recorded with the evaluation's hardware)."""
    return distributed.size() if splits(engine) else 1


@contextlib.contextmanager
def scoring_ranks(engine: str, folder: Path, *, dtype: str, windows: torch.Tensor, batch_size: int, top_k: int,
                  reference_dir: Path | None) -> Iterator[None]:
    """Rank 0, around its own `open_engine(...)` + `measure(...)`: the other ranks open `folder` in `engine` and
    score the same windows with it (a no-op for an engine that does not split, or in one process)."""
    if not splits(engine):
        yield
        return
    command = {"engine": engine, "folder": str(folder), "dtype": dtype, "windows": windows, "batch_size": batch_size,
               "top_k": top_k, "reference_dir": None if reference_dir is None else str(reference_dir)}
    with distributed.leading(command):
        yield


def follow_scoring() -> None:
    """The ranks other than 0, after the shared calibration: score what rank 0 asks until it releases them."""
    distributed.follow(_score_share)


def _score_share(command: dict) -> None:
    reference = load_reference(Path(command["reference_dir"])) if command["reference_dir"] else None
    folder = Path(command["folder"])
    # the torch reference (the engine that splits) as this rank's machine allows; the ranks then agree on it
    # (streamed where any rank streams: TorchEngine), as rank 0 obeys its plan's decision
    streamed = decide_torch_loading_of(folder, command["dtype"]).streamed
    with open_engine(command["engine"], folder, dtype=command["dtype"], streamed=streamed) as eng:
        eng.score(command["windows"], batch_size=command["batch_size"], reference=reference, top_k=command["top_k"])
