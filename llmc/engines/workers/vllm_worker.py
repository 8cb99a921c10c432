"""Child process run under the vLLM venv's Python: score token windows, time prefill/decode.

Usage: python vllm_worker.py <request folder>   (wire format: _wire.py)
request.json: {"model": dir, "dtype": str, "max_model_len": int, "kv_cache_dtype": str, "decode_tokens": int,
               "repeats": int}; tensors: windows, prompt
scores: nll [n, seq-1] (vLLM returns the log-prob of each actual token, nothing more)
result.json: {"throughput": {...}, "version": str, "load_s": float}
Imports nothing from llmc (llmc is not installed in that venv).
"""

import sys
import time

import numpy as np

import _wire


def main(folder: str) -> None:
    req, tensors = _wire.read_request(folder)
    windows, prompt_ids = tensors["windows"].tolist(), tensors["prompt"].tolist()
    # lazy: inside _wire.run, so a missing or broken engine package lands in error.json
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.monotonic()
    llm = LLM(
        model=req["model"],
        tokenizer=req["model"],
        dtype=req["dtype"],
        max_model_len=req["max_model_len"],
        kv_cache_dtype=req.get("kv_cache_dtype", "auto"),
        enforce_eager=True,
        seed=0,
    )
    load_s = time.monotonic() - t

    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], scoring, use_tqdm=False)
    logprobs = []
    for w, out in zip(windows, outs):
        row = []
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row.append(entry[w[pos]].logprob)
        logprobs.append(row)

    prefill, decode = [], []
    prompt = TokensPrompt(prompt_token_ids=prompt_ids)
    short = TokensPrompt(prompt_token_ids=prompt_ids[:64])
    n = req.get("decode_tokens", 0)
    for _ in range(req.get("repeats", 1)):
        t = time.monotonic()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        prefill.append(len(prompt_ids) / (time.monotonic() - t))
        if n:
            t = time.monotonic()
            llm.generate([short], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            first = time.monotonic() - t
            t = time.monotonic()
            llm.generate([short], SamplingParams(max_tokens=n + 1, min_tokens=n + 1, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
            decode.append(n / max(time.monotonic() - t - first, 1e-9))

    _wire.write_result(folder, {
        "throughput": {"prefill_tokens_per_s": _wire.summary(prefill), "decode_tokens_per_s": _wire.summary(decode),
                       "prompt_tokens": len(prompt_ids), "decode_tokens": n, "repeats": req.get("repeats", 1)},
        "version": vllm.__version__,
        "load_s": load_s,
    }, {"nll": -np.asarray(logprobs, dtype=np.float64)})


if __name__ == "__main__":
    _wire.run(main, sys.argv[1])
