"""DeepSeek-V3.2's lightning indexer, llama.cpp against llmc's torch engine: which keys each keeps, and why they differ.

    bash scripts/setup-llama.sh
    PYTHONPATH=$PWD python benchmarks/v32_indexer_agreement.py /tmp/v32-agree --topk 8 16 32 64 \
        > benchmarks/results/v32_indexer_agreement.jsonl
    PYTHONPATH=$PWD python benchmarks/v32_indexer_agreement.py /tmp/v32-agree --topk 8 --index-heads 64 \
        >> benchmarks/results/v32_indexer_agreement.jsonl

The tiny random DeepSeek-V3.2 of tests/integration/test_gguf_moe_llamacpp.py (2 MoE layers, as make_tiny builds it;
index_head_dim 64), quantized W8A16 by llmc and written twice as GGUF from the same canonical form: as `llmc build`
writes it (Q8_0 linears, F16 attn_k_b / indexer attn_k / embeddings) and with every tensor F32 (the dequantized
canonical weights: what the torch engine multiplies with). Both are scored by llama.cpp with its K cache (MLA latent
cache and indexer key cache) in F16 (its default) and in F32; the torch engine scores the compressed-tensors export of
the same canonical form. Same 8 random windows x 64 tokens as the test.

Per case, one JSON line: perplexity change, top-1 agreement, KLD (torch || llama.cpp, full vocabulary), and per layer
how many queries keep a different key set in llama.cpp (its `top_k-N`, read with its masked `indexer_score-N` through
its eval callback: benchmarks/_v32_llama_child.py) than in transformers (its own indexer's scores, recorded), with
the swapped keys' torch score gaps (`compare`). `--index-heads 64` gives the tiny model DeepSeek-V3.2's 64 indexer
heads (the tests' 4 leave many keys at exactly 0: every head's ReLU zero).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, WINDOWS = 64, 8


def _f32_gguf(qm, out: Path):
    """`export_gguf` with every tensor written F32 from the dequantized canonical weights (diagnostic only)."""
    from llmc.formats import gguf as g

    plan_tensors, type_plan = g._plan_tensors, g.type_plan

    def all_f32(*a, **k):
        return [[dataclasses.replace(i, qtype="F32") for i in f] for f in plan_tensors(*a, **k)]

    def requantized(*a, **k):  # F32 "requantized" = the dequantized weights as they are
        return dataclasses.replace(type_plan(*a, **k), method="requantized")

    g._plan_tensors, g.type_plan = all_f32, requantized
    try:
        return g.export_gguf(qm, out, embedding_type="f32")
    finally:
        g._plan_tensors, g.type_plan = plan_tensors, type_plan


class IndexerRecorder:
    """transformers' DeepseekV32Indexer.forward, recording each call's masked index scores and kept keys."""

    def __init__(self) -> None:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

        self.m, self.calls = m, []

    def __enter__(self):
        m, calls = self.m, self.calls
        original = m.DeepseekV32Indexer.forward
        self.original = original

        def forward(mod, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                    past_key_values=None):
            # transformers' lines (5.23), to read index_scores beside the selection
            b, s, _ = hidden_states.shape
            cos, sin = position_embeddings
            q = mod.wq_b(q_resid).view(b, s, mod.n_heads, mod.head_dim)
            q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
            k = mod.k_norm(mod.wk(hidden_states)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
            q_rot, k_rot = m.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
            scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
            w = mod.weights_proj(hidden_states.to(mod.weights_proj.weight.dtype)).float() * (mod.n_heads**-0.5)
            index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
            if attention_mask.dtype == torch.bool:
                index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
            else:
                index_scores = index_scores + attention_mask
            out = original(mod, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                           past_key_values=past_key_values)
            topk = index_scores.topk(min(mod.index_topk, index_scores.shape[-1]), dim=-1).indices
            if not torch.equal(topk.sort(-1).values, out.long().sort(-1).values):
                raise AssertionError("the recorder's index scores do not reproduce transformers' selection")
            calls.append((mod.layer_idx, index_scores.detach().clone(), out.detach().long().clone()))
            return out

        m.DeepseekV32Indexer.forward = forward
        return self

    def __exit__(self, *exc):
        self.m.DeepseekV32Indexer.forward = self.original


def _kept(sel: np.ndarray, t: int) -> set[int]:
    """The causal keys (<= t) in a query's selection (llama.cpp's top_k can name masked keys for early queries)."""
    return {int(j) for j in sel if j <= t}


def compare(torch_scores, torch_sel, llama_scores, llama_sel, k: int) -> dict:
    """Per layer, over the queries with more than k causal keys: how many keep a different key set in llama.cpp than
    in transformers; of the keys swapped, how many have exactly equal torch scores (a tie, broken differently by
    torch.topk and ggml_top_k; `ties_at_zero`: at score 0, every head's ReLU zero) and, for the rest, the torch
    score gap between the key torch kept and the one llama.cpp kept instead. Scores are in units of the query's
    torch score spread (max - min over its causal keys); `margin_*`: torch's gap between its k-th and (k+1)-th key,
    over all queries; `score_noise_*`: |llama.cpp's score - torch's| over every causal key."""
    n, L, S = torch_sel.shape[0], torch_sel.shape[1], SEQ_LEN
    per_layer = []
    for il in range(L):
        differ, queries, ties, zero_ties, gaps, margins, noise = 0, 0, 0, 0, [], [], []
        for w in range(n):
            for t in range(S):
                ts, ls = torch_scores[w, il, t, : t + 1], llama_scores[w, il, t, : t + 1]
                spread = float(ts.max() - ts.min()) or 1.0
                noise.extend((np.abs(ls - ts) / spread).tolist())
                if t + 1 <= k:
                    continue  # every causal key kept by both: nothing to choose
                queries += 1
                ordered = np.sort(ts)[::-1]
                margins.append(float(ordered[k - 1] - ordered[k]) / spread)
                a, b = _kept(torch_sel[w, il, t], t), _kept(llama_sel[w, il, t], t)
                if a == b:
                    continue
                differ += 1
                # torch kept j_t, llama.cpp j_l instead: the closest such pair in torch's scores
                gap = min(float(ts[j_t] - ts[j_l]) for j_t in a - b for j_l in b - a) / spread
                if gap == 0.0:
                    ties += 1
                    zero_ties += int(any(ts[j] == 0.0 for j in a - b))
                else:
                    gaps.append(gap)
        q = (lambda xs, p: float(np.quantile(xs, p)) if xs else None)
        per_layer.append({
            "layer": il, "queries": queries, "differ": differ, "exact_ties": ties, "ties_at_zero": zero_ties,
            "gap_median": q(gaps, 0.5), "gap_max": q(gaps, 1.0),
            "margin_median": q(margins, 0.5), "margin_p10": q(margins, 0.1),
            "score_noise_median": q(noise, 0.5), "score_noise_p99": q(noise, 0.99),
        })
    return {"layers": per_layer}


def _metrics(ref_logits: torch.Tensor, logits: torch.Tensor, windows: torch.Tensor) -> dict:
    ref = torch.log_softmax(ref_logits[:, :-1].double(), -1)
    got = torch.log_softmax(logits[:, :-1].double(), -1)
    tgt = windows[:, 1:]
    nll_ref = -ref.gather(-1, tgt[..., None]).squeeze(-1)
    nll = -got.gather(-1, tgt[..., None]).squeeze(-1)
    ppl_ref, ppl = math.exp(float(nll_ref.mean())), math.exp(float(nll.mean()))
    kld = float((ref.exp() * (ref - got)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).double().mean())
    return {"ppl_torch": ppl_ref, "ppl_llama": ppl, "delta_pct": 100 * (ppl / ppl_ref - 1), "top1": top1, "kld": kld}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--topk", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--index-heads", type=int, default=4, help="index_n_heads (the tests' 4; DeepSeek-V3.2's 64)")
    ap.add_argument("--cases", nargs="+", default=["q8_0/f16", "q8_0/f32", "f32/f16", "f32/f32"],
                    help="GGUF weights / llama.cpp K-cache type")
    args = ap.parse_args()

    from llmc.engines.environments import engine_python
    from llmc.engines.llamacpp import SPEC
    from llmc.engines.torch_ref import TorchEngine
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.gguf import export_gguf
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model
    from tests.unit.families import make_tiny

    python = engine_python(SPEC)
    child = ROOT / "benchmarks" / "_v32_llama_child.py"
    for k in args.topk:
        base = args.out / f"topk{k}-heads{args.index_heads}"
        folder = make_tiny("deepseek_v32", base / "model", index_head_dim=64, index_topk=k,
                           index_n_heads=args.index_heads)
        src = ModelSource(folder, "t", str(folder))
        quantize_model(src, Scheme(TensorSpec(format="int8", strategy="channel")), base / "q", None)
        qm = QuantizedModel.open(base / "q")
        ggufs = {"q8_0": export_gguf(qm, base / "gguf_q8_0").path, "f32": _f32_gguf(qm, base / "gguf_f32").path}
        export_compressed_tensors(qm, base / "ct")
        windows = torch.randint(3, qm.config["vocab_size"], (WINDOWS, SEQ_LEN),
                                generator=torch.Generator().manual_seed(0))
        np.save(base / "windows.npy", windows.numpy())
        engine = TorchEngine(base / "ct", streamed=False)
        with torch.no_grad(), IndexerRecorder() as rec:
            ref_logits = engine.model(input_ids=windows, use_cache=False).logits.float()
        n_layers = qm.config["num_hidden_layers"]
        t_scores = np.stack([c[1].numpy() for c in rec.calls]).reshape(n_layers, WINDOWS, SEQ_LEN, SEQ_LEN)
        t_sel = np.stack([c[2].numpy() for c in rec.calls]).reshape(n_layers, WINDOWS, SEQ_LEN, -1)
        t_scores, t_sel = t_scores.transpose(1, 0, 2, 3), t_sel.transpose(1, 0, 2, 3)
        for case in args.cases:
            weights, cache = case.split("/")
            npz = base / f"llama_{weights}_{cache}.npz"
            t0 = time.time()
            subprocess.run([str(python), str(child), str(ggufs[weights]), str(base / "windows.npy"), cache, str(npz)],
                           check=True, env={**os.environ, "PYTHONPATH": ""})
            r = np.load(npz)
            row = {"index_topk": k, "index_n_heads": args.index_heads, "gguf": weights, "k_cache": cache,
                   "llama_cpp": str(r["version"]),
                   **_metrics(ref_logits, torch.from_numpy(r["logits"]), windows),
                   **compare(t_scores, t_sel, r["scores"], r["topk"], k), "seconds": round(time.time() - t0, 1),
                   "loadavg": open("/proc/loadavg").read().split()[:3],
                   "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
