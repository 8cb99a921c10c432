"""Perplexity of the same artifact in vLLM-CPU and in llmc's torch reference engine.

    python benchmarks/vllm_agreement.py ARTIFACT_OR_MODEL_DIR [...] [--windows 4] [--seq-len 512]

Same token windows (Brown eval split, tokenized once with the HF tokenizer) fed to both engines.
vLLM runs bf16 on the CPU (its INT8 kernel refuses fp32); the torch reference runs fp32.
Needs `bash scripts/setup-vllm.sh`.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of
    from llmc.engines.vllm_cpu import VllmEngine

    tok = AutoTokenizer.from_pretrained(args.folders[0])
    w = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.windows, seed=None).ids
    print(f"{args.windows} Brown eval windows x {args.seq_len} tokens")
    for folder in args.folders:
        t = time.monotonic()
        scores, tput = VllmEngine(folder).measure(w, w[:1], decode_tokens=8, repeats=1)
        vllm_s = time.monotonic() - t
        torch_nll = TorchEngine(folder, streamed=decide_torch_loading_of(folder, "float32").streamed).score(w)["nll"]
        pv, pt = math.exp(scores["nll"].mean()), math.exp(torch_nll.mean())
        print(f"{folder}: vLLM {pv:.4f} ({tput['engine_dtype']}, vLLM {tput['engine_version']}, {vllm_s:.0f} s) "
              f"| llmc torch {pt:.4f} (fp32) | difference {(pv / pt - 1) * 100:+.3f}% "
              f"| max |d logprob| {(scores['nll'] - torch_nll).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
