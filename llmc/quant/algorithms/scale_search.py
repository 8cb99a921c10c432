"""Scale search: per block of a microscaling weight (NVFP4, MXFP4, MXFP8), the scale on the format's own grid with
the least squared error among round-to-nearest's and its neighbours (`llmc.quant.scale_search`), instead of the one
round-to-nearest derives from the block's absmax. No calibration data; round-to-nearest's scale wins ties, so no
block's error grows. Measured against RTN in
benchmarks/results/microscaling-log.md ("Block-scale search")."""

from __future__ import annotations

from torch import nn

from llmc.quant.algorithms.registry import AlgorithmOptions, Context, register
from llmc.quant.microscaling import MICROSCALING_FORMATS
from llmc.quant.numerics import QuantizedWeight, weight_global_scales
from llmc.quant.scale_search import search_block_scales
from llmc.quant.spec import TensorSpec


class ScaleSearchOptions(AlgorithmOptions):
    def check(self, context: Context) -> None:
        w = context.scheme.weights
        if not w.info.microscaling:
            raise ValueError(f"scale_search chooses block scales of nvfp4, mxfp4 or mxfp8 weights, not {w.describe()}; "
                             "fix: algorithm: rtn, or a microscaling weight format")


@register("scale_search", kind="quantizer", options=ScaleSearchOptions, calibrates=False, block_scaled=True)
def scale_search_layer(linears: dict[str, nn.Linear], stats, weights: TensorSpec,
                       options: ScaleSearchOptions) -> dict[str, QuantizedWeight]:
    del stats, options
    out = {}
    shared = weight_global_scales({name: lin.weight.data for name, lin in linears.items()}, weights)
    for name, lin in linears.items():
        q = search_block_scales(lin.weight.data, MICROSCALING_FORMATS[weights.format], global_scale=shared.get(name))
        out[name] = QuantizedWeight(codes=q.codes, scale=q.scale, zero_point=None, global_scale=q.global_scale)
    return out
