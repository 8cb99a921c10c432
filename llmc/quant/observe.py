"""What the calibration pass over one decoder layer records (`LayerStats`): per-Linear input ranges, KV-cache
ranges, GPTQ's Hessians and AWQ's module calls, through hooks (`observing`); and the calibration batches run
through a layer (`forward_batches`, `observe_batches`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from llmc.model.attention import register_kv_attention, route_kv, unroute_kv
from llmc.model.skeleton import layer_output, return_free_heap_to_os
from llmc.quant.activations import Activations
from llmc.quant.algorithms.catalog import Observe
from llmc.quant.algorithms.gptq import accumulate_hessian

KV_OBSERVER = "llmc_observe_kv"


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
    # Under torchrun, statistics that must equal one process's bit for bit although each rank's Linears differ
    # (Mixture-of-Experts layers: an expert no token of a rank's windows reached has no entry there): `exact`
    # combines them key by key over the union of the ranks' keys (llmc.distributed.reduce_layer_stats), and a rank
    # after the first keeps each Hessian call's input in `deferred` instead of accumulating it, to replay the calls
    # once the ranks before it have accumulated theirs (llmc.distributed.chain_hessians): every float32 step is then
    # the one one process takes.
    exact: bool = False
    defer_hessians: bool = False
    deferred: dict[str, list[torch.Tensor]] = field(default_factory=dict)


_ACTIVE_KV_STATS: LayerStats | None = None
RANGES_ONLY = Observe(hessians=False, module_calls=())
_MODULE_NAMES: dict[int, str] = {}


def _observe_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Record the absmax of the keys/values the module would cache; they pass on unchanged."""
    stats = _ACTIVE_KV_STATS
    name = _MODULE_NAMES.get(id(module))
    if stats is not None and name is not None:
        for store, t in ((stats.key_absmax, key), (stats.value_absmax, value)):
            m = t.detach().abs().amax().float()
            store[name] = torch.maximum(store[name], m) if name in store else m
    return key, value


def register_kv_observer() -> None:
    register_kv_attention(KV_OBSERVER, _observe_kv)


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
                if key == name and stats.defer_hessians:
                    stats.deferred.setdefault(key, []).append(x.clone())  # the forward may reuse its buffer
                elif key == name:
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
    route_kv([(attn, attn.config) for attn in kv_modules.values()], KV_OBSERVER)
    _ACTIVE_KV_STATS = stats
    try:
        yield stats
    finally:
        _ACTIVE_KV_STATS = None
        for h in handles:
            h.remove()
        for attn in kv_modules.values():
            _MODULE_NAMES.pop(id(attn), None)
        unroute_kv([(attn, attn.config) for attn in kv_modules.values()])


def stats_from_shared(saved: dict[str, dict[str, torch.Tensor]], linears: dict, kv_modules: dict) -> LayerStats:
    channel = {n: saved["channel_absmax"][n] for n in linears}
    return LayerStats(
        input_absmax={n: t.amax() for n, t in channel.items()},  # as the observer derives it
        channel_absmax=channel,
        key_absmax={n: saved["key_absmax"][n] for n in kv_modules},
        value_absmax={n: saved["value_absmax"][n] for n in kv_modules},
    )


def observe_batches(
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
        forward_batches(layer, hidden, extras, sink)


def forward_batches(
    layer: nn.Module,
    hidden: Activations,
    extras: list[tuple[tuple, dict]],
    sink: Callable[[torch.Tensor], None] | None,
) -> None:
    """Every calibration batch through `layer` as it is now; each output to `sink` (on the layer's device: the
    sink places it)."""
    device = next(layer.parameters()).device
    with torch.no_grad():
        for h, (args, kwargs) in zip(hidden, extras):
            out = layer_output(layer(h.to(device), *args, **kwargs))
            if sink is not None:
                sink(out)
            if hidden.spilled:  # batch-sized buffers freed in a loop fragment the heap; give them back
                del h, out
                return_free_heap_to_os()
