"""The quantize stage of a MoE recipe on a synthetic full-width checkpoint, in this process (issue 46:
benchmarks/deepseek_full_width.py, benchmarks/gptoss_full_width.py, which sample this process's memory and the disk
meanwhile). `llmc quantize` refuses to start there, because the plan's export row does not fit this machine although
`quantize` never exports. The plan's decision is handed to quantize_model as the build hands it; the recipe's
calibration section (samples, seq_len, every expert on every token, stream_experts) as the build reads it.

    nice -n 10 python benchmarks/_moe_quantize_child.py <work folder> --recipe R [--lift-refusal vllm:gpt_oss]
        [--set key=value ...]

--lift-refusal RUNTIME:FAMILY lifts a runtime's refusal of a family in this process only (gpt-oss's per-expert NVFP4
experts, which no vLLM loader reads: the quantize stage is what is measured). Prints `planned <json>` (the plan's
quantize row), `layer <i> <seconds since the stage started>` as each layer is durable, and `done <json>` (the stage's
seconds and the decision the loop obeyed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llmc.model.source import ModelSource  # noqa: E402
from llmc.planning.plan import make_plan  # noqa: E402
from llmc.quant.stream import Calibration, StreamOptions, quantize_model  # noqa: E402
from llmc.recipe.load import load_recipe  # noqa: E402

TOKENIZER_VOCAB = 49152  # SmolLM2's ids (the checkpoint's tokenizer), inside every full-width embedding


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path, help="the benchmark's --work folder (checkpoint/ in it)")
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "deepseek-r1-nvfp4.yaml")
    ap.add_argument("--lift-refusal", action="append", default=[], metavar="RUNTIME:FAMILY")
    ap.add_argument("--set", dest="extra", action="append", default=[])
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.lift_refusal:
        import llmc.runtimes.catalog  # noqa: F401 - registers the runtimes
        from llmc.runtimes.registry import RUNTIMES

        for item in args.lift_refusal:
            runtime, family = item.split(":")
            RUNTIMES[runtime].refused_families.pop(family)
    work = args.work
    overrides = [f"model.source={work}/checkpoint", "model.config=null", "calibration.samples=1",
                 "calibration.seq_len=128", *args.extra]
    recipe = load_recipe(args.recipe, overrides)
    t0 = time.time()
    plan = make_plan(recipe, work / "checkpoint", refuse=False)
    row = next(r for r in plan.rows if r.name.startswith("quantize"))
    (name, scheme), = ((n, q.to_scheme()) for n, q in recipe.variant_sections())
    planned = {**row.as_dict(), "parts_gb": {k: v / 1e9 for k, v in row.parts.items()}, "plan_s": time.time() - t0,
               "estimates": {k: v for k, v in plan.as_dict()["estimates"].items() if k != "stages"}}
    print("planned " + json.dumps(planned, default=str), flush=True)
    c = recipe.calibration
    ids = torch.randint(0, TOKENIZER_VOCAB, (c.samples, c.seq_len), generator=torch.Generator().manual_seed(0))
    cal = Calibration(ids, moe_all_experts=c.moe_calibrate_all_experts, stream_experts=c.stream_experts)
    t = time.time()
    res = quantize_model(ModelSource(work / "checkpoint", "s", "s"), scheme, work / "out", cal,
                         StreamOptions(dtype=torch.bfloat16, loop=row.decision,
                                       on_layer_done=lambda i: print(f"layer {i} {time.time() - t:.2f}", flush=True)))
    print("done " + json.dumps({"seconds": time.time() - t, "decision": res.loop.as_dict()}), flush=True)


if __name__ == "__main__":
    main()
