#!/usr/bin/env python3
"""How often an asymmetric int4 range's zero point is 0 (unsigned) on a real model, and what the one-level narrower
grid of zero_grid 'nonzero' costs in weight error in those groups (RTN, every *proj Linear). Only the moved groups are
quantized (the others are identical under both grids: tests/unit/test_gptq_zero.py).

Usage: PYTHONPATH=. python benchmarks/gptq_zero_groups.py <llmc cache dir> <model source, e.g. demo:smollm2-135m>"""
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc.model.source import resolve_source
from llmc.quant.numerics import dequantize, qparams_from_range, quantize_weight
from llmc.quant.spec import TensorSpec
from llmc.storage.store import Store

torch.set_num_threads(1)
src = resolve_source(sys.argv[2], Store(Path(sys.argv[1])))
weights = {}
for f in sorted(Path(src.folder).glob("*.safetensors")):
    for k, v in load_file(str(f)).items():
        if k.endswith("proj.weight") and v.dim() == 2:
            weights[k] = v.float()
print(sys.argv[2], len(weights), "Linears", flush=True)
for g in (128, 64, 32):
    spec = TensorSpec("int4", "group", group_size=g, symmetric=False)
    per_row = TensorSpec("int4", "channel", symmetric=False)
    groups = 0
    moved_rows = []
    for k, w in weights.items():
        if w.shape[1] % g:
            continue
        x = w.reshape(-1, g)
        _, zp = qparams_from_range(x.amin(-1), x.amax(-1), spec)
        groups += x.shape[0]
        moved_rows.append(x[zp == -8])
    m = torch.cat(moved_rows)
    p = quantize_weight(m, per_row)  # one range per moved group
    q = quantize_weight(m, replace(per_row, zero_grid="nonzero"))
    ep = float((dequantize(p.codes, p.scale, p.zero_point, per_row) - m).pow(2).sum())
    eq = float((dequantize(q.codes, q.scale, q.zero_point, per_row) - m).pow(2).sum())
    print(f"g{g}: {len(m)}/{groups} groups ({100 * len(m) / groups:.3f} %) have zero point 0 on the plain grid; "
          f"their weight SSE {ep:.4g} plain -> {eq:.4g} on the nonzero grid "
          f"({(100 * (eq / ep - 1)) if ep else 0:+.1f} %)",
          flush=True)
