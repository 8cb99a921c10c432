"""Quantize a model one decoder layer at a time.

Peak memory is one decoder layer plus the calibration activations, whatever the depth: the model
is built on the meta device, and each layer's weights are read from the safetensors checkpoint,
calibrated, quantized, written, and dropped before the next layer is read.

Calibration, when the scheme needs it (static activation scales, KV-cache scales, or a
data-driven algorithm), runs the calibration windows through the layers in sequence: the inputs
of layer i+1 are the outputs of layer i (original weights for RTN, as ModelOpt does; the
already-quantized layer for SmoothQuant/AWQ/GPTQ, as llm-compressor's sequential pipeline does).
Per layer: observe → transform (SmoothQuant/AWQ, `llmc.quant.algorithms`) → observe again if the
transform changed statistics the scheme stores → quantize weights (RTN/GPTQ) → write. GPTQ alone is
true-sequential instead (`llmc.quant.true_sequential`): each Linear is quantized inside the forward that
makes the next layer's inputs, from the inputs that reach it there.

The activations passed between layers stay in memory or, when they would not fit, spill to disk
one batch per file (`llmc.quant.activations`; recipe key `calibration.spill_activations`).

Resume: after each layer, its file, the next layer's inputs (`state/inputs-<i+1>/`) and
`progress.json` are written atomically in that order; a rerun in the same work directory continues
at `progress.json`'s layer from that layer's saved inputs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmc import distributed
from llmc.model.checkpoint import INDEX_FILE, CheckpointReader
from llmc.model.confine import source_file
from llmc.model.source import TOKENIZER_FILES, ModelSource
from llmc.progress import log, steps
from llmc.quant import moe, true_sequential
from llmc.quant.algorithms import Observe, Pipeline
from llmc.quant.activations import (
    Activations,
    ActivationWriter,
    SpillMode,
    inputs_dir,
    memory_available,
    should_spill,
)
from llmc.quant.algorithms.gptq import accumulate_hessian
from llmc.quant.canonical import FORMAT_NAME, FORMAT_VERSION, META_FILE, module_matches
from llmc.quant.numerics import QuantizedWeight, dequantize_weight, quantize_weight, static_scale
from llmc.quant.shared_stats import SharedStats
from llmc.quant.spec import Scheme
from llmc.store import atomic_save_safetensors, atomic_write_json

KV_OBSERVER = "llmc_observe_kv"
CALIBRATION_BATCH_SIZE = 4  # windows per calibration forward


# --------------------------------------------------------------------------- model skeleton


def build_skeleton(config_dict: dict, dtype: torch.dtype) -> nn.Module:
    """The model with parameters on the meta device (no memory) and real buffers (rotary tables)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.for_model(**config_dict)
    # sdpa where the family supports it; Gemma 2 (logit soft-capping) runs transformers' eager attention
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    config._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder layers and its dotted prefix."""
    n = model.config.num_hidden_layers
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and name.endswith("layers"):
            return name, mod
    raise ValueError(f"could not find the {n} decoder layers of {type(model).__name__}")


def materialize(module: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace meta parameters of `module` by the given tensors (names relative to the module)."""
    for name, t in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(t.to(dtype), requires_grad=False)
        elif attr in owner._buffers:
            owner._buffers[attr] = t.to(dtype) if t.is_floating_point() else t


def release(module: nn.Module) -> None:
    module.to_empty(device="meta")
    _return_free_heap_to_os()


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def _return_free_heap_to_os() -> None:
    """glibc keeps freed tensors below its (self-raising) mmap threshold in the heap, so without this the
    process's peak grows with the number of layers streamed through it: measured on a 60-layer
    SmolLM2-width model, 1.21x the 30-layer peak (RTN, static scales); trimmed after each layer, 1.003x."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def target_linears(layer: nn.Module, prefix: str, ignore: tuple[str, ...]) -> dict[str, nn.Linear]:
    return {
        f"{prefix}{n}": m
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and not module_matches(f"{prefix}{n}", ignore)
    }


# --------------------------------------------------------------------------- statistics


@dataclass
class LayerStats:
    """What one calibration pass over a layer observed."""

    input_absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # per Linear, scalar
    channel_absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # per Linear, [in]
    key_absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # per attention module
    value_absmax: dict[str, torch.Tensor] = field(default_factory=dict)
    # GPTQ: H = 2/n Σ x xᵀ per distinct input; Linears fed the same tensor share one (hessian_of).
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    hessian_tokens: dict[str, int] = field(default_factory=dict)
    hessian_of: dict[str, str] = field(default_factory=dict)
    # AWQ: (args, kwargs) of each call, per layer-relative module name.
    module_calls: dict[str, list[tuple[tuple, dict]]] = field(default_factory=dict)


_ACTIVE_KV_STATS: LayerStats | None = None
RANGES_ONLY = Observe(hessians=False, module_calls=())
_MODULE_NAMES: dict[int, str] = {}
_BASE_ATTENTION: dict[int, str] = {}  # the attention implementation each observed module ran before


def _observe_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's attention (sdpa, or its own eager function) that first records the absmax of the
    keys/values it would cache."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stats = _ACTIVE_KV_STATS
    name = _MODULE_NAMES.get(id(module))
    if stats is not None and name is not None:
        for store, t in ((stats.key_absmax, key), (stats.value_absmax, value)):
            m = t.detach().abs().amax().float()
            store[name] = torch.maximum(store[name], m) if name in store else m
    if _BASE_ATTENTION.get(id(module)) == "eager":
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_kv_observer() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(KV_OBSERVER, _observe_kv_attention)
    AttentionMaskInterface.register(KV_OBSERVER, sdpa_mask)


@contextlib.contextmanager
def observing(
    layer: nn.Module,
    linears: dict[str, nn.Linear],
    stats: LayerStats,
    kv_modules: dict[str, nn.Module],
    observe: Observe = RANGES_ONLY,
):
    global _ACTIVE_KV_STATS
    handles = []
    last_input: list = [None, None]  # (tensor, Hessian key) of the latest hooked call

    def pre_hook(name: str) -> Callable:
        def hook(_mod, args):
            x = args[0].detach()
            a = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            prev = stats.channel_absmax.get(name)
            stats.channel_absmax[name] = a if prev is None else torch.maximum(prev, a)
            stats.input_absmax[name] = stats.channel_absmax[name].amax()
            if observe.hessians:
                shared = last_input[1] if last_input[0] is args[0] else name
                key = stats.hessian_of.setdefault(name, shared)
                if key == name:
                    stats.hessians[key], stats.hessian_tokens[key] = accumulate_hessian(
                        stats.hessians.get(key), stats.hessian_tokens.get(key, 0), x
                    )
                last_input[:] = [args[0], key]

        return hook

    def call_hook(name: str) -> Callable:
        def hook(_mod, args, kwargs):
            stats.module_calls.setdefault(name, []).append((args, kwargs))

        return hook

    for name, lin in linears.items():
        handles.append(lin.register_forward_pre_hook(pre_hook(name)))
    for name in observe.module_calls:
        handles.append(layer.get_submodule(name).register_forward_pre_hook(call_hook(name), with_kwargs=True))
    for name, attn in kv_modules.items():
        _MODULE_NAMES[id(attn)] = name
        _BASE_ATTENTION.setdefault(id(attn), attn.config._attn_implementation)
        attn.config._attn_implementation = KV_OBSERVER
    _ACTIVE_KV_STATS = stats
    try:
        yield stats
    finally:
        _ACTIVE_KV_STATS = None
        for h in handles:
            h.remove()
        for attn in kv_modules.values():
            _MODULE_NAMES.pop(id(attn), None)
            attn.config._attn_implementation = _BASE_ATTENTION.pop(id(attn), "sdpa")


# --------------------------------------------------------------------------- capture


class _Stop(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for a decoder layer: records what the model passes to it, returns its input."""

    def __init__(self, index: int, sink: list, stop: bool) -> None:
        super().__init__()
        self.index, self.sink, self.stop = index, sink, stop

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((self.index, hidden_states, args, kwargs))
        if self.stop:
            raise _Stop
        return hidden_states


def capture_layer_inputs(
    model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor],
    hidden_sink: Callable[[torch.Tensor], None] | None = None,
) -> list[list[tuple[tuple, dict]]]:
    """The extra args each layer receives per batch; layer-0 hidden states go to `hidden_sink` batch by batch
    (so spilled activations are never all in memory, not even the first layer's).

    Attention masks and rotary tables depend only on shapes and positions, not on hidden
    states, so they are recorded once with every layer replaced by a pass-through recorder.
    """
    original = list(layers)
    n = len(layers)
    extras = []
    try:
        for batch in batches:
            sink: list = []
            for i in range(n):
                layers[i] = _Recorder(i, sink, stop=(i == n - 1))
            with contextlib.suppress(_Stop), torch.no_grad():
                model.model(input_ids=batch, use_cache=False)
            if hidden_sink is not None:
                hidden_sink(sink[0][1])
            per_layer = [None] * n
            for i, _, args, kwargs in sink:
                per_layer[i] = (args, kwargs)
            # Equal-length windows get equal masks and rotary tables: keep one copy, not one per batch
            # (a materialized mask is batch x seq² floats, which would grow with the calibration set).
            if extras and _identical(per_layer, extras[0]):
                per_layer = extras[0]
            extras.append(per_layer)
    finally:
        for i, m in enumerate(original):
            layers[i] = m
    return extras


def _identical(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    try:
        return bool(a is b or a == b)
    except Exception:  # objects without a usable equality
        return False


def _layer_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------- main loop


@dataclass
class StreamResult:
    layers: int
    quantized_modules: int
    calibrated: bool


def quantize_model(
    source: ModelSource,
    scheme: Scheme,
    out: Path,
    *,
    calibration: torch.Tensor | None,
    calibration_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    batch_size: int = CALIBRATION_BATCH_SIZE,
    extra_meta: dict | None = None,
    on_layer_done: Callable[[int], None] | None = None,
    spill_activations: SpillMode = "auto",
    shared_stats: Path | None = None,
    device: torch.device | str = "cpu",
    moe_calibrate_all_experts: bool = False,
    moe_min_tokens: int | None = None,
) -> StreamResult:
    """Write the canonical quantized form of `source` under `out` (resumable, see module doc).

    `calibration_mask`: per-sample calibration (right-padded rows, 1 = token): each sample runs as its own batch
    at its own length, so no padding reaches a layer and no statistic, scale, Hessian or search can see it.
    `shared_stats`: a folder keyed by (model, calibration data, dtype) where schemes calibrated on
    original outputs share their statistics (`llmc.quant.shared_stats`).
    `device`: where each layer is calibrated and quantized (one layer and one batch of activations at a
    time live there; the activations passed between layers, the embeddings and the files stay on the host).
    `moe_calibrate_all_experts`: Mixture-of-Experts blocks run every expert on every calibration token for
    statistics (the layer's output stays the routed one); `moe_min_tokens`: experts routed fewer calibration tokens
    are named in a warning (default: a tenth of an even share). Tokens routed per expert: `moe_tokens.json`."""
    device = torch.device(device)
    torch.manual_seed(0)
    pipeline = Pipeline.of(scheme)
    propagate = pipeline.propagate
    reader = CheckpointReader(source.folder)
    config = reader.config()
    model = build_skeleton(config, dtype)
    moe_blocks = moe.unfuse_experts(model)  # fused 3-D experts -> per-expert Linears under the Hub names
    layers_prefix, layers = decoder_layers(model)
    n_layers = len(layers)
    (out / "layers").mkdir(parents=True, exist_ok=True)
    state_dir = out / "state"
    progress_file = state_dir / "progress.json"
    start = _resume_layer(progress_file)
    # Each rank keeps the inputs of its own block of windows (llmc.distributed); one process, state/ as before.
    act_dir = state_dir / f"rank-{distributed.rank()}" if distributed.active() else state_dir
    if start:
        log(f"resuming quantization at layer {start}/{n_layers}")

    calibrate = scheme.needs_calibration
    if calibrate and calibration is None:
        raise ValueError("this scheme needs calibration data")
    if calibrate and distributed.active():
        calibration, calibration_mask = _my_windows(calibration, calibration_mask, batch_size)
    if moe_blocks and calibrate and distributed.active():
        from llmc.errors import RecipeError

        raise RecipeError("Mixture-of-Experts calibration under torchrun is not implemented (tokens routed per expert "
                          "differ by rank)", fix="calibrate in one process (no --nproc)")
    # MoE: which experts were starved depends on the routed tokens, which shared ranges do not record
    shared = (SharedStats(shared_stats, n_layers) if shared_stats and calibrate and pipeline.shares_statistics
              and not moe_blocks else None)
    moe_report = moe.TokenReport.load(out, moe_calibrate_all_experts) if moe_blocks and calibrate else None
    all_linears, all_kv = set(), set()
    for i, layer in enumerate(layers):
        all_linears |= set(target_linears(layer, f"{layers_prefix}.{i}.", scheme.ignore))
        all_kv |= set(_kv_modules(layer, f"{layers_prefix}.{i}.", scheme))
    reuse = shared is not None and not pipeline.needs_inputs_after_transform and shared.covers(all_linears, all_kv)
    if reuse:
        log("calibration statistics come from an earlier scheme on the same model and data: no calibration forward")
    gptq_in_forward = calibrate and pipeline.true_sequential
    traces_structure = calibrate and (bool(pipeline.transforms) or pipeline.true_sequential)
    if traces_structure or (calibrate and not reuse):
        # no name kept for these tensors: release(model) below must free them before the rest is read again
        materialize(model, reader.get_many([n for n in reader.names() if not n.startswith(layers_prefix + ".")]),
                    dtype)
    structure = LayerStructure(model, layers, calibration) if traces_structure else None
    if calibrate and not reuse:
        _register_kv_observer()
        act_bytes = calibration.numel() * config.get("hidden_size", 0) * torch.empty(0, dtype=dtype).element_size()
        spill = should_spill(spill_activations, act_bytes, memory_available())
        if spill:
            log(f"calibration activations ({act_bytes / 1e9:.2f} GB a copy) spill to {state_dir}: "
                "one batch in memory at a time")
        forward_batch = batch_size
        if gptq_in_forward and not spill and calibration_mask is None and _fits_one_forward(
                config, calibration.shape, dtype, device):
            forward_batch = calibration.shape[0]  # GPTQ inside the one forward that makes the outputs
        elif gptq_in_forward and moe_blocks:
            # staged passes group Linears by the first input each batch reaches, which differs per batch when
            # tokens are routed: MoE layers take the two-forward order instead (Hessians observed, then GPTQ)
            gptq_in_forward = False
        batches = unpadded_samples(calibration, calibration_mask) if calibration_mask is not None else list(
            calibration.split(forward_batch))
        saved = inputs_dir(act_dir, start)
        hidden = Activations.load(saved, spill) if start and saved.is_dir() else None
        if start and distributed.any_rank(hidden is None or len(hidden) != len(batches)):
            log(f"no saved inputs for layer {start} in {len(batches)} batches (work folder from an older run "
                "or another machine): starting over")
            start = 0
        first = None if start else ActivationWriter(inputs_dir(act_dir, 0), spill)
        extras = capture_layer_inputs(model, layers, batches, first.put if first else None)
        hidden = hidden if start else first.commit()
    else:
        batches, extras, hidden, spill = [], [], Activations([]), False

    modules: dict[str, dict] = {}
    kv_names: list[str] = []
    for i in steps(range(n_layers), "quantize layers", total=n_layers):
        prefix = f"{layers_prefix}.{i}."
        layer = layers[i]
        linears = target_linears(layer, prefix, scheme.ignore)
        kv_modules = _kv_modules(layer, prefix, scheme)
        for name, lin in linears.items():
            modules[name] = {"shape": list(lin.weight.shape), "layer": i}
        kv_names += list(kv_modules)
        if i < start:
            continue

        materialize(layer, reader.with_prefix(prefix), dtype)
        if moe_blocks:
            moe.check_materialized(layer, prefix, source.folder)
        layer.to(device)
        if structure is not None:
            structure.record(i, layer)
        stats = LayerStats()
        layer_extras = to_device([e[i] for e in extras], device)
        routed: dict[str, torch.Tensor] = {}  # MoE block -> tokens routed to each expert in this layer
        if reuse:
            stats = _stats_from(to_device(shared.load(i), device), linears, kv_modules)
            pipeline.transform_layer(layer, prefix, stats)
        elif gptq_in_forward:
            next_inputs = ActivationWriter(inputs_dir(act_dir, i + 1), spill)
            with moe.observing_experts(layer, moe_calibrate_all_experts, routed):
                quantized = _quantize_true_sequential(layer, prefix, linears, kv_modules, hidden, layer_extras, stats,
                                                      pipeline, next_inputs.put, batch_size)
        elif calibrate:
            # The next layer's inputs: this layer's outputs with original weights (collected while
            # observing) or with its quantized weights (one more pass, after quantizing).
            next_inputs = ActivationWriter(inputs_dir(act_dir, i + 1), spill)
            observe = pipeline.observe(layer)
            sink = next_inputs.put if propagate == "original" else None
            with moe.observing_experts(layer, moe_calibrate_all_experts, routed):
                _observe(layer, linears, kv_modules, observe, hidden, layer_extras, stats, sink)
            distributed.reduce_layer_stats(stats)
            if shared is not None and distributed.is_main():
                shared.save(i, to_device({"channel_absmax": stats.channel_absmax, "key_absmax": stats.key_absmax,
                                          "value_absmax": stats.value_absmax}, _HOST))
            if pipeline.transform_layer(layer, prefix, stats) and pipeline.reads_statistics_after_transform:
                # Rescaled weights change activation ranges (and Hessians): measure them again.
                stats = LayerStats()
                replace_observe = Observe(hessians=observe.hessians, module_calls=())
                with moe.observing_experts(layer, moe_calibrate_all_experts, None):
                    _observe(layer, linears, kv_modules, replace_observe, hidden, layer_extras, stats)
                distributed.reduce_layer_stats(stats)
        # MoE experts no calibration token reached (never with moe_calibrate_all_experts): RTN weights, and
        # static activation ranges from the layer's other experts (llmc.quant.moe.proxy_input_ranges)
        starved = [] if moe_calibrate_all_experts else moe.starved_linears(layer, prefix, routed, linears)
        if not gptq_in_forward:
            quantized = _quantize_spread(pipeline, {n: m for n, m in linears.items() if n not in starved}, stats,
                                         device)
        quantized.update({n: quantize_weight(linears[n].weight.data, scheme.weights)
                          for n in linears if n not in quantized})
        if moe_report is not None and routed:
            moe_report.add(i, prefix, routed, moe.proxy_input_ranges(stats, starved) if scheme.stores_ranges else {},
                           moe_min_tokens, calibration.numel(), config)
        stats.module_calls.clear()

        if distributed.is_main():
            tensors = _layer_tensors(layer, prefix, linears, quantized, stats, scheme, kv_modules)
            atomic_save_safetensors(out / "layers" / f"{i:05d}.safetensors", tensors)
            if moe_report is not None:
                moe_report.save(out)
        if calibrate and not reuse:
            if propagate == "quantized" and not gptq_in_forward:
                for name, lin in linears.items():
                    lin.weight.data = dequantize_weight(quantized[name], scheme.weights, dtype)
                _forward_batches(layer, hidden, layer_extras, next_inputs.put)
            hidden = next_inputs.commit()
        # Progress moves only after the layer file and the next layer's inputs are complete (on every rank); a run
        # killed anywhere before this line redoes layer i from its own saved inputs.
        distributed.barrier()
        if distributed.is_main():
            atomic_write_json(progress_file, {"next_layer": i + 1, **_world_entry()})
        distributed.barrier()
        shutil.rmtree(inputs_dir(act_dir, i), ignore_errors=True)
        release(layer)
        if on_layer_done:
            on_layer_done(i)

    release(model)  # the skeleton's embeddings and head: read again below, so never two copies (70B: 4.2 GB each)
    distributed.barrier()
    if not distributed.is_main():  # rank 0 writes the rest and removes the state (every rank is done with it)
        return StreamResult(layers=n_layers, quantized_modules=len(modules), calibrated=calibrate)
    rest = reader.get_many([n for n in reader.names() if not n.startswith(layers_prefix + ".")])
    rest = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in rest.items()}
    atomic_save_safetensors(out / "rest.safetensors", rest)
    for f in TOKENIZER_FILES:
        path = source_file(source.folder, f, "tokenizer file")  # never a link leaving the folder (exit 7)
        if f != INDEX_FILE and path.is_file():  # the source's shard index names none of these files
            shutil.copyfile(path, out / f)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "scheme": scheme.to_dict(),
        "source": {"sha256": source.sha256, "origin": source.origin},
        "config": config,
        "dtype": str(dtype).removeprefix("torch."),
        "modules": modules,
        "kv_cache_modules": kv_names,
        "files": [f"layers/{i:05d}.safetensors" for i in range(n_layers)] + ["rest.safetensors"],
        **({"moe": moe.canonical_entry(model, moe_blocks, moe_report)} if moe_blocks else {}),
        **(extra_meta or {}),
    }
    atomic_write_json(out / META_FILE, meta)
    if shared is not None and not reuse:
        shared.finish(all_linears, all_kv)
    shutil.rmtree(state_dir, ignore_errors=True)
    return StreamResult(layers=n_layers, quantized_modules=len(modules), calibrated=calibrate)


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


def _quantize_spread(pipeline: Pipeline, linears: dict[str, nn.Linear], stats: LayerStats,
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


def unpadded_samples(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """One [1, length] batch per right-padded row: the tokens its mask keeps, no padding."""
    lengths = mask.long().sum(dim=1)
    if not torch.equal(mask.long(), (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()):
        raise ValueError("calibration rows must be right-padded: each mask is ones then zeros")
    return [ids[i : i + 1, : int(n)] for i, n in enumerate(lengths.tolist()) if n > 0]


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
            return mappings.discover(layer, lambda: (x, _layer_output(layer(x, *args, **kwargs))))


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


def _stats_from(saved: dict[str, dict[str, torch.Tensor]], linears: dict, kv_modules: dict) -> LayerStats:
    channel = {n: saved["channel_absmax"][n] for n in linears}
    return LayerStats(
        input_absmax={n: t.amax() for n, t in channel.items()},  # as the observer derives it
        channel_absmax=channel,
        key_absmax={n: saved["key_absmax"][n] for n in kv_modules},
        value_absmax={n: saved["value_absmax"][n] for n in kv_modules},
    )


def _observe(
    layer: nn.Module,
    linears: dict[str, nn.Linear],
    kv_modules: dict[str, nn.Module],
    observe: Observe,
    hidden: Activations,
    extras: list[tuple[tuple, dict]],
    stats: LayerStats,
    sink: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Run the calibration batches through one layer, recording into `stats`; outputs go to `sink`."""
    with observing(layer, linears, stats, kv_modules, observe):
        _forward_batches(layer, hidden, extras, sink)


def _forward_batches(
    layer: nn.Module,
    hidden: Activations,
    extras: list[tuple[tuple, dict]],
    sink: Callable[[torch.Tensor], None] | None,
) -> None:
    """Every calibration batch through `layer` as it is now; each output to `sink` (on the host)."""
    device = next(layer.parameters()).device
    with torch.no_grad():
        for h, (args, kwargs) in zip(hidden, extras):
            out = _layer_output(layer(h.to(device), *args, **kwargs))
            if sink is not None:
                sink(out.to(_HOST))
            if hidden.spilled:  # batch-sized buffers freed in a loop fragment the heap; give them back
                del h, out
                _return_free_heap_to_os()


def _quantize_true_sequential(
    layer: nn.Module,
    prefix: str,
    linears: dict[str, nn.Linear],
    kv_modules: dict[str, nn.Module],
    hidden: Activations,
    extras: list[tuple[tuple, dict]],
    stats: LayerStats,
    pipeline: Pipeline,
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
        return _layer_output(layer(hidden[b].to(device), *args, **kwargs))

    # Ranges only where the scheme stores them (static activation or KV-cache scales): abs() of every
    # Linear's input is a copy of the activations, ~3% of a SmolLM2 W4A16 run for nothing.
    with observing(layer, linears if scheme.stores_ranges else {}, stats, kv_modules, RANGES_ONLY):
        if len(hidden) == 1:
            quantized, out = true_sequential.in_one_forward(lambda: run(0), linears, stacks, scheme.weights,
                                                            options, batch_windows)
            sink(out.to(_HOST))
            return quantized
        quantized = true_sequential.staged([functools.partial(run, b) for b in range(len(hidden))], linears,
                                           stacks, scheme.weights, options)
    _forward_batches(layer, hidden, extras, sink)  # the staged passes observed every range already
    return quantized


def _fits_one_forward(config: dict, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether one decoder layer's forward over every calibration window at once fits in a quarter of the
    free memory of `device`: residual stream, norms, q/k/v/o and the MLP's intermediates per token, plus
    attention scores as if materialized (batch x heads x seq²)."""
    windows, seq = shape
    hidden, inter = config.get("hidden_size", 0), config.get("intermediate_size", 0)
    heads = config.get("num_attention_heads", 1)
    elem = torch.empty(0, dtype=dtype).element_size()
    need = windows * seq * (8 * hidden + 4 * inter) * elem + windows * heads * seq * seq * 4
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = memory_available()
    return free is not None and need <= free // 4


def _layer_tensors(
    layer: nn.Module,
    prefix: str,
    linears: dict[str, nn.Linear],
    quantized: dict[str, QuantizedWeight],
    stats: LayerStats,
    scheme: Scheme,
    kv_modules: dict[str, nn.Module],
) -> dict[str, torch.Tensor]:
    tensors = {f"{prefix}{n}": p.detach() for n, p in layer.state_dict().items()}
    for name, q in quantized.items():
        tensors[f"{name}.weight"] = q.codes
        tensors[f"{name}.weight_scale"] = q.scale.float()
        if q.zero_point is not None:
            tensors[f"{name}.weight_zero_point"] = q.zero_point
        act = scheme.activations
        if act is not None and not act.dynamic:
            tensors[f"{name}.input_scale"] = static_scale(stats.input_absmax[name], act)
    for name in kv_modules:
        tensors[f"{name}.k_scale"] = static_scale(stats.key_absmax[name], scheme.kv_cache)
        tensors[f"{name}.v_scale"] = static_scale(stats.value_absmax[name], scheme.kv_cache)
    return to_device(tensors, _HOST)


_HOST = torch.device("cpu")


def to_device(obj, device: torch.device):
    """`obj` (tensors in nested tuples/lists/dicts) on `device`; a tensor shared by several entries (the one
    mask or rotary table all batches use) is moved once and stays shared."""
    moved: dict[int, torch.Tensor] = {}

    def go(o):
        if isinstance(o, torch.Tensor):
            if o.device == device:
                return o
            if id(o) not in moved:
                moved[id(o)] = o.to(device)
            return moved[id(o)]
        if isinstance(o, tuple):
            return tuple(go(x) for x in o)
        if isinstance(o, list):
            return [go(x) for x in o]
        if isinstance(o, dict):
            return {k: go(v) for k, v in o.items()}
        return o

    return go(obj)
