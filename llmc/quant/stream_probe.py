"""What the stream costs per decoder layer beyond its arithmetic and its bytes, timed on the stream itself.

Each layer `quantize_model` streams is also made durable and cleaned up after: the layer's file, the next layer's
inputs as a resume point, progress.json and (a scheme calibrated on original outputs) the shared calibration
statistics, each written to a temporary name, fsynced, renamed and its folder fsynced; the layer's memory returned to
the OS (malloc_trim); its hooks and its writer thread's hand-offs. None of it follows the forward's FLOPs or the
layer's bytes; all of it follows the disk's fsync latency and how busy the machine is. So the planner times it the
way it times the matmul rate, by running it: `quantize_model` on a tiny random Llama (widths of 128, `PROBE_LAYERS`
layers, written once into the llmc cache: _tiny_model), the time between its first and last layers' commits, per
layer. The tiny model's arithmetic is a few milliseconds of it."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmc import distributed
from llmc.errors import LlmcError
from llmc.model.source import ModelSource
from llmc.planning import probes
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, StreamOptions, quantize_model
from llmc.storage.store import Store, stage_key
from llmc.telemetry import events, progress

PROBE_LAYERS = 5
PROBE_CONFIG = {  # widths every group size divides (NVFP4 16, MX 32, block FP8 128)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": PROBE_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
PROBE_WINDOWS, PROBE_SEQ_LEN = 4, 32
# what a calibrated scheme's stream writes per layer at most (static activation ranges and KV-cache scales: it shares
# its statistics), and a data-free one's
_CALIBRATED = Scheme(TensorSpec("fp8_e4m3", "tensor"), activations=TensorSpec("fp8_e4m3", "tensor"),
                     kv_cache=TensorSpec("fp8_e4m3", "tensor"))
_DATA_FREE = Scheme(TensorSpec("fp8_e4m3", "channel"))


def layer_overhead_seconds(calibrated: bool, dtype_name: str) -> float:
    """Seconds the stream spends per decoder layer on what its forward and its bytes do not count (module doc),
    for a scheme that calibrates (or not) computed in `dtype_name` on this machine's CPU: probed, and cached per
    machine like every rate (llmc.planning.probes)."""
    key = f"stream layers {'calibrated' if calibrated else 'data-free'} {dtype_name}"
    return 1.0 / probes.rate(key, _stream_timer(calibrated, dtype_name), repeats=3)


MODEL_STAGE = "stream-probe-model"


def _tiny_model(scratch: Path) -> Path:
    """The tiny model the probe streams. It is deterministic, so it is made once in the llmc cache that keeps the
    probes' rates, as a stage output keyed by its config (written under its key's lock to a `.partial` folder that
    the next writer or `llmc build`'s sweep removes if a process is killed midway, then renamed whole) and reused by
    every later process, so a process killed by SIGTERM or SIGKILL leaves no model behind in the temporary folder
    (only a run's own output, in `scratch`, if killed during the second or so the run takes). Without a rates cache
    (probes.use_cache(None)), or with one this process cannot write (read-only), in `scratch`, which the caller
    removes."""
    rates = probes.book().path
    if rates is not None:
        try:
            return Store(rates.parent).materialized(
                MODEL_STAGE, stage_key(MODEL_STAGE, {"config": PROBE_CONFIG, "seed": 0}), _write_tiny_model)
        except (OSError, LlmcError):  # a cache that cannot be written costs a write per run, never the plan
            pass
    _write_tiny_model(scratch / "model")
    return scratch / "model"


def _write_tiny_model(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    c = PROBE_CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "model.norm.weight": torch.ones(h),
               "lm_head.weight": torch.randn(v, h, generator=g) * 0.05}
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    for n in range(PROBE_LAYERS):
        p = f"model.layers.{n}."
        tensors |= {f"{p}{name}.weight": torch.randn(*shape, generator=g) * 0.05 for name, shape in shapes.items()}
        tensors |= {f"{p}input_layernorm.weight": torch.ones(h), f"{p}post_attention_layernorm.weight": torch.ones(h)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c))


def _stream_timer(calibrated: bool, dtype_name: str):
    def run_once() -> float:
        with tempfile.TemporaryDirectory(prefix="llmc-stream-probe-") as tmp:
            committed: list[float] = []
            windows = (Calibration(torch.randint(0, PROBE_CONFIG["vocab_size"], (PROBE_WINDOWS, PROBE_SEQ_LEN),
                                                 generator=torch.Generator().manual_seed(0)),
                                   shared_stats=Path(tmp) / "shared-stats") if calibrated else None)
            # the tiny model's layers are not the build's; under torchrun this rank times them on its own (the
            # others are not running the probe: they wait for its cached rate, llmc.build)
            with progress.quiet(), events.muted(), distributed.alone():  # the model's writing is silent too
                source = ModelSource(_tiny_model(Path(tmp)), sha256="stream-probe", origin="stream-probe")
                quantize_model(source, _CALIBRATED if calibrated else _DATA_FREE, Path(tmp) / "out", windows,
                               StreamOptions(dtype=getattr(torch, dtype_name),
                                             on_layer_done=lambda i: committed.append(time.monotonic())))
        return (len(committed) - 1) / (committed[-1] - committed[0])  # layers/s
    return run_once
