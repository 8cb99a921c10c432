"""Issue 35: the export stage's planned disk and time count what each format really writes (codes at its packing,
scales and zero points at its dtypes, GPTQ's g_idx, the unquantized tensors copied or converted, the tokenizer files
and config), checked against the files written for a tiny bf16 model. Tolerance: 3% for the weight-file formats
(what is left is JSON: headers, serve files, the index); 20% for the ONNX graphs, whose graph file and initializers
the count approximates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from llmc.pipeline.ids import Kind
from llmc.recipe.load import parse_recipe
from llmc.recipe.schema import SCHEME_SETTINGS

FP8 = {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
       "activations": {"format": "fp8_e4m3", "strategy": "tensor"}}
INT4 = {"weights": {"format": "int4", "strategy": "group", "group_size": 32}}
INT8 = {"weights": {"format": "int8", "strategy": "channel"}, "activations": {"format": "int8", "strategy": "tensor"}}
MIXED = {"algorithm": "rtn", "groups": [{"name": "attention", "roles": ["attention"], "scheme": "W8A8-FP8"},
                                        {"name": "mlp", "roles": ["mlp"], "scheme": "W4A16-NVFP4"}]}
NVFP4_W4A4 = SCHEME_SETTINGS["W4A4-NVFP4"]
FP8_BLOCK = SCHEME_SETTINGS["W8A8-FP8-BLOCK"]
CASES = [(FP8, "vllm", 0.03), (INT4, "vllm", 0.03), (INT4, "exllamav2", 0.03), (INT4, "lmdeploy", 0.03),
         (INT4, "llama.cpp", 0.03), (INT4, "tensorrt-llm", 0.03), (INT8, "tensorrt", 0.20),
         (MIXED, "vllm", 0.03),  # each group's Linears at its own scheme's bytes
         (NVFP4_W4A4, "tensorrt-llm", 0.03), (FP8_BLOCK, "tensorrt-llm", 0.03)]  # ModelOpt's NVFP4 / fp8_pb_wo


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("bf16") / "m", tie=False, hidden=256, intermediate=512)
    weights = folder / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    return folder


def _arch(quant: dict) -> dict:
    """The target arch NVFP4 (MIXED's MLPs too) and block FP8 need; the default (sm80) for the others."""
    weights = quant.get("weights", {})
    if quant is MIXED or weights.get("format") == "nvfp4":
        return {"gpu_arch": "sm100"}
    return {"gpu_arch": "sm90"} if weights.get("strategy") == "block" else {}


IDS = [f"{q['weights']['format'] if 'weights' in q else 'mixed'}-{r}" for q, r, _ in CASES]
# 12-18 s of CPU each (calibrated or ONNX builds; 2-core EPYC, load ~16): the default run keeps them, the fast tier
# keeps the INT4 formats and block FP8 (~1 s each, the same planned-bytes check)
HEAVY_CASES = {"fp8_e4m3-vllm", "int8-tensorrt", "mixed-vllm", "nvfp4-tensorrt-llm"}


@pytest.mark.parametrize("quant, runtime, tolerance",
                         [pytest.param(*case, id=name, marks=[pytest.mark.heavy] if name in HEAVY_CASES else [])
                          for case, name in zip(CASES, IDS)])
def test_the_planned_export_counts_the_bytes_of_every_file_it_writes(bf16_model: Path, tmp_path: Path, quant: dict,
                                                                     runtime: str, tolerance: float) -> None:
    from llmc.build import build_until
    from llmc.storage.store import COMPLETE_MARKER, Store

    if runtime == "tensorrt":
        pytest.importorskip("onnx")
    r = parse_recipe(yaml.safe_dump({
        "name": "w", "model": {"source": str(bf16_model)}, "quantization": quant,
        "calibration": {"samples": 4, "seq_len": 32}, "targets": [{"runtime": runtime, **_arch(quant)}],
        "gates": {"allow_unevaluated": True}}))
    result = build_until(r, Store(tmp_path / "cache"), "export")
    [artifact] = result.artifacts.values()
    written = sum(f.stat().st_size for f in artifact.dir.rglob("*") if f.is_file() and f.name != COMPLETE_MARKER)
    [row] = [r for r in result.plan.rows if r.id.kind is Kind.EXPORT]
    predicted = row.disk_bytes
    assert predicted == pytest.approx(written, rel=tolerance), (predicted, written)
