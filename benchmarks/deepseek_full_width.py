"""DeepSeek-V3 at full width on this CPU (issue 46): a synthetic checkpoint with DeepSeek-V3's exact tensor shapes
(recipes/configs/DeepSeek-V3/config.json: hidden 7168, 128 heads, MLA ranks 1536/512, 256 routed experts of 2048 + 1
shared, vocab 129,280) but 1 dense + 1 MoE layer, stored FP8 block-wise as the original ships (every decoder-layer
Linear weight but the router an F8_E4M3 `weight` with a float32 `weight_scale_inv` per 128x128 block; norms, router,
embeddings and head bf16), quantized with recipes/deepseek-r1-nvfp4.yaml (experts NVFP4; the plan's decision streams
the MoE layer expert by expert, llmc.quant.expert_stream) by benchmarks/_deepseek_quantize_child.py: the quantize
stage as the build runs it (written when `llmc quantize` still refused this machine for the export row's memory:
it checks only the stages it runs since).

    nice -n 10 python benchmarks/deepseek_full_width.py --work /tmp/i46-ds-full-width

Prints one JSON line: the plan's quantize row for this checkpoint (peak host RAM, disk, time, the decision) and what
the stage measured (peak RSS = VmHWM and peak RssAnon sampled every 0.5 s, its seconds, per layer and per expert, the
canonical output's size on disk and the work folder's peak while experts were spilled, the load average). The child
is stopped if the (shared) disk falls under --min-free-gb. The checkpoint and output are removed afterwards unless
--keep. Random codes: every byte but E4M3's two NaN codes, one 1 MiB block rotated per chunk (memcpy speed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc_status import memory_bytes  # noqa: E402
from full_width import ROOT, du  # noqa: E402

SHARD_BYTES = 2 << 30
BLOCK = 128
SCALE_INV = 5e-5  # a code of 448 decodes to 0.022: weights of a trained model's order


def fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3's checkpoint stores in FP8: the decoder layers' Linear weights but the router's."""
    return ".layers." in name and name.endswith(".weight") and len(shape) == 2 and not name.endswith("mlp.gate.weight")


def write_checkpoint(out: Path, layers: int, dense: int, tokenizer_from: Path, experts: int | None = None) -> dict:
    from llmc.planning.shapes import from_config

    config = json.loads((ROOT / "recipes" / "configs" / "DeepSeek-V3" / "config.json").read_text())
    config.update(num_hidden_layers=layers, first_k_dense_replace=dense)
    if experts is not None:  # fewer routed experts, every width kept (the expert-by-expert path's cost is per expert)
        config.update(n_routed_experts=experts)
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


SAMPLE_S = 0.5  # memory samples (the peaks are the layer's tensors, held for seconds, not transients)
DISK_EVERY = 10  # the work folder's size and the disk's free space every this many samples
EXPERT_LINE = re.compile(r'^llmc-progress (\{.*"stage": "layer \d+ experts".*\})$')


def run_quantize(work: Path, overrides: list[str], min_free: float) -> dict:
    """The quantize stage in a child (_deepseek_quantize_child.py) under nice, sampled: VmHWM and RssAnon, the output
    folder's size (codes written and experts spilled), the disk's free space; the child is stopped when less than
    `min_free` bytes are left (the disk is shared)."""
    cmd = ["nice", "-n", "10", sys.executable, str(Path(__file__).with_name("_deepseek_quantize_child.py")),
           str(work), *[a for o in overrides for a in ("--set", o)]]
    log = (work / "quantize.log").open("w")
    t0 = time.time()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak = {"VmHWM": 0, "RssAnon": 0, "out": 0}
    low = {"free": None, "stopped": None}
    loads: list[float] = []

    def sample() -> None:
        n = 0
        while child.poll() is None:
            fields = memory_bytes(child.pid, ("VmHWM", "RssAnon")) or {}
            for k, v in fields.items():
                peak[k] = max(peak[k], v)
            if n % DISK_EVERY == 0:
                loads.append(os.getloadavg()[0])
                peak["out"] = max(peak["out"], du(work / "out"))
                free = shutil.disk_usage(work).free
                low["free"] = free if low["free"] is None else min(low["free"], free)
                if free < min_free:
                    low["stopped"] = f"stopped: {free / 1e9:.1f} GB free on the shared disk"
                    child.terminate()
            n += 1
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = list(child.stdout)
    child.wait()
    sampler.join()
    log.close()
    out = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in lines if ln.startswith(("planned ", "done "))}
    layers = [float(ln.split()[2]) for ln in lines if ln.startswith("layer ")]
    experts = [json.loads(m.group(1))["elapsed_s"] for ln in (work / "quantize.log").read_text().splitlines()
               if (m := EXPERT_LINE.match(ln))]
    per_expert = [b - a for a, b in zip(experts, experts[1:])]
    return {"exit": child.returncode, "stopped": low["stopped"], "wall_s": time.time() - t0,
            "planned": json.loads(out["planned"]) if "planned" in out else None,
            "done": json.loads(out["done"]) if "done" in out else None,
            "layer_seconds": [b - a for a, b in zip([0.0, *layers], layers)],
            "experts_done": len(experts), "expert_s_median": sorted(per_expert)[len(per_expert) // 2]
            if per_expert else None, "expert_s_p10_p90": [sorted(per_expert)[len(per_expert) // 10],
                                                          sorted(per_expert)[9 * len(per_expert) // 10]]
            if per_expert else None,
            "peak_rss_gb": peak["VmHWM"] / 1e9, "peak_rss_anon_gb": peak["RssAnon"] / 1e9,
            "peak_out_gb": peak["out"] / 1e9, "min_free_gb": (low["free"] or 0) / 1e9,
            "output_gb": du(work / "out") / 1e9 if (work / "out").is_dir() else None,
            "load": [min(loads, default=0), max(loads, default=0)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dense", type=int, default=1, help="first_k_dense_replace")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts per MoE layer (default DeepSeek-V3's 256; a multiple of its 8 groups)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--min-free-gb", type=float, default=3.0, help="stop the child below this much free disk")
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
        written = write_checkpoint(ckpt, args.layers, args.dense, tokenizer, args.experts)
        os.sync()  # a user's checkpoint is on disk already: no write-back during the run
    write_s = time.time() - t
    shutil.rmtree(args.work / "out", ignore_errors=True)
    measured = run_quantize(args.work, args.overrides, args.min_free_gb * 1e9)
    planned = measured.pop("planned")
    row = {"cpu": "2-core AMD EPYC (AVX-512, avx512_bf16), shared", "overrides": args.overrides,
           "layers": args.layers, "dense": args.dense, "routed_experts": args.experts or 256,
           "checkpoint_gb": du(ckpt) / 1e9, "written": written, "write_checkpoint_s": write_s,
           "predicted": planned, "measured": measured}
    if planned:
        stage_s = (measured["done"] or {}).get("seconds")
        row["measured_vs_plan"] = {
            "peak_rss": measured["peak_rss_gb"] / planned["host_gb"] - 1,
            "disk": (measured["output_gb"] or 0) / planned["disk_gb"] - 1,
            "time": stage_s / planned["seconds"] - 1 if stage_s else None,
            # the plan costs every layer as the largest (the MoE one): the MoE layer against its per-layer figure
            "moe_layer_time": measured["layer_seconds"][-1] / planned["layer_seconds"] - 1
            if len(measured["layer_seconds"]) == args.layers else None}
    print(json.dumps(row, default=str), flush=True)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
