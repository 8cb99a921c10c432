"""The GPTQ- and AWQ-layout exports (llmc.formats.files.write_repacked_checkpoint) on one canonical form, each in a
fresh process: wall time and peak RssAnon (sampled every 50 ms), for this checkout's code and, with --code, another
checkout's (e.g. a worktree of an earlier commit), in the same run.

The canonical form is a quantize stage of a build (`llmc build` leaves it under the cache's stages/quantize/<key>;
benchmarks/full_width.py --keep keeps it for a synthetic full-width checkpoint):

    python benchmarks/repack_export.py --quantized CACHE/stages/quantize/<key> --code /path/to/old/checkout

One JSON line per (code, format). The export is written beside the canonical form and removed after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _proc_status import memory_bytes

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys, time
from pathlib import Path
from llmc.quant.canonical import QuantizedModel
fmt, src, out = sys.argv[1:4]
if fmt == "awq":
    from llmc.formats.awq_format import export_awq as export
else:
    from llmc.formats.gptq_format import export_gptq as export
qm = QuantizedModel.open(Path(src))
print("start", flush=True)
t = time.perf_counter()
summary = export(qm, Path(out))
print("seconds", time.perf_counter() - t, summary["max_relative_weight_error_fp16_scales"], flush=True)
"""


def run(code: Path, fmt: str, quantized: Path) -> dict:
    out = quantized.parent / f".repack-bench-{fmt}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, fmt, str(quantized), str(out)], env=env, cwd=code,
                             stdout=subprocess.PIPE, text=True)
    peak = 0
    while child.poll() is None:
        sample = memory_bytes(child.pid, ("RssAnon",))
        if sample:
            peak = max(peak, sample.get("RssAnon", 0))
        time.sleep(0.05)
    lines = child.stdout.read().split("\n")
    shutil.rmtree(out, ignore_errors=True)
    done = [line.split() for line in lines if line.startswith("seconds")]
    return {"code": str(code), "format": fmt, "exit": child.returncode,
            "export_s": float(done[0][1]) if done else None,
            "max_relative_weight_error_fp16_scales": float(done[0][2]) if done else None,
            "peak_rss_anon_gb": peak / 1e9, "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantized", type=Path, required=True, help="a canonical quantized form (quantize stage)")
    ap.add_argument("--code", type=Path, action="append", default=[], help="another checkout to compare")
    ap.add_argument("--formats", nargs="+", default=["awq", "gptq"], choices=["awq", "gptq"])
    args = ap.parse_args()
    for code in [ROOT, *args.code]:
        for fmt in args.formats:
            print(json.dumps(run(code.resolve(), fmt, args.quantized.resolve())), flush=True)


if __name__ == "__main__":
    main()
