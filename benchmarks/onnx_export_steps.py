"""One onnxruntime export timed step by step against the plan's terms for it (issue 44, onnx int4).

    nice -n 19 python benchmarks/onnx_export_steps.py RECIPE CACHE OUT.jsonl [--keep-source DIR] [--set k=v ...]
The plan is made (rates reprobed when LLMC_REPROBE=1) right before the export, which runs in the same process with
timers around each of export_onnx's steps and the stage's own (input verification, hashing)."""
import argparse, json, os, shutil, subprocess, sys, time
from collections import defaultdict
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("recipe", type=Path); ap.add_argument("cache", type=Path); ap.add_argument("out", type=Path)
ap.add_argument("--set", dest="overrides", action="append", default=[])
ap.add_argument("--keep-source", type=Path, default=None, help="copy the builder's input folder here")
args = ap.parse_args()
os.environ["LLMC_CACHE"] = str(args.cache)
from llmc.build import build_until
from llmc.planning.plan import plan_recipe
from llmc.recipe.load import load_recipe
from llmc.storage.store import Store
import llmc.formats.onnx_genai as og
import llmc.formats.onnx_qdq as oq
import llmc.formats.base as fb
import llmc.pipeline.export as pe
import llmc.storage.store as st
import onnx

store = Store.default()
recipe = load_recipe(args.recipe, args.overrides)
build_until(recipe, store, "quantize")

captured = {}
orig_cost = og.OnnxGenai.cost
def cost(self, label, work):
    captured["work"] = work
    return orig_cost(self, label, work)
og.OnnxGenai.cost = cost
load_plan = os.getloadavg()[0]
t0 = time.time()
plan = plan_recipe(recipe, store, args.recipe)
plan_s = time.time() - t0
og.OnnxGenai.cost = orig_cost
rows = {r["stage"]: r for r in plan.as_dict()["estimates"]["stages"] if r["stage"].startswith("export onnx")}
work = captured["work"]
fmt = og.OnnxGenai()
terms = {"files+hash+read (ArtifactFormat.cost)": fb.ArtifactFormat.cost(fmt, "x", work).seconds,
         "  of which read_seconds": work.read_seconds,
         "builder_seconds": og.builder_seconds(work.config)}
if work.bits == 4:  # (before issue 44's onnx-int4 fix: packed_bytes * 8 / bits / base.REPACK_RATE)
    terms["intermediate_seconds"] = og.intermediate_seconds(work)
    terms["repack_seconds (llmc GPTQ + builder loader)"] = og.repack_seconds(work)
else:
    terms["weight_pass_seconds"] = oq.weight_pass_seconds(work)
terms["export_seconds"] = og.export_seconds(work)
terms["row"] = next(iter(rows.values()))["seconds"]
print(json.dumps({"plan_terms": terms, "packed_bytes": work.packed_bytes, "bits": work.bits}), flush=True)

timers = defaultdict(float)
def timed(name, fn):
    def wrap(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timers[name] += time.perf_counter() - s
    return wrap

orig_run = subprocess.run
def run(cmd, *a, **k):
    if "onnxruntime_genai.models.builder" in cmd:
        if args.keep_source:
            src = Path(cmd[cmd.index("-i") + 1])
            shutil.rmtree(args.keep_source, ignore_errors=True)
            shutil.copytree(src, args.keep_source)
        return timed("builder subprocess", orig_run)(cmd, *a, **k)
    return orig_run(cmd, *a, **k)
og.subprocess.run = run
og.export_gptq = timed("export_gptq (intermediate)", og.export_gptq)
og.float_model = timed("float_model", og.float_model)
og.copy_tokenizer_files = timed("copy_tokenizer_files", og.copy_tokenizer_files)
og._put_codes_back = timed("_put_codes_back", og._put_codes_back)
oq.insert_qdq = timed("  insert_qdq", oq.insert_qdq)
onnx.load = timed("onnx.load (all)", onnx.load)
onnx.save = timed("onnx.save (all)", onnx.save)
og._builder_quantized = timed("_builder_quantized", og._builder_quantized)
og._rotary_error = timed("_rotary_error", og._rotary_error)
og.atomic_write_json = timed("atomic_write_json", og.atomic_write_json)
og.export_onnx = timed("export_onnx total", og.export_onnx)
pe.check_export = timed("check_export", pe.check_export)
Store.require_intact = timed("require_intact (inputs)", Store.require_intact)
st.record_files = timed("record_files (hash outputs)", st.record_files)

shutil.rmtree(args.cache / "stages" / "export", ignore_errors=True)
load_build = os.getloadavg()[0]
t = time.time()
result = build_until(recipe, store, "export")
build_s = time.time() - t
stages = {s.name: s.seconds for s in result.stages if s.name.startswith("export:") and not s.cached}
out = {"recipe": str(args.recipe), "overrides": args.overrides,
       "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
       "load": [round(load_plan, 1), round(load_build, 1), round(os.getloadavg()[0], 1)],
       "plan_s": round(plan_s, 1), "plan_rows": rows, "plan_terms": terms,
       "measured_stage_s": stages, "measured_steps_s": {k: round(v, 2) for k, v in timers.items()},
       "reprobe": os.environ.get("LLMC_REPROBE")}
line = json.dumps(out)
print(line, flush=True)
with open(args.out, "a") as f:
    f.write(line + "\n")
