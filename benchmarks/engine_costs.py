"""ONNX Runtime's scoring on SmolLM2-135M, planned (llmc.engines.onnxrt.scoring_cost) against measured: the
session's start-up (seconds, RssAnon it adds), the windows' scoring and the throughput repeats, each timed in a
fresh process. What docs/planner-constants.md#engine-start-up records was measured with it:

    PYTHONPATH=. python benchmarks/engine_costs.py --work /tmp/engine-costs --windows 8 --seq-len 256

The artifact is SmolLM2-135M quantized W4A16 (int4, group 64, RTN) and exported for onnxruntime-genai (int4
MatMulNBits), written under --work once and reused. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from pathlib import Path
import os
import torch
sys.path.insert(0, sys.argv[4])
from _proc_status import memory_bytes as status
def memory_bytes():
    return status(os.getpid(), ("RssAnon", "VmHWM"))
folder, windows, seq_len = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
from llmc.engines.onnxrt import OnnxRuntimeEngine
ids = torch.randint(10, 40000, (windows, seq_len), generator=torch.Generator().manual_seed(0))
before = memory_bytes()["RssAnon"]
t = time.perf_counter()
eng = OnnxRuntimeEngine(folder)
start_s = time.perf_counter() - t
after = memory_bytes()["RssAnon"]
t = time.perf_counter()
scores = eng.score(ids)
score_s = time.perf_counter() - t
peak = memory_bytes()
t = time.perf_counter()
eng.throughput(ids[:1], decode_tokens=16, repeats=1)
throughput_s = time.perf_counter() - t
print(json.dumps({"start_s": start_s, "session_bytes": after - before, "process_bytes": before,
                  "score_s": score_s, "throughput_s": throughput_s, "peak_rss_anon": peak.get("VmHWM", 0)}))
"""


def artifact(work: Path) -> tuple[Path, Path]:
    """The source folder and the ONNX Runtime artifact (made once under `work`)."""
    from llmc.formats.onnx_genai import export_onnx
    from llmc.model.source import resolve_source
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model
    from llmc.storage.store import Store

    source = resolve_source("demo:smollm2-135m", Store.default())
    out = work / "onnx"
    if not (out / "genai_config.json").is_file():
        quantize_model(source, Scheme(TensorSpec("int4", "group", group_size=64)), work / "q", None)
        export_onnx(QuantizedModel.open(work / "q"), out)
    return Path(source.folder), out


def planned(source: Path, out: Path, windows: int, seq_len: int) -> dict:
    import os

    from llmc.engines.base import Scoring
    from llmc.engines.onnxrt import scoring_cost
    from llmc.model.checkpoint import read_model_config
    from llmc.planning import shapes
    from llmc.planning.machine import Machine
    from llmc.planning.machine import memory_available

    config = read_model_config(source)
    shape = shapes.Shape.of(shapes.from_headers(source), config, 4)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    row = scoring_cost(Scoring(shape, Machine(memory_available(), None, "cpu", os.cpu_count()), windows, seq_len,
                               16, 1, 256, size, False))
    return {"planned_s": row.seconds, "planned_host_bytes": row.host_bytes, "parts": row.parts, "why": row.why,
            "model_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    source, out = artifact(a.work)
    print(json.dumps({"kind": "planned", **planned(source, out, a.windows, a.seq_len)}), flush=True)
    for _ in range(a.runs):
        res = subprocess.run([sys.executable, "-c", CHILD, str(out), str(a.windows), str(a.seq_len),
                              str(Path(__file__).parent)], capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        print(json.dumps({"kind": "measured", **json.loads(res.stdout.strip().splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
