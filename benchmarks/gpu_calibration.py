"""Calibration on a GPU, llmc against llm-compressor 0.14 side by side, per decoder layer and against the floor.

    python benchmarks/gpu_calibration.py --out DIR [--shape llama-8b|llama-70b|smollm2|tiny] [--layers 3]
        [--samples 64] [--seq-len 2048] [--schemes gptq-w4a16 fp8-static sq-w8a8 awq-w4a16 awq-w4a16-grid]
        [--tools llmc llm-compressor llm-compressor-tuned] [--repeats 2] [--device cuda|cpu] [--dtype bfloat16]
        [--budget-s 450] [--step-timeout-s 150] [--heldout-samples 8] [--heldout-seq-len 1024] [--peer-python PY]
        [--work DIR] [--disk-probe-mb 256] [--eval-windows 0] [--eval-scheme fp8-static]
        [--resume-every-layer SCHEME ...] [--profile SCHEME ...] [--width-70b]

No weights travel to a lent GPU machine, so the model is synthetic: the named architecture's decoder layer with random
weights (wall time depends on shapes and token counts, not values), `--layers` of them, written to disk in `--dtype`
with a word-level tokenizer made here; the calibration tokens are seeded random ids, one file every tool reads. Each
tool runs in a fresh child process (benchmarks/_llmc_gpu_child.py, benchmarks/_llmcompressor_gpu_child.py) that first
measures the floor in that same process — one plain forward of every calibration token through one decoder layer
(benchmarks/_layer_floor.py) — then times the quantization call `--repeats` times (each on a fresh copy: llmc into a
new folder, llm-compressor on a freshly loaded model), imports and CUDA start-up outside the timer: llmc's
quantize_model with `device`, layers streamed from disk; llm-compressor's oneshot with its sequential pipeline, model in
host memory. Both compute in `--dtype`.

What is compared (the `tool` of each row):
- `llmc`: llmc's defaults (batch 4, activations on the device between layers when they fit, reads and writes
  overlapped, one forward per layer for FP8 and SmoothQuant, whose next layer is calibrated on unquantized outputs).
- `llm-compressor`: its defaults (batch 1, activations offloaded to the CPU between layers, no prefetch, a
  calibration pass and a propagation pass per layer).
- `llm-compressor-tuned`: the same recipe with llmc's semantics where llm-compressor has the knob (TUNED_KNOBS:
  batch_size 4, sequential_offload_device the run's device, sequential_prefetch, and propagate_error off for FP8
  and SmoothQuant); the child checks each knob against the installed llm-compressor and names any it lacks.
- `awq-w4a16-grid` is llmc's AWQ with llm-compressor's 20-point grid (the same search); it is compared against the
  `awq-w4a16` llm-compressor rows (the same peer recipe, run once).

Reported: a `run` row per repeat (total wall, each decoder layer's time, the floor, peak GPU memory (torch's max
allocated) and peak host RSS); a `cell` row per scheme and tool with layer 2's and layer 3's median and spread over
the repeats and their multiples of the floor (layer 1 carries the embeddings' forward, and llm-compressor's last
subgraph the final norm and LM head, so neither is the compared layer; layer 3 is llmc's last, whose resume point is
not written). Once every run is timed, every output (compressed-tensors; the first repeat's) is scored by one
function (benchmarks/_hidden_error_child.py, on `--device`): final hidden-state relative error on
`--heldout-samples` × `--heldout-seq-len` held-out tokens (`quality` rows), and for llmc against each llm-compressor
row of its peer the difference with a paired 95% bootstrap interval over blocks of 128 held-out tokens
(`quality-diff` rows). Every row carries a `stamp` (benchmarks/_bench_stamp.py): a sha256 of llmc/, the commit and
whether llmc/ or benchmarks/ differ from it, the GPU and its driver, the filesystem type of the work folder and its
measured write (fsync) and read rates. A last `check` row names any row kind the run promised and did not write.

`--width-70b`: one Llama-3.3-70B-width layer (8192 / 28672 / 64 heads / 8 KV), FP8 static and GPTQ, llmc, one
repeat, no quality step, the checkpoint written to tmpfs (/dev/shm) when it has room, else to `--work`; each of those
can still be set (`--shape tiny` checks the mode's path on a CPU). Its layer 1 is reported.

Every step has a time limit (`--step-timeout-s`, cut to what is left of `--budget-s`); a step that fails or runs out
of time is written as a row with its error and the run goes on. Rows go to DIR/rows.jsonl as they come, the table to
DIR/summary.md. `--device cpu --shape tiny` runs the same path on a CPU in seconds (docs/gpu.md).

Beside each llmc run: the planner's prediction for it (time per layer, peak GPU memory, where the activations live).
`--eval-windows N`: llmc's run of `--eval-scheme` also times the streamed torch evaluation of its export and of the
unquantized model on the device, per decoder layer. After the timed pairs and the scoring, as the budget allows:
`--resume-every-layer S...` runs llmc's S again with a resume point after every layer (the cost of the default's
one a minute), and `--profile S...` runs llmc's S under cProfile (DIR/profile-S.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks"
sys.path.insert(0, str(HERE))
from algorithms_vs_llmcompressor import PAIRS  # noqa: E402  (same scheme pairs as the CPU comparison)
from _bench_stamp import environment_stamp, stamp_row  # noqa: E402

SHAPES = {  # hidden, intermediate, attention heads, KV heads, vocab
    "tiny": (128, 256, 4, 2, 1024),
    "smollm2": (576, 1536, 9, 3, 49152),
    "llama-8b": (4096, 14336, 32, 8, 128256),  # Llama-3.1-8B
    "llama-70b": (8192, 28672, 64, 8, 128256),  # Llama-3.3-70B
}
SCHEMES = ["gptq-w4a16", "fp8-static", "sq-w8a8", "awq-w4a16", "awq-w4a16-grid"]
PEERS = ["llm-compressor", "llm-compressor-tuned"]
TOOLS = ["llmc", *PEERS]
MIN_STEP_S = 15  # a step is not started with less of the budget left
LLMC_BATCH = 4  # llmc.quant.stream.CALIBRATION_BATCH_SIZE (tests/unit/test_gpu_calibration_bench.py checks)
# llmc calibrates these in one forward per layer, the next layer on the unquantized outputs (propagate: original);
# GPTQ and AWQ propagate the quantized outputs, as llm-compressor's propagate_error=True does
ONE_PASS = {"fp8-static", "sq-w8a8"}
BLOCK_TOKENS = 128  # held-out tokens per block of the paired interval
WIDTH_70B = {"shape": "llama-70b", "layers": 1, "schemes": ["fp8-static", "gptq-w4a16"], "tools": ["llmc"],
             "repeats": 1, "heldout_samples": 0}
DEFAULTS = {"shape": "llama-8b", "layers": 3, "schemes": SCHEMES, "tools": TOOLS, "repeats": 2, "heldout_samples": 8}


def tuned_knobs(scheme: str, device: str) -> dict:
    """llm-compressor's oneshot arguments that give it llmc's semantics where it has the knob: llmc's batch, the
    activations kept on the calibration device between layers, the next batch prefetched, and for the schemes llmc
    calibrates in one pass the propagation pass dropped (the next layer calibrated on unquantized outputs)."""
    knobs = {"batch_size": LLMC_BATCH, "sequential_offload_device": "cuda:0" if device == "cuda" else device,
             "sequential_prefetch": True}
    if scheme in ONE_PASS:
        knobs["propagate_error"] = False
    return knobs


def int4_group(shape: str) -> int:
    """128 (both tools' usual W4A16 group) where it divides every Linear's input width, else 64 (SmolLM2's 576)."""
    hidden, inter = SHAPES[shape][:2]
    return 128 if hidden % 128 == 0 and inter % 128 == 0 else 64


def scheme_pair(scheme: str, group: int) -> tuple[str, str]:
    """(llmc Scheme expression, llm-compressor recipe name) with the INT4 group filled in."""
    llmc_expr, peer = PAIRS[scheme]
    return llmc_expr.format(group=group), peer


def write_model(folder: Path, shape: str, layers: int, dtype_name: str, device: str = "cpu") -> None:
    """A Llama checkpoint of `shape` with `layers` random decoder layers (normal(0, 0.02) weights, unit norms, tied
    embeddings) and a word-level tokenizer (llm-compressor saves one; nothing is downloaded). The weights are drawn
    on `device` (on a GPU in a fraction of the 48 s the host took at 8B width on the H100 run)."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, inter, heads, kv, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(getattr(torch, dtype_name))
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.to("cpu").save_pretrained(folder, safe_serialization=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(folder)


def run_step(cmd: list[str], timeout: float, env: dict) -> tuple[list[dict], str | None]:
    """The JSON lines a child printed, and its error (non-zero exit, or the time limit) or None."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        stdout, error = r.stdout, (None if r.returncode == 0 else f"exit {r.returncode}: {r.stderr[-2500:]}")
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        error = f"time limit ({timeout:.0f} s) reached"
    lines = []
    for line in stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # a library's own output on stdout
            continue
    return [line for line in lines if isinstance(line, dict)], error


def layer2_row(row: dict) -> dict:
    """Adds layers 1-3's times (those the run has) and each one's multiple of the floor measured in the same
    process."""
    layers = row.get("layer_s") or []
    for n in (1, 2, 3):
        if len(layers) >= n and layers[n - 1] is not None and (n > 1 or len(layers) == 1):
            row[f"layer{n}_s"] = layers[n - 1]
            if row.get("floor_s"):
                row[f"layer{n}_x_floor"] = layers[n - 1] / row["floor_s"]
    return row


def spread(values: list[float]) -> dict:
    """Median, min, max and (max - min) / median of a cell's repeats."""
    import statistics

    if not values:
        return {}
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values), "n": len(values),
            "spread_pct": 100 * (max(values) - min(values)) / median if median else None}


def cell_rows(runs: list[dict]) -> list[dict]:
    """One row per (scheme, tool): each compared layer's median and spread over the repeats that finished."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r.get("kind") == "run" and "error" not in r:
            cells.setdefault((r["scheme"], r["tool"]), []).append(r)
    out = []
    for (scheme, tool), rs in cells.items():
        row = {"kind": "cell", "scheme": scheme, "tool": tool, "repeats": len(rs),
               "wall_s": spread([r["wall_s"] for r in rs]), "floor_s": spread([r["floor_s"] for r in rs])}
        for n in (1, 2, 3):
            if all(f"layer{n}_s" in r for r in rs):
                row[f"layer{n}_s"] = spread([r[f"layer{n}_s"] for r in rs])
                row[f"layer{n}_x_floor"] = row[f"layer{n}_s"]["median"] / row["floor_s"]["median"]
        for key in ("peak_gpu_mb", "peak_rss_mb", "peer_scheme", "oneshot_kwargs", "knobs_missing", "predicted"):
            if rs[0].get(key) is not None:
                row[key] = rs[0][key]
        out.append(row)
    return out


def paired_interval(err_a: list[float], err_b: list[float], ref: list[float], resamples: int = 2000,
                    seed: int = 0) -> dict:
    """Relative error of A minus B (each sqrt(sum err2 / sum ref2) over held-out blocks) with a 95% interval from a
    paired bootstrap: the same resampled blocks for both, so what the two outputs share (the tokens) cancels."""
    import torch

    a, b, r = (torch.tensor(x, dtype=torch.float64) for x in (err_a, err_b, ref))
    diff = float((a.sum() / r.sum()).sqrt() - (b.sum() / r.sum()).sqrt())
    idx = torch.randint(0, len(r), (resamples, len(r)), generator=torch.Generator().manual_seed(seed))
    rs = r[idx].sum(1)
    boot = (a[idx].sum(1) / rs).sqrt() - (b[idx].sum(1) / rs).sqrt()
    low, high = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"diff": diff, "ci95": [low, high], "blocks": len(r), "resamples": resamples}


def quality_diff_rows(quality: list[dict]) -> list[dict]:
    """llmc's error minus each llm-compressor row's of the same peer recipe, with the paired interval."""
    peer_of = {scheme: PAIRS[scheme][1] for scheme in SCHEMES}
    scored = [q for q in quality if "block_err2" in q]
    out = []
    for mine in (q for q in scored if q["tool"] == "llmc"):
        for theirs in (q for q in scored if q["tool"] in PEERS
                       and peer_of.get(q["scheme"]) == peer_of.get(mine["scheme"])):
            out.append({"kind": "quality-diff", "scheme": mine["scheme"], "tool": "llmc", "against": theirs["tool"],
                        "against_scheme": theirs["scheme"], "heldout_tokens": mine.get("heldout_tokens"),
                        "block_tokens": mine.get("block_tokens"),
                        **paired_interval(mine["block_err2"], theirs["block_err2"], mine["block_ref2"])})
    return out


def expected_kinds(args) -> set[str]:
    """The row kinds this invocation promises (the `check` row names any that are missing)."""
    kinds = {"setup", "model", "run", "cell"}
    if args.heldout_samples:
        kinds.add("quality")
        if "llmc" in args.tools and set(args.tools) & set(PEERS):
            kinds.add("quality-diff")
    if args.resume_every_layer:
        kinds.add("every-layer")
    if args.profile:
        kinds.add("profile")
    return kinds


def predict_only(model: Path, args, group: int, emit) -> None:
    """The planner's quantize-stage prediction per scheme for the shape on this device, from its config alone."""
    import torch
    from _llmc_gpu_child import planner_prediction
    from llmc.quant.spec import Scheme, TensorSpec

    hidden, inter, heads, kv, vocab = SHAPES[args.shape]
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": args.layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "torch_dtype": args.dtype, "rms_norm_eps": 1e-5}))
    for scheme in args.schemes:
        expr = scheme_pair(scheme, group)[0]
        t = time.monotonic()
        predicted = planner_prediction(model, eval(expr, {"Scheme": Scheme, "TensorSpec": TensorSpec}),  # noqa: S307
                                       (args.samples, args.seq_len), args.dtype, torch.device(args.device))
        emit({"kind": "predicted", "scheme": scheme, "tool": "llmc", "plan_s": time.monotonic() - t,
              "predicted": predicted})


def _f(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "–"


def _spread_cell(d: dict | None) -> str:
    """'median [min, max]' of a cell's repeats (the median alone for one)."""
    if not d:
        return "–"
    if d["n"] == 1:
        return _f(d["median"], ".3f")
    return f"{d['median']:.3f} [{d['min']:.3f}, {d['max']:.3f}]"


def summary(rows: list[dict]) -> str:
    """The table: one line per (scheme, tool) cell, llmc's against each llm-compressor cell of its peer recipe."""
    cells = {(r["scheme"], r["tool"]): r for r in rows if r.get("kind") == "cell"}
    errors = {(r["scheme"], r["tool"]): r["hidden_rel_error"] for r in rows if r.get("kind") == "quality"
              and "hidden_rel_error" in r}
    diffs = {(r["scheme"], r["against"]): r for r in rows if r.get("kind") == "quality-diff"}
    peer_of = {scheme: PAIRS[scheme][1] for scheme in SCHEMES}
    lead = next((n for n in (2, 1) if any(f"layer{n}_s" in c for c in cells.values())), 2)
    lines = [f"| scheme | tool | runs | wall s | layer {lead} s median [min, max] | layer 3 s median [min, max] "
             f"| floor s | layer {lead} ÷ floor | llmc ÷ this (layer {lead}) | peak GPU MB | peak RSS MB "
             "| hidden-state rel. error | llmc − this, paired 95% | planned layer s | planned GPU MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    failed = [r for r in rows if r.get("kind") == "run" and "error" in r]
    for (scheme, tool), c in cells.items():
        mine = [v for (s_, t), v in cells.items() if t == "llmc" and peer_of.get(s_) == peer_of.get(scheme)]
        ratio = "–"
        if tool != "llmc" and mine and f"layer{lead}_s" in c:
            ratio = ", ".join(f"{m['scheme']}: {m[f'layer{lead}_s']['median'] / c[f'layer{lead}_s']['median']:.2f}×"
                              for m in mine if f"layer{lead}_s" in m)
        diff = "; ".join(f"vs {v['against']}: {v['diff']:+.4f} [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]"
                         for (s_, _a), v in diffs.items() if s_ == scheme) if tool == "llmc" else ""
        predicted = c.get("predicted") or {}
        lines.append(f"| {scheme} | {tool} | {c['repeats']} | {_f(c['wall_s'].get('median'), '.2f')} "
                     f"| {_spread_cell(c.get(f'layer{lead}_s'))} | {_spread_cell(c.get('layer3_s'))} "
                     f"| {_f(c['floor_s'].get('median'), '.4f')} | {_f(c.get(f'layer{lead}_x_floor'), '.1f')}× "
                     f"| {ratio} | {_f(c.get('peak_gpu_mb'), ',.0f')} | {_f(c.get('peak_rss_mb'), ',.0f')} "
                     f"| {_f(errors.get((scheme, tool)), '.4f')} | {diff or '–'} "
                     f"| {_f(predicted.get('layer_s'), '.3f')} | {_f(predicted.get('gpu_mb'), ',.0f')} |")
    for r in failed:
        lines.append(f"| {r['scheme']} | {r['tool']} | failed: {r['error'].strip().splitlines()[-1][:100]} "
                     "| | | | | | | | | | | | |")
    for c in cells.values():
        if c.get("knobs_missing"):
            lines.append(f"\n{c['scheme']} {c['tool']}: llm-compressor lacks {', '.join(c['knobs_missing'])}")
    for r in rows:
        if r.get("kind") in ("every-layer", "profile"):
            lines.append(f"\n{r['kind']} {r['scheme']} (llmc): layer 2 {_f(r.get('layer2_s'), '.3f')} s, wall "
                         f"{_f(r.get('wall_s'), '.2f')} s{(' — ' + r['error'][-200:]) if 'error' in r else ''}")
        if r.get("kind") == "run" and r.get("eval"):
            for which, e in r["eval"].items():
                lines.append(f"\nstreamed torch evaluation of the {which} ({e['windows']} windows): wall "
                             f"{e['wall_s']:.2f} s, per decoder layer {', '.join(f'{x:.3f}' for x in e['layer_s'])} s")
        if r.get("kind") == "check" and r.get("missing_kinds"):
            lines.append(f"\nmissing row kinds: {', '.join(r['missing_kinds'])}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for rows.jsonl and summary.md")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default llama-8b (--width-70b: llama-70b)")
    ap.add_argument("--layers", type=int, default=None, help="default 3 (--width-70b: 1)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--schemes", nargs="+", default=None, choices=SCHEMES)
    ap.add_argument("--tools", nargs="+", default=None, choices=TOOLS)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per cell, in one process (default 2)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: the same path, e.g. at --shape tiny)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--budget-s", type=float, default=450, help="the whole run's time limit; steps past it are skipped")
    ap.add_argument("--step-timeout-s", type=float, default=150)
    ap.add_argument("--heldout-samples", type=int, default=None, help="default 8 (x 1024 tokens); 0: no quality step")
    ap.add_argument("--heldout-seq-len", type=int, default=1024)
    ap.add_argument("--peer-python", default=sys.executable, help="the Python that imports llm-compressor")
    ap.add_argument("--work", type=Path, help="where the model and outputs are written (default: a temp folder)")
    ap.add_argument("--disk-probe-mb", type=int, default=256, help="bytes written and read back to rate the work "
                    "folder's disk (0: none)")
    ap.add_argument("--eval-windows", type=int, default=0, help="windows of the streamed evaluation timing (0: none)")
    ap.add_argument("--eval-scheme", default="fp8-static", choices=SCHEMES)
    ap.add_argument("--resume-every-layer", nargs="*", default=[], choices=SCHEMES)
    ap.add_argument("--profile", nargs="*", default=[], choices=SCHEMES)
    ap.add_argument("--width-70b", action="store_true",
                    help="one Llama-3.3-70B-width layer, FP8 static and GPTQ, llmc, checkpoint on tmpfs when it fits")
    ap.add_argument("--predict-only", action="store_true",
                    help="only the planner's predictions for each scheme on this device (config only: no weights)")
    args = ap.parse_args(argv)
    for key, value in (WIDTH_70B if args.width_70b else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.layers < 3 and not args.width_70b:
        ap.error("--layers must be at least 3: layer 2 is the one compared, and neither neighbour's extra work is in it")
    return args


def checkpoint_bytes(shape: str, layers: int, elem: int) -> int:
    """The synthetic checkpoint's size: the decoder layers and the (tied) embeddings."""
    hidden, inter, heads, kv, vocab = SHAPES[shape]
    head_dim = hidden // heads
    layer = hidden * (2 * hidden + 2 * kv * head_dim) + 3 * hidden * inter + 2 * hidden
    return elem * (layers * layer + vocab * hidden + hidden)


def work_root(args) -> Path | None:
    """Where the model and the outputs go: --work, else for --width-70b tmpfs when it holds the checkpoint three times
    over (the model, llmc's canonical form and its export), else the system's temp folder."""
    if args.work is not None or not args.width_70b:
        return args.work
    shm = Path("/dev/shm")
    need = 3 * checkpoint_bytes(args.shape, args.layers, 2 if args.dtype == "bfloat16" else 4)
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        return shm
    return None


def main() -> None:
    args = parse_args()

    import torch
    from safetensors.torch import save_file

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to torch: pass --device cpu (e.g. with --shape tiny) to check the path here")
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "rows.jsonl"
    jsonl.write_text("")  # this run's rows only, as summary.md
    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="llmc-gpu-calibration-", dir=work_root(args)))
    stamp = environment_stamp(REPO, work, args.device, args.disk_probe_mb)

    def emit(row: dict) -> None:
        row = stamp_row(row, stamp)
        rows.append(row)
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    group = int4_group(args.shape)
    emit({"kind": "setup", "device": args.device, "device_name": torch.cuda.get_device_name()
          if args.device.startswith("cuda") else "cpu", "torch": torch.__version__, "shape": args.shape,
          "dims": SHAPES[args.shape], "layers": args.layers, "samples": args.samples, "seq_len": args.seq_len,
          "dtype": args.dtype, "int4_group": group, "cpus": os.cpu_count(), "repeats": args.repeats,
          "schemes": args.schemes, "tools": args.tools, "width_70b": args.width_70b,
          "heldout_tokens": args.heldout_samples * args.heldout_seq_len,
          "tuned_knobs": {s_: tuned_knobs(s_, args.device) for s_ in args.schemes}})
    env = {**os.environ, "THREADS": os.environ.get("THREADS", str(os.cpu_count())), "PYTHONPATH": os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p])}
    try:
        model, tokens, heldout = work / "model", work / "tokens.safetensors", work / "heldout.safetensors"
        if args.predict_only:
            predict_only(model, args, group, emit)
            return
        t = time.monotonic()
        write_model(model, args.shape, args.layers, args.dtype, args.device)
        vocab = SHAPES[args.shape][4]
        save_file({"input_ids": torch.randint(3, vocab, (args.samples, args.seq_len),
                                              generator=torch.Generator().manual_seed(0))}, str(tokens))
        save_file({"input_ids": torch.randint(3, vocab, (max(args.heldout_samples, 1), args.heldout_seq_len),
                                              generator=torch.Generator().manual_seed(1))}, str(heldout))
        emit({"kind": "model", "write_s": time.monotonic() - t,
              "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors"))})

        outputs = timed_runs(args, group, model, tokens, work, env, emit, left)
        for cell in cell_rows(rows):
            emit(cell)
        # Every timing first; the scoring then gets what is left of the budget, and a cut keeps the errors already
        # printed.
        if args.heldout_samples and outputs:
            score(args, model, heldout, outputs, env, emit, left)
            for diff in quality_diff_rows([r for r in rows if r.get("kind") == "quality"]):
                emit(diff)
        extra_runs(args, group, model, tokens, work, env, emit, left)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    emit({"kind": "check", "expected_kinds": sorted(expected_kinds(args)),
          "missing_kinds": sorted(expected_kinds(args) - {r["kind"] for r in rows if "error" not in r})})
    table = summary(rows)
    (args.out / "summary.md").write_text(table)
    print("\n" + table + f"\ntotal {time.monotonic() - start:.1f} s", flush=True)


def timed_runs(args, group: int, model: Path, tokens: Path, work: Path, env: dict, emit, left) -> list[str]:
    """Every (scheme, tool) cell, its repeats in one child; llm-compressor's recipe once per peer recipe (the
    same-grid AWQ pair reuses the AWQ rows). Returns NAME=FOLDER of each output to score."""
    outputs: list[str] = []
    peers_run: set[tuple[str, str]] = set()
    for scheme in args.schemes:
        llmc_expr, peer_scheme = scheme_pair(scheme, group)
        for tool in args.tools:
            if tool in PEERS and (tool, peer_scheme) in peers_run:
                continue  # its rows are those of the scheme that ran this peer recipe first
            out = work / f"{tool}-{scheme}"
            if left() < MIN_STEP_S:
                emit({"kind": "run", "scheme": scheme, "tool": tool, "error": "skipped: --budget-s spent"})
                continue
            step_env = {**env, "BENCH_REPEATS": str(args.repeats)}
            if tool == "llmc":
                cmd = [sys.executable, str(HERE / "_llmc_gpu_child.py"), str(model), str(tokens), llmc_expr,
                       str(out), args.dtype, args.device]
                folder = out / "export"
                if scheme == args.eval_scheme and args.eval_windows:
                    step_env["BENCH_EVAL_WINDOWS"] = str(args.eval_windows)
            else:
                peers_run.add((tool, peer_scheme))
                cmd = [args.peer_python, str(HERE / "_llmcompressor_gpu_child.py"), str(model), str(tokens),
                       peer_scheme, str(out), str(group), args.dtype, args.device]
                folder = out
                if tool == "llm-compressor-tuned":
                    step_env["BENCH_ONESHOT_KWARGS"] = json.dumps(tuned_knobs(scheme, args.device))
            t = time.monotonic()
            lines, error = run_step(cmd, min(args.step_timeout_s * args.repeats, left()), step_env)
            for line in lines:
                emit(layer2_row({"kind": "run", "scheme": scheme, "tool": tool, "step_s": time.monotonic() - t,
                                 **line}))
            if error or len(lines) < args.repeats:
                emit({"kind": "run", "scheme": scheme, "tool": tool, "step_s": time.monotonic() - t,
                      "repeat": len(lines), "error": error or "fewer repeats than asked"})
            if lines:  # the first repeat's output is complete once its line is printed
                outputs.append(f"{tool}:{scheme}={folder}")
            shutil.rmtree(out / "canonical", ignore_errors=True)  # llmc's export is what is scored
    return outputs


def score(args, model: Path, heldout: Path, outputs: list[str], env: dict, emit, left) -> None:
    """Each output's final hidden-state error on the held-out tokens, on the run's device."""
    if left() < MIN_STEP_S:
        emit({"kind": "quality", "error": "skipped: --budget-s spent"})
        return
    t = time.monotonic()
    lines, error = run_step([sys.executable, str(HERE / "_hidden_error_child.py"), str(model), str(heldout),
                             *outputs], left(), {**env, "BENCH_SCORE_DEVICE": args.device,
                                                 "BENCH_BLOCK_TOKENS": str(BLOCK_TOKENS)})
    for line in lines:
        tool, scheme = line.pop("name").split(":")
        emit({"kind": "quality", "scheme": scheme, "tool": tool,
              "heldout_tokens": args.heldout_samples * args.heldout_seq_len, **line})
    if error:
        emit({"kind": "quality", "error": error, "step_s": time.monotonic() - t})


def extra_runs(args, group: int, model: Path, tokens: Path, work: Path, env: dict, emit, left) -> None:
    """As the budget allows: llmc with a resume point after every layer, and llmc under cProfile."""
    extra = [(s_, "every-layer", {"BENCH_RESUME_EVERY_S": "0"}) for s_ in args.resume_every_layer]
    extra += [(s_, "profile", {"BENCH_PROFILE": str(args.out / f"profile-{s_}.txt")}) for s_ in args.profile]
    for scheme, label, extra_env in extra:
        if left() < MIN_STEP_S:
            emit({"kind": label, "scheme": scheme, "tool": "llmc", "error": "skipped: --budget-s spent"})
            continue
        out = work / f"llmc-{scheme}-{label}"
        t = time.monotonic()
        lines, error = run_step([sys.executable, str(HERE / "_llmc_gpu_child.py"), str(model), str(tokens),
                                 scheme_pair(scheme, group)[0], str(out), args.dtype, args.device],
                                min(args.step_timeout_s, left()), {**env, **extra_env})
        row = {"kind": label, "scheme": scheme, "tool": "llmc", "step_s": time.monotonic() - t,
               **(lines[-1] if lines else {})}
        if error:
            row["error"] = error
        emit(layer2_row(row))
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
