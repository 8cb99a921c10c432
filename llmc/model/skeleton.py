"""A model as a skeleton: built on the meta device from its config, then one decoder layer at a time given real
weights (`materialize`), moved (`to_device`) and emptied again (`release`). The layer stream, the streaming torch
engine and the ONNX exporter walk models this way, so that peak memory is one layer whatever the depth."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
from collections.abc import Callable

import torch
from torch import nn

HOST = torch.device("cpu")


def build_skeleton(config_dict: dict, dtype: torch.dtype) -> nn.Module:
    """The model with parameters on the meta device (no memory) and real buffers (rotary tables)."""
    # lazy: accelerate + transformers (~2.5 s), only to build a model; llmc --help and plan skip it
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.for_model(**config_dict)
    # sdpa where the family supports it; Gemma 2 (logit soft-capping) runs transformers' eager attention
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    config._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    with init_empty_weights(include_buffers=False), _LargeEmptyOnMeta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _keep_float32(model)
    model.eval()
    return model


# init_empty_weights moves each parameter to the meta device once it is registered, but transformers' fused experts
# allocate it first (`nn.Parameter(torch.empty(E, 2I, H))`): DeepSeek-V3's gate_up_proj is 30 GB in float32, an
# allocation Linux's overcommit heuristic refuses on a 24 GB machine before any page is touched. No buffer is that
# large, so an uninitialized tensor of this many elements is made on the meta device directly.
META_ABOVE_ELEMENTS = 1 << 28


class _LargeEmptyOnMeta(torch.overrides.TorchFunctionMode):
    """`torch.empty` of META_ABOVE_ELEMENTS or more elements, with no device named, made on the meta device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if all(isinstance(d, int) for d in size) and math.prod(size) >= META_ABOVE_ELEMENTS:
                kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _keep_float32(model: nn.Module) -> None:
    """The tensors transformers keeps in float32 whatever the model's dtype (`_keep_in_fp32_modules_strict`:
    DeepSeek-V3's and GLM-4.5's router `e_score_correction_bias`, whose rounding to bf16 would move the top-k
    choice): made float32 here and marked, so `materialize` loads them in float32 and the layer files keep them so."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    if not keep:
        return
    for name, module in model.named_modules():
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or not t.is_floating_point() or not any(k in f"{name}.{attr}".split(".") for k in keep):
                continue
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(t.float(), requires_grad=False)
            else:
                module._buffers[attr] = t.float()
            module._llmc_float32 = {*getattr(module, "_llmc_float32", ()), attr}


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder layers and its dotted prefix."""
    n = model.config.num_hidden_layers
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and name.endswith("layers"):
            return name, mod
    raise ValueError(f"could not find the {n} decoder layers of {type(model).__name__}")


def output_head_names(model: nn.Module) -> set[str]:
    """The output head's parameter names: a calibration forward stops at the first decoder layer and never reads
    them, so the skeleton leaves them on the meta device (a 7B's untied 152k-row head is 2.2 GB in float32; a tied
    head's checkpoint usually stores no tensor of its own)."""
    head = model.get_output_embeddings()
    if head is None:
        return set()
    prefix = next(name for name, module in model.named_modules() if module is head)
    return {f"{prefix}.{name}" for name, _ in head.named_parameters(recurse=False)}


def materialize(module: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace meta parameters of `module` by the given tensors (names relative to the module). A tensor the model
    has no place for is ignored, whether its module exists or not (an old checkpoint's per-layer
    `self_attn.rotary_emb.inv_freq`, which transformers 5 computes once per model); a quantized source's parts
    (`weight._data`) never get here: the plan refuses them (llmc.model.checks.quantized_kind)."""
    for name, t in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name) if owner_name else module
        except AttributeError:
            continue
        kept = torch.float32 if attr in getattr(owner, "_llmc_float32", ()) else dtype  # `_keep_float32`
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(t.to(kept), requires_grad=False)
        elif attr in owner._buffers:
            owner._buffers[attr] = t.to(kept) if t.is_floating_point() else t


def is_gather(module: nn.Module) -> bool:
    """A lookup table whose forward gathers rows and does nothing else (`nn.Embedding` itself, without max_norm).
    Its rows gathered from the table as stored and then cast equal the rows of the table cast first, since a cast is
    elementwise; a subclass may compute in the table's dtype (Gemma's scaled embeddings multiply there), so is not."""
    return type(module) is nn.Embedding and module.max_norm is None


def materialize_skeleton(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """`materialize` for the weights outside the decoder layers that a calibration forward runs (`tensors`), except
    that a lookup table (`is_gather`) keeps the dtype it is stored in and casts the rows it gathers to `dtype`: the
    same layer inputs, without a compute-dtype copy of the table (a 7B's 152k-row bf16 embedding is 1.1 GB as
    stored, 2.2 GB more in float32, most of which the calibration never reads)."""
    rest = dict(tensors)
    for name, module in model.named_modules():
        t = rest.get(f"{name}.weight")
        if t is None or not is_gather(module) or not t.is_floating_point() or t.dtype == dtype:
            continue
        del rest[f"{name}.weight"]
        module._parameters["weight"] = nn.Parameter(t, requires_grad=False)
        module.register_forward_hook(_CastOutput(dtype))
    materialize(model, rest, dtype)


class _CastOutput:
    """A forward hook returning the module's output in `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.dtype)


def config_with_layers(config: dict, layers: int) -> dict:
    """`config` with `layers` decoder layers: its per-layer lists (layer_types) and per-layer maps keyed by layer
    index (per_layer_config, which transformers 5.x saves for Gemma 4's full layers) cut to them, or repeated in
    their pattern for a model of fewer layers; a map left at the old indices makes transformers refuse the model
    (a layer type no longer homogeneous)."""
    n = config.get("num_hidden_layers")
    if not n:
        return {**config, "num_hidden_layers": layers}
    cut = {k: (v * -(-layers // n))[:layers] for k, v in config.items() if isinstance(v, list) and len(v) == n}
    maps = {k: {str(i): v[str(i % n)] for i in range(layers) if str(i % n) in v}
            for k, v in config.items() if _is_per_layer_map(v, n)}
    out = {**config, **cut, **maps, "num_hidden_layers": layers}
    if config.get("num_kv_shared_layers"):
        out["num_kv_shared_layers"] = _kv_shared_layers(out["num_kv_shared_layers"] * layers / n,
                                                        out.get("layer_types") or [])
    return out


def _kv_shared_layers(share: float, types: list) -> int:
    """Gemma 4's trailing layers that read an earlier layer's keys/values, in the same share of a cut model, as many
    as leave a layer of every type before them to produce a cache (transformers refuses the model otherwise)."""
    shared = round(share)
    while shared and set(types[:len(types) - shared]) != set(types):
        shared -= 1
    return shared


def _is_per_layer_map(value: object, layers: int) -> bool:
    """A map of layer index to that layer's config overrides (not id2label, whose keys are indices too)."""
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(k, str) and k.isdigit() and int(k) < layers and isinstance(v, dict)
                    for k, v in value.items()))


def gathered_params(config_dict: dict) -> int:
    """Parameters of the lookup tables outside the decoder layers of the model `config_dict` describes that
    `materialize_skeleton` keeps as stored (`is_gather`), from a meta skeleton without decoder layers (no weight is
    read; a layer of Llama 4's experts takes seconds to build)."""
    return _gathered_params(json.dumps(config_with_layers(config_dict, 0), sort_keys=True))


@functools.lru_cache(maxsize=16)
def _gathered_params(config_json: str) -> int:
    model = build_skeleton(json.loads(config_json), torch.float32)
    return sum(m.weight.numel() for m in model.modules() if is_gather(m))


def release(module: nn.Module) -> None:
    module.to_empty(device="meta")
    return_free_heap_to_os()


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def return_free_heap_to_os() -> None:
    """glibc keeps freed tensors below its (self-raising) mmap threshold in the heap, so without this the
    process's peak grows with the number of layers streamed through it: measured on a 60-layer
    SmolLM2-width model, 1.21x the 30-layer peak (RTN, static scales); trimmed after each layer, 1.003x."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)



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


def layer_output(out) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple."""
    return out[0] if isinstance(out, tuple) else out
