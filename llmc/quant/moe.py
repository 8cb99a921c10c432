"""Mixture-of-Experts blocks as per-expert Linears, so every expert is quantized and calibrated on its own tokens.

transformers 5 keeps a Mixtral / Qwen3-MoE block's experts as two fused 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]) that no Linear hook sees. `unfuse_experts(model)` replaces each such
`experts` module by `ExpertLinears`: one `Expert` per index holding nn.Linear gate / up / down projections named
as the family's Hub checkpoints name them (Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}`, Qwen3-MoE
`mlp.experts.E.{gate_proj,up_proj,down_proj}`). Its forward is transformers' own routed loop (the block's router
picks top-k experts, each expert runs on the tokens routed to it, outputs weighted and index-added), so the
layer computes what it computed before and a hook on an expert's Linear sees only that expert's routed tokens.
Families differ only by their `MoeLayout` row (llmc.model.families): gpt-oss's experts are biased, its gate/up
interleaved in a transposed [E, H, 2I] tensor and activated by a clamped SwiGLU (`ClampedSwiGLU`); Llama-4's take
their input already scaled by the router (`ExpertLinears._scaled_input`); both families' Hub checkpoints hold the
fused tensors, split per expert as they are read (`per_expert_tensors`).

Memory: each expert Linear's weight is a *view* of the fused parameter (`gate_up_proj[e, :I]`), never a copy: an
unfused model takes no more memory than the fused one. In the layer stream the views are of meta tensors and are
replaced by the checkpoint's own per-expert tensors when a layer is read, so no fused tensor exists at all there
(gpt-oss, Llama-4: one layer's fused tensors, split into per-expert copies as it is read).

Because the block keeps its module path under the Hub name (Mixtral's decoder layer calls `self.mlp` but the Hub
names the block `block_sparse_moe`: the block is registered as `block_sparse_moe` and the layer's `mlp` attribute
still reaches it), checkpoint names, canonical names and the compressed-tensors export are one and the same.

The router (`gate`: a module with a [E, H] weight, not an nn.Linear) is kept as it is: never quantized; smoothing
of the norm before the experts scales its input columns too (`mappings.Mapping.also_scaled`).

Statistics: `observing_experts(layer, all_tokens, counts)` counts the tokens routed to each expert and, with
`all_tokens` (recipe `calibration.moe_calibrate_all_experts`), runs every expert on every token so its hooks see
all of them, while the block's output still takes only the routed rows (statistics only).
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmc.model.families import LAYOUTS, MoeLayout, all_experts_refused, experts_per_token
from llmc.model.skeleton import return_free_heap_to_os

if TYPE_CHECKING:
    from llmc.model.checkpoint import CheckpointReader


class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate) on the gate and up projections' outputs:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GatedActivation:
    """The SwiGLU of Mixtral / Qwen3-MoE experts: act(gate) * up."""

    def __init__(self, act_fn) -> None:
        self.act_fn = act_fn

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


def expert_activation(layout: MoeLayout, fused: nn.Module):
    """The function of (gate output, up output) the layout's experts compute, with the fused module's constants."""
    if layout.activation == "clamped_swiglu":
        return ClampedSwiGLU(float(fused.alpha), float(fused.limit))
    return GatedActivation(fused.act_fn)


class Expert(nn.Module):
    """One expert's gated MLP as three Linears under the family's names: down(glu(gate(x), up(x))), `glu` the
    layout's activation (GatedActivation: act(gate) * up; ClampedSwiGLU for gpt-oss)."""

    def __init__(self, layout: MoeLayout, gate: nn.Linear, up: nn.Linear, down: nn.Linear, glu) -> None:
        super().__init__()
        self.names = (layout.gate, layout.up, layout.down)
        for name, lin in zip(self.names, (gate, up, down)):
            self.add_module(name, lin)
        self.glu = glu

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.projections()
        return down(self.glu(gate(x), up(x)))


class ExpertLinears(nn.ModuleList):
    """Drop-in for transformers' fused experts module: same forward signature and arithmetic, per-expert Linears.
    `routing` is the layout's: "top_k" (hidden, top-k index, top-k weights) or "scaled_input" (Llama-4). `routers`:
    the block's routers by name (`block_routers`), where its children cannot say (Gemma-4, whose block is the
    decoder layer, holding other Linears)."""

    def __init__(self, experts: list[Expert], routing: str = "top_k", routers: tuple[str, ...] | None = None) -> None:
        super().__init__(experts)
        self.routing = routing
        self.routers = routers
        self.all_tokens = False  # statistics mode: every expert sees every token (output still routed)
        self.routed: torch.Tensor | None = None  # tokens routed per expert, counted while set
        # expert-by-expert streaming (llmc.quant.expert_stream): called instead of the loop, with the block's routing
        self.deferred = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.routing == "scaled_input":
            return self._scaled_input(hidden_states)
        if self.deferred is not None:
            return self.deferred(self, hidden_states, top_k_index, top_k_weights)
        final = torch.zeros_like(hidden_states)
        mask = self.routing_mask(top_k_index)
        for e in range(len(self)):
            self.add_expert(e, hidden_states, mask, top_k_weights, final)
        return final

    def routing_mask(self, top_k_index: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # [expert, top-k slot, token]; as transformers' loop, E + 1 classes
            return nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)

    def add_expert(self, e: int, hidden_states: torch.Tensor, mask: torch.Tensor, top_k_weights: torch.Tensor,
                   final: torch.Tensor) -> None:
        """Expert e's weighted outputs on its routed tokens, added into `final` (counted in `routed` while set)."""
        slot, token = torch.where(mask[e])
        if self.routed is not None:
            self.routed[e] += token.numel()
        if self.all_tokens:  # the Linears' hooks see every token; only the routed rows enter the output
            out = self[e](hidden_states)[token]
        elif token.numel() == 0:
            return
        else:
            out = self[e](hidden_states[token])
        out = out * top_k_weights[token, slot, None]
        final.index_add_(0, token, out.to(final.dtype))

    def _scaled_input(self, routed_in: torch.Tensor) -> torch.Tensor:
        """Llama-4's Llama4TextExperts.forward: `routed_in` [E * T, H] holds every token once per expert, scaled by
        that expert's sigmoid score, which is 0 exactly where the token is not routed to it (sigmoid(-inf)); expert e
        runs on its routed rows only (a zero row's output is 0 without biases, as transformers computes it), so its
        Linears' hooks see its routed tokens. Returns [E * T, H], the block sums over experts."""
        x = routed_in.view(len(self), -1, routed_in.shape[-1])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            token = x[e].ne(0).any(dim=-1).nonzero().flatten()
            if self.routed is not None:
                self.routed[e] += token.numel()
            if token.numel():
                out[e, token] = expert(x[e, token]).to(out.dtype)
        return out.view(-1, routed_in.shape[-1])


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3


def _linear_view(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear whose weight (and bias) is the given tensor itself (a view, no copy)."""
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


# the fused experts' tensors as transformers names them inside the `experts` module
FUSED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def split_experts(layout: MoeLayout, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                  down_bias: torch.Tensor | None) -> list[dict[str, torch.Tensor]]:
    """Per expert, its projections' nn.Linear tensors ({"gate.weight", "gate.bias", "up.weight", ..., "down.bias"};
    biases only where the layout has them) as *views* of the fused ones, as the layout says they are stored:
    [E, out, in] or transposed [E, in, out]; gate/up as halves or interleaved along the output dimension."""
    out = []
    for e in range(gate_up.shape[0]):
        gu, d = (gate_up[e].T, down[e].T) if layout.transposed else (gate_up[e], down[e])  # [2I, H], [H, I]
        if layout.gate_up == "interleaved":
            pick = (slice(0, None, 2), slice(1, None, 2))
        else:
            inter = gu.shape[0] // 2
            pick = (slice(0, inter), slice(inter, None))
        t = {"gate.weight": gu[pick[0]], "up.weight": gu[pick[1]], "down.weight": d}
        if layout.bias:
            t |= {"gate.bias": gate_up_bias[e][pick[0]], "up.bias": gate_up_bias[e][pick[1]], "down.bias": down_bias[e]}
        out.append(t)
    return out


def expert_linears(fused: nn.Module, layout: MoeLayout) -> ExpertLinears:
    """Per-expert Linears viewing `fused`'s 3-D parameters (llmc.quant.moe.split_experts: the layout's storage)."""
    bias = (fused.gate_up_proj_bias.data, fused.down_proj_bias.data) if layout.bias else (None, None)
    glu = expert_activation(layout, fused)
    experts = []
    for t in split_experts(layout, fused.gate_up_proj.data, fused.down_proj.data, *bias):
        experts.append(Expert(layout, *(_linear_view(t[f"{p}.weight"], t.get(f"{p}.bias")) for p in ("gate", "up", "down")),
                              glu))
    # a block that is the decoder layer itself (Gemma-4) holds other 2-D Linears beside its router: name it
    return ExpertLinears(experts, layout.routing, None if layout.block else (layout.router,))


def block_path(block: str, rest: str) -> str:
    """`rest` inside the MoE block `block` (layer-relative; "" where the decoder layer is the block: Gemma-4)."""
    return f"{block}.{rest}" if block else rest


def block_routers(block: nn.Module, experts: ExpertLinears) -> list[str]:
    """Block-relative names of `block`'s routers (kept in high precision): the layout's where the experts carry them,
    else every child with a 2-D weight beside the experts (a router or a shared expert's one-row gate)."""
    if experts.routers is not None:
        return list(experts.routers)
    return [n for n, m in block.named_children() if not isinstance(m, ExpertLinears)
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]


def per_expert_tensors(tensors: dict[str, torch.Tensor], layout: MoeLayout) -> dict[str, torch.Tensor]:
    """A layer's checkpoint tensors with the fused experts (`<block>.experts.gate_up_proj` ..., a family whose Hub
    checkpoints hold them so: `layout.checkpoint_fused`) replaced by per-expert ones under the Hub projection names
    (`<block>.experts.E.<gate>.weight` ...), each its own contiguous copy; other tensors pass through."""
    if not layout.checkpoint_fused:
        return tensors
    out = dict(tensors)
    # layer-relative names start at the block ("feed_forward.experts.gate_up_proj"), or at `experts` where the
    # layer is the block (Gemma-4)
    for name in [n for n in tensors if n == "experts.gate_up_proj" or n.endswith(".experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        parts = [out.pop(base + f, None) for f in FUSED_NAMES]
        if parts[1] is None:
            continue  # half a fused block: check_materialized names what is missing
        names = {"gate": layout.gate, "up": layout.up, "down": layout.down}
        for e, t in enumerate(split_experts(layout, *parts)):
            for key, value in t.items():
                proj, _, kind = key.partition(".")
                out[f"{base}{e}.{names[proj]}.{kind}"] = value.contiguous()
    return out


def read_layer(reader: CheckpointReader, prefix: str, layout: MoeLayout, encoded_experts: bool = True,
               widen_to: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A decoder layer's checkpoint tensors (`prefix`: the layer's; names layer-relative) as
    `per_expert_tensors(reader.with_prefix(prefix), layout)` gives them, each fused block read one expert at a time
    (`CheckpointReader.expert_slices`; an MXFP4 original's experts decoded one by one): the per-expert copies are
    made without the fused tensors existing whole beside them, which held gpt-oss-120b's 6.4 GB layer twice while
    it was split. The same tensors, bit for bit. `encoded_experts=False`: the fused expert weights a quantized
    original stores encoded are left unread (their codes pass through: llmc.quant.mxfp4_source.
    pass_through_layer_codes), their biases split as ever. `widen_to`: CheckpointReader.get_stored's."""
    names = [n for n in reader.names() if n.startswith(prefix)]
    local = {n[len(prefix):] for n in names}
    bases = [n[: -len("gate_up_proj")] for n in sorted(local) if layout.checkpoint_fused
             and (n == "experts.gate_up_proj" or n.endswith(".experts.gate_up_proj"))
             and n[: -len("gate_up_proj")] + "down_proj" in local]  # half a block: check_materialized names it
    fused = {b + f for b in bases for f in FUSED_NAMES}
    out = {n[len(prefix):]: t for n, t in reader.get_many([n for n in names if n[len(prefix):] not in fused],
                                                                 widen_to).items()}
    projections = {"gate": layout.gate, "up": layout.up, "down": layout.down}
    for base in bases:
        # an unread weight stands in as a meta tensor of its shape (split_experts picks the biases' rows by it)
        slices = [reader.expert_slices(prefix + base + f, widen_to) if base + f in local
                  and (encoded_experts or reader.encoded(prefix + base + f) is None)
                  else _meta_slices(reader, prefix + base + f) if base + f in local else itertools.repeat(None)
                  for f in FUSED_NAMES]
        for e, parts in enumerate(zip(*slices)):
            (one,) = split_experts(layout, *parts)  # views of expert e's slices, copied below
            for key, value in one.items():
                if value.is_meta:
                    continue  # an encoded weight left unread
                proj, _, kind = key.partition(".")
                out[f"{base}{e}.{projections[proj]}.{kind}"] = value.contiguous()
            del one, parts
            # an expert's read and decode temporaries, freed between the copies that stay, are heap holes glibc keeps:
            # 0.83 GB of a 1.65 GB gpt-oss-120b-width layer of 32 experts until trimmed
            return_free_heap_to_os()
    return out


def _meta_slices(reader: CheckpointReader, name: str) -> Iterator[torch.Tensor]:
    """Each expert's [1, ...] slice of the encoded fused tensor `name` as a meta tensor of its decoded shape."""
    shape = reader.encoded(name).shape
    return itertools.repeat(torch.empty((1, *shape[1:]), device="meta"), shape[0])


def per_expert_shapes(shapes: dict[str, tuple[int, ...]], layout: MoeLayout) -> dict[str, tuple[int, ...]]:
    """`per_expert_tensors` on shapes alone (the planner reads safetensors headers): done on meta tensors."""
    meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    return {n: tuple(t.shape) for n, t in per_expert_tensors(meta, layout).items()}


def layout_of(config) -> MoeLayout:
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    layout = LAYOUTS.get(model_type)
    if layout is None:
        from llmc.errors import IncompatibleTargetError

        raise IncompatibleTargetError(
            f"model_type {model_type!r} keeps fused experts llmc has no per-expert layout for",
            fix=f"use one of {', '.join(sorted(LAYOUTS))}, or a dense model",
        )
    return layout


def unfuse_experts(model: nn.Module) -> list[str]:
    """Replace every fused experts module of `model` by `ExpertLinears` (views), blocks under their Hub names.
    Returns the dotted names of the MoE blocks (empty for a dense model)."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(getattr(module, "experts", None), nn.Module) and _is_fused_experts(module.experts)]
    if not found:
        return []
    layout = layout_of(model.config)
    blocks = []
    for name, block in found:
        block.experts = expert_linears(block.experts, layout)
        if not layout.block:  # the decoder layer is the block (Gemma-4): nothing to rename
            blocks.append(name)
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if attr != layout.block:  # Mixtral: the layer calls self.mlp, the Hub names the block block_sparse_moe
            del parent._modules[attr]
            parent._modules[layout.block] = block
            object.__setattr__(parent, attr, block)  # the layer's forward still finds it; the module tree does not
        blocks.append(f"{parent_name}.{layout.block}")
    return blocks


def routed_blocks(layer: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertLinears]]:
    """(block name, block, its experts) for every unfused MoE block inside `layer` (names layer-relative)."""
    for name, module in layer.named_modules():
        if isinstance(getattr(module, "experts", None), ExpertLinears):
            yield name, module, module.experts


def expert_names(layer: nn.Module) -> dict[str, tuple[int, int]]:
    """Layer-relative name of every expert Linear -> (block index within the layer, expert index)."""
    out = {}
    for b, (name, _block, experts) in enumerate(routed_blocks(layer)):
        for e, expert in enumerate(experts):
            for proj in expert.names:
                out[block_path(name, f"experts.{e}.{proj}")] = (b, e)
    return out


@contextlib.contextmanager
def observing_experts(layer: nn.Module, all_tokens: bool, counts: dict[str, torch.Tensor] | None):
    """Inside: each MoE block of `layer` adds the tokens routed to each expert to `counts[block name]` (when
    `counts` is given) and, with `all_tokens`, runs every expert on every token (statistics only)."""
    blocks = list(routed_blocks(layer))
    for name, _block, experts in blocks:
        if all_tokens and experts.routing == "scaled_input":  # the plan refuses it first (families.check_all_experts)
            raise all_experts_refused(next((m.config.model_type for m in layer.modules() if hasattr(m, "config")),
                                           None))
        experts.all_tokens = all_tokens
        if counts is not None:
            experts.routed = counts.setdefault(name, torch.zeros(len(experts), dtype=torch.long))
    try:
        yield
    finally:
        for _name, _block, experts in blocks:
            experts.all_tokens, experts.routed = False, None


def default_min_tokens(calibration_tokens: int, experts: int, top_k: int) -> int:
    """A tenth of an even share of the routed tokens: what an expert gets if routing were uniform, / 10."""
    return max(1, calibration_tokens * top_k // max(experts, 1) // 10)


def starved_linears(layer: nn.Module, prefix: str, counts: dict[str, torch.Tensor], linears: dict) -> list[str]:
    """The target Linears (full names) of experts that received no token while their statistics were observed."""
    out = []
    for block, routed in counts.items():
        for e in (routed == 0).nonzero().flatten().tolist():
            for proj in layer.get_submodule(block_path(block, f"experts.{e}")).names:
                name = prefix + block_path(block, f"experts.{e}.{proj}")
                if name in linears:
                    out.append(name)
    return out


def proxy_input_ranges(stats, starved: list[str]) -> dict[str, str]:
    """Give each starved expert Linear the largest input range the layer's other experts saw for the same
    projection (its static activation scale then clips nothing any routed expert produced). Returns starved name ->
    what it was given, for the warning."""
    given = {}
    for name in starved:
        block, _, tail = name.rpartition(".experts.")
        proj = tail.split(".", 1)[1]
        peers = [n for n in stats.channel_absmax
                 if n != name and n.startswith(f"{block}.experts.") and n.endswith(f".{proj}") and n not in starved]
        if not peers:
            continue
        stats.channel_absmax[name] = torch.stack([stats.channel_absmax[n] for n in peers]).amax(dim=0)
        stats.input_absmax[name] = stats.channel_absmax[name].amax()
        given[name] = f"max over {len(peers)} other experts' {name.rsplit('.', 1)[1]}"
    return given


# --------------------------------------------------------------------------- the per-expert token report

TOKENS_FILE = "moe_tokens.json"


@dataclass
class TokenReport:
    """Tokens routed to each expert of each MoE block during calibration (`moe_tokens.json` in the quantized form,
    and `moe.tokens` in quantized.json), with the experts under the threshold and what the starved ones got."""

    all_experts: bool
    blocks: dict  # full block name -> {"layer", "tokens", "min_tokens", "below", "starved"}

    @classmethod
    def load(cls, folder, all_experts: bool) -> TokenReport:
        """The report a killed run left (its layers are not calibrated again on resume), else an empty one."""
        import json
        from pathlib import Path

        f = Path(folder) / TOKENS_FILE
        saved = json.loads(f.read_text()) if f.is_file() else {}
        if saved.get("calibrate_all_experts") != all_experts:
            saved = {}
        return cls(all_experts, saved.get("blocks", {}))

    def add(self, layer_index: int, prefix: str, routed: dict[str, torch.Tensor], proxies: dict[str, str],
            min_tokens: int | None, calibration_tokens: int, config: dict) -> None:
        from llmc.telemetry.progress import log

        for block, counts in routed.items():
            tokens = counts.tolist()
            top_k = experts_per_token(config) or 1
            threshold = min_tokens if min_tokens is not None else default_min_tokens(calibration_tokens, len(tokens),
                                                                                     top_k)
            below = [e for e, n in enumerate(tokens) if n < threshold]
            starved = [e for e, n in enumerate(tokens) if n == 0] if not self.all_experts else []
            name = full_block_name(prefix, block)
            block = block or "experts"  # Gemma-4: the layer is the block
            self.blocks[name] = {"layer": layer_index, "tokens": tokens, "min_tokens": threshold, "below": below,
                                 "starved": starved}
            log(f"layer {layer_index} {block}: calibration tokens routed to experts 0..{len(tokens) - 1}: {tokens}")
            if below:
                log(f"warning: layer {layer_index} {block}: experts {below} were routed fewer than {threshold} "
                    f"calibration tokens ({', '.join(str(tokens[e]) for e in below)})"
                    + ("; their statistics still come from every token (moe_calibrate_all_experts)" if self.all_experts
                       else "; their scales rest on few tokens: fix: calibration.moe_calibrate_all_experts: true, "
                            "or more calibration.samples"))
            if starved:
                given = sorted({v for k, v in proxies.items() if k.startswith(name + ".")})
                log(f"warning: layer {layer_index} {block}: experts {starved} received no calibration token: their "
                    "weights are quantized by round-to-nearest from their own range"
                    + (f", their static input scales are the {'; '.join(given)}" if given else ""))

    def save(self, folder) -> None:
        from pathlib import Path

        from llmc.storage.store import atomic_write_json

        atomic_write_json(Path(folder) / TOKENS_FILE, self.to_dict())

    def to_dict(self) -> dict:
        return {"calibrate_all_experts": self.all_experts, "blocks": self.blocks}


def full_block_name(prefix: str, block: str) -> str:
    """A block's full name from its layer's prefix ("model.layers.3.") and its layer-relative name ("" for Gemma-4,
    whose layer is the block: "model.layers.3")."""
    return prefix + block if block else prefix.rstrip(".")


def layer_routers(layer: nn.Module) -> set[str]:
    """Layer-relative names of the routers of `layer`'s MoE blocks: kept in high precision even where they are
    nn.Linear (Llama-4's Llama4Router, Gemma-4's router.proj)."""
    return {block_path(name, n) for name, block, experts in routed_blocks(layer)
            for n in block_routers(block, experts)}


def router_names(model: nn.Module, blocks: list[str]) -> list[str]:
    """The full names of the routers of `blocks` (kept in high precision)."""
    out = []
    for name in blocks:
        block = model.get_submodule(name)
        out += [f"{name}.{n}" for n in block_routers(block, block.experts)]
    return out


def canonical_entry(model: nn.Module, blocks: list[str], report: TokenReport | None) -> dict:
    """quantized.json's `moe` entry: the family's Hub layout, the blocks, the routers (unquantized, which the
    exports' ignore lists name) and the token report."""
    layout = layout_of(model.config)
    routers = router_names(model, blocks)
    return {
        "layout": {"block": layout.block, "gate": layout.gate, "up": layout.up, "down": layout.down},
        "blocks": blocks,
        "routers": routers,
        "ignore": ["re:.*\\." + re.escape(block_path(layout.block, layout.router)) + "$"],
        "tokens": report.to_dict() if report is not None else None,
    }


def check_materialized(layer: nn.Module, prefix: str, folder,
                       unread: Callable[[str], bool] = lambda name: False) -> None:
    """InputError when the checkpoint left a parameter of an MoE layer unread (a checkpoint holding fused 3-D
    experts, `experts.gate_up_proj`, instead of the Hub's per-expert tensors): caught here, not as a meta tensor
    deep inside a forward. `unread(name)`: a parameter left unread on purpose (a routed expert's weight whose
    stored codes pass through)."""
    missing = [n for n, p in layer.named_parameters() if p.is_meta and not unread(n)]
    if missing:
        from llmc.errors import InputError

        raise InputError(
            f"{folder}: no tensor for {prefix}{missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                                 else "")
            + ": llmc reads Mixture-of-Experts experts per expert under the Hub checkpoint names "
            "(…experts.<e>.w1.weight / …experts.<e>.gate_proj.weight), not fused 3-D tensors (…experts.gate_up_proj)",
            fix="save the model with transformers' save_pretrained, which writes the per-expert Hub layout",
        )
