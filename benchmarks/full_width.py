"""Predicted vs measured at full width: synthetic checkpoints with the exact tensor shapes of Llama-3.1-8B and
Llama-3.3-70B (their real config.json from recipes/configs/, the real vocabulary size, random bf16 weights, sharded
safetensors with an index) but only N decoder layers, built by `llmc build` with a shipped recipe's quantization
(`--set model.source=<checkpoint>`), end to end: quantize, export, evaluation (streamed when the dense model does
not fit), gates, publish.

    python benchmarks/full_width.py --model Llama-3.3-70B-Instruct --recipe recipes/llama70b-fp8.yaml --layers 1 2
    python benchmarks/full_width.py --model Llama-3.1-8B --recipe recipes/llama70b-fp8.yaml --layers 1 2 4

Per run: the plan's prediction for that checkpoint (llmc.planning.plan: per-stage peak host RAM, disk, time) and what the
build measured: the process's peak RSS (VmHWM) and per-stage peaks of VmRSS, RssAnon and RssFile (sampled every
SAMPLE_S, attributed to the stage the build's log says is running; MEMORY_FIELDS says which one the plan predicts),
each stage output's size on disk (du: hard links once), the quantize stage's time per layer from the stream's
progress lines, the load average during the build. Checkpoint, cache and registry are removed after each run
(--keep keeps them); the report and build.log stay. The tokenizer is SmolLM2's (ids < 49,152 fit the 128,256-row
embedding; the vocabulary size, which sets the embedding, head and logits, is the real one). One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from _proc_status import memory_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the plan is this checkout's, as the build's is (PYTHONPATH=ROOT), not the installed one
SHARD_BYTES = 2 << 30
# Sampled per stage. RssAnon is what the process allocated (tensors, Python): what the planner predicts and what
# the OOM killer counts. RssFile is the resident pages of mmapped files (the safetensors checkpoint is read through
# mmap): clean page cache the kernel drops under pressure, so it varies with the machine's other load, not with the
# build. VmRSS = RssAnon + RssFile + RssShmem; VmHWM (its peak) is still shown.
MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile")
# Seconds between samples: a stage's peak can be a transient (an evaluation batch's logits, 0.2 GB for SmolLM2's 4
# windows of 256), which sampling every 0.1 s missed in one build of three (0.88 GB measured against 1.02-1.03 GB)
SAMPLE_S = 0.02


def write_checkpoint(model: str, layers: int, out: Path, tokenizer_from: Path, dtype=torch.bfloat16) -> Path:
    """config.json (num_hidden_layers = layers), tokenizer, *.safetensors shards + model.safetensors.index.json."""
    from llmc.planning.shapes import from_config

    config = json.loads((ROOT / "recipes" / "configs" / model / "config.json").read_text())
    config["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / f).is_file():
            shutil.copyfile(tokenizer_from / f, out / f)
    shapes = from_config(config).shapes
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(1 << 20, generator=gen) * 0.02).to(dtype)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = total = 0
    names = list(shapes)

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name in names:
        shape = shapes[name]
        if len(shape) == 1:  # norms: ones, as trained checkpoints start
            t = torch.ones(shape, dtype=dtype)
        else:  # one random block of 2^20 values, rotated per chunk: memcpy speed, no float32 copy of the embedding
            t = torch.empty(shape, dtype=dtype)
            flat = t.view(-1)
            for i, start in enumerate(range(0, flat.numel(), base.numel())):
                chunk = flat[start : start + base.numel()]
                chunk.copy_(torch.roll(base, 7919 * i)[: chunk.numel()])
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out


def predict(recipe: Path, overrides: list[str], checkpoint: Path | None, config: dict | None = None) -> dict:
    """The plan's estimates for the checkpoint (or, without one, from its config: the same shapes)."""
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import load_recipe

    plan = make_plan(load_recipe(recipe, overrides), checkpoint, refuse=False, config=None if checkpoint else config)
    return plan.as_dict()["estimates"]


_LOG = re.compile(r"^\[llmc (\d\d):(\d\d):(\d\d)\] (quantize|export|eval|calibration|tasks|published|plan)(.*)")


def stage_of(kind: str, rest: str) -> str:
    """The stage a log line starts, named as the plan names it where it can: 'export <target label>', 'eval
    baseline', 'eval artifact' (the log names an artifact by its folder's hash), else the line's first word."""
    if kind == "calibration":
        return "quantize"
    if kind == "export" and " for " in rest:
        return "export " + rest.rsplit(" for ", 1)[1].strip()
    if kind == "eval" and " on " in rest:
        return "eval baseline" if " on baseline " in rest else "eval artifact"
    return kind


def run_build(recipe: Path, overrides: list[str], cache: Path, registry: Path, report: Path,
              command: str = "build") -> dict:
    """`llmc build` (or `llmc quantize`: `command`) in a child; its peak RSS overall (VmHWM) and per stage
    (sampled), wall time, exit code."""
    env = {**os.environ, "LLMC_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    tail = (["--report-dir", str(report), *[a for o in overrides for a in ("--set", o)],
             "--set", f"publish.registry={registry}"] if command == "build"
            else [*[a for o in overrides for a in ("--set", o)]])
    cmd = [sys.executable, "-c", "from llmc.cli import main; main()", command, str(recipe), *tail]
    t0 = time.time()
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    samples: list[tuple[float, dict[str, int]]] = []  # (time, {VmRSS, RssAnon, RssFile} in bytes)
    hwm = [0]
    loads: list[float] = []  # 1-minute load average at each sample: the machine's other work during the build
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            fields = memory_bytes(child.pid, (*MEMORY_FIELDS, "VmHWM"))
            if fields is None or "VmRSS" not in fields:  # the child has exited (a zombie has no memory lines)
                break
            hwm[0] = max(hwm[0], fields.get("VmHWM", 0))
            samples.append((time.time(), fields))
            loads.append(os.getloadavg()[0])
            time.sleep(SAMPLE_S)

    # stage windows from the time each log line arrives (the child's stderr is line-buffered): each starts at its
    # line, ends at the next one. (The log's own timestamps are whole seconds: a window widened by one second to
    # cover them gave the next stage's first second to the one before, e.g. the baseline evaluation's 2 GB of outer
    # weights to the last export.)
    thread = threading.Thread(target=sample, daemon=True)
    arrived: list[tuple[float, str]] = []
    out_lines: list[str] = []
    readers = [threading.Thread(target=lambda: [arrived.append((time.time(), ln)) for ln in child.stderr], daemon=True),
               threading.Thread(target=lambda: out_lines.extend(child.stdout), daemon=True)]
    for t in (thread, *readers):
        t.start()
    for t in readers:
        t.join()
    child.wait()
    done.set()
    thread.join()
    wall = time.time() - t0
    stdout, stderr = "".join(out_lines), "".join(line for _, line in arrived)
    marks = []
    for ts, line in arrived:
        m = _LOG.match(line)
        if m:
            marks.append((ts, stage_of(m.group(4), m.group(5))))
    peaks: dict[str, dict[str, int]] = {}  # stage -> field -> peak bytes
    for i, (start, stage) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        for t, fields in samples:
            if start <= t < stop:
                into = peaks.setdefault(stage, {})
                for k in MEMORY_FIELDS:
                    into[k] = max(into.get(k, 0), fields.get(k, 0))
    return {"exit": child.returncode, "wall_s": wall, "peak_rss": hwm[0],
            "peak": {k: max((f.get(k, 0) for _, f in samples), default=0) for k in MEMORY_FIELDS},
            "stage_peaks": peaks, "load": [min(loads, default=0), max(loads, default=0)],
            "layer_seconds": layer_seconds(stderr), "stderr": stderr,
            "stdout_tail": stdout[-1500:], "stderr_tail": stderr[-1500:] if child.returncode else ""}


def layer_seconds(stderr: str) -> list[float]:
    """Seconds each decoder layer took in the quantize stage: differences of the `llmc-progress` lines'
    elapsed_s for 'quantize layers' (the stream's per-layer loop: read, calibrate, quantize, write one layer)."""
    elapsed = [json.loads(line.split(" ", 1)[1])["elapsed_s"] for line in stderr.splitlines()
               if line.startswith("llmc-progress ") and '"quantize layers"' in line]
    return [b - a for a, b in zip([0.0, *elapsed], elapsed)]


def du(path: Path, count_links: bool = False) -> int:
    """Bytes on disk under `path`, each hard-linked file once (or, with count_links, every link: apparent size)."""
    out = subprocess.run(["du", "-sbl" if count_links else "-sb", str(path)], capture_output=True, text=True,
                         check=False)
    return int(out.stdout.split()[0]) if out.stdout.split() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder name under recipes/configs/")
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="more overrides (defaults keep the run small: 1x128 calibration tokens, 2x32 eval tokens)")
    ap.add_argument("--work", type=Path, default=None, help="where checkpoints, cache and registry go")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--predict-only", action="store_true",
                    help="print only the plan's predictions for each N (from the config: no checkpoint, no build)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    tokenizer = resolve_source("demo:smollm2-135m", Store.default()).folder
    work = args.work or Path(tempfile.mkdtemp(prefix="llmc-full-width-", dir=str(Path.home())))
    small = ["calibration.samples=1", "calibration.seq_len=128", "eval.windows=2", "eval.seq_len=32",
             "eval.batch_size=1", "eval.decode_tokens=0", "eval.throughput_repeats=1", "gates.allow_unevaluated=true",
             "gates.max_ppl_increase_pct=1000000", "gates.max_mean_kld=1000", "gates.min_top1_agreement_pct=0.001"]
    for n in args.layers:
        if args.predict_only:
            config = json.loads((ROOT / "recipes" / "configs" / args.model / "config.json").read_text())
            overrides = ["model.source=/nonexistent", *small, *args.overrides]
            predicted = predict(args.recipe, overrides, None, {**config, "num_hidden_layers": n})
            print(json.dumps({"model": args.model, "layers": n, "load": os.getloadavg(), "predicted": predicted}))
            continue
        run = work / f"{args.model}-{n}"
        shutil.rmtree(run, ignore_errors=True)
        t = time.time()
        ckpt = write_checkpoint(args.model, n, run / "checkpoint", tokenizer)
        # a checkpoint a user builds is on disk already: without this the kernel writes the fresh one back during
        # the build, and each layer's fsync waited behind it (70B width, N = 1: 12.2-13.0 s per layer, 8.4 s with this sync)
        os.sync()
        write_s = time.time() - t
        overrides = [f"model.source={ckpt}", *small, *args.overrides]
        predicted = predict(args.recipe, overrides, ckpt)
        measured = run_build(args.recipe, overrides, run / "cache", run / "registry", run / "report")
        (run / "build.log").write_text(measured["stderr"])  # kept: per-stage timestamps, the plan as printed
        report = json.loads((run / "report" / "report.json").read_text()) if (run / "report" / "report.json").is_file() else {}
        stages = {s["name"]: s for s in report.get("stages", [])}
        quantize_s = sum(s["seconds"] for k, s in stages.items() if k.startswith("quantize"))
        disk = {kind: du(run / "cache" / "stages" / kind) for kind in ("quantize", "export", "eval")
                if (run / "cache" / "stages" / kind).is_dir()}
        artifacts = {label: du(Path(t["artifact"]), count_links=True) / 1e9
                     for label, t in report.get("targets", {}).items()}
        streamed = {eid: bool((e.get("throughput") or {}).get("streamed")) for eid, e in report.get("evals", {}).items()
                    if isinstance(e, dict)}
        row = {
            "model": args.model, "layers": n, "recipe": str(args.recipe), "overrides": overrides[1:],
            "load": os.getloadavg(), "checkpoint_gb": du(ckpt) / 1e9, "write_checkpoint_s": write_s,
            "predicted": {"stages": predicted["stages"], "peak_host_gb": max(s["host_gb"] for s in predicted["stages"]),
                          "quantize_s_per_layer": predicted["calibration_s"] / n, "dtype": predicted["dtype"],
                          "source_gb": predicted["source_gb"]},
            "measured": {"exit": measured["exit"], "wall_s": measured["wall_s"], "peak_rss_gb": measured["peak_rss"] / 1e9,
                         "peak_gb": {k: v / 1e9 for k, v in measured["peak"].items()},
                         "stage_peak_gb": {stage: {k: v / 1e9 for k, v in fields.items()}
                                           for stage, fields in measured["stage_peaks"].items()},
                         "layer_seconds": measured["layer_seconds"], "load_during": measured["load"],
                         "quantize_s_per_layer": quantize_s / n, "disk_gb": {k: v / 1e9 for k, v in disk.items()},
                         "registry_gb_apparent": du(run / "registry", count_links=True) / 1e9,
                         "registry_gb_new": du(run / "registry") / 1e9, "artifact_gb": artifacts,
                         "eval_streamed": streamed,
                         "stages": {k: s["seconds"] for k, s in stages.items()}},
            "tail": measured["stderr_tail"] or measured["stdout_tail"][-600:],
        }
        print(json.dumps(row), flush=True)
        if not args.keep:  # disk: a 70B-width run leaves ~20 GB; the registry holds links to the cache's files
            for big in ("checkpoint", "cache", "registry"):
                shutil.rmtree(run / big, ignore_errors=True)


if __name__ == "__main__":
    main()
