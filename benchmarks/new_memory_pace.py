"""How fast this machine hands a fresh process new memory, one GiB at a time.

    python benchmarks/new_memory_pace.py [--gib 6] [--out benchmarks/results/new_memory_pace_<date>_<cpu>.jsonl]
    python benchmarks/new_memory_pace.py --after-free 0 3 6 12 24 [--out ...]

A fresh process allocates and touches `--gib` tensors of 1 GiB one after another (`torch.ones`, float32), keeping
each, and prints one JSON line per tensor: its seconds and GB/s, MemFree before it, and whether the machine is a VM
that reports its free pages to its host (`llmc.planning.machine.memory_from_host`). On such a VM the first GiBs are
the pages freed in the last seconds (not yet handed back: memory speed) and the rest come at the host's pace, which
moves with the host's other guests and which no counter in the guest shows (docs/planner-constants.md#reclaim_rate).
The 7B-width stages of `benchmarks/plan_under_load.py` allocate GBs each, so their time follows this pace: run it
just before or after them, on a quiet machine.

`--after-free WAIT...`: how many of the pages a process has just freed the next allocation still gets at memory
speed, WAIT seconds after the free (the pool `llmc.planning.machine.HOST_POOL_BYTES` plans): for each WAIT, 4 GiB
touched and freed, then 5 GiB touched in 256 MiB chunks; one JSON line with the GB that came at over 1.5 GB/s before
the first slower chunk, and every chunk's GB/s. Each trial waits 30 s after the last before it starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from llmc.planning.machine import memory_free, memory_from_host
from llmc.planning.probes import fingerprint

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=6)
    ap.add_argument("--out", type=Path, help="append the rows to this file too")
    ap.add_argument("--after-free", type=float, nargs="+", metavar="WAIT",
                    help="seconds between a free and the next allocation, one trial each (module doc)")
    args = ap.parse_args()
    rows = after_free(args.after_free) if args.after_free else one_gib_at_a_time(args.gib)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


CHUNK = 256 << 20
FAST_GB_S = 1.5  # a chunk at least this fast came from the pages freed before it (the host's pace is ~0.3-0.7)


def after_free(waits: list[float]) -> list[dict]:
    rows = []
    reporting, cpu = memory_from_host(), fingerprint()["cpu"]
    for wait in waits:
        time.sleep(30)  # the previous trial's pages handed back first
        _touched_chunks(4 * GIB // CHUNK)  # touched, then freed as the result is dropped
        time.sleep(wait)
        kept, rates = _touched_chunks(5 * GIB // CHUNK)
        del kept
        fast = next((i for i, r in enumerate(rates) if r < FAST_GB_S), len(rates))
        row = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu, "wait_s": wait,
               "freed_gb": round(4 * GIB / 1e9, 2), "fast_gb": round(fast * CHUNK / 1e9, 2),
               "chunk_gb_per_s": [round(r, 2) for r in rates], "free_page_reporting": reporting}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _touched_chunks(n: int) -> tuple[list[torch.Tensor], list[float]]:
    kept, rates = [], []
    for _ in range(n):
        started = time.perf_counter()
        kept.append(torch.ones(CHUNK, dtype=torch.uint8))
        rates.append(CHUNK / (time.perf_counter() - started) / 1e9)
    return kept, rates


def one_gib_at_a_time(gib: int) -> list[dict]:
    kept, rows = [], []
    reporting, cpu = memory_from_host(), fingerprint()["cpu"]
    for i in range(gib):
        free = memory_free()
        started = time.perf_counter()
        kept.append(torch.ones(GIB // 4, dtype=torch.float32))
        seconds = time.perf_counter() - started
        row = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu, "gib_index": i,
               "seconds": round(seconds, 3), "gb_per_s": round(GIB / seconds / 1e9, 2),
               "mem_free_gb": round(free / 1e9, 2) if free is not None else None, "free_page_reporting": reporting}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
