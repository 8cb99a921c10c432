"""The calibration hidden states that flow from one decoder layer to the next.

Each layer's inputs are kept per calibration batch. They live in memory, or — when they would not
fit (70B-class widths with many long windows: 512 × 2048 tokens × 8192 × fp32 is 34 GB per copy) —
spilled: every batch in its own safetensors file, read back when the layer needs it, so only the
batch being run is resident. Either way, each layer's inputs are also the resume point of a killed
run, so they are written to `state/inputs-<layer>/` before progress moves past that layer.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from llmc.model.skeleton import HOST
from llmc.telemetry import events
from llmc.storage.store import fsync_dir, resource_errors

SpillMode = Literal["auto", "always", "never"]
# auto spills when input + output copies of the activations would take more than this share of
# the memory available when quantization starts (the rest is for the layer and algorithm state).
AUTO_SPILL_SHARE = 0.25


ALL_BATCHES = "batches.safetensors"  # in-memory mode's single file per layer


def inputs_dir(state_dir: Path, layer: int) -> Path:
    return state_dir / f"inputs-{layer:05d}"


def should_spill(mode: SpillMode, activation_bytes: int, available: int | None) -> bool:
    if mode != "auto":
        return mode == "always"
    return available is not None and 2 * activation_bytes > AUTO_SPILL_SHARE * available


# On a GPU the activations stay there between layers when input + output copies take at most this share of the GPU
# memory free when quantization starts: the rest is for the layer, one forward's temporaries and the algorithm's
# state (AWQ keeps every module's calibration inputs: about 25x a copy at 8B width, docs/gpu.md).
RESIDENT_SHARE = 0.25


def stays_on_device(device: torch.device, activation_bytes: int, device_free: int | None) -> bool:
    """Whether the activations passed between layers live on the calibrating GPU (no host round trip per batch and
    layer) rather than in host memory: a CUDA device with room for two copies (`RESIDENT_SHARE`)."""
    return (device.type == "cuda" and device_free is not None
            and 2 * activation_bytes <= RESIDENT_SHARE * device_free)


class Activations:
    """One layer's inputs, one tensor per calibration batch, in memory or read back from disk."""

    def __init__(self, tensors: list[torch.Tensor] | None = None, folder: Path | None = None, count: int = 0):
        self._tensors, self._folder = tensors, folder
        self._count = len(tensors) if tensors is not None else count

    @classmethod
    def load(cls, folder: Path, spill: bool) -> Activations:
        if (folder / ALL_BATCHES).is_file():  # written in memory mode: one file
            d = load_file(str(folder / ALL_BATCHES))
            tensors = [d[f"b{b:05d}"] for b in range(len(d))]
            if not spill:
                return cls(tensors=tensors)
            for b, t in enumerate(tensors):  # resumed with less memory than it was started with
                _write(folder / f"b{b:05d}.safetensors", {"hidden": t})
            (folder / ALL_BATCHES).unlink()
        count = len(list(folder.glob("b[0-9]*.safetensors")))
        if spill:
            return cls(folder=folder, count=count)
        return cls(tensors=[_read(folder, b) for b in range(count)])

    def __len__(self) -> int:
        return self._count

    @property
    def spilled(self) -> bool:
        return self._tensors is None

    def __getitem__(self, b: int) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[b]
        return _read(self._folder, b)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[b] for b in range(self._count))

    def to(self, device: torch.device) -> Activations:
        """In-memory batches moved to `device` (spilled ones stay on disk)."""
        if self._tensors is None:
            return self
        return Activations(tensors=[t.to(device) for t in self._tensors])


class ActivationWriter:
    """Collects the next layer's inputs batch by batch and publishes them as one folder.

    Spilled batches go to disk as they are produced; in-memory ones are written by `persist`. The folder appears
    under its final name only when every batch is in it (rename), so a killed run never resumes from a partial set;
    progress moves past a layer only once `persist` has made the folder durable. In-memory batches are kept on
    `device`: the host, or the calibrating GPU when they stay there (`stays_on_device`; `persist` copies them to
    the host to write them).
    """

    def __init__(self, final: Path, spill: bool, device: torch.device = HOST):
        self.final, self.spill, self.device = final, spill, device
        self.partial = final.with_name(final.name + ".partial")
        shutil.rmtree(self.partial, ignore_errors=True)
        if spill:
            self.partial.mkdir(parents=True)
        self._tensors: list[torch.Tensor] = []
        self._count = 0

    def put(self, tensor: torch.Tensor) -> None:
        b = self._count
        self._count += 1
        if self.spill:
            _write(self.partial / f"b{b:05d}.safetensors", {"hidden": tensor.to(HOST)})
        else:
            self._tensors.append(tensor.to(self.device))

    def commit(self) -> Activations:
        """`publish`, then `persist`: the inputs, durable under their final name."""
        hidden = self.publish()
        self.persist()
        return hidden

    def publish(self) -> Activations:
        """The inputs as the next layer reads them, now: in memory, or spilled batches under the final folder name
        (renamed, not yet fsynced)."""
        if not self.spill:
            return Activations(tensors=list(self._tensors))
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.partial, self.final)
        return Activations(folder=self.final, count=self._count)

    def persist(self) -> None:
        """Make the published inputs durable under their final name (may run on another thread than `publish`:
        it only reads the batches)."""
        if not self.spill:  # one file (one fsync) per layer, not one per batch
            self.partial.mkdir(parents=True, exist_ok=True)
            # from a GPU: a blocking copy on this (the writer's) thread, ordered after the kernels that made them
            _write(self.partial / ALL_BATCHES, {f"b{b:05d}": t.to(HOST) for b, t in enumerate(self._tensors)})
        folder = self.final if self.spill else self.partial
        # Files need no rename of their own (the folder is renamed once), only to be on disk first.
        for f in folder.iterdir():
            with open(f, "rb+") as handle:
                os.fsync(handle.fileno())
        if not self.spill:
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.partial, self.final)
        fsync_dir(self.final.parent)
        self._tensors = []  # the writer must not keep them alive


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with resource_errors(path.name, path.parent):
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(path))
    events.emit(f"file:{path.name}")


def _read(folder: Path, b: int) -> torch.Tensor:
    return load_file(str(folder / f"b{b:05d}.safetensors"))["hidden"]
