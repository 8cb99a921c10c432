"""TensorRT-LLM scores llmc's ModelOpt-style checkpoint like the torch reference scores the same weights.

Needs an NVIDIA GPU and TensorRT-LLM in its own environment (LLMC_TRTLLM_PYTHON or .venv-trtllm); skipped
elsewhere. Run on a GPU machine:  .venv/bin/python -m pytest -m gpu tests/engines/test_trtllm.py -s
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmc.errors import EngineUnavailable


def _trtllm_reason() -> str | None:
    from llmc.engines.trtllm import trtllm_python

    try:
        trtllm_python()
    except EngineUnavailable as e:
        return e.message
    return None


pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(_trtllm_reason() is not None, reason=str(_trtllm_reason()))]


def test_fp8_checkpoint_in_tensorrt_llm_agrees_with_the_torch_reference(tmp_path: Path, tiny_model: Path) -> None:
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.modelopt_hf import export_modelopt_hf
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.trtllm import TensorRtLlmEngine
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, quantize_model

    scheme = Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"))
    calib = torch.randint(3, 200, (8, 64))
    quantize_model(ModelSource(tiny_model, "t", "t"), scheme, tmp_path / "q", Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "q")
    export_modelopt_hf(qm, tmp_path / "trt", tensor_parallel=1)
    export_compressed_tensors(qm, tmp_path / "ct")
    windows = torch.randint(3, 200, (4, 64))
    base, _ = TensorRtLlmEngine(tiny_model).measure(windows, windows[:1], decode_tokens=8, repeats=1)
    scores, tput = TensorRtLlmEngine(tmp_path / "trt").measure(windows, windows[:1], decode_tokens=8, repeats=1,
                                                               reference=base)
    reference = TorchEngine(tmp_path / "ct", streamed=False).score(windows)
    ppl_trt, ppl_torch = math.exp(scores["nll"].mean().item()), math.exp(reference["nll"].mean().item())
    print(f"\nppl TensorRT-LLM {ppl_trt:.4f} vs torch reference {ppl_torch:.4f}; KL vs its baseline "
          f"{scores['kl'].mean().item():.2e}; decode {tput['decode_tokens_per_s']['median']:.0f} tok/s on {tput['gpu']}")
    assert abs(ppl_trt / ppl_torch - 1) < 0.02  # FP8 GEMMs in fp16/bf16 vs the fp32 emulation
    assert scores["kl"].shape == scores["nll"].shape and scores["top1"].mean() > 0.9
