"""Child process run under the llama.cpp venv's Python: score token windows, time prefill/decode.

Usage: python llama_worker.py <request folder>   (wire format: _wire.py)
request.json: {"gguf": path, "decode_tokens": int, "repeats": int, "threads": int}; tensors: windows, prompt
              and, to score against a reference, reference_index [n, seq-1, k] and maybe its head (reference_head_*)
scores: nll [n, seq-1], top1_index [n, seq-1], logprobs_at_reference [n, seq-1, k] (when given a reference),
        kl_exact [n, seq-1] (when given a reference head whose vocabulary is the GGUF's)
result.json: {"throughput": {...}, "version": str, "load_s": float}
Imports only numpy and llama_cpp (llmc is not installed in that venv).
"""

import sys
import time

import numpy as np

import _agreement
import _wire


def main(folder: str) -> None:
    req, tensors = _wire.read_request(folder)
    # lazy: inside _wire.run, so a missing or broken engine package lands in error.json
    import llama_cpp
    from llama_cpp import Llama

    windows, prompt = tensors["windows"].astype(np.int64), tensors["prompt"].tolist()
    n_tok = windows.shape[1]
    n_ctx = max(n_tok, len(prompt)) + req.get("decode_tokens", 0) + 8
    t = time.monotonic()
    llm = Llama(model_path=req["gguf"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=req.get("threads", 2), seed=0, verbose=False)
    load_s = time.monotonic() - t
    scores = _agreement.WindowScores(tensors)

    for w, ids in enumerate(windows):
        llm.reset()
        llm.eval(ids.tolist())
        logits = np.asarray(llm.scores[: n_tok - 1], dtype=np.float64)
        scores.add(w, ids, logits)

    prefill, decode = [], []
    n = req.get("decode_tokens", 0)
    for _ in range(req.get("repeats", 1)):
        llm.reset()
        t = time.monotonic()
        llm.eval(prompt)
        prefill.append(len(prompt) / (time.monotonic() - t))
        if n:
            llm.reset()
            llm.eval(prompt[:64])
            t = time.monotonic()
            for _ in range(n):
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                llm.eval([nxt])
            decode.append(n / (time.monotonic() - t))

    _wire.write_result(folder, {
        "throughput": {"prefill_tokens_per_s": _wire.summary(prefill), "decode_tokens_per_s": _wire.summary(decode),
                       "prompt_tokens": len(prompt), "decode_tokens": n, "repeats": req.get("repeats", 1)},
        "version": llama_cpp.__version__,
        "load_s": load_s,
    }, scores.arrays())


if __name__ == "__main__":
    _wire.run(main, sys.argv[1])
