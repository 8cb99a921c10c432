"""llmc's MXFP4 / NVFP4 GGUF files, as `llmc build` writes them, read by ggml's own C dequantizers.

    PYTHONPATH=$PWD python benchmarks/fp4_gguf_file_check.py /tmp/ggml/bin/libggml-base.so demo:smollm2-135m /tmp/out

(libggml-base: build steps in benchmarks/fp4_ggml_check.py.) The model is quantized into llmc's canonical form
(round to nearest; NVFP4 fused siblings share their global scale, as the quantize stage does), exported by
`llmc.formats.gguf.export_gguf`, and every MXFP4 / NVFP4 tensor of the written file is decoded by ggml's
`dequantize_row_mxfp4` / `dequantize_row_nvfp4` (times the file's `<name>.scale` for NVFP4, as llama.cpp multiplies
the matmul's output by it), q/k rows un-permuted, against the canonical dequantized weights
(`QuantizedModel.dequantized_weight`, what llmc's torch reference evaluates). One JSON line per format.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from llmc.formats.gguf import TENSOR_SCALE_SUFFIX, export_gguf, gguf_name, llama_unpermute, _arch
from llmc.model.source import resolve_source
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
from llmc.storage.store import Store

SCHEMES = {"mxfp4": TensorSpec("mxfp4", "group", group_size=32), "nvfp4": TensorSpec("nvfp4", "group", group_size=16)}


def ggml_dequantize(lib: ctypes.CDLL, name: str, data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    f = getattr(lib, f"dequantize_row_{name}")
    f.restype, f.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    out = np.empty(shape, dtype=np.float32)
    data = np.ascontiguousarray(data)
    f(data.ctypes.data, out.ctypes.data, out.size)
    return torch.from_numpy(out)


def main(lib_path: str, spec: str, work: str) -> None:
    lib = ctypes.CDLL(lib_path)
    source = resolve_source(spec, Store.default())
    work_dir = Path(work)
    for name, weights in SCHEMES.items():
        qdir = work_dir / f"q-{name}"
        t0 = time.perf_counter()
        if not (qdir / "quantized.json").exists():
            quantize_model(source, Scheme(weights), qdir, None)
        t1 = time.perf_counter()
        qm = QuantizedModel.open(qdir)
        res = export_gguf(qm, work_dir / f"gguf-{name}")
        t2 = time.perf_counter()
        arch = _arch(qm.config)
        names = arch.tensor_names()
        by_gguf = {gguf_name(f"{m}.weight", names): m for m in qm.quantized_modules}
        tensors = {t.name: t for t in GGUFReader(str(res.path)).tensors}
        ggml_type = GGMLQuantizationType[name.upper()]
        worst_abs, worst_rel, n = 0.0, 0.0, 0
        canonical: dict[str, torch.Tensor] = {}
        for part in qm.iter_files():
            canonical.update(part)
        for gname, t in tensors.items():
            if t.tensor_type != ggml_type:
                continue
            module = by_gguf[gname]
            want = qm.dequantized_weight(canonical, module).float()
            got = ggml_dequantize(lib, name, np.asarray(t.data), tuple(want.shape))
            scale = tensors.get(gname.removesuffix(".weight") + TENSOR_SCALE_SUFFIX)
            if scale is not None:
                got = got * torch.from_numpy(np.asarray(scale.data).copy())
            kind = gname.split(".")[-2]
            if arch.family.permute_qk and kind in ("attn_q", "attn_k"):
                got = llama_unpermute(got, arch.n_head if kind == "attn_q" else arch.n_head_kv)
            diff = (got - want).abs()
            worst_abs = max(worst_abs, float(diff.max()))
            nz = want != 0
            worst_rel = max(worst_rel, float((diff[nz] / want[nz].abs()).max()) if nz.any() else 0.0)
            n += 1
        print(json.dumps({
            "model": spec, "format": name, "ggml_tensors_checked": n, "quantized_linears": len(qm.quantized_modules),
            "ggml_decode_vs_canonical_max_abs": worst_abs, "ggml_decode_vs_canonical_max_rel": worst_rel,
            "writer_weight_error": res.weight_error, "tensor_types": res.summary()["tensor_types"],
            "gguf_bytes": res.path.stat().st_size, "quantize_s": round(t1 - t0, 1), "export_s": round(t2 - t1, 1),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
