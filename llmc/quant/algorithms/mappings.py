"""Which operation produces the input of which Linears inside a decoder layer.

SmoothQuant and AWQ rescale a shared input between its producer (a norm, or a Linear's output rows) and the
Linears that consume it; AWQ measures the error at the output of `parent`. The pairs are found from the
layer itself (`discover`), not from a list of names:

1. trace one probe forward of the layer: Linears called on the same tensor object form a consumer group,
   and the module whose output *is* that tensor is its candidate producer (a norm, when it is a leaf with a
   1-D weight as wide as the input). A group whose input no module returned (an activation product such as
   act(gate) * up, or an attention output) gets as candidates the earlier Linears' output-row slices of its
   width (a fused producer such as Phi-3's gate_up_proj offers its slices);
2. keep a candidate only if it *is* a smoothing pair: dividing the producer's outputs by a random positive
   per-channel s and multiplying the consumers' input columns by s leaves the layer's output unchanged (in
   float64, to 1e-5 of what the layer adds to its input). This rejects everything a name list would get
   wrong: OLMo 2's post-norms (they normalize the sublayer's output, not the Linears' input), q_proj → o_proj
   (softmax in between), v_proj → o_proj under grouped-query attention (widths differ), gate → down (SiLU).

What this finds per family (tests/unit/test_families.py): Llama/Mistral/Qwen2/Qwen3/Granite: input_layernorm →
q/k/v, post_attention_layernorm → gate/up, v → o (without GQA), up → down. Gemma 2/3: pre_feedforward_layernorm
(not post_attention_layernorm) → gate/up. Phi-3: input_layernorm → qkv_proj, post_attention_layernorm →
gate_up_proj, the up half of gate_up_proj → down_proj, the v slice of qkv_proj → o_proj (without GQA). OLMo 2:
no norm pair (its norms follow the attention and the MLP; q/k/v and gate/up read the residual stream itself),
so SmoothQuant there smooths only v → o and up → down, and AWQ searches only those.

Mixture-of-Experts blocks (`llmc.quant.moe`): each expert reads its own routed subset of the norm's output, never
the same tensor object, so tracing cannot group them. Their candidates come from the block's structure instead:
the module that returned the tensor the experts module gets (or the block's input, where no module returned that
tensor: Llama-4's router-scaled input) → every expert's gate and up, plus the Linears inside the block that read the
block's input itself (DeepSeek-V3's and GLM-4.5's shared experts) or the very tensor its experts module gets (a
shared expert's gate/up and its one-row sigmoid gate: Qwen2-MoE, Qwen3-Next; that gate, a Linear child of the block
like the router, is scaled with the router and stays unquantized) (parent: the block, `routed`), with the input
columns of the routers that read the producer's output scaled by the same s (`also_scaled`: without it the routing
moves, which the check below rejects), and per expert up → down. Gemma-4's MoE variant, whose decoder layer is the
block, gives its experts pre_feedforward_layernorm_2 of the residual beside a dense MLP on pre_feedforward_layernorm,
and routes from the residual itself (its router's own weightless norm): the pair is pre_feedforward_layernorm_2 →
the experts, no router scaled, AWQ scoring the experts module (the layer's input is not theirs; the routing is
replayed as recorded). The check then runs on them as on any candidate. Expert Linears are never offered as producers
or consumers of other groups.

`layer_mappings(layer)` returns what `discover` recorded for the layer (the layer stream records every layer
before its algorithms run); for a layer never traced it falls back to the Llama-family names.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Mapping:
    producer: str
    consumers: tuple[str, ...]
    parent: str
    from_norm: bool  # the producer is a norm (SmoothQuant only rescales these unless smooth: all)
    producer_rows: tuple[int, int] | None = None  # [start, end) of a fused producer's outputs the consumers read
    also_scaled: tuple[str, ...] = ()  # modules reading the same input whose columns take s too, never quantized
    routed: bool = False  # consumers read routed subsets of the producer's output (MoE experts): no shared input


class UnsupportedLayout(ValueError):
    pass


# Relative to what the layer adds to its input. The check runs in float64, but some norms compute in float32
# whatever their input (Gemma's): a true pair then moves the output by ~1e-7 of it, a wrong one by ~1e-2 or more.
PRESERVE_TOLERANCE = 1e-5
_RECORDED: weakref.WeakKeyDictionary[nn.Module, list[Mapping]] = weakref.WeakKeyDictionary()


def remember(layer: nn.Module, mappings: list[Mapping]) -> None:
    """Make `layer_mappings(layer)` answer `mappings` (found by `discover` on this layer or an identical one)."""
    _RECORDED[layer] = mappings


def layer_mappings(layer: nn.Module) -> list[Mapping]:
    """The producer → consumers pairs of one decoder layer, in forward order."""
    recorded = _RECORDED.get(layer)
    return list(recorded) if recorded is not None else llama_family_mappings(layer)


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


def llama_family_mappings(layer: nn.Module) -> list[Mapping]:
    """The pairs by Llama-family names, for a layer `discover` has not traced (direct callers and tests)."""
    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    mlp_norm = "pre_feedforward_layernorm" if _has(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
    needed = ["input_layernorm", *attn, "self_attn.o_proj", mlp_norm, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    missing = [n for n in needed if not _has(layer, n)]
    if missing:
        raise UnsupportedLayout(
            f"{type(layer).__name__} has no {', '.join(missing)}: without a traced forward SmoothQuant/AWQ know "
            "Llama-family layers only; fix: run it through llmc.quant.stream (which traces each layer), or use "
            "algorithm rtn or gptq"
        )
    mappings = [Mapping("input_layernorm", attn, "self_attn", True)]
    v, o = layer.get_submodule("self_attn.v_proj"), layer.get_submodule("self_attn.o_proj")
    if v.out_features == o.in_features:  # with grouped-query attention v's outputs are shared by heads
        mappings.append(Mapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", False))
    mappings.append(Mapping(mlp_norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp", True))
    mappings.append(Mapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj", False))
    return mappings


# --------------------------------------------------------------------------- discovery


def is_norm(module: nn.Module, width: int) -> bool:
    """A leaf whose only parameters are a 1-D weight (and bias) as wide as its output: RMSNorm, LayerNorm."""
    weight = getattr(module, "weight", None)
    return (not isinstance(module, nn.Linear) and not list(module.children()) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and weight.shape[0] == width)


@dataclass
class _Trace:
    groups: list[tuple[str, ...]]  # Linears that read one tensor object, in call order
    producer_of: dict[tuple[str, ...], str | None]  # the module that returned that tensor, if any
    first_call: dict[str, int]  # call index of each Linear
    block_input_producer: dict[str, str | None] = field(default_factory=dict)  # MoE block -> who made its input
    # MoE block -> the Linears inside it that read the block's input tensor itself (DeepSeek's shared experts)
    block_input_readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    input_of: dict[str, int] = field(default_factory=dict)  # id of the tensor each Linear read
    module_input: dict[str, int] = field(default_factory=dict)  # id of each module's first input (AWQ's x)
    # MoE block -> the Linears outside its experts that read the very tensor its experts module gets (a shared
    # expert's gate/up and its gate: Qwen2-MoE, Qwen3-Next)
    beside_experts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # MoE block -> the module that returned the tensor its experts module gets (or the tensor it is a whole view of):
    # the block's input producer in most families; Gemma-4's pre_feedforward_layernorm_2, whose block is the layer
    experts_input_producer: dict[str, str | None] = field(default_factory=dict)
    # a router (layer-relative, `moe.block_routers`) -> the module that returned what it reads (or a whole view of
    # it): it takes the pair's scale only when that is the pair's producer (Gemma-4's router reads the residual)
    router_input_producer: dict[str, str | None] = field(default_factory=dict)


def _trace(layer: nn.Module, run: Callable[[], torch.Tensor], blocks: tuple[str, ...] = ()) -> _Trace:
    from llmc.quant import moe

    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    produced: dict[int, str] = {}
    inputs: dict[str, int] = {}
    reshaped_from: dict[int, int] = {}  # a Linear's input that is a whole-tensor view -> the tensor it views
    module_input: dict[str, int] = {}
    first_call: dict[str, int] = {}
    keep: list[torch.Tensor] = []  # hold every traced tensor so no id is reused during the trace
    handles = []

    def out_hook(name: str):
        def hook(_m, _args, out):
            if isinstance(out, torch.Tensor):
                keep.append(out)
                produced.setdefault(id(out), name)

        return hook

    def note_view(x: torch.Tensor) -> None:
        keep.append(x)
        # DeepSeek's kv_b_proj reads kv_a_layernorm's output reshaped (.view): still that norm's output
        if x._base is not None and x._base.numel() == x.numel():
            keep.append(x._base)
            reshaped_from.setdefault(id(x), id(x._base))

    def in_hook(name: str):
        def hook(_m, args):
            x = args[0]
            note_view(x)
            inputs.setdefault(name, id(x))
            first_call.setdefault(name, len(first_call))

        return hook

    def first_input_hook(name: str):
        def hook(_m, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                keep.append(x)
                module_input.setdefault(name, id(x))

        return hook

    for name, module in layer.named_modules():
        if name:
            handles.append(module.register_forward_hook(out_hook(name)))
            handles.append(module.register_forward_pre_hook(first_input_hook(name), with_kwargs=True))
        if name in linears or (name and name in blocks):  # a layer that is its own block (Gemma-4): its input is
            # the residual stream, which no module of the layer produces
            handles.append(module.register_forward_pre_hook(in_hook(name)))
    experts_input: dict[str, int] = {}  # MoE block -> the tensor its experts module was given
    router_input: dict[str, int] = {}  # router -> the tensor it was given

    def first_arg_hook(seen: dict[str, int], key: str):
        def hook(_m, args):
            if args and isinstance(args[0], torch.Tensor):  # a module called by keyword only stays unknown
                note_view(args[0])
                seen.setdefault(key, id(args[0]))

        return hook

    for b in blocks:
        block = layer.get_submodule(b)
        handles.append(block.experts.register_forward_pre_hook(first_arg_hook(experts_input, b)))
        for r in moe.block_routers(block, block.experts):
            handles.append(block.get_submodule(r).register_forward_pre_hook(
                first_arg_hook(router_input, moe.block_path(b, r))))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    by_input: dict[int, list[str]] = {}
    for name in sorted(inputs, key=first_call.__getitem__):
        by_input.setdefault(inputs[name], []).append(name)
    groups = [tuple(g) for g in by_input.values() if g[0] not in blocks]
    inside = {b: f"{b}." if b else "" for b in blocks}  # "": the decoder layer is the block (Gemma-4)
    readers = {b: tuple(n for n in by_input[inputs[b]] if n.startswith(inside[b]) and n != b) for b in blocks
               if b in inputs}
    beside = {b: tuple(n for g in groups for n in g if inputs[n] == experts_input[b] and n.startswith(inside[b])
                       and not n.startswith(f"{inside[b]}experts.")) for b in blocks if b in experts_input}

    def producer(tensor: int) -> str | None:  # the module that returned the tensor, or the tensor it wholly views
        return produced.get(tensor, produced.get(reshaped_from.get(tensor, -1)))

    producer_of = {g: producer(inputs[g[0]]) for g in groups}
    return _Trace(groups, producer_of, first_call, {b: produced.get(inputs[b]) for b in blocks if b in inputs},
                  readers, inputs, module_input, beside, {b: producer(t) for b, t in experts_input.items()},
                  {r: producer(t) for r, t in router_input.items()})


def _parent(layer: nn.Module, consumers: tuple[str, ...], producer_is_linear: bool) -> str | None:
    """The module whose output AWQ scores: a lone consumer fed by a Linear is its own parent; otherwise the
    layer's child block (self_attn, mlp) holding every consumer."""
    if producer_is_linear and len(consumers) == 1:
        return consumers[0]
    tops = {c.split(".", 1)[0] for c in consumers}
    if len(tops) == 1 and "." in consumers[0]:
        return tops.pop()
    return consumers[0] if len(consumers) == 1 else None


def _moe_candidates(layer: nn.Module, trace: _Trace) -> list[Mapping]:
    """Per MoE block: the producer of the experts' input -> every expert's gate and up (the routers that read that
    same tensor scaled too), and per expert up -> down (module docstring)."""
    from llmc.quant import moe

    out = []
    for name, block, experts in moe.routed_blocks(layer):
        block_producer = trace.block_input_producer.get(name)
        # what the experts read: the block's input in most families (Mixtral, Qwen, DeepSeek: a view of it; Llama-4:
        # it times the router scores, which no module returns), a norm of the layer's own beside a dense MLP where the
        # decoder layer is the block (Gemma-4: pre_feedforward_layernorm_2 of the residual)
        producer = trace.experts_input_producer.get(name) or block_producer
        gate_up = tuple(moe.block_path(name, f"experts.{e}.{p}") for e, x in enumerate(experts) for p in x.names[:2])
        routers = [moe.block_path(name, n) for n in moe.block_routers(block, experts)]
        # a router takes s where it reads the producer's output, else the routing would move (the check rejects the
        # pair without it); one reading something else keeps its weights (Gemma-4's router: the residual, normed by
        # its own weightless norm)
        scaled = tuple(r for r in routers if trace.router_input_producer.get(r) == producer)
        if producer == block_producer:  # AWQ scores the whole block, whose input is the consumers'
            parent = name
            gate_up += trace.block_input_readers.get(name, ())  # DeepSeek's shared experts read the block input itself
        else:  # the block's input is not theirs: AWQ scores the experts module (its input is theirs; the routing,
            parent = moe.block_path(name, "experts")  # computed from another tensor, is replayed as recorded)
        # a shared expert reads the block's whole input beside the routed experts: its gate/up are consumers too (its
        # sigmoid gate, a Linear child of the block, is scaled with the router and stays unquantized)
        shared = tuple(n for n in trace.beside_experts.get(name, ()) if n not in routers and n not in gate_up)
        if shared and parent != name:  # no module AWQ could score would hold both the experts and these Linears
            producer = None
        if producer is not None and is_norm(layer.get_submodule(producer), layer.get_submodule(gate_up[0]).in_features):
            out.append(Mapping(producer, gate_up + shared, parent, True, also_scaled=scaled, routed=True))
        for e, x in enumerate(experts):
            _gate, up, down = (moe.block_path(name, f"experts.{e}.{p}") for p in x.names)
            out.append(Mapping(up, (down,), down, False))
    return out


def _candidates(layer: nn.Module, trace: _Trace) -> list[Mapping]:
    from llmc.quant import moe

    experts = set(moe.expert_names(layer))
    out = _moe_candidates(layer, trace)
    beside = {n for names in trace.beside_experts.values() for n in names}
    for group in trace.groups:
        if experts & set(group) or set(group) <= beside:  # the MoE block's input: its candidate is above
            continue
        width = layer.get_submodule(group[0]).in_features
        producer = trace.producer_of[group]
        if producer is not None:
            module = layer.get_submodule(producer)
            linear = isinstance(module, nn.Linear) and module.out_features == width
            parent = _parent(layer, group, linear)
            if parent in trace.module_input and trace.module_input[parent] != trace.input_of[group[0]]:
                # MLA's q_b_proj / kv_b_proj: self_attn's input is not theirs, so AWQ scores the first consumer's
                # output (DeepSeek-V3.2: q_b_proj, beside the indexer's wq_b, which takes the same scale)
                parent = group[0]
            if parent and (linear or is_norm(module, width)):
                out.append(Mapping(producer, group, parent, not linear))
            continue
        parent = _parent(layer, group, True)
        if parent is None:
            continue
        for name, lin in layer.named_modules():
            if (not isinstance(lin, nn.Linear) or name in group or name in experts or name not in trace.first_call
                    or trace.first_call[name] > trace.first_call[group[0]] or lin.out_features < width):
                continue
            starts = sorted({*range(0, lin.out_features - width + 1, width), lin.out_features - width})
            for start in starts:
                rows = None if (start, start + width) == (0, lin.out_features) else (start, start + width)
                out.append(Mapping(name, group, parent, False, rows))
    return out


def _preserves(layer: nn.Module, mapping: Mapping, run: Callable[[], torch.Tensor], baseline: torch.Tensor,
               added: float, generator: torch.Generator) -> bool:
    """Whether rescaling the pair by a random positive s leaves the layer's output as it was."""
    from llmc.quant.algorithms.smoothquant import divide_output, multiply_input

    producer = layer.get_submodule(mapping.producer)
    consumers = [layer.get_submodule(c) for c in mapping.consumers + mapping.also_scaled]
    # divide_output and multiply_input assign new tensors and never write into the old ones (test), so the old
    # tensors are the exact originals: restored by reference, not cloned (a clone of a 70B-width layer's gate and
    # up in float64 is 3.8 GB)
    saved = {id(p): p.data for m in (producer, *consumers) for p in m.parameters(recurse=False)}
    width = consumers[0].in_features
    # drawn on the host (one seeded generator for every device: the same probe on a CPU and a GPU), used on the layer's
    s = torch.exp(torch.empty(width, dtype=torch.float64).uniform_(-1, 1, generator=generator)).to(
        consumers[0].weight.device)
    try:
        divide_output(producer, s, mapping.producer_rows)
        multiply_input(consumers, s)
        with torch.no_grad():
            changed = (run() - baseline).abs().max().item()
    finally:
        for m in (producer, *consumers):
            for p in m.parameters(recurse=False):
                p.data = saved[id(p)]
    return changed <= PRESERVE_TOLERANCE * added


def discover(layer: nn.Module, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> list[Mapping]:
    """The smoothing pairs of `layer`, found by tracing and checking it (module docstring). `run()` runs one
    probe forward of the layer as it is and returns (layer input, layer output); the layer must hold float64
    weights and `run` float64 inputs."""
    from llmc.quant import moe

    generator = torch.Generator().manual_seed(0)
    trace = _trace(layer, lambda: run()[1], tuple(name for name, _b, _e in moe.routed_blocks(layer)))
    with torch.no_grad():
        x, baseline = run()
    added = max((baseline - x).abs().max().item(), 1e-30)
    found = [m for m in _candidates(layer, trace) if _preserves(layer, m, lambda: run()[1], baseline, added, generator)]
    # an expert no probe token reached has no call index: its pairs go last
    return sorted(found, key=lambda m: trace.first_call.get(m.consumers[0], len(trace.first_call)))
