"""Runs inside the TensorRT-LLM environment (a GPU machine), one process per evaluation.

Usage: python trtllm_worker.py <request folder>   (wire format: _wire.py)
request.json: {"model": folder, "llm_args": {...}, "top_k": k, "decode_tokens": n, "repeats": r}; tensors:
              windows, prompt and, when scoring an artifact against a baseline, reference_index [w, s-1, k]
scores: nll, and either topk_logprobs + topk_index or the log-probs at the reference's indices (at_reference)
        + argmax
result.json: {"throughput": {...}, "version": str, "load_s": float}
Imports nothing from llmc: this environment has TensorRT-LLM's own pins.
"""

from __future__ import annotations

import sys
import time

import torch

import _wire


def main(folder: str) -> None:
    # lazy: inside _wire.run, so a missing or broken engine package lands in error.json
    import tensorrt_llm
    from tensorrt_llm import LLM, SamplingParams

    req, tensors = _wire.read_request(folder)
    windows = torch.from_numpy(tensors["windows"])
    ref_index = torch.from_numpy(tensors["reference_index"]) if "reference_index" in tensors else None
    t = time.monotonic()
    llm = LLM(model=req["model"], **req["llm_args"])
    load_s = time.monotonic() - t

    context = SamplingParams(max_tokens=1, return_context_logits=True)
    parts: dict[str, list[torch.Tensor]] = {}
    for w in range(windows.shape[0]):
        out = llm.generate([windows[w].tolist()], context)[0]
        logits = out.context_logits.float().cpu()[:-1]  # position t predicts token t+1
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        row = {"nll": -logprobs.gather(-1, windows[w, 1:].long()[:, None])[:, 0].double()}
        if ref_index is None:
            top = logprobs.topk(req["top_k"], dim=-1)
            row["topk_logprobs"], row["topk_index"] = top.values, top.indices.int()
        else:
            row["at_reference"] = logprobs.gather(-1, ref_index[w].long())
            row["argmax"] = logits.argmax(-1).int()
        for k, v in row.items():
            parts.setdefault(k, []).append(v)
    scores = {k: torch.stack(v).numpy() for k, v in parts.items()}

    ids = tensors["prompt"].tolist()
    prefill, decode = [], []
    greedy = SamplingParams(max_tokens=req["decode_tokens"] or 1, ignore_eos=True, temperature=0.0)
    one = SamplingParams(max_tokens=1)
    llm.generate([ids[:8]], one)  # warm-up
    for _ in range(req["repeats"]):
        t = time.perf_counter()
        llm.generate([ids], one)
        prefill_s = time.perf_counter() - t
        prefill.append(len(ids) / prefill_s)
        if req["decode_tokens"]:
            short = ids[:64]
            t = time.perf_counter()
            llm.generate([short], one)
            short_prefill_s = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate([short], greedy)
            decode.append(req["decode_tokens"] / max(time.perf_counter() - t - short_prefill_s, 1e-9))
    _wire.write_result(folder, {
        "version": tensorrt_llm.__version__,
        "load_s": load_s,
        "throughput": {"prefill_tokens_per_s": _wire.summary(prefill), "decode_tokens_per_s": _wire.summary(decode),
                       "prompt_tokens": len(ids), "decode_tokens": req["decode_tokens"], "repeats": req["repeats"],
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }, scores)


if __name__ == "__main__":
    _wire.run(main, sys.argv[1])
