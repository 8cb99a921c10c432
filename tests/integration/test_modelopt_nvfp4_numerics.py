"""llmc's NVFP4 against NVIDIA ModelOpt's own NVFP4QTensor, both ways: ModelOpt quantizing the same weights gives
llmc's bytes, ModelOpt decodes llmc's bytes to llmc's values, and llmc decodes ModelOpt's bytes to ModelOpt's values.

ModelOpt runs in its own venv (`bash scripts/setup-peers.sh`, or LLMC_MODELOPT_PYTHON); the test skips without it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.formats.microscaling_export import modelopt_nvfp4_tensors
from llmc.quant.microscaling import (
    NVFP4,
    BlockQuantized,
    dequantize_blocks,
    global_scale_from_modelopt,
    quantize_blocks,
    unpack_e2m1,
)

pytestmark = [pytest.mark.slow, pytest.mark.peers]
REPO = Path(__file__).resolve().parents[2]
MODELOPT_PYTHON = Path(os.environ.get("LLMC_MODELOPT_PYTHON", REPO / ".venv-modelopt" / "bin" / "python"))

# Runs in ModelOpt's venv; imports nothing from llmc.
_MODELOPT_SIDE = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
inp, out = sys.argv[1:3]
t = load_file(inp)
result = {}
for name in sorted({k.split(".")[0] for k in t}):
    w = t[f"{name}.w"]
    qt, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), 16)
    result[f"{name}.packed"] = qt._quantized_data
    result[f"{name}.weight_scale"] = scale
    result[f"{name}.weight_scale_2"] = scale_2.reshape(())
    result[f"{name}.dequant"] = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2,
                                              block_sizes={-1: 16})
    ours = NVFP4QTensor(w.shape, torch.float32, t[f"{name}.llmc_weight"])
    result[f"{name}.dequant_of_llmc"] = ours.dequantize(dtype=torch.float32, scale=t[f"{name}.llmc_weight_scale"],
                                                        double_scale=t[f"{name}.llmc_weight_scale_2"],
                                                        block_sizes={-1: 16})
save_file(result, out)
"""


def _weights() -> dict[str, torch.Tensor]:
    out = {}
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(64, 256, generator=g) * 0.02 * (10.0 ** (seed - 2))  # global scales over four decades
        w[3, 40] = 0.5 * (10.0 ** (seed - 2))
        w[6, 32:64] *= 1e-3  # small blocks: subnormal E4M3 scales
        w[5, :32] = 0.0
        out[f"w{seed}"] = w
    return out


def test_modelopt_and_llmc_nvfp4_agree_both_ways(tmp_path: Path) -> None:
    if not MODELOPT_PYTHON.exists():
        pytest.skip(f"ModelOpt venv missing ({MODELOPT_PYTHON}): bash scripts/setup-peers.sh")
    weights = _weights()
    ours = {name: quantize_blocks(w, NVFP4) for name, w in weights.items()}
    inp = {}
    for name, w in weights.items():
        inp[f"{name}.w"] = w
        inp.update({f"{name}.llmc_{k}": v for k, v in modelopt_nvfp4_tensors(ours[name]).items()})
    save_file(inp, tmp_path / "in.safetensors")
    script = tmp_path / "modelopt_side.py"
    script.write_text(_MODELOPT_SIDE)
    subprocess.run([str(MODELOPT_PYTHON), str(script), str(tmp_path / "in.safetensors"), str(tmp_path / "out.st")],
                   check=True, capture_output=True, timeout=600)
    theirs = load_file(tmp_path / "out.st")
    for name, w in weights.items():
        q, mo = ours[name], modelopt_nvfp4_tensors(ours[name])
        live = w.unflatten(-1, (-1, 16)).abs().amax(-1) > 0
        # Same weights -> same bytes: packed codes, block scales of every non-zero block (ModelOpt stores 1.0 for
        # an all-zero block, llmc 0; its codes are 0 either way) and weight_scale_2 within one float32 rounding.
        assert torch.equal(theirs[f"{name}.packed"], mo["weight"]), name
        assert torch.equal(theirs[f"{name}.weight_scale"].view(torch.uint8)[live],
                           mo["weight_scale"].view(torch.uint8)[live]), name
        assert theirs[f"{name}.weight_scale_2"].item() == pytest.approx(mo["weight_scale_2"].item(), rel=2.0**-23)
        # ModelOpt decodes llmc's bytes to llmc's values, and llmc decodes ModelOpt's bytes to ModelOpt's values,
        # up to the float32 rounding of the reciprocal global scale.
        mine = dequantize_blocks(q)
        bound = mine.abs() * 2.0**-22
        assert ((theirs[f"{name}.dequant_of_llmc"] - mine).abs() <= bound).all(), name
        back = BlockQuantized(codes=unpack_e2m1(theirs[f"{name}.packed"]), scale=theirs[f"{name}.weight_scale"],
                              global_scale=global_scale_from_modelopt(theirs[f"{name}.weight_scale_2"]).reshape(1),
                              format=NVFP4)
        assert ((dequantize_blocks(back) - theirs[f"{name}.dequant"]).abs() <= bound).all(), name
