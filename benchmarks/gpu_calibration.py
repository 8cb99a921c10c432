"""Calibration on a GPU, llmc against llm-compressor 0.14 side by side, per decoder layer and against the floor.

    python benchmarks/gpu_calibration.py --out DIR [--shape llama-8b|llama-70b|smollm2|tiny] [--layers 3]
        [--samples 128] [--seq-len 2048] [--schemes gptq-w4a16 fp8-static sq-w8a8 awq-w4a16]
        [--tools llmc llm-compressor] [--device cuda|cpu] [--dtype bfloat16] [--budget-s 450] [--step-timeout-s 120]
        [--heldout-samples 2] [--heldout-seq-len 1024] [--peer-python PY] [--work DIR]
        [--eval-windows 0] [--eval-scheme fp8-static] [--resume-every-layer SCHEME ...] [--profile SCHEME ...]

No weights travel to a lent GPU machine, so the model is synthetic: the named architecture's decoder layer with random
weights (wall time depends on shapes and token counts, not values), `--layers` of them, written to disk in `--dtype`
with a word-level tokenizer made here; the calibration tokens are seeded random ids, one file both tools read. Each
tool runs in a fresh child process (benchmarks/_llmc_gpu_child.py, benchmarks/_llmcompressor_gpu_child.py) that first
measures the floor in that same process — one plain forward of every calibration token through one decoder layer
(benchmarks/_layer_floor.py) — then times the quantization call alone, imports and CUDA start-up outside the timer:
llmc's quantize_model with `device`, layers streamed from disk; llm-compressor's oneshot with its sequential pipeline,
model in host memory. Both compute in `--dtype`. Reported per run: total wall, each decoder layer's time, the floor
and layer 2's time as a multiple of it, peak GPU memory (torch's max allocated) and peak host RSS. Layer 2 of 3 is the
one compared: layer 1 carries the embeddings' forward, and llm-compressor's last subgraph the final norm and LM head.
Once every run is timed, all outputs (compressed-tensors) are scored by one function
(benchmarks/_hidden_error_child.py): final hidden-state relative error on held-out tokens.

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

SHAPES = {  # hidden, intermediate, attention heads, KV heads, vocab
    "tiny": (128, 256, 4, 2, 1024),
    "smollm2": (576, 1536, 9, 3, 49152),
    "llama-8b": (4096, 14336, 32, 8, 128256),  # Llama-3.1-8B
    "llama-70b": (8192, 28672, 64, 8, 128256),  # Llama-3.3-70B
}
SCHEMES = ["gptq-w4a16", "fp8-static", "sq-w8a8", "awq-w4a16"]
TOOLS = ["llmc", "llm-compressor"]
MIN_STEP_S = 15  # a step is not started with less of the budget left


def int4_group(shape: str) -> int:
    """128 (both tools' usual W4A16 group) where it divides every Linear's input width, else 64 (SmolLM2's 576)."""
    hidden, inter = SHAPES[shape][:2]
    return 128 if hidden % 128 == 0 and inter % 128 == 0 else 64


def scheme_pair(scheme: str, group: int) -> tuple[str, str]:
    """(llmc Scheme expression, llm-compressor recipe name) with the INT4 group filled in."""
    llmc_expr, peer = PAIRS[scheme]
    return llmc_expr.format(group=group), peer


def write_model(folder: Path, shape: str, layers: int, dtype_name: str) -> None:
    """A Llama checkpoint of `shape` with `layers` random decoder layers (normal(0, 0.02) weights, unit norms, tied
    embeddings) and a word-level tokenizer (llm-compressor saves one; nothing is downloaded)."""
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
    model = model.to_empty(device="cpu").to(getattr(torch, dtype_name))
    model.tie_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(folder, safe_serialization=True)
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
    """Adds layer 2's time and its multiple of the floor measured in the same process."""
    layers = row.get("layer_s") or []
    if len(layers) > 1 and layers[1] is not None:
        row["layer2_s"] = layers[1]
        if row.get("floor_s"):
            row["layer2_x_floor"] = layers[1] / row["floor_s"]
    return row


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


def summary(rows: list[dict]) -> str:
    runs = {(r["scheme"], r["tool"]): r for r in rows if r.get("kind") == "run"}
    errors = {(r["scheme"], r["tool"]): r["hidden_rel_error"] for r in rows if r.get("kind") == "quality"}
    lines = ["| scheme | tool | wall s | layer 2 s | floor s | layer 2 ÷ floor | llmc ÷ llm-compressor (layer 2) "
             "| peak GPU MB | peak RSS MB | hidden-state rel. error | planned layer s | planned GPU MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "–"

    for (scheme, tool), r in runs.items():
        if "error" in r:
            lines.append(f"| {scheme} | {tool} | failed: {r['error'].strip().splitlines()[-1][:100]} | | | | | | | |")
            continue
        peer = runs.get((scheme, "llm-compressor"), {})
        ratio = (r["layer2_s"] / peer["layer2_s"] if tool == "llmc" and "layer2_s" in r and "layer2_s" in peer
                 else None)
        lines.append(f"| {scheme} | {tool} | {f(r.get('wall_s'), '.2f')} | {f(r.get('layer2_s'), '.3f')} "
                     f"| {f(r.get('floor_s'), '.4f')} | {f(r.get('layer2_x_floor'), '.1f')}× "
                     f"| {f(ratio, '.2f')}{'×' if ratio else ''} | {f(r.get('peak_gpu_mb'), ',.0f')} "
                     f"| {f(r.get('peak_rss_mb'), ',.0f')} | {f(errors.get((scheme, tool)), '.4f')} "
                     f"| {f((r.get('predicted') or {}).get('layer_s'), '.3f')} "
                     f"| {f((r.get('predicted') or {}).get('gpu_mb'), ',.0f')} |")
    for r in rows:
        if r.get("kind") in ("every-layer", "profile"):
            lines.append(f"\n{r['kind']} {r['scheme']} (llmc): layer 2 {f(r.get('layer2_s'), '.3f')} s, wall "
                         f"{f(r.get('wall_s'), '.2f')} s{(' — ' + r['error'][-200:]) if 'error' in r else ''}")
        if r.get("kind") == "run" and r.get("eval"):
            for which, e in r["eval"].items():
                lines.append(f"\nstreamed torch evaluation of the {which} ({e['windows']} windows): wall "
                             f"{e['wall_s']:.2f} s, per decoder layer {', '.join(f'{x:.3f}' for x in e['layer_s'])} s")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for rows.jsonl and summary.md")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    ap.add_argument("--tools", nargs="+", default=TOOLS, choices=TOOLS)
    ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: the same path, e.g. at --shape tiny)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--budget-s", type=float, default=450, help="the whole run's time limit; steps past it are skipped")
    ap.add_argument("--step-timeout-s", type=float, default=120)
    ap.add_argument("--heldout-samples", type=int, default=2, help="0: no quality step")
    ap.add_argument("--heldout-seq-len", type=int, default=1024)
    ap.add_argument("--peer-python", default=sys.executable, help="the Python that imports llm-compressor")
    ap.add_argument("--work", type=Path, help="where the model and outputs are written (default: a temp folder)")
    ap.add_argument("--eval-windows", type=int, default=0, help="windows of the streamed evaluation timing (0: none)")
    ap.add_argument("--eval-scheme", default="fp8-static", choices=SCHEMES)
    ap.add_argument("--resume-every-layer", nargs="*", default=[], choices=SCHEMES)
    ap.add_argument("--profile", nargs="*", default=[], choices=SCHEMES)
    ap.add_argument("--predict-only", action="store_true",
                    help="only the planner's predictions for each scheme on this device (config only: no weights)")
    args = ap.parse_args()
    if args.layers < 3:
        ap.error("--layers must be at least 3: layer 2 is the one compared, and neither neighbour's extra work is in it")

    import torch
    from safetensors.torch import save_file

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to torch: pass --device cpu (e.g. with --shape tiny) to check the path here")
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "rows.jsonl"
    jsonl.write_text("")  # this run's rows only, as summary.md
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    group = int4_group(args.shape)
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    emit({"kind": "setup", "device": args.device, "device_name": torch.cuda.get_device_name()
          if args.device.startswith("cuda") else "cpu", "torch": torch.__version__, "shape": args.shape,
          "dims": SHAPES[args.shape], "layers": args.layers, "samples": args.samples, "seq_len": args.seq_len,
          "dtype": args.dtype, "int4_group": group, "cpus": os.cpu_count(), "llmc_commit": git.stdout.strip() or None})
    env = {**os.environ, "THREADS": os.environ.get("THREADS", str(os.cpu_count())), "PYTHONPATH": os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p])}
    work = Path(tempfile.mkdtemp(prefix="llmc-gpu-calibration-", dir=args.work))
    try:
        model, tokens, heldout = work / "model", work / "tokens.safetensors", work / "heldout.safetensors"
        if args.predict_only:
            predict_only(model, args, group, emit)
            return
        t = time.monotonic()
        write_model(model, args.shape, args.layers, args.dtype)
        vocab = SHAPES[args.shape][4]
        save_file({"input_ids": torch.randint(3, vocab, (args.samples, args.seq_len),
                                              generator=torch.Generator().manual_seed(0))}, str(tokens))
        save_file({"input_ids": torch.randint(3, vocab, (max(args.heldout_samples, 1), args.heldout_seq_len),
                                              generator=torch.Generator().manual_seed(1))}, str(heldout))
        emit({"kind": "model", "write_s": time.monotonic() - t,
              "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors"))})

        outputs: list[str] = []
        for scheme in args.schemes:
            llmc_expr, peer_scheme = scheme_pair(scheme, group)
            for tool in args.tools:
                out = work / f"{tool}-{scheme}"
                if left() < MIN_STEP_S:
                    emit({"kind": "run", "scheme": scheme, "tool": tool, "error": "skipped: --budget-s spent"})
                    continue
                step_env = env
                if tool == "llmc":
                    cmd = [sys.executable, str(HERE / "_llmc_gpu_child.py"), str(model), str(tokens), llmc_expr,
                           str(out), args.dtype, args.device]
                    folder = out / "export"
                    if scheme == args.eval_scheme and args.eval_windows:
                        step_env = {**env, "BENCH_EVAL_WINDOWS": str(args.eval_windows)}
                else:
                    cmd = [args.peer_python, str(HERE / "_llmcompressor_gpu_child.py"), str(model), str(tokens),
                           peer_scheme, str(out), str(group), args.dtype, args.device]
                    folder = out
                t = time.monotonic()
                lines, error = run_step(cmd, min(args.step_timeout_s, left()), step_env)
                row = {"kind": "run", "scheme": scheme, "tool": tool, "step_s": time.monotonic() - t,
                       **(lines[-1] if lines else {})}
                if error:
                    row["error"] = error
                else:
                    outputs.append(f"{tool}:{scheme}={folder}")
                emit(layer2_row(row))
                shutil.rmtree(out / "canonical", ignore_errors=True)  # llmc's export is what is scored

        # Every timing first; the scoring (host only) then gets what is left of the budget, and a cut keeps the
        # errors already printed.
        if args.heldout_samples and outputs:
            if left() < MIN_STEP_S:
                emit({"kind": "quality", "error": "skipped: --budget-s spent"})
            else:
                t = time.monotonic()
                lines, error = run_step([sys.executable, str(HERE / "_hidden_error_child.py"), str(model),
                                         str(heldout), *outputs], left(), env)
                for line in lines:
                    tool, scheme = line.pop("name").split(":")
                    emit({"kind": "quality", "scheme": scheme, "tool": tool,
                          "heldout_tokens": args.heldout_samples * args.heldout_seq_len, **line})
                if error:
                    emit({"kind": "quality", "error": error, "step_s": time.monotonic() - t})

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
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = summary(rows)
    (args.out / "summary.md").write_text(table)
    print("\n" + table + f"\ntotal {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
