"""Child process run under the vLLM venv's Python: score token windows, time prefill/decode.

Usage: python _vllm_worker.py request.json response.json
This file imports nothing from llmc (llmc is not installed in that venv).
request: {"model": dir, "dtype": str, "max_model_len": int, "windows": [[ids]], "prompt": [ids],
          "decode_tokens": int, "repeats": int, "kv_cache_dtype": str}
response: {"logprobs": [[float]], "throughput": {...}, "version": str, "load_s": float}
"""

import json
import statistics
import sys
import time


def main() -> None:
    req = json.load(open(sys.argv[1]))
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
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in req["windows"]], scoring, use_tqdm=False)
    logprobs = []
    for w, out in zip(req["windows"], outs):
        row = []
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row.append(entry[w[pos]].logprob)
        logprobs.append(row)

    prefill, decode = [], []
    prompt = TokensPrompt(prompt_token_ids=req["prompt"])
    short = TokensPrompt(prompt_token_ids=req["prompt"][:64])
    n = req.get("decode_tokens", 0)
    for _ in range(req.get("repeats", 1)):
        t = time.monotonic()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        prefill.append(len(req["prompt"]) / (time.monotonic() - t))
        if n:
            t = time.monotonic()
            llm.generate([short], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            first = time.monotonic() - t
            t = time.monotonic()
            llm.generate([short], SamplingParams(max_tokens=n + 1, min_tokens=n + 1, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
            decode.append(n / max(time.monotonic() - t - first, 1e-9))

    def summary(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    json.dump({
        "logprobs": logprobs,
        "throughput": {"prefill_tokens_per_s": summary(prefill), "decode_tokens_per_s": summary(decode),
                       "prompt_tokens": len(req["prompt"]), "decode_tokens": n, "repeats": req.get("repeats", 1)},
        "version": vllm.__version__,
        "load_s": load_s,
    }, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
