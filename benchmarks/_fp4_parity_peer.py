"""llm-compressor's data-free FP4 quantization of a local model, saved compressed; used by benchmarks/fp4_parity.py.

    .venv-llmcompressor/bin/python benchmarks/_fp4_parity_peer.py MODEL_DIR SCHEME OUT_DIR

Runs in llm-compressor's own venv (scripts/setup-peers.sh); imports nothing from llmc. SCHEME is a compressed-tensors
preset (NVFP4A16, MXFP4A16): weight-only, so oneshot() needs no calibration data. Every Linear but lm_head is
quantized, as llm-compressor's NVFP4 examples do. Prints one JSON line: versions and the wall time of oneshot().
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(model_dir: str, scheme: str, out_dir: str) -> None:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    # float32, as the checkpoint stores it and llmc reads it: both tools see the same weights.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    start = time.perf_counter()
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])])
    seconds = time.perf_counter() - start
    model.save_pretrained(out_dir, save_compressed=True)
    print(json.dumps({"scheme": scheme, "oneshot_s": round(seconds, 2), "llmcompressor": llmcompressor.__version__,
                      "compressed_tensors": compressed_tensors.__version__,
                      "transformers": transformers.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
