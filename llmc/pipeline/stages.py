"""The pipeline's stages, in order, for one recipe: what `llmc build` runs and `llmc plan` costs.

Every stage has an `id` (`llmc.pipeline.ids.StageId`), a `share` (how the ranks of a torchrun job share it,
`llmc.pipeline.ranks.Share`), `cost(costing)` (appends its rows to the plan), `pending(build)` (whether its output
must still be written: the disk check) and `run(build)` (through the runner's cache protocol). A stage whose plan
rows are parts of it (the evaluate stage: one row per scoring) says which parts are still to run
(`pending_parts(build)`), so that a rerun's plan marks the cached ones (`pending_ids`)."""

from __future__ import annotations

from llmc.pipeline.calibrate import Calibrate
from llmc.pipeline.evaluate import Evaluate
from llmc.pipeline.export import Export
from llmc.pipeline.gate import Gate
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.publish import Publish
from llmc.pipeline.quantize import Quantize
from llmc.pipeline.tasks import Tasks
from llmc.quant.spec import Scheme
from llmc.recipe.schema import Recipe


def stages(recipe: Recipe, schemes: dict[str, Scheme], last: Kind = Kind.PUBLISH) -> list:
    """The stages up to and including `last`: calibrate, quantize each variant, export it for each target,
    evaluate, tasks, gate, publish."""
    quantizes: list[Quantize] = []
    for variant, scheme in schemes.items():  # each knows the ones before it (whose statistics it may reuse)
        quantizes.append(Quantize(variant, scheme, tuple(quantizes)))
    exports: list[Export] = []
    for q in quantizes:  # each knows the ones before it (whose files, or verified inputs, it may share)
        for t in recipe.targets:
            exports.append(Export(q, t, tuple(exports)))
    every = [Calibrate(), *quantizes, *exports, Evaluate(quantizes, exports), Tasks(), Gate(), Publish()]
    return [s for s in every if not s.id.kind.comes_after(last)]


def pending_ids(walk: list, b) -> list[StageId]:
    """The stages, or the parts of a stage, whose outputs the build must still write."""
    out: list[StageId] = []
    for s in walk:
        parts = getattr(s, "pending_parts", None)
        out += parts(b) if parts is not None else [s.id] if s.pending(b) else []
    return out
