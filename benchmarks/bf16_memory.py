"""A bf16 source stays bf16: peak memory of the quantize stage streaming one bf16 checkpoint as `model.dtype:
float32` and as `model.dtype: auto` (the checkpoint's own dtype).

    python benchmarks/bf16_memory.py [--source demo:gemma3-270m] [--samples 8] [--seq-len 512] [--out F.jsonl]

The source is resolved through llmc (a demo GGUF is unpacked once, in float32, into --cache-dir) and written
once more as a bfloat16 safetensors folder (the dtype Gemma-3 and most shipped checkpoints are published in);
a source folder already stored in bf16 is used as it is. Then `llmc quantize` runs twice in a child process on
that same folder, each time with an empty stage cache (nothing reused): `--set model.dtype=float32` and
`--set model.dtype=auto`. The parent samples the child's RssAnon (resident anonymous memory: the mapped
checkpoint's page-cache pages are left out, they are shared and reclaimable) every 50 ms, split at the log line that
starts the layer streaming (before it: imports, tokenizer, calibration windows; from it: the streamed layers), and
reads its VmHWM (peak resident, file pages included). One JSON line per run, then the ratios.
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

from _proc_status import memory_bytes

ROOT = Path(__file__).resolve().parents[1]

# FP8 W8A8 with static activation scales and an FP8 KV cache: every layer runs the calibration forward, so the
# stage holds a layer, its activations and the canonical form's unquantized tensors (embeddings) at once.
RECIPE = """version: 1
name: bf16-memory
model: {{source: {source}}}
quantization:
  weights: {{format: fp8_e4m3, strategy: channel}}
  activations: {{format: fp8_e4m3, strategy: tensor}}
  kv_cache: {{format: fp8_e4m3}}
calibration: {{samples: {samples}, seq_len: {seq_len}}}
targets:
  - {{runtime: vllm, gpu_arch: sm90}}
"""


def bf16_folder(source: str, cache: Path, work: Path) -> Path:
    """The source as a bf16 safetensors folder: itself when stored in bf16, else a bf16 copy under `work`."""
    import torch
    from safetensors.torch import load_file, save_file

    from llmc.model.checkpoint import check_safetensors_header, safetensors_files
    from llmc.model.dtype import checkpoint_dtype
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    folder = resolve_source(source, Store.default(cache)).folder
    if checkpoint_dtype([check_safetensors_header(f) for f in safetensors_files(folder)]) == "bfloat16":
        return folder
    out = work / "bf16"
    out.mkdir()
    for f in safetensors_files(folder):
        tensors = load_file(f)
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
                  out / f.name, metadata={"format": "pt"})
        del tensors
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def quantize_peak(recipe: Path, folder: Path, dtype: str, cache: Path, threads: int) -> dict:
    """`llmc quantize` in a child with an empty cache: its peak RssAnon (sampled) before the layer streaming starts
    (imports, tokenizer, calibration windows) and during it, its VmHWM, and the wall time."""
    env = {**os.environ, "LLMC_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "llmc", "quantize", str(recipe), "--threads", str(threads),
           "--set", f"model.source={folder}", "--set", f"model.dtype={dtype}"]
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = {"before_layers": 0, "layers": 0, "hwm": 0}
    phase = ["before_layers"]  # "layers" from the log line that starts the streaming ("quantize: ...")
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            fields = memory_bytes(child.pid, ("RssAnon", "VmHWM"))
            if fields is None:
                break
            if "RssAnon" in fields:  # absent once the child is a zombie
                peaks[phase[0]] = max(peaks[phase[0]], fields["RssAnon"])
                peaks["hwm"] = max(peaks["hwm"], fields["VmHWM"])
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stderr = []
    for line in child.stderr:  # the phase switches when llmc logs the start of the layer streaming
        stderr.append(line)
        if re.match(r"^\[llmc [\d:]+\] quantize: ", line):
            phase[0] = "layers"
    stdout = child.stdout.read()
    child.wait()
    done.set()
    thread.join()
    if child.returncode != 0:
        raise SystemExit(f"llmc quantize ({dtype}) exited {child.returncode}:\n{''.join(stderr)[-3000:]}")
    mb = 2**20
    return {"dtype_requested": dtype, "peak_rss_anon_mb": round(max(peaks["before_layers"], peaks["layers"]) / mb, 1),
            "peak_rss_anon_before_layers_mb": round(peaks["before_layers"] / mb, 1),
            "peak_rss_anon_layers_mb": round(peaks["layers"] / mb, 1),
            "peak_vmhwm_mb": round(peaks["hwm"] / mb, 1), "wall_s": round(time.monotonic() - t0, 1),
            "canonical_form": stdout.strip().splitlines()[-1] if stdout.strip() else None}


def canonical_bytes(folder: str | None) -> int | None:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) if folder else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="demo:gemma3-270m")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where the source is resolved (default llmc's)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmc-bf16-") as tmp:
        work = Path(tmp)
        folder = bf16_folder(args.source, args.cache_dir, work)
        recipe = work / "recipe.yaml"
        recipe.write_text(RECIPE.format(source=folder, samples=args.samples, seq_len=args.seq_len))
        rows = []
        for dtype in ("float32", "auto"):
            row = quantize_peak(recipe, folder, dtype, work / f"cache-{dtype}", args.threads)
            row["canonical_form_bytes"] = canonical_bytes(row.pop("canonical_form"))
            row.update(source=args.source, source_folder_dtype="bfloat16", samples=args.samples,
                       seq_len=args.seq_len, loadavg=Path("/proc/loadavg").read_text().split()[:3],
                       command=" ".join(sys.argv))
            rows.append(row)
            shutil.rmtree(work / f"cache-{dtype}")
        rows.append({"ratio_auto_over_float32_rss_anon": round(rows[1]["peak_rss_anon_mb"] / rows[0]["peak_rss_anon_mb"], 3),
                     "ratio_auto_over_float32_rss_anon_layers": round(rows[1]["peak_rss_anon_layers_mb"]
                                                                      / rows[0]["peak_rss_anon_layers_mb"], 3),
                     "ratio_auto_over_float32_vmhwm": round(rows[1]["peak_vmhwm_mb"] / rows[0]["peak_vmhwm_mb"], 3)})
        for row in rows:
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
