"""Quantize a local HF causal LM with llm-compressor's oneshot(), for peer comparison with llmc.

Runs with the interpreter of llm-compressor's own venv and imports nothing from llmc:

    .venv-llmcompressor/bin/python benchmarks/peer_llmcompressor.py \\
        --model MODEL_DIR --tokens calib.safetensors --scheme gptq-w4a16 --out OUT_DIR [--group-size 64] [--threads 2]

MODEL_DIR is a local HF folder (safetensors + tokenizer). TOKENS is a safetensors file holding one int64
tensor `input_ids` of shape [n_windows, seq_len]; the windows are used as-is (no re-tokenization, no
shuffling, no downloads). Every scheme is calibrated with pipeline="sequential" (one decoder layer at a
time) unless --pipeline says otherwise. The compressed model and tokenizer are saved to OUT_DIR.

Logs go to stderr; stdout gets exactly one JSON line:
    {"scheme", "wall_s" (oneshot() only), "load_s", "save_s", "peak_rss_mb", "llmcompressor", "out"}
Exit status 2 is a usage error, 3 means the scheme cannot run with the installed llm-compressor.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

SCHEMES = ("gptq-w4a16", "awq-w4a16", "smoothquant-w8a8", "smoothquant-gptq-w8a8", "rtn-w8a8", "fp8")
IGNORE = ["lm_head"]


def w4a16_groups(group_size: int) -> dict[str, Any]:
    """Symmetric int4 group-wise weights on every Linear; activations stay in full precision."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=group_size, actorder=None)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def build_recipe(scheme: str, group_size: int) -> list[Any]:
    """The modifier list for one scheme (llm-compressor 0.14: AWQ and SmoothQuant are transforms
    that only rescale weights, so a quantizing modifier must follow them)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    recipes: dict[str, Callable[[], list[Any]]] = {
        "gptq-w4a16": lambda: [GPTQModifier(config_groups=w4a16_groups(group_size), ignore=IGNORE,
                                            actorder=None, dampening_frac=0.01, block_size=128)],
        "awq-w4a16": lambda: [AWQModifier(),  # mappings inferred from the architecture (Llama)
                              QuantizationModifier(config_groups=w4a16_groups(group_size), ignore=IGNORE)],
        "smoothquant-w8a8": lambda: [SmoothQuantModifier(smoothing_strength=0.5),
                                     QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=IGNORE)],
        "smoothquant-gptq-w8a8": lambda: [SmoothQuantModifier(smoothing_strength=0.5),
                                          GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=IGNORE,
                                                       actorder=None, dampening_frac=0.01, block_size=128)],
        "rtn-w8a8": lambda: [QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=IGNORE)],
        "fp8": lambda: [QuantizationModifier(scheme="FP8", targets=["Linear"], ignore=IGNORE)],
    }
    return recipes[scheme]()


def skip_pinning_without_accelerator() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (IntermediatesCache.pin_memory) unconditionally,
    which raises "Cannot access accelerator device" on CPU-only torch. Pinning only speeds host-to-device
    copies, so on a CPU-only machine skipping it changes nothing but the crash."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # type: ignore[method-assign]
        print("[peer] no accelerator: IntermediatesCache.pin_memory disabled", file=sys.stderr)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--tokens", required=True, help="safetensors file with int64 input_ids [n, seq_len]")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--group-size", type=int, default=64, help="group size for the W4A16 schemes")
    p.add_argument("--out", required=True, help="output folder for the compressed model")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--pipeline", default="sequential", help="oneshot() calibration pipeline")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    # llm-compressor's loguru sink writes to stdout; point fd 1 at stderr for the whole run and keep
    # a private duplicate of the real stdout for the single JSON result line.
    sys.stdout.flush()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import llmcompressor
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    skip_pinning_without_accelerator()
    ids = load_file(args.tokens)["input_ids"]
    if ids.dim() != 2:
        print(f"error: input_ids must be 2-D [n, seq_len], got {tuple(ids.shape)}", file=sys.stderr)
        return 2
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * n})

    try:
        recipe = build_recipe(args.scheme, args.group_size)
    except Exception as e:  # constructor arguments this llm-compressor version rejects
        print(f"error: scheme {args.scheme} cannot be built with llmcompressor "
              f"{llmcompressor.__version__}: {e}", file=sys.stderr)
        return 3

    t = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_s = time.monotonic() - t
    print(f"[peer] {args.scheme}: {n} windows x {seq_len} tokens, pipeline={args.pipeline}, "
          f"threads={args.threads}, load {load_s:.1f}s", file=sys.stderr)

    t = time.monotonic()
    llmcompressor.oneshot(model=model, tokenizer=tokenizer, dataset=ds, recipe=recipe,
                          num_calibration_samples=n, max_seq_length=seq_len, shuffle_calibration_samples=False,
                          pipeline=args.pipeline)
    wall_s = time.monotonic() - t

    t = time.monotonic()
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    save_s = time.monotonic() - t

    print(json.dumps({"scheme": args.scheme, "wall_s": round(wall_s, 3), "load_s": round(load_s, 3),
                      "save_s": round(save_s, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "llmcompressor": llmcompressor.__version__, "out": args.out}), file=result_out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
