"""What the W4A8 kernels' own FP8 rounding costs, on top of the W4AFP8 scheme the torch reference scores.

    python benchmarks/w4afp8_kernel_rounding.py [--model gemma3-270m] [--algorithm gptq] [--seed 0]
        [--samples 16] [--seq-len 512] [--eval-windows 16]

Two W4AFP8 quantizations (int4 symmetric groups of 128, dynamic per-token FP8 activations) with the same
calibration, one with plain float32 group scales and one with `scale_grid="fp8_row"` (group scales on vLLM's
per-row FP8 grid), each exported as compressed-tensors and scored by llmc's torch reference three ways on the
same Brown eval windows:
  - as stored: weight = code x group scale (what llmc's reports and llm-compressor's own evaluation assume);
  - vLLM: the group scales as vLLM's W4A8-FP8 scheme converts them at load (`convert_bf16_scales_to_fp8`,
    emulated by `llmc.quant.numerics.fp8_row_group_scales`: bf16, per output row c = max|scale| / 448 with
    vLLM's floor 1 / (448 x 512), group scale -> c x fp8_e4m3(scale / c), then its /8 repack);
  - TensorRT-LLM: the weight as ModelOpt simulates W4A8_AWQ's FP8 GEMM operand, fp8(code x scale / s2) x s2 with
    s2 = max|code x scale| / 448 over the fused GEMM (`llmc.formats.modelopt_hf.fp8_weight_operand`; the
    conformance test checks it equals ModelOpt 0.47's own simulation). Activations stay per-token here.
Neither kernel was run (both need a Hopper/Ada GPU); these are the kernels' documented conversions applied in
the torch reference. Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms_vs_llmcompressor import MODELS, model_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(MODELS))
    ap.add_argument("--algorithm", default="gptq", choices=["rtn", "gptq", "awq"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.modelopt_hf import fp8_weight_operand, w4a8_weight_scale_2
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.numerics import dequantize, fp8_row_group_scales
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, quantize_model

    torch.set_num_threads(2)
    group = MODELS[args.model]["group"]
    source = model_source(args.model)
    tok = AutoTokenizer.from_pretrained(source.folder)
    eval_ids = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.eval_windows, seed=None).ids
    calib = make_windows(tok, load_corpus("brown", "calibration"), args.seq_len, args.samples, seed=args.seed).ids
    base = math.exp(float(TorchEngine(source.folder, streamed=decide_torch_loading_of(source.folder, "float32").streamed).token_nll(eval_ids).mean()))
    print(json.dumps({"model": args.model, "scheme": "W4AFP8", "algorithm": args.algorithm, "seed": args.seed,
                      "baseline_ppl": base}), flush=True)
    for grid in (None, "fp8_row"):
        scheme = Scheme(TensorSpec("int4", "group", group_size=group, scale_grid=grid),
                        TensorSpec("fp8_e4m3", "token", dynamic=True), algorithm=args.algorithm)
        with tempfile.TemporaryDirectory(prefix="llmc-w4afp8-") as tmp:
            t = time.monotonic()
            quantize_model(source, scheme, Path(tmp) / "q", Calibration(calib))
            qm = QuantizedModel.open(Path(tmp) / "q")
            export_compressed_tensors(qm, Path(tmp) / "export")
            engine = TorchEngine(Path(tmp) / "export", streamed=decide_torch_loading_of(Path(tmp) / "export", "float32").streamed)
            stored = {n: m.weight.data.clone() for n, m in engine.model.named_modules() if n in qm.quantized_modules}
            variants = {"vllm": {}, "tensorrt-llm": {}}
            for tensors in qm.iter_files():
                scale_2 = w4a8_weight_scale_2(qm, tensors)
                for name in scale_2:
                    codes, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
                    variants["vllm"][name] = dequantize(codes, fp8_row_group_scales(scale), None, scheme.weights)
                    variants["tensorrt-llm"][name] = fp8_weight_operand(
                        dequantize(codes, scale, None, scheme.weights), scale_2[name])
            quantize_s = time.monotonic() - t
            for variant, weights in {"as stored": stored, **variants}.items():
                for name, w in weights.items():
                    engine.model.get_submodule(name).weight.data.copy_(w)
                ppl = math.exp(float(engine.token_nll(eval_ids).mean()))
                changed = sum(float((w - stored[n]).norm() ** 2) for n, w in weights.items()) ** 0.5
                total = sum(float(w.norm() ** 2) for w in stored.values()) ** 0.5
                print(json.dumps({"scale_grid": grid or "float", "weights": variant, "ppl": ppl,
                                  "ppl_change_pct": 100 * (ppl / base - 1), "relative_weight_change": changed / total,
                                  "quantize_s": quantize_s}), flush=True)


if __name__ == "__main__":
    main()
