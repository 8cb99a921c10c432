"""How fast this machine hands a fresh process new memory, one GiB at a time.

    python benchmarks/new_memory_pace.py [--gib 6] [--out benchmarks/results/new_memory_pace_<date>_<cpu>.jsonl]

A fresh process allocates and touches `--gib` tensors of 1 GiB one after another (`torch.ones`, float32), keeping
each, and prints one JSON line per tensor: its seconds and GB/s, MemFree before it, and whether the machine is a VM
that reports its free pages to its host (`llmc.planning.machine.memory_from_host`). On such a VM the first GiBs are
the pages freed in the last seconds (not yet handed back: memory speed) and the rest come at the host's pace, which
moves with the host's other guests and which no counter in the guest shows (docs/planner-constants.md#reclaim_rate).
The 7B-width stages of `benchmarks/plan_under_load.py` allocate GBs each, so their time follows this pace: run it
just before or after them, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from llmc.planning.machine import memory_from_host
from llmc.planning.probes import fingerprint
from llmc.quant.activations import memory_free

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=6)
    ap.add_argument("--out", type=Path, help="append the rows to this file too")
    args = ap.parse_args()
    kept, rows = [], []
    reporting, cpu = memory_from_host(), fingerprint()["cpu"]
    for i in range(args.gib):
        free = memory_free()
        started = time.perf_counter()
        kept.append(torch.ones(GIB // 4, dtype=torch.float32))
        seconds = time.perf_counter() - started
        row = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu, "gib_index": i,
               "seconds": round(seconds, 3), "gb_per_s": round(GIB / seconds / 1e9, 2),
               "mem_free_gb": round(free / 1e9, 2) if free is not None else None, "free_page_reporting": reporting}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    sys.exit(main())
