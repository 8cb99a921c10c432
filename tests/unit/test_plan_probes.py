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
