"""Worker for tests/unit/test_distributed.py: quantize a model folder with each named scheme, as one process or as
one rank of a torchrun job (`python -m torch.distributed.run --standalone --nproc-per-node 2 dist_child.py ...`).

    dist_child.py MODEL OUT SCHEME[,SCHEME...]     writes OUT/<scheme>/ (the canonical quantized form)
    dist_child.py --eval ARTIFACT WINDOWS.pt OUT.pt   scores the windows in the torch engine (rank 0 saves them)

LLMC_TEST_KILL_RANK / LLMC_TEST_KILL_LAYER: that rank SIGKILLs itself while writing that layer's outputs (mid-layer).
LLMC_TEST_SPILL: the calibration's spill_activations (default "auto"). LLMC_TEST_CALIBRATION: see calibration_windows.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from llmc import distributed
from llmc.quant.spec import Scheme, TensorSpec

SCHEMES = {
    # static activation ranges + FP8 KV-cache ranges, original outputs propagated: maxima only
    "rtn-static-kv": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"),
                            TensorSpec("fp8_e4m3", "tensor")),
    "smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"),
                          TensorSpec("fp8_e4m3", "tensor"), algorithm="smoothquant"),
    "gptq": Scheme(TensorSpec("int4", "group", group_size=16), algorithm="gptq"),
    "awq": Scheme(TensorSpec("int4", "group", group_size=16), algorithm="awq"),
    # the Mixture-of-Experts cases (tests/unit/test_moe_distributed.py)
    "w4a16-gptq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"),
    "fp8-static": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
}
CALIBRATION = (16, 24)  # windows x tokens: 4 batches of 4, two per rank with 2 ranks


def calibration_windows() -> torch.Tensor:
    """LLMC_TEST_CALIBRATION=split-vocab: the first half of the windows (rank 0's block of two) draws token ids below
    100, the second half ids from 100 (a model can then route an expert only the second half's tokens)."""
    g = torch.Generator().manual_seed(7)
    if os.environ.get("LLMC_TEST_CALIBRATION") == "split-vocab":
        half = (CALIBRATION[0] // 2, CALIBRATION[1])
        return torch.cat([torch.randint(3, 100, half, generator=g), torch.randint(100, 200, half, generator=g)])
    return torch.randint(3, 200, CALIBRATION, generator=g)


def _kill_mid_layer() -> None:
    kill_rank, kill_layer = os.environ.get("LLMC_TEST_KILL_RANK"), os.environ.get("LLMC_TEST_KILL_LAYER")
    if kill_rank is None or int(kill_rank) != distributed.rank():
        return
    from llmc.quant.activations import ActivationWriter

    real_publish = ActivationWriter.publish

    def publish(self):
        if self.final.name == f"inputs-{int(kill_layer) + 1:05d}":  # this layer's outputs, before progress moves
            os.kill(os.getpid(), signal.SIGKILL)
        return real_publish(self)

    ActivationWriter.publish = publish


def quantize(model: Path, out: Path, names: list[str]) -> None:
    from llmc.model.source import ModelSource
    from llmc.quant.stream import Calibration, quantize_model

    _kill_mid_layer()
    for name in names:
        quantize_model(ModelSource(model, "t", "t"), SCHEMES[name], out / name,
                       Calibration(calibration_windows(), spill=os.environ.get("LLMC_TEST_SPILL", "auto")))


def evaluate(artifact: Path, windows: Path, out: Path) -> None:
    from llmc.engines.torch_ref import TorchEngine

    ids = torch.load(windows)
    engine = TorchEngine(artifact, streamed=False)
    base = engine.score(ids, batch_size=2)
    scored = engine.score(ids, batch_size=2, reference=base)
    if distributed.is_main():
        torch.save({"base": base, "scored": scored}, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    distributed.init("cpu")
    try:
        if sys.argv[1] == "--eval":
            evaluate(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        else:
            quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(","))
    finally:
        distributed.destroy()
