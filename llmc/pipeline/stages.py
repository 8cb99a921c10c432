"""The pipeline's stages, in order, for one recipe: what `llmc build` runs and `llmc plan` decides and costs.

Every stage is a `llmc.pipeline.stage.Stage`: an `id`, a `share` (how the ranks of a torchrun job share it),
`decide(costing)` (its choices, one typed decision), `cost(costing)` (its rows of the plan, each with the decision it
prices), `pending_parts(build)` (itself, or the parts of it whose outputs are still to be written: the evaluate
stage has one row per scoring, so a rerun's plan marks the cached ones) and `run(build)` (through the runner's cache
protocol, executing the plan's decision)."""

from __future__ import annotations

from llmc.pipeline.calibrate import Calibrate
from llmc.pipeline.evaluate import Evaluate
from llmc.pipeline.export import Export
from llmc.pipeline.gate import Gate
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.publish import Publish
from llmc.pipeline.quantize import Quantize
from llmc.pipeline.stage import Stage
from llmc.pipeline.tasks import Tasks
from llmc.quant.search import SearchSpace
from llmc.quant.spec import Scheme
from llmc.recipe.schema import Recipe


def stages(recipe: Recipe, schemes: dict[str, Scheme], last: Kind = Kind.PUBLISH,
           searched: dict[str, dict] | None = None, spaces: dict[str, SearchSpace] | None = None,
           config: dict | None = None) -> list[Stage]:
    """The stages up to and including `last`: calibrate, quantize each variant, export it for each target,
    evaluate, tasks, gate, publish. `searched`: the variants whose mix quantization.search chose, with its record;
    `spaces`: each searched variant's search on the model (the plan costs its measurement where none is chosen);
    `config`: the model's config.json, where a target's format follows the model's family (`Runtime.family_formats`)."""
    quantizes: list[Quantize] = []
    for variant, scheme in schemes.items():  # each knows the ones before it (whose statistics it may reuse)
        quantizes.append(Quantize(variant, scheme, tuple(quantizes), (searched or {}).get(variant),
                                  (spaces or {}).get(variant)))
    exports: list[Export] = []
    for q in quantizes:  # each knows the ones before it (whose files, or verified inputs, it may share)
        for t in recipe.targets:
            exports.append(Export(q, t, tuple(exports), config))
    every = [Calibrate(), *quantizes, *exports, Evaluate(quantizes, exports), Tasks(exports), Gate(), Publish()]
    return [s for s in every if not s.id.kind.comes_after(last)]


def pending_ids(walk: list[Stage], b) -> list[StageId]:
    """The stages, or the parts of a stage, whose outputs the build must still write."""
    return [part for s in walk for part in s.pending_parts(b)]
