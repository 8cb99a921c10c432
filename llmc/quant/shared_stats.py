"""Calibration statistics shared between schemes on the same model and data.

When layer i+1 is calibrated on layer i's *original* outputs (RTN static scales, KV-cache scales,
SmoothQuant), what calibration observes at each layer — every Linear's per-channel input absmax and
every attention module's key/value absmax — depends only on the model, the calibration tokens and the
compute dtype, never on the scheme. The first such scheme writes them here per layer; a later one that
needs a subset (INT8 static after FP8 static + KV, SmoothQuant after either) reads them and runs no
calibration forward at all. The folder is keyed by (model hash, calibration data hash, dtype) by the
caller.

Not shared: GPTQ Hessians and AWQ's per-module inputs. Both algorithms calibrate layer i+1 on the
already-*quantized* layer i, so their statistics depend on the scheme from the second layer on
(`AlgorithmSteps.shares_statistics`: no step registered with `hessians` or `module_calls`, original outputs).

    <folder>/layer-<i>.safetensors   channel_absmax.<linear>, key_absmax.<attn>, value_absmax.<attn>
    <folder>/complete.json           written last: layer count and the names covered

Several builds may record into one folder at once (the same model and data: a search's measurement beside a
hand-mixed build, the registry hook's queue): each layer file only grows (a scheme that observed fewer modules adds
its statistics to what is there, never drops them), `complete.json` claims the union of what its writers covered,
and both are read-modify-written under the folder's lock. A scheme that left layer 0 unquantized once rewrote that
layer's file empty after another had recorded it, and the other then claimed it complete.
"""

from __future__ import annotations

from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load_file

from llmc.storage.store import atomic_save_safetensors, atomic_write_json

KINDS = ("channel_absmax", "key_absmax", "value_absmax")
COMPLETE = "complete.json"
LOCK = ".lock"


class SharedStats:
    def __init__(self, folder: Path, n_layers: int) -> None:
        self.folder, self.n_layers = Path(folder), n_layers

    def covers(self, linears: set[str], kv_modules: set[str]) -> bool:
        """True when every layer is stored and holds statistics for all these modules."""
        marker = self.folder / COMPLETE
        if not marker.is_file():
            return False
        import json

        done = json.loads(marker.read_text())
        return (done["layers"] == self.n_layers and linears <= set(done["linears"])
                and kv_modules <= set(done["kv_modules"]))

    def _locked(self) -> FileLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.folder / LOCK))

    def save(self, layer: int, stats: dict[str, dict[str, torch.Tensor]]) -> None:
        """Add this layer's statistics to its file (what other schemes recorded there stays)."""
        tensors = {f"{kind}.{name}": t.contiguous() for kind in KINDS for name, t in stats[kind].items()}
        path = self.folder / f"layer-{layer:05d}.safetensors"
        with self._locked():
            if path.is_file():
                tensors = {**load_file(str(path)), **tensors}
            atomic_save_safetensors(path, tensors)

    def load(self, layer: int) -> dict[str, dict[str, torch.Tensor]]:
        tensors = load_file(str(self.folder / f"layer-{layer:05d}.safetensors"))
        out: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
        for key, t in tensors.items():
            kind, name = key.split(".", 1)
            out[kind][name] = t
        return out

    def finish(self, linears: set[str], kv_modules: set[str]) -> None:
        """Mark the statistics complete (only when every layer's file is there: a run resumed from a
        work folder that did not share statistics leaves them incomplete, and unused), for these modules and those
        an earlier writer covered."""
        import json

        with self._locked():
            if not all((self.folder / f"layer-{i:05d}.safetensors").is_file() for i in range(self.n_layers)):
                return
            marker = self.folder / COMPLETE
            if marker.is_file():
                done = json.loads(marker.read_text())
                if done.get("layers") == self.n_layers:
                    linears, kv_modules = linears | set(done["linears"]), kv_modules | set(done["kv_modules"])
            atomic_write_json(marker, {"layers": self.n_layers, "linears": sorted(linears),
                                       "kv_modules": sorted(kv_modules)})
