"""The layer loop's decision, made once: which data flow carries the calibration data, where the activations live
between layers, whether GPTQ runs every window in one forward, whether statistics are shared with another scheme,
how often a resume point is made.

`decide_layer_loop` is the only place these choices are made. `llmc plan` calls it (through the quantize stage's
`decide`) with the facts it reads from config.json, the recipe and this machine, prints the decision and costs it;
`llmc build` hands the plan's decision to `llmc.quant.stream.quantize_model`, which obeys it. The stream decides
again only when a fact it can see and the plan could not differs materially (the memory free when the stage starts,
statistics another build left on disk, the MoE blocks the skeleton holds) and logs what changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmc.model.families import LAYOUTS
from llmc.quant.activations import SpillMode, should_spill, stays_on_device
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.flows import FlowNeeds, flow_for

Placement = Literal["none", "memory", "device", "disk"]
SharedUse = Literal["none", "record", "reuse"]
ExpertMode = Literal["auto", "always", "never"]  # Calibration.stream_experts

# With the activations on the GPU a layer takes well under a second at 8B width, less than writing its 2 GB of
# outputs takes: a resume point (the next layer's inputs copied to the host and made durable) is made when this long
# has passed since the last one, so a kill loses at most about this much GPU work (docs/gpu.md).
RESIDENT_RESUME_EVERY_S = 60.0
# A snapshot of free memory that moved by less than this share since the plan still stands (the plan's own
# allocations, the tokenizer, the page cache move it by a few percent between plan and stage)
SNAPSHOT_TOLERANCE = 0.10


@dataclass(frozen=True)
class SourceCodes:
    """A quantized original whose routed experts all target its own stored format (gpt-oss's MXFP4 experts to
    `weights: mxfp4` groups of 32: llmc.quant.mxfp4_source.source_codes_fact): their codes and scales could be copied
    as stored. Sizes of the largest decoder layer, for the cost of what the loop then does."""

    format: str  # the source's format (llmc.model.source_formats: "mxfp4")
    expert_params: int  # the routed experts' weights whose codes would be copied
    other_quantized_params: int  # the layer's other weights the quantizer still rounds (attention, where not ignored)


@dataclass(frozen=True)
class LoopFacts:
    """What the layer loop's decision is made from: the calibration's shape, the model's, the machine's snapshot."""

    calibrates: bool  # the scheme needs calibration data
    windows: int  # calibration windows this process runs (its rank's share under torchrun)
    seq_len: int
    masked: bool  # per-sample calibration (each sample its own batch)
    batch_size: int  # windows per calibration forward
    spill_mode: SpillMode  # calibration.spill_activations
    hidden: int
    intermediate: int
    heads: int
    elem: int  # bytes per element of the compute dtype
    moe: bool  # the model has Mixture-of-Experts blocks
    device: str  # where layers are calibrated: "cpu" or "cuda[:i]"
    host_available: int | None  # MemAvailable when the decision is made
    device_free: int | None  # the calibrating GPU's free memory then (None: the CPU)
    shared_stats: bool  # statistics can be shared with other schemes on the same model and data (a folder is given)
    shared_covered: bool  # ... and those already recorded cover every Linear and KV module this scheme needs
    resume_every_s: float | None = None  # the caller's resume interval (None: the default for the placement)
    ranks: int = 1  # data-parallel processes calibrating (torchrun's WORLD_SIZE)
    # the largest decoder layer's weights in the compute dtype, and whether its routed experts can be read one at a
    # time (per-expert tensors in the checkpoint, top-k routing): what expert-by-expert streaming is decided on
    layer_bytes: int = 0
    experts_streamable: bool = False
    stream_experts: ExpertMode = "auto"
    # a quantized original whose routed experts all target its own stored format (None: any other source or target)
    source_codes: SourceCodes | None = None

    @property
    def activation_bytes(self) -> int:
        """One copy of the activations passed between layers."""
        return self.windows * self.seq_len * self.hidden * self.elem

    def changed_from(self, planned: LoopFacts) -> list[str]:
        """What differs materially from the facts the plan decided on, in words (empty: the plan stands)."""
        changes = []
        for name in ("host_available", "device_free"):
            now, then = getattr(self, name), getattr(planned, name)
            if (now is None) != (then is None) or (now and then and abs(now - then) > SNAPSHOT_TOLERANCE * then):
                changes.append(f"{name.replace('_', ' ')} {_gb(then)} at plan time, {_gb(now)} now")
        for name in ("calibrates", "windows", "seq_len", "masked", "batch_size", "spill_mode", "moe", "device",
                     "shared_stats", "shared_covered", "resume_every_s", "hidden", "elem", "ranks",
                     "experts_streamable", "stream_experts", "source_codes"):
            if getattr(self, name) != getattr(planned, name):
                changes.append(f"{name.replace('_', ' ')} {getattr(planned, name)} planned, {getattr(self, name)} now")
        return changes


def experts_streamable(config: dict) -> bool:
    """Whether the family's routed experts can be read one at a time: per-expert tensors in its Hub checkpoints
    (not fused 3-D ones) and top-k routing (not Llama-4's router-scaled inputs)."""
    layout = LAYOUTS.get(config.get("model_type"))
    return layout is not None and not layout.checkpoint_fused and layout.routing == "top_k"


def config_widths(config: dict) -> dict[str, int]:
    """The widths the decision reads from config.json, read the same way by the plan and the stream."""
    return {"hidden": config.get("hidden_size", 0), "intermediate": config.get("intermediate_size", 0),
            "heads": config.get("num_attention_heads", 1)}


@dataclass(frozen=True)
class LayerLoopPlan:
    """The layer loop's decision (`decide_layer_loop`), what `llmc plan` prints and `quantize_model` obeys."""

    flow: str  # the registered data flow (llmc.quant.flows)
    activations: Placement  # where the activations passed between layers live ("none": no calibration forward)
    one_forward: bool  # GPTQ quantizes inside one forward over every calibration window
    shared: SharedUse  # statistics recorded for later schemes, or reused from an earlier one
    traces_structure: bool  # the smoothing pairs of each distinct layer structure are traced first (float64)
    batch_size: int  # windows per calibration forward
    resume_every_s: float  # seconds between resume points (0: after every layer)
    device: str
    why: tuple[str, ...]  # each choice's reason, in words
    facts: LoopFacts  # what it was decided from
    # a Mixture-of-Experts layer's routed experts read, calibrated, quantized and written one at a time
    # (llmc.quant.expert_stream), the router run once: the layer never whole in memory
    expert_stream: bool = False
    # the routed experts' stored codes and scales copied into the output as they are (an MXFP4 original to MXFP4
    # g32, no forward pass): never decoded, never quantized (llmc.quant.mxfp4_source.pass_through_layer_codes)
    experts_kept: bool = False

    @property
    def runs_forwards(self) -> bool:
        """Whether calibration windows run through the layers (a data-free or shared-statistics flow: none)."""
        return self.activations != "none"

    @property
    def reads_skeleton(self) -> bool:
        """Whether the weights outside the layers are read first: to run the windows to the first layer, or to
        trace the smoothing pairs (a shared-statistics SmoothQuant still does)."""
        return self.runs_forwards or self.traces_structure

    def as_dict(self) -> dict:
        """The decision as `llmc plan --json` and report.json record it (facts left out: they are the machine's)."""
        return {"flow": self.flow, "activations": self.activations, "one_forward": self.one_forward,
                "shared_statistics": self.shared, "traces_structure": self.traces_structure,
                "batch_size": self.batch_size, "resume_every_s": self.resume_every_s, "device": self.device,
                **({"experts": "one at a time"} if self.expert_stream else {}),
                **({"experts_codes": f"{self.facts.source_codes.format} passed through"}
                   if self.experts_kept else {})}

    def describe(self) -> str:
        return "; ".join(self.why)


def decide_layer_loop(pipeline: AlgorithmSteps, facts: LoopFacts) -> LayerLoopPlan:
    """Every choice the layer loop makes for `pipeline`'s scheme, from `facts` (pure)."""
    why: list[str] = []
    calibrates = facts.calibrates
    shared: SharedUse = "none"
    if calibrates and facts.shared_stats and pipeline.shares_statistics and not facts.moe:
        # MoE: which experts were starved depends on the routed tokens, which shared ranges do not record
        reusable = facts.shared_covered and not pipeline.needs_inputs_after_transform
        shared = "reuse" if reusable else "record"
        why.append("statistics recorded earlier in this build (by an earlier scheme, or the search's measuring "
                   "pass) on the same model and data: no calibration forward"
                   if reusable else "ranges recorded for later schemes on the same model and data")
    forwards = calibrates and shared != "reuse"
    spill = resident = one_forward = False
    if forwards:
        copy = facts.activation_bytes
        spill = should_spill(facts.spill_mode, copy, facts.host_available)
        resident = not spill and stays_on_device(torch.device(facts.device), copy, facts.device_free)
        if spill:
            why.append(f"two copies of the calibration activations ({2 * copy / 1e9:.2f} GB) would take more than a "
                       f"quarter of the {_gb(facts.host_available)} available (or spill_activations says so): "
                       "one batch in memory, the rest on disk")
        elif resident:
            why.append(f"two copies of the calibration activations ({2 * copy / 1e9:.2f} GB) take at most a quarter "
                       f"of the GPU's {_gb(facts.device_free)} free: they stay there between layers")
        else:
            why.append(f"two copies of the calibration activations ({2 * copy / 1e9:.2f} GB) stay in host memory")
        one_forward = (pipeline.true_sequential and not spill and not facts.masked
                       and fits_one_forward(facts, facts.device_free if facts.device != "cpu"
                                            else facts.host_available))
        if one_forward and facts.moe:
            # GPTQ inside one forward sums each expert's Hessian over its routed rows of every window at once, in an
            # order no split of the windows over ranks reproduces; the two-forward order sums them batch by batch,
            # which the ranks chain bit for bit (llmc.distributed.chain_hessians). Taken in one process too, so the
            # codes do not depend on the number of processes.
            one_forward = False
            why.append("Mixture-of-Experts: Hessians observed batch by batch, then GPTQ (not inside one forward), "
                       "so any number of ranks computes the same codes")
    flow = flow_for(FlowNeeds(calibrates=calibrates, shared_cover=shared == "reuse",
                              true_sequential=pipeline.true_sequential, moe=facts.moe, one_forward=one_forward)).name
    if flow == "true-sequential":
        why.append("GPTQ inside " + ("one forward over every calibration window" if one_forward else
                                     "staged forwards, one group of Linears further each (every window in one "
                                     "forward would not fit a quarter of the free memory)"))
    placement: Placement = ("disk" if spill else "device" if resident else "memory") if forwards else "none"
    if facts.resume_every_s is not None and not spill:
        resume = facts.resume_every_s
    else:  # spilled inputs are on disk anyway: every layer is a resume point
        resume = RESIDENT_RESUME_EVERY_S if resident else 0.0
    if resume:
        why.append(f"a resume point every {resume:.0f} s (the next layer's inputs saved)")
    traces = calibrates and (bool(pipeline.transforms) or pipeline.true_sequential)
    expert_stream = decide_expert_stream(pipeline, facts, flow, why)
    experts_kept = decide_experts_kept(pipeline, facts, flow, expert_stream, why)
    return LayerLoopPlan(flow=flow, activations=placement, one_forward=one_forward, shared=shared,
                         traces_structure=traces, batch_size=facts.batch_size, resume_every_s=resume,
                         device=facts.device, why=tuple(why), facts=facts, expert_stream=expert_stream,
                         experts_kept=experts_kept)


def decide_experts_kept(pipeline: AlgorithmSteps, facts: LoopFacts, flow: str, expert_stream: bool,
                        why: list[str]) -> bool:
    """Whether the routed experts' stored codes are copied as they are, never decoded nor quantized (appending the
    reason to `why`): where every routed expert targets the quantized original's own format (`facts.source_codes`)
    and nothing needs their decoded weights: no forward pass (data-free) and no transform. Otherwise the experts are
    decoded, quantized and their codes kept afterwards where their weights are still the original's
    (llmc.quant.mxfp4_source.keep_layer_codes)."""
    if facts.source_codes is None or flow != "data-free" or pipeline.transforms or expert_stream:
        return False
    why.append(f"the routed experts' {facts.source_codes.format.upper()} codes and scales are copied as stored (their "
               "target is the source's own format, and nothing runs them): not decoded, not quantized")
    return True


# A layer whose weights in the compute dtype take more than this share of the available memory is streamed expert by
# expert: the whole-layer path holds the layer, its codes, the previous layer's codes being written and the next
# layer read ahead, about 2.5 copies of it (llmc.pipeline.quantize.quantize_cost)
WHOLE_LAYER_SHARE = 0.5


def decide_expert_stream(pipeline: AlgorithmSteps, facts: LoopFacts, flow: str, why: list[str]) -> bool:
    """Whether a Mixture-of-Experts layer's routed experts are read, calibrated, quantized and written one at a time
    (appending the reason to `why`). Only where each expert's statistics and codes depend on its own weights and its
    routed inputs alone: no forward at all, or one observing forward over the original weights (RTN's ranges) with
    no transform, Hessian or replayed module call, whose outputs (the original ones) are the next layer's inputs."""
    if not facts.moe or facts.stream_experts == "never" or facts.ranks > 1:  # one process: its stats are its own
        return False
    over = too_large_for(facts)
    if facts.stream_experts == "auto" and over is None:
        return False
    observe_only = (flow == "data-free" or flow == "sequential" and not pipeline.transforms
                    and not pipeline.observes_hessians and not pipeline.replays_module_calls
                    and pipeline.propagate == "original")
    if not (facts.experts_streamable and observe_only):
        if facts.stream_experts == "always" or over is not None:
            why.append("the layer's experts are not streamed one at a time: "
                       + ("the checkpoint holds them fused (or their routing scales the input)"
                          if not facts.experts_streamable else
                          f"the {pipeline.scheme.algorithm} pipeline transforms or observes more than each expert's "
                          "own input ranges"))
        return False
    why.append(f"routed experts one at a time (the router run once, each expert read from the checkpoint, calibrated "
               f"on its routed tokens, quantized, written and dropped): the {_gb(facts.layer_bytes)} layer "
               + (f"is over half of {over}" if facts.stream_experts == "auto"
                  else "(calibration.stream_experts: always)"))
    return True


def too_large_for(facts: LoopFacts) -> str | None:
    """Where a whole layer does not fit (over WHOLE_LAYER_SHARE of the host's available memory, or of the
    calibrating GPU's free memory, which holds the whole layer too), in words; None where it fits both."""
    if facts.host_available is not None and facts.layer_bytes > WHOLE_LAYER_SHARE * facts.host_available:
        return f"the {_gb(facts.host_available)} available"
    if (facts.device != "cpu" and facts.device_free is not None
            and facts.layer_bytes > WHOLE_LAYER_SHARE * facts.device_free):
        return f"the GPU's {_gb(facts.device_free)} free"
    return None


def fits_one_forward(facts: LoopFacts, free: int | None) -> bool:
    """Whether one decoder layer's forward over every calibration window at once fits in a quarter of `free` bytes:
    residual stream, norms, q/k/v/o and the MLP's intermediates per token, plus attention scores as if
    materialized (batch x heads x seq²)."""
    tokens = facts.windows * facts.seq_len
    need = (tokens * (8 * facts.hidden + 4 * facts.intermediate) * facts.elem
            + facts.windows * facts.heads * facts.seq_len ** 2 * 4)
    return free is not None and need <= free // 4


def redecided(planned: LayerLoopPlan, now: LoopFacts, pipeline: AlgorithmSteps) -> tuple[LayerLoopPlan, list[str]]:
    """The plan's decision, or a new one where the facts moved materially since (with what changed)."""
    changes = now.changed_from(planned.facts)
    if not changes:
        return planned, []
    again = decide_layer_loop(pipeline, now)
    return (planned, []) if again.as_dict() == planned.as_dict() else (again, changes)


def _gb(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 1e9:.1f} GB"

