"""Child process run under the GPTQModel venv's Python: score token windows, time prefill/decode.

Usage: python gptqmodel_worker.py <request folder>   (wire format: _wire.py)
request.json: {"model": dir, "dtype": "bfloat16" | "float16", "backend": a GPTQModel BACKEND value ("auto", "gptq_torch",
               "gptq_torch_aten", "awq_torch", ...), "threads": int, "decode_tokens": int, "repeats": int};
              tensors: windows, prompt and, to score against a reference, reference_index and maybe reference_head_*
scores: nll [n, seq-1], top1_index [n, seq-1], logprobs_at_reference [n, seq-1, k] (when given a reference),
        kl_exact [n, seq-1] (when given a reference head whose vocabulary is the model's)
result.json: {"throughput": {...}, "version": str, "load_s": float, "kernels": [QuantLinear class names in use],
              "threads": int}
Imports torch, numpy and gptqmodel (llmc is not installed in that venv).
"""

import sys
import time

import numpy as np

import _agreement
import _wire


def quant_kernels(model) -> list:
    """The QuantLinear classes GPTQModel put in place of the Linear layers: which kernel actually runs."""
    return sorted({type(m).__name__ for m in model.modules() if hasattr(m, "qweight")})


def main(folder: str) -> None:
    req, tensors = _wire.read_request(folder)
    # lazy: inside _wire.run, so a missing or broken engine package lands in error.json
    import torch
    import gptqmodel
    from gptqmodel import GPTQModel

    torch.set_num_threads(int(req.get("threads", 2)))
    windows, prompt = tensors["windows"].astype(np.int64), tensors["prompt"].astype(np.int64)
    t = time.monotonic()
    qmodel = GPTQModel.load(req["model"], device="cpu", backend=req.get("backend", "auto"),
                            dtype=getattr(torch, req.get("dtype", "bfloat16")))
    load_s = time.monotonic() - t
    model = qmodel.model.eval()
    kernels = quant_kernels(model)
    if not kernels:  # GPTQModel would otherwise run whatever it loaded, not its quantized kernels
        raise RuntimeError(f"GPTQModel loaded {req['model']} without any quantized layer")
    scores = _agreement.WindowScores(tensors)

    with torch.inference_mode():
        for w, ids in enumerate(windows):
            logits = model(torch.from_numpy(ids)[None]).logits[0, :-1].double().numpy()
            scores.add(w, ids, logits)

        prefill, decode = [], []
        n = int(req.get("decode_tokens", 0))
        full, short = torch.from_numpy(prompt)[None], torch.from_numpy(prompt[:64])[None]
        for _ in range(int(req.get("repeats", 1))):
            t = time.monotonic()
            model(full)
            prefill.append(full.shape[1] / (time.monotonic() - t))
            if n:  # greedy decode with the KV cache; the first token (a prefill of 64) is timed apart and removed
                t = time.monotonic()
                model.generate(short, max_new_tokens=1, do_sample=False)
                first = time.monotonic() - t
                t = time.monotonic()
                model.generate(short, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False)
                decode.append(n / max(time.monotonic() - t - first, 1e-9))

    _wire.write_result(folder, {
        "throughput": {"prefill_tokens_per_s": _wire.summary(prefill), "decode_tokens_per_s": _wire.summary(decode),
                       "prompt_tokens": int(full.shape[1]), "decode_tokens": n, "repeats": req.get("repeats", 1)},
        "version": gptqmodel.__version__,
        "load_s": load_s,
        "kernels": kernels,
        "threads": torch.get_num_threads(),
    }, scores.arrays())


if __name__ == "__main__":
    _wire.run(main, sys.argv[1])
