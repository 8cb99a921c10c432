"""The planner's rate probes run for every scheme the recipe validator accepts."""

from __future__ import annotations

import pytest

from llmc.quant.numerics import quantize_rate
from llmc.quant.spec import TensorSpec


@pytest.mark.parametrize("group_size", [32, 48, 96, 192, 128, 320])
def test_the_quantizer_probe_takes_any_group_size(group_size: int) -> None:
    """48, 96 and 192 divide SmolLM2's widths but not 256: bb4e556's probe quantized a fixed 256 x 256 matrix and
    crashed `llmc plan` for them."""
    rate = quantize_rate(TensorSpec("int4", "group", group_size=group_size), "float32", elements=1 << 16)
    assert rate > 0


@pytest.mark.parametrize("spec", [TensorSpec("fp8_e4m3", "tensor"),  # static: the stored scale
                                  TensorSpec("int8", "token", dynamic=True),
                                  TensorSpec("fp8_e4m3", "group", group_size=128, dynamic=True),  # block-wise FP8
                                  TensorSpec("nvfp4", "group", group_size=16),  # under its global scale
                                  TensorSpec("mxfp4", "group", group_size=32, dynamic=True)])
def test_the_activation_emulation_probe_takes_every_activation_format(spec: TensorSpec) -> None:
    """The evaluation's cost times the torch engine's `fake_quantize` of each activation spec, on a width (SmolLM2's
    576) the block sizes must divide."""
    from llmc.quant.numerics import fake_quantize_rate

    assert fake_quantize_rate(spec, "float32", width=576, rows=8) > 0
