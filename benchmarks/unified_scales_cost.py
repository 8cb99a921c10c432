"""What unifying fused siblings' FP8 weight scales costs a target that would not need it (issue 45, question B).

vLLM and SGLang run q/k/v and gate/up as one GEMM with one per-tensor FP8 weight scale (the max of the members'; the
other members' codes requantized to it: `llmc.quant.runtime_scales`), and llmc's canonical form holds exactly that
for every target. A runtime that runs each Linear on its own (ONNX Runtime / TensorRT from QDQ ONNX) could keep each
member's own scale. This measures the difference on a real model: FP8 W8A8 with per-tensor weights and static
per-tensor activations, quantized once by llmc's layer stream with the unification switched off ("separate": each
Linear's own scale), then `runtime_scales.unify_fused_weight_scales` applied to that canonical form ("unified": what
vLLM / SGLang serve, bit for bit what the quantize stage writes, tests/unit/test_runtime_scales.py). Both exported as
compressed-tensors and scored by llmc's torch engine against the unquantized model on the same Brown eval windows:
perplexity with the paired change against the baseline and against each other (bootstrap 95% intervals), mean KL
divergence and top-1 agreement with the baseline.

    PYTHONPATH=$PWD nice -n 19 python benchmarks/unified_scales_cost.py --model demo:smollm2-135m \\
        --samples 32 --eval-windows 32 --out benchmarks/results/unified_scales_cost.jsonl

Prints one JSON line (per-window means kept in --out, so the intervals can be recomputed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def unify_canonical(root: Path) -> dict:
    """In place on the canonical form at `root`: `runtime_scales.unify_fused_weight_scales` on each file's quantized
    Linears (a decoder layer per file). Returns how many fused groups changed, how many members' scales were below
    their group's max (those members are requantized onto a coarser grid), and the ratio own scale / scale after, over
    every quantized Linear of a layer with a fused group (o_proj and down_proj, in no group, count as 1.0)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from llmc.quant import runtime_scales
    from llmc.quant.canonical import QuantizedModel

    qm = QuantizedModel.open(root)
    modules = list(qm.quantized_modules)
    changed, ratios = 0, []
    for f in qm.files():
        with safe_open(str(f), framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
            metadata = h.metadata()
        mine = {n: qm.scheme_of(n).weights for n in modules if f"{n}.weight_scale" in tensors}
        before = {n: tensors[f"{n}.weight_scale"].float().reshape(()).item() for n in mine}
        groups = runtime_scales.unify_fused_weight_scales(tensors, mine)
        if not groups:
            continue
        changed += len(groups)
        ratios += [before[n] / tensors[f"{n}.weight_scale"].float().reshape(()).item() for n in mine]
        save_file(tensors, str(f), metadata=metadata)
    return {"groups_unified": changed, "scale_ratio_min": min(ratios, default=None),
            "scale_ratio_median": sorted(ratios)[len(ratios) // 2] if ratios else None,
            "members_below_max": sum(r < 1.0 for r in ratios)}


def _means(x: torch.Tensor) -> list[float]:
    return x.double().mean(dim=1).tolist()


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.eval.metrics import mean_interval, paired_ppl_change
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import resolve_source
    from llmc.quant import runtime_scales
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, quantize_model
    from llmc.storage.store import Store

    torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_start = os.getloadavg()
    source = resolve_source(args.model, Store.default())
    tok = AutoTokenizer.from_pretrained(source.folder)
    eval_ids = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.eval_windows, seed=None).ids
    calib_ids = make_windows(tok, load_corpus("brown", "calibration"), args.seq_len, args.samples, seed=0).ids
    scheme = Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"), ignore=("lm_head",))
    t0 = time.monotonic()
    reference = TorchEngine(source.folder, streamed=False).score(eval_ids)
    base_s = time.monotonic() - t0
    scores, info = {}, {}
    with tempfile.TemporaryDirectory(prefix="llmc-unified-", dir=args.work) as tmp:
        tmp = Path(tmp)
        t0 = time.monotonic()
        with pytest_free_patch(runtime_scales, "unify_fused_weight_scales", lambda tensors, specs: []):
            quantize_model(source, scheme, tmp / "separate", Calibration(calib_ids))
        quantize_s = time.monotonic() - t0
        shutil.copytree(tmp / "separate", tmp / "unified")
        info = unify_canonical(tmp / "unified")
        for variant in ("separate", "unified"):
            export_compressed_tensors(QuantizedModel.open(tmp / variant), tmp / f"{variant}-export")
            shutil.rmtree(tmp / variant)
            t0 = time.monotonic()
            scores[variant] = TorchEngine(tmp / f"{variant}-export", streamed=False).score(eval_ids,
                                                                                           reference=reference)
            scores[variant]["eval_s"] = time.monotonic() - t0
            shutil.rmtree(tmp / f"{variant}-export")
    base_nll = reference["nll"].double().mean(dim=1, keepdim=True)
    row = {"benchmark": "unified_scales_cost", "model": args.model, "started_utc": started,
           "scheme": "FP8 W8A8: weights fp8_e4m3 per tensor, activations fp8_e4m3 static per tensor, lm_head kept",
           "calibration": f"brown calibration split, {args.samples}x{args.seq_len}, seed 0",
           "eval": f"brown eval split, {args.eval_windows} windows x {args.seq_len} tokens", "torch_threads": args.threads,
           "cpu": _cpu(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(), **info,
           "quantize_s": round(quantize_s, 1), "baseline_eval_s": round(base_s, 1),
           "ppl_baseline": round(math.exp(base_nll.mean().item()), 4)}
    nll = {v: s["nll"].double().mean(dim=1, keepdim=True) for v, s in scores.items()}
    for v, s in scores.items():
        kl, top1 = mean_interval(s["kl"].double().mean(dim=1, keepdim=True)), \
            mean_interval(s["top1"].double().mean(dim=1, keepdim=True))
        ch = paired_ppl_change(base_nll, nll[v])
        row[v] = {"ppl": round(math.exp(nll[v].mean().item()), 4),
                  "ppl_change_pct": [round(ch[k], 3) for k in ("delta_pct", "ci_low_pct", "ci_high_pct")],
                  "mean_kld": [round(kl[k], 5) for k in ("mean", "ci_low", "ci_high")],
                  "top1_pct": [round(100 * top1[k], 2) for k in ("mean", "ci_low", "ci_high")],
                  "eval_s": round(s["eval_s"], 1)}
    ch = paired_ppl_change(nll["separate"], nll["unified"])
    dkl = mean_interval((scores["unified"]["kl"].double().mean(dim=1) - scores["separate"]["kl"].double().mean(dim=1))[:, None])
    dtop = mean_interval((scores["unified"]["top1"].double().mean(dim=1)
                          - scores["separate"]["top1"].double().mean(dim=1))[:, None])
    row["unified_vs_separate"] = {"ppl_change_pct": [round(ch[k], 3) for k in ("delta_pct", "ci_low_pct", "ci_high_pct")],
                                  "mean_kld_change": [round(dkl[k], 5) for k in ("mean", "ci_low", "ci_high")],
                                  "top1_change_pct_points": [round(100 * dtop[k], 2) for k in ("mean", "ci_low", "ci_high")]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        full = {**row, "window_nll": {"baseline": base_nll[:, 0].tolist(), **{v: nll[v][:, 0].tolist() for v in nll}},
                "window_kl": {v: _means(s["kl"]) for v, s in scores.items()},
                "window_top1": {v: _means(s["top1"]) for v, s in scores.items()}}
        with args.out.open("a") as f:
            f.write(json.dumps(full) + "\n")
    return row


class pytest_free_patch:
    """Set `obj.name` to `value` for a `with` block (monkeypatch without pytest)."""

    def __init__(self, obj, name: str, value) -> None:
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self) -> None:
        self.saved = getattr(self.obj, self.name)
        setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc) -> None:
        setattr(self.obj, self.name, self.saved)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:smollm2-135m")
    ap.add_argument("--samples", type=int, default=32, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="folder for the temporary canonical forms and exports")
    ap.add_argument("--out", type=Path, help="append the JSON line (with per-window means) here")
    print(json.dumps(measure(ap.parse_args())), flush=True)


if __name__ == "__main__":
    main()
