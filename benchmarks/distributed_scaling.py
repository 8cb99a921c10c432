"""Data-parallel calibration (llmc.distributed): 1 vs 2 processes here, and a model of multi-GPU scaling.

    python benchmarks/distributed_scaling.py measure [--hidden 256 --layers 4 --windows 16 --seq-len 128]
    python benchmarks/distributed_scaling.py model [--measured benchmarks/results/distributed_scaling.jsonl]

`measure` builds a random Llama-shaped model, quantizes it with RTN-static+KV and with GPTQ as one process and as two
torchrun ranks (gloo, one thread each), and records per run: the wall time of the quantize call, the time spent in
GPTQ's solve, and the bytes each rank received through llmc.distributed's collectives, next to the bytes
llmc.planning.scaling predicts from the shapes. On this machine (2 cores shared with other jobs) two ranks cannot be faster
than one: both compete for the same cores, and the load from other work changes every timing. The run shows that
the ranks agree, what the collectives move, and what the coordination costs; not a speed-up.

`model` predicts multi-GPU times for Llama-3-8B's shapes: the communication volume per layer from llmc.planning.scaling (the
same formulas the measurement checks), llm-compressor's published GPTQ figures (745 s on 1 GPU, 264 s on 4:
docs.vllm.ai/projects/llm-compressor, distributed oneshot) split by Amdahl's law into a part that divides by N and
one that does not, and what llmc's choice of solving each GPTQ stack on rank 0 (true-sequential) adds to that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA3_8B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "layers": 32}
PUBLISHED = {"model": "Llama-3-8B", "scheme": "GPTQ W4A16", "gpus_1_s": 745.0, "gpus_4_s": 264.0,
             "source": "llm-compressor docs, distributed oneshot (as quoted in issue 19)"}


def llama_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    head_dim = hidden // heads
    return {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
            "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
            "mlp.down_proj": (hidden, intermediate)}


# --------------------------------------------------------------------------- measure (child: one rank)


def child(model: str, out: str, scheme: str, windows: int, seq_len: int) -> None:
    import torch

    from llmc import distributed
    from llmc.model.source import ModelSource
    from llmc.quant.algorithms import gptq
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, quantize_model

    schemes = {"rtn-static-kv": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"),
                                       TensorSpec("fp8_e4m3", "tensor")),
               "gptq": Scheme(TensorSpec("int4", "group", group_size=64), algorithm="gptq")}
    solve = [0.0]
    real = gptq.gptq_quantize_shared

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            solve[0] += time.perf_counter() - t

    gptq.gptq_quantize_shared = timed
    import llmc.quant.true_sequential as ts

    ts.gptq_quantize_shared = timed
    torch.set_num_threads(1)
    distributed.init("cpu")
    calibration = torch.randint(3, 250, (windows, seq_len), generator=torch.Generator().manual_seed(0))
    distributed.barrier()
    t = time.perf_counter()
    quantize_model(ModelSource(Path(model), "m", "m"), schemes[scheme], Path(out), Calibration(calibration))
    wall = time.perf_counter() - t
    print("RESULT " + json.dumps({"rank": distributed.rank(), "wall_s": wall, "solve_s": solve[0],
                                  "received_bytes": dict(distributed.TRAFFIC)}), flush=True)
    distributed.destroy()


def measure(args) -> list[dict]:
    import torch

    from llmc.planning import scaling
    from tests.conftest import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", hidden=args.hidden, intermediate=args.hidden * 4, layers=args.layers,
                                heads=args.hidden // 64, kv_heads=max(1, args.hidden // 128))
        shapes = llama_shapes(args.hidden, args.hidden * 4, args.hidden // 64, max(1, args.hidden // 128))
        for scheme in ("rtn-static-kv", "gptq"):
            for nproc in (1, 2):
                launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable])
                cmd = [*launcher, __file__, "child", str(model), f"{tmp}/{scheme}-{nproc}", scheme,
                       str(args.windows), str(args.seq_len)]
                env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if r.returncode:
                    raise SystemExit(r.stdout[-2000:] + r.stderr[-2000:])
                ranks = sorted((json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")),
                               key=lambda x: x["rank"])
                work = scaling.Workload(ranges=scheme != "gptq", hessians=scheme == "gptq", module_calls=False,
                                        solve_on_rank0=scheme == "gptq")
                predicted = scaling.bytes_per_layer(shapes, nproc, work)
                row = {"scheme": scheme, "nproc": nproc, "hidden": args.hidden, "layers": args.layers,
                       "windows": args.windows, "seq_len": args.seq_len, "wall_s": max(x["wall_s"] for x in ranks),
                       "solve_s_rank0": ranks[0]["solve_s"], "ranks": ranks,
                       "predicted_bytes_per_layer_per_rank": predicted,
                       "solve_flops_per_layer": scaling.solve_flops(shapes, scheme == "gptq"),
                       "load_avg_1m": os.getloadavg()[0], "torch_threads_per_rank": 1, "torch": torch.__version__}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
    return rows


# --------------------------------------------------------------------------- model


def gptq_solve_s_h100(shapes: dict[str, tuple[int, int]]) -> float:
    """One layer's GPTQ solve on an H100, from this repository's measurements (docs/gpu.md, GPTQ's column loop as
    one Triton kernel): ~0.1 ms per 128-column block per ~2000 rows, so blocks x rows/2000 x 0.1 ms per stack; plus
    the inverse Hessians (~in³ flops each) at an assumed 20 TFLOP/s (fp32 Cholesky: not measured here)."""
    from llmc.planning import scaling

    total = 0.0
    for group in scaling.input_groups(shapes):
        rows = sum(shapes[n][0] for n in group)
        width = shapes[group[0]][1]
        total += (width / 128) * max(rows / 2000, 1.0) * 1e-4 + width ** 3 / 20e12
    return total


def model(args) -> None:
    from llmc.planning import scaling

    shapes = llama_shapes(LLAMA3_8B["hidden"], LLAMA3_8B["intermediate"], LLAMA3_8B["heads"], LLAMA3_8B["kv_heads"])
    layers = LLAMA3_8B["layers"]
    t1, t4 = PUBLISHED["gpus_1_s"], PUBLISHED["gpus_4_s"]
    parallel, serial = scaling.amdahl_fit(t1, t4, 4)
    solve = gptq_solve_s_h100(shapes)
    print(f"{PUBLISHED['model']} {PUBLISHED['scheme']}, llm-compressor: {t1:.0f} s on 1 GPU, {t4:.0f} s on 4 "
          f"({t1 / t4:.2f}x). Amdahl: {parallel:.0f} s divide by N, {serial:.0f} s do not ({serial / t1:.0%}).")
    print(f"GPTQ solve per layer on an H100 (from the Triton kernel timings): ~{solve * 1e3:.0f} ms, "
          f"{solve * layers:.1f} s for {layers} layers.")
    print("N  bytes/rank/layer (Hessians + codes)  comm s @100 GB/s  @25 GB/s  llm-compressor-like T(N)  "
          "llmc T(N) (solve on rank 0)  speed-up llmc")
    work = scaling.Workload(ranges=False, hessians=True, module_calls=False, solve_on_rank0=True)
    for n in (1, 2, 4, 8):
        volume = sum(scaling.bytes_per_layer(shapes, n, work).values())
        comm_fast, comm_pcie = layers * volume / 100e9, layers * volume / 25e9
        spread = parallel / n + serial + comm_fast
        llmc = (parallel - solve * layers) / n + solve * layers + serial + comm_fast
        print(f"{n}  {volume / 1e9:8.2f} GB {'':27s}{comm_fast:8.1f}  {comm_pcie:8.1f}  {spread:12.0f} s "
              f"{llmc:22.0f} s {'':14s}{(t1) / llmc:5.2f}x")
    if args.measured and Path(args.measured).is_file():
        print("\nmeasured here (bytes each rank received per layer vs llmc.planning.scaling's prediction):")
        for line in Path(args.measured).read_text().splitlines():
            row = json.loads(line)
            if row["nproc"] < 2:
                continue
            got = max(sum(r["received_bytes"].values()) for r in row["ranks"]) / row["layers"]
            want = sum(row["predicted_bytes_per_layer_per_rank"].values())
            print(f"  {row['scheme']}: {got / 1e6:.2f} MB measured, {want / 1e6:.2f} MB predicted "
                  f"(hidden {row['hidden']}, {row['nproc']} ranks)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--windows", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/distributed_scaling.jsonl")
    mo = sub.add_parser("model")
    mo.add_argument("--measured", default=str(ROOT / "benchmarks/results/distributed_scaling.jsonl"))
    args = p.parse_args()
    if args.cmd == "measure":
        rows = measure(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        model(args)


if __name__ == "__main__":
    main()
