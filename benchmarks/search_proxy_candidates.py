"""Which damage proxy ranks quantization.search's units like their true end-to-end damage: every proxy
`llmc.quant.search.layer_damages` knows (output, update, token, fisher with the gradient of the data's next-token
log-likelihood or of tokens drawn from the model itself), measured on the recipe's calibration windows, against the
true per-unit KL divergences `benchmarks/search_proxy.py` measured (its --out rows).

    PYTHONPATH=$PWD python benchmarks/search_proxy_candidates.py RECIPE [--set KEY=VALUE]... --rows TRUE.json
        [--mix REPORT.json=MEASURED_KLD]... [--out results.json]

For each proxy: Spearman's rank correlation with the true KLD over every (unit, candidate) pair and per candidate,
the least-squares factor a in KLD ~= a * proxy, and for each --mix (a build's report.json, its search's units, and
the KLD its evaluation measured) the mix's summed proxy, a * that and, for fisher, the sum itself (fisher is an
estimate of the KL divergence per token in nats, no factor fitted). Runs the unquantized model whole (a model that
fits in memory; the search itself streams)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_proxy import spearman  # noqa: E402  (the script beside this one)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--rows", type=Path, required=True, help="search_proxy.py's --out (true per-unit KLD rows)")
    ap.add_argument("--mix", action="append", default=[], help="REPORT.json=MEASURED_KLD")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc.data.stages import calibration_tokens
    from llmc.model.source import resolve_source
    from llmc.quant.search import Unit, layer_damages
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    recipe = load_recipe(Path(args.recipe), args.overrides)
    q = recipe.quantization
    members = q.search.members(q.algorithm)
    true = json.loads(args.rows.read_text())
    measured = json.loads(Path(true["measurement"]).read_text())
    cands = list(q.search.names)  # the recipe's candidates (its rows' units; the true rows cover some of them)
    schemes = {c: members.get(c) for c in cands}
    source = resolve_source(recipe.model.source, Store.default())
    tok = AutoTokenizer.from_pretrained(source.folder)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    model.requires_grad_(False)
    ids = calibration_tokens(recipe.calibration, tok).input_ids
    t0 = time.monotonic()
    captured = _capture(model, ids)
    modules = dict(model.named_modules())
    by_layer: dict[int, list[Unit]] = {}
    for name, entry in measured["units"].items():
        by_layer.setdefault(int(name.split(".")[1]), []).append(Unit(name, tuple(entry["linears"]), 0))
    proxies: dict[str, dict[str, list[float]]] = {}
    for i, layer in enumerate(model.model.layers):
        units = by_layer.get(i, [])
        linears = {n: modules[n] for u in units for n in u.linears}
        c = captured[i]
        for label, grads in (("data", c["g_data"]), ("sampled", c["g_sampled"])):
            got = layer_damages(layer, linears, units, schemes, c["x"], c["extras"], c["y"], c["absmax"], grads)
            for p, rows in got.items():
                key = f"fisher-{label}" if p == "fisher" else p
                if p != "fisher" and label == "sampled":
                    continue
                proxies.setdefault(key, {}).update(rows)
        print(f"  layer {i + 1}/{len(model.model.layers)}, {time.monotonic() - t0:.0f} s", file=sys.stderr)

    result = {"recipe": args.recipe, "overrides": args.overrides, "rows": str(args.rows),
              "tokens": int(ids.numel()), "seconds": time.monotonic() - t0, "proxies": {}}
    for p, damage in proxies.items():
        result["proxies"][p] = _score(p, damage, cands, true["rows"], args.mix)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**result, "damage": proxies, "candidates": cands}, indent=1))
    return 0


def _capture(model, ids: torch.Tensor) -> list[dict]:
    """Per decoder layer: its inputs, call arguments and outputs on `ids` (one batch per window), the input absmax
    of each of its Linears, and the gradient at its output of the summed next-token log-likelihood, once with the
    data's next tokens and once with tokens drawn from the model's own distribution (seed 0)."""
    layers = model.model.layers
    per = [{"x": [], "extras": [], "y": [], "absmax": {}, "g_data": [], "g_sampled": []} for _ in layers]
    outs: list[torch.Tensor] = []

    def keep(i):
        def hook(_m, args, kwargs, out):
            y = out[0] if isinstance(out, tuple) else out
            y.retain_grad()
            outs.append(y)
            per[i]["x"].append(args[0].detach().clone())
            per[i]["extras"].append((tuple(a.detach() if torch.is_tensor(a) else a for a in args[1:]),
                                     {k: _detached(v) for k, v in kwargs.items()}))
        return hook

    def absmax(name, i):
        def hook(_m, args):
            a = args[0].detach().abs().amax()
            prev = per[i]["absmax"].get(name)
            per[i]["absmax"][name] = a if prev is None else torch.maximum(prev, a)
        return hook

    hooks = [layer.register_forward_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    hooks += [m.register_forward_pre_hook(absmax(n, i)) for i, layer in enumerate(layers)
              for n, m in ((f"model.layers.{i}.{k}", m) for k, m in layer.named_modules()) if isinstance(m, torch.nn.Linear)]
    hooks.append(model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.requires_grad_()))
    from llmc.quant.fisher import DRAW_SEED, draw_tokens

    g = torch.Generator().manual_seed(DRAW_SEED)
    try:
        for w in range(ids.shape[0]):
            outs.clear()
            batch = ids[w:w + 1]
            logp = torch.log_softmax(model(batch, use_cache=False).logits.float(), -1)
            data = logp[:, :-1].gather(-1, batch[:, 1:, None]).sum()
            drawn = draw_tokens(logp.detach(), g)  # as llmc.quant.fisher.head_gradients draws them
            sampled = logp.gather(-1, drawn.unsqueeze(-1)).sum()
            for label, loss, retain in (("g_data", data, True), ("g_sampled", sampled, False)):
                for y in outs:
                    y.grad = None
                loss.backward(retain_graph=retain)
                for i, y in enumerate(outs):
                    per[i][label].append(y.grad.detach().clone())
            for i, y in enumerate(outs):
                per[i]["y"].append(y.detach().clone())
    finally:
        for h in hooks:
            h.remove()
    return per


def _detached(v):
    if torch.is_tensor(v):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(_detached(t) for t in v)
    return v


def _score(proxy: str, damage: dict[str, list[float]], cands: list[str], rows: list[dict], mixes: list[str]) -> dict:
    pairs = [(damage[r["unit"]][cands.index(r["candidate"])], r["kld"], r["candidate"]) for r in rows
             if r["candidate"] in cands]
    p = np.array([a for a, _, _ in pairs])
    k = np.array([b for _, b, _ in pairs])
    factor = float((p * k).sum() / (p * p).sum())
    out = {"spearman_all": spearman(list(p), list(k)),
           "spearman_per_candidate": {c: spearman([a for a, _, cc in pairs if cc == c], [b for _, b, cc in pairs if cc == c])
                                      for c in sorted({c for *_, c in pairs})},
           "factor": factor, "mixes": {}}
    for spec in mixes:
        path, kld = spec.rsplit("=", 1)
        report = json.loads(Path(path).read_text())
        units = report["search"][""]["units"]
        summed = sum(damage[u][cands.index(c)] for u, c in units.items() if c in cands)
        unknown = sorted({c for c in units.values() if c not in cands})
        out["mixes"][path] = {"measured_kld": float(kld), "summed_proxy": summed, "predicted_factor": factor * summed,
                              **({"predicted_fisher": summed} if proxy.startswith("fisher") else {}),
                              **({"candidates_not_measured": unknown} if unknown else {})}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
