"""Each export stage's planned time against its measured one (issue 44, "Plan accuracy"): the plan of RECIPE
(`plan_recipe`, what `llmc plan` prints), then `llmc export` of the same recipe in the same cache with every export
stage's output removed first (the quantize stage stays cached, so each export runs and only the exports do), stage
times from the build's stage records. `--profile OUT` also writes a cProfile of the build (`python -m pstats OUT`).

    nice -n 10 python benchmarks/export_cost.py --recipe recipes/smollm2-qdq-runtimes.yaml --cache /tmp/c \\
      --set calibration.samples=4

One JSON line: per export stage the plan's seconds and range, the measured seconds and the error
(predicted - measured) / measured; the load average before and after.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="an llmc cache of this benchmark's own")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--profile", type=Path, default=None)
    args = ap.parse_args()
    os.environ["LLMC_CACHE"] = str(args.cache)
    from llmc.build import build_until
    from llmc.planning.plan import plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    store = Store.default()
    recipe = load_recipe(args.recipe, args.overrides)
    build_until(recipe, store, "quantize")  # cached after the first run: the exports alone are measured below
    plan = plan_recipe(recipe, store, args.recipe)
    rows = {r["stage"]: r for r in plan.as_dict()["estimates"]["stages"] if r["stage"].startswith("export ")}
    shutil.rmtree(args.cache / "stages" / "export", ignore_errors=True)
    load = os.getloadavg()[0]
    profiler = cProfile.Profile() if args.profile else None
    t = time.time()
    if profiler:
        profiler.enable()
    result = build_until(recipe, store, "export")
    if profiler:
        profiler.disable()
        profiler.dump_stats(str(args.profile))
    stages = {}
    for s in result.stages:
        if not s.name.startswith("export:") or s.cached:
            continue
        name = f"export {s.name.split(':', 1)[1]}"
        row = rows.get(name, {})
        planned = row.get("seconds")
        stages[name] = {"planned_s": planned, "range": [row.get("seconds_low"), row.get("seconds_high")],
                        "measured_s": s.seconds,
                        "error": round((planned - s.seconds) / s.seconds, 3) if planned and s.seconds else None,
                        "in_range": bool(row) and row["seconds_low"] <= s.seconds <= row["seconds_high"]}
    print(json.dumps({"recipe": str(args.recipe), "overrides": args.overrides,
                      "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)),
                      "load": [round(load, 1), round(os.getloadavg()[0], 1)], "stages": stages,
                      "unmatched_plan_rows": sorted(set(rows) - set(stages))}), flush=True)


if __name__ == "__main__":
    main()
