"""RssAnon and VmHWM around one gpt-oss-120b-width layer's read (issue 46): the fused experts split whole
(`per_expert_tensors(reader.with_prefix(...))`, as the layer stream read them before 57da633) or read one expert at
a time (`moe.read_layer`), then after malloc_trim. Checkpoint: benchmarks/gptoss_full_width.py --keep.

    PYTHONPATH=. nice -n 10 python benchmarks/gptoss_read_rss.py <work>/checkpoint whole|slices
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from llmc.model.checkpoint import CheckpointReader
from llmc.model.families import LAYOUTS
from llmc.model.skeleton import return_free_heap_to_os
from llmc.quant import moe


def memory_kb() -> dict[str, int]:
    return {ln.split(":")[0]: int(ln.split()[1]) for ln in open("/proc/self/status")
            if ln.startswith(("RssAnon", "VmHWM"))}


def main() -> None:
    torch.set_num_threads(2)
    reader = CheckpointReader(Path(sys.argv[1]), torch.bfloat16)
    layout = LAYOUTS["gpt_oss"]
    print("start", memory_kb())
    t = time.time()
    if sys.argv[2] == "whole":
        got = moe.per_expert_tensors(reader.with_prefix("model.layers.0."), layout)
    else:
        got = moe.read_layer(reader, "model.layers.0.", layout)
    held = sum(v.numel() * v.element_size() for v in got.values())
    print(sys.argv[2], f"{time.time() - t:.1f} s, held {held / 1e9:.3f} GB", memory_kb())
    return_free_heap_to_os()
    print("after malloc_trim", memory_kb())


if __name__ == "__main__":
    main()
