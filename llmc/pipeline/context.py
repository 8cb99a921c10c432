"""What the stages share: during a build (`Build`: the runner, the result they append to, the tokens) and during
planning (`Costing`: the model's shape, this machine, and the rows the stages' costs append; no stage leaves facts
here for a later one: a later stage asks the earlier stage objects it was given)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from llmc.data.tokens import TokenSet
from llmc.pipeline.runner import Runner
from llmc.model.dtype import BYTES, kept_elem
from llmc.planning.machine import Machine
from llmc.planning.rows import CostRow
from llmc.planning.shapes import Shape
from llmc.recipe.schema import Recipe
from llmc.result import BuildResult


@dataclass
class Build:
    """One build in progress. Each stage reads what earlier ones left here and appends its own outputs to
    `result` (calibration record, quantized folders, artifacts, evaluations, verdicts)."""

    recipe: Recipe
    runner: Runner
    result: BuildResult
    device: torch.device
    tokenizer: object
    calibration: TokenSet | None  # the calibration windows (None: no scheme calibrates)
    evaluation: dict | None  # corpus label (None when one corpus) -> its windows; None: the build stops before eval
    calib_key: str | None = None  # the calibrate stage's key, once it ran
    quantized: dict[str, tuple[Path, str]] = field(default_factory=dict)  # variant -> (quantize folder, its key)

    @cached_property
    def model_config(self) -> dict:
        """The source's config.json, read once per build (each quantize stage's key asks it, on every lookup)."""
        return self.result.source.config()


@dataclass(frozen=True)
class SchemeBytes:
    """A scheme's sizes on this model, which the quantize stage's cost computes and the export and eval costs read."""

    quantized_params: int  # weights the scheme quantizes
    canonical: float  # the quantize stage's output: codes one per byte, the rest in the compute dtype
    packed: float  # the quantized weights' codes, packed at the scheme's bits
    artifact: float  # packed codes + the rest in the compute dtype


@dataclass
class Costing:
    """One plan in progress: `llmc plan` walks the stages, each appending its rows of cost."""

    recipe: Recipe
    shape: Shape
    machine: Machine
    linears: dict[str, tuple[int, int]]
    compute: str  # the compute dtype's name
    stored_elem: int  # bytes per element of the source's stored weights
    side_files: int = 0  # bytes of the source's tokenizer files and config.json, which exports copy
    rows: list[CostRow] = field(default_factory=list)  # each stage's, appended as the walk costs it
    config: dict = field(default_factory=dict)  # the model's config.json (mixed precision: its groups' Linears)
    # every tensor of the model by checkpoint name (safetensors headers, or the config's rows): for a format that
    # types each tensor on its own (WrittenTensors.other_tensors)
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def elem(self) -> int:
        """Bytes per element of the compute dtype."""
        return BYTES[self.compute]

    @property
    def kept_elem(self) -> int:
        """Bytes per element of the weights outside the decoder layers as the canonical form keeps them
        (llmc.model.dtype.kept_dtype: the source's, unless wider than the compute dtype)."""
        return kept_elem(self.stored_elem, self.compute)
