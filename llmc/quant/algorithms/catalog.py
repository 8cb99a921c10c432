"""Every built-in calibration algorithm, registered, and what consumers ask about them: `AlgorithmSteps.of(scheme)`,
the registry's lookups, `IMPLEMENTED` (`from llmc.quant.algorithms.catalog import AlgorithmSteps`).

Importing this module imports each algorithm module (each registers itself). A new algorithm is one module and
one name on the import line below.
"""

from __future__ import annotations

from llmc.quant.algorithms import awq, gptq, rtn, scale_search, smoothquant  # noqa: F401  (each registers itself)
from llmc.quant.algorithms.mappings import Mapping
from llmc.quant.algorithms.steps import AlgorithmSteps, calibration_passes, quantize_stage_config
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

__all__ = ["ALGORITHMS", "IMPLEMENTED", "Algorithm", "AlgorithmOptions", "Mapping", "Observe", "AlgorithmSteps",
           "calibration_passes", "compose", "names", "quantize_stage_config", "register", "steps_of"]
