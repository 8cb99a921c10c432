"""Perplexity of one ONNX Q/DQ artifact in onnxruntime with and without ORT's quantized-kernel fusions.

    python benchmarks/ort_qdq_fusion.py <artifact folder> [--windows 32]

Default session (what a deployment gets): Q/DQ around MatMul fused into ORT's int8 kernels
(MatMulIntegerToFloat; MatMulNBits for weight-only). `session.disable_quant_qdq=1`: the graph's own
semantics (DequantizeLinear -> float MatMul). Both against the torch reference of the same canonical
weights is what `llmc build` reports; this script isolates the kernel's share. Same Brown eval windows
(512 tokens) as `llmc build`; prints one JSON line per session and the difference.
"""

import argparse
import json
import math
import time
from pathlib import Path

from transformers import AutoTokenizer

from llmc.calibration.corpora import load_corpus
from llmc.calibration.windows import make_windows
from llmc.engines.onnxrt import OnnxRuntimeEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.artifact)
    windows = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.windows, seed=None).ids
    nll = {}
    for label, config in (("fused (ORT default)", {}), ("unfused (session.disable_quant_qdq=1)",
                                                         {"session.disable_quant_qdq": "1"})):
        engine = OnnxRuntimeEngine(args.artifact, session_config=config)
        t = time.perf_counter()
        nll[label] = engine.score(windows)["nll"]
        print(json.dumps({"session": label, "ppl": math.exp(float(nll[label].mean())),
                          "score_s": round(time.perf_counter() - t, 1), "windows": args.windows}), flush=True)
    a, b = nll.values()
    print(json.dumps({"fused_over_unfused_ppl_pct": 100 * (math.exp(float(a.mean() - b.mean())) - 1)}))


if __name__ == "__main__":
    main()
