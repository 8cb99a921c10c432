"""AWQ on one decoder layer of a model's width on the host: the layer's AWQ time against the floor (one plain forward
of the same calibration tokens through the same layer, `_layer_floor.floor_seconds`), where the time goes (each
mapping's scale search, the clip search), what it chose and the quantized layer's error.

    PYTHONPATH=$PWD python benchmarks/awq_layer_cpu.py --model Llama-3.1-8B --samples 4 --seq-len 512 \
        --save /tmp/awq-after.pt > after.json

The layer is random (normal 0.02 weights, seeded) and its inputs random with a few outlier channels (as trained
models' residual streams have, so the search has something to find); the same seed builds the same layer and
inputs in every run, so two runs of two llmc versions (PYTHONPATH) compare their choices: `--compare` reads two
`--save` files and prints how many scales and clipping bounds agree. Quality: the relative error of the layer's
output with every Linear quantized after AWQ (what the export stores), on held-out inputs; RTN's beside it.
One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from _layer_floor import floor_seconds
from llmc.quant.algorithms import awq
from llmc.quant.algorithms.catalog import Observe
from llmc.quant.observe import LayerStats, observing
from llmc.quant.spec import TensorSpec

ROOT = Path(__file__).resolve().parents[1]
OUTLIERS = 8  # input channels 20x the rest


def build_layer(config_dir: Path, dtype: torch.dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**json.loads((config_dir / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    layer = layer.to_empty(device="cpu").to(dtype)
    for name, p in layer.named_parameters():
        p.data.normal_(0, 0.02) if p.dim() == 2 else p.data.fill_(1.0)
    return layer.eval(), LlamaRotaryEmbedding(config), config


def inputs(samples: int, seq_len: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, seq_len, hidden, generator=g)
    x[..., :OUTLIERS] *= 20
    return x.to(dtype)


def forward(layer: nn.Module, rotary, x: torch.Tensor, batch: int) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None]
    pe = rotary(x[:1], positions)
    with torch.no_grad():
        outs = [layer(c, position_embeddings=pe, attention_mask=None, position_ids=positions) for c in x.split(batch)]
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs])


def quantized_error(layer: nn.Module, rotary, x: torch.Tensor, reference: torch.Tensor, spec: TensorSpec,
                    batch: int) -> float:
    """Relative error of the layer's output with every Linear quantized (RTN on its current weights)."""
    saved = {n: m.weight.data for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    for n, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            m.weight.data = awq.fake_quantize_weight(m.weight.data, spec)
    out = forward(layer, rotary, x, batch)
    for n, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            m.weight.data = saved[n]
    return float((out - reference).float().norm() / reference.float().norm())


def timed(fn, log: list, label) -> object:
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        log.append((label(args, out), time.perf_counter() - t))
        return out
    return wrapper


def run_awq(layer: nn.Module, rotary, calib: torch.Tensor, spec: TensorSpec, options, batch: int) -> dict:
    """Capture the module calls as the stream does, run `awq_layer`, and time each mapping's search and each clip."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    stats = LayerStats()
    with observing(layer, linears, stats, {}, Observe(hessians=False, module_calls=awq.awq_module_calls(layer))):
        forward(layer, rotary, calib, batch)
    parts: list = []
    scales: dict = {}
    names = {id(m): n for n, m in layer.named_modules()}

    def mapping_label(args, out):
        scales[names[id(args[0])]] = out.detach().float().clone()
        return f"scale:{names[id(args[0])]}"

    original = (awq._search_mapping, awq.search_clip)
    awq._search_mapping = timed(awq._search_mapping, parts, mapping_label)
    def clip_label(args, out):
        return "clip:" + next(n for n, m in linears.items() if m.weight.data_ptr() == args[0].data_ptr())

    awq.search_clip = timed(awq.search_clip, parts, clip_label)
    try:
        t = time.perf_counter()
        awq.awq_layer(layer, "", stats, spec, options)
        total = time.perf_counter() - t
    finally:
        awq._search_mapping, awq.search_clip = original
    bounds = {n: awq.grouped_view(m.weight.data.float(), spec).abs().amax(dim=-1) for n, m in linears.items()}
    return {"seconds": total, "parts": parts, "scales": scales, "bounds": bounds}


def compare(a_path: str, b_path: str) -> dict:
    a, b = torch.load(a_path), torch.load(b_path)
    out = {"scales_equal": {k: bool(torch.equal(a["scales"][k], b["scales"][k])) for k in a["scales"]},
           "scales_max_rel_diff": {k: float(((a["scales"][k] - b["scales"][k]).abs() / a["scales"][k]).max())
                                   for k in a["scales"]}}
    out["bounds_equal_fraction"] = {k: float((a["bounds"][k] == b["bounds"][k]).float().mean()) for k in a["bounds"]}
    return out


def parts_against(before_dir: Path, config_dir: Path, tokens: int, group_size: int, with_linear: bool = True) -> dict:
    """The parts this change made cheaper, timed with this llmc's awq.py and with `before_dir`'s (loaded beside it;
    both use this llmc's numerics), on the down projection [hidden, intermediate] in float32 with `tokens` input
    rows: fake quantization of the weight, the lone-Linear search (s = 1 and one ratio: the Gram matrix and two
    candidates, or two candidates on the rows), and the clip search on AwqOptions' default sample."""
    import importlib.util

    spec_before = importlib.util.spec_from_file_location(
        "awq_before", before_dir / "llmc" / "quant" / "algorithms" / "awq.py")
    before = importlib.util.module_from_spec(spec_before)
    from llmc.quant.algorithms import registry

    register = registry.register  # this llmc registered "awq" already: the old copy's decorator registers nothing
    registry.register = lambda *a, **k: (lambda fn: fn)
    try:
        spec_before.loader.exec_module(before)
    finally:
        registry.register = register
    config = json.loads((config_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    spec = TensorSpec("int4", "group", group_size=group_size)
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(inter, hidden, bias=False)
    lin.weight.data = torch.randn(hidden, inter, generator=g) * 0.02
    x = torch.randn(tokens, inter, generator=g)
    x[:, :OUTLIERS] *= 20
    x_mean = x.abs().mean(0)
    calls = [((x,), {})]
    two = awq.AwqOptions(n_grid=1, search="grid")  # s = 1 and ratio 0
    out: dict = {}
    for label, module in (("before", before), ("after", awq)):
        timings = {}
        t = time.perf_counter()
        q = module.fake_quantize_weight(lin.weight.data, spec)
        timings["fake_quantize_s"] = time.perf_counter() - t
        s = None
        if with_linear:
            t = time.perf_counter()
            s = module._search_linear(lin, calls, x_mean, None, spec, two)
            timings["linear_search_2_candidates_s"] = time.perf_counter() - t
        t = time.perf_counter()
        clipped = module.search_clip(lin.weight.data, x, spec)
        timings["clip_search_s"] = time.perf_counter() - t
        out[label] = {"timings": timings, "q": q, "s": s, "clipped": clipped}
    b, a = out["before"], out["after"]
    bounds = [awq.grouped_view(v["clipped"], spec).abs().amax(dim=-1) for v in (b, a)]
    return {
        "weight": [hidden, inter], "tokens": tokens,
        "before": b["timings"], "after": a["timings"],
        "fake_quantize_equal": bool(torch.equal(b["q"], a["q"])),
        "linear_search_same_scale": bool(torch.equal(b["s"], a["s"])) if with_linear else None,
        "clip_bounds_equal_fraction": float((bounds[0] == bounds[1]).float().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Llama-3.1-8B", help="a folder name under recipes/configs/, or a folder with a config.json")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="sequences per call (the stream's batch)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--search", default="refine", choices=["refine", "grid"])
    ap.add_argument("--clip-tokens", type=int, default=awq.AwqOptions().clip_tokens,
                    help="rows the clip search samples (AwqOptions.clip_tokens)")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor (a second run of the same shape)")
    ap.add_argument("--save", help="write the chosen scales and clipping bounds here (torch.save)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --save files and exit")
    ap.add_argument("--parts-against", metavar="DIR",
                    help="time the changed parts against the awq.py of the llmc tree in DIR instead, and exit")
    ap.add_argument("--skip-linear", action="store_true", help="with --parts-against: not the lone-Linear search")
    args = ap.parse_args()
    if args.parts_against:
        config_dir = Path(args.model) if Path(args.model).is_dir() else ROOT / "recipes" / "configs" / args.model
        print(json.dumps({"model": args.model, **parts_against(Path(args.parts_against), config_dir,
                                                               args.samples * args.seq_len, args.group_size,
                                                               not args.skip_linear),
                          "load": list(os.getloadavg())}))
        return
    if args.compare:
        print(json.dumps(compare(*args.compare)))
        return
    dtype = getattr(torch, args.dtype)
    config_dir = Path(args.model) if Path(args.model).is_dir() else ROOT / "recipes" / "configs" / args.model
    spec = TensorSpec("int4", "group", group_size=args.group_size)
    options = awq.AwqOptions(search=args.search, clip_tokens=args.clip_tokens)
    floor = None if args.no_floor else floor_seconds(config_dir, args.samples, args.seq_len, dtype,
                                                     torch.device("cpu"))
    layer, rotary, config = build_layer(config_dir, dtype)
    calib = inputs(args.samples, args.seq_len, config.hidden_size, dtype, seed=1)
    heldout = inputs(2, args.seq_len, config.hidden_size, dtype, seed=2)
    reference = forward(layer, rotary, heldout, args.batch)
    rtn_error = quantized_error(layer, rotary, heldout, reference, spec, args.batch)
    result = run_awq(layer, rotary, calib, spec, options, args.batch)
    awq_error = quantized_error(layer, rotary, heldout, reference, spec, args.batch)
    if args.save:
        torch.save({"scales": result["scales"], "bounds": result["bounds"]}, args.save)
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "tokens": args.samples * args.seq_len, "seq_len": args.seq_len,
        "batch": args.batch, "group_size": args.group_size, "search": args.search, "clip_tokens": args.clip_tokens,
        "awq_layer_s": result["seconds"], "floor_s": floor,
        "x_floor": result["seconds"] / floor if floor else None,
        "parts_s": [[label, round(s, 3)] for label, s in result["parts"]],
        "layer_rel_error_awq": awq_error, "layer_rel_error_rtn": rtn_error,
        "llmc": str(Path(awq.__file__).resolve().parents[3]), "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "load": list(os.getloadavg()),
    }))


if __name__ == "__main__":
    main()
