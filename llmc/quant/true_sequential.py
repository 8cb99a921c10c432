"""GPTQ inside one decoder layer's forward, each Linear calibrated on inputs that already went through the
layer's quantized Linears before it ("true sequential", as the GPTQ authors' reference code orders q/k/v,
o, gate/up, down).

Layer-at-a-time GPTQ otherwise costs two forwards per layer: one with original weights to collect every
Linear's Hessian, one with quantized weights to make the next layer's inputs. Here the forward that makes
the next layer's inputs is also the one that collects the Hessians: a pre-hook on each Linear takes the
Hessian of the input arriving there, quantizes the Linear and swaps its weight for the dequantized one
before it computes. So the layer's output is the quantized layer's output, after one forward.

That needs every calibration window in one forward (a Hessian is a sum over all of them). When the layer's
activations for all windows do not fit, `staged` gets the same quantization from several forwards over the
batches: each runs until the first Linear not yet quantized has seen its input (and the Linears sharing
that input), then stops; the group is quantized and the next forward goes one group further; a last
forward makes the outputs. Both sum each Hessian over the same windows in the same order and quantize the
same stacks of Linears (`stacks_of`), so they give the same bits (tests/unit/test_true_sequential.py, test_stream.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from llmc import distributed
from llmc.quant.algorithms.gptq import GptqOptions, accumulate_hessian, gptq_quantize_shared
from llmc.quant.numerics import QuantizedWeight, dequantize_weight
from llmc.quant.spec import TensorSpec


class _Stop(Exception):
    pass


def _set_quantized(lin: nn.Linear, q: QuantizedWeight, spec: TensorSpec) -> None:
    lin.weight.data = dequantize_weight(q, spec, lin.weight.dtype)


@contextlib.contextmanager
def _pre_hooks(linears: dict[str, nn.Linear], hook: Callable[[str, nn.Linear, torch.Tensor], None]):
    handles = [lin.register_forward_pre_hook(lambda mod, args, name=name: hook(name, mod, args[0]))
               for name, lin in linears.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def stacks_of(layer: nn.Module, prefix: str, linears: dict[str, nn.Linear]) -> dict[str, tuple[str, ...]]:
    """The Linears quantized together, rows stacked (one column loop instead of three), per member: those that
    read one norm's output (q/k/v, gate/up) in Llama-family layers; every other Linear alone."""
    from llmc.quant.algorithms.mappings import UnsupportedLayout, layer_mappings

    try:
        mappings = layer_mappings(layer)
    except UnsupportedLayout:
        return {}
    stacks = {}
    for m in mappings:
        names = tuple(prefix + c for c in m.consumers)
        if m.from_norm and not m.routed and len(names) > 1 and all(n in linears for n in names):
            stacks.update(dict.fromkeys(names, names))
    return stacks


def _quantize_stack(names: tuple[str, ...], linears: dict[str, nn.Linear], hessian: torch.Tensor,
                    spec: TensorSpec, options: GptqOptions, quantized: dict[str, QuantizedWeight]) -> None:
    # Under torchrun: computed on rank 0, the codes broadcast (llmc.distributed); every rank then runs the same layer.
    results = distributed.computed_once(
        lambda: gptq_quantize_shared([linears[n].weight.data for n in names], hessian, spec, options,
                                     list(names))[0])
    results = distributed.moved(results, hessian.device)
    for name, q in zip(names, results):
        quantized[name] = q
        _set_quantized(linears[name], q, spec)


def in_one_forward(
    run_layer: Callable[[], torch.Tensor], linears: dict[str, nn.Linear], stacks: dict[str, tuple[str, ...]],
    spec: TensorSpec, options: GptqOptions, batch_windows: int,
) -> tuple[dict[str, QuantizedWeight], torch.Tensor]:
    """Quantize `linears` during the one call `run_layer()` (every calibration window in one batch).
    Returns the codes and the call's output, which is the quantized layer's output. Hessians are summed
    `batch_windows` windows at a time, in the order `staged` sums its batches, and stacks are quantized
    together in both: the two give the same bits."""
    quantized: dict[str, QuantizedWeight] = {}
    last: list = [None, None]  # (input tensor, its Hessian)
    stack_input: dict[str, torch.Tensor] = {}  # a stack's later members must read its first member's input

    def hook(name: str, lin: nn.Linear, x: torch.Tensor) -> None:
        if name in quantized:
            if name in stack_input and stack_input.pop(name) is not x:
                raise RuntimeError(f"{name} was quantized with {stacks[name][0]}'s input but reads another tensor")
            return
        if last[0] is not x:
            hessian, tokens = None, 0
            for chunk in x.detach().split(batch_windows):
                hessian, tokens = accumulate_hessian(hessian, tokens, chunk)
            hessian, tokens = distributed.combine_running_means(hessian, tokens)  # over every rank's windows
            last[:] = [x, hessian]
        names = stacks.get(name, (name,))
        stack_input.update(dict.fromkeys(names[1:], x))
        _quantize_stack(names, linears, last[1], spec, options, quantized)

    with _pre_hooks(linears, hook), torch.no_grad():
        out = run_layer()
    return quantized, out


def staged(
    batch_calls: list[Callable[[], object]], linears: dict[str, nn.Linear], stacks: dict[str, tuple[str, ...]],
    spec: TensorSpec, options: GptqOptions,
) -> dict[str, QuantizedWeight]:
    """The same quantization as `in_one_forward`, one group of Linears per pass over the batches.
    `batch_calls[b]()` runs the layer over batch b; a pass stops each batch at the first Linear past its
    group. The caller runs the forward that makes the outputs afterwards."""
    quantized: dict[str, QuantizedWeight] = {}
    while len(quantized) < len(linears):
        group: list[str] = []
        hessian, tokens = None, 0
        batch_input = None

        def hook(name: str, lin: nn.Linear, x: torch.Tensor) -> None:
            nonlocal hessian, tokens, batch_input
            if name in quantized:
                return
            if batch_input is None:  # the group's first Linear: its input is the group's
                batch_input = x
                hessian, tokens = accumulate_hessian(hessian, tokens, x.detach())
            elif x is not batch_input:
                raise _Stop  # the next group's input: this batch has given all it has for the group
            if b == 0:
                group.append(name)

        with _pre_hooks(linears, hook), torch.no_grad():
            for b, call in enumerate(batch_calls):
                batch_input = None
                with contextlib.suppress(_Stop):
                    call()
        if not group:  # the rest were never called (MoE experts no token reached): the caller quantizes them
            break
        hessian, tokens = distributed.combine_running_means(hessian, tokens)  # over every rank's windows
        for name in group:
            if name not in quantized:
                names = stacks.get(name, (name,))
                if not set(names) <= set(group):
                    raise RuntimeError(f"{', '.join(names)} are stacked but do not all read {group[0]}'s input")
                _quantize_stack(names, linears, hessian, spec, options, quantized)
    return quantized
