"""Calibration algorithms, applied to one decoder layer at a time, one registry of them.

Each algorithm lives in its own module and registers its options model and its layer function there
(`registry.register`):

  transforms  SmoothQuant (`smoothquant.py`) and AWQ (`awq.py`) rescale (and AWQ clips) weights in place; the
              layer computes the same function (up to AWQ's clipping) with easier-to-quantize tensors;
  quantizers  RTN (`rtn.py`) and GPTQ (`gptq.py`) turn each Linear's weight into codes and scales.

A scheme composes them, transform first ("smoothquant+gptq"); `Pipeline.of(scheme)` (`pipeline.py`) is the
resolved view the layer stream and the build ask everything about the scheme's algorithm.
"""

from __future__ import annotations

from llmc.quant.algorithms import awq, gptq, rtn, scale_search, smoothquant  # noqa: F401  (each registers itself)
from llmc.quant.algorithms.mappings import Mapping
from llmc.quant.algorithms.pipeline import Pipeline, calibration_passes, quantize_stage_config
from llmc.quant.algorithms.registry import (
    ALGORITHMS,
    Algorithm,
    AlgorithmOptions,
    Observe,
    compose,
    names,
    register,
    steps_of,
)

# What the planner accepts: every registered algorithm alone (a transform then RTN), and the compositions of
# several that have run end to end and been measured (docs/calibration.md). Others the composition rules allow
# (awq+gptq) are refused as not implemented until they are.
IMPLEMENTED: frozenset[str] = frozenset(names()) | {"smoothquant+gptq"}



__all__ = ["ALGORITHMS", "IMPLEMENTED", "Algorithm", "AlgorithmOptions", "Mapping", "Observe", "Pipeline",
           "calibration_passes", "compose", "names", "quantize_stage_config", "register", "steps_of"]
