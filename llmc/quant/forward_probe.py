"""How much of the matmul probe's rate one decoder layer's forward reaches on this machine's CPU, timed on a layer of
the model's own widths.

The planner costs a forward's GEMMs and attention from the probed matmul rate (llmc.planning.machine.
forward_seconds). What runs between the GEMMs (the RMSNorms, rotary embedding, attention's softmax, the MLP's
activation and, calibrating, the stream's range-observing hooks on every Linear) follows the tokens times the width,
not the FLOPs, so at a small model's width it is a share of the forward that no matmul rate sees: SmolLM2's layer over
4 x 256 tokens in float32 reached 0.56 of the probed rate on the Xeon of 2026-12-03, where the constant said 0.75,
and the quantize stage and the baseline's evaluation were planned 27-39% short (docs/planner.md, Accuracy). So where a
layer is small enough to build and run in about a second, the plan times one, the way it times the matmul: a
Llama-shaped layer (transformers' LlamaDecoderLayer: the model's hidden and MLP widths, heads, key/value heads and
head size) over one batch of the stage's shape, as the stream runs it where the stage calibrates (`_call`), and reads the
share of the matmul rate it reached. A wider layer keeps the constant (llmc.planning.machine.forward_efficiency):
its GEMMs are most of its forward there."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.planning import probes
from llmc.planning.machine import forward_efficiency, forward_seconds
from llmc.planning.shapes import Shape

# a layer built and timed at the model's widths only up to this many weights (SmolLM2's is 3.5 M, a 1B Llama's 60 M)
# and a call predicted to take at most MAX_CALL_S at the constant's efficiency: each timed run repeats it for
# probes.MIN_SAMPLE_S
MAX_LAYER_PARAMS = 64 * 2**20
MAX_CALL_S = 0.5


@dataclass(frozen=True)
class LayerWidths:
    """The widths that set a dense decoder layer's forward."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, shape: Shape) -> LayerWidths | None:
        """A dense model's layer widths; None for a Mixture-of-Experts one (its layer is not this layer)."""
        if shape.active < 1 or not shape.heads:
            return None
        return cls(shape.hidden, shape.intermediate, shape.heads, shape.kv_heads or shape.heads,
                   shape.attn_width // shape.heads)

    @property
    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate

    def ideal_seconds(self, batch: int, seq_len: int, compute: str) -> float:
        """The forward over one batch at the full probed matmul rate (efficiency 1)."""
        tokens = batch * seq_len
        return forward_seconds(2 * tokens * self.params, 2 * tokens * seq_len * self.heads * self.head_dim,
                               compute=compute, device="cpu", width=self.hidden, rows=tokens, efficiency=1.0)


def measured_efficiency(shape: Shape, *, batch: int, seq_len: int, compute: str, device: str,
                        observed: bool) -> float | None:
    """The share of the probed matmul rate the forward of `shape`'s decoder layer over `batch` sequences of
    `seq_len` tokens reaches in `compute` on this CPU (with the stream's range-observing hooks when `observed`),
    probed and cached per machine like every rate; None on a GPU, for a Mixture-of-Experts layer, or for a layer too
    large to time in a moment (module doc): the constant's then."""
    widths = LayerWidths.of(shape) if device == "cpu" else None
    if widths is None:
        return None
    ideal = widths.ideal_seconds(batch, seq_len, compute)
    if widths.params > MAX_LAYER_PARAMS or ideal / forward_efficiency(compute, device) > MAX_CALL_S:
        return None
    key = (f"layer forward {compute} cpu hidden={widths.hidden} intermediate={widths.intermediate} "
           f"heads={widths.heads}/{widths.kv_heads}x{widths.head_dim} tokens={batch}x{seq_len}"
           + (" observed" if observed else ""))
    probe = probes.measured(key, _forward_timer(widths, batch, seq_len, compute, observed), repeats=3)
    if not probe.samples:  # another machine's rates (llmc plan --machine) without this layer's: the constant's
        return None
    return ideal * probe.read(probes.current_reading())


def _forward_timer(widths: LayerWidths, batch: int, seq_len: int, compute: str, observed: bool):
    """A function timing the layer's forward and returning calls/s; the layer and its inputs are made on the first
    run (its first call untimed: the first forward's allocations) and kept for the others."""
    state: dict = {}

    def run_once() -> float:
        if not state:
            state.update(_layer_and_inputs(widths, batch, seq_len, getattr(torch, compute)))
            _call(state, observed)
        return probes.sustained_rate(1.0, lambda: _call(state, observed))

    return run_once


def _layer_and_inputs(widths: LayerWidths, batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=widths.hidden, intermediate_size=widths.intermediate,
                         num_attention_heads=widths.heads, num_key_value_heads=widths.kv_heads,
                         head_dim=widths.head_dim, num_hidden_layers=1, vocab_size=256)
    config._attn_implementation = "sdpa"  # the calibration forward's and the torch engine's
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    layer = layer.to_empty(device="cpu").to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():  # ones for the norms, small weights elsewhere: no denormals
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=g).to(dtype) * 0.02)
    hidden = torch.randn(batch, seq_len, widths.hidden, generator=g).to(dtype)
    positions = torch.arange(seq_len)[None].expand(batch, seq_len)
    rotary = LlamaRotaryEmbedding(config)
    return {"layer": layer, "hidden": hidden, "positions": positions,
            "position_embeddings": tuple(t.to(dtype) for t in rotary(hidden, positions))}


def _call(state: dict, observed: bool) -> None:
    """One forward, as the calibration stream runs it when `observed`: the heap returned to the OS first (the stream
    does after every layer, so each layer's forward allocates its temporaries anew: 10-25 ms of SmolLM2's layer on
    the Xeon of 2026-12-03), range-observing hooks on every Linear and the key/value observer on the attention."""
    from llmc.model.skeleton import return_free_heap_to_os
    from llmc.quant.observe import RANGES_ONLY, LayerStats, observing, register_kv_observer

    layer = state["layer"]
    with torch.no_grad():
        if observed:
            register_kv_observer()
            return_free_heap_to_os()
            linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
            with observing(layer, linears, LayerStats(), {"self_attn": layer.self_attn}, RANGES_ONLY):
                layer(state["hidden"], position_embeddings=state["position_embeddings"],
                      position_ids=state["positions"])
        else:
            layer(state["hidden"], position_embeddings=state["position_embeddings"], position_ids=state["positions"])
