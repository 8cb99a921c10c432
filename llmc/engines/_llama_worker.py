"""Child process run under the llama.cpp venv's Python: score token windows, time prefill/decode.

Usage: python _llama_worker.py request.json response.npz
Imports only numpy and llama_cpp (llmc is not installed in that venv).
request: {"gguf": path, "windows": [[ids]], "reference_index": path to a .npy [n, seq-1, k] of token ids
          or null, "prompt": [ids], "decode_tokens": int, "repeats": int, "threads": int}
response (npz): nll [n, seq-1], top1_index [n, seq-1], logprobs_at_reference [n, seq-1, k] (when given),
                meta (a JSON string: throughput, version, load_s)
"""

import json
import statistics
import sys
import time

import numpy as np


def main() -> None:
    req = json.load(open(sys.argv[1]))
    import llama_cpp
    from llama_cpp import Llama

    windows = np.asarray(req["windows"], dtype=np.int64)
    n_tok = windows.shape[1]
    n_ctx = max(n_tok, len(req["prompt"])) + req.get("decode_tokens", 0) + 8
    t = time.monotonic()
    llm = Llama(model_path=req["gguf"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=req.get("threads", 2), seed=0, verbose=False)
    load_s = time.monotonic() - t
    ref = np.load(req["reference_index"]) if req.get("reference_index") else None

    nll, top1, at_ref = [], [], []
    for w, ids in enumerate(windows):
        llm.reset()
        llm.eval(ids.tolist())
        logits = np.asarray(llm.scores[: n_tok - 1], dtype=np.float64)
        m = logits.max(-1, keepdims=True)
        lse = m + np.log(np.exp(logits - m).sum(-1, keepdims=True))
        nll.append(lse[:, 0] - logits[np.arange(n_tok - 1), ids[1:]])
        top1.append(logits.argmax(-1))
        if ref is not None:
            at_ref.append(np.take_along_axis(logits, ref[w], axis=-1) - lse)

    prefill, decode = [], []
    n = req.get("decode_tokens", 0)
    for _ in range(req.get("repeats", 1)):
        llm.reset()
        t = time.monotonic()
        llm.eval(req["prompt"])
        prefill.append(len(req["prompt"]) / (time.monotonic() - t))
        if n:
            llm.reset()
            llm.eval(req["prompt"][:64])
            t = time.monotonic()
            for _ in range(n):
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                llm.eval([nxt])
            decode.append(n / (time.monotonic() - t))

    def summary(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    meta = {
        "throughput": {"prefill_tokens_per_s": summary(prefill), "decode_tokens_per_s": summary(decode),
                       "prompt_tokens": len(req["prompt"]), "decode_tokens": n, "repeats": req.get("repeats", 1)},
        "version": llama_cpp.__version__,
        "load_s": load_s,
    }
    out = {"nll": np.stack(nll), "top1_index": np.stack(top1), "meta": np.asarray(json.dumps(meta))}
    if ref is not None:
        out["logprobs_at_reference"] = np.stack(at_ref).astype(np.float32)
    with open(sys.argv[2] + ".tmp", "wb") as f:
        np.savez(f, **out)
    import os

    os.replace(sys.argv[2] + ".tmp", sys.argv[2])


if __name__ == "__main__":
    main()
