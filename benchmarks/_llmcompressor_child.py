"""Run one llm-compressor oneshot on local files; used by benchmarks/algorithms_vs_llmcompressor.py.

    .venv-llmcompressor/bin/python benchmarks/_llmcompressor_child.py MODEL_DIR TOKENS.safetensors SCHEME OUT_DIR [GROUP]

Runs in llm-compressor's own venv (scripts/setup-peers.sh); imports nothing from llmc. SCHEME is one of
the schemes in recipe() below (gptq-nvfp4a16 / rtn-nvfp4a16: benchmarks/fp4_calibration.py's NVFP4 peer rows); GROUP is the INT4 group size, 64 by default (SmolLM2's 576 is not
divisible by 128; Gemma-3-270M takes 128). Prints one JSON line: wall time of oneshot() alone, peak RSS,
versions.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM); ru_maxrss would include the parent's memory at fork."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


def w4a16(group: int) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=args)}


def w4afp8(group: int) -> dict:
    """compressed-tensors' W4AFP8 preset (int4 symmetric groups, dynamic per-token FP8 activations) at GROUP."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True, observer=None)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)}


def fp8_static() -> dict:
    """FP8 weights per output channel (llmc's fp8_e4m3 'channel' layout, so both tools write the same format) and
    compressed-tensors' FP8 preset's activations: static, one scale per tensor, set from the calibration data."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)}


def recipe(scheme: str, g: int = 64) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    return {
        "gptq-w4a16": lambda: [GPTQModifier(config_groups=w4a16(g), ignore=["lm_head"], actorder=None)],
        "gptq-w4a16-actorder": lambda: [GPTQModifier(config_groups=w4a16(g), ignore=["lm_head"], actorder="static")],
        "awq-w4a16": lambda: [AWQModifier(), QuantizationModifier(config_groups=w4a16(g), ignore=["lm_head"])],
        "rtn-w4a16": lambda: [QuantizationModifier(config_groups=w4a16(g), ignore=["lm_head"])],
        "gptq-w4afp8": lambda: [GPTQModifier(config_groups=w4afp8(g), ignore=["lm_head"], actorder=None)],
        "awq-w4afp8": lambda: [AWQModifier(), QuantizationModifier(config_groups=w4afp8(g), ignore=["lm_head"])],
        "sq-w8a8": lambda: [SmoothQuantModifier(smoothing_strength=0.5),
                            QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])],
        # llm-compressor 0.14 maps Gemma3 to its default SmoothQuant mappings, which smooth
        # post_attention_layernorm into gate/up_proj; in Gemma 2/3 that norm normalizes the attention
        # output before the residual add, and gate/up_proj read pre_feedforward_layernorm's output.
        "sq-w8a8-gemma-mappings": lambda: [
            SmoothQuantModifier(smoothing_strength=0.5, mappings=[
                [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                [["re:.*gate_proj", "re:.*up_proj"], "re:.*pre_feedforward_layernorm"],
            ]),
            QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])],
        "sq-gptq-w8a8": lambda: [SmoothQuantModifier(smoothing_strength=0.5),
                                 GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"], actorder=None)],
        "fp8-static": lambda: [QuantizationModifier(config_groups=fp8_static(), ignore=["lm_head"])],
        "rtn-w8a8": lambda: [QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])],
        # NVFP4 weight-only (compressed-tensors' NVFP4A16 preset) as llm-compressor's NVFP4 examples run it: GPTQ
        # with its defaults (actorder "static", block 128, dampening 0.01), or plain rounding (data-free)
        "gptq-nvfp4a16": lambda: [GPTQModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"])],
        "rtn-nvfp4a16": lambda: [QuantizationModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"])],
    }[scheme]()


def main() -> None:
    model_dir, tokens_file, scheme, out = sys.argv[1:5]
    group = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    import llmcompressor
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations, which raises "Cannot access accelerator
        # device when none is available" on a CPU-only machine; pinning is only a transfer optimization.
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    ids = load_file(tokens_file)["input_ids"]
    n, seq = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq] * n})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    t = time.monotonic()
    llmcompressor.oneshot(model=model, dataset=ds, recipe=recipe(scheme, group), num_calibration_samples=n,
                          max_seq_length=seq, pipeline="sequential", shuffle_calibration_samples=False)
    wall = time.monotonic() - t
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    print(json.dumps({"scheme": scheme, "group_size": group, "wall_s": wall, "peak_rss_mb": _peak_rss_mb(),
                      "llmcompressor": llmcompressor.__version__, "torch": torch.__version__, "out": out}))


if __name__ == "__main__":
    main()
