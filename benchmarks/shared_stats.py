"""A second scheme on the same model and data, with and without the shared calibration statistics.

    python benchmarks/shared_stats.py [--samples 32] [--repeats 2]

SmolLM2-135M (the demo source) and 32 x 512 Brown calibration windows, as `llmc build` prepares them.
FP8 static + FP8 KV is quantized once with statistics sharing on (it records them); then INT8 static +
INT8 KV is quantized repeatedly, alternating "shared" (reads them: no calibration forward) and
"calibrated" (no sharing: runs the forwards), each in a fresh child process. Prints the wall time of
every run, the median ratio, and whether both produced bit-identical layer files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from activation_spill import layer_digest

CHILD = """
import json, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file
from llmc.model.source import resolve_source
from llmc.storage.store import Store
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model
out, scheme, tokens, shared = Path(sys.argv[1]), eval(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(2)
source = resolve_source("demo:smollm2-135m", Store.default())
calib = load_file(tokens)["input_ids"]
t = time.monotonic()
quantize_model(source, scheme, out, Calibration(calib, shared_stats=Path(shared) if shared != "-" else None))
print(json.dumps({"wall_s": time.monotonic() - t}))
"""

FP8_KV = "Scheme(TensorSpec('fp8_e4m3', 'channel'), TensorSpec('fp8_e4m3', 'tensor'), TensorSpec('fp8_e4m3', 'tensor'))"
INT8_KV = "Scheme(TensorSpec('int8', 'channel'), TensorSpec('int8', 'tensor'), TensorSpec('int8', 'tensor'))"


def run(out: Path, scheme: str, tokens: Path, shared: str) -> float:
    r = subprocess.run([sys.executable, "-c", CHILD, str(out), scheme, str(tokens), shared],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from safetensors.torch import save_file

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store
    from transformers import AutoTokenizer

    source = resolve_source("demo:smollm2-135m", Store.default())
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    windows = make_windows(tokenizer, load_corpus("brown", "calibration"), 512, args.samples, seed=0)
    with tempfile.TemporaryDirectory(prefix="llmc-shared-") as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.safetensors"
        save_file({"input_ids": windows.ids}, str(tokens))
        shared = tmp / "shared"
        first = run(tmp / "fp8", FP8_KV, tokens, str(shared))
        print(json.dumps({"run": "fp8-static-kv records statistics", "wall_s": first}), flush=True)
        walls: dict[str, list[float]] = {"shared": [], "calibrated": []}
        digests = {}
        for r in range(args.repeats):
            for mode in ("shared", "calibrated"):
                out = tmp / f"int8-{mode}-{r}"
                walls[mode].append(run(out, INT8_KV, tokens, str(shared) if mode == "shared" else "-"))
                digests[mode] = layer_digest(out)
                print(json.dumps({"run": f"int8-static-kv {mode}", "repeat": r, "wall_s": walls[mode][-1]}), flush=True)
        print(json.dumps({
            "median_wall_s": {m: statistics.median(w) for m, w in walls.items()},
            "shared_vs_calibrated": statistics.median(walls["shared"]) / statistics.median(walls["calibrated"]),
            "identical_layers": digests["shared"] == digests["calibrated"],
        }), flush=True)


if __name__ == "__main__":
    main()
