"""GPTQ inside the layer's forward (true sequential): each Linear quantized on inputs through the already-quantized
Linears before it, against a direct whole-model reference; the staged (memory-bounded) order against the
one-forward order; the recipe's option."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from llmc.model.source import ModelSource
from llmc.quant import stream, true_sequential
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.algorithms.gptq import GptqOptions, accumulate_hessian, gptq_quantize
from llmc.quant.numerics import dequantize_weight
from llmc.quant.spec import Scheme, TensorSpec

INT4_G16 = TensorSpec("int4", "group", group_size=16)
GPTQ = Scheme(INT4_G16, algorithm="gptq")


def _calibration() -> torch.Tensor:
    return torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))


def _codes(folder: Path, layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(layers):
        out.update({k: v for k, v in load_file(str(folder / "layers" / f"{i:05d}.safetensors")).items()
                    if k.endswith(".weight") and "norm" not in k})
    return out


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


def test_gptq_true_sequential_equals_a_whole_model_reference(tiny_model: Path, tmp_path: Path) -> None:
    """Reference: the whole model in memory; for each Linear in forward order, its input over every window
    is captured by a full forward with the Linears before it already quantized, and GPTQ quantizes it."""
    from transformers import AutoModelForCausalLM

    calib = _calibration()
    stream.quantize_model(ModelSource(tiny_model, "t", "t"), GPTQ, tmp_path / "q",
                          stream.Calibration(calib, batch_size=2))
    streamed = _codes(tmp_path / "q", 2)

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    order = [f"model.layers.{i}.{n}" for i in range(2) for n in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for name in order:
        lin = model.get_submodule(name)
        seen = {}
        handle = lin.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0]))
        with torch.no_grad():
            model(calib)
        handle.remove()
        hessian, _ = accumulate_hessian(None, 0, seen["x"])
        q, _ = gptq_quantize(lin.weight.data, hessian, INT4_G16, GptqOptions())
        lin.weight.data = dequantize_weight(q, INT4_G16)
        assert _agree(streamed[f"{name}.weight"], q.codes) > 0.995, name
        torch.testing.assert_close(load_file(str(tmp_path / "q" / "layers" / f"{name.split('.')[2]:0>5}.safetensors"))
                                   [f"{name}.weight_scale"], q.scale.float())


def test_staged_passes_give_the_one_forward_result(tiny_model: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """When every window does not fit in one forward, the staged order (a pass per group of Linears sharing an
    input, then the outputs' pass) gives the same bits: same windows per Hessian sum, same order."""
    calib, src = _calibration(), ModelSource(tiny_model, "t", "t")
    stream.quantize_model(src, GPTQ, tmp_path / "one", stream.Calibration(calib, batch_size=2))

    passes = []
    real_staged = true_sequential.staged

    def counting(batch_calls, *args):
        def counted(call):
            def run():
                passes.append(1)
                return call()
            return run
        return real_staged([counted(c) for c in batch_calls], *args)

    monkeypatch.setattr("llmc.quant.loop_plan.fits_one_forward", lambda *a: False)
    monkeypatch.setattr(true_sequential, "staged", counting)
    stream.quantize_model(src, GPTQ, tmp_path / "staged", stream.Calibration(calib, batch_size=2))
    assert len(passes) == 2 * 4 * 2  # layers x groups (q/k/v, o, gate/up, down) x batches
    one, staged = _codes(tmp_path / "one", 2), _codes(tmp_path / "staged", 2)
    assert one.keys() == staged.keys()
    for k in one:
        assert torch.equal(one[k], staged[k]), k


def test_one_forward_outputs_are_the_quantized_layers_outputs() -> None:
    """The forward that quantizes returns what the layer computes with its quantized weights."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    second = block[2].weight.data.clone()
    x = torch.randn(256, 32)
    linears = {"0": block[0], "2": block[2]}
    quantized, out = true_sequential.in_one_forward(lambda: block(x), linears, {}, INT4_G16, GptqOptions(), 256)
    assert set(quantized) == {"0", "2"}
    for name, lin in linears.items():
        torch.testing.assert_close(lin.weight.data, dequantize_weight(quantized[name], INT4_G16))
    with torch.no_grad():
        torch.testing.assert_close(out, block(x))
        # the second Linear was calibrated on the first one's quantized output
        hessian, _ = accumulate_hessian(None, 0, torch.relu(block[0](x)))
    expected, _ = gptq_quantize(second, hessian, INT4_G16, GptqOptions())
    assert torch.equal(quantized["2"].codes, expected.codes)


def _true_sequential(scheme: Scheme) -> bool:
    return AlgorithmSteps.of(scheme).true_sequential


def test_true_sequential_option() -> None:
    from pydantic import ValidationError

    from llmc.recipe.schema import QuantizationSection

    assert _true_sequential(GPTQ)
    assert not _true_sequential(Scheme(INT4_G16, algorithm="gptq", algorithm_options=(("propagate", "original"),)))
    assert not _true_sequential(Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True),
                                          algorithm="smoothquant+gptq"))
    assert not _true_sequential(Scheme(INT4_G16, algorithm="gptq", algorithm_options=(("true_sequential", False),)))
    w4 = {"weights": {"format": "int4", "strategy": "group", "group_size": 16}}
    QuantizationSection.model_validate({**w4, "algorithm": "gptq", "options": {"true_sequential": False}})
    for options, algorithm, message in (
        ({"true_sequential": True, "propagate": "original"}, "gptq", "propagate"),
        ({"true_sequential": "yes"}, "gptq", "true or false"),
        ({"true_sequential": True}, "awq", "do not apply"),
    ):
        with pytest.raises(ValidationError, match=message):
            QuantizationSection.model_validate({**w4, "algorithm": algorithm, "options": options})
