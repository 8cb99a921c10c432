"""How torch's CPU threads wait for each other (libgomp's OMP_WAIT_POLICY) decides how fast llmc runs on a machine
shared with other processes: each kernel below is timed in a fresh process with the policy unset (libgomp's default:
spin, then sleep) and with PASSIVE (sleep at once; what llmc sets unless the user did, llmc/__init__.py), alternated
in the same run, while `--competitors` single-thread busy loops (a stand-in for another job on a CI runner) hold
cores. llmc's own build under the same load: `--build` (a small `llmc build` of recipes/smollm2-fp8.yaml, each
policy, its stage times from report.json).

    nice -n 0 python benchmarks/omp_wait_policy.py --competitors 0 1 2 --rounds 3 \\
        --out benchmarks/results/omp_wait_policy.jsonl
    python benchmarks/omp_wait_policy.py --table benchmarks/results/omp_wait_policy.jsonl

Kernels (float32, the shapes of SmolLM2-135M's layers at 512 tokens): `fake_quantize` of a static FP8 input (what
the torch engine adds to every quantized Linear), the MLP's GEMM [512, 576] x [576, 1728], and one Llama decoder
layer's forward. Each is repeated for `--seconds` and reported as a rate; one JSON line per (competitors, policy,
round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("unset", "PASSIVE")

CHILD = r"""
import json, sys, time
import torch  # before llmc: llmc's default policy must not apply to the "unset" runs
from llmc.quant.numerics import fake_quantize, static_scale
from llmc.quant.spec import TensorSpec
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

seconds = float(sys.argv[1])
torch.manual_seed(0)

def rate(work, call):
    call()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        call()
        n += 1
    return work * n / (time.perf_counter() - start)

spec = TensorSpec("fp8_e4m3", "tensor")
x = torch.randn(512, 576)
scale = static_scale(x.abs().amax(), spec)
w = torch.randn(1728, 576)
config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, attn_implementation="sdpa")
layer = LlamaDecoderLayer(config, 0).eval()
hidden = torch.randn(2, 512, 576)
position = torch.arange(512).expand(2, -1)
rope = LlamaRotaryEmbedding(config)(hidden, position)
with torch.no_grad():
    out = {
        "fake_quantize_Melem_s": rate(x.numel(), lambda: fake_quantize(x, spec, scale)) / 1e6,
        "gemm_GFLOP_s": rate(2 * 512 * 576 * 1728, lambda: torch.nn.functional.linear(x, w)) / 1e9,
        "layer_forward_tokens_s": rate(hidden.shape[0] * hidden.shape[1],
                                       lambda: layer(hidden, position_embeddings=rope, attention_mask=None,
                                                     position_ids=position)),
    }
print(json.dumps(out))
"""


def child_env(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_competitors(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def kernels(policy: str, seconds: float) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(seconds)], env=child_env(policy), check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def build(policy: str, work: Path) -> dict:
    """A small build of recipes/smollm2-fp8.yaml in its own cache; its stage times."""
    cache, reports = work / f"cache-{policy}", work / f"report-{policy}"
    env = {**child_env(policy), "LLMC_CACHE": str(cache)}
    # the source's unpacked copy is made once, outside the timed stages
    sets = ["calibration.samples=4", "calibration.seq_len=256", "eval.windows=4", "eval.seq_len=256",
            "eval.decode_tokens=4", "eval.throughput_repeats=1"]
    args = [a for s in sets for a in ("--set", s)]
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch; from llmc.cli import main; main()", "build",
                    str(ROOT / "recipes/smollm2-fp8.yaml"), *args, "--no-publish", "--report-dir", str(reports)],
                   env=env, check=True, capture_output=True)
    wall = time.monotonic() - start
    report = json.loads(next(cache.glob("builds/*/report.json")).read_text())
    stages = {s["name"]: s["seconds"] for s in report["stages"] if not s.get("cached")}
    for sub in ("quantize", "export", "eval", "calibrate"):  # the next round computes again
        subprocess.run(["rm", "-rf", str(cache / "stages" / sub)], check=True)
    subprocess.run(["rm", "-rf", str(cache / "builds")], check=True)
    return {"build_wall_s": wall, "stages_s": stages}


def measure(args: argparse.Namespace) -> None:
    out = open(args.out, "a") if args.out else sys.stdout
    with tempfile.TemporaryDirectory(prefix="omp-policy-") as tmp:
        for n in args.competitors:
            procs = start_competitors(n)
            try:
                time.sleep(1.0)
                for r in range(args.rounds):
                    for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                        row = {"competitors": n, "policy": policy, "round": r, "cpus": os.cpu_count(),
                               "load_1min": os.getloadavg()[0], "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                        row |= kernels(policy, args.seconds)
                        if args.build:
                            row |= build(policy, Path(tmp))
                        print(json.dumps(row), file=out, flush=True)
            finally:
                stop(procs)


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    keys = ["fake_quantize_Melem_s", "gemm_GFLOP_s", "layer_forward_tokens_s"]
    if any("build_wall_s" in r for r in rows):
        keys.append("build_wall_s")
    print("| competitors | " + " | ".join(f"{k} unset | PASSIVE | ratio" for k in keys) + " |")
    print("|---" * (1 + 3 * len(keys)) + "|")
    for n in sorted({r["competitors"] for r in rows}):
        cells = []
        for k in keys:
            med = {p: statistics.median(r[k] for r in rows if r["competitors"] == n and r["policy"] == p and k in r)
                   for p in POLICIES}
            cells += [f"{med['unset']:.1f}", f"{med['PASSIVE']:.1f}", f"{med['PASSIVE'] / med['unset']:.2f}x"]
        print(f"| {n} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--build", action="store_true", help="also time a small llmc build per policy")
    ap.add_argument("--out")
    ap.add_argument("--table")
    args = ap.parse_args()
    if args.table:
        table(args.table)
    else:
        measure(args)


if __name__ == "__main__":
    main()
