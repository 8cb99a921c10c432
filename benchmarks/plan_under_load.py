"""The planner's predictions on a busy machine against a build of the same recipe (issue 35's "Done means").

While a load runs (`--load`), `llmc plan`'s estimates are taken `--plans` times (each in a fresh process, the
machine's rates probed again: LLMC_REPROBE=1), then the same recipe is built and measured (benchmarks/full_width.py's
run_build: per-stage RssAnon peaks sampled every SAMPLE_S, stage times from report.json). With `--model` the source is
a synthetic checkpoint of that model's real widths (recipes/configs/<model>/config.json, random bf16 weights) and
`--layers` decoder layers; without it, the recipe's own source.

The loads (each in a session of its own, killed with it when the measured build ends):
- `build` (the default): another `llmc build` of `--load-recipe` in a loop (its own cache, its outputs removed between
  runs so that it keeps computing): a second user's build, whose phases (I/O, compute) the probes and the measured
  stages overlap differently from run to run.
- `matmul`: one thread multiplying two MATMUL_SIZE-square float32 matrices in a loop (tens of ms an iteration): one
  core taken steadily, so the probes (seconds) and the stages (seconds to minutes) see the same contention.
- `none`: nothing beside the plans and the build.

    nice -n 10 python benchmarks/plan_under_load.py --recipe recipes/smollm2-fp8.yaml --set calibration.samples=4 ...
    nice -n 10 python benchmarks/plan_under_load.py --recipe recipes/smollm2-fp8.yaml --model Qwen2-7B --layers 2 ...

One JSON line: the load's kind, each plan's per-stage predictions (host GB, seconds, range) and load average, the
build's per-stage measurements, and per stage the errors (predicted - measured) / measured of every plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from full_width import ROOT, run_build, write_checkpoint  # noqa: E402

PLAN = """
import json, sys
from pathlib import Path
from llmc.planning.plan import make_plan, plan_recipe
from llmc.recipe.load import load_recipe
from llmc.storage.store import Store
recipe = load_recipe(Path(sys.argv[1]), sys.argv[2:])
make_plan(recipe)
plan = plan_recipe(recipe, Store.default(), Path(sys.argv[1]))
print(json.dumps(plan.as_dict()["estimates"]))
"""


# one 1024-square float32 product (2.1 GFLOP): 24 ms on the 2-core Xeon at nice 19, load 2.2 (2026-12-03 10:18 UTC,
# `torch.set_num_threads(1)`, mean of 10), so the contention is steady at the probes' and the stages' time scales
MATMUL_SIZE = 1024
MATMUL_LOOP = f"""
import torch
torch.set_num_threads(1)
a, b = torch.randn({MATMUL_SIZE}, {MATMUL_SIZE}), torch.randn({MATMUL_SIZE}, {MATMUL_SIZE})
while True:
    a @ b
"""


def start_build_load(recipe: Path, overrides: list[str], work: Path) -> subprocess.Popen:
    """`llmc build` of `recipe` over and over in its own cache (its stage outputs but the unpacked source removed
    after each run), in a process group of its own."""
    cache = work / "load-cache"
    sets = " ".join(f"--set {o}" for o in [*overrides, f"publish.registry={work / 'load-registry'}"])
    loop = (f"while true; do {sys.executable} -c 'from llmc.cli import main; main()' build {recipe} {sets} "
            f"--report-dir {work / 'load-report'} >/dev/null 2>&1; "
            f"rm -rf {cache}/stages/quantize {cache}/stages/export {cache}/stages/eval {cache}/stages/calibrate "
            f"{cache}/shared-stats {work / 'load-registry'}; done")
    env = {**os.environ, "LLMC_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(["bash", "-c", loop], env=env, start_new_session=True)


def start_matmul_load() -> subprocess.Popen:
    """MATMUL_LOOP in a process group of its own."""
    return subprocess.Popen([sys.executable, "-c", MATMUL_LOOP], start_new_session=True)


def start_load(args: argparse.Namespace, work: Path) -> subprocess.Popen | None:
    """The `--load` kind's process (None: `none`)."""
    if args.load == "build":
        return start_build_load(args.load_recipe, args.load_overrides, work)
    return start_matmul_load() if args.load == "matmul" else None


def stop_load(load: subprocess.Popen | None) -> None:
    """Kill the load's whole process group (a build load's `llmc build` as well as its shell loop)."""
    if load is not None:
        os.killpg(load.pid, signal.SIGTERM)
        load.wait()


def plan_once(recipe: Path, overrides: list[str], cache: Path) -> dict:
    env = {**os.environ, "LLMC_CACHE": str(cache), "PYTHONPATH": str(ROOT), "LLMC_REPROBE": "1"}
    t = time.time()
    out = subprocess.run([sys.executable, "-c", PLAN, str(recipe), *overrides], env=env, capture_output=True,
                         text=True)
    if out.returncode:  # say why, not only that it failed
        sys.exit(f"plan exited {out.returncode}:\n{out.stderr[-3000:]}")
    estimates = json.loads(out.stdout.strip().splitlines()[-1])
    return {"at": time.strftime("%H:%M:%S", time.gmtime(t)), "plan_s": time.time() - t, "load": os.getloadavg()[0],
            "source_resident": estimates.get("source_resident"),
            "stages": {s["stage"]: {"host_gb": s["host_gb"], "seconds": s["seconds"],
                                    "range": [s["seconds_low"], s["seconds_high"]]} for s in estimates["stages"]}}


def measured_stages(report: dict, peaks: dict, variant: str) -> dict:
    """report.json's stage times and the sampled RssAnon peaks, under the plan's stage names."""
    out = {}
    for s in report.get("stages", []):
        kind, *rest = s["name"].split(":")
        if kind == "eval":
            name = f"eval torch {'baseline' if rest[-1] == 'baseline' else variant}"
            sampled = peaks.get("eval baseline" if rest[-1] == "baseline" else "eval artifact", {})
        elif kind in ("quantize", "export"):
            name = f"{kind} {rest[0] if kind == 'export' else variant}"
            sampled = peaks.get("quantize" if kind == "quantize" else f"export {rest[0]}", {})
        else:
            continue
        out[name] = {"seconds": s["seconds"], "cached": s.get("cached", False),
                     "rss_anon_gb": sampled.get("RssAnon", 0) / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--model", default=None, help="a folder under recipes/configs/: a synthetic checkpoint of it")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--plans", type=int, default=5)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--load", choices=("build", "matmul", "none"), default="build",
                    help="what runs beside the plans and the build (module doc)")
    ap.add_argument("--load-recipe", type=Path, default=ROOT / "recipes" / "smollm2-fp8.yaml",
                    help="the recipe the build load loops over (--load build only)")
    ap.add_argument("--load-set", dest="load_overrides", action="append", default=[],
                    help="an override of the build load's recipe (--load build only)")
    ap.add_argument("--warmup-s", type=float, default=45.0, help="seconds the load runs before the first plan")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--builds", type=int, default=1,
                    help="builds measured (each in a fresh stage cache with the plans' rates): the plans are judged "
                         "against each stage's median, since one build on a shared 2-core VM is one sample of a "
                         "spread wider than the cost model's band")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="llmc-plan-load-", dir=str(Path.home())))
    work.mkdir(parents=True, exist_ok=True)
    overrides = list(args.overrides)
    if args.model:
        from llmc.model.source import resolve_source
        from llmc.storage.store import Store

        tokenizer = resolve_source("demo:smollm2-135m", Store.default()).folder
        ckpt = write_checkpoint(args.model, args.layers, work / "checkpoint", tokenizer)
        os.sync()
        overrides = [f"model.source={ckpt}", *overrides]
    load = start_load(args, work)
    try:
        time.sleep(args.warmup_s)
        plans = [plan_once(args.recipe, overrides, work / "cache") for _ in range(args.plans)]
        t = time.time()
        variant = next((n.split(" ", 1)[1] for n in plans[0]["stages"] if n.startswith("quantize ")), "")
        builds = []
        for i in range(args.builds):
            cache = work / ("cache" if i == 0 else f"cache-build{i}")
            if i:  # the plans' rates and the source's hash memo; no stage of the first build
                cache.mkdir(exist_ok=True)
                for name in ("machine-rates.json", "file-hashes.json"):
                    if (work / "cache" / name).is_file():
                        shutil.copyfile(work / "cache" / name, cache / name)
            measured = run_build(args.recipe, overrides, cache, work / f"registry{i}", work / f"report{i}")
            (work / f"build{i}.log").write_text(measured["stderr"])
            report_file = work / f"report{i}" / "report.json"
            report = json.loads(report_file.read_text()) if report_file.is_file() else {}
            builds.append((measured, measured_stages(report, measured["stage_peaks"], variant)))
            if i:  # its stages and registry entry (GBs at 7B widths): the disk holds one build's at a time
                shutil.rmtree(cache, ignore_errors=True)
                shutil.rmtree(work / f"registry{i}", ignore_errors=True)
    finally:
        stop_load(load)
    measured = builds[0][0]
    got = {stage: {"seconds": statistics.median(b[1][stage]["seconds"] for b in builds if stage in b[1]),
                   "cached": any(b[1][stage]["cached"] for b in builds if stage in b[1]),
                   "rss_anon_gb": max(b[1][stage]["rss_anon_gb"] for b in builds if stage in b[1]),
                   "each_s": [b[1][stage]["seconds"] for b in builds if stage in b[1]]}
           for stage in builds[0][1]}
    errors = {}
    for stage, m in got.items():
        p = [pl["stages"][stage] for pl in plans if stage in pl["stages"]]
        if not p or m["cached"]:
            continue
        errors[stage] = {
            "time": [round((x["seconds"] - m["seconds"]) / m["seconds"], 3) for x in p] if m["seconds"] else None,
            "memory": [round((x["host_gb"] - m["rss_anon_gb"]) / m["rss_anon_gb"], 3) for x in p]
            if m["rss_anon_gb"] else None,
            "in_range": [x["range"][0] <= m["seconds"] <= x["range"][1] for x in p]}
    print(json.dumps({"recipe": str(args.recipe), "load_kind": args.load, "model": args.model,
                      "layers": args.layers if args.model else None, "overrides": overrides, "plans": plans,
                      "build_started": time.strftime("%H:%M:%S", time.gmtime(t)),
                      "build": {"exit": measured["exit"], "wall_s": measured["wall_s"], "load": measured["load"],
                                "stages": got, "layer_seconds": measured["layer_seconds"]},
                      "errors": errors, "tail": measured["stderr_tail"][-800:]}), flush=True)
    if args.model:
        shutil.rmtree(work / "checkpoint", ignore_errors=True)


if __name__ == "__main__":
    main()
