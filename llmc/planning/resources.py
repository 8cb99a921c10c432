"""What each stage of a build costs, per device, before any weight loads: peak host RAM, peak GPU memory, disk
and time, and the strategy chosen for each (activations in memory or spilled, evaluation whole or streamed).

Pure functions of the model's tensor shapes (llmc.planning.shapes), the recipe and the machine (`Machine`). The
formulas follow what the code holds at its peak, named term by term in `Stage.parts`:
  - quantize (llmc.quant.stream): the process, everything outside the decoder layers while calibrating (the
    skeleton holds embeddings and head), one decoder layer in the compute dtype (+ its stored-dtype copy while it
    is read when the two differ), the quantizer's float32 temporaries (one block of rows for RTN, the largest
    Linear for GPTQ and the smoothing transforms), the layer's codes,
    the activations passed between layers (two copies, or one batch in and out when spilled), one batch's
    forward temporaries, and the algorithm's state (GPTQ: float32 Hessians + the float64 factorization of the
    widest; AWQ: every module's calibration inputs); algorithms that rescale smoothing pairs first find them on the
    first layer in float64 (the layer + a candidate pair's rescaled consumers), a peak of its own;
  - evaluation (torch reference): the whole dense model, or (streamed, llmc.engines.torch_stream) the outer
    weights, one dense layer (an artifact's: + its codes and the float32 decompression of one block of rows, or of
    one Linear for packed int4), the hidden states of every window and one batch's logits; the baseline's output
    head an artifact is scored with is mapped;
  - disk: each file once (targets with identical weights share them through hard links), only what is not cached.
Time = floating-point work / this machine's measured matmul rate in the compute dtype at the model's width
(`matmul_rate`: a small probe at plan time; a CPU without bf16 instructions runs bf16 GEMMs several times slower
than fp32) x the share a decoder layer reaches (`forward_efficiency`), plus the quantizer's arithmetic at its probed
rate (`quantize_rate`), plus reading and writing the bytes. Constants measured at full width are in
docs/planner.md ("Planner at full width").
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field

import torch

from llmc.pipeline.ids import StageId
from llmc.planning.shapes import ModelTensors, active_fraction
from llmc.quant.numerics import BLOCK_ELEMENTS

GB = 1e9
PROCESS_BYTES = 0.45e9  # python + torch + transformers + tokenizers imported: RssAnon of a build while it exports
# FP8 (which allocates nothing else), 0.39-0.52 GB measured at 8B and 70B width
# llmc.formats.files.REPACK_BLOCK_ELEMENTS (2^20) x ~10 int32 / float32 temporaries of the packing and its check
REPACK_BLOCK_BYTES = 40e6
CUDA_CONTEXT_BYTES = 0.6e9
DISK_READ_RATE = 1.0e9  # bytes/s a layer is read + converted (page-cache-warm safetensors reads measured ~1-2 GB/s)
DISK_WRITE_RATE = 0.3e9  # bytes/s safetensors serializes and fsyncs (canonical form, artifacts): 0.27-0.30 measured in
# 70B-width builds on this VM (a layer's 0.86 GB of codes in 2.85 s, the 4.2 GB outer weights in 15.6 s)
# weight elements/s compressed-tensors' decompressor turns codes into float32 (the torch engine reads an artifact
# through it, streamed or whole): 0.145 G/s measured for FP8 on the 2-core EPYC, per call of 1M to 8M elements
DECOMPRESS_RATE = 0.145e9
# Quantized weight elements per second the GPTQ / AWQ layouts repack and check (int16 codes -> int32 words, then the
# float32 decode against the canonical weight): 13-16 ns per element at 70B width on this VM, in a process holding
# 0-6 GB (benchmarks/repack_export.py; 32 s for one 70B-width layer's export, 18.5 s of it writing and hashing).
REPACK_RATE = 0.07e9
# float64 bytes of a decoder layer per second that smoothing-pair discovery gets through (llmc.quant.stream.
# LayerStructure: the layer converted to float64 and back, one probe forward per candidate pair, each candidate's
# rescaled weights): an 8B-width layer (1.75 GB in float64) took 13.6 s inside a build on the 2-core EPYC, 4.6 s in
# a process holding nothing else (fresh pages fault in slower the more the process holds, as for the quantizer)
DISCOVERY_RATE = 0.13e9
# AWQ fake-quantizes candidate weights ((q(w * s) / s) in float32, cast back): that costs this many times the
# quantizer probe's time per element (0.045 G elements/s against a 0.167 probe, int4 groups at 8B width)
FAKE_QUANT_COST = 3.7
HASH_RATE = 1.5e9  # bytes/s sha256 (hashlib) reads back what a stage wrote (measured 1.56 GB/s on the 2-core EPYC)
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Machine:
    available: int | None  # host bytes available (MemAvailable)
    gpu_free: int | None  # bytes free on the calibration GPU (None: calibrating on the CPU)
    device: str  # "cpu" | "cuda:0"
    cpu_count: int | None = None


@dataclass
class Stage:
    """One stage's cost on one device."""

    name: str
    device: str
    host_bytes: float
    gpu_bytes: float = 0.0
    disk_bytes: float = 0.0  # new bytes this stage leaves in the cache
    seconds: float = 0.0
    strategy: str = ""
    why: str = ""
    # host_bytes term by term (tests, docs); a quantize stage's host_bytes is the largest of these terms' sum and its
    # one-off peaks (writing the weights outside the layers, the first layer's pair discovery, named in `why`)
    parts: dict[str, float] = field(default_factory=dict)
    # File pages the stage keeps mapped (safetensors are read through mmap): page cache, not the process's own
    # memory (RssFile, not RssAnon); the kernel can drop them, at the price of reading them again.
    mapped_bytes: float = 0.0
    layer_seconds: float = 0.0  # the quantize stage: one decoder layer (read, forward, quantize, write) ...
    fixed_seconds: float = 0.0  # ... and what runs once (the weights outside the layers, their copy in the output)

    id: StageId | None = None  # the stage (or the part of it) this row costs

    def named(self, id: StageId) -> Stage:
        """This row, as the stage `id`."""
        self.id, self.name = id, str(id)
        return self

    def as_dict(self) -> dict:
        return {"stage": self.name, "device": self.device, "host_gb": self.host_bytes / GB,
                "gpu_gb": self.gpu_bytes / GB, "disk_gb": self.disk_bytes / GB, "seconds": self.seconds,
                "strategy": self.strategy, "why": self.why, "mapped_gb": self.mapped_bytes / GB,
                "layer_seconds": self.layer_seconds, "fixed_seconds": self.fixed_seconds}


def matmul_rate(dtype_name: str, device: str = "cpu", width: int = 1024, rows: int = 64) -> float:
    """FLOP/s of a [rows, width] x [width, 128] matmul in `dtype_name` on `device`, measured now (best of 3 after a
    warm-up). `width` is the model's hidden size and `rows` the tokens of one forward (capped at 512): a CPU's
    float32 rate moves ~2x with the rows (memory-bound at few), bf16 without bf16 instructions hardly at all
    (benchmarks/forward_efficiency.py)."""
    return _matmul_rate(dtype_name, device, width, max(1, min(rows, 512)))


@functools.cache
def _matmul_rate(dtype_name: str, device: str, width: int, rows: int) -> float:
    dtype = getattr(torch, dtype_name)
    dev = torch.device(device)
    a = torch.randn(rows, width, dtype=dtype, device=dev)
    w = torch.randn(128, width, dtype=dtype, device=dev)
    torch.nn.functional.linear(a, w)  # warm-up
    best = float("inf")
    for _ in range(3):  # best of 3: a slow phase of the machine (seen: half the rate for ~0.1 s) passes
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        torch.nn.functional.linear(a, w)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * rows * width * 128 / max(best, 1e-9)


def forward_efficiency(dtype_name: str, device: str) -> float:
    """Share of the probed rates (`forward_seconds`) a decoder layer's forward reaches. Measured by
    benchmarks/forward_efficiency.py on the 2-core AVX2 CPU, one Llama layer at SmolLM2, 8B and 70B width over
    32-2048 tokens (benchmarks/results/forward_efficiency.jsonl): with 1.0 for bf16 the prediction is 0.85-1.22x
    the measured time; float32 reaches less of its probe (its weights stream from memory at few tokens where the
    probe's stay in cache): with 0.75, 0.48-1.34x, on runs of a few milliseconds that move 2x between runs. GPUs:
    not measured (an older constant, 0.6)."""
    if device != "cpu":
        return 0.6
    return 0.75 if dtype_name == "float32" else 1.0


def forward_seconds(gemm_flops: float, attention_flops: float, *, compute: str, device: str, width: int,
                    rows: int) -> float:
    """Seconds of a forward's GEMMs (at the compute dtype's probed rate) and causal attention. On a CPU, attention
    runs at the float32 rate whatever the dtype: PyTorch's CPU attention kernel computes its blocks in float32
    (measured: a bf16 SmolLM2-width layer at 2048 tokens, where attention is a quarter of the FLOPs, ran no slower
    than its GEMMs alone at the bf16 rate)."""
    attention_dtype = "float32" if device == "cpu" else compute
    seconds = gemm_flops / matmul_rate(compute, device, width, rows)
    if attention_flops:
        seconds += attention_flops / matmul_rate(attention_dtype, device, width, rows)
    return seconds / forward_efficiency(compute, device)


# The quantizer works on blocks of rows (llmc.quant.numerics.BLOCK_ELEMENTS) with float32 temporaries reused from
# the heap; the probe's weight spans several blocks, so it runs the same path as a large Linear does.
QUANTIZE_PROBE_ELEMENTS = 3072 * 4096  # float32 copy: 50 MB


@functools.cache
def quantize_rate(dtype_name: str, weight_format: str = "fp8_e4m3", strategy: str = "tensor",
                  group_size: int | None = None, elements: int = QUANTIZE_PROBE_ELEMENTS) -> float:
    """Weight elements/s llmc's round-to-nearest quantizer (llmc.quant.numerics.quantize_weight: range, scale,
    divide in float32, round, cast) processes, measured now on a weight of `elements` (the model's largest Linear,
    capped at 3072 x 4096) in `dtype_name`: the per-Linear arithmetic every algorithm ends with. Memory-bound
    (float32 temporaries of each block of rows), so it follows neither the matmul rate nor a cache-resident
    probe."""
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import TensorSpec

    spec = TensorSpec(weight_format, strategy, **({"group_size": group_size} if group_size else {}))
    dtype = getattr(torch, dtype_name)
    # columns a multiple of 256 and of the group size (any the recipe validator accepts: 48 divides SmolLM2's 576)
    step = math.lcm(256, group_size or 1)
    quantize_weight(torch.randn(256, step).to(dtype), spec)  # warm-up: first-call dispatch
    elements = min(elements, QUANTIZE_PROBE_ELEMENTS)
    columns = max(step, min(4096, int(elements ** 0.5)) // step * step)
    w = torch.empty(max(1, elements // columns), columns, dtype=dtype).uniform_(-1, 1)
    best = float("inf")
    for _ in range(2):  # best of 2: a loaded machine slows some runs
        t = time.perf_counter()
        quantize_weight(w, spec)
        best = min(best, time.perf_counter() - t)
    return w.numel() / max(best, 1e-9)


def layer_seconds(layer_params: int, *, stored_bytes: float, tokens: int, passes: float, active: float,
                  compute: str, code_bytes: float, device: str, width: int, seq_len: int = 0, attn_width: int = 0,
                  batch_tokens: int = 64, largest_linear: int = QUANTIZE_PROBE_ELEMENTS,
                  weight_key: tuple = ("fp8_e4m3", "tensor", None)) -> dict[str, float]:
    """One decoder layer of the quantize stage, part by part: read it (`stored_bytes`), the calibration forward
    passes over `tokens` in sequences of `seq_len` (GEMMs + causal attention at the matmul rate probed at the
    model's `width`), the quantizer's arithmetic (the probed quantize rate) and writing its codes with fsync.
    benchmarks/layer_time.py measures the same parts at full width."""
    forward = forward_seconds(2 * tokens * layer_params * active, 2 * tokens * seq_len * attn_width,
                              compute=compute, device=device, width=width, rows=batch_tokens)
    return {"read": stored_bytes / DISK_READ_RATE, "forward": passes * forward,
            "quantize": layer_params / quantize_rate(compute, *weight_key, elements=largest_linear),
            "write": layer_params * code_bytes / DISK_WRITE_RATE}


@dataclass
class Shape:
    """The sizes the formulas use, from the tensors and config."""

    params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    layer_params: int  # the largest decoder layer
    outer_params: int
    largest_linear: int  # elements of the largest quantized Linear weight
    widest_input: int  # the largest Linear input width (GPTQ's Hessian side)
    intermediate: int
    attn_width: int
    active: float  # share of a layer's parameters one token runs through (MoE < 1)
    stored_bytes: int

    @classmethod
    def of(cls, tensors: ModelTensors, config: dict, elem: int) -> Shape:
        per_layer = tensors.layer_params()
        linears = tensors.linear_shapes()
        in_layers = {n: s for n, s in linears.items() if f"{n}.weight" in tensors.layer_of}
        h = config.get("hidden_size", 0)
        heads = config.get("num_attention_heads", 1)
        inter = config.get("moe_intermediate_size") if config.get("num_experts") else config.get("intermediate_size")
        fraction = active_fraction(config)
        largest = max(per_layer.values()) if per_layer else 0
        experts = sum(tensors.numel(s) for n, s in in_layers.items() if ".experts." in n) / max(len(per_layer), 1)
        active = (largest - experts * (1 - fraction)) / largest if largest else 1.0
        return cls(params=tensors.params, layers=config.get("num_hidden_layers", 1), hidden=h, heads=heads,
                   vocab=config.get("vocab_size", 0), layer_params=largest, outer_params=tensors.outer_params,
                   largest_linear=max((a * b for a, b in in_layers.values()), default=0),
                   widest_input=max((b for _, b in in_layers.values()), default=h),
                   intermediate=inter or 4 * h, attn_width=heads * (config.get("head_dim") or h // max(heads, 1)),
                   active=active, stored_bytes=tensors.stored_total(elem))


def quantize_stage(shape: Shape, *, compute: str, stored_elem: int, calibrated: bool, tokens: int, seq_len: int,
                   batch: int, spill: bool, hessians: bool, replays_module_calls: bool, passes: int, code_bytes: float,
                   machine: Machine, weight_key: tuple = ("fp8_e4m3", "tensor", None),
                   whole_weight_copies: bool = True, discovers_pairs: bool = False,
                   search: tuple[int, int, int] | None = None) -> Stage:
    """Calibration + quantization of one scheme (llmc.quant.stream), on the CPU or one GPU. `discovers_pairs`: the
    algorithm rescales smoothing pairs (SmoothQuant, AWQ, GPTQ's true-sequential order), found on the first layer
    in float64 before it is calibrated. `hessians`: the quantizer observes every input's Hessian (GPTQ);
    `replays_module_calls`: a step keeps each module's calibration inputs (AWQ); `search`: a step's candidate scales
    per mapping, clipping ranges per Linear and clip-search tokens (`AlgorithmOptions.search_cost`: AWQ's)."""
    e = ELEM[compute]
    h, layer = shape.hidden, shape.layer_params
    on_gpu = machine.device != "cpu"
    copy = tokens * h * e  # one copy of the activations passed between layers
    act = (2 * batch * seq_len * h * e if spill else 2 * copy) if calibrated else 0
    forward = batch * seq_len * (4 * h + 3 * shape.intermediate) * e + batch * shape.heads * seq_len ** 2 * e
    algorithm = 0.0
    if hessians:  # float32 Hessians of the distinct inputs + the float64 inverse factor of the widest
        algorithm += 4 * (2 * h * h + shape.attn_width ** 2 + shape.widest_input ** 2) + 16 * shape.widest_input ** 2
    if replays_module_calls:  # every module's calibration inputs, kept for the grid search
        algorithm += tokens * (2 * h + shape.attn_width + shape.intermediate) * e
    if search:  # the down projection's search through its inputs' float32 Gram matrix, and its ΔW, ΔW·G
        algorithm += 4 * shape.intermediate ** 2 + 2 * 4 * shape.largest_linear
    parts = {
        "process": PROCESS_BYTES,
        "outer weights": shape.outer_params * e if calibrated else 0.0,
        "layer": layer * (e + (stored_elem if stored_elem != e else 0)),
        # RTN works a block of rows at a time; GPTQ and the smoothing transforms (SmoothQuant, AWQ) make float32
        # copies of a whole Linear
        "quantizer float32 copy": 2 * 4 * (shape.largest_linear if whole_weight_copies
                                           else min(shape.largest_linear, BLOCK_ELEMENTS)),
        "layer codes": layer * code_bytes,
        "activations": act,
        "forward temporaries": forward if calibrated else 0.0,
        "algorithm state": algorithm,
    }
    gpu = 0.0
    if on_gpu:  # the layer, its float32 copies, one batch and the algorithm state live on the GPU
        gpu = (CUDA_CONTEXT_BYTES + layer * e + parts["quantizer float32 copy"] + 2 * batch * seq_len * h * e
               + parts["forward temporaries"] + algorithm)
        for k in ("quantizer float32 copy", "forward temporaries", "algorithm state"):
            parts[k] = 0.0
    parts["layer file being written"] = layer * code_bytes  # safetensors serializes the layer's tensors in memory
    # the last step reads everything outside the layers again (rest.safetensors) and writes it, the skeleton's copy
    # released first: one copy (70B width, RTN int4: 5.41 GB measured; two while the stream still named the
    # calibration's copy: 9.62 GB for FP8)
    host = max(sum(parts.values()), PROCESS_BYTES + shape.outer_params * e)
    discovery = discovery_s = 0.0
    if discovers_pairs and calibrated:
        # the first layer in float64 (its own dtype released) and, while a candidate pair is checked, its rescaled
        # consumers beside the originals: gate and up (two of the largest Linears), or for MoE every expert's gate
        # and up (about two thirds of the layer)
        pair = max(2 * shape.largest_linear, 2 / 3 * layer if shape.active < 1 else 0.0)
        discovery = 8 * (layer + pair)
        discovery_s = 8 * layer / DISCOVERY_RATE  # measured on the CPU: on a GPU, an upper bound
        if on_gpu:  # the layer is on the GPU when it is traced
            gpu = max(gpu, CUDA_CONTEXT_BYTES + discovery + parts["activations"])
        else:
            host = max(host, PROCESS_BYTES + parts["outer weights"] + parts["activations"] + discovery)
    # time: each layer's parts (llmc.quant.stream's loop) times the depth, plus reading the weights outside the
    # layers and writing their copy (rest.safetensors) once
    parts_s = layer_seconds(layer, stored_bytes=layer * stored_elem, tokens=tokens if calibrated else 0,
                            passes=passes, active=shape.active, compute=compute, code_bytes=code_bytes,
                            device=machine.device, width=h, seq_len=seq_len, attn_width=shape.attn_width,
                            batch_tokens=batch * seq_len, largest_linear=shape.largest_linear, weight_key=weight_key)
    per_layer = sum(parts_s.values())
    if hessians:  # the column loop in float32: about in² · out per Linear
        fp32_rate = matmul_rate("float32", machine.device, shape.widest_input, 128)
        per_layer += 2 * shape.widest_input * shape.largest_linear * 4 / (
            fp32_rate * forward_efficiency("float32", machine.device))
    if search:
        # Each mapping's candidate scales fake-quantize its consumers (every Linear but o_proj, about); a lone Linear
        # (up -> down) is scored through its Gram matrix, out x in² per candidate; the clip search fake-quantizes
        # every Linear but q and k once per clipping range. Measured at 8B width: one candidate of down 16.8 s, its
        # clip search 17 s (32 tokens), the layer 229 s where RTN's takes 2 (docs/planner.md)
        evaluations, clip_iterations, clip_tokens = search
        searched = layer - h * shape.attn_width
        down = (layer - 2 * h * shape.attn_width) / 3  # a third of the layer less q and o: the MLP's down
        fake_rate = quantize_rate(compute, *weight_key, elements=shape.largest_linear) / FAKE_QUANT_COST
        fp32_rate = matmul_rate("float32", machine.device, shape.intermediate, 128)
        per_layer += evaluations * (searched / fake_rate + 2 * down * shape.intermediate / fp32_rate)
        per_layer += clip_iterations * (searched / fake_rate + 2 * min(tokens, clip_tokens) * searched / fp32_rate)
    # ... and every file of the canonical form is hashed once when the stage completes (llmc.storage.store.record_files)
    canonical = shape.layers * layer * code_bytes + shape.outer_params * e
    fixed = (shape.outer_params * (stored_elem / DISK_READ_RATE + e / DISK_WRITE_RATE) + canonical / HASH_RATE
             + discovery_s)
    strategy = ("activations spilled to disk" if spill else "activations in memory") if calibrated else "no calibration"
    why = (f"two copies of the calibration activations take {2 * copy / GB:.2f} GB, "
           f"{'more' if spill else 'less'} than a quarter of the {(machine.available or 0) / GB:.1f} GB available"
           if calibrated else "weights only: no forward pass")
    if discovery:
        why += (f"; the first layer's smoothing pairs are found in float64 ({discovery / GB:.1f} GB on the "
                f"{'GPU' if on_gpu else 'host'}, ~{discovery_s:.0f} s)")
    return Stage("quantize", machine.device, host, gpu, 0.0, per_layer * shape.layers + fixed, strategy, why, parts,
                 mapped_bytes=layer * stored_elem, layer_seconds=per_layer, fixed_seconds=fixed)


def eval_stage(shape: Shape, *, label: str, compute: str, windows: int, seq_len: int, batch: int, streamed: bool,
               reference: bool, artifact_code_bytes: float, top_k: int, throughput_tokens: int,
               machine: Machine, stored_elem: int | None = None, quantized_params: int = 0) -> Stage:
    """One torch-reference evaluation (the baseline, reference=False, or an artifact scored against the baseline's
    reference, reference=True), whole or one layer at a time, on the host. host_bytes is what the process
    allocates (RssAnon); weights transformers or safetensors leave mapped from their files are `mapped_bytes`."""
    e = ELEM[compute]
    stored_elem = stored_elem or e
    h, tokens = shape.hidden, windows * seq_len
    logits = 3 * batch * seq_len * shape.vocab * 4  # float32 logits, log-softmax / top-k temporaries
    scores = tokens * (top_k * 8 + h * 4)  # the baseline's top-k and output-head inputs (or the reference's)
    # an artifact reads the baseline's output head for the exact KL (llmc.engines.agreement) through mmap: file
    # pages, like the baseline's own head weight it stores (no copy)
    head = shape.vocab * h * e if reference else 0.0
    parts = {"process": PROCESS_BYTES, "logits": logits, "scores and reference": scores}
    forward = batch * seq_len * (4 * h + 3 * shape.intermediate) * e
    mapped = head
    if streamed:  # the outer weights and each layer are copied out of the files (materialized), then dropped
        parts |= {"outer weights": shape.outer_params * e,
                  # an artifact's layer: its codes (copied out of the file) and the dense layer decompressed
                  # module by module through float32: a block of rows at a time for 8-bit codes, the whole Linear
                  # for packed int4 (llmc.engines.torch_stream.LayerDecoder)
                  "layer": shape.layer_params * (e + artifact_code_bytes)
                  + (4 * (min(shape.largest_linear, BLOCK_ELEMENTS) if artifact_code_bytes >= 1
                          else shape.largest_linear) if artifact_code_bytes else 0),
                  "hidden states of every window": tokens * h * e,
                  "forward temporaries": forward}
        mapped += shape.layer_params * stored_elem
    else:
        # transformers maps the safetensors: tensors already in the compute dtype stay file pages (the baseline's
        # whole model when the checkpoint is stored in it); what it converts or decompresses is allocated (an
        # artifact's quantized Linears, decompressed to the compute dtype, plus one layer's codes while it does)
        converted = shape.params if stored_elem != e else (quantized_params if artifact_code_bytes else 0)
        parts |= {"model (converted or decompressed)": converted * e
                  + shape.layer_params * artifact_code_bytes,
                  "forward temporaries": forward}
        mapped += (shape.params - converted) * stored_elem
    scored = tokens + (0 if streamed else throughput_tokens)
    forward = forward_seconds(2 * scored * (shape.layer_params * shape.active * shape.layers + shape.vocab * h),
                              2 * tokens * seq_len * shape.attn_width * shape.layers,  # causal, over each window
                              compute=compute, device="cpu", width=h, rows=batch * seq_len)
    # reading the weights, and an artifact's decompression (streamed or whole, through compressed-tensors)
    io = shape.stored_bytes / DISK_READ_RATE + (quantized_params / DECOMPRESS_RATE if artifact_code_bytes else 0.0)
    dense = shape.params * e
    strategy = "streamed (one layer resident)" if streamed else "whole model"
    why = (f"the dense model takes {dense / GB:.1f} GB, {'more' if streamed else 'less'} than half of the "
           f"{(machine.available or 0) / GB:.1f} GB available")
    if machine.available and streamed != (dense > 0.5 * machine.available):  # not auto's choice: set by the user
        why = (f"LLMC_TORCH_EVAL chose it (the dense model takes {dense / GB:.1f} GB of the "
               f"{machine.available / GB:.1f} GB available)")
    return Stage(f"eval {label}", "cpu", sum(parts.values()), 0.0, 0.0,
                 forward + io, strategy, why, parts,
                 mapped_bytes=mapped)


def export_stage(shape: Shape, *, label: str, artifact_bytes: float, whole_model: bool, shared_with: str | None,
                 compute: str, machine: Machine, passes_codes_through: bool = False,
                 max_shard_bytes: float = 2 << 30, new_bytes: float | None = None,
                 repacked_bytes: float | None = None, bits: int = 4) -> Stage:
    """One export. Streaming exporters read the quantized form through mmap and write one shard at a time
    (llmc.formats.files.write_shards): what they pass through unchanged stays file pages (`mapped_bytes`: one
    shard), what they create is allocated. `passes_codes_through`: 8-bit codes written as stored (FP8/INT8 in
    compressed-tensors or ModelOpt): measured at 70B width, 0.52 GB RssAnon, the process alone. `repacked_bytes`:
    the layers' weights in the GPTQ / AWQ layouts (llmc.formats.files.write_repacked_checkpoint, a block of rows at
    a time): one shard of them, and the largest Linear's packed blocks joined (measured at 70B width, one layer:
    0.75-1.15 GB). Otherwise (compressed-tensors and TensorRT-LLM int4 packing) one shard of new tensors and one
    layer's codes (over-predicted: 2.6 and 1.5 GB measured at 70B width, 3.45 planned).
    Whole-model exporters (ONNX) hold the float32 model three times (weights, the graph's copy, the codes)."""
    e = ELEM[compute]
    mapped = 0.0
    # the largest shard: write_shards never splits one canonical file, and the weights outside the layers are one
    # (4.2 GB at 70B width: 4.38 GB of RssFile measured while it was written)
    shard = min(artifact_bytes, max(max_shard_bytes, shape.outer_params * e))
    if whole_model:
        host = PROCESS_BYTES + 3 * shape.params * 4
    elif passes_codes_through:
        host = PROCESS_BYTES
        mapped = shard
    elif repacked_bytes is not None:
        # the codes' bits, twice (the blocks and their concatenation), and one block's int32 / float32 temporaries
        largest_packed = shape.largest_linear * bits / 8
        host = PROCESS_BYTES + min(repacked_bytes, max_shard_bytes) + 2 * largest_packed + REPACK_BLOCK_BYTES
        mapped = shard + shape.layer_params * 1.0
    else:
        host = PROCESS_BYTES + min(artifact_bytes, max_shard_bytes) + shape.layer_params * 1.0
        mapped = shard + shape.layer_params * e
    new_bytes = artifact_bytes if new_bytes is None else new_bytes  # less what identical files already hold
    disk = 0.0 if shared_with else new_bytes
    why = (f"same weight files as {shared_with} (hard links)" if shared_with else
           "its own files" if new_bytes >= artifact_bytes else
           f"its own files, but for {(artifact_bytes - new_bytes) / GB:.2f} GB of shards identical to an earlier "
           "export's (hard links)")
    # serialize and fsync the artifact from the mapped canonical form, then hash it (the store's record); measured on
    # a quiet machine: 7.1-10.6 s for 2.32-2.98 GB at 8B width, 17-34 s for 5.1-7.6 GB at 70B width (was 25 MB/s)
    seconds = artifact_bytes * (1 / DISK_WRITE_RATE + 1 / HASH_RATE)
    if repacked_bytes is not None:
        seconds += repacked_bytes * 8 / bits / REPACK_RATE
    return Stage(f"export {label}", "cpu", host, 0.0, disk, seconds,
                 "whole model in memory" if whole_model else "one shard at a time", why, mapped_bytes=mapped)


def cpu_count() -> int | None:
    return os.cpu_count()
