"""llmc: quantize a Hugging Face causal LM into runtime-ready, evaluated, gated artifacts."""

import os

__version__ = "0.1.0"

# torch's CPU threads wait for each other by spinning (libgomp's default). On a machine shared with other processes
# (CI runners, a second build) a thread that lost its core stalls every parallel op of the others for a time slice:
# beside other builds a static-FP8 fake-quantize ran 7-34x slower, a GEMM 1.7-2.4x, a decoder layer 3.3-4.8x
# (benchmarks/omp_wait_policy.py, benchmarks/results/planner-log.md). Sleeping waiters cost 1-2% of a GEMM or a
# layer when the machine is quiet. libgomp reads this once, when torch loads: it applies when llmc is imported first
# (the `llmc` command); a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
