"""One llmc quantize_model for benchmarks/gpu_calibration.py, timed per decoder layer, with the layer floor measured
in this same process first; then (outside the timer) the canonical form exported to compressed-tensors, which the
benchmark's quality step reads exactly as it reads llm-compressor's output.

    python benchmarks/_llmc_gpu_child.py MODEL_DIR TOKENS.safetensors SCHEME_EXPR OUT_DIR DTYPE DEVICE

Per layer: from the previous layer's on_layer_done (the first layer: from the call, so it includes the embeddings'
forward) to this layer's, i.e. reading the layer, calibrating and quantizing it on DEVICE, and writing its file and
the next layer's inputs. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    folder, tokens, scheme_expr, out, dtype_name, device_name = sys.argv[1:7]
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports stay outside the timer, as the peer's)
    from safetensors.torch import load_file

    from _layer_floor import floor_seconds, peak_gpu_mb, peak_rss_mb
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import Calibration, quantize_model, StreamOptions

    scheme = eval(scheme_expr, {"Scheme": Scheme, "TensorSpec": TensorSpec})  # noqa: S307 - the benchmark's own table
    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    ids = load_file(tokens)["input_ids"]
    floor = floor_seconds(Path(folder), ids.shape[0], ids.shape[1], dtype, device)
    done: list[float] = []

    def layer_done(_i: int) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        done.append(time.monotonic())

    t = time.monotonic()
    quantize_model(ModelSource(Path(folder), "synthetic", "synthetic"), scheme, Path(out) / "canonical",
                   Calibration(ids),
                   StreamOptions(dtype=dtype, device=device, on_layer_done=layer_done))
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.monotonic() - t
    layer_s = [b - a for a, b in zip([t, *done], done)]
    peak_gpu = peak_gpu_mb(device)
    export_compressed_tensors(QuantizedModel.open(Path(out) / "canonical"), Path(out) / "export")
    print(json.dumps({"wall_s": wall, "layer_s": layer_s, "floor_s": floor, "peak_gpu_mb": peak_gpu,
                      "peak_rss_mb": peak_rss_mb(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
