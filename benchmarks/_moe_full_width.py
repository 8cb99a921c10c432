"""What benchmarks/deepseek_full_width.py and benchmarks/gptoss_full_width.py share (issue 46: a frontier MoE at its
full widths on this CPU, from the quantized original it ships as): the synthetic checkpoint's shards (`ShardWriter`,
random bytes from a 1 MiB block rotated per chunk: memcpy speed, not the RNG's), the quantize stage run in a child
(_moe_quantize_child.py) under nice and sampled (`run_quantize`), the plan against the measurement
(`against_plan`), and the command line both share (`main`).
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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc_status import memory_bytes  # noqa: E402
from full_width import ROOT, du  # noqa: E402

SHARD_BYTES = 2 << 30


def cpu_label() -> str:
    """This machine's CPU as the rows name it (read from /proc/cpuinfo: the VMs differ from one session to the next)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = ", ".join(f for f, present in (("AVX-512", "avx512f" in flags), ("avx512_bf16", "avx512_bf16" in flags),
                                          ("AMX", "amx_tile" in flags)) if present) or "AVX2, no AVX-512"
    return f"{os.cpu_count()}-core {name} ({isa}), shared"


CPU = cpu_label()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class Filler:
    """Fills tensors with a fixed random block per dtype, each chunk starting at another offset into it (slices of
    the block doubled: no copy made), so a 10 GB checkpoint is written at disk speed."""

    def __init__(self, blocks: dict[torch.dtype, torch.Tensor]) -> None:
        self.blocks = {dtype: torch.cat([b, b]) for dtype, b in blocks.items()}
        self.n = {dtype: b.numel() for dtype, b in blocks.items()}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        flat, n, src = t.view(-1), self.n[t.dtype], self.blocks[t.dtype]
        for i, start in enumerate(range(0, flat.numel(), n)):
            chunk = flat[start: start + n]
            offset = 7919 * i % n
            chunk.copy_(src[offset: offset + chunk.numel()])
        return t


class ShardWriter:
    """`add` tensors in order; shards of about SHARD_BYTES as the Hub's (model-0000N.safetensors) and the index."""

    def __init__(self, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self.out, self.shard_bytes = out, shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.size = self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size and self.size + nbytes > self.shard_bytes:
            self.flush()
        self.shard[name] = t
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if self.shard:
            file = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
            save_file(self.shard, str(self.out / file), metadata={"format": "pt"})
            self.weight_map.update({k: file for k in self.shard})
            self.shard, self.size = {}, 0

    def close(self) -> dict:
        self.flush()
        (self.out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, indent=2))
        return {"bytes": self.total, "tensors": len(self.weight_map)}


def start_checkpoint(out: Path, config: dict, tokenizer_from: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (tokenizer_from / f).is_file():
            shutil.copyfile(tokenizer_from / f, out / f)


SAMPLE_S = 0.5  # memory samples (the peaks are the layer's tensors, held for seconds, not transients)
DISK_EVERY = 10  # the work folder's size and the disk's free space every this many samples
EXPERT_LINE = re.compile(r'^llmc-progress (\{.*"stage": "layer \d+ experts".*\})$')


def run_quantize(work: Path, child_args: list[str], min_free: float) -> dict:
    """The quantize stage in a child (_moe_quantize_child.py) under nice, sampled: VmHWM and RssAnon, the output
    folder's size (codes written and experts spilled), the disk's free space; the child is stopped when less than
    `min_free` bytes are left (the disk is shared)."""
    cmd = ["nice", "-n", "10", sys.executable, str(Path(__file__).with_name("_moe_quantize_child.py")),
           str(work), *child_args]
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
    per_expert = sorted(b - a for a, b in zip(experts, experts[1:]))
    return {"exit": child.returncode, "stopped": low["stopped"], "wall_s": time.time() - t0,
            "planned": json.loads(out["planned"]) if "planned" in out else None,
            "done": json.loads(out["done"]) if "done" in out else None,
            "layer_seconds": [b - a for a, b in zip([0.0, *layers], layers)],
            "experts_done": len(experts),
            "expert_s_median": per_expert[len(per_expert) // 2] if per_expert else None,
            "expert_s_p10_p90": [per_expert[len(per_expert) // 10], per_expert[9 * len(per_expert) // 10]]
            if per_expert else None,
            "peak_rss_gb": peak["VmHWM"] / 1e9, "peak_rss_anon_gb": peak["RssAnon"] / 1e9,
            "peak_out_gb": peak["out"] / 1e9, "min_free_gb": (low["free"] or 0) / 1e9,
            "output_gb": du(work / "out") / 1e9 if (work / "out").is_dir() else None,
            "load": [min(loads, default=0), max(loads, default=0)]}


def against_plan(planned: dict, measured: dict, layers: int) -> dict:
    """Measured / planned - 1 for peak RSS (VmHWM: with the checkpoint's mapped pages; RssAnon: allocated, what
    the plan's host figure counts), the canonical output on disk, the stage's seconds and the last layer's."""
    stage_s = (measured["done"] or {}).get("seconds")
    return {"peak_rss": measured["peak_rss_gb"] / planned["host_gb"] - 1,
            "peak_rss_anon": measured["peak_rss_anon_gb"] / planned["host_gb"] - 1,
            "disk": (measured["output_gb"] or 0) / planned["disk_gb"] - 1,
            "time": stage_s / planned["seconds"] - 1 if stage_s else None,
            # the plan's per-layer figure is the largest layer's (a MoE one): the last layer against it
            "last_layer_time": measured["layer_seconds"][-1] / planned["layer_seconds"] - 1
            if len(measured["layer_seconds"]) == layers else None}


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--min-free-gb", type=float, default=3.0, help="stop the child below this much free disk")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="use the checkpoint a --keep run left")
    return ap


def main(args: argparse.Namespace, write: Callable[[Path, Path], dict], child_args: list[str],
         row: dict) -> dict:
    """Write the checkpoint (`write(folder, tokenizer_folder)`, unless --reuse finds one), run and sample the
    quantize stage, print and return one JSON row: `row`, the checkpoint, the plan, the measurement, the diff."""
    torch.set_num_threads(2)
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    tokenizer = resolve_source("demo:smollm2-135m", Store.default()).folder
    ckpt = args.work / "checkpoint"
    t = time.time()
    written = None
    if not (args.reuse and (ckpt / "model.safetensors.index.json").is_file()):
        shutil.rmtree(args.work, ignore_errors=True)
        written = write(ckpt, tokenizer)
        os.sync()  # a user's checkpoint is on disk already: no write-back during the run
    write_s = time.time() - t
    shutil.rmtree(args.work / "out", ignore_errors=True)
    measured = run_quantize(args.work, [*child_args, *[a for o in args.overrides for a in ("--set", o)]],
                            args.min_free_gb * 1e9)
    planned = measured.pop("planned")
    row = {"cpu": CPU, **row, "overrides": args.overrides, "checkpoint_gb": du(ckpt) / 1e9, "written": written,
           "write_checkpoint_s": write_s, "predicted": planned, "measured": measured}
    if planned:
        row["measured_vs_plan"] = against_plan(planned, measured, row.get("layers", 0))
    print(json.dumps(row, default=str), flush=True)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return row
