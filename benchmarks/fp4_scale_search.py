"""Weight reconstruction error of NVFP4 / MXFP4 / MXFP8: round-to-nearest scales against the block-scale search
(llmc.quant.scale_search), on real trained matrices: the demo models' GGUF tensors, dequantized by gguf-py.

Caveat: these weights already sit on their GGUF's 4-bit grid (SmolLM2 Q4_1, Gemma-3 Q4_K_M, with some Q6_K); the
figures are relative errors of each method against that dequantized matrix, and the ratio search / RTN.

    python benchmarks/fp4_scale_search.py --model gemma3-270m --out benchmarks/results/fp4_scale_search.jsonl

One JSON line per (tensor, format), and a summary line per format.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llmc.model.source import describe_source
from llmc.quant.microscaling import MXFP4, MXFP8, NVFP4, quantize_blocks
from llmc.quant.scale_search import block_errors, search_block_scales

PICK = ("attn_q.weight", "attn_v.weight", "ffn_up.weight", "ffn_down.weight")


def _matrices(gguf_path: Path, layers: list[int]):
    from gguf import GGUFReader, quants

    reader = GGUFReader(gguf_path)
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and int(parts[1]) in layers and ".".join(parts[2:]) in PICK:
            w = quants.dequantize(t.data, t.tensor_type)
            yield t.name, t.tensor_type.name, torch.from_numpy(w.reshape(w.shape[0], -1).copy()).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="a demo model: smollm2-135m, gemma3-270m, ...")
    ap.add_argument("--layers", default="0,8,17", help="decoder layers to read")
    ap.add_argument("--out", type=Path, help="append the JSON lines here too")
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    lines, totals = [], {}
    for name, source_type, w in _matrices(describe_source(f"demo:{args.model}"), layers):
        for fmt in (NVFP4, MXFP4, MXFP8):
            if w.shape[1] % fmt.block_size:
                continue
            start = time.perf_counter()
            rtn = block_errors(w, quantize_blocks(w, fmt)).sum().item()
            rtn_s = time.perf_counter() - start
            start = time.perf_counter()
            found = block_errors(w, search_block_scales(w, fmt)).sum().item()
            search_s = time.perf_counter() - start
            energy = w.pow(2).sum().item()
            line = {"model": args.model, "tensor": name, "source_type": source_type, "shape": list(w.shape),
                    "format": fmt.name, "rtn_rel_mse": rtn / energy, "search_rel_mse": found / energy,
                    "ratio": found / rtn, "rtn_s": round(rtn_s, 3), "search_s": round(search_s, 3)}
            lines.append(line)
            t = totals.setdefault(fmt.name, [0.0, 0.0])
            t[0] += rtn
            t[1] += found
            print(json.dumps(line), flush=True)
    for fmt, (rtn, found) in totals.items():
        line = {"model": args.model, "format": fmt, "summary": True, "layers": layers, "ratio": found / rtn}
        lines.append(line)
        print(json.dumps(line))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)


if __name__ == "__main__":
    main()
