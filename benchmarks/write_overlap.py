"""The quantize stage's wall time with and without overlapping each layer's durable writes (its file, the next
layer's inputs, progress) and weight reads with the compute (llmc.quant.overlap, issue 31), measured in the same run.

A synthetic Llama checkpoint (default: Llama-3.1-8B's decoder layer, 4096 / 14336 / 32 heads / 8 KV heads, a small
vocabulary so the per-run work outside the layers stays small; random bf16 weights) is written to --work, on this
machine's disk (not tmpfs: the writes and their fsyncs are what is measured). Each scheme is quantized
--repeats times with overlap off and on, alternating which goes first, in this process (imports outside the timer),
calibrated on seeded random windows. Per run: the wall time of `quantize_model`, and each layer's time between its
`on_layer_done` calls (i.e. until the layer is durable). Prints a table; --out gets one JSON line per run.

    python benchmarks/write_overlap.py                                     # 8B width on the CPU
    python benchmarks/write_overlap.py --device cuda --dtype bfloat16 --samples 128 --seq-len 2048 \\
        --schemes fp8-static gptq-w4a16 --out $OUT/write-overlap.jsonl   # on a lent GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEMES = {  # name -> Scheme expression (fp8-rtn: dynamic activations, nothing calibrated)
    "fp8-rtn": 'Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "token", dynamic=True))',
    "fp8-static": 'Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))',
    "gptq-w4a16": 'Scheme(TensorSpec("int4", "group", group_size=128), algorithm="gptq")',
}


def write_model(folder: Path, hidden: int, inter: int, heads: int, kv: int, vocab: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(folder, safe_serialization=True)


def run(model: Path, scheme_expr: str, calibrated: bool, out: Path, overlap: bool, args) -> dict:
    import torch

    from llmc.model.source import ModelSource
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, StreamOptions, quantize_model

    scheme = eval(scheme_expr, {"Scheme": Scheme, "TensorSpec": TensorSpec})  # noqa: S307 - this file's table
    ids = torch.randint(3, args.vocab, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    device = torch.device(args.device)
    done: list[float] = []

    def layer_done(_i: int) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        done.append(time.monotonic())

    gc.collect()
    t = time.monotonic()
    quantize_model(ModelSource(model, "synthetic", "synthetic"), scheme, out,
                   Calibration(ids) if calibrated else None,
                   StreamOptions(dtype=getattr(torch, args.dtype), device=device, on_layer_done=layer_done,
                                 overlap=overlap))
    wall = time.monotonic() - t
    layer_s = [b - a for a, b in zip([t, *done], done)]
    shutil.rmtree(out)
    return {"wall_s": wall, "layer_s": layer_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--schemes", nargs="+", default=["fp8-rtn", "fp8-static"], choices=sorted(SCHEMES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--work", type=Path, help="where the checkpoint and outputs go (default: a folder under /var/tmp)")
    ap.add_argument("--out", type=Path, help="one JSON line per run")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    work = args.work or Path(tempfile.mkdtemp(prefix="write-overlap-", dir="/var/tmp"))
    model = work / "model"
    if not (model / "config.json").is_file():
        write_model(model, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab, args.layers)
    rows = []
    for name in args.schemes:
        for r in range(args.repeats):
            for overlap in ((False, True) if r % 2 == 0 else (True, False)):
                calibrated = name != "fp8-rtn"
                row = {"scheme": name, "overlap": overlap, "repeat": r, "hidden": args.hidden,
                       "intermediate": args.intermediate, "layers": args.layers, "tokens": args.samples * args.seq_len,
                       "device": args.device, "dtype": args.dtype,
                       **run(model, SCHEMES[name], calibrated, work / "out", overlap, args)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    if args.work is None:
        shutil.rmtree(work)
    print("\n| scheme | overlap | best wall s | median layer s (layers 2..) | wall ÷ no overlap |\n|---|---|---|---|---|")
    for name in args.schemes:
        best = {o: min(r["wall_s"] for r in rows if r["scheme"] == name and r["overlap"] == o) for o in (False, True)}
        for o in (False, True):
            layers = [s for r in rows if r["scheme"] == name and r["overlap"] == o for s in r["layer_s"][1:]]
            print(f"| {name} | {'on' if o else 'off'} | {best[o]:.2f} | {statistics.median(layers):.2f} | "
                  f"{best[o] / best[False]:.2f}× |")


if __name__ == "__main__":
    main()
