"""The quantize stage of recipes/deepseek-r1-nvfp4.yaml on the synthetic DeepSeek-V3-width checkpoint, in this process:
`llmc quantize` refuses to start there, because the plan's export row (40.8 GB host) does not fit this machine although
`quantize` never exports. The plan's decision is handed to quantize_model as the build hands it. Peak RSS: sample
/proc/<pid>/status (VmHWM) meanwhile (benchmarks/results/deepseek_full_width.md).

    nice -n 10 python benchmarks/_deepseek_quantize_child.py <work folder>
"""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmc.model.source import ModelSource
from llmc.planning.plan import make_plan
from llmc.quant.stream import Calibration, StreamOptions, quantize_model
from llmc.recipe.load import load_recipe

W = Path(sys.argv[1])  # the --work folder `benchmarks/deepseek_full_width.py --keep` left (checkpoint/)
torch.set_num_threads(2)
overrides = [f"model.source={W}/checkpoint", "model.config=null", "calibration.samples=1", "calibration.seq_len=128"]
recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "deepseek-r1-nvfp4.yaml", overrides)
t0 = time.time()
plan = make_plan(recipe, W / "checkpoint", refuse=False)
row = next(r for r in plan.rows if r.name.startswith("quantize"))
scheme = {name: q.to_scheme() for name, q in recipe.variant_sections()}
(name, scheme), = scheme.items()
(W / "plan.json").write_text(json.dumps({**row.as_dict(), "parts_gb": {k: v / 1e9 for k, v in row.parts.items()},
                                          "plan_s": time.time() - t0, "estimates": plan.as_dict()["estimates"]}, default=str))
print("planned", row.host_bytes / 1e9, row.disk_bytes / 1e9, row.seconds, row.decision.as_dict(), flush=True)
ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
cal = Calibration(ids, moe_all_experts=recipe.calibration.moe_calibrate_all_experts)
t = time.time()
res = quantize_model(ModelSource(W / "checkpoint", "s", "s"), scheme, W / "out", cal,
                     StreamOptions(dtype=torch.bfloat16, loop=row.decision))
print("done", time.time() - t, res.loop.as_dict(), flush=True)
