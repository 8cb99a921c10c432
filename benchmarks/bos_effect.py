"""What prepending a tokenizer's declared-but-unused BOS does to perplexity, on identical targets.

    PYTHONPATH=$PWD python benchmarks/bos_effect.py demo:smollm2-135m 16

Takes the Brown eval windows llmc's rule makes (`llmc.data.bos`: no BOS where the tokenizer adds none), scores
positions 1..n-1 of each as they are, then again with the declared BOS prepended (llmc's rule before issue 21),
so both score exactly the same tokens; prints both perplexities and the paired per-window change with a bootstrap
95% interval. fp32, CPU.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmc.data.sources import BrownSource
from llmc.data.tokens import make_tokens
from llmc.model.source import resolve_source
from llmc.storage.store import Store


def token_nll(model, ids: torch.Tensor, skip: int, batch: int = 4) -> torch.Tensor:
    """Per-token NLL of ids[:, skip+1:] given everything before (skip=1 leaves the prepended BOS unscored)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            b = ids[i : i + batch]
            logp = torch.log_softmax(model(input_ids=b).logits[:, skip:-1].float(), -1)
            out.append(-logp.gather(-1, b[:, skip + 1 :, None])[..., 0])
    return torch.cat(out)


def main(spec: str, windows: int, seq_len: int = 512) -> None:
    src = resolve_source(spec, Store.default())
    tok = AutoTokenizer.from_pretrained(src.folder)
    model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32).eval()
    tokens = make_tokens(BrownSource(), tok, "eval", packing="windows", count=windows, seq_len=seq_len, seed=None)
    decision = tokens.bos_decision
    print(f"{spec}: {decision.reason}")
    if decision.used or decision.declared_id is None:
        print("the rule already prepends this tokenizer's BOS (or it has none): nothing to compare")
        return
    plain = tokens.input_ids
    with_bos = torch.cat([torch.full((windows, 1), decision.declared_id), plain], 1)
    t = time.monotonic()
    a = token_nll(model, plain, 0)
    b = token_nll(model, with_bos, 1)
    print(f"no BOS (llmc's rule): ppl {math.exp(a.mean()):.3f}")
    print(f"declared BOS {tok.convert_ids_to_tokens(decision.declared_id)!r} prepended, same targets: "
          f"ppl {math.exp(b.mean()):.3f}")
    diff = b.mean(1) - a.mean(1)  # per-window log ratio, BOS over no BOS
    g = torch.Generator().manual_seed(0)
    boots = torch.stack([diff[torch.randint(0, windows, (windows,), generator=g)].mean() for _ in range(1000)])
    lo, hi = torch.quantile(boots, torch.tensor([0.025, 0.975])).tolist()
    print(f"ppl(with BOS) / ppl(no BOS) - 1: {math.expm1(diff.mean()):+.2%} [{math.expm1(lo):+.2%}, "
          f"{math.expm1(hi):+.2%}] (paired bootstrap over {windows} windows); {time.monotonic() - t:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)
