"""The torch reference evaluation split over ranks (llmc.engines.split): 1 process vs 2 torchrun ranks here.

    python benchmarks/distributed_eval.py [--model FOLDER] [--windows 8 --seq-len 256 --batch-size 2]

Scores the same windows the way a build's eval stage does, twice: the baseline (top-k log-probs and output-head
inputs kept as the reference) and then against that reference (exact KL, top-1), in three set-ups: one process with
one torch thread, one process with two threads (what one process can get from this machine's 2 cores), and two
torchrun ranks (gloo) with one thread each. Prints one JSON row per set-up: the wall time of each scoring pass (the
slowest rank's, after a barrier), the model's load time, whether the per-window scores are bit-identical to the
one-process run, and the load average. Without --model: a random Llama-shaped model (hidden 256, 4 layers). The
token ids are random (timing does not depend on them).
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


def child(model: str, windows: int, seq_len: int, batch_size: int, threads: int, out: str) -> None:
    import torch

    from llmc import distributed
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of

    torch.set_num_threads(threads)
    distributed.init("cpu")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(3, vocab, (windows, seq_len), generator=torch.Generator().manual_seed(0))
    distributed.barrier()
    t = time.perf_counter()
    engine = TorchEngine(Path(model), streamed=decide_torch_loading_of(Path(model), "float32").streamed)
    distributed.barrier()
    load_s = time.perf_counter() - t
    passes = {}
    for name in ("baseline", "against_reference"):
        distributed.barrier()
        t = time.perf_counter()
        scores = engine.score(ids, batch_size=batch_size, reference=passes.get("baseline", (None, None))[1])
        distributed.barrier()
        passes[name] = (time.perf_counter() - t, scores)
    if distributed.is_main():
        torch.save({k: v[1] for k, v in passes.items()}, out)
        print("RESULT " + json.dumps({"load_s": load_s, **{f"{k}_s": v[0] for k, v in passes.items()}}), flush=True)
    distributed.destroy()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/distributed_eval.jsonl")
    args = p.parse_args()
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.conftest import make_tiny_model

            model = make_tiny_model(Path(tmp) / "m", hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2)
        reference = None
        for ranks, threads in ((1, 1), (1, 2), (2, 1)):
            launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                        if ranks > 1 else [sys.executable])
            out = f"{tmp}/scores-{ranks}-{threads}.pt"
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
            load_before = os.getloadavg()[0]
            r = subprocess.run([*launcher, __file__, "child", str(model), str(args.windows), str(args.seq_len),
                                str(args.batch_size), str(threads), out], env=env, capture_output=True, text=True,
                               check=False)
            if r.returncode:
                raise SystemExit(r.stdout[-2000:] + r.stderr[-2000:])
            result = json.loads(next(line[7:] for line in r.stdout.splitlines() if line.startswith("RESULT ")))
            scores = torch.load(out)
            reference = reference or scores
            identical = all(torch.equal(scores[p][k], reference[p][k]) for p in scores for k in scores[p])
            row = {"model": str(args.model or "random llama hidden 256, 4 layers"), "ranks": ranks,
                   "threads_per_rank": threads, "windows": args.windows, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, **{k: round(v, 3) for k, v in result.items()},
                   "bit_identical_to_1_process_1_thread": identical,
                   "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "torch": torch.__version__}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
