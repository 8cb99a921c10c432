"""Perplexity of a real model whose decoder Linear weights are replaced by their NVFP4 / MXFP4 values: round-to-
nearest scales against the block-scale search (llmc.quant.scale_search), weight-only (activations unquantized),
on the same Brown eval windows, with paired bootstrap intervals on the per-window change against RTN.

    PYTHONPATH=$PWD python benchmarks/fp4_weight_quality.py demo:smollm2-135m 16

fp32, CPU. The decoder's q/k/v/o/gate/up/down weights are quantized; embeddings, norms and the (tied) head are not.
One JSON line per variant.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmc.data.sources import BrownSource
from llmc.data.tokens import make_tokens
from llmc.model.source import resolve_source
from llmc.quant.microscaling import MXFP4, NVFP4, dequantize_blocks, quantize_blocks
from llmc.quant.scale_search import search_block_scales
from llmc.storage.store import Store

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def window_nll(model, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Mean token NLL of each window [windows]."""
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            b = ids[i: i + batch]
            logp = torch.log_softmax(model(input_ids=b).logits[:, :-1].float(), -1)
            out.append(-logp.gather(-1, b[:, 1:, None])[..., 0].mean(1))
    return torch.cat(out)


def paired(diff: torch.Tensor) -> tuple[float, float, float]:
    """Mean per-window log-ppl change as a ppl ratio - 1, with a bootstrap 95% interval."""
    g = torch.Generator().manual_seed(0)
    n = len(diff)
    boots = torch.stack([diff[torch.randint(0, n, (n,), generator=g)].mean() for _ in range(2000)])
    lo, hi = torch.quantile(boots, torch.tensor([0.025, 0.975])).tolist()
    return math.expm1(diff.mean().item()), math.expm1(lo), math.expm1(hi)


def main(spec: str, windows: int, seq_len: int = 512) -> None:
    src = resolve_source(spec, Store.default())
    tok = AutoTokenizer.from_pretrained(src.folder)
    model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32).eval()
    ids = make_tokens(BrownSource(), tok, "eval", packing="windows", count=windows, seq_len=seq_len,
                      seed=None).input_ids
    linears = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    variants = {"fp32": None}
    for fmt in (NVFP4, MXFP4):
        variants[f"{fmt.name} rtn"] = lambda w, f=fmt: quantize_blocks(w, f)
        variants[f"{fmt.name} search"] = lambda w, f=fmt: search_block_scales(w, f)
    nll = {}
    for name, quantize in variants.items():
        start = time.monotonic()
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(original[n] if quantize is None else dequantize_blocks(quantize(original[n])))
        quant_s = time.monotonic() - start
        nll[name] = window_nll(model, ids)
        line = {"model": spec, "variant": name, "windows": windows, "seq_len": seq_len, "corpus": "brown eval",
                "ppl": math.exp(nll[name].mean().item()), "quantize_s": round(quant_s, 1),
                "eval_s": round(time.monotonic() - start - quant_s, 1), "window_nll": nll[name].tolist()}
        if quantize is not None:
            base = nll["fp32"]
            line["vs_fp32"] = paired(nll[name] - base)
            rtn = name.replace("search", "rtn")
            if rtn != name:
                line["vs_rtn"] = paired(nll[name] - nll[rtn])
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)
