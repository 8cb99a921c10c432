"""One llmc quantize_model for benchmarks/gpu_calibration.py, timed per decoder layer, with the layer floor measured
in this same process first; then (outside the timer) the canonical form exported to compressed-tensors, which the
benchmark's quality step reads exactly as it reads llm-compressor's output.

    python benchmarks/_llmc_gpu_child.py MODEL_DIR TOKENS.safetensors SCHEME_EXPR OUT_DIR DTYPE DEVICE

Per layer: from the previous layer's on_layer_done (the first layer: from the call, so it includes the embeddings'
forward) to this layer's, i.e. reading the layer, calibrating and quantizing it on DEVICE, and writing its file and
the next layer's inputs. Prints one JSON line.

Also, outside the timer: the planner's prediction for this quantize stage on this machine (`predicted`: time per
layer, peak GPU and host bytes, the activations' placement), computed before the run as `llmc plan` would; with
BENCH_EVAL_WINDOWS=N, the streamed torch evaluation of the export on DEVICE (one decoder layer resident, N windows of
the calibration file in bf16), its time per decoder layer; with BENCH_PROFILE=FILE, the quantization call under
cProfile (its time then includes the profiler's), the top functions by cumulative time written to FILE;
BENCH_RESUME_EVERY_S sets StreamOptions.resume_every_s (0: a resume point after every layer).

BENCH_REPEATS=N (default 1): the quantization call N times in this process, each into a fresh folder (a second run
into the first's would resume it), one JSON line each with its `repeat`; imports, the floor and the prediction once.
Only the first repeat's output is exported (what the quality step scores) and profiled.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import shutil
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

    predicted = planner_prediction(Path(folder), scheme, ids.shape, dtype_name, device)
    resume = os.environ.get("BENCH_RESUME_EVERY_S")
    profile = os.environ.get("BENCH_PROFILE")
    for repeat in range(int(os.environ.get("BENCH_REPEATS", "1"))):
        done.clear()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        canonical = Path(out) / ("canonical" if repeat == 0 else f"canonical-{repeat}")
        options = StreamOptions(dtype=dtype, device=device, on_layer_done=layer_done,
                                resume_every_s=float(resume) if resume else None)
        profiler = cProfile.Profile() if profile and repeat == 0 else None
        t = time.monotonic()
        if profiler:
            profiler.enable()
        quantize_model(ModelSource(Path(folder), "synthetic", "synthetic"), scheme, canonical, Calibration(ids),
                       options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.monotonic() - t
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
            Path(profile).write_text(text.getvalue())
        layer_s = [b - a for a, b in zip([t, *done], done)]
        peak_gpu = peak_gpu_mb(device)
        if repeat == 0:
            export_compressed_tensors(QuantizedModel.open(canonical), Path(out) / "export")
        else:
            shutil.rmtree(canonical, ignore_errors=True)
        row = {"repeat": repeat, "wall_s": wall, "layer_s": layer_s, "floor_s": floor, "peak_gpu_mb": peak_gpu,
               "peak_rss_mb": peak_rss_mb(), "torch": torch.__version__, "predicted": predicted,
               "resume_every_s": options.resume_every_s}
        if repeat == 0:
            row.update(evaluated(Path(folder), Path(out) / "export", ids, device))
        print(json.dumps(row), flush=True)


def evaluated(folder: Path, export: Path, ids, device) -> dict:
    """With BENCH_EVAL_WINDOWS=N: the streamed torch evaluation of the export and of the unquantized model, timed."""
    windows = int(os.environ.get("BENCH_EVAL_WINDOWS", "0"))
    if not windows:
        return {}
    return {"eval": {"artifact": streamed_eval_seconds(export, ids[:windows], device),
                     "baseline": streamed_eval_seconds(folder, ids[:windows], device)}}


def planner_prediction(folder: Path, scheme, shape: tuple[int, int], dtype_name: str, device) -> dict:
    """The quantize stage's cost row as `llmc plan` makes it for this checkpoint, scheme, calibration and device
    (llmc.pipeline.quantize.Quantize.cost; the machine's rates probed here, on this device)."""
    from types import SimpleNamespace

    import torch
    from llmc.model.dtype import BYTES
    from llmc.pipeline.context import Costing
    from llmc.pipeline.quantize import Quantize
    from llmc.planning import shapes
    from llmc.planning.machine import Machine
    from llmc.planning.machine import memory_available
    from llmc.recipe.schema import CalibrationSection

    config = json.loads((folder / "config.json").read_text())
    # planning offline (no weights written: benchmarks/gpu_calibration.py --predict-only) as `llmc plan` does, the
    # quantize stage deciding its layer loop (llmc.quant.loop_plan) from the same facts
    tensors = shapes.from_headers(folder) if any(folder.glob("*.safetensors")) else shapes.from_config(config)
    elem = BYTES[dtype_name]
    available = memory_available()
    gpu_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    # the recipe's own calibration section (its defaults for the rest), so a field the stage's decision reads later
    # is there (a namespace of the fields read once went stale: stream_experts)
    calibration = CalibrationSection(samples=shape[0], seq_len=shape[1], packing="windows", spill_activations="auto")
    recipe = SimpleNamespace(calibration=calibration)
    costing = Costing(recipe=recipe, shape=shapes.Shape.of(tensors, config, elem),
                      machine=Machine(available, gpu_free, str(device), os.cpu_count()),
                      linears=tensors.linear_shapes(), compute=dtype_name, stored_elem=elem, config=config,
                      tensor_shapes=tensors.shapes)  # the widths the layer loop's decision reads, as the plan's
    Quantize("", scheme).cost(costing)
    row = costing.rows[-1]
    return {"layer_s": row.layer_seconds, "fixed_s": row.fixed_seconds, "seconds": row.seconds,
            "gpu_mb": row.gpu_bytes / 2**20, "host_mb": row.host_bytes / 2**20, "strategy": row.strategy,
            "why": row.why}


def streamed_eval_seconds(folder: Path, windows, device) -> dict:
    """The torch engine's streamed evaluation of `folder` on `device` in bf16 (token NLL of `windows`): wall time and
    each decoder layer's (between the ends of consecutive layers: the layer read, decompressed, moved and run over
    every window)."""
    import torch
    from llmc.engines import torch_stream
    from llmc.engines.torch_ref import TorchEngine

    ends: list[float] = []
    release = torch_stream.release

    def timed_release(module) -> None:  # the end of a layer in streamed_logits
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.monotonic())
        release(module)

    torch_stream.release = timed_release
    try:
        engine = TorchEngine(folder, dtype="bfloat16", streamed=True, device=device)
        t = time.monotonic()
        nll = engine.token_nll(windows, batch_size=4)
        wall = time.monotonic() - t
    finally:
        torch_stream.release = release
    return {"wall_s": wall, "layer_s": [b - a for a, b in zip(ends, ends[1:])], "windows": int(windows.shape[0]),
            "mean_nll": float(nll.mean())}


if __name__ == "__main__":
    main()
