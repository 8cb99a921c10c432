"""Peak memory with the activations between layers kept in memory vs spilled to disk.

    python benchmarks/activation_spill.py [--layers 4] [--samples 128 256] [--seq-len 512] [--algorithm rtn-static]

One synthetic model with SmolLM2-135M's width (benchmarks/memory_depth.py's writer), quantized in fresh
child processes with the same calibration tokens, per calibration set size: `spill_activations="never"`
and `"always"`. Reports each child's peak RSS (VmHWM) and wall time, and checks that both wrote
bit-identical layer files. One copy of the activations is samples x seq_len x 576 x 4 bytes (256 x 512:
288 MiB); in memory two copies are held (a layer's inputs and outputs), spilled one batch of each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from memory_depth import SCHEMES, write_model

CHILD = """
import json, sys, time, torch
from pathlib import Path
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model
folder, out, scheme, samples, seq, spill = sys.argv[1], sys.argv[2], eval(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
torch.set_num_threads(2)
calib = torch.randint(0, 49152, (samples, seq), generator=torch.Generator().manual_seed(0))
t = time.monotonic()
quantize_model(ModelSource(Path(folder), "synthetic", "synthetic"), scheme, Path(out), Calibration(calib, spill=spill))
print(json.dumps({"wall_s": time.monotonic() - t, "peak_rss_mb": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024}))
"""


def layer_digest(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted((out / "layers").glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--algorithm", default="rtn-static", choices=sorted(SCHEMES))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmc-spill-") as tmp:
        model = Path(tmp) / "m"
        write_model(model, args.layers)
        for samples in args.samples:
            activation_mb = samples * args.seq_len * 576 * 4 / 2**20
            runs = {}
            for spill in ("never", "always"):
                out = Path(tmp) / f"q-{samples}-{spill}"
                r = subprocess.run([sys.executable, "-c", CHILD, str(model), str(out), SCHEMES[args.algorithm],
                                    str(samples), str(args.seq_len), spill], capture_output=True, text=True, check=True)
                runs[spill] = {**json.loads(r.stdout.strip().splitlines()[-1]), "layers_sha256": layer_digest(out)}
                print(json.dumps({"algorithm": args.algorithm, "samples": samples, "spill": spill,
                                  "activation_copy_mb": round(activation_mb, 1), **runs[spill]}), flush=True)
            print(json.dumps({
                "samples": samples,
                "peak_ratio_spilled_vs_memory": runs["always"]["peak_rss_mb"] / runs["never"]["peak_rss_mb"],
                "wall_ratio_spilled_vs_memory": runs["always"]["wall_s"] / runs["never"]["wall_s"],
                "identical_layers": runs["always"]["layers_sha256"] == runs["never"]["layers_sha256"],
            }), flush=True)

if __name__ == "__main__":
    main()
