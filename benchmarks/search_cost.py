"""quantization.search's measuring pass: planned against measured (issue 44). The plan of RECIPE (`plan_recipe`, what
`llmc plan` prints: the quantize row of a searched variant carries the measurement), then `llmc quantize` of the same
recipe in a cache of the benchmark's own with the measurement's and the quantize stage's outputs removed first, stage
times from the build's stage records (`quantize:<variant or search>:sensitivity` and the quantize stage).

    nice -n 10 python benchmarks/search_cost.py --recipe recipes/smollm2-search-nvfp4.yaml --cache /tmp/c \\
      --set calibration.samples=4 --set calibration.seq_len=128

One JSON line: the quantize row's planned seconds and range (measurement included) and peak host memory, the
measurement's planned seconds (from the row's words), the measured seconds of both stage records and their sum, the
error (predicted - measured) / measured; the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="an llmc cache of this benchmark's own")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    os.environ["LLMC_CACHE"] = str(args.cache)
    from llmc.build import build_until
    from llmc.planning.plan import plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    store = Store.default()
    recipe = load_recipe(args.recipe, args.overrides)
    plan = plan_recipe(recipe, store, args.recipe)
    rows = [r for r in plan.as_dict()["estimates"]["stages"] if r["stage"].startswith("quantize")]
    shutil.rmtree(args.cache / "stages" / "quantize", ignore_errors=True)
    shutil.rmtree(args.cache / "stages" / "search-sensitivity", ignore_errors=True)
    load = os.getloadavg()[0]
    t = time.time()
    result = build_until(recipe, store, "quantize")
    measured = {s.name: s.seconds for s in result.stages if s.name.startswith("quantize") and not s.cached}
    total = sum(measured.values())
    out = []
    for r in rows:
        words = re.search(r"the search's measurement first: .*?~(\d+) s", r["why"])
        out.append({"stage": r["stage"], "planned_s": r["seconds"], "range": [r["seconds_low"], r["seconds_high"]],
                    "planned_host_gb": r["host_gb"], "planned_measurement_s": float(words.group(1)) if words else None,
                    "measured": measured, "measured_s": total,
                    "error": round((r["seconds"] - total) / total, 3) if total else None,
                    "in_range": r["seconds_low"] <= total <= r["seconds_high"]})
    print(json.dumps({"recipe": str(args.recipe), "overrides": args.overrides,
                      "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)),
                      "load": [round(load, 1), round(os.getloadavg()[0], 1)], "rows": out}), flush=True)


if __name__ == "__main__":
    main()
