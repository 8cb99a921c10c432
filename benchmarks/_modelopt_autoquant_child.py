"""Run NVIDIA ModelOpt's AutoQuantize on local files; used by benchmarks/search_vs_autoquantize.py.

    .venv-modelopt/bin/python benchmarks/_modelopt_autoquant_child.py MODEL_DIR CALIB.safetensors EVAL.safetensors \\
        OUT_DIR SCORE_STEPS BITS [BITS...]

Runs in ModelOpt's own venv (scripts/setup-peers.sh); imports nothing from llmc. For each BITS (ModelOpt's
effective bits: an unquantized weight costs 16, FP8 8, NVFP4 4.5, over the searched Linears) a fresh float32 model is
searched by `mtq.auto_quantize` (method "gradient", ModelOpt's default) over the candidates W4A16_NVFP4_CFG and
FP8_DEFAULT_CFG (plus "none", which ModelOpt always adds), lm_head kept out (`disabled_layers`), calibrated on every
calibration window (`num_calib_steps` = all of them, batch 1) and scored on the first SCORE_STEPS of them. The first
search's scores are saved to OUT_DIR/scores.pth and restored by the next BITS (ModelOpt's `checkpoint`: the
gradient scoring is not repeated). The searched model (ModelOpt's fake-quantized forward) then runs the eval windows
one at a time; the input of its (unquantized) lm_head for every token is written to OUT_DIR/hidden-<BITS>.safetensors
so the caller computes the logits with the baseline's head and scores them exactly as its own rows.
Prints one JSON line per BITS: the chosen format per Linear, each decision's candidates with ModelOpt's scores and
costs, the effective bits reached, wall times.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    model_dir, calib_file, eval_file, out_dir, score_steps = sys.argv[1:6]
    budgets = [float(b) for b in sys.argv[6:]]
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    cpu_nvfp4_fake_quant()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    calib = load_file(calib_file)["input_ids"]
    evals = load_file(eval_file)["input_ids"]
    loader = [calib[i : i + 1] for i in range(calib.shape[0])]

    def forward_step(model, batch):
        return model(input_ids=batch, labels=batch, use_cache=False)

    def loss_func(output, batch):
        return output.loss

    for bits in budgets:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        t = time.monotonic()
        model, state = mtq.auto_quantize(
            model, constraints={"effective_bits": bits},
            quantization_formats=[mtq.W4A16_NVFP4_CFG, mtq.FP8_DEFAULT_CFG],
            data_loader=loader, forward_step=forward_step, loss_func=loss_func,
            disabled_layers=["*lm_head*"], num_calib_steps=len(loader), num_score_steps=int(score_steps),
            checkpoint=str(out / "scores.pth"), verbose=False)
        search_s = time.monotonic() - t
        # AutoQuantize leaves HF models with gradient checkpointing on and checkpointed modules in train mode
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        model.eval()
        hidden, nll = score(model, evals)
        save_file({"hidden": hidden.contiguous()}, str(out / f"hidden-{bits:g}.safetensors"))
        best, stats = state["best"], state["candidate_stats"]
        # each decision (q/k/v one, gate/up one, o and down each alone) spread over the Linears it covers
        chosen = {module: str(recipe) for name, recipe in best["recipe"].items()
                  for module in stats[name]["module_names"]}
        scores = {name: {"formats": [str(f) for f in s["formats"]], "scores": [float(x) for x in s["scores"]],
                         "costs": [float(x) for x in s["costs"]]} for name, s in stats.items()}
        print(json.dumps({"bits": bits, "search_s": round(search_s, 1), "hidden": str(out / f"hidden-{bits:g}.safetensors"),
                          "ppl_child": math.exp(nll), "effective_bits": (best.get("constraints") or {}).get("effective_bits"),
                          "is_satisfied": best.get("is_satisfied"), "chosen": chosen, "scores": scores,
                          "modelopt": modelopt.__version__, "torch": torch.__version__}), flush=True)
        del model


def cpu_nvfp4_fake_quant() -> None:
    """ModelOpt 0.47 fake-quantizes NVFP4 (E2M1 codes, E4M3 scale per 16) only on CUDA: its
    `tensor_quant._dynamic_block_quantize_impl` asserts `amax.is_cuda` and then calls a Triton kernel or the CUDA
    extension (`fused_amax_convert`), so AutoQuantize's first NVFP4 forward after calibration (the sensitivity scoring)
    fails on the CPU. Here the same math in torch takes its place for CPU tensors: per-tensor scale amax / (6 x 448),
    each block's scale (block amax / 6) in E4M3 relative to it, elements rounded to the nearest E2M1 value."""
    import torch
    from modelopt.torch.quantization import tensor_quant

    original = tensor_quant.dynamic_block_quantize_op
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2

    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        if inputs.is_cuda or (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) != (4, 2, 8, 4):
            return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        x = inputs.float().reshape(-1, block_size)
        global_scale = amax.float().amax() / (6.0 * 448.0)
        block = (x.abs().amax(-1, keepdim=True) / 6.0 / global_scale).clamp(max=448.0)
        scale = block.to(torch.float8_e4m3fn).float() * global_scale
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        y = (x / scale).clamp(-6.0, 6.0)
        q = grid[torch.bucketize(y.abs(), mids)] * y.sign()
        return (q * scale).reshape(inputs.shape).to(inputs.dtype)

    tensor_quant.dynamic_block_quantize_op = op


def score(model, evals):
    """The lm_head's input for every token of every eval window [n, seq, hidden], and the mean next-token NLL."""
    import torch

    captured: list = []
    handle = model.lm_head.register_forward_hook(lambda _m, args, _o: captured.append(args[0].detach().float()))
    nll_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(evals.shape[0]):
            ids = evals[i : i + 1]
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll_sum += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                               ids[:, 1:].reshape(-1), reduction="sum"))
            count += ids.shape[1] - 1
    handle.remove()
    return torch.cat(captured), nll_sum / count


if __name__ == "__main__":
    main()
