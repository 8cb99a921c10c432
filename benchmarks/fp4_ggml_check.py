"""llmc's GGUF MXFP4 / NVFP4 blocks through ggml's own C dequantizers, and ggml's reference quantizers on the same
weights.

    # ggml-base from the llama.cpp that llama-cpp-python 0.3.36 vendors (ggml 0.25.3): a 4-minute build, no model
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/l && tar xzf /tmp/l/*.tar.gz -C /tmp/l
    cmake -S /tmp/l/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/ggml -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DBUILD_SHARED_LIBS=ON && ninja -C /tmp/ggml ggml-base
    PYTHONPATH=$PWD python benchmarks/fp4_ggml_check.py /tmp/ggml/bin/libggml-base.so demo:smollm2-135m

For every q/k/v/o/gate/up/down weight of the model (float32): llmc's round-to-nearest MXFP4 and NVFP4, written as
GGUF blocks by `gguf_mxfp4_blocks` / `gguf_nvfp4_blocks`, decoded by ggml's `dequantize_row_mxfp4` /
`dequantize_row_nvfp4` (the C functions llama.cpp's CPU backend uses to read these types), against llmc's
`dequantize_blocks`; and ggml's `quantize_row_*_ref` (what llama-quantize runs) on the same weights: block bytes
equal to llmc's, and reconstruction error sum((decoded - w)^2) / sum(w^2). One JSON line per format.
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np
import torch
from safetensors.torch import load_file

from llmc.formats.microscaling_export import gguf_mxfp4_blocks, gguf_nvfp4_blocks
from llmc.model.source import resolve_source
from llmc.quant.microscaling import MXFP4, NVFP4, dequantize_blocks, e2m1_decode, quantize_blocks
from llmc.storage.store import Store

BYTES_PER_BLOCK = {"mxfp4": (32, 17), "nvfp4": (64, 36)}


def ggml(lib: ctypes.CDLL, fn: str):
    f = getattr(lib, fn)
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return f


def dequantize(lib: ctypes.CDLL, name: str, blocks: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    out = np.empty(shape, dtype=np.float32)
    blocks = np.ascontiguousarray(blocks)
    ggml(lib, f"dequantize_row_{name}")(blocks.ctypes.data, out.ctypes.data, out.size)
    return torch.from_numpy(out)


def quantize_ref(lib: ctypes.CDLL, name: str, w: torch.Tensor) -> np.ndarray:
    per, nbytes = BYTES_PER_BLOCK[name]
    x = np.ascontiguousarray(w.numpy(), dtype=np.float32)
    out = np.zeros((w.shape[0], w.shape[1] // per * nbytes), dtype=np.uint8)
    ggml(lib, f"quantize_row_{name}_ref")(x.ctypes.data, out.ctypes.data, x.size)
    return out


def main(lib_path: str, spec: str) -> None:
    lib = ctypes.CDLL(lib_path)
    folder = resolve_source(spec, Store.default()).folder
    weights = {k: v.float() for k, v in load_file(f"{folder}/model.safetensors").items()
               if k.endswith("_proj.weight")}
    for name, fmt in (("mxfp4", MXFP4), ("nvfp4", NVFP4)):
        worst_exact, worst_rel, bytes_equal, nbytes = 0.0, 0.0, 0, 0
        sq = {"weight": 0.0, "llmc": 0.0, "ggml_ref": 0.0}
        for w in weights.values():
            q = quantize_blocks(w, fmt)
            ours = dequantize_blocks(q)
            ref_blocks = quantize_ref(lib, name, w)
            if name == "mxfp4":
                blocks = gguf_mxfp4_blocks(q)
                theirs = dequantize(lib, name, blocks, tuple(w.shape))
                worst_exact = max(worst_exact, float((theirs - ours).abs().max()))
                ref = dequantize(lib, name, ref_blocks, tuple(w.shape))
            else:
                blocks, scale = gguf_nvfp4_blocks(q)
                theirs = dequantize(lib, name, blocks, tuple(w.shape))
                # ggml decodes code x block scale; llama.cpp multiplies the matmul's output by `.scale`.
                unscaled = (e2m1_decode(q.codes).unflatten(-1, (-1, 16)) * q.scale.float().unsqueeze(-1)).flatten(-2)
                worst_exact = max(worst_exact, float((theirs - unscaled).abs().max()))
                scaled = theirs * float(scale[0])
                worst_rel = max(worst_rel, float(((scaled - ours).abs() / ours.abs().clamp_min(1e-30))[ours != 0]
                                                 .max()))
                ref = dequantize(lib, name, ref_blocks, tuple(w.shape))  # ggml's quantizer has no tensor scale
            bytes_equal += int((ref_blocks == blocks).sum())
            nbytes += blocks.size
            sq["weight"] += float(w.double().pow(2).sum())
            sq["llmc"] += float((ours.double() - w.double()).pow(2).sum())
            sq["ggml_ref"] += float((ref.double() - w.double()).pow(2).sum())
        row = {"model": spec, "format": name, "tensors": len(weights),
               "ggml_decode_of_llmc_blocks_max_abs_diff": worst_exact,
               "ggml_ref_quantizer_bytes_equal_pct": 100 * bytes_equal / nbytes,
               "rel_mse_llmc": sq["llmc"] / sq["weight"], "rel_mse_ggml_ref": sq["ggml_ref"] / sq["weight"]}
        if name == "nvfp4":
            row["ggml_decode_times_scale_max_rel_diff"] = worst_rel
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "demo:smollm2-135m")
