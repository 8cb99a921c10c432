"""llama.cpp itself on llmc's MXFP4 / NVFP4 GGUF files, against llmc's torch reference on the same weights.

    bash scripts/setup-llama.sh
    PYTHONPATH=$PWD python benchmarks/fp4_gguf_llamacpp.py demo:smollm2-135m /tmp/out --windows 6 --seq-len 512 \
        > benchmarks/results/fp4_gguf_llamacpp.jsonl

Per format: the model is quantized into llmc's canonical form (round to nearest; NVFP4's fused siblings under their
shared global scale, as the quantize stage does), written both as compressed-tensors (what the torch reference
engine decodes: `QuantizedModel.dequantized_weight` bit for bit) and as GGUF (`export_gguf`: MXFP4 / NVFP4 blocks
from the same codes, ggml's decode of them equal to those weights, `benchmarks/fp4_gguf_file_check.py`). Both
engines score the same Brown eval windows (the build's: `make_tokens(..., "eval", packing="windows", seed=None)`),
fed as token ids, so tokenization and BOS are the same by construction. The torch engine's scores are the
reference: llama.cpp's perplexity change against it with a paired bootstrap 95% interval over windows, the exact
KL divergence (torch || llama.cpp over the full vocabulary: the worker re-applies the reference's output head) and
top-1 agreement. One JSON line per format. What remains between the two is llama.cpp's arithmetic: its CPU backend
quantizes each FP4 matmul's activations to Q8_0 (blocks of 32), and its kernels' accumulation order.
`--q8-0-activations` also scores the torch reference with that Q8_0 round trip on every quantized Linear's input
(`q8_0_roundtrip`), to see how much of the difference it is; `--embedding-type f32` writes the token embedding /
tied head in F32 instead of the F16 `llmc build` writes, for the same question about the head.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from llmc.data.sources import BrownSource
from llmc.data.tokens import make_tokens
from llmc.engines.agreement import kld_kind
from llmc.engines.llamacpp import LlamaCppEngine
from llmc.engines.torch_ref import TorchEngine
from llmc.engines.torch_stream import decide_torch_loading_of
from llmc.eval.metrics import mean_interval, paired_ppl_change, perplexity
from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.formats.gguf import export_gguf
from llmc.model.source import resolve_source
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
from llmc.storage.store import Store

Q8_0_BLOCK = 32


def q8_0_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """`x` through ggml's Q8_0 along its last dimension (`quantize_row_q8_0_ref`: per 32 values d = amax / 127,
    codes round(x / d) half away from zero, d stored as fp16), decoded: what llama.cpp's CPU backend multiplies an FP4
    weight with in place of the activations."""
    b = x.float().reshape(-1, Q8_0_BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = b * inv
    codes = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (codes * d.half().float()).reshape(x.shape).to(x.dtype)


def torch_with_q8_0_activations(folder: Path, modules, windows) -> dict:
    """The torch reference on `folder` with every quantized Linear's input through `q8_0_roundtrip`."""
    engine = TorchEngine(folder, streamed=decide_torch_loading_of(folder, "float32").streamed)
    hooked = 0
    for name, mod in engine.model.named_modules():
        if name in modules:
            mod.register_forward_pre_hook(lambda _m, args: (q8_0_roundtrip(args[0]), *args[1:]))
            hooked += 1
    if hooked != len(modules):
        raise SystemExit(f"{folder}: {hooked} of the {len(modules)} quantized Linears found in the torch model")
    return engine.score(windows)


SCHEMES = {"mxfp4": TensorSpec("mxfp4", "group", group_size=32), "nvfp4": TensorSpec("nvfp4", "group", group_size=16)}


def compare(qdir: Path, work: Path, windows, *, threads: int | None = None, embedding_type: str = "f16",
            q8_0_activations: bool = False) -> dict:
    """Export the canonical form in `qdir` as GGUF (token embedding / tied head as `embedding_type`) and
    compressed-tensors, score both on `windows`; the figures. `q8_0_activations`: also score the torch reference
    with llama.cpp's Q8_0 activations emulated, and llama.cpp against that."""
    qm = QuantizedModel.open(qdir)
    t0 = time.perf_counter()
    gguf = export_gguf(qm, work / f"gguf-{embedding_type}", embedding_type=embedding_type)
    export_compressed_tensors(qm, work / "ct")
    t1 = time.perf_counter()
    reference = TorchEngine(work / "ct", streamed=decide_torch_loading_of(work / "ct", "float32").streamed).score(windows)
    t2 = time.perf_counter()
    scores, tput = LlamaCppEngine(gguf.path.parent, threads=threads).measure(
        windows, windows[:1], decode_tokens=0, repeats=0, reference=reference)
    t3 = time.perf_counter()
    change = paired_ppl_change(reference["nll"], scores["nll"])
    emulated = {}
    if q8_0_activations:
        q8 = torch_with_q8_0_activations(work / "ct", set(qm.quantized_modules), windows)
        emulated = {"ppl_torch_q8_0_activations": perplexity(q8["nll"]),
                    "torch_q8_0_vs_torch": paired_ppl_change(reference["nll"], q8["nll"]),
                    "llama_cpp_vs_torch_q8_0": paired_ppl_change(q8["nll"], scores["nll"])}
    return {
        "ppl_torch": perplexity(reference["nll"]), "ppl_llama_cpp": perplexity(scores["nll"]),
        "llama_cpp_vs_torch_pct": change["delta_pct"], "ci_low_pct": change["ci_low_pct"],
        "ci_high_pct": change["ci_high_pct"],
        "kld": mean_interval(scores["kl"]), "kld_kind": kld_kind(scores),
        "top1_agreement": mean_interval(scores["top1"].double()),
        "gguf_tensor_types": gguf.summary()["tensor_types"], "gguf_bytes": gguf.path.stat().st_size,
        "gguf_added_weight_error": gguf.weight_error,
        "llama_cpp_version": tput["engine_version"], "threads": tput["threads"],
        "export_s": round(t1 - t0, 1), "torch_s": round(t2 - t1, 1), "llama_cpp_s": round(t3 - t2, 1),
        **emulated,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a model source, e.g. demo:smollm2-135m")
    p.add_argument("work", type=Path, help="working folder (canonical forms are reused from here)")
    p.add_argument("--formats", default="mxfp4,nvfp4")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: every CPU)")
    p.add_argument("--embedding-type", default="f16", choices=("f16", "f32", "q8_0"),
                   help="the GGUF's token embedding (and tied output head); f16 is what `llmc build` writes")
    p.add_argument("--q8-0-activations", action="store_true",
                   help="also score the torch reference with llama.cpp's Q8_0 activations emulated")
    args = p.parse_args()
    source = resolve_source(args.model, Store.default())
    from transformers import AutoTokenizer

    tokens = make_tokens(BrownSource(), AutoTokenizer.from_pretrained(source.folder), "eval", packing="windows",
                         count=args.windows, seq_len=args.seq_len, seed=None)
    for name in args.formats.split(","):
        qdir = args.work / f"q-{name}"
        t0 = time.perf_counter()
        if not (qdir / "quantized.json").exists():
            quantize_model(source, Scheme(SCHEMES[name]), qdir, None)
        row = compare(qdir, args.work / name, tokens.input_ids, threads=args.threads,
                      embedding_type=args.embedding_type, q8_0_activations=args.q8_0_activations)
        print(json.dumps({"model": args.model, "format": name, "windows": args.windows, "seq_len": args.seq_len,
                          "tokens_sha256": tokens.sha256, "bos": tokens.bos,
                          "embedding_type": args.embedding_type, **row,
                          "total_s": round(time.perf_counter() - t0, 1), "load_avg_1m": os.getloadavg()[0]}),
              flush=True)


if __name__ == "__main__":
    main()
