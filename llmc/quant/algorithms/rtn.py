"""RTN: round each weight to the nearest code on scales from its own range. No calibration data, no options."""

from __future__ import annotations

from torch import nn

from llmc.quant.algorithms.registry import AlgorithmOptions, register
from llmc.quant.numerics import QuantizedWeight, quantize_weights
from llmc.quant.spec import TensorSpec


class RtnOptions(AlgorithmOptions):
    pass


@register("rtn", kind="quantizer", options=RtnOptions, calibrates=False, block_scaled=True)
def rtn_layer(linears: dict[str, nn.Linear], stats, weights: TensorSpec,
              options: RtnOptions) -> dict[str, QuantizedWeight]:
    del stats, options
    return quantize_weights({name: lin.weight.data for name, lin in linears.items()}, weights)
