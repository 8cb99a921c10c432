"""Does the calibration domain move quality beyond the noise? SmolLM2-135M-Instruct (the packaged demo model)
quantized INT8-SmoothQuant (W8A8, dynamic per-token activations) and INT4-AWQ (W4A16, symmetric group 64 — not
the source's Q4_1 grid), calibrated on Brown, Shakespeare and Austen, each evaluated on every corpus's held-out
part; then the same two schemes calibrated on chat-formatted samples with and without the model's chat template.

    scripts/setup-corpora.sh && python benchmarks/make_chat_set.py OUT/chat
    PYTHONPATH=$PWD python benchmarks/data_domains.py OUT [--samples 32] [--windows 24] [--only domains|chat]

Writes OUT/results.jsonl (one line per evaluation, appended as they finish) and OUT/results.md. Every build goes
through llmc's own build (`build_until(..., "gate")`) with its own cache under OUT/cache, so a rerun reuses
every finished stage.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import yaml

CORPORA = Path(os.environ.get("LLMC_CORPORA", Path.home() / ".cache" / "llmc" / "corpora"))
DOMAINS = {
    "brown": "brown",
    "shakespeare": {"kind": "text", "path": str(CORPORA / "shakespeare"), "holdout": 10},
    "austen": {"kind": "text", "path": str(CORPORA / "austen"), "holdout": 10},
}
VARIANTS = [
    {"name": "w8a8-sq", "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                                          "activations": {"format": "int8", "strategy": "token", "dynamic": True},
                                          "algorithm": "smoothquant"}},
    {"name": "w4a16-awq", "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 64,
                                                       "symmetric": True}, "algorithm": "awq"}},
]


def recipe(name: str, dataset, corpus, *, samples: int, windows: int, packing: str = "windows") -> dict:
    return {
        "version": 1, "name": name,
        "model": {"source": "demo:smollm2-135m", "dtype": "float32"},
        "variants": VARIANTS,
        "calibration": {"dataset": dataset, "packing": packing, "samples": samples, "seq_len": 512, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"corpus": corpus, "seq_len": 512, "windows": windows, "decode_tokens": 0,
                 "throughput_repeats": 1},
    }


def run(out: Path, name: str, spec: dict, tags: dict) -> None:
    from llmc.build import build_until
    from llmc.recipe.load import load_recipe
    from llmc.store import Store

    path = out / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    t = time.monotonic()
    result = build_until(load_recipe(path), Store(out / "cache"), "gate", threads=2)
    wall = time.monotonic() - t
    with (out / "results.jsonl").open("a") as f:
        for eval_id, m in result.evals.items():
            row = {**tags, "recipe": str(path), "eval": eval_id, "perplexity": m.perplexity, "ppl_ci95": m.ppl_ci95,
                   "ppl_change": m.ppl_change, "kld": m.kld, "windows": spec["eval"]["windows"],
                   "calibration": {k: result.calibration.get(k) for k in ("dataset_label", "packing", "samples",
                                                                           "tokens_sha256", "chat_templates")},
                   "build_wall_s": round(wall, 1)}
            f.write(json.dumps(row) + "\n")
    print(f"{name}: done in {wall:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--only", choices=("domains", "chat"), default=None)
    a = ap.parse_args()
    if a.only != "chat":
        for calib, dataset in DOMAINS.items():
            for ev, corpus in DOMAINS.items():
                run(a.out, f"cal-{calib}-eval-{ev}", recipe(f"cal-{calib}-eval-{ev}", dataset, corpus,
                                                            samples=a.samples, windows=a.windows),
                    {"study": "domains", "calibrated_on": calib, "evaluated_on": ev})
    if a.only != "domains":
        chat = a.out / "chat"
        eval_corpus = {"kind": "jsonl", "path": str(chat / "austen-chat-eval.jsonl"), "messages": "messages"}
        for template in ("model", "none"):
            dataset = {"kind": "jsonl", "path": str(chat / "austen-chat-calibration.jsonl"), "messages": "messages",
                       "chat_template": template}
            run(a.out, f"chat-template-{template}", recipe(f"chat-template-{template}", dataset, eval_corpus,
                                                           samples=a.samples, windows=a.windows, packing="samples"),
                {"study": "chat", "calibrated_on": f"austen chat samples, template {template}",
                 "evaluated_on": "austen chat eval (model template)"})
        run(a.out, "chat-brown-windows", recipe("chat-brown-windows", "brown", eval_corpus, samples=a.samples,
                                                 windows=a.windows),
            {"study": "chat", "calibrated_on": "brown windows (default)", "evaluated_on": "austen chat eval (model template)"})


if __name__ == "__main__":
    main()
