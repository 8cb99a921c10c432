"""Typed stage ids: what a stage is, for the cache, the plan's table and the build's records."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """The stages in pipeline order. The value is the stage's folder in the cache (`llmc.storage.store`) where it has one;
    a str, so `build_until(recipe, store, "export")` keeps working."""

    CALIBRATE = "calibrate"
    QUANTIZE = "quantize"
    EXPORT = "export"
    EVAL = "eval"
    TASKS = "tasks"
    GATE = "gate"
    PUBLISH = "publish"

    @property
    def emits_written(self) -> bool:
        """Whether the runner emits '<kind>:written' once the stage's files are written (llmc.telemetry.events); the quantize
        stage reports each layer instead, the tasks stage nothing (as before the stages were objects)."""
        return self in (Kind.CALIBRATE, Kind.EXPORT, Kind.EVAL)

    def comes_after(self, other: Kind) -> bool:
        order = list(Kind)
        return order.index(self) > order.index(other)


@dataclass(frozen=True)
class StageId:
    """One stage (or one cached unit of it): its kind and what it is of, e.g. (EXPORT, ("fp8/vllm-sm90-tp1",))."""

    kind: Kind
    of: tuple[str, ...] = ()

    def __str__(self) -> str:
        """As `llmc plan`'s table names it: 'quantize fp8', 'export vllm-sm90-tp1', 'eval torch baseline'."""
        return " ".join((self.kind.value, *self.of))

    @property
    def record_name(self) -> str:
        """As the build's stage records name it (report.json, report.md): 'quantize:W8A8-FP8', 'eval:torch:baseline'."""
        return ":".join((self.kind.value, *self.of))

    def covers(self, other: StageId) -> bool:
        """Whether `other` is this stage or one of its parts (an evaluation of the evaluate stage)."""
        return other.kind is self.kind and other.of[:len(self.of)] == self.of
