"""Data flows: how the calibration data moves through the layer loop (`llmc.quant.stream.quantize_model`). The
scheme's pipeline chooses one (`flow_for`); each is registered under its name, as algorithms are
(`llmc.quant.algorithms.registry`):

  data-free          nothing calibrates: each layer's weights are quantized as read
  shared-statistics  the ranges an earlier scheme recorded on the same model and data (`llmc.quant.shared_stats`):
                     no calibration forward at all
  sequential         each layer observes its inputs, is transformed (SmoothQuant, AWQ), observed again where the
                     transform changed what the scheme stores, quantized; the next layer's inputs are this layer's
                     original outputs (collected while observing) or its quantized outputs (one more pass)
  true-sequential    GPTQ quantizes each Linear inside the forward that makes the next layer's inputs
                     (`llmc.quant.true_sequential`)

Mixture-of-Experts blocks are an observation mode of the calibrating flows, not a flow: they count the tokens
routed to each expert and, with `calibration.moe_calibrate_all_experts`, run every expert on every token for
statistics (`llmc.quant.moe.observing_experts`). A flow reads and moves the loop's state (`Stream`: the activations
between layers) and one layer's work (`LayerWork`); the loop does the rest (materialize, quantize what the flow
left unquantized, write, make the next layer's inputs durable, resume, release).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from llmc import distributed
from llmc.model.skeleton import HOST, capture_layer_inputs, layer_output, to_device
from llmc.telemetry.progress import log
from llmc.quant import moe, true_sequential
from llmc.quant.activations import Activations, ActivationWriter, inputs_dir
from llmc.quant.algorithms.catalog import Observe, AlgorithmSteps
from llmc.quant.numerics import QuantizedWeight, dequantize_weight
from llmc.quant.observe import (RANGES_ONLY, LayerStats, forward_batches, observe_batches, observing,
                                register_kv_observer, stats_from_shared)
from llmc.quant.shared_stats import SharedStats
from llmc.quant.spec import TensorSpec
from llmc.registry import Registry


@dataclass(frozen=True)
class FlowNeeds:
    """What chooses the flow: the scheme's pipeline and the calibration's shape on this machine."""

    calibrates: bool  # the scheme needs calibration data
    shared_cover: bool  # shared statistics of an earlier scheme cover every Linear and KV module (and may be used)
    true_sequential: bool  # the quantizer quantizes inside the forward (GPTQ's default)
    moe: bool  # the model has Mixture-of-Experts blocks
    one_forward: bool  # every calibration window fits one forward of a layer (unspilled, unmasked)


@dataclass
class Stream:
    """The layer loop's state a flow reads and moves."""

    model: nn.Module
    layers: nn.ModuleList
    pipeline: AlgorithmSteps
    dtype: torch.dtype
    device: torch.device
    batch_size: int
    act_dir: Path  # this rank's saved activations (state/inputs-<i>/)
    start: int  # the first layer to quantize (a resumed run's)
    spill: bool  # activations between layers live on disk, one batch in memory at a time
    # in memory, they stay on `device` (the calibrating GPU: `activations.stays_on_device`) rather than the host
    resident: bool
    one_forward: bool  # every calibration window fits one forward of a layer
    moe_all_experts: bool
    shared: SharedStats | None = None
    # each quantized Linear's weight format (a mixed scheme's groups differ); None: the pipeline scheme's for all
    specs: Mapping[str, TensorSpec] | None = None
    hidden: Activations = field(default_factory=lambda: Activations([]))  # the current layer's inputs
    extras: list = field(default_factory=list)  # per batch, per layer: (args, kwargs) the model passes the layer
    # under torchrun, statistics combined bit for bit as one process computes them, over Linears that differ by
    # rank (Mixture-of-Experts models: LayerStats.exact)
    exact_stats: bool = False

    def new_stats(self) -> LayerStats:
        """An empty LayerStats for one observation pass (`exact_stats`: a rank after the first defers its Hessian
        calls, llmc.distributed.chain_hessians)."""
        return LayerStats(exact=True, defer_hessians=distributed.rank() > 0) if self.exact_stats else LayerStats()

    def weight_spec(self, name: str) -> TensorSpec:
        return self.specs[name] if self.specs else self.pipeline.scheme.weights

    def inputs_writer(self, layer: int) -> ActivationWriter:
        """Collects `layer`'s inputs where they live between layers (the host, disk, or the calibrating GPU)."""
        return ActivationWriter(inputs_dir(self.act_dir, layer), self.spill, self.device if self.resident else HOST)


@dataclass
class LayerWork:
    """One decoder layer's work: what the flow observes into and what it leaves for the loop."""

    index: int
    prefix: str
    module: nn.Module
    linears: dict[str, nn.Linear]
    kv_modules: dict[str, nn.Module]
    extras: list  # per batch: (args, kwargs), on the layer's device
    stats: LayerStats = field(default_factory=LayerStats)
    routed: dict[str, torch.Tensor] = field(default_factory=dict)  # MoE block -> tokens routed to each expert
    quantized: dict[str, QuantizedWeight] | None = None  # set by a flow that quantizes (else the loop does)
    next_inputs: ActivationWriter | None = None


class DataFlow:
    name: ClassVar[str]

    @staticmethod
    def applies(needs: FlowNeeds) -> bool:
        raise NotImplementedError

    @staticmethod
    def forward_passes(pipeline: AlgorithmSteps, loop) -> float:
        """Forward passes over the calibration tokens per layer, in model forwards (what the plan costs): one to
        observe, one more through the quantized layer where a step calibrates, plus each step's own."""
        return pipeline.calibration_passes()

    def prepare(self, s: Stream, calibration: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Before the first layer: the first layer's inputs (or nothing)."""

    def calibrate(self, s: Stream, w: LayerWork) -> None:
        """The layer's statistics into `w.stats` (and its transform applied); may quantize it (`w.quantized`)."""

    def propagate(self, s: Stream, w: LayerWork) -> None:
        """After the layer is quantized: the next layer's inputs into `s.hidden` (published: the loop makes them
        durable with `w.next_inputs.persist`, on its writer's thread)."""


FLOWS: Registry[type[DataFlow]] = Registry("data flow")  # in the order `flow_for` asks them


def register_flow(name: str) -> Callable[[type[DataFlow]], type[DataFlow]]:
    def register(cls: type[DataFlow]) -> type[DataFlow]:
        FLOWS.add(name, cls)
        cls.name = name
        return cls

    return register


def flow_for(needs: FlowNeeds) -> DataFlow:
    """The first registered flow that applies."""
    return next(cls for cls in FLOWS.values() if cls.applies(needs))()


@register_flow("data-free")
class DataFree(DataFlow):
    @staticmethod
    def applies(needs: FlowNeeds) -> bool:
        return not needs.calibrates

    @staticmethod
    def forward_passes(pipeline: AlgorithmSteps, loop) -> float:
        return 0.0


@register_flow("shared-statistics")
class SharedStatistics(DataFlow):
    @staticmethod
    def applies(needs: FlowNeeds) -> bool:
        return needs.shared_cover

    @staticmethod
    def forward_passes(pipeline: AlgorithmSteps, loop) -> float:
        return 0.0  # the ranges an earlier scheme recorded: no calibration forward

    def prepare(self, s: Stream, calibration, mask) -> None:
        log("calibration statistics recorded earlier in this build (by an earlier scheme, or the search's measuring "
            "pass) on the same model and data: no calibration forward")

    def calibrate(self, s: Stream, w: LayerWork) -> None:
        w.stats = stats_from_shared(to_device(s.shared.load(w.index), s.device), w.linears, w.kv_modules)
        s.pipeline.transform_layer(w.module, w.prefix, w.stats)


class _Calibrating(DataFlow):
    """The flows that run the calibration windows through each layer."""

    def forward_batch(self, s: Stream, calibration: torch.Tensor) -> int:
        return s.batch_size

    def prepare(self, s: Stream, calibration: torch.Tensor, mask: torch.Tensor | None) -> None:
        register_kv_observer()
        if s.start >= len(s.layers):  # killed after the last layer: no layer runs again, no inputs are needed
            return
        batches = unpadded_samples(calibration, mask) if mask is not None else list(
            calibration.split(self.forward_batch(s, calibration)))
        saved = inputs_dir(s.act_dir, s.start)
        hidden = Activations.load(saved, s.spill).to(s.device if s.resident else HOST) if (
            s.start and saved.is_dir()) else None
        if s.start and distributed.any_rank(hidden is None or len(hidden) != len(batches)):
            log(f"no saved inputs for layer {s.start} in {len(batches)} batches (work folder from an older run "
                "or another machine): starting over")
            s.start = 0
        first = None if s.start else s.inputs_writer(0)
        s.extras = capture_layer_inputs(s.model, s.layers, batches, first.put if first else None)
        # layer 0's inputs are not a resume point (a run with no progress captures them again): not persisted
        s.hidden = hidden if s.start else first.publish()

    def propagate(self, s: Stream, w: LayerWork) -> None:
        s.hidden = w.next_inputs.publish()


@register_flow("true-sequential")
class TrueSequential(_Calibrating):
    @staticmethod
    def applies(needs: FlowNeeds) -> bool:
        # MoE: staged passes group Linears by the first input each batch reaches, which differs per batch when
        # tokens are routed, so MoE layers take the two-forward order (Hessians observed, then GPTQ) unless every
        # window runs in one forward
        return needs.calibrates and needs.true_sequential and (needs.one_forward or not needs.moe)

    @staticmethod
    def forward_passes(pipeline: AlgorithmSteps, loop) -> float:
        # in one forward, that forward is also the one that makes the next layer's inputs; staged, the partial
        # passes add up to about one more
        return pipeline.calibration_passes() - (1.0 if loop.one_forward else 0.0)

    def forward_batch(self, s: Stream, calibration: torch.Tensor) -> int:
        return calibration.shape[0] if s.one_forward else s.batch_size  # GPTQ inside the one forward it makes

    def calibrate(self, s: Stream, w: LayerWork) -> None:
        if s.exact_stats:  # the ranks' experts are called on different tokens: their hooks would not meet
            raise RuntimeError("GPTQ inside the forward does not combine a Mixture-of-Experts layer over ranks: "
                               "the layer loop takes the sequential flow there (llmc.quant.loop_plan)")
        w.next_inputs = s.inputs_writer(w.index + 1)
        with moe.observing_experts(w.module, s.moe_all_experts, w.routed):
            w.quantized = quantize_true_sequential(w.module, w.prefix, w.linears, w.kv_modules, s.hidden, w.extras,
                                                   w.stats, s.pipeline, w.next_inputs.put, s.batch_size)


@register_flow("sequential")
class Sequential(_Calibrating):
    @staticmethod
    def applies(needs: FlowNeeds) -> bool:
        return needs.calibrates

    def calibrate(self, s: Stream, w: LayerWork) -> None:
        # The next layer's inputs: this layer's outputs with original weights (collected while observing) or with
        # its quantized weights (one more pass, after quantizing: `propagate`).
        pipeline, layer = s.pipeline, w.module
        w.next_inputs = s.inputs_writer(w.index + 1)
        observe = pipeline.observe(layer)
        sink = w.next_inputs.put if pipeline.propagate == "original" else None
        w.stats = s.new_stats()
        with moe.observing_experts(layer, s.moe_all_experts, w.routed):
            observe_batches(layer, w.linears, w.kv_modules, observe, s.hidden, w.extras, w.stats, sink)
        distributed.sum_counts(w.routed)  # which experts are starved: decided on every rank's tokens
        distributed.reduce_layer_stats(w.stats, s.device)
        if s.shared is not None and distributed.is_main():
            s.shared.save(w.index, to_device({"channel_absmax": w.stats.channel_absmax,
                                              "key_absmax": w.stats.key_absmax,
                                              "value_absmax": w.stats.value_absmax}, HOST))
        if pipeline.transform_layer(layer, w.prefix, w.stats) and pipeline.reads_statistics_after_transform:
            # Rescaled weights change activation ranges (and Hessians): measure them again.
            w.stats = s.new_stats()
            again = Observe(hessians=observe.hessians, module_calls=())
            with moe.observing_experts(layer, s.moe_all_experts, None):
                observe_batches(layer, w.linears, w.kv_modules, again, s.hidden, w.extras, w.stats)
            distributed.reduce_layer_stats(w.stats, s.device)

    def propagate(self, s: Stream, w: LayerWork) -> None:
        if s.pipeline.propagate == "quantized":
            for name, lin in w.linears.items():
                lin.weight.data = dequantize_weight(w.quantized[name], s.weight_spec(name), s.dtype)
            forward_batches(w.module, s.hidden, w.extras, w.next_inputs.put)
        super().propagate(s, w)


def quantize_true_sequential(
    layer: nn.Module,
    prefix: str,
    linears: dict[str, nn.Linear],
    kv_modules: dict[str, nn.Module],
    hidden: Activations,
    extras: list[tuple[tuple, dict]],
    stats: LayerStats,
    pipeline: AlgorithmSteps,
    sink: Callable[[torch.Tensor], None],
    batch_windows: int,
) -> dict[str, QuantizedWeight]:
    """GPTQ for one layer, each Linear on inputs through the layer's already-quantized Linears
    (`llmc.quant.true_sequential`); the quantized layer's outputs go to `sink`, ranges into `stats`."""
    device = next(layer.parameters()).device
    scheme, options = pipeline.scheme, pipeline.quantizer.options
    stacks = true_sequential.stacks_of(layer, prefix, linears)

    def run(b: int) -> torch.Tensor:
        args, kwargs = extras[b]
        return layer_output(layer(hidden[b].to(device), *args, **kwargs))

    # Ranges only where the scheme stores them (static activation or KV-cache scales): abs() of every
    # Linear's input is a copy of the activations, ~3% of a SmolLM2 W4A16 run for nothing.
    with observing(layer, linears if scheme.stores_ranges else {}, stats, kv_modules, RANGES_ONLY):
        if len(hidden) == 1:
            quantized, out = true_sequential.in_one_forward(lambda: run(0), linears, stacks, scheme.weights,
                                                            options, batch_windows)
            sink(out)
            return quantized
        quantized = true_sequential.staged([functools.partial(run, b) for b in range(len(hidden))], linears,
                                           stacks, scheme.weights, options)
    forward_batches(layer, hidden, extras, sink)  # the staged passes observed every range already
    return quantized


def unpadded_samples(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """One [1, length] batch per right-padded row: the tokens its mask keeps, no padding."""
    lengths = mask.long().sum(dim=1)
    if not torch.equal(mask.long(), (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()):
        raise ValueError("calibration rows must be right-padded: each mask is ones then zeros")
    return [ids[i : i + 1, : int(n)] for i, n in enumerate(lengths.tolist()) if n > 0]
