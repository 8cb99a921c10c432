"""A row of the plan's table: one stage's (or one part of a stage's) cost on one device, as its `cost` computes
it (llmc/pipeline/<stage>.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.pipeline.ids import StageId

GB = 1e9
# the prefix of a searched quantize row's parts that are its measuring pass's (CostRow.parts)
MEASUREMENT_PART = "search measurement: "


@dataclass
class CostRow:
    """One stage's cost on one device."""

    name: str
    device: str
    host_bytes: float
    gpu_bytes: float = 0.0
    disk_bytes: float = 0.0  # new bytes this stage leaves in the cache
    seconds: float = 0.0
    strategy: str = ""
    why: str = ""
    # host_bytes term by term (tests, docs); a quantize stage's host_bytes is the largest of these terms' sum and its
    # one-off peaks (writing the weights outside the layers, the first layer's pair discovery, named in `why`); a
    # searched variant's row also lists its measuring pass's terms, named MEASUREMENT_PART + term, a pass that runs
    # before the loop: host_bytes is then the larger of the two (the measurement's terms sum to its own peak)
    parts: dict[str, float] = field(default_factory=dict)
    # File pages the stage keeps mapped (safetensors are read through mmap): page cache, not the process's own
    # memory (RssFile, not RssAnon); the kernel can drop them, at the price of reading them again.
    mapped_bytes: float = 0.0
    layer_seconds: float = 0.0  # the quantize stage: one decoder layer (read, forward, quantize, write) ...
    fixed_seconds: float = 0.0  # ... and what runs once (the weights outside the layers, their copy in the output)
    # the quantize stage's layer_seconds part by part (read, decode, forward, quantize, write, ..., the stream's
    # overhead, GPTQ's column loop, AWQ's searches, a search's measuring pass: what the layer loop does per layer as
    # its decision says); on the CPU they sum to layer_seconds, on a GPU the reads and writes overlap the compute
    layer_parts: dict[str, float] = field(default_factory=dict)
    # what `seconds` may turn out to be: at the probes' fastest and slowest runs, widened by the cost model's measured
    # error (llmc.planning.machine.time_range); the plan fills it in after its walk
    seconds_range: tuple[float, float] | None = None

    id: StageId | None = None  # the stage (or the part of it) this row costs
    # the stage's decision that this row costs (the quantize stage's llmc.quant.loop_plan.LayerLoopPlan), which the
    # build executes
    decision: object | None = None
    # a strategy that would take less host memory, and its peak in GB (the plan names it where memory is short)
    cheaper: tuple[str, float] | None = None
    # a build's plan: this stage's output is in the cache / the stage comes after the command's last (Plan.mark_cached);
    # neither runs, and the plan's totals leave them out
    cached: bool = False
    skipped: bool = False

    @property
    def seconds_low(self) -> float:
        return (self.seconds_range or (self.seconds,))[0]

    @property
    def seconds_high(self) -> float:
        return (self.seconds_range or (self.seconds,))[-1]

    def named(self, id: StageId) -> CostRow:
        """This row, as the stage `id`."""
        self.id, self.name = id, str(id)
        return self

    def as_dict(self) -> dict:
        return {"stage": self.name, "device": self.device, "host_gb": self.host_bytes / GB,
                "gpu_gb": self.gpu_bytes / GB, "disk_gb": self.disk_bytes / GB, "seconds": self.seconds,
                "strategy": self.strategy, "why": self.why, "mapped_gb": self.mapped_bytes / GB,
                "layer_seconds": self.layer_seconds, "fixed_seconds": self.fixed_seconds,
                "seconds_low": self.seconds_low, "seconds_high": self.seconds_high,
                **({"decision": self.decision.as_dict()} if self.decision is not None else {}),
                **({"layer_parts_s": dict(self.layer_parts)} if self.layer_parts else {}),
                **({"cached": True} if self.cached else {}), **({"skipped": True} if self.skipped else {})}
