"""Does the calibration domain move quality beyond the noise? SmolLM2-135M-Instruct (the packaged demo model)
quantized INT8-SmoothQuant (W8A8, dynamic per-token activations) and INT4-AWQ (W4A16, symmetric group 64 — not
the source's Q4_1 grid; grid 10, no clip search), calibrated on Brown, Shakespeare and Austen, each evaluated on
the corpora's held-out parts (Brown: every 10th file; Shakespeare and Austen: `holdout: 10`, every 10th play /
chapter); then both schemes calibrated on chat-formatted samples with and without the model's chat template.

    scripts/setup-corpora.sh && python benchmarks/make_chat_set.py OUT/chat
    python benchmarks/make_cloze_task.py OUT/tasks       # a local multiple-choice task for eval.tasks
    PYTHONPATH=$PWD python benchmarks/data_domains.py OUT [--samples 8] [--windows 8] [--only domains|chat|tasks]
    PYTHONPATH=$PWD python benchmarks/data_domains.py OUT --match chat-template   # only the builds so named
    PYTHONPATH=$PWD python benchmarks/data_domains.py OUT --table      # results.jsonl as a markdown table

Runs go most informative first (a loaded machine may not finish the plan). Writes OUT/results.jsonl, one line
per evaluation as it finishes. Every build goes through llmc's own build (`build_until(..., "gate")`) with its
own cache under OUT/cache, so a rerun reuses every finished stage (baselines, calibrations, quantizations).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import yaml

CORPORA = Path(os.environ.get("LLMC_CORPORA", Path.home() / ".cache" / "llmc" / "corpora"))
DOMAINS = {
    "brown": "brown",
    "shakespeare": {"kind": "text", "path": str(CORPORA / "shakespeare"), "holdout": 10},
    "austen": {"kind": "text", "path": str(CORPORA / "austen"), "holdout": 10},
}
VARIANTS = {v["name"]: v for v in [
    {"name": "w8a8-sq", "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                                          "activations": {"format": "int8", "strategy": "token", "dynamic": True},
                                          "algorithm": "smoothquant"}},
    {"name": "w4a16-awq", "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 64,
                                                       "symmetric": True}, "algorithm": "awq",
                                            # the full search (grid 20 + clip search) ran ~100 s a layer on this
                                            # loaded 2-core machine: a coarser grid and no clip search fit the time
                                            "options": {"n_grid": 10, "clip": False}}},
]}


def recipe(name: str, dataset, corpus, *, samples: int, windows: int, packing: str = "windows",
           variant: str = "w8a8-sq") -> dict:
    return {
        "version": 1, "name": name,
        "model": {"source": "demo:smollm2-135m", "dtype": "float32"},
        "variants": [VARIANTS[variant]],
        "calibration": {"dataset": dataset, "packing": packing, "samples": samples, "seq_len": 512, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"corpus": corpus, "seq_len": 512, "windows": windows, "decode_tokens": 0,
                 "throughput_repeats": 1},
    }


def run(out: Path, name: str, spec: dict, tags: dict) -> None:
    from llmc.build import build_until
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    path = out / "recipes" / f"{name}.yaml"
    results = out / "results.jsonl"
    if results.is_file() and any(json.loads(x)["recipe"] == str(path) for x in results.read_text().splitlines()):
        return  # measured by an earlier run of this script
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    t = time.monotonic()
    result = build_until(load_recipe(path), Store(out / "cache"), "gate", threads=2)
    wall = time.monotonic() - t
    with (out / "results.jsonl").open("a") as f:
        for eval_id, m in result.evals.items():
            # a build on several corpora (eval.corpus as a mapping): each evaluation says which it was scored on
            on = {"evaluated_on": m.corpus} if m.corpus else {}
            row = {**tags, **on, "recipe": str(path), "eval": str(replace(eval_id, corpus=None)), "perplexity": m.perplexity, "ppl_ci95": m.ppl_ci95,
                   "ppl_change": m.ppl_change, "kld": m.kld, "windows": spec["eval"]["windows"],
                   "calibration": {k: result.calibration.get(k) for k in ("dataset_label", "packing", "samples",
                                                                           "tokens_sha256", "chat_templates")},
                   "tasks": m.tasks, "build_wall_s": round(wall, 1),
                   "verdicts": [v.to_dict() for v in result.verdicts if v.target == eval_id]}
            f.write(json.dumps(row) + "\n")
    print(f"{name}: done in {wall:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--only", choices=("domains", "chat", "tasks"), default=None)
    ap.add_argument("--task-limit", type=int, default=100)
    ap.add_argument("--one-build-per-calibration", action="store_true",
                    help="domains: one build per (scheme, calibration corpus), evaluated on every corpus at once "
                         "(eval.corpus as a mapping; one quantization, named <scheme>-cal-<corpus>-eval-all)")
    ap.add_argument("--match", default=None,
                    help="run only the builds whose name contains this (e.g. chat-template, awq-cal-austen)")
    ap.add_argument("--table", action="store_true", help="print OUT/results.jsonl as a markdown table and stop")
    a = ap.parse_args()
    if a.table:
        print(table(a.out / "results.jsonl"))
        return
    # On a loaded machine the whole plan does not finish: the most informative runs first. INT8-SmoothQuant calibrated
    # on Brown vs Shakespeare, judged on both held-out parts; the chat study; the same for INT4-AWQ; then Austen.
    first = [("brown", "shakespeare"), ("shakespeare", "shakespeare"), ("brown", "brown"), ("shakespeare", "brown")]
    rest = [(c, e) for c in DOMAINS for e in DOMAINS if (c, e) not in first]
    plan = [("domains", "w8a8-sq", c, e) for c, e in first] + [("chat", "w8a8-sq", t, None) for t in ("model", "none")]
    plan += [("tasks", "w8a8-sq", "brown", "brown")]
    plan += [("domains", "w4a16-awq", c, e) for c, e in first] + [("chat", "w4a16-awq", t, None) for t in ("model", "none")]
    plan += [("domains", v, c, e) for v in VARIANTS for c, e in rest]
    if a.one_build_per_calibration:  # the domain pairs regrouped: one build per calibration, all corpora evaluated
        pairs = [(v, c) for study, v, c, _ in plan if study == "domains"]
        plan = [p for p in plan if p[0] != "domains"] + [("domains", v, c, "all") for v, c in dict.fromkeys(pairs)]
    for study, variant, calib, ev in plan:
        if a.only and a.only != study:
            continue
        if a.match and a.match not in run_name(study, variant, calib, ev):
            continue
        if study == "domains":
            name = f"{variant}-cal-{calib}-eval-{ev}"
            run(a.out, name, recipe(name, DOMAINS[calib], DOMAINS if ev == "all" else DOMAINS[ev],
                                    samples=a.samples, windows=a.windows,
                                    variant=variant), {"study": "domains", "calibrated_on": calib, "evaluated_on": ev})
        elif study == "tasks":
            tasks_run(a, variant)
        else:
            chat_run(a, variant, calib)


def run_name(study: str, variant: str, calib: str, ev: str | None) -> str:
    return {"domains": f"{variant}-cal-{calib}-eval-{ev}", "tasks": f"{variant}-tasks"}.get(
        study, f"{variant}-chat-template-{calib}")


def table(path: Path) -> str:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    base = {(r["study"], r["calibrated_on"], r["evaluated_on"]): r for r in rows if r["eval"] == "torch:baseline"}
    out = ["| calibrated on | evaluated on (held-out) | scheme | ppl base | ppl quant | Δ ppl (95% CI) | KLD (95% CI) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["eval"] == "torch:baseline" or r["ppl_change"] is None:
            continue
        b = base[(r["study"], r["calibrated_on"], r["evaluated_on"])]
        c, k = r["ppl_change"], r["kld"]
        out.append(f"| {r['calibrated_on']} | {r['evaluated_on']} | {r['eval'].split(':', 1)[1].split('/')[0]} | "
                   f"{b['perplexity']:.3f} | {r['perplexity']:.3f} | {c['delta_pct']:+.2f}% [{c['ci_low_pct']:+.2f}, "
                   f"{c['ci_high_pct']:+.2f}] | {k['mean']:.4f} [{k['ci_low']:.4f}, {k['ci_high']:.4f}] |")
    out += ["", *calibration_pairs(path.parent, rows)]
    tasks = [(r["eval"], name, t) for r in rows for name, t in (r.get("tasks") or {}).items()]
    if tasks:
        out += ["", "| model | task | accuracy (95% CI: acc ± 1.96·stderr) | n |", "|---|---|---|---|"]
        out += [f"| {e} | {n} | {t['acc']:.4f} [{t['ci_low']:.4f}, {t['ci_high']:.4f}] | {t['n']} |" for e, n, t in tasks]
        out += [f"- gate {v['gate']} on {v['target']}: {v['measured']} — {'pass' if v['passed'] else 'FAIL'}"
                for r in rows for v in r.get("verdicts", []) if v["gate"].startswith("min_task")]
    return "\n".join(out)


def calibration_pairs(out: Path, rows: list[dict]) -> list[str]:
    """Calibration A against calibration B on the same held-out windows, paired per window: the perplexity of
    B's artifact relative to A's (llmc's paired bootstrap), so the calibration effect is measured directly."""
    from safetensors.torch import load_file

    from llmc.eval.metrics import paired_ppl_change, perplexity

    by_ppl = {}
    for d in (out / "cache" / "stages" / "eval").iterdir():
        if (d / "scores.safetensors").is_file():
            nll = load_file(str(d / "scores.safetensors"))["nll"]
            by_ppl[round(perplexity(nll), 6)] = nll
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r["study"] != "baseline" and r["eval"] != "torch:baseline" and r["perplexity"] is not None:
            scheme = r["eval"].split(":", 1)[1].split("/")[0]
            groups.setdefault((r["study"], r["evaluated_on"], scheme), {})[r["calibrated_on"]] = by_ppl.get(
                round(r["perplexity"], 6))
    lines = ["| evaluated on | scheme | calibration A → B | ppl(B) / ppl(A) − 1, paired per window (95% CI) |",
             "|---|---|---|---|"]
    for (study, ev, scheme), cal in groups.items():
        names = [c for c in cal if cal[c] is not None]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ch = paired_ppl_change(cal[a], cal[b], 1000)
                lines.append(f"| {ev} | {scheme} | {a} → {b} | {ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, "
                             f"{ch['ci_high_pct']:+.2f}] |")
    return lines


def tasks_run(a, variant: str) -> None:
    """The Brown-calibrated build again (every stage cached) with a local harness task: Austen next-word cloze
    (benchmarks/make_cloze_task.py OUT/tasks), gated at 0.9 of the baseline's accuracy."""
    name = f"{variant}-tasks"
    spec = recipe(name, "brown", "brown", samples=a.samples, windows=a.windows, variant=variant)
    spec["eval"] |= {"tasks": [str(a.out / "tasks" / "austen_cloze.yaml")], "task_limit": a.task_limit}
    spec["gates"] = {"min_task_accuracy_ratio": 0.9}
    run(a.out, name, spec, {"study": "tasks", "calibrated_on": "brown", "evaluated_on": "brown + austen_cloze"})


def chat_run(a, variant: str, template: str) -> None:
    chat = a.out / "chat"
    eval_corpus = {"kind": "jsonl", "path": str(chat / "austen-chat-eval.jsonl"), "messages": "messages"}
    dataset = {"kind": "jsonl", "path": str(chat / "austen-chat-calibration.jsonl"), "messages": "messages",
               "chat_template": template}
    name = f"{variant}-chat-template-{template}"
    run(a.out, name, recipe(name, dataset, eval_corpus, samples=a.samples, windows=a.windows, packing="samples",
                            variant=variant),
        {"study": "chat", "calibrated_on": f"austen chat samples, template {template}",
         "evaluated_on": "austen chat eval (model template)"})

if __name__ == "__main__":
    main()
