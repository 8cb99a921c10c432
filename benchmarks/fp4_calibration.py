"""NVFP4 / MXFP4 weight-only calibration on a real model: round to nearest, the data-free block-scale search and GPTQ
(and AWQ), each quantized by llmc's layer stream (`quantize_model`), exported as compressed-tensors and scored by the
torch reference engine against the unquantized model on the same Brown eval windows: perplexity change with a paired
bootstrap 95% interval, exact mean KLD and top-1 agreement (with intervals), and the change against RTN of the same
format (paired over the same windows).

    PYTHONPATH=$PWD python benchmarks/fp4_calibration.py --model demo:smollm2-135m \\
        --variants nvfp4-rtn nvfp4-scale_search nvfp4-gptq mxfp4-rtn mxfp4-scale_search mxfp4-gptq \\
        --samples 32 --seq-len 512 --eval-windows 16 --out benchmarks/results/fp4_calibration.jsonl
    PYTHONPATH=$PWD python benchmarks/fp4_calibration.py --table benchmarks/results/fp4_calibration.jsonl

One JSON line per variant (per-window NLL, KL and top-1 means kept, so `--table` pairs rows measured in separate
runs on the same windows); `--table` prints the markdown table of a results file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

# variant name -> (weight format, block size, algorithm)
FORMATS = {"nvfp4": 16, "mxfp4": 32}
ALGORITHMS = ("rtn", "scale_search", "gptq", "gptq+scale_search_scales", "awq")


def scheme_of(variant: str):
    from llmc.quant.spec import Scheme, TensorSpec

    fmt, algorithm = variant.split("-", 1)
    options: tuple = ()
    if algorithm == "gptq+scale_search_scales":  # GPTQ choosing each block's scale by the search at its first column
        algorithm, options = "gptq", (("block_scales", "search"),)
    return Scheme(TensorSpec(fmt, "group", group_size=FORMATS[fmt]), algorithm=algorithm, algorithm_options=options)


def _window_means(x: torch.Tensor) -> list[float]:
    return x.double().mean(dim=1).tolist()


def measure(args) -> None:
    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import resolve_source
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.stream import Calibration, quantize_model
    from llmc.storage.store import Store
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    source = resolve_source(args.model, Store.default())
    tok = AutoTokenizer.from_pretrained(source.folder)
    eval_ids = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.eval_windows, seed=None).ids
    calib_ids = make_windows(tok, load_corpus("brown", "calibration"), args.seq_len, args.samples, seed=0).ids
    t = time.monotonic()
    base = TorchEngine(source.folder)
    reference = base.score(eval_ids)
    head = {"model": args.model, "variant": "baseline", "seq_len": args.seq_len, "eval_windows": args.eval_windows,
            "window_nll": _window_means(reference["nll"]), "eval_s": round(time.monotonic() - t, 1),
            "load_avg": os.getloadavg()[0]}
    _emit(head, args.out)
    del base
    for variant in args.variants:
        scheme = scheme_of(variant)
        with tempfile.TemporaryDirectory(prefix="llmc-fp4cal-") as tmp:
            t = time.monotonic()
            calibration = Calibration(calib_ids) if scheme.needs_calibration else None
            quantize_model(source, scheme, Path(tmp) / "canonical", calibration)
            quantize_s = time.monotonic() - t
            export_compressed_tensors(QuantizedModel.open(Path(tmp) / "canonical"), Path(tmp) / "export")
            t = time.monotonic()
            scores = TorchEngine(Path(tmp) / "export").score(eval_ids, reference=reference)
            eval_s = time.monotonic() - t
        row = {"model": args.model, "variant": variant, "scheme": scheme.weights.describe(),
               "algorithm": scheme.algorithm, "algorithm_options": dict(scheme.algorithm_options),
               "calibration": f"{args.samples}x{args.seq_len}" if calibration is not None else None,
               "quantize_s": round(quantize_s, 1), "eval_s": round(eval_s, 1), "load_avg": os.getloadavg()[0],
               "window_nll": _window_means(scores["nll"]), "window_kl": _window_means(scores["kl"]),
               "window_top1": _window_means(scores["top1"].double())}
        _emit(row, args.out)


def _emit(row: dict, out: Path | None) -> None:
    print(json.dumps({k: v for k, v in row.items() if not k.startswith("window_")}), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def table(path: Path) -> str:
    from llmc.eval.metrics import mean_interval, paired_ppl_change

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        base = [r for r in mine if r["variant"] == "baseline"][-1]
        latest = {r["variant"]: r for r in mine if r["variant"] != "baseline"}  # a variant measured twice: the last
        base_nll = torch.tensor(base["window_nll"])[:, None]
        lines += [f"{model}: baseline ppl {math.exp(base_nll.mean()):.2f}, {base['eval_windows']} windows of "
                  f"{base['seq_len']} tokens", "",
                  "| variant | calibration | ppl | Δ ppl vs unquantized (95% CI) | Δ ppl vs RTN (95% CI) | mean KLD (95% CI) "
                  "| top-1 agreement (95% CI) | quantize s |",
                  "|---|---|---|---|---|---|---|---|"]
        for variant, r in latest.items():
            nll = torch.tensor(r["window_nll"])[:, None]
            ch = paired_ppl_change(base_nll, nll)
            rtn = latest.get(variant.split("-")[0] + "-rtn")
            vs_rtn = "" if rtn is None or rtn is r else _pct(paired_ppl_change(torch.tensor(rtn["window_nll"])[:, None], nll))
            kl = mean_interval(torch.tensor(r["window_kl"])[:, None])
            top1 = mean_interval(torch.tensor(r["window_top1"])[:, None])
            lines.append(f"| {variant} | {r['calibration'] or '-'} | {math.exp(nll.mean()):.2f} | {_pct(ch)} | {vs_rtn} | "
                         f"{kl['mean']:.4f} [{kl['ci_low']:.4f}, {kl['ci_high']:.4f}] | {top1['mean'] * 100:.1f}% "
                         f"[{top1['ci_low'] * 100:.1f}, {top1['ci_high'] * 100:.1f}] | {r['quantize_s']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def _pct(ch: dict) -> str:
    return f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:smollm2-135m")
    ap.add_argument("--variants", nargs="+", default=[f"{f}-{a}" for f in FORMATS for a in ("rtn", "scale_search", "gptq")],
                    help=f"<format>-<algorithm>: formats {', '.join(FORMATS)}; algorithms {', '.join(ALGORITHMS)}")
    ap.add_argument("--samples", type=int, default=32, help="calibration windows (GPTQ, AWQ)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="append the JSON lines here")
    ap.add_argument("--table", type=Path, help="print the markdown table of this results file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    measure(args)
    if args.out:
        print(table(args.out))


if __name__ == "__main__":
    main()
