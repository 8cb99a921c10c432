"""Runs inside the TensorRT-LLM environment (a GPU machine), one process per evaluation.

    python _trtllm_worker.py request.json out_dir

request.json: {"model": folder, "llm_args": {...}, "tensors": file, "top_k": k, "decode_tokens": n,
"repeats": r}; the tensors file holds `windows` [w, s] token ids, `prompt` [1, p] and, when scoring an
artifact against a baseline, `reference_index` [w, s-1, k]. Writes out_dir/scores.safetensors (nll, and
either top-k log-probs or the log-probs at the reference's indices + argmax) and out_dir/result.json.
Imports nothing from llmc: this environment has TensorRT-LLM's own pins.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(request_file: str, out_dir: str) -> None:
    import tensorrt_llm
    from tensorrt_llm import LLM, SamplingParams

    req = json.loads(Path(request_file).read_text())
    io = load_file(req["tensors"])
    windows, prompt, ref_index = io["windows"], io["prompt"], io.get("reference_index")
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
    save_file({k: torch.stack(v).contiguous() for k, v in parts.items()}, str(Path(out_dir) / "scores.safetensors"))

    ids = prompt[0].tolist()
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
    result = {
        "version": tensorrt_llm.__version__,
        "load_s": load_s,
        "throughput": {"prefill_tokens_per_s": _summary(prefill),
                       "decode_tokens_per_s": _summary(decode) if decode else None,
                       "prompt_tokens": len(ids), "decode_tokens": req["decode_tokens"], "repeats": req["repeats"],
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }
    (Path(out_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
