"""Quantize a model one decoder layer at a time.

Peak memory is one decoder layer plus the calibration activations, whatever the depth: the model
is built on the meta device (`llmc.model.skeleton`), and each layer's weights are read from the safetensors
checkpoint, calibrated, quantized, written, and dropped before the next layer is read.

How the calibration data moves through the layers is a data flow (`llmc.quant.flows`), chosen from the scheme's
pipeline and what fits: none (data-free), statistics an earlier scheme recorded (shared-statistics), each layer's
outputs passed on to the next (sequential: original weights for RTN, as ModelOpt does; the already-quantized layer
for SmoothQuant/AWQ/GPTQ, as llm-compressor's sequential pipeline does), or GPTQ quantizing each Linear inside the
forward that makes the next layer's inputs (true-sequential). Per layer this loop materializes it, lets the flow
observe and transform it, quantizes what the flow left (RTN/GPTQ), writes it, lets the flow pass its outputs on.

The activations passed between layers stay in memory (on a GPU, on the GPU when two copies fit a quarter of its free
memory) or, when they would not fit, spill to disk one batch per file (`llmc.quant.activations`; recipe key
`calibration.spill_activations`).

Resume: after each layer its file is written atomically and, at each resume point, the next layer's inputs
(`state/inputs-<i+1>/`) and then `progress.json`; a rerun in the same work directory continues at `progress.json`'s
layer from that layer's saved inputs. Every layer is a resume point, except when the activations stay on the GPU
(`StreamOptions.resume_every_s`: one a minute by default there, since writing a layer's outputs takes longer than
computing it). These writes run on one background thread while the next layer computes, and the next layer's weights
are read while this one computes (`llmc.quant.overlap`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from llmc import distributed
from llmc.errors import RecipeError
from llmc.model.checkpoint import INDEX_FILE, CheckpointReader
from llmc.model.confine import source_file
from llmc.model.dtype import kept_dtype
from llmc.model.families import check_kv_cache, kept_in_dtype, unloaded_layers_note
from llmc.model.skeleton import (HOST, build_skeleton, capture_layer_inputs, decoder_layers, layer_output, materialize,
                                 materialize_skeleton, output_head_names, release, to_device)
from llmc.model.source import TOKENIZER_FILES, ModelSource
from llmc.model.source_formats import canonical_fp8_scale, decode, fp8_strategy
from llmc.model.tokenizer_files import copy_tokenizer_file
from llmc.planning.machine import memory_available
from llmc.telemetry.progress import log, steps
from llmc.quant import expert_stream, fisher, int_source, moe, mxfp4_source, runtime_scales
from llmc.quant.activations import Activations, ActivationWriter, SpillMode, inputs_dir
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.canonical import FORMAT_NAME, FORMAT_VERSION, META_FILE, module_matches
from llmc.quant.flows import FLOWS, DataFlow, LayerWork, Stream
from llmc.quant.loop_plan import (ExpertMode, LayerLoopPlan, LoopFacts, SourceCodes, config_widths,
                                  decide_layer_loop, experts_streamable, redecided)
from llmc.quant.numerics import QuantizedWeight, input_scale_name, quantize_weights, static_scale
from llmc.quant.observe import RANGES_ONLY, LayerStats, forward_batches, observe_batches, observing
from llmc.quant.overlap import LayerWriter, Prefetcher, on_host
from llmc.quant.shared_stats import SharedStats
from llmc.quant.groups import resolve as resolve_groups
from llmc.quant.spec import Scheme
from llmc.storage.store import atomic_save_safetensors, atomic_save_safetensors_streamed, atomic_write_json

CALIBRATION_BATCH_SIZE = 4  # windows per calibration forward


def target_linears(layer: nn.Module, prefix: str, ignore: tuple[str, ...]) -> dict[str, nn.Linear]:
    routers = moe.layer_routers(layer)  # MoE routers stay in high precision (Llama-4's is an nn.Linear)
    return {
        f"{prefix}{n}": m
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and n not in routers and not module_matches(f"{prefix}{n}", ignore)
    }


# --------------------------------------------------------------------------- main loop


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class Calibration:
    """The calibration windows and how the stream runs them through the layers."""

    tokens: torch.Tensor  # [windows, seq_len] token ids
    # per-sample calibration (right-padded rows, 1 = token): each sample runs as its own batch at its own length, so
    # no padding reaches a layer and no statistic, scale, Hessian or search can see it
    mask: torch.Tensor | None = None
    batch_size: int = CALIBRATION_BATCH_SIZE  # windows per forward
    spill: SpillMode = "auto"  # the activations passed between layers: in memory or on disk (llmc.quant.activations)
    # a folder keyed by (model, calibration data, dtype) where schemes calibrated on original outputs share their
    # statistics (llmc.quant.shared_stats)
    shared_stats: Path | None = None
    # Mixture-of-Experts blocks run every expert on every token for statistics (the layer's output stays the routed
    # one); experts routed fewer than `moe_min_tokens` (default: a tenth of an even share) are named in a warning.
    # Tokens routed per expert: `moe_tokens.json`.
    moe_all_experts: bool = False
    moe_min_tokens: int | None = None
    # a MoE layer's routed experts one at a time (llmc.quant.expert_stream): "auto" where the layer is over half
    # the available memory (llmc.quant.loop_plan.decide_expert_stream); never changes the output
    stream_experts: ExpertMode = "auto"


@dataclass(frozen=True)
class StreamOptions:
    """Where and in what the stream computes, and what it reports."""

    dtype: torch.dtype = torch.float32
    # where each layer is calibrated and quantized (one layer and one batch of activations at a time live there; the
    # activations passed between layers, the embeddings and the files stay on the host)
    device: torch.device | str = "cpu"
    extra_meta: Mapping[str, object] | None = None  # entries added to quantized.json
    # called with each layer's index once it is durable (with `overlap`: on the writer's thread)
    on_layer_done: Callable[[int], None] | None = None
    # each layer's writes run while the next layer computes, and its weights are read while the previous one
    # computes (llmc.quant.overlap); the same files either way. Off under torchrun.
    overlap: bool = True
    # seconds between resume points (the next layer's inputs saved, progress moved); None: after every layer, or
    # every loop_plan.RESIDENT_RESUME_EVERY_S when the activations stay on the GPU. The files are the same either way.
    resume_every_s: float | None = None
    # the layer loop's decision as the plan made it (llmc.quant.loop_plan); None: decided when the stream starts
    loop: LayerLoopPlan | None = None


@dataclass
class StreamResult:
    layers: int
    quantized_modules: int
    calibrated: bool
    loop: LayerLoopPlan  # the decision the loop obeyed


def quantize_model(source: ModelSource, scheme: Scheme, out: Path, calibration: Calibration | None,
                   options: StreamOptions = StreamOptions()) -> StreamResult:
    """Write the canonical quantized form of `source` under `out` (resumable, see module doc), calibrated on
    `calibration`'s windows (None: a scheme that does not calibrate), as `options.loop` decided (None: decided here,
    by the same `decide_layer_loop`)."""
    cal, dtype, device = calibration, options.dtype, torch.device(options.device)
    torch.manual_seed(0)
    m = _open_model(source, scheme, dtype)
    (out / "layers").mkdir(parents=True, exist_ok=True)
    state_dir = out / "state"
    progress_file = state_dir / "progress.json"
    start = _resume_layer(progress_file)
    if start:
        log(f"resuming quantization at layer {start}/{m.n_layers}")
    windows, mask = _calibration_windows(scheme, cal, m)
    shared = (SharedStats(cal.shared_stats, m.n_layers) if cal is not None and cal.shared_stats else None)
    pipeline = AlgorithmSteps.of(scheme)
    loop = _obeyed(options.loop, pipeline, loop_facts(scheme, cal, windows, mask, m.config, dtype, device,
                                                      bool(m.moe_blocks), shared, m.all_linears, m.all_kv,
                                                      options.resume_every_s, m.largest_layer_params,
                                                      m.source_codes(scheme)))
    shared = shared if loop.shared != "none" else None
    m.pipelines = ({g: AlgorithmSteps.of(member) for g, member in scheme.members().items()} if scheme.mixed
                   else {"": pipeline})
    moe_report = moe.TokenReport.load(out, cal.moe_all_experts) if m.moe_blocks and scheme.needs_calibration else None
    if loop.reads_skeleton:
        # no name kept for these tensors: release(model) below must free them before the rest is read again; the
        # output head is never run (the forward stops at the first layer)
        unread = output_head_names(m.model)
        materialize_skeleton(m.model, m.reader.get_many([n for n in m.reader.names() if not n.startswith(
            m.layers_prefix + ".") and n not in unread]), dtype)
    structure = LayerStructure(m.model, m.layers, windows) if loop.traces_structure else None
    # Each rank keeps the inputs of its own block of windows (llmc.distributed); one process, state/ as before.
    act_dir = state_dir / f"rank-{distributed.rank()}" if distributed.active() else state_dir
    s = Stream(m.model, m.layers, pipeline, dtype, device, loop.batch_size, act_dir, start,
               spill=loop.activations == "disk", resident=loop.activations == "device", one_forward=loop.one_forward,
               moe_all_experts=cal is not None and cal.moe_all_experts, shared=shared, specs=m.specs(scheme),
               exact_stats=distributed.active() and bool(m.moe_blocks))
    flow = FLOWS[loop.flow]()
    flow.prepare(s, windows, mask)
    loop_state = _LoopState(out, progress_file, act_dir, options, saved=s.start, loop=loop)
    # a family whose Hub checkpoints hold fused experts (gpt-oss): split per expert as each layer is read
    layout = moe.layout_of(m.config) if m.moe_blocks else None
    weights = Prefetcher(lambda j: _layer_checkpoint_tensors(m.reader, f"{m.layers_prefix}.{j}.", layout, dtype,
                                                             loop.expert_stream, not loop.experts_kept),
                         range(s.start, m.n_layers), loop_state.overlap)
    for i in steps(range(m.n_layers), "quantize layers", total=m.n_layers):
        w = m.layer_work(i, scheme)
        if i >= s.start:
            by_expert = loop.expert_stream and any(True for _ in moe.routed_blocks(w.module))
            (_quantize_layer_by_expert if by_expert else _quantize_layer)(s, flow, w, m, weights.take(i), structure,
                                                                          moe_report, cal, windows, loop_state)
            loop_state.commit(i, i == m.n_layers - 1, w.next_inputs, loop.resume_every_s)
            release(w.module)
    loop_state.writer.close()
    weights.close()
    if m.passed_through:
        log(f"{m.passed_through} Linear(s) kept the codes and scales of the {m.reader.source_format.describe()} "
            "source, bit for bit (their target format is the source's)")
    if m.mxfp4_kept.describe():
        log(m.mxfp4_kept.describe())
    if m.int_kept.describe():
        log(m.int_kept.describe())
    release(m.model)  # the skeleton's embeddings and head: read again below, so never two copies
    # (docs/planner-constants.md#outer-weights-copy)
    distributed.barrier()
    if distributed.is_main():  # rank 0 writes the rest and removes the state (every rank is done with it)
        entries = {"moe": moe.canonical_entry(m.model, m.moe_blocks, moe_report)} if m.moe_blocks else {}
        if scheme.mixed:  # the Linears an `ignore: true` group leaves unquantized: exporters name them (ignore lists)
            entries["unquantized_modules"] = sorted(n for n, g in m.group_of.items() if g is None)
        # the stream quantizes Linears of the decoder layers only: every other one (an output head, Gemma-4's
        # per_layer_model_projection) stays in its dtype, and quantized.json says so for the exporters' configs
        entries["unquantized_linears"] = sorted(set(m.every_linear) - set(m.modules))
        _write_rest(out, source, m.reader, scheme, m.config, dtype, m.layers_prefix, m.n_layers, m.modules,
                    m.kv_names, {**entries, "layer_loop": loop.as_dict(), **(options.extra_meta or {})})
        if shared is not None and loop.shared == "record":
            shared.finish(m.all_linears, m.all_kv)
        shutil.rmtree(state_dir, ignore_errors=True)
    return StreamResult(layers=m.n_layers, quantized_modules=len(m.modules), calibrated=scheme.needs_calibration,
                        loop=loop)


LayerMeasure = Callable[[int, nn.Module, dict[str, nn.Linear], Activations, list, Activations, LayerStats,
                         "list[torch.Tensor] | None"], None]


def measure_model(source: ModelSource, scheme: Scheme, calibration: Calibration, work: Path, measure: LayerMeasure,
                  options: StreamOptions = StreamOptions(), gradients: bool = False) -> int:
    """The calibration pass of the layer stream, with each resident layer handed to `measure` (quantization.search):
    `measure(index, layer, its Linears, its original inputs, its call arguments, its original outputs, its observed
    statistics, the loss gradient at its outputs or None)`. The statistics later schemes share (ranges, KV) are
    recorded into `calibration.shared_stats` as a calibrating scheme records them, so the quantize stage of the
    chosen mix runs no calibration forward of its own. Nothing is quantized or written but those statistics; the
    activations stay in memory (or spill, as the recipe says) under `work`. With `gradients` (the fisher proxy,
    `llmc.quant.fisher`) every layer's inputs are kept, and the layers are measured in a second pass from the last
    back, each read again and its backward carrying the gradient to the one before. Returns the number of layers."""
    if distributed.active():
        raise RecipeError("quantization.search measures in one process in this llmc version",
                          fix="build without --nproc / torchrun")
    dtype, device = options.dtype, torch.device(options.device)
    observing = replace(scheme, algorithm="rtn", algorithm_options=(), groups=())  # ranges, original outputs
    m = _open_model(source, observing, dtype)
    pipeline = AlgorithmSteps.of(observing)
    shared = SharedStats(calibration.shared_stats, m.n_layers) if calibration.shared_stats else None
    facts = loop_facts(observing, calibration, calibration.tokens, calibration.mask, m.config, dtype, device,
                       bool(m.moe_blocks), None, m.all_linears, m.all_kv, None)
    loop = decide_layer_loop(pipeline, measurement_facts(facts, m.n_layers, gradients))
    unread = output_head_names(m.model)
    materialize_skeleton(m.model, m.reader.get_many([n for n in m.reader.names()
                                                     if not n.startswith(m.layers_prefix + ".") and n not in unread]),
                         dtype)
    s = Stream(m.model, m.layers, pipeline, dtype, device, loop.batch_size, work, 0, spill=loop.activations == "disk",
               resident=loop.activations == "device", one_forward=False, moe_all_experts=calibration.moe_all_experts,
               shared=shared)
    flow = FLOWS["sequential"]()
    flow.prepare(s, calibration.tokens, calibration.mask)
    kept: dict[int, tuple[Activations, list, LayerStats]] = {}  # with gradients: each layer's inputs until measured
    for i in steps(range(m.n_layers), "search: measure layers" if not gradients else "search: forward",
                   total=m.n_layers):
        w = m.layer_work(i, observing)
        materialize(w.module, m.reader.with_prefix(f"{m.layers_prefix}.{i}.", dtype), dtype)
        w.module.to(device)
        w.extras = to_device([e[i] for e in s.extras], device)
        inputs = s.hidden
        flow.calibrate(s, w)  # ranges observed (and shared), the original outputs collected
        flow.propagate(s, w)  # s.hidden: this layer's original outputs, the next layer's inputs
        if gradients:
            kept[i] = (inputs, w.extras, w.stats)
        else:
            measure(i, w.module, w.linears, inputs, w.extras, s.hidden, w.stats, None)
            shutil.rmtree(inputs_dir(work, i), ignore_errors=True)  # spilled: one layer's inputs on disk at a time
        release(w.module)
    if gradients:
        _measure_backward(m, observing, s.hidden, kept, measure, dtype, device, work)
    release(m.model)
    if shared is not None:
        shared.finish(m.all_linears, m.all_kv)
    shutil.rmtree(work, ignore_errors=True)
    return m.n_layers


def measurement_facts(facts: LoopFacts, layers: int, gradients: bool) -> LoopFacts:
    """The facts `measure_model`'s layer loop is decided on (and the plan's cost of it, llmc.pipeline.quantize): where
    the activations live, as any pass decides it; with gradients every layer's inputs wait for the second pass (and
    its gradients, outputs and the previous layer's gradients join them): decided on that many copies."""
    copies = layers + 3 if gradients else 2
    return replace(facts, calibrates=True, windows=-(-facts.windows * copies // 2))


def _measure_backward(m: _Model, observing: Scheme, last: Activations,
                      kept: dict[int, tuple[Activations, list, LayerStats]], measure: LayerMeasure,
                      dtype: torch.dtype, device: torch.device, work: Path) -> None:
    """measure_model's second pass with gradients: the gradient at the last layer's outputs from the final norm and
    the output head, then each layer from the last back read again, measured with the gradient at its outputs, and
    its backward giving the gradient at the previous layer's."""
    head = m.model.get_output_embeddings()
    if head is None:
        raise RecipeError(f"quantization.search's fisher proxy needs the output head, and {type(m.model).__name__} "
                          "has none", fix="use `proxy: output` for this model")
    stored = set(m.reader.names())
    materialize(m.model, m.reader.get_many(sorted(n for n in output_head_names(m.model) if n in stored)), dtype)
    if head.weight.is_meta:  # tied: the checkpoint keeps the embedding's table only (as stored: materialize_skeleton)
        table = m.model.get_input_embeddings().weight
        head.weight = table if table.dtype == dtype else nn.Parameter(table.to(dtype), requires_grad=False)
    norm = fisher.final_norm(m.model, m.layers_prefix)
    head.to(device)
    norm.to(device)
    softcap = m.config.get("final_logit_softcapping") or m.config.get("text_config", {}).get("final_logit_softcapping")
    grads = fisher.head_gradients(norm, head, last, device, softcap)
    for i in steps(reversed(range(m.n_layers)), "search: measure layers (backward)", total=m.n_layers):
        inputs, extras, stats = kept.pop(i)
        w = m.layer_work(i, observing)
        materialize(w.module, m.reader.with_prefix(f"{m.layers_prefix}.{i}.", dtype), dtype)
        w.module.to(device)
        outputs, back = fisher.layer_backward(w.module, inputs, extras, grads, device)
        measure(i, w.module, w.linears, inputs, extras, Activations(outputs), stats, grads)
        grads = back
        release(w.module)
        shutil.rmtree(inputs_dir(work, i), ignore_errors=True)


def loop_facts(scheme: Scheme, cal: Calibration | None, windows: torch.Tensor | None, mask: torch.Tensor | None,
               config: dict, dtype: torch.dtype, device: torch.device, moe_blocks: bool,
               shared: SharedStats | None, linears: set[str], kv: set[str],
               resume_every_s: float | None, layer_params: int = 0,
               source_codes: SourceCodes | None = None) -> LoopFacts:
    """The facts the layer loop is decided on, as the stream sees them when it starts."""
    return LoopFacts(
        calibrates=scheme.needs_calibration, windows=0 if windows is None else windows.shape[0],
        seq_len=0 if windows is None else windows.shape[1], masked=mask is not None,
        batch_size=cal.batch_size if cal is not None else CALIBRATION_BATCH_SIZE,
        spill_mode=cal.spill if cal is not None else "auto", **config_widths(config), elem=torch.empty(0, dtype=dtype).element_size(), moe=moe_blocks, device=str(device),
        host_available=memory_available(), device_free=_device_free(device), shared_stats=shared is not None,
        shared_covered=shared is not None and shared.covers(linears, kv), resume_every_s=resume_every_s,
        ranks=distributed.size(), layer_bytes=layer_params * torch.empty(0, dtype=dtype).element_size(),
        experts_streamable=moe_blocks and experts_streamable(config),
        stream_experts=cal.stream_experts if cal is not None else "auto", source_codes=source_codes)


def _obeyed(planned: LayerLoopPlan | None, pipeline: AlgorithmSteps, now: LoopFacts) -> LayerLoopPlan:
    """The plan's decision; decided again (and said so) only where the facts moved materially since it was made."""
    if planned is None:
        loop = decide_layer_loop(pipeline, now)
    else:
        loop, changes = redecided(planned, now, pipeline)
        if changes:
            log(f"the layer loop is decided again ({'; '.join(changes)}): {planned.as_dict()} -> {loop.as_dict()}")
    if loop.runs_forwards:
        log(f"layer loop: {loop.flow}, activations in {loop.activations}; {loop.describe()}")
    return loop


def _calibration_windows(scheme: Scheme, cal: Calibration | None, m: _Model):
    """This process's calibration windows and mask (its block of them under torchrun)."""
    if not scheme.needs_calibration:
        return None, None
    if cal is None:
        raise ValueError("this scheme needs calibration data")
    if not distributed.active():
        return cal.tokens, cal.mask
    if m.moe_blocks:
        check_moe_ranks(scheme, distributed.size())
    return _my_windows(cal.tokens, cal.mask, cal.batch_size)


def check_moe_ranks(scheme: Scheme, ranks: int) -> None:
    """RecipeError for a Mixture-of-Experts calibration over several ranks that llmc does not combine: AWQ's search
    decides per expert whether it has inputs, which differs by rank (the plan refuses it first)."""
    if ranks > 1 and any(AlgorithmSteps.of(member).replays_module_calls for member in scheme.members().values()):
        raise RecipeError(f"{scheme.name}: a search over each module's replayed inputs (AWQ) on a Mixture-of-Experts "
                          f"model over {ranks} processes is not implemented: an expert's routed inputs differ by rank",
                          fix="calibrate AWQ in one process (no --nproc), or use GPTQ / SmoothQuant / RTN on the ranks")


@dataclass
class _Model:
    """The checkpoint and its skeleton as the loop walks them, with the Linears each scheme group quantizes."""

    reader: CheckpointReader
    config: dict
    model: nn.Module
    moe_blocks: list[str]
    layers_prefix: str
    layers: nn.ModuleList
    all_linears: set[str]
    all_kv: set[str]
    group_of: dict[str, str | None]  # Linear -> its group ("" unmixed; None: left unquantized)
    every_linear: list[str]  # every Linear of the model, inside the decoder layers or not
    passed_through: int = 0  # Linears that kept their quantized original's codes (_pass_through_source_codes)
    mxfp4_kept: mxfp4_source.Kept = field(default_factory=mxfp4_source.Kept)  # an MXFP4 original's expert codes
    int_kept: int_source.Tally = field(default_factory=int_source.Tally)  # an integer original's codes
    modules: dict[str, dict] = field(default_factory=dict)  # quantized.json's modules, as the loop walks them
    pipelines: dict[str, AlgorithmSteps] = field(default_factory=dict)  # each group's (one "" unmixed)
    kv_names: list[str] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def largest_layer_params(self) -> int:
        """The largest decoder layer's parameters (the skeleton's: meta, no memory)."""
        return max((sum(p.numel() for p in layer.parameters()) for layer in self.layers), default=0)

    def source_codes(self, scheme: Scheme) -> SourceCodes | None:
        """`LoopFacts.source_codes` as the skeleton's Linears give it (the plan gives it from config.json's)."""
        fmt = self.reader.source_format
        linears = {n: tuple(mod.weight.shape) for n, mod in self.model.named_modules() if isinstance(mod, nn.Linear)}
        return mxfp4_source.source_codes_fact(fmt.name if fmt is not None else None, scheme, linears, self.n_layers,
                                              self.config.get("model_type"))

    def specs(self, scheme: Scheme) -> dict:
        members = scheme.members()
        return {n: members[g].weights for n, g in self.group_of.items() if g is not None}

    def layer_work(self, i: int, scheme: Scheme) -> LayerWork:
        """Layer i's work, its modules recorded for quantized.json (layers before a resume point too)."""
        prefix = f"{self.layers_prefix}.{i}."
        linears = {n: lin for n, lin in target_linears(self.layers[i], prefix, scheme.ignore).items()
                   if n in self.all_linears}
        w = LayerWork(i, prefix, self.layers[i], linears, _kv_modules(self.layers[i], prefix, scheme), extras=[])
        self.modules.update({name: {"shape": list(lin.weight.shape), "layer": i,
                                    **({"group": self.group_of[name]} if scheme.mixed else {})}
                             for name, lin in w.linears.items()})
        self.kv_names += list(w.kv_modules)
        return w


def _layer_checkpoint_tensors(reader: CheckpointReader, prefix: str, layout, dtype: torch.dtype,
                              without_experts: bool = False, encoded_experts: bool = True) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors (names layer-relative), MoE experts per expert under the Hub projection names, a
    16-bit float read straight into a wider compute `dtype` (CheckpointReader.get_stored's `widen_to`);
    `without_experts`: all but the routed experts' (read one at a time: llmc.quant.expert_stream);
    `encoded_experts=False`: all but the fused expert weights a quantized original stores encoded (their codes pass
    through: llmc.quant.mxfp4_source.pass_through_layer_codes)."""
    if without_experts:
        names = [n for n in reader.names() if n.startswith(prefix)
                 and not expert_stream.is_routed_expert(n[len(prefix):])]
        return {n[len(prefix):]: t for n, t in reader.get_many(names, dtype).items()}
    return (moe.read_layer(reader, prefix, layout, encoded_experts, dtype) if layout is not None
            else reader.with_prefix(prefix, dtype))


def _open_model(source: ModelSource, scheme: Scheme, dtype: torch.dtype) -> _Model:
    reader = CheckpointReader(source.folder, dtype)  # a quantized original decoded straight to the compute dtype
    config = reader.config()
    if scheme.kv_cache is not None:  # the plan refused it; a direct caller is refused here
        check_kv_cache(config)
    unloaded = unloaded_layers_note(config, reader.names())
    if unloaded:
        log(f"note: {unloaded}")
    model = build_skeleton(config, dtype)
    moe_blocks = moe.unfuse_experts(model)  # fused 3-D experts -> per-expert Linears under the Hub names
    layers_prefix, layers = decoder_layers(model)
    all_linears, all_kv = set(), set()
    for i, layer in enumerate(layers):
        # a Linear the family keeps in its dtype (Qwen2-MoE's shared_expert_gate, gated-DeltaNet gate projections:
        # llmc.model.families.KEPT_IN_DTYPE) is never quantized; quantized.json's unquantized_linears names it
        all_linears |= {n for n in target_linears(layer, f"{layers_prefix}.{i}.", scheme.ignore)
                        if not kept_in_dtype(config.get("model_type"), n)}
        all_kv |= set(_kv_modules(layer, f"{layers_prefix}.{i}.", scheme))
    # mixed precision: each Linear's group (None: left unquantized), resolved as the planner did (llmc.quant.groups)
    group_of = (resolve_groups(scheme, sorted(all_linears), len(layers), config.get("model_type")) if scheme.mixed
                else dict.fromkeys(all_linears, ""))
    return _Model(reader, config, model, moe_blocks, layers_prefix, layers,
                  {n for n in all_linears if group_of[n] is not None}, all_kv, group_of,
                  sorted(n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)))


class _LoopState:
    """The loop's writes and resume points: each layer's file on the writer's thread, progress moved at each resume
    point after the layer file and the next layer's inputs are durable."""

    def __init__(self, out: Path, progress_file: Path, act_dir: Path, options: StreamOptions, saved: int,
                 loop: LayerLoopPlan | None = None) -> None:
        self.out, self.progress_file, self.act_dir, self.options = out, progress_file, act_dir, options
        # the loop's decisions: MoE layers expert by expert; the routed experts' encoded weights left unread, their
        # stored codes copied as the layer is written (llmc.quant.loop_plan.decide_experts_kept)
        self.expert_stream = loop is not None and loop.expert_stream
        self.experts_kept = loop is not None and loop.experts_kept
        self.overlap = options.overlap and not distributed.active()  # a job's barriers must not interleave
        self.writer = LayerWriter(self.overlap)
        self.saved, self.saved_at = saved, time.monotonic()  # the layer progress.json points at, and when

    def write_layer(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        self.writer.submit(i, functools.partial(atomic_save_safetensors, self.out / "layers" / f"{i:05d}.safetensors",
                                                tensors))

    def write_layer_parts(self, i: int, parts: expert_stream.LayerParts, resident: dict[str, torch.Tensor]) -> None:
        """Layer i's file from its resident tensors and its experts' spilled ones (llmc.quant.expert_stream)."""
        self.writer.submit(i, functools.partial(parts.write, self.out / "layers" / f"{i:05d}.safetensors", resident))

    def commit(self, i: int, last: bool, next_inputs: ActivationWriter | None, resume_every_s: float) -> None:
        """Progress moves only after the layer file and the next layer's inputs are durable (the writer's order, on
        every rank); a run killed anywhere before that redoes the layers from the last resume point's inputs."""
        if last or time.monotonic() - self.saved_at >= resume_every_s:
            # after the last layer only progress moves: nothing reads the model's last outputs again
            self.writer.submit(i, functools.partial(_commit_layer, i, None if last else next_inputs,
                                                    self.progress_file, self.act_dir, self.saved,
                                                    self.options.on_layer_done))
            self.saved, self.saved_at = i + 1, time.monotonic()
        elif self.options.on_layer_done:
            self.writer.submit(i, functools.partial(self.options.on_layer_done, i))


def _quantize_layer(s: Stream, flow: DataFlow, w: LayerWork, m: _Model, weights, structure: LayerStructure | None,
                    moe_report, cal: Calibration | None, windows: torch.Tensor | None, state: _LoopState) -> None:
    """One decoder layer: materialized, calibrated by the flow, quantized (what the flow left), written, and its
    outputs passed on. `state.experts_kept` (the loop's decision): the routed experts' weights were not read; their
    stored codes are copied instead of quantized."""
    scheme, device = s.pipeline.scheme, s.device
    materialize(w.module, weights, s.dtype)
    kept = [n for n in w.linears if expert_stream.is_routed_expert(n[len(w.prefix):])] if state.experts_kept else []
    if m.moe_blocks:
        moe.check_materialized(w.module, w.prefix, m.reader.folder,
                               lambda n: bool(kept) and n.endswith(".weight") and expert_stream.is_routed_expert(n))
    if kept:  # `.to(device)` for what was read: the kept experts' weights were not
        expert_stream.move_resident(w.module, device)
    else:
        w.module.to(device)
    if structure is not None:
        structure.record(w.index, w.module)
    w.extras = to_device([e[w.index] for e in s.extras], device)
    flow.calibrate(s, w)
    # MoE experts no calibration token reached (never with moe_calibrate_all_experts): RTN weights, and
    # static activation ranges from the layer's other experts (llmc.quant.moe.proxy_input_ranges)
    starved = [] if s.moe_all_experts else moe.starved_linears(w.module, w.prefix, w.routed, w.linears)
    members = scheme.members()
    rounded = {n: lin for n, lin in w.linears.items() if n not in kept}
    w.quantized = _quantized_linears(rounded, w.quantized, starved, m, members, w.stats, device)
    if m.reader.source_format is not None:
        m.passed_through += _pass_through_source_codes(w, m, members)
    if kept:  # copied as stored, never decoded nor quantized (llmc.quant.loop_plan.decide_experts_kept)
        w.quantized.update(mxfp4_source.pass_through_layer_codes(m.reader, w.prefix, moe.layout_of(m.config), kept))
        m.mxfp4_kept.passed_through += len(kept)
    elif m.reader.source_format is not None and m.reader.source_format.name == "mxfp4" and m.moe_blocks:
        # gpt-oss's MXFP4 experts: passed through to an MXFP4 target, cast exactly to NVFP4 (llmc.quant.mxfp4_source)
        m.mxfp4_kept.add(mxfp4_source.keep_layer_codes(
            w.quantized, {n: lin.weight.data for n, lin in w.linears.items()},
            {n: members[m.group_of[n]].weights for n in w.linears}, m.reader, w.prefix, moe.layout_of(m.config)))
    if moe_report is not None and w.routed:
        moe_report.add(w.index, w.prefix, w.routed,
                       moe.proxy_input_ranges(w.stats, starved) if scheme.stores_ranges else {},
                       cal.moe_min_tokens, cal.tokens.numel(), m.config)  # every rank's tokens
    w.stats.module_calls.clear()
    if distributed.is_main():
        schemes = {n: members[m.group_of[n]] for n in w.linears}
        state.write_layer(w.index, on_host(_layer_tensors(w.module, w.prefix, w.linears, w.quantized, w.stats, scheme,
                                                          schemes, w.kv_modules)))
        if moe_report is not None:
            moe_report.save(state.out)
    flow.propagate(s, w)


def _quantize_layer_by_expert(s: Stream, flow: DataFlow, w: LayerWork, m: _Model, weights, structure, moe_report,
                              cal: Calibration | None, windows, state: _LoopState) -> None:
    """One Mixture-of-Experts decoder layer, its routed experts one at a time (llmc.quant.expert_stream): the layer
    read without them, its calibration batches routed once, then each expert read, calibrated on its routed tokens,
    quantized, spilled and dropped; the batches run again for the next layer's inputs. The same file as
    `_quantize_layer` writes."""
    scheme, device, members = s.pipeline.scheme, s.device, s.pipeline.scheme.members()
    materialize(w.module, weights, s.dtype)
    expert_stream.move_resident(w.module, device)
    w.extras = to_device([e[w.index] for e in s.extras], device)
    calibrating = flow.name != "data-free"
    observe = s.pipeline.observe(w.module) if calibrating else RANGES_ONLY
    w.stats = s.new_stats()
    resident = {n: lin for n, lin in w.linears.items() if not expert_stream.is_routed_expert(n[len(w.prefix):])}
    parts = expert_stream.LayerParts(state.act_dir / f"experts-{w.index}")
    schemes = {n: members[m.group_of[n]] for n in w.linears}
    with expert_stream.deferred(w.module) as blocks:
        if calibrating:  # the router once: each block's inputs and routing kept, its experts not run
            with moe.observing_experts(w.module, s.moe_all_experts, w.routed):
                observe_batches(w.module, resident, w.kv_modules, observe, s.hidden, w.extras, w.stats)
        starved = [] if s.moe_all_experts else moe.starved_linears(w.module, w.prefix, w.routed, w.linears)
        for block, d in blocks.items():
            experts = w.module.get_submodule(moe.block_path(block, "experts"))
            for e in steps(range(len(experts)), f"layer {w.index} experts", total=len(experts)):
                _quantize_expert(s, w, m, block, e, experts, d if calibrating else None, observe, starved, members,
                                 schemes, parts)
        w.quantized = _quantized_linears(resident, None, starved, m, members, w.stats, device)
        if m.reader.source_format is not None:
            m.passed_through += _pass_through_source_codes(w, m, members)
        if calibrating:  # the next layer's inputs: the batches again, each block given its experts' summed outputs
            w.next_inputs = s.inputs_writer(w.index + 1)
            for d in blocks.values():
                d.replay()
            with observing(w.module, {}, LayerStats(), w.kv_modules, RANGES_ONLY):  # attention routed as observed
                forward_batches(w.module, s.hidden, w.extras, w.next_inputs.put)
    if moe_report is not None and w.routed:
        moe_report.add(w.index, w.prefix, w.routed,
                       moe.proxy_input_ranges(w.stats, starved) if scheme.stores_ranges else {},
                       cal.moe_min_tokens, cal.tokens.numel(), m.config)
    w.stats.module_calls.clear()
    tensors = _layer_tensors(w.module, w.prefix, resident, w.quantized, w.stats, scheme, schemes, w.kv_modules)
    # each expert's input scales were spilled as its own; the fused-MoE kernels take the max over the layer's experts
    # (llmc.quant.runtime_scales), known only now: those replace the spilled ones
    spilled = {f"{n}.input_scale": static_scale(w.stats.input_absmax[n], schemes[n].activations) for n in w.linears
               if n not in resident and n in w.stats.input_absmax
               and runtime_scales.fp8_static_tensor_acts(schemes[n].activations)}
    unified = runtime_scales.unify_expert_input_scales(spilled, {n: schemes[n].activations for n in w.linears})
    parts.unspill(unified)
    tensors.update(unified)
    state.write_layer_parts(w.index, parts, on_host({n: t for n, t in tensors.items() if not t.is_meta}))
    if moe_report is not None:
        moe_report.save(state.out)
    flow.propagate(s, w)


def _quantize_expert(s: Stream, w: LayerWork, m: _Model, block: str, e: int, experts: nn.Module, d, observe,
                     starved: list[str], members: dict[str, Scheme], schemes: dict[str, Scheme],
                     parts: expert_stream.LayerParts) -> None:
    """Expert e of `block`: read from the checkpoint (its own tensors), run on the kept calls with its Linears
    observed (`d`; None: data-free), quantized, its tensors spilled, its weights dropped."""
    name = moe.block_path(block, f"experts.{e}")
    expert, prefix = experts[e], f"{w.prefix}{name}."
    materialize(expert, m.reader.with_prefix(prefix, s.dtype), s.dtype)
    moe.check_materialized(expert, prefix, m.reader.folder)
    expert.to(s.device)
    linears = {n: lin for n, lin in w.linears.items() if n.startswith(prefix)}
    if d is not None:
        with observing(w.module, linears, w.stats, {}, observe), \
                moe.observing_experts(w.module, s.moe_all_experts, None):
            d.run_expert(experts, e)
    quantized = _quantized_linears(linears, None, starved, m, members, w.stats, s.device)
    if m.reader.source_format is not None:
        one = LayerWork(w.index, prefix, expert, linears, {}, extras=[], quantized=quantized)
        m.passed_through += _pass_through_source_codes(one, m, members)
    parts.spill(f"{name}", on_host(_layer_tensors(expert, prefix, linears, quantized, w.stats, s.pipeline.scheme,
                                                  schemes, {})))
    expert_stream.release_weights(expert)


def _quantized_linears(linears: dict[str, nn.Linear], quantized: dict[str, QuantizedWeight] | None, starved: list[str],
                       m: _Model, members: dict[str, Scheme], stats: LayerStats,
                       device: torch.device) -> dict[str, QuantizedWeight]:
    """Codes of `linears`: what a flow quantized already (`quantized`), else each group's quantizer (one call per
    group, with its group's scheme); starved experts and what is left by round-to-nearest."""
    if quantized is None:
        quantized = {}
        for group in members:
            mine = {n: lin for n, lin in linears.items() if n not in starved and m.group_of[n] == group}
            if mine:
                quantized.update(_quantize_spread(m.pipelines[group], mine, stats, device))
    for group, member in members.items():
        quantized.update(quantize_weights({n: linears[n].weight.data for n in linears
                                           if n not in quantized and m.group_of[n] == group}, member.weights))
    return quantized


def _pass_through_source_codes(w: LayerWork, m: _Model, members: dict) -> int:
    """Where a Linear's target format is its quantized original's own (FP8 128x128 blocks, per channel or per
    tensor, from an FP8 block-wise, compressed-tensors or ModelOpt source of that strategy; the integer scheme of a
    GPTQ, AWQ or compressed-tensors source, with algorithm rtn: llmc.quant.int_source) and no algorithm changed
    its weight (it still equals the decoded original in the compute dtype), the source's codes and scales are kept,
    bit for bit: quantizing the decoded values again would round a second time (a block's maximum need not be a
    code of 448, and bf16 rounds the decoded values first). Returns how many Linears kept them."""
    fmt = m.reader.source_format
    kept = 0
    for name in list(w.quantized):
        spec = members[m.group_of[name]].weights
        parts = m.reader.encoded(f"{name}.weight")
        if parts is not None and spec.format in int_source.INT_FORMATS:
            # a GPTQ / AWQ / compressed-tensors integer original, its scheme the target's (llmc.quant.int_source)
            q = int_source.kept_codes(fmt, members[m.group_of[name]], parts, m.reader, w.linears[name].weight.data,
                                      m.int_kept)
            if q is not None:
                w.quantized[name] = q
                kept += 1
            continue
        if parts is None or spec.format != "fp8_e4m3" or spec.strategy not in ("tensor", "channel", "block"):
            continue
        stored = m.reader.get_stored(parts.parts)
        codes, scale = stored[parts.codes], stored[parts.scale]
        if fp8_strategy(fmt, parts, codes, scale) != spec.strategy:
            continue
        weight = w.linears[name].weight.data
        if not torch.equal(decode(fmt, parts, stored, weight.dtype), weight.cpu()):
            continue  # an algorithm changed the weight: its own codes stand
        w.quantized[name] = QuantizedWeight(codes=codes.to(weight.device), zero_point=None, scale=canonical_fp8_scale(
            scale, spec.strategy, tuple(codes.shape)).to(weight.device))
        kept += 1
    return kept


def _write_rest(out: Path, source: ModelSource, reader: CheckpointReader, scheme: Scheme, config: dict,
                dtype: torch.dtype, layers_prefix: str, n_layers: int, modules: dict, kv_names: list[str],
                extra_meta: dict) -> None:
    """The weights outside the decoder layers, the tokenizer files and the canonical form's metadata."""
    names = [n for n in reader.names() if not n.startswith(layers_prefix + ".")]

    # quantization never touches these (read again from the source): kept in the source's dtype where it is no
    # wider than the compute dtype, so no float32 copy of a bf16 vocabulary is made or written
    def kept(t: torch.Tensor) -> torch.Tensor:
        return t.to(kept_dtype(t.dtype, dtype)) if t.is_floating_point() else t

    like = {n: reader.stored_like(n) for n in names}
    if all(t is not None for t in like.values()):  # written one at a time from the mapped file: the embedding and
        # head never together (they were the build's peak at a large vocabulary), and no copy of one kept as stored
        atomic_save_safetensors_streamed(out / "rest.safetensors", {n: kept(t) for n, t in like.items()},
                                         lambda n: kept(reader.mapped(n)))
    else:  # a decoded tensor among them: its dtype and shape are known once decoded
        atomic_save_safetensors(out / "rest.safetensors", {n: kept(t) for n, t in reader.get_many(names).items()})
    for f in TOKENIZER_FILES:
        path = source_file(source.folder, f, "tokenizer file")  # never a link leaving the folder (exit 7)
        if f != INDEX_FILE and path.is_file():  # the source's shard index names none of these files
            copy_tokenizer_file(path, out / f)  # tokenizer_config.json without an auto_map
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "scheme": scheme.to_dict(),
        "source": {"sha256": source.sha256, "origin": source.origin,
                   # a quantized original: what it was decoded from (the baseline is the decoded original)
                   **({"decoded_from": reader.source_format.describe()} if reader.source_format else {})},
        "config": config,
        "dtype": str(dtype).removeprefix("torch."),
        "modules": modules,
        "kv_cache_modules": kv_names,
        "files": [f"layers/{i:05d}.safetensors" for i in range(n_layers)] + ["rest.safetensors"],
        **extra_meta,
    }
    atomic_write_json(out / META_FILE, meta)


def _commit_layer(i: int, next_inputs: ActivationWriter | None, progress_file: Path, act_dir: Path,
                  previous: int, on_layer_done: Callable[[int], None] | None) -> None:
    """After layer i's file is durable: the next layer's inputs made durable, then progress moved past layer i (on
    every rank), then the previous resume point's inputs (layer `previous`'s) removed."""
    if next_inputs is not None:
        next_inputs.persist()
    distributed.barrier()
    if distributed.is_main():
        atomic_write_json(progress_file, {"next_layer": i + 1, **_world_entry()})
    distributed.barrier()
    shutil.rmtree(inputs_dir(act_dir, previous), ignore_errors=True)
    if on_layer_done:
        on_layer_done(i)


def _device_free(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _resume_layer(progress_file: Path) -> int:
    """The layer a rerun starts at: progress.json's, when it was written by as many ranks as run now (each rank's
    saved inputs are its own block of windows)."""
    if not progress_file.is_file():
        return 0
    progress = json.loads(progress_file.read_text())
    if progress.get("world_size", 1) != distributed.size():
        log(f"the work folder was left by {progress.get('world_size', 1)} processes, this run has "
            f"{distributed.size()}: starting over")
        return 0
    return progress["next_layer"]


def _world_entry() -> dict:
    return {"world_size": distributed.size()} if distributed.active() else {}


def _my_windows(ids: torch.Tensor, mask: torch.Tensor | None, batch_size: int):
    """This rank's contiguous block of calibration rows, cut on batch boundaries (per-sample: on samples)."""
    unit = 1 if mask is not None else batch_size
    lo, hi = distributed.shard_bounds(ids.shape[0], unit)
    if lo >= hi:
        from llmc.errors import RecipeError

        raise RecipeError(f"{ids.shape[0]} calibration windows in batches of {unit} leave rank {distributed.rank()} "
                          f"of {distributed.size()} without any",
                          fix="use fewer processes (--nproc) or more calibration.samples")
    return ids[lo:hi], None if mask is None else mask[lo:hi]


def _quantize_spread(pipeline: AlgorithmSteps, linears: dict[str, nn.Linear], stats: LayerStats,
                     device: torch.device) -> dict[str, QuantizedWeight]:
    """The quantizer's codes for every Linear; under torchrun each group of Linears sharing an input (one Hessian)
    is quantized on one rank and the results broadcast (llmc.distributed.spread)."""
    if not distributed.active():
        return pipeline.quantize_layer(linears, stats)
    groups: dict[str, list[str]] = {}
    for name in linears:
        groups.setdefault(stats.hessian_of.get(name, name), []).append(name)
    sizes = {n: lin.weight.numel() for n, lin in linears.items()}
    results = distributed.spread(list(groups.values()), sizes,
                                 lambda names: pipeline.quantize_layer({n: linears[n] for n in names}, stats))
    return {n: distributed.moved(results[n], device) for n in linears}


def _kv_modules(layer: nn.Module, prefix: str, scheme: Scheme) -> dict[str, nn.Module]:
    """The attention modules whose keys/values a KV cache holds: those that run transformers' attention
    interface (they carry `head_dim` and an output projection), whatever their q/k/v Linears are called
    (Phi-3 fuses them into qkv_proj)."""
    if not scheme.kv_cache:
        return {}
    return {f"{prefix}{n}": m for n, m in layer.named_modules()
            if hasattr(m, "head_dim") and isinstance(getattr(m, "o_proj", None), nn.Linear)}


PROBE_TOKENS = 16  # tokens of the forward that traces a layer's structure


class LayerStructure:
    """The smoothing pairs of each decoder layer, found from the layer (`mappings.discover`) and recorded
    for the algorithms (`mappings.remember`). One probe forward per distinct layer structure (names, classes
    and shapes), on random hidden states with the masks and rotary tables the model gives a short window,
    with the layer in float64 for the check (back in its own dtype, bit for bit, afterwards)."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, calibration: torch.Tensor) -> None:
        ids = calibration[:1, :PROBE_TOKENS]
        self.extras = capture_layer_inputs(model, layers, [ids])[0]
        self.shape = (1, ids.shape[1], model.config.hidden_size)
        self.found: dict[tuple, list] = {}

    def record(self, index: int, layer: nn.Module) -> None:
        from llmc.quant.algorithms import mappings

        signature = tuple((n, type(m).__name__, tuple(p.shape for p in m.parameters(recurse=False)))
                          for n, m in layer.named_modules())
        if signature not in self.found:
            self.found[signature] = self._discover(index, layer)
            log(f"layer {index} ({type(layer).__name__}) smoothing pairs: "
                + ("; ".join(f"{m.producer}{list(m.producer_rows) if m.producer_rows else ''} -> "
                             f"{', '.join(m.consumers)}"
                             + (f" (+ {', '.join(m.also_scaled)} scaled, kept unquantized)" if m.also_scaled else "")
                             for m in self.found[signature]) or "none"))
        mappings.remember(layer, self.found[signature])

    def _discover(self, index: int, layer: nn.Module) -> list:
        from llmc.quant.algorithms import mappings

        device = next(layer.parameters()).device
        args, kwargs = _as_float64(to_device(self.extras[index], device))
        x = torch.randn(self.shape, generator=torch.Generator().manual_seed(index), dtype=torch.float64).to(device)
        with _in_float64(layer):
            return mappings.discover(layer, lambda: (x, layer_output(layer(x, *args, **kwargs))))


@contextlib.contextmanager
def _in_float64(module: nn.Module):
    """`module`'s floating parameters and buffers in float64 inside, each back in its own dtype afterwards
    (exact: float64 holds every float32/bf16/fp16 value)."""
    slots = [(m, store, k) for m in module.modules() for store in (m._parameters, m._buffers)
             for k, t in store.items() if t is not None and t.is_floating_point()]
    dtypes = [store[k].dtype for _, store, k in slots]
    for _, store, k in slots:
        store[k].data = store[k].data.to(torch.float64)
    try:
        yield
    finally:
        for (_, store, k), dtype in zip(slots, dtypes):
            store[k].data = store[k].data.to(dtype)


def _as_float64(obj):
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.float64) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_as_float64(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _as_float64(v) for k, v in obj.items()}
    return obj


def _layer_tensors(
    layer: nn.Module,
    prefix: str,
    linears: dict[str, nn.Linear],
    quantized: dict[str, QuantizedWeight],
    stats: LayerStats,
    scheme: Scheme,
    schemes: dict[str, Scheme],
    kv_modules: dict[str, nn.Module],
) -> dict[str, torch.Tensor]:
    """The layer's tensors as the canonical form stores them; `schemes`: each quantized Linear's (plain) scheme."""
    # (meta: a routed expert streamed one at a time, its tensors spilled already: llmc.quant.expert_stream)
    tensors = {f"{prefix}{n}": p.detach() for n, p in layer.state_dict().items() if not p.is_meta}
    for name, q in quantized.items():
        member = schemes[name]
        tensors[f"{name}.weight"] = q.codes
        # microscaling block scales keep their encoding (E4M3, E8M0): canonical.py
        tensors[f"{name}.weight_scale"] = q.scale if member.weights.info.microscaling else q.scale.float()
        if q.zero_point is not None:
            tensors[f"{name}.weight_zero_point"] = q.zero_point
        if q.global_scale is not None:
            tensors[f"{name}.weight_global_scale"] = q.global_scale
        act = member.activations
        if act is not None and not act.dynamic:
            tensors[f"{name}.{input_scale_name(act)}"] = static_scale(stats.input_absmax[name], act)
    # the scales vLLM's / SGLang's fused kernels hold one of, as they will compute with them (issue 45)
    runtime_scales.unify_fused_weight_scales(tensors, {n: schemes[n].weights for n in quantized})
    tensors.update(runtime_scales.unify_expert_input_scales(tensors, {n: schemes[n].activations for n in quantized}))
    for name in kv_modules:
        tensors[f"{name}.k_scale"] = static_scale(stats.key_absmax[name], scheme.kv_cache)
        tensors[f"{name}.v_scale"] = static_scale(stats.value_absmax[name], scheme.kv_cache)
    return to_device(tensors, HOST)
