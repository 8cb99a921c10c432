"""Which device calibrates and quantizes the layers (recipe key `calibration.device`), and with how many CPU
threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` (None: left as they are) for the block, then given back: a build
    or evaluation called as a library function (tests, the hook, a notebook) must not leave its process on one
    thread."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def resolve_device(requested: str, key: str = "calibration.device") -> torch.device:
    """The device the recipe's `key` (calibration.device, eval.device) names ("auto": CUDA when torch sees a GPU)."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        from llmc.errors import ResourceError

        raise ResourceError(
            f"{key} is '{requested}' but torch sees no CUDA GPU (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'})",
            fix=f"set {key}: auto (or cpu), or run on a machine with a GPU and a CUDA build of torch",
        )
    return torch.device(requested)
