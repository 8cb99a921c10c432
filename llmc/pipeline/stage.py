"""What every stage of the build is (`Stage`): an id, how the ranks of a torchrun job share it, its decision, its
cost, whether its output is still to be written, and its run. `llmc plan` walks the stages deciding and costing,
`llmc build` walks the same stages running what the plan decided (`llmc.pipeline.stages`)."""

from __future__ import annotations

from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import StageId
from llmc.pipeline.ranks import Share


class Stage:
    id: StageId
    share: Share

    def decide(self, c: Costing) -> object | None:
        """The stage's choices on the machine `c` plans for, as one typed decision that `cost` prices and `run`
        executes (the quantize stage's layer loop, the evaluation's streamed scoring); None: nothing to choose."""
        return None

    def cost(self, c: Costing) -> None:
        """Append the stage's rows to the plan (each with the decision it prices)."""
        raise NotImplementedError

    def pending(self, b: Build) -> bool:
        """Whether the build must still write the stage's output (the disk check)."""
        raise NotImplementedError

    def pending_parts(self, b: Build) -> list[StageId]:
        """The stage, or those of its parts (rows of the plan) whose outputs are still to be written."""
        return [self.id] if self.pending(b) else []

    def run(self, b: Build) -> None:
        """Produce the stage's output through the runner's cache protocol (`llmc.pipeline.runner`)."""
        raise NotImplementedError
