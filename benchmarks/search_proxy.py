"""How well quantization.search's proxy (each unit's layer-output relative error, measured in the build's one
calibration pass) ranks the true per-unit damage: the end-to-end KL divergence from the unquantized model on held-out
evaluation windows with only that unit quantized (weights round-to-nearest, as the search measures them).

    PYTHONPATH=$PWD python benchmarks/search_proxy.py RECIPE [--set KEY=VALUE]... [--windows 4] [--seq-len 256]
        [--sensitivity PATH] [--candidates A,B] [--mix CHOSEN.json]... [--out results.json]

RECIPE (with the same --set as the build) names the search (evaluated on Brown's eval split); its measurement must be in the cache (`llmc build` or
`llmc quantize` it first). Weight-only candidates only (an activation scheme's true damage needs its calibrated
activation scales; those candidates are skipped, said so). Prints Spearman's rank correlation between proxy and true
damage, over every (unit, candidate) and per candidate across units; the least-squares factor a in
KLD ~= a * proxy (through the origin); and, for each --mix (a build's chosen units, `result.search[...]` or
report.json's search entry: {"units": {unit: candidate}}), its predicted KLD two ways: a * (summed proxy), and the
sum of its units' true KLDs (additivity alone).

Each evaluation reruns only the decoder layers from the unit's layer on (the unquantized inputs to that layer are
kept from one baseline pass)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort(kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):  # ties share their mean rank
            idx = v == value
            r[idx] = r[idx].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1]) if len(x) > 1 else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--candidates", help="comma-separated: only these candidates (default: every weight-only one)")
    ap.add_argument("--mix", action="append", default=[], help="a JSON file with {'units': {unit: candidate}}")
    ap.add_argument("--sensitivity", type=Path, help="the measurement's sensitivity.json (default: the newest cached)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.model.source import resolve_source
    from llmc.quant.numerics import dequantize_weight, quantize_weights
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    recipe = load_recipe(Path(args.recipe), args.overrides)
    q = recipe.quantization
    members = q.search.members(q.algorithm)
    store = Store.default()
    measured = _measurement(store, args.sensitivity)
    cands = measured["candidates"]
    skipped = [c for c in cands if c in members and members[c].activations is not None]
    wanted = args.candidates.split(",") if args.candidates else cands
    specs = {c: members[c].weights for c in cands if c in members and c not in skipped and c in wanted}
    if skipped:
        print(f"skipped (activation schemes): {', '.join(skipped)}")

    source = resolve_source(recipe.model.source, store)
    tok = AutoTokenizer.from_pretrained(source.folder)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    ids = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.windows,
                       seed=None).ids
    ids = torch.as_tensor(np.asarray(ids))
    layers = model.model.layers
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, layer in enumerate(layers)]
    with torch.no_grad():
        base = torch.log_softmax(model(ids, use_cache=False).logits.float(), -1)
    for h in hooks:
        h.remove()

    def kld_from(i: int) -> float:
        """Mean per-token KL(base || model) running layers i.. on the baseline's inputs to layer i."""
        logq = torch.log_softmax(run_from(model, ids, i, inputs[i]).float(), -1)
        return float((base.exp() * (base - logq)).sum(-1).mean())

    # A check that the shortened run is the model's own: layers i.. on the kept input, nothing quantized, give the
    # baseline back (a mismatch here would be in every true KLD below).
    for i in sorted({1, len(layers) // 2 + 1} & set(range(len(layers)))):
        drift = kld_from(i)
        if drift > 1e-4:
            raise SystemExit(f"running layers {i}.. alone gives KL {drift:.3g} from the unquantized model (expected ~0):"
                             " run_from does not reproduce this model's forward; fix it before trusting any row")

    modules = dict(model.named_modules())
    rows = []
    t0 = time.monotonic()
    for n_unit, (unit, entry) in enumerate(measured["units"].items()):
        layer = int(unit.split(".")[1])
        for c, proxy in zip(cands, entry["damage"]):
            if c not in specs:
                continue
            saved = {n: modules[n].weight.data for n in entry["linears"]}
            codes = quantize_weights(dict(saved), specs[c])
            try:
                for n, w in saved.items():
                    modules[n].weight.data = dequantize_weight(codes[n], specs[c], w.dtype)
                true = kld_from(layer)
            finally:
                for n, w in saved.items():
                    modules[n].weight.data = w
            rows.append({"unit": unit, "candidate": c, "proxy": proxy, "kld": true})
        print(f"  {n_unit + 1}/{len(measured['units'])} units, {time.monotonic() - t0:.0f} s", file=sys.stderr)

    result = _summarise(rows, specs)
    for path in args.mix:
        chosen = json.loads(Path(path).read_text())
        chosen = chosen.get("search", {}).get("", chosen) if "units" not in chosen else chosen
        result["mixes"][path] = _predict(chosen["units"], rows, measured, result["factor"])
    result.update({"recipe": args.recipe, "overrides": args.overrides, "windows": args.windows,
                   "seq_len": args.seq_len, "measurement": measured["path"], "seconds": time.monotonic() - t0})
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**result, "rows": rows}, indent=1))
    return 0


class _Skip(torch.nn.Module):
    """A decoder layer already run: passes the hidden states through. It keeps the layer's own attention-type
    attributes, and its place in `model.model.layers`, so that the model's loop still pairs every later layer with its
    own mask and rotary embedding: Gemma-3 picks them by the loop index from `config.layer_types`, so running a slice
    `layers[i:]` would give layer i layer 0's (local, sliding) rope."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        for name in ("attention_type", "layer_type", "is_sliding", "layer_idx"):
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def run_from(model, ids: torch.Tensor, i: int, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits on `ids` with `hidden` (the kept input to decoder layer i) as layer i's input: the embedding's
    output replaced by `hidden` and layers 0..i-1 passed through, so only layers i.. and the head run."""
    layers = model.model.layers
    saved = list(layers)
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, out: hidden)
    try:
        for j in range(i):
            layers[j] = _Skip(saved[j])
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        hook.remove()
        for j in range(i):
            layers[j] = saved[j]


def _measurement(store, path: Path | None) -> dict:
    """The search measurement at `path`, or the newest cached one (its sensitivity.json and where it is)."""
    if path is not None:
        return {**json.loads(path.read_text()), "path": str(path)}
    from llmc.pipeline.search import SENSITIVITY_FILE  # lazy: the script's imports wait for its arguments

    found = sorted((store.root / "stages" / "quantize").glob(f"*/{SENSITIVITY_FILE}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no cached search measurement: run `llmc quantize RECIPE` (same --set) first")
    return {**json.loads(found[-1].read_text()), "path": str(found[-1])}


def _summarise(rows: list[dict], specs: dict) -> dict:
    proxy = np.array([r["proxy"] for r in rows])
    kld = np.array([r["kld"] for r in rows])
    factor = float((proxy * kld).sum() / (proxy * proxy).sum())
    per = {c: spearman([r["proxy"] for r in rows if r["candidate"] == c], [r["kld"] for r in rows if r["candidate"] == c])
           for c in specs}
    return {"spearman_all": spearman(list(proxy), list(kld)), "spearman_per_candidate": per, "factor": factor,
            "pairs": len(rows), "mixes": {}}


def _predict(units: dict[str, str], rows: list[dict], measured: dict, factor: float) -> dict:
    by = {(r["unit"], r["candidate"]): r for r in rows}
    cands = measured["candidates"]
    proxy = sum(measured["units"][u]["damage"][cands.index(c)] for u, c in units.items())
    missing = [u for u, c in units.items() if c != "bf16" and (u, c) not in by]
    true_sum = sum(by[(u, c)]["kld"] for u, c in units.items() if (u, c) in by)
    return {"summed_proxy": proxy, "predicted_kld_factor": factor * proxy, "predicted_kld_sum_of_units": true_sum,
            "units_without_true_damage": len(missing)}


if __name__ == "__main__":
    raise SystemExit(main())
