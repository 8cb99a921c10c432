"""The quantize stage of one scheme: the model streamed one decoder layer at a time through the scheme's
algorithm (`llmc.quant.stream`), written in llmc's canonical quantized form.

Key: the scheme, the compute dtype, the algorithm's key entries, the device type where it is not the CPU, the MoE
calibration mode where set, the number of ranks where sums over windows depend on it; the source and the
calibration windows. Cost (`quantize_cost`): what `llmc.quant.stream` holds at its peak, term by term, and its time
per decoder layer, from what the scheme's algorithm states about itself (`AlgorithmSteps`: Hessians, replayed module
calls, transforms, search sizes, calibration passes) and the quantizer's probed rate at the scheme's weights
(`llmc.quant.numerics.quantize_rate`).

The peak, term by term (`CostRow.parts`): the process, everything outside the decoder layers while calibrating (the
skeleton holds embeddings and head; while they are read, their stored-dtype copies too, a peak of its own), one
decoder layer in the compute dtype (+ its stored-dtype copy while it is read
when the two differ), the quantizer's float32 temporaries (one block of rows when it quantizes a Linear by itself,
the largest Linear when the algorithm copies whole weights), the layer's codes, the activations passed between
layers (two copies, or one batch in and out when spilled), one batch's forward temporaries, and the algorithm's
state (Hessians: float32 + the float64 factorization of the widest input; replayed module calls: every module's
calibration inputs); algorithms that rescale smoothing pairs first find them on the first layer in float64 (the
layer + a candidate pair's rescaled consumers), a peak of its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc import distributed
from llmc.telemetry import events
from llmc.pipeline.stage import Stage
from llmc.pipeline import ranks
from llmc.model.checkpoint import read_elem, widened_bytes
from llmc.model.dtype import BYTES, kept_elem
from llmc.model.families import expert_count
from llmc.model.source_formats import decode_rate
from llmc.pipeline.context import Build, Costing, SchemeBytes
from llmc.pipeline.runner import read_json
from llmc.pipeline.ids import Kind, StageId
from llmc.quant.algorithms.catalog import AlgorithmSteps, quantize_stage_config
from llmc.quant.flows import FLOWS
from llmc.storage.direct_io import CHUNK_BYTES, DIRECT_MIN_BYTES
from llmc.planning.machine import (CUDA_CONTEXT_BYTES, PROCESS_BYTES, Machine, file_write_seconds, forward_efficiency,
                                   forward_seconds, matmul_rate, read_seconds, source_read_seconds, spill_seconds)
from llmc.planning.rows import GB, MEASUREMENT_PART, CostRow
from llmc.planning.shapes import Shape
from llmc.quant import runtime_scales
from llmc.quant.canonical import module_matches
from llmc.quant.numerics import BLOCK_ELEMENTS, QUANTIZE_PROBE_ELEMENTS, quantize_rate
from llmc.quant.groups import by_group
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream_probe import layer_overhead_seconds
from llmc.quant.forward_probe import measured_efficiency
from llmc.formats.described import check_seconds
from llmc.quant.canonical import META_FILE
from llmc.quant.mxfp4_source import kept_codes_seconds, passed_through_seconds, source_codes_fact
from llmc.quant.loop_plan import LayerLoopPlan, LoopFacts, config_widths, decide_layer_loop, experts_streamable
from llmc.quant.search import BF16, MeasurementCost, SearchSpace, measurement_cost
from llmc.quant.stream import Calibration, CALIBRATION_BATCH_SIZE, measurement_facts, quantize_model, StreamOptions
from llmc.storage.store import stage_key

# float64 bytes of a decoder layer per second smoothing-pair discovery gets through (llmc.quant.stream.LayerStructure:
# the layer in float64 and back, one probe forward per candidate pair): docs/planner-constants.md#discovery_rate
DISCOVERY_RATE = 0.13e9
# a search's fake quantization of candidate weights ((q(w * s) / s) in float32, a block of rows at a time, cast back:
# awq.quantized_at_scale) costs this many times the quantizer probe's time per element:
# docs/planner-constants.md#fake_quant_cost
FAKE_QUANT_COST = 2.0
# a GPU layer's parts that run after its overlapped reads, writes and compute (on the host, or on the GPU after the
# quantizer's pass): each adds to the layer's time
_AFTER_THE_OVERLAP = ("mxfp4 codes kept", "mxfp4 codes copied", "hessian column loop", "scale search",
                      "clip search")


class Quantize(Stage):
    share = ranks.Share.ALL

    def __init__(self, variant: str, scheme: Scheme, earlier: tuple[Quantize, ...] = (),
                 searched: dict | None = None, space: SearchSpace | None = None) -> None:
        self.variant, self.scheme = variant, scheme
        # quantization.search on this model, its mix not chosen yet: the measuring pass runs before this stage
        # (llmc.pipeline.search), and the plan costs it in this stage's row (`measurement`)
        self.space = space if searched is None else None
        # quantization.search's record of the chosen mix (llmc.quant.search.summary), less what only the budget fixes:
        # the same mix from another budget is the same output
        self.searched = ({k: v for k, v in searched.items() if not k.startswith("budget")} if searched else None)
        self.earlier = earlier  # the quantize stages before this one in the build (whose statistics it may reuse)
        # as the plan and the build's records name it: the variant (unique in a recipe), else the scheme
        self.id = StageId(Kind.QUANTIZE, (variant or scheme.name,))

    def key(self, b: Build) -> str:
        scheme, device = self.scheme, b.device
        cfg = {"scheme": scheme.to_dict(), "dtype": b.result.dtype, **quantize_stage_config(scheme)}
        if device.type != "cpu":  # float rounding differs by device; CPU keys stay as they were
            cfg["device"] = device.type
        if b.recipe.calibration.moe_calibrate_all_experts:  # MoE statistics from every token (keys without: as were)
            cfg["moe_calibrate_all_experts"] = True
        rules = runtime_scales.rules_applied(scheme, expert_count(b.model_config) > 1)
        if rules:  # scales unified as the serving runtimes' fused kernels hold them (keys without: as were)
            cfg["runtime_scales"] = rules
        if self.searched:  # the measurement its predicted damages come from
            cfg["search"] = self.searched["measurement_key"]
        summing = ranks.ranks_summing(AlgorithmSteps.of(scheme).sums_over_windows)
        if summing:  # sums over windows associate differently on N ranks (maxima do not)
            cfg["ranks"] = summing
        return stage_key("quantize", cfg, [b.result.source.sha256, self._calib_key(b) or ""])

    def pending(self, b: Build) -> bool:
        return not b.runner.is_done(self.id, self.key(b))

    def _calib_key(self, b: Build) -> str | None:
        return b.calib_key if self.scheme.needs_calibration else None

    def decide(self, c: Costing) -> LayerLoopPlan:
        """The layer loop's decision on the machine `c` plans for (llmc.quant.loop_plan.decide_layer_loop): the same
        function the stream would call, given what the plan reads from config.json, the recipe and the machine."""
        return decide_layer_loop(AlgorithmSteps.of(self.scheme), self._facts(c))

    def decide_measurement(self, c: Costing) -> LayerLoopPlan | None:
        """The search's measuring pass's layer loop (llmc.quant.stream.measure_model: its ranges observed as RTN's,
        every layer's inputs kept for the fisher proxy), where a search is still to measure; else None."""
        if self.space is None:
            return None
        observing = replace(self.scheme, algorithm="rtn", algorithm_options=(), groups=())
        facts = replace(self._facts(c), shared_stats=True, shared_covered=False)
        return decide_layer_loop(AlgorithmSteps.of(observing),
                                 measurement_facts(facts, c.shape.layers, self.space.proxy == "fisher"))

    def _facts(self, c: Costing) -> LoopFacts:
        cal, shape = c.recipe.calibration, c.shape
        windows = cal.samples
        if distributed.active():  # this rank's block of windows (llmc.quant.stream._my_windows)
            lo, hi = distributed.shard_bounds(cal.samples, 1 if cal.packing == "samples" else CALIBRATION_BATCH_SIZE)
            windows = hi - lo
        facts = LoopFacts(calibrates=self.scheme.needs_calibration, windows=windows, seq_len=cal.seq_len,
                          masked=cal.packing == "samples", batch_size=CALIBRATION_BATCH_SIZE,
                          spill_mode=cal.spill_activations, **config_widths(c.config), elem=c.elem,
                          moe=shape.active < 1, device=c.machine.device, host_available=c.machine.available,
                          device_free=c.machine.gpu_free,
                          shared_stats=self.scheme.needs_calibration, shared_covered=self._statistics_recorded(c),
                          resume_every_s=cal.resume_every_s, ranks=distributed.size(),
                          layer_bytes=shape.layer_params * c.elem,
                          experts_streamable=shape.active < 1 and experts_streamable(c.config),
                          stream_experts=cal.stream_experts,
                          source_codes=source_codes_fact(getattr(shape.source_format, "name", None), self.scheme,
                                                         c.linears, shape.layers, c.config.get("model_type")))
        return facts

    def _statistics_recorded(self, c: Costing) -> bool:
        """Whether an earlier quantize stage of this build records the statistics this scheme needs (its Linears and
        KV modules among those recorded): then this one reuses them (llmc.quant.shared_stats)."""
        # an earlier scheme that shares statistics has them recorded, by itself or (where it reused them) by one
        # before it that covers it: no need to decide the earlier stages again (that recursion doubles per variant)
        needed = _targets(self.scheme, c.linears)
        if (self.searched is not None or self.space is not None) and AlgorithmSteps.of(self.scheme).shares_statistics:
            return True  # the search's measurement pass records them (llmc.pipeline.search)
        return any(
            q.scheme.needs_calibration and AlgorithmSteps.of(q.scheme).shares_statistics
            and needed <= _targets(q.scheme, c.linears)
            and (q.scheme.kv_cache is not None or self.scheme.kv_cache is None) for q in self.earlier)

    def run(self, b: Build) -> None:
        scheme, device, calib_key = self.scheme, b.device, self._calib_key(b)
        calibration = b.runner.output(StageId(Kind.CALIBRATE), calib_key) if calib_key else None
        c = b.recipe.calibration
        planned = b.result.plan.decision_of(self.id)

        def produce(out: Path) -> None:
            windows = None
            if calibration is not None:
                saved = load_file(str(calibration / "tokens.safetensors"))
                windows = Calibration(saved["input_ids"], mask=saved.get("attention_mask"), spill=c.spill_activations,
                                      shared_stats=self._shared_stats(b, calib_key),
                                      moe_all_experts=c.moe_calibrate_all_experts, moe_min_tokens=c.moe_min_tokens,
                                      stream_experts=c.stream_experts)
            quantize_model(b.result.source, scheme, out, windows,
                           StreamOptions(dtype=getattr(torch, b.result.dtype), device=device, loop=planned,
                                         resume_every_s=c.resume_every_s,
                                         extra_meta={"calibration_key": calib_key, "device": device.type,
                                                     **({"search": self.searched} if self.searched else {})},
                                         on_layer_done=lambda i: events.emit(f"quantize:layer:{i}")))

        key = self.key(b)
        done = b.runner.run(
            self.id, key, produce, all_ranks=True, inputs=[calibration] if calibration else [],
            announce=f"quantize: {scheme.name} with {scheme.algorithm}, one decoder layer at a time on {device}")
        b.quantized[self.variant] = (done, key)
        b.result.quantized_dirs[self.variant] = done
        # the decision the loop obeyed, as its output records it (a cached output: as it was when written)
        b.result.stages[-1] = replace(b.result.stages[-1], decision=read_json(done, META_FILE).get("layer_loop"))

    @staticmethod
    def _shared_stats(b: Build, calib_key: str | None) -> Path | None:
        """Where schemes calibrated on original outputs share statistics: one folder per model, data and dtype
        (and the stream's batch size, which fixes the exact arithmetic of the calibration forwards)."""
        if calib_key is None:
            return None
        cfg = {"dtype": b.result.dtype, "batch_size": CALIBRATION_BATCH_SIZE}
        if b.device.type != "cpu":
            cfg["device"] = b.device.type
        return b.runner.shared_folder("shared-stats", stage_key("shared-stats", cfg, [b.result.source.sha256,
                                                                                      calib_key]))

    def groups(self, c: Costing) -> list[dict] | None:
        """A mixed scheme's groups on this model (`group_bytes`); None for one scheme."""
        return group_bytes(self.scheme, c.linears, c.config, c.elem) if self.scheme.mixed else None

    def sizes(self, c: Costing) -> SchemeBytes:
        """The scheme's sizes on this model: what this stage writes and what the exports and evaluations of its
        output read."""
        scheme, shape, e = self.scheme, c.shape, c.elem
        groups = self.groups(c)
        if groups is not None:
            quantized = sum(g["params"] for g in groups if g["quantized"])
            packed = sum(g["bytes"] for g in groups if g["quantized"])
        else:
            quantized = sum(a * b for n, (a, b) in c.linears.items() if not module_matches(n, scheme.ignore))
            packed = quantized * scheme.weights.stored_bits / 8  # the codes, packed (microscaling: with their scales)
        # unquantized tensors: those inside the layers in the compute dtype, those outside as kept (kept_dtype)
        rest = (shape.params - quantized - shape.outer_params) * e + shape.outer_params * c.kept_elem
        return SchemeBytes(quantized_params=quantized, canonical=quantized * 1 + rest,  # int4: one code a byte
                           packed=packed, artifact=packed + rest)

    def cost(self, c: Costing) -> None:
        scheme, shape, sizes = self.scheme, c.shape, self.sizes(c)
        pipe, loop = AlgorithmSteps.of(scheme), self.decide(c)
        row = quantize_cost(shape, loop, pipe, compute=c.compute, stored_elem=c.stored_elem, machine=c.machine)
        row.disk_bytes = sizes.canonical
        row.decision = loop
        if c.config.get("model_type"):  # the stream's first step builds the model's meta skeleton, as an export's
            skeleton = check_seconds(c.config)  # config check does (llmc.formats.described.model_linears)
            row.seconds += skeleton
            row.fixed_seconds += skeleton
        measuring = self.measurement(c)
        if measuring is not None:  # the search measures first, in the same stage walk's time and memory
            layers = shape.layers * shape.layer_share
            row.seconds += measuring.seconds(layers)
            row.layer_seconds += measuring.layer_seconds
            row.layer_parts.update({f"{MEASUREMENT_PART}{k}": v for k, v in measuring.seconds_parts.items()})
            row.fixed_seconds += measuring.fixed_seconds
            row.host_bytes = max(row.host_bytes, measuring.host_bytes)
            # the pass's peak term by term beside the loop's, so the parts show which of the two is host_bytes
            row.parts.update({f"{MEASUREMENT_PART}{k}": v for k, v in measuring.parts.items()})
            row.why += (f"; the search's measurement first: {measuring.forwards} forwards of each layer"
                        + (", every layer's inputs kept for the fisher proxy's backward"
                           if self.space.proxy == "fisher" else "")
                        + f", ~{measuring.seconds(layers):.0f} s, {measuring.host_bytes / GB:.2f} GB")
        c.rows.append(row.named(self.id))
        if loop.activations in ("memory", "device"):
            spilled = quantize_cost(shape, decide_layer_loop(pipe, replace(loop.facts, spill_mode="always")), pipe,
                                    compute=c.compute, stored_elem=c.stored_elem, machine=c.machine)
            if spilled.host_bytes < 0.95 * row.host_bytes:  # only a strategy that saves something is named
                row.cheaper = ("set calibration.spill_activations: always (or auto) to keep one batch of "
                               "activations in memory", spilled.host_bytes / 1e9)

    def measurement(self, c: Costing) -> MeasurementCost | None:
        """The search's measuring pass (llmc.pipeline.search, llmc.quant.stream.measure_model) where it is still to
        run, as its layer loop decides it (`decide_measurement`); else None."""
        loop = self.decide_measurement(c)
        if loop is None:
            return None
        section = dict(c.recipe.variant_sections())[self.variant]
        members = section.search.members(section.algorithm)
        candidates = {n: (self.scheme.member(members[n]) if n != BF16 else None) for n in self.space.candidates}
        tokens = c.recipe.calibration.samples * c.recipe.calibration.seq_len
        return measurement_cost(self.space, candidates, c.linears, c.shape, tokens=tokens,
                                seq_len=c.recipe.calibration.seq_len,
                                batch_tokens=min(loop.batch_size, c.recipe.calibration.samples)
                                * c.recipe.calibration.seq_len,
                                activations=loop.activations, compute=c.compute, stored_elem=c.stored_elem,
                                device=c.machine.device, resident=c.machine.source_resident)


def _targets(scheme: Scheme, linears: dict[str, tuple[int, int]]) -> set[str]:
    return {n for n in linears if not module_matches(n, scheme.ignore)}


def kill_loss_seconds(resume_every_s: float, per_layer: float, layers: int) -> float:
    """The most quantize work a kill can lose: a layer is a resume point once `resume_every_s` have passed since the
    last, so up to the interval plus the layer running is redone (never more than the whole loop)."""
    return min(resume_every_s + per_layer, per_layer * layers)


def kill_loss(resume_every_s: float, per_layer: float, layers: int) -> str:
    """The plan's sentence for the worst case of a kill (llmc plan's quantize row)."""
    lost = kill_loss_seconds(resume_every_s, per_layer, layers)
    what = "the interval plus the layer running" if resume_every_s else "the layer running"
    return (f"a kill loses at most ~{lost:.1f} s of quantization ({what}; "
            "calibration.resume_every_s or --resume-every sets the interval)")


def group_bytes(scheme: Scheme, linears: dict[str, tuple[int, int]], config: dict, elem: int) -> list[dict]:
    """A mixed scheme's groups on this model, in the recipe's order: each group's Linears, parameters and the bytes
    its weights take stored (codes packed, microscaling scales included; an `ignore: true` group's, and those the
    scheme's `ignore` leaves out, in the model's dtype of `elem` bytes). Resolving the groups raises the recipe's
    error for a Linear in no group or in two (llmc.quant.groups)."""
    rows = []
    for name, shapes in by_group(scheme, linears, config.get("num_hidden_layers", 0), config.get("model_type")).items():
        group = scheme.group(name) if name is not None else None
        if name is None and not shapes:
            continue
        quantized = group is not None and group.quantized
        params = sum(a * b for a, b in shapes.values())
        bits = group.weights.stored_bits if quantized else 8 * elem
        rows.append({"group": name if name is not None else "quantization.ignore", "quantized": quantized,
                     "scheme": scheme.member(group).name if quantized else "unquantized",
                     "linears": len(shapes), "params": params, "bytes": params * bits / 8})
    return rows


FP8_PER_TENSOR = TensorSpec("fp8_e4m3", "tensor")


def layer_seconds(layer_params: int, *, stored_bytes: float, converted_bytes: float = 0.0, tokens: int,
                  passes: float, active: float, compute: str, code_bytes: float, device: str, width: int,
                  seq_len: int = 0, attn_width: int = 0, batch_tokens: int = 64,
                  largest_linear: int = QUANTIZE_PROBE_ELEMENTS, weights: TensorSpec = FP8_PER_TENSOR,
                  machine: Machine | None = None, efficiency: float | None = None) -> dict[str, float]:
    """One decoder layer of the quantize stage, part by part: read it (`stored_bytes` of the source, the share the
    page cache holds on `machine` from memory; into `converted_bytes` of a wider compute dtype in the same pass where
    not 0), the calibration forward
    passes over `tokens` in sequences of `seq_len` (GEMMs + causal attention at the matmul rate probed at the
    model's `width`), the quantizer's arithmetic (its probed rate at the scheme's `weights`) and writing its codes
    with fsync (and hashing them). benchmarks/layer_time.py measures the same parts at full width. `efficiency`: the
    forward's share of the matmul rate where it was measured at the model's widths (llmc.quant.forward_probe)."""
    forward = forward_seconds(2 * tokens * layer_params * active, 2 * tokens * seq_len * attn_width,
                              compute=compute, device=device, width=width, rows=batch_tokens, efficiency=efficiency)
    read = read_seconds(stored_bytes) if machine is None else source_read_seconds(stored_bytes, machine,
                                                                                   converted_bytes)
    return {"read": read, "forward": passes * forward,
            "quantize": layer_params / quantize_rate(weights, compute, elements=largest_linear, device=device),
            "write": file_write_seconds(layer_params * code_bytes)}  # durable, and hashed for the store's record


def _scale_bytes(spec: TensorSpec) -> float:
    """Bytes of scale per weight a microscaling format's canonical form keeps beside its one-a-byte codes (NVFP4:
    an E4M3 scale per 16, 0.0625); other formats' scales are too few to count here."""
    info = spec.info
    return info.scale_bits / 8 / info.scale_block if info.microscaling else 0.0


def overlap_bytes(layers: int, previous: float, ahead: float) -> tuple[float, float]:
    """What llmc.quant.overlap holds beside the layer computing, (the previous layer's codes being written, the next
    layer's weights read ahead), at the layer where the sum peaks: the first layer has no previous one and the last
    no next, so one decoder layer holds neither and two hold one of them at a time, the larger (layer 0 the next,
    layer 1 the previous); from three layers on, a middle one holds both. One gpt-oss-120b-width layer of 32
    experts counted as a middle one was planned at 6.60 GB, 2.47 GB of it these two, and peaked at 4.98 GB
    (benchmarks/results/gptoss_full_width.jsonl)."""
    if layers <= 1:
        return 0.0, 0.0
    if layers == 2:
        return (previous, 0.0) if previous >= ahead else (0.0, ahead)
    return previous, ahead


def quantize_cost(shape: Shape, loop: LayerLoopPlan, pipe: AlgorithmSteps, *, compute: str, stored_elem: int,
                  machine: Machine, code_bytes: float = 1.0) -> CostRow:
    """Calibration + quantization of one scheme (llmc.quant.stream), on the CPU or one GPU, as `loop` decided it
    (llmc.quant.loop_plan): where the activations live (two copies in memory or on the GPU, one batch when
    spilled, none when statistics are reused), the data flow's forward passes (`DataFlow.forward_passes`), the
    smoothing pairs traced first in float64. What the algorithm costs beside the forwards comes from its `pipe`:
    Hessians, replayed module calls (each module's calibration inputs kept), whole float32 weight copies, a
    search's candidate scales, clipping ranges and clip-search tokens (`AlgorithmSteps.search_cost`)."""
    calibrated, spill, resident = loop.runs_forwards, loop.activations == "disk", loop.activations == "device"
    skeleton = loop.reads_skeleton  # the weights outside the layers, read before the first layer
    tokens, seq_len, batch = loop.facts.windows * loop.facts.seq_len, loop.facts.seq_len, loop.batch_size
    passes = FLOWS[loop.flow].forward_passes(pipe, loop)
    hessians, replays_module_calls = pipe.observes_hessians, pipe.replays_module_calls
    whole_weight_copies, discovers_pairs = pipe.copies_whole_weights, loop.traces_structure
    search, weights = pipe.search_cost, pipe.scheme.weights
    e = BYTES[compute]
    # a layer's weights as read: a 16-bit float source widened into a wider compute dtype as it is read, else as
    # stored (then converted beside its clone by materialize) (llmc.model.checkpoint.widened)
    as_read = read_elem(stored_elem, e)
    h, layer = shape.hidden, shape.layer_params
    on_gpu = machine.device != "cpu"
    copy = tokens * h * e  # one copy of the activations passed between layers
    # expert by expert (llmc.quant.expert_stream): the layer without its routed experts, and one expert, at a time
    by_expert = loop.expert_stream and shape.routed_params > 0
    layer_less_experts = layer - shape.routed_params if by_expert else layer
    held = layer_less_experts + shape.expert_params if by_expert else layer
    # the experts' stored codes copied (llmc.quant.loop_plan.decide_experts_kept): never read as weights, decoded or
    # quantized; the layer holds its other weights and everyone's codes
    copied = loop.facts.source_codes if loop.experts_kept else None
    unread = copied.expert_params if copied is not None else 0
    act = (2 * batch * seq_len * h * e if spill else copy if resident else 2 * copy) if calibrated else 0
    forward = batch * seq_len * (4 * h + 3 * shape.intermediate) * e
    if not on_gpu:  # the CPU's attention materializes its scores; a GPU's SDPA (flash, memory-efficient) does not
        forward += batch * shape.heads * seq_len ** 2 * e
    algorithm = 0.0
    if hessians:  # float32 Hessians of the distinct inputs + the float64 inverse factor of the widest
        algorithm += 4 * (2 * h * h + shape.attn_width ** 2 + shape.widest_input ** 2) + 16 * shape.widest_input ** 2
    if replays_module_calls:  # every module's calibration inputs, kept for the grid search
        algorithm += tokens * (2 * h + shape.attn_width + shape.intermediate) * e
    if search:  # the down projection's search through its inputs' float32 Gram matrix, and its ΔW, ΔW·G
        algorithm += 4 * shape.intermediate ** 2 + 2 * 4 * shape.largest_linear
    # the skeleton's weights outside the layers, calibrating: an untied output head is left unread (the calibration
    # forward stops at the first layer)
    skeleton_params = shape.outer_params - shape.head_params
    # ... its lookup tables kept as stored, the rest converted to the compute dtype (materialize_skeleton)
    converted_params = skeleton_params - min(shape.gathered_params, skeleton_params)
    parts = {
        "process": PROCESS_BYTES,
        "outer weights": (converted_params * e + (skeleton_params - converted_params) * stored_elem
                          if skeleton else 0.0),
        "layer": (held - unread) * e,  # (a clone in the stored dtype is gone once converted: `conversion`, below)
        # the quantizer works a block of rows at a time; Hessian-based and smoothing algorithms make float32 copies
        # of a whole Linear
        "quantizer float32 copy": 2 * 4 * (shape.largest_linear if whole_weight_copies
                                           else min(shape.largest_linear, BLOCK_ELEMENTS))
        if copied is None or copied.other_quantized_params else 0.0,
        "layer codes": held * code_bytes,
        "activations": act,
        # expert by expert: each MoE block's inputs and routing, and its summed outputs, kept for every batch
        "expert calls kept": 2 * copy if by_expert and calibrated else 0.0,
        "forward temporaries": forward if calibrated else 0.0,
        "algorithm state": algorithm,
    }
    gpu = 0.0
    if on_gpu:  # the layer, its float32 copies, one batch and the algorithm state live on the GPU
        gpu = (CUDA_CONTEXT_BYTES + held * e + parts["quantizer float32 copy"]
               + (2 * copy if resident else 2 * batch * seq_len * h * e) + parts["forward temporaries"] + algorithm)
        for k in ("quantizer float32 copy", "forward temporaries", "algorithm state"):
            parts[k] = 0.0
    # safetensors before 0.6 serializes a file's tensors in memory; a file of DIRECT_MIN_BYTES or more goes through
    # direct_io's bounce buffer of CHUNK_BYTES instead
    parts["layer file being written"] = (layer * code_bytes if layer * code_bytes < DIRECT_MIN_BYTES and not by_expert
                                         else CHUNK_BYTES)  # (expert by expert: streamed from the spilled experts)
    # llmc.quant.overlap: the previous layer's codes, held by the writer while this layer computes, and the next
    # layer's weights (as read), read while this layer computes; one layer each at most
    parts["previous layer being written"], parts["next layer read ahead"] = overlap_bytes(
        shape.layers, layer_less_experts * code_bytes, (layer_less_experts - unread) * as_read)
    # The skeleton's copy (calibrating only) is made from clones in the stored dtype (CheckpointReader.get_many),
    # converted beside them by materialize (6 bytes a weight from bf16 to float32), except the lookup tables, kept
    # as cloned (a 7B's 152k-row bf16 embedding: 2 bytes a weight, not 6). The last step reads everything outside
    # the layers again (rest.safetensors), the skeleton's copy released first
    # (docs/planner-constants.md#outer-weights-copy), and writes it in the dtype it is kept in
    # (llmc.model.dtype.kept_dtype: the source's, unless wider than the compute dtype): a second copy only where it
    # is converted. It is written one tensor at a time straight from the mapped file (store.
    # atomic_save_safetensors_streamed, CheckpointReader.mapped): the page cache's pages, no copy, so only the
    # largest converted one is new memory, the embedding or the head (the whole of them was counted until the plan
    # caught up with the streamed write: gpt-oss-120b widths, 4 experts, planned 2.77 GB, RssAnon 1.59 GB; each was
    # cloned until 2026-12-04).
    kept = kept_elem(stored_elem, compute)
    skeleton_peak = (converted_params * (e + (stored_elem if stored_elem != e else 0))
                     + (skeleton_params - converted_params) * stored_elem) if skeleton else 0.0
    largest_outer = min(shape.outer_params, max(shape.vocab * h, shape.head_params))
    rest_peak = largest_outer * kept if kept != stored_elem else 0.0
    outer_peak = PROCESS_BYTES + max(skeleton_peak, rest_peak)
    # while a layer is converted from its clone in the stored dtype (read as stored, not widened), before any of its
    # compute's parts exist
    conversion = (sum(parts[k] for k in ("process", "outer weights", "layer", "previous layer being written",
                                         "next layer read ahead", "activations"))
                  + (held * as_read if as_read != e else 0))
    host = max(sum(parts.values()), conversion, outer_peak)
    discovery = discovery_s = 0.0
    if discovers_pairs:
        # the first layer in float64 (its own dtype released) and, while a candidate pair is checked, its rescaled
        # consumers beside the originals: gate and up (two of the largest Linears), or for MoE every expert's gate
        # and up (about two thirds of the layer)
        pair = max(2 * shape.largest_linear, 2 / 3 * layer if shape.active < 1 else 0.0)
        discovery = 8 * (layer + pair)
        discovery_s = 8 * layer / DISCOVERY_RATE  # measured on the CPU: on a GPU, an upper bound
        if on_gpu:  # the layer is on the GPU when it is traced
            gpu = max(gpu, CUDA_CONTEXT_BYTES + discovery + parts["activations"])
        else:
            # (layer 1's weights are being read ahead meanwhile: llmc.quant.overlap)
            host = max(host, PROCESS_BYTES + parts["outer weights"] + parts["activations"] + discovery
                       + parts["next layer read ahead"])
    # time: each layer's parts (llmc.quant.stream's loop) times the depth, plus reading the weights outside the
    # layers (twice when calibrating: the skeleton's copy, then rest.safetensors') and writing their copy once
    # a quantized original: its codes and scales are read (not stored_elem bytes a weight), then decoded at its
    # decoder's probed rate (llmc.model.source_formats.decode_rate)
    parts_s = layer_seconds(layer, stored_bytes=shape.layer_stored_bytes or layer * stored_elem,
                            converted_bytes=widened_bytes(layer, stored_elem, e, shape.layer_decoded),
                            tokens=tokens if calibrated else 0,
                            passes=passes, active=shape.active, compute=compute, code_bytes=code_bytes,
                            device=machine.device, width=h, seq_len=seq_len, attn_width=shape.attn_width,
                            batch_tokens=batch * seq_len, largest_linear=shape.largest_linear, weights=weights,
                            machine=machine,
                            efficiency=measured_efficiency(shape, batch=batch, seq_len=seq_len, compute=compute,
                                                           device=machine.device, observed=True)
                            if calibrated else None)
    # On a GPU the layer's read and its file's write run on host threads while the GPU computes (llmc.quant.overlap):
    # the slower of the two. On a CPU the writer shares the cores and the memory bandwidth with the compute.
    if copied is not None:
        # the experts' stored codes and scales read (`read`), unpacked and written (`write`): no decode, and the
        # quantizer only for the layer's other quantized Linears (llmc.quant.mxfp4_source.pass_through_layer_codes)
        if copied.other_quantized_params:
            parts_s["quantize"] = copied.other_quantized_params / quantize_rate(
                weights, compute, elements=shape.largest_linear, device=machine.device)
        else:
            del parts_s["quantize"]
        if shape.source_format is not None and shape.layer_decoded > unread:
            parts_s["decode"] = (shape.layer_decoded - unread) / decode_rate(shape.source_format)
        parts_s["mxfp4 codes copied"] = passed_through_seconds(unread)
    elif shape.source_format is not None and shape.layer_decoded:
        parts_s["decode"] = shape.layer_decoded / decode_rate(shape.source_format)
        # an MXFP4 original's expert codes checked, unpacked and cast (or passed through) after the quantizer's
        # own pass (llmc.quant.mxfp4_source.keep_layer_codes)
        kept_s = kept_codes_seconds(shape.source_format, weights, shape.routed_params)
        if kept_s:
            parts_s["mxfp4 codes kept"] = kept_s
    if spill and calibrated:  # each layer's outputs written to disk, fsynced and read back by the next layer
        parts_s["spill"] = spill_seconds(copy)
    if by_expert:  # each expert's codes spilled and read back into the layer file; the batches run again without
        # the routed experts for the next layer's inputs
        parts_s["expert spill"] = spill_seconds(shape.routed_params * (code_bytes + _scale_bytes(weights)))
        parts_s["forward again"] = forward_seconds(2 * tokens * layer_less_experts,
                                                   2 * tokens * seq_len * shape.attn_width,
                                                   compute=compute, device=machine.device, width=h,
                                                   rows=batch * seq_len) if calibrated else 0.0
    if not on_gpu:  # the stream's own work per layer: its durable files, heap trims, hooks (llmc.quant.stream_probe)
        parts_s["stream overhead"] = layer_overhead_seconds(calibrated, compute)
    if hessians:  # the column loop in float32: about in² · out per Linear
        fp32_rate = matmul_rate("float32", machine.device, shape.widest_input, 128)
        parts_s["hessian column loop"] = 2 * shape.widest_input * shape.largest_linear * 4 / (
            fp32_rate * forward_efficiency("float32", machine.device))
    if search:
        # Each mapping's candidate scales fake-quantize its consumers (every Linear but o_proj, about); a lone Linear
        # (up -> down) is scored on its input rows where they are fewer than its input channels (out x in x tokens
        # per candidate), else through its Gram matrix (out x in²); the clip search fake-quantizes every Linear but q
        # and k once per clipping range and scores each group against its sampled rows or, where they outnumber the
        # group's columns, the group's Gram matrix (llmc.quant.algorithms.awq; docs/planner-constants.md#fake_quant_cost)
        evaluations, clip_iterations, clip_tokens = search
        searched = layer - h * shape.attn_width
        down = (layer - 2 * h * shape.attn_width) / 3  # a third of the layer less q and o: the MLP's down
        fake_rate = quantize_rate(weights, compute, elements=shape.largest_linear,
                                  device=machine.device) / FAKE_QUANT_COST
        fp32_rate = matmul_rate("float32", machine.device, shape.intermediate, 128)
        lone = min(tokens, shape.intermediate) if loop.facts.ranks <= 1 else shape.intermediate  # torchrun: Gram
        group = weights.group_size or shape.widest_input
        parts_s["scale search"] = evaluations * (searched / fake_rate + 2 * down * lone / fp32_rate)
        parts_s["clip search"] = clip_iterations * (searched / fake_rate
                                                    + 2 * min(tokens, clip_tokens, group) * searched / fp32_rate)
    if on_gpu:  # the slower of the host's reads and writes and the GPU's work, then what runs after both
        io = (parts_s["read"] + parts_s.get("decode", 0.0) + parts_s["write"] + parts_s.get("spill", 0.0)
              + parts_s.get("expert spill", 0.0))
        compute_s = parts_s["forward"] + parts_s.get("forward again", 0.0) + parts_s.get("quantize", 0.0)
        per_layer = max(io, compute_s)
        for name in _AFTER_THE_OVERLAP:
            per_layer += parts_s.get(name, 0.0)
    else:  # the parts one after the other: layer_parts sums to layer_seconds
        per_layer = sum(parts_s.values())
    # calibrating, the skeleton's copy is read first and, but for its lookup tables, converted into new tensors of
    # the compute dtype (its untied head is not read, benchmarks/results/planner-log.md)
    converted = e if e != stored_elem else 0
    skeleton_s = (source_read_seconds(skeleton_params * stored_elem + converted_params * converted, machine)
                  if skeleton else 0.0)
    # every file of the canonical form is hashed for the store's record: counted with its write (file_write_seconds)
    fixed = (source_read_seconds(shape.outer_params * stored_elem, machine)
             + file_write_seconds(shape.outer_params * kept) + skeleton_s + discovery_s)
    strategy = {"disk": "activations spilled to disk", "device": "activations on the GPU",
                "memory": "activations in memory"}.get(loop.activations, "no calibration")
    if loop.flow == "shared-statistics":
        strategy = "statistics shared"
    why = loop.describe() or "weights only: no forward pass"
    if loop.activations != "none":
        why += f"; {kill_loss(loop.resume_every_s, per_layer, shape.layers)}"
    if by_expert:
        one = shape.expert_params * (e + code_bytes + stored_elem)
        why += (f"; per expert: {one / GB:.2f} GB read, quantized and spilled at a time, "
                f"~{per_layer * shape.expert_params / max(layer, 1):.1f} s; per MoE layer "
                f"{shape.routed_params * (code_bytes + _scale_bytes(weights)) / GB:.1f} GB of expert codes and "
                "scales spilled to disk beside the output (removed as the layer file is written)")
    if discovery:
        why += (f"; the first layer's smoothing pairs are found in float64 ({discovery / GB:.1f} GB on the "
                f"{'GPU' if on_gpu else 'host'}, ~{discovery_s:.0f} s)")
    # the largest layer's time, each smaller layer's in proportion to its parameters (benchmarks/results/
    # deepseek_full_width.md: a dense first layer priced as the MoE one put the stage at +83% to +102%)
    layers = shape.layers * shape.layer_share
    return CostRow("quantize", machine.device, host, gpu, 0.0, per_layer * layers + fixed, strategy, why, parts,
                   mapped_bytes=held * stored_elem, layer_seconds=per_layer, fixed_seconds=fixed,
                   layer_parts=parts_s)
