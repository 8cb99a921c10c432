"""AWQ's search costs at a model's full width, the parts the planner times (llmc.pipeline.quantize.quantize_cost,
`awq_search`): one candidate scale fake-quantizing a Linear ((q(w x s) / s) in float32, cast back) against the
quantizer probe (`quantize_rate`, hence FAKE_QUANT_COST), one candidate of the lone up -> down mapping scored
through the Gram matrix of its inputs (out x in² FLOPs) against the float32 matmul probe, and the clip search of one
MLP projection. The weight is the model's down projection [hidden, intermediate], random bf16; the process holds
--held GB first, as a build holds its outer weights and layer (fresh pages fault in slower the more it holds).

    python benchmarks/awq_search.py --model Llama-3.1-8B --held 4

One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from _timing import best_seconds
from llmc.planning.machine import matmul_rate
from llmc.quant.numerics import quantize_rate
from llmc.quant.algorithms.awq import fake_quantize_weight, search_clip
from llmc.quant.spec import TensorSpec

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Llama-3.1-8B", help="a folder name under recipes/configs/")
    ap.add_argument("--held", type=float, default=4.0, help="GB the process holds while measuring")
    ap.add_argument("--tokens", type=int, default=32, help="calibration rows the clip search reads")
    args = ap.parse_args()
    config = json.loads((ROOT / "recipes" / "configs" / args.model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    held = torch.ones(int(args.held * 1e9) // 4)  # noqa: F841 (kept alive: the build's resident memory)
    spec = TensorSpec("int4", "group", group_size=128)
    w = (torch.randn(hidden, inter) * 0.02).to(torch.bfloat16)
    s = torch.rand(inter) + 0.5
    probe = quantize_rate(spec, "bfloat16", elements=w.numel())
    fake = best_seconds(lambda: (fake_quantize_weight(w.float() * s, spec) / s).to(w.dtype), 2)
    wf, gram = w.float(), torch.randn(inter, inter)
    candidate = best_seconds(lambda: float((((fake_quantize_weight(wf * s, spec) / s - wf) @ gram) * wf).sum()), 1)
    clip = best_seconds(lambda: search_clip(w, torch.randn(args.tokens, inter), spec), 1)
    print(json.dumps({
        "model": args.model, "weight": [hidden, inter], "held_gb": args.held, "tokens": args.tokens,
        "quantize_probe_g_per_s": probe / 1e9, "fake_quant_g_per_s": w.numel() / fake / 1e9,
        "fake_quant_cost": probe * fake / w.numel(),
        "gram_candidate_s": candidate, "gram_candidate_gflops": 2 * hidden * inter ** 2 / candidate / 1e9,
        "float32_probe_gflops": matmul_rate("float32", "cpu", inter, 128) / 1e9,
        "clip_search_s": clip, "load": list(os.getloadavg()),
    }))


if __name__ == "__main__":
    main()
