"""DeepSeek-V3 at full width on this CPU (issue 46): a synthetic checkpoint with DeepSeek-V3's exact tensor shapes
(recipes/configs/DeepSeek-V3/config.json: hidden 7168, 128 heads, MLA ranks 1536/512, 256 routed experts of 2048 + 1
shared, vocab 129,280) but 1 dense + 1 MoE layer, stored FP8 block-wise as the original ships (every decoder-layer
Linear weight but the router an F8_E4M3 `weight` with a float32 `weight_scale_inv` per 128x128 block; norms, router,
embeddings and head bf16), quantized by `llmc quantize` with recipes/deepseek-r1-nvfp4.yaml (experts NVFP4; the
plan's decision streams the MoE layer expert by expert, llmc.quant.expert_stream).

    nice -n 10 python benchmarks/deepseek_full_width.py --work /root/ds-full-width

Prints one JSON line: the plan's quantize row for this checkpoint (peak host RAM, disk, time, the decision) and what
`llmc quantize` measured (peak RSS = VmHWM, per-field peaks, wall time, quantize-stage seconds, per-layer seconds,
the canonical output's size on disk, the load average). The checkpoint and cache are removed afterwards unless
--keep. Random codes: every byte but E4M3's two NaN codes, one 1 MiB block rotated per chunk (memcpy speed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from full_width import ROOT, du, run_build  # noqa: E402

SHARD_BYTES = 2 << 30
BLOCK = 128
SCALE_INV = 5e-5  # a code of 448 decodes to 0.022: weights of a trained model's order
RECIPE = ROOT / "recipes" / "deepseek-r1-nvfp4.yaml"


def fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3's checkpoint stores in FP8: the decoder layers' Linear weights but the router's."""
    return ".layers." in name and name.endswith(".weight") and len(shape) == 2 and not name.endswith("mlp.gate.weight")


def write_checkpoint(out: Path, layers: int, dense: int, tokenizer_from: Path) -> dict:
    from llmc.planning.shapes import from_config

    config = json.loads((ROOT / "recipes" / "configs" / "DeepSeek-V3" / "config.json").read_text())
    config.update(num_hidden_layers=layers, first_k_dense_replace=dense)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / f).is_file():
            shutil.copyfile(tokenizer_from / f, out / f)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    shapes = from_config(plain).shapes
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (1 << 20,), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # E4M3's NaNs -> 1.0
    base = (torch.randn(1 << 20, generator=gen) * 0.02).to(torch.bfloat16)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = total = 0

    doubled = {torch.uint8: torch.cat([codes, codes]), torch.bfloat16: torch.cat([base, base])}

    def fill(t: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """`block` repeated, each chunk starting at another offset into it (slices of it doubled: no copy made)."""
        flat, n, src = t.view(-1), block.numel(), doubled[block.dtype]
        for i, start in enumerate(range(0, flat.numel(), n)):
            chunk = flat[start: start + n]
            offset = 7919 * i % n
            chunk.copy_(src[offset: offset + chunk.numel()])
        return t

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal size, total
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
        size += nbytes
        total += nbytes

    def flush() -> None:
        nonlocal shard, size
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            shard, size = {}, 0

    for name, shape in shapes.items():
        if fp8_linear(name, shape):
            add(name, fill(torch.empty(shape, dtype=torch.uint8), codes).view(torch.float8_e4m3fn))
            grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            add(f"{name}_scale_inv", torch.full(grid, SCALE_INV, dtype=torch.float32))
        elif len(shape) == 1:
            add(name, torch.ones(shape, dtype=torch.float32 if "e_score_correction_bias" in name else torch.bfloat16))
        else:
            add(name, fill(torch.empty(shape, dtype=torch.bfloat16), base))
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return {"bytes": total, "tensors": len(weight_map)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dense", type=int, default=1, help="first_k_dense_replace")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="use the checkpoint a --keep run left")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    tokenizer = resolve_source("demo:smollm2-135m", Store.default()).folder
    ckpt = args.work / "checkpoint"
    t = time.time()
    written = None
    if not (args.reuse and (ckpt / "model.safetensors.index.json").is_file()):
        shutil.rmtree(args.work, ignore_errors=True)
        written = write_checkpoint(ckpt, args.layers, args.dense, tokenizer)
        os.sync()  # a user's checkpoint is on disk already: no write-back during the run
    write_s = time.time() - t
    overrides = [f"model.source={ckpt}", "model.config=null", "calibration.samples=1", "calibration.seq_len=128",
                 *args.overrides]
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import load_recipe

    plan = make_plan(load_recipe(RECIPE, overrides), ckpt, refuse=False)
    predicted = plan.as_dict()["estimates"]
    row = next(r for r in plan.rows if r.name.startswith("quantize"))
    q = {**row.as_dict(), "parts_gb": {k: v / 1e9 for k, v in row.parts.items()}}
    cache = args.work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    measured = run_build(RECIPE, overrides, cache, args.work / "registry", args.work / "report", command="quantize")
    (args.work / "quantize.log").write_text(measured["stderr"])
    out = cache / "stages" / "quantize"
    row = {
        "cpu": "2-core AMD EPYC (AVX-512, avx512_bf16), shared", "overrides": overrides,
        "checkpoint_gb": du(ckpt) / 1e9, "written": written, "write_checkpoint_s": write_s,
        "predicted": {"quantize": q, "source_gb": predicted.get("source_gb")},
        "measured": {"exit": measured["exit"], "wall_s": measured["wall_s"], "peak_rss_gb": measured["peak_rss"] / 1e9,
                     "peak_gb": {k: v / 1e9 for k, v in measured["peak"].items()},
                     "layer_seconds": measured["layer_seconds"], "load_during": measured["load"],
                     "output_gb": du(out) / 1e9 if out.is_dir() else None},
        "tail": measured["stderr_tail"] or measured["stdout_tail"][-600:],
    }
    print(json.dumps(row), flush=True)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
