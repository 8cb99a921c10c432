"""Expert-by-expert streaming: a Mixture-of-Experts layer too large for memory, one routed expert at a time.

DeepSeek-V3's MoE layer is 11.3 B parameters, 22.5 GB in bf16: more than a 24 GB machine holds beside its codes. When
the layer loop's decision says so (`LayerLoopPlan.expert_stream`, llmc.quant.loop_plan), the stream reads the layer
without its routed experts and:

1. runs the calibration batches through it once with each MoE block's experts *deferred* (`DeferredExperts`): the
   router runs, the experts' inputs and routing are kept per call, the block gets zeros (the MoE block is the last
   sublayer, so nothing observed depends on them);
2. per expert: reads its weights from the checkpoint (its own tensors, never the layer's), runs it on the kept calls
   (its routed tokens, or every token with `moe_calibrate_all_experts`) with its Linears observed, adding its
   weighted outputs into each call's output in expert order, as `ExpertLinears.forward` does; quantizes it, spills
   its tensors to a file (`LayerParts`) and drops its weights;
3. runs the batches again with each block returning the outputs summed in step 2: the next layer's inputs.

The layer file is then assembled from the resident tensors and the spilled ones, streamed from disk: the same bytes
`safetensors` writes for the same tensors (llmc.storage.direct_io.header: the library's order and header), so the
output equals the whole-layer path's bit for bit (tests/unit/test_expert_stream.py). Only observing pipelines are
streamed (RTN's ranges, or data-free): each expert's statistics and codes then depend on its own weights and inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from llmc.model.skeleton import release
from llmc.quant.moe import ExpertLinears, routed_blocks
from llmc.storage import direct_io
from llmc.storage.store import fsync_dir

# a routed expert's tensor, layer-relative: `<block>.experts.<e>.<projection>.<kind>` (not `shared_experts`)
ROUTED_EXPERT = re.compile(r"^(?:.*\.)?experts\.\d+\.")
COPY_CHUNK = 16 << 20  # bytes copied from a spilled expert's file at a time


def is_routed_expert(layer_relative_name: str) -> bool:
    return ROUTED_EXPERT.match(layer_relative_name) is not None


class DeferredExperts:
    """Stands in for one block's expert loop: records each call's inputs and routing (capture), runs one expert over
    every recorded call (`run_expert`), then returns each call's summed output in call order (replay)."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (hidden, routing mask, weights)
        self.outputs: list[torch.Tensor] = []
        self.replaying = False
        self._next = 0

    def __call__(self, experts: ExpertLinears, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.replaying:
            out = self.outputs[self._next]
            self._next += 1
            return out
        mask = experts.routing_mask(top_k_index)
        if experts.routed is not None:  # counted once per call, as the whole loop counts them
            experts.routed += mask[: len(experts)].flatten(1).sum(dim=1)
        self.calls.append((hidden.detach(), mask, top_k_weights.detach()))
        self.outputs.append(torch.zeros_like(hidden))
        return torch.zeros_like(hidden)

    def run_expert(self, experts: ExpertLinears, e: int) -> None:
        with torch.no_grad():
            for (hidden, mask, weights), final in zip(self.calls, self.outputs):
                experts.add_expert(e, hidden, mask, weights, final)

    def replay(self) -> None:
        self.replaying, self._next = True, 0


@contextlib.contextmanager
def deferred(layer: nn.Module) -> Iterator[dict[str, DeferredExperts]]:
    """Inside: every MoE block of `layer` defers its experts (block name -> its `DeferredExperts`)."""
    blocks = {name: (experts, DeferredExperts()) for name, _block, experts in routed_blocks(layer)}
    for experts, d in blocks.values():
        experts.deferred = d
    try:
        yield {name: d for name, (_e, d) in blocks.items()}
    finally:
        for experts, _d in blocks.values():
            experts.deferred = None


def move_resident(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)` for its materialized tensors; the routed experts' meta weights stay unread."""
    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for k, t in store.items():
                if t is None or t.is_meta or t.device == device:
                    continue
                moved = t.data.to(device)
                store[k] = nn.Parameter(moved, requires_grad=False) if isinstance(t, nn.Parameter) else moved


def release_weights(module: nn.Module) -> None:
    """Drop `module`'s tensors (back to meta): an expert once its codes are spilled. The freed heap is given back
    to the OS each time (llmc.model.skeleton.release): without it the process grew ~35 MB an expert at DeepSeek-V3's
    width (RssAnon 3.5 GB at expert 12, 5.4 GB at expert 63 of 256)."""
    release(module)


class LayerParts:
    """A layer's file made of tensors spilled expert by expert (`spill`) and the layer's resident ones (`write`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.spilled: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}  # name -> file, offset, ...

    def spill(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """One expert's tensors to their own file (its weights are dropped next); where each one's bytes lie."""
        path = self.folder / f"{key}.safetensors"
        tensors = {n: t.contiguous().cpu() for n, t in tensors.items()}
        save_file(tensors, str(path))
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            head = json.loads(f.read(n))
        for name, info in head.items():
            if name != "__metadata__":
                self.spilled[name] = (path, 8 + n + info["data_offsets"][0], tensors[name].dtype,
                                      tuple(tensors[name].shape))

    def unspill(self, names) -> None:
        """Forget the spilled copies of `names`: the layer's resident tensors of those names replace them."""
        for name in names:
            self.spilled.pop(name, None)

    def write(self, path: Path, resident: dict[str, torch.Tensor]) -> None:
        """The layer's file: `resident` and the spilled tensors, in the bytes safetensors writes for them all (its
        order and header), streamed from the spill files; fsynced, renamed into place, spill files removed."""
        resident = {n: t.contiguous().cpu() for n, t in resident.items() if n not in self.spilled}
        meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (_p, _o, dtype, shape) in self.spilled.items()}
        head, order = direct_io.header({**resident, **meta}, None)
        # a spill file is removed once its last tensor is copied: the library's order keeps an expert's 1-byte codes
        # and scales together, so the disk holds about one layer of expert codes, not two
        left: dict[Path, int] = {}
        for src, *_ in self.spilled.values():
            left[src] = left.get(src, 0) + 1
        tmp = path.with_name(f".{path.name}.tmp")
        digest = hashlib.sha256(head)
        with open(tmp, "wb") as out:
            out.write(head)
            for name in order:
                if name in resident:
                    data = resident[name].reshape(-1).view(torch.uint8).numpy().tobytes() \
                        if resident[name].numel() else b""
                    out.write(data)
                    digest.update(data)
                    continue
                self._copy(name, meta[name], out, digest)
                src = self.spilled[name][0]
                left[src] -= 1
                if not left[src]:
                    src.unlink()
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        direct_io.remember(path, digest.hexdigest())
        for f in self.folder.glob("*.safetensors"):
            f.unlink()
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    def _copy(self, name: str, like: torch.Tensor, out, digest) -> None:
        src, offset, _dtype, _shape = self.spilled[name]
        left = like.numel() * like.element_size()
        with open(src, "rb") as f:
            f.seek(offset)
            while left:
                block = f.read(min(COPY_CHUNK, left))
                if not block:
                    raise OSError(f"{src}: ends before {name}'s bytes (the spill file was truncated)")
                out.write(block)
                digest.update(block)
                left -= len(block)
