"""Export a scheme as an ONNX Runtime model folder that onnxruntime-genai runs (INT4 weight-only as
MatMulNBits; 8-bit schemes as Q/DQ, see the end of this docstring).

The graph is written by onnxruntime-genai's own model builder (the tool ORT ships for LLMs: fused
GroupQueryAttention with KV cache, SkipSimplifiedLayerNormalization, RotaryEmbedding, MatMulNBits),
so llmc does not maintain a second ONNX graph writer. The builder does not quantize anything here: it
is fed the canonical codes as a GPTQ-format checkpoint (llmc.formats.gptq_format), which its GPTQ
loader repacks into MatMulNBits blocks unchanged. Everything the scheme leaves unquantized (the
embedding, the lm_head) is excluded from the builder's own RTN quantizer, which would otherwise
requantize them to 4 bits (measured on SmolLM2: +0.7% perplexity and 100x the KL of the exact export).

    <out>/model.onnx, model.onnx.data   the decoder (external data)
    <out>/genai_config.json             onnxruntime-genai's runtime config (inputs/outputs, KV layout, search)
    <out>/tokenizer files               copied by the builder
    <out>/llmc-serve.json               how it was built and what to expect

`accuracy_level` is MatMulNBits' compute type on the CPU: 4 (ORT's CPU default, what a deployment
gets) quantizes activations to int8 per block inside the kernel; 1 computes in float32 and reproduces
the canonical model's function to rounding (KL ~1e-6 against the torch reference on SmolLM2).

8-bit schemes (W8A8 INT8/FP8 with static activation scales, W8A16) go through the builder as a float
model (the canonical weights dequantized), and llmc then puts its codes back into the builder's graph:
each quantized MatMul's weight becomes codes -> DequantizeLinear (q/k/v, which the builder packs into
one MatMul, concatenated), with QuantizeLinear -> DequantizeLinear and the calibrated scale on its input
(llmc.formats.onnx_qdq.insert_qdq; every replaced weight is checked against the canonical one first).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from llmc import __version__
from llmc.formats.base import (ArtifactFormat, ExportLayout, ExportRequest, ExportWork, read_json,
                               target_key)
from llmc.formats.registry import register_format
from llmc.formats import files
from llmc.formats.files import MAX_SHARD_BYTES, SERVE_FILE, copy_tokenizer_files
from llmc.formats.gptq_format import check_scheme as check_gptq_scheme
from llmc.formats.gptq_format import GptqCheckpoint, export_gptq
from llmc.formats.onnx_qdq import float_model, graph_probe_config, weight_pass_seconds
from llmc.planning import probes
from llmc.planning.rows import CostRow
from llmc.planning.machine import file_write_seconds, uncached_read_seconds
from llmc.planning.target import host_work_seconds, per_layer_host_seconds
from llmc.errors import EngineFailed, IncompatibleTargetError
from llmc.telemetry.progress import log
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec, probe_text
from llmc.storage.store import atomic_write_json

GENAI_CONFIG = "genai_config.json"  # onnxruntime-genai's runtime config: what `llmc inspect` recognises
ONNX_OPTIONS = {"accuracy_level": 4}  # what `llmc build` uses (part of the export stage key)
MATMULNBITS_BLOCK_SIZES = (16, 32, 64, 128, 256)
# Nodes the builder would otherwise quantize itself (names are the builder's, stable across models).
UNQUANTIZED_NODES = ("/lm_head/MatMul", "/model/embed_tokens/Gather")
# Initializer suffixes the builder gives weights *it* quantized (never present in an llmc export).
_BUILDER_QUANTIZED_SUFFIXES = ("_Q4", "_Q8")
_BUILDER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(attn|mlp)\.(\w+)\.MatMul\.weight")


def builder_env() -> dict[str, str]:
    """The model builder's environment: it stamps each graph's producer_version with `git rev-parse HEAD` run five
    folders above its own file, which is the enclosing repository's commit wherever the venv lives inside one (a
    project's .venv): the artifact's bytes then changed with every commit of that project. With no repository to
    find it stamps its wheel's own commit."""
    return {**os.environ, "GIT_DIR": os.devnull}


def check_scheme(scheme: Scheme) -> None:
    """Raise IncompatibleTargetError unless the exporter can carry the scheme exactly."""
    if scheme.weights.format != "int4":
        from llmc.formats import onnx_qdq

        onnx_qdq.check_scheme(scheme, target="the ONNX Runtime exporter (8-bit schemes as Q/DQ)")
        return
    check_gptq_scheme(scheme, target="the ONNX Runtime exporter (MatMulNBits)")
    w = scheme.weights
    if w.strategy != "group" or w.group_size not in MATMULNBITS_BLOCK_SIZES:
        got = f"group_size {w.group_size}" if w.strategy == "group" else f"strategy {w.strategy}"
        raise IncompatibleTargetError(
            f"MatMulNBits needs block-wise scales with a block of {'/'.join(map(str, MATMULNBITS_BLOCK_SIZES))}; "
            f"the scheme has {got}",
            fix="use strategy: group with group_size 32, 64 or 128")
    if scheme.kv_cache is not None:
        raise IncompatibleTargetError(
            "onnxruntime-genai keeps the KV cache in the activation dtype; the scheme quantizes it",
            fix="drop kv_cache from the scheme for the onnxruntime target")


def _rotary_error(out: Path, config: dict) -> float | None:
    """Largest |cos_cache - cos(p * theta^(-2i/d))| over the cache, or None when the model's rotary is
    not the default kind (scaled variants are the builder's to compute). Catches a config the builder
    misread (e.g. a rope theta it did not find falls back to 10000)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or theta is None:
        return None
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    init = {i.name: i for i in model.graph.initializer}
    if "cos_cache" not in init:
        return None
    onnx.external_data_helper.load_external_data_for_tensor(init["cos_cache"], str(out))
    cos = numpy_helper.to_array(init["cos_cache"]).astype(np.float64)
    half = cos.shape[1]
    inv = float(theta) ** (-np.arange(0, 2 * half, 2) / (2 * half))
    pos = np.arange(cos.shape[0])[:, None]
    return float(np.abs(cos - np.cos(pos * inv)).max())


def _builder_quantized(out: Path) -> list[str]:
    import onnx

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    return [i.name for i in model.graph.initializer if i.name.endswith(_BUILDER_QUANTIZED_SUFFIXES)]


def builder_weights(graph) -> dict[str, list[str]]:
    """{weight initializer: [module]} in the builder's float graph: its names are stable for the Llama
    family (model.layers.N.attn.qkv_proj.MatMul.weight packs q, k and v)."""
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out = {}
    for t in graph.initializer:
        m = _BUILDER_WEIGHT.fullmatch(t.name)
        if m:
            layer, block, proj = m.groups()
            parent = f"model.layers.{layer}." + ("self_attn" if block == "attn" else "mlp")
            out[t.name] = [f"{parent}.{p}" for p in packed.get(proj, (proj,))]
    return out


def _put_codes_back(qm: QuantizedModel, out: Path) -> dict:
    """Replace the builder's float weights by llmc's codes + DequantizeLinear (and Q/DQ on static
    activations) in place; returns the summary's scheme fields."""
    import onnx

    from llmc.formats.onnx_qdq import insert_qdq, scheme_summary

    model = onnx.load(str(out / "model.onnx"))  # with its external data
    counts = insert_qdq(model, qm, builder_weights(model.graph))
    for f in out.glob("model.onnx*"):
        f.unlink()  # the save below writes a new data file; appending to the old one would keep stale bytes
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    del model  # (onnx.checker does not know the builder's contrib ops; the evaluation loads the graph in ORT)
    return {**scheme_summary(qm.scheme), **counts}


def export_onnx(qm: QuantizedModel, out: Path, *, accuracy_level: int = 4) -> dict:
    """Write the ONNX Runtime / onnxruntime-genai folder for `qm` into `out`; returns the summary."""
    check_scheme(qm.scheme)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    int4 = qm.scheme.weights.format == "int4"
    with tempfile.TemporaryDirectory(prefix=".llmc-onnx-", dir=out.parent) as tmp:
        if int4:  # the builder's GPTQ loader repacks the canonical codes into MatMulNBits unchanged
            source = Path(tmp) / "gptq"
            # the builder's GPTQ loader reads a stored 2^b - 1 as zero 0, the canonical meaning
            # (onnxruntime_genai/models/loaders/gptq.py, handle_qzeros: (z + 1) & mask), so no zero is refused here
            gptq_summary = export_gptq(qm, source, v1_zeros_checked=False)
            options = ["-p", "int4", "--extra_options", "nodes_to_exclude=" + ",".join(UNQUANTIZED_NODES),
                       f"accuracy_level={accuracy_level}"]
            log("export: onnxruntime-genai model builder (int4 MatMulNBits from the canonical codes)")
        else:  # a float graph from the dequantized weights; llmc puts the codes back as Q/DQ below
            source = Path(tmp) / "float"
            float_model(qm).save_pretrained(source)
            copy_tokenizer_files(qm.root, source)
            options = ["-p", "fp32"]
            log("export: onnxruntime-genai model builder (float graph), then Q/DQ from the canonical codes")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out),
               "-e", "cpu", "-c", str(Path(tmp) / "cache"), *options]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=builder_env())
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise EngineFailed(f"onnxruntime-genai's model builder failed (exit {proc.returncode}):\n{tail}",
                               fix="the builder supports the architectures its docs list; "
                                   f"model_type here is {qm.config.get('model_type')!r}")
    qdq = None if int4 else _put_codes_back(qm, out)
    requantized = _builder_quantized(out)
    if requantized:
        raise EngineFailed(f"the ONNX builder quantized weights itself ({', '.join(requantized[:4])}): the "
                           "artifact would not hold llmc's codes", fix="report this as an llmc bug")
    rotary_error = _rotary_error(out, qm.config)
    # float32 angles round by ~p * 2^-24 at position p (5e-4 at 8192); a misread theta is off by O(1)
    if rotary_error is not None and rotary_error > 1e-2:
        raise EngineFailed(f"the ONNX graph's rotary cos cache differs from the model's rope theta by up to "
                           f"{rotary_error:.3g}: the builder misread the config", fix="report this as an llmc bug")
    import onnxruntime
    import onnxruntime_genai

    summary = {
        "runtime": "onnxruntime-genai",
        "written_by": f"llmc {__version__} via onnxruntime_genai.models.builder {onnxruntime_genai.__version__}",
        "onnxruntime": onnxruntime.__version__,
        "execution_provider": "cpu",
        **({"weights": "MatMulNBits int4, block = the scheme's group size, llmc's codes; scales rounded to float16",
            "accuracy_level": accuracy_level,
            "activations": "int8 per block inside MatMulNBits" if accuracy_level == 4 else "float32",
            "max_relative_weight_error_fp16_scales": gptq_summary["max_relative_weight_error_fp16_scales"],
            "unquantized": list(UNQUANTIZED_NODES)} if int4 else qdq),
        "rotary_cache_max_error": rotary_error,
        "run": "python -c \"import onnxruntime_genai as og; m = og.Model('<folder>'); ...\" (onnxruntime-genai), or "
               "onnxruntime.InferenceSession('<folder>/model.onnx')",
    }
    if int4 and not math.isfinite(summary["max_relative_weight_error_fp16_scales"]):
        raise EngineFailed("non-finite weights after converting scales to float16", fix="check the quantized scales")
    atomic_write_json(out / SERVE_FILE, summary)
    json.loads((out / "genai_config.json").read_text())  # the builder wrote a parseable runtime config
    return summary


# The model builder's run costs per traced op and per process, like torch.onnx's export (llmc.formats.onnx_qdq): a
# Python process importing torch, transformers and onnxruntime-genai, then the graph made layer by layer. The plan
# times the builder itself on tiny models of the model's own family (a float checkpoint and a tokenizer, as
# `export_onnx` gives it) at 1 and BUILDER_PROBE_LAYERS layers, and costs the model's depth from the two.
# Both sizes and their repeats run in ONE process per family (`_BuilderProbe`): its start and imports are most of a
# run (47 s of a 48 s run at load 5 on the shared 2-core VM, benchmarks/results/planner-log.md), so four processes
# cost a cold plan minutes under load. Each sample is still what one export pays: that process's start and imports
# once, plus one run of the builder at that size.
BUILDER_PROBE_LAYERS = 3
BUILDER_PROBE_REPEATS = 2  # timed runs per size, all in one process


def _builder_key(config: dict, layers: int) -> str:
    return (f"onnxruntime-genai builder {config.get('model_type')} tied={bool(config.get('tie_word_embeddings'))} "
            f"layers={layers}")


def builder_rate(config: dict, layers: int) -> float:
    """Builder exports/s (one process's start and imports plus one run) on a tiny model of `config`'s family with
    `layers` decoder layers (llmc.planning.probes: timed, cached per machine)."""
    return probes.rate(_builder_key(config, layers), _builder_timer(config, layers), repeats=BUILDER_PROBE_REPEATS)


def builder_seconds(config: dict) -> float:
    """Seconds onnxruntime-genai's model builder takes on the model of `config` (its num_hidden_layers): the probed
    run at 1 layer, plus each further layer at the probed difference (BUILDER_PROBE_LAYERS against 1)."""
    return per_layer_host_seconds(builder_rate, config, BUILDER_PROBE_LAYERS)


def _probe_tokenizer():
    """A word-level tokenizer of the tiny model's vocabulary, with BOS/EOS: what the builder copies beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: a plan with cached rates skips it
    from transformers import PreTrainedTokenizerFast  # lazy: as above

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _write_probe_model(tiny: dict, folder: Path) -> None:
    """The tiny float checkpoint of `tiny` (a config) and its tokenizer, as `export_onnx` hands the builder a model."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: a plan with cached rates skips it
    from transformers.utils import logging as hf_logging

    config = AutoConfig.for_model(**tiny, bos_token_id=1, eos_token_id=2)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # `llmc plan` prints its plan, not the probe's "Writing model shards"
    try:
        with torch.random.fork_rng(devices=[]):  # the build's own random state stays as it was
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _probe_tokenizer().save_pretrained(folder)


# The probe's process: argv[1] is the parent's time.monotonic() at launch (CLOCK_MONOTONIC, one clock for every
# process of the machine), argv[2] the runs as [[layers, input, output, cache], ...]. It imports the builder as
# `python -m onnxruntime_genai.models.builder` does, then runs the builder's command line per run (runpy: the same
# `__main__` code, its imports then cached) and prints one JSON line: start_s (launch to imports done) and each run's
# seconds. The builder's own prints go to stderr.
_BUILDER_PROBE_SCRIPT = """\
import contextlib, json, runpy, shutil, sys, time
launched, runs = float(sys.argv[1]), json.loads(sys.argv[2])
import onnxruntime_genai.models.builder
start_s = time.monotonic() - launched
seconds = []
for layers, source, out, cache in runs:
    sys.argv = ["builder", "-i", source, "-o", out, "-e", "cpu", "-c", cache, "-p", "fp32"]
    t = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
    seconds.append([layers, time.monotonic() - t])
    shutil.rmtree(out, ignore_errors=True)
print(json.dumps({"start_s": start_s, "runs": seconds}))
"""


def builder_probe_seconds(report: dict) -> dict[int, list[float]]:
    """Per size, the seconds one export pays, from the probe process's `report`: its start and imports, plus what
    its first run took beyond that size's later runs (loading what the builder imports lazily: once per process, as
    in an export; 0 when the first run was no slower), plus each later run at that size. The first run is a
    warm-up and gives no sample of its own."""
    runs = [(int(layers), float(s)) for layers, s in report["runs"]]
    (first_layers, first_s), timed = runs[0], runs[1:]
    same = sorted(s for layers, s in timed if layers == first_layers)
    once = float(report["start_s"]) + (max(first_s - same[len(same) // 2], 0.0) if same else 0.0)
    out: dict[int, list[float]] = {}
    for layers, s in timed:
        out.setdefault(layers, []).append(once + s)
    return out


class _BuilderProbe:
    """The builder probe of one family for one rate book: the first size asked for starts one process timing every
    size not yet cached (BUILDER_PROBE_REPEATS runs each, after a 1-layer warm-up); each size's timer then reads its
    samples in turn."""

    def __init__(self, config: dict, book: probes.RateBook) -> None:
        self.config, self.book = config, book
        self.samples: dict[int, list[float]] = {}

    def next_rate(self, layers: int) -> float:
        if not self.samples.get(layers):
            sizes = [n for n in (1, BUILDER_PROBE_LAYERS)
                     if n == layers or not self.book.cached(_builder_key(self.config, n))]
            self.samples.update(self._run(sorted(set(sizes) | {layers})))
        return 1.0 / self.samples[layers].pop(0)

    def _run(self, sizes: list[int]) -> dict[int, list[float]]:
        with tempfile.TemporaryDirectory(prefix="llmc-builder-probe-") as tmp:
            root = Path(tmp)
            for n in sizes:
                _write_probe_model(graph_probe_config(self.config, n), root / f"float-{n}")
            order = [sizes[0]] + [n for _ in range(BUILDER_PROBE_REPEATS) for n in sizes]  # warm-up, then in turn
            runs = [[n, str(root / f"float-{n}"), str(root / "out"), str(root / "cache")] for n in order]
            # HOME: onnxruntime's device id (~/.cache/Microsoft/DeveloperTools) goes into the probe's folder:
            # planning writes nothing of the user's
            proc = subprocess.run([sys.executable, "-c", _BUILDER_PROBE_SCRIPT, repr(time.monotonic()),
                                   json.dumps(runs)], capture_output=True, text=True,
                                  env={**builder_env(), "HOME": str(root)})
        lines = proc.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        except ValueError:
            report = None
        if report is None:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise EngineFailed(f"timing onnxruntime-genai's model builder on a tiny {self.config.get('model_type')} "
                               f"model failed (exit {proc.returncode}):\n{tail}",
                               fix="check the onnxruntime-genai install (`python -m onnxruntime_genai.models.builder "
                                   "--help`)")
        return builder_probe_seconds(report)


_builder_probes: dict[str, _BuilderProbe] = {}


def _builder_timer(config: dict, layers: int):
    """A function returning one sample (exports/s) of the builder at `layers` layers on a tiny model of `config`'s
    family, from the family's one probe process (`_BuilderProbe`, started on the first call: a cached rate starts
    none)."""
    family = _builder_key(config, 0)

    def run_once() -> float:
        found = _builder_probes.get(family)
        if found is None or found.book is not probes.book():  # a new rate book (--reprobe): a new process
            found = _builder_probes[family] = _BuilderProbe(config, probes.book())
        return found.next_rate(layers)

    return run_once


# The int4 export's work per quantized weight, which the builder's runs on tiny models (`builder_seconds`: its start,
# imports and graph, per layer) do not hold: llmc's GPTQ intermediate (`export_gptq`: each Linear repacked a block of
# rows at a time and decoded again to check it, llmc.formats.files.repack_linear, probed as the GPTQ export's own:
# `gptq_format.repack_rate`), its files written and read back by the builder, and the builder's own GPTQ loader, which
# unpacks every weight, dequantizes it, quantizes it again and packs it as MatMulNBits blocks, in torch, one Linear at
# a time (onnxruntime_genai.models.loaders), timed in this process on one Linear of the scheme of
# llmc.formats.files.REPACK_PROBE_SHAPE.


def builder_repack_rate(weights: TensorSpec) -> float:
    """Quantized weight elements/s onnxruntime-genai's GPTQ loader reads and repacks into MatMulNBits blocks (its
    `QuantModel.from_pretrained`, as the builder calls it, on a one-Linear GPTQ checkpoint of REPACK_PROBE_SHAPE that
    llmc's own `to_gptq` wrote; llmc.planning.probes: timed, cached per machine)."""
    out, inp = files.probe_shape(weights)
    return probes.rate(f"onnxruntime-genai gptq loader {probe_text(weights)} elements={out * inp}",
                       _builder_repack_timer(weights))


def _builder_repack_timer(weights: TensorSpec):
    state: dict = {}

    def run_once() -> float:
        from safetensors.torch import save_file  # lazy: a plan with cached rates skips it

        from llmc.formats.gptq_format import gptq_quantization_config, to_gptq

        try:
            from onnxruntime_genai.models.loaders.quant_model import QuantModel
        except ImportError as e:
            raise EngineFailed(f"timing onnxruntime-genai's GPTQ loader: {e}",
                               fix="install onnxruntime-genai (the onnxruntime target's exporter)") from e
        out, inp = files.probe_shape(weights)
        if not state:
            state["dir"] = tempfile.TemporaryDirectory(prefix="llmc-gptq-loader-probe-")
            linear = files.probe_linear(weights)
            g = vars(to_gptq(linear["codes"], linear["scale"], linear["zero"], weights.bits, v1_zeros_checked=False))
            save_file({f"model.layers.0.mlp.down_proj.{k}": v.contiguous() for k, v in g.items()},
                      str(Path(state["dir"].name) / "model.safetensors"))
            config = gptq_quantization_config(Scheme(weights), weights.bits)
            state["attrs"] = {"config": config, "use_g_idx": bool(config.get("desc_act"))}

        def load() -> None:  # the arguments the builder passes (builders/base.py), for a model of one such Linear
            with contextlib.redirect_stdout(io.StringIO()):  # its "Unpacking and repacking layer 0": not the plan's
                QuantModel.from_pretrained("gptq", input_path=state["dir"].name, quant_attrs=state["attrs"],
                                           q_size=inp, kv_size=inp, intermediate_size=out, num_layers=1)

        return probes.sustained_rate(out * inp, load)

    return run_once


def repack_seconds(work: ExportWork) -> float:
    """Seconds of the int4 export's work per quantized weight: `export_gptq`'s repack (the GPTQ export's own term,
    `GptqCheckpoint.repack_seconds`) and the builder's GPTQ loader (`builder_repack_rate`), each at its probed rate;
    0 for a named profile."""
    def loader_seconds() -> float:
        return sum(sum(o * i for o, i in w.linears) / builder_repack_rate(w.weights)
                   for w in work.written if w.linears)

    return GptqCheckpoint().repack_seconds(work) + host_work_seconds(loader_seconds)


def intermediate_seconds(work: ExportWork) -> float:
    """Seconds to write the GPTQ intermediate's files (durable and hashed, as any shard llmc writes) and for the
    builder to read them back (written around the page cache: from the disk)."""
    nbytes = sum(GptqCheckpoint().written_bytes(w) for w in work.written)
    files = max(1, math.ceil(nbytes / MAX_SHARD_BYTES))
    return file_write_seconds(nbytes, files=files) + uncached_read_seconds(nbytes, files=files)


def export_seconds(work: ExportWork) -> float:
    """What `export_onnx` spends beside writing and hashing its files: the builder's run (`builder_seconds`); for an
    int4 scheme the GPTQ-format intermediate written and read (`intermediate_seconds`) and every quantized weight
    repacked twice, by llmc into the intermediate and by the builder's loader into MatMulNBits (`repack_seconds`);
    for an 8-bit scheme the float model it reads (the canonical weights dequantized) and llmc's codes put back into
    its graph (`onnx_qdq.weight_pass_seconds`: the float copy and `insert_qdq` at its probed rate)."""
    seconds = builder_seconds(work.config) if work.config else 0.0
    if work.bits == 4:
        return seconds + intermediate_seconds(work) + repack_seconds(work)
    return seconds + weight_pass_seconds(work)


@register_format
class OnnxGenai(ArtifactFormat):
    name = "onnx"
    libraries = ("onnx", "onnxruntime", "onnxruntime_genai")
    unquantized_elem = 4  # the graph is traced in float32: every unquantized initializer is float32
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = ("llmc maps the onnxruntime-genai builder's packed qkv/gate_up weights back to Llama-family "
                       "modules; other families' graphs are not verified here")
    read_by = ("onnxruntime",)
    layout = ExportLayout(whole_model=True)
    triton_backend = "onnxruntime"
    unevaluated = "not evaluated: add onnxruntime to eval.runtimes"
    proof = ("loaded and scored in onnxruntime 1.32 here (CPU EP; tests in the default run on a tiny model, and "
             "the real model in the integration suite): fp32 compute reproduces the torch reference of the same codes "
             "(INT4: KL ~1e-6, MatMulNBits blocks decode to the canonical weights with fp16 scales; 8-bit Q/DQ: "
             "KL < 1e-6 with ORT's int8 kernel fusion off); onnxruntime-genai's genai_config.json written by its own "
             "builder")

    def check_scheme(self, scheme) -> None:
        check_scheme(scheme)

    def cost(self, label: str, work: ExportWork) -> CostRow:
        """Its files written and hashed (`ArtifactFormat.cost`), and what making them adds (`export_seconds`: the
        model builder's run, the int4 intermediate's repack or the 8-bit codes put back into the graph)."""
        row = super().cost(label, work)
        row.seconds += export_seconds(work)
        return row

    def stage_config(self, request: ExportRequest) -> dict:
        return {"target": target_key(request.target), "options": ONNX_OPTIONS}

    def write(self, request: ExportRequest, out: Path) -> None:
        export_onnx(request.quantized, out, **ONNX_OPTIONS)

    def recognizes(self, path: Path) -> bool:
        return (path / GENAI_CONFIG).is_file()

    def describe(self, path: Path) -> str:
        import onnx  # lazy: onnx is the exporter's optional dependency (ArtifactFormat.libraries)

        cfg = read_json(path / GENAI_CONFIG)["model"]
        dec = cfg["decoder"]
        graph = onnx.load(str(path / dec["filename"]), load_external_data=False).graph
        ops = Counter(n.op_type for n in graph.node)
        blocks = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name in ("bits",)}
        extra = read_json(path / SERVE_FILE) or {}
        return "\n".join([
            f"ONNX Runtime model folder (onnxruntime-genai) at {path} ({cfg.get('type')}, "
            f"{dec['num_hidden_layers']} layers)",
            "  ops: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
            + (f"; MatMulNBits bits {sorted(blocks)}" if blocks else ""),
            f"  {extra.get('weights', 'not written by llmc')}"
            + (f"; accuracy_level {extra['accuracy_level']} ({extra['activations']})" if "accuracy_level" in extra else ""),
            "  accepted by: onnxruntime (CPU EP here; CUDA/DML EPs run MatMulNBits too), onnxruntime-genai "
            f"(og.Model('{path}'))",
        ])
