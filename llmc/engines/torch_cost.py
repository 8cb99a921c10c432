"""The torch reference engine's plan rows (each engine costs itself beside its code; the others' are their modules'
`scoring_cost`): one scoring of the baseline or of an artifact, whole or one decoder layer at a time
(llmc.engines.torch_stream), on the CPU or a GPU, and what the engine quantize-dequantizes per token to emulate an
artifact's runtime."""

from __future__ import annotations

from llmc.engines.agreement import chunk_rows, scoring_rate
from llmc.model.dtype import BYTES
from llmc.planning.machine import (CUDA_CONTEXT_BYTES, PROCESS_BYTES, Machine, forward_seconds, read_seconds,
                                   source_read_seconds)
from llmc.planning.rows import GB, CostRow
from llmc.planning.shapes import Shape, inputs_per_token
from llmc.quant.canonical import module_matches
from llmc.quant.forward_probe import measured_efficiency
from llmc.quant.groups import by_group
from llmc.quant.numerics import BLOCK_ELEMENTS, fake_quantize_rate
from llmc.quant.spec import Scheme, TensorSpec

# weight elements/s compressed-tensors' decompressor turns codes into float32 (the torch engine reads an artifact
# through it, streamed or whole): docs/planner-constants.md#decompress_rate
DECOMPRESS_RATE = 0.145e9


def emulated_elements(scheme: Scheme, linears: dict[str, tuple[int, int]], config: dict
                      ) -> tuple[tuple[TensorSpec, float], ...]:
    """What the torch engine quantize-dequantizes per scored token to emulate `scheme`'s runtime
    (llmc.engines.torch_ref): every quantized Linear's input where its scheme quantizes activations (each Linear its
    own, q/k/v the same input three times), and each layer's keys and values where the KV cache is quantized; as
    (spec, elements per token over the whole model). A token runs through its top-k experts only."""
    layers = {n: s for n, s in linears.items() if not module_matches(n, scheme.ignore)}
    by_spec: dict[TensorSpec, float] = {}
    if scheme.mixed:
        members = scheme.members()
        sets = [(members[g].activations, shapes) for g, shapes in
                by_group(scheme, layers, config.get("num_hidden_layers", 0), config.get("model_type")).items()
                if g in members]
    else:
        sets = [(scheme.activations, layers)]
    for spec, shapes in sets:
        if spec is not None:
            by_spec[spec] = by_spec.get(spec, 0.0) + inputs_per_token(shapes, config)
    if scheme.kv_cache is not None:
        heads = config.get("num_attention_heads", 1)
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(heads, 1)
        kv = 2 * config.get("num_key_value_heads", heads) * head_dim * config.get("num_hidden_layers", 1)
        by_spec[scheme.kv_cache] = by_spec.get(scheme.kv_cache, 0.0) + kv
    return tuple(by_spec.items())


def eval_cost(shape: Shape, *, label: str, compute: str, windows: int, seq_len: int, batch: int, streamed: bool,
              reference: bool, artifact_code_bytes: float, top_k: int, throughput_tokens: int,
              machine: Machine, stored_elem: int | None = None, quantized_params: int = 0,
              device: str = "cpu", emulated: tuple[tuple[TensorSpec, float], ...] = ()) -> CostRow:
    """One torch-reference evaluation (the baseline, reference=False, or an artifact scored against the baseline's
    reference, reference=True), whole or one layer at a time, on `device` (eval.device). host_bytes is what the
    process allocates (RssAnon); weights transformers or safetensors leave mapped from their files are
    `mapped_bytes`. On a GPU the model (or its one layer), the windows' hidden states, the forward's temporaries and
    the logits live there (`gpu_bytes`); the host still reads and decompresses the weights. `emulated`: what the
    engine quantize-dequantizes per token to emulate the artifact's runtime (`emulated_elements`), timed at
    `fake_quantize`'s probed rate."""
    e = BYTES[compute]
    stored_elem = stored_elem or e
    h, tokens = shape.hidden, windows * seq_len
    batch = max(1, min(batch, windows))  # fewer windows than a batch: one batch of them, not of eval.batch_size
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
    # the decoder layers at the share of the matmul rate a layer of these widths was measured to reach on this CPU
    # (llmc.quant.forward_probe; the constant's where none was), the output head at the constant's
    forward = forward_seconds(2 * scored * shape.layer_params * shape.active * shape.layers,
                              2 * tokens * seq_len * shape.attn_width * shape.layers,  # causal, over each window
                              compute=compute, device=device, width=h, rows=batch * seq_len,
                              efficiency=measured_efficiency(shape, batch=batch, seq_len=seq_len, compute=compute,
                                                             device=device, observed=False))
    forward += forward_seconds(2 * scored * shape.vocab * h, 0, compute=compute, device=device, width=h,
                               rows=batch * seq_len)
    # the runtime's activation and KV-cache quantization, emulated in the compute dtype on every scored token (at
    # SmolLM2's widths static FP8 doubled the scoring time: benchmarks/results/planner-log.md "Accuracy under load")
    forward += sum(scored * elements / fake_quantize_rate(spec, compute, width=h, rows=batch * seq_len, device=device)
                   for spec, elements in emulated)
    # scoring the logits (llmc.engines.agreement.score_logits, probed): an artifact's exact KL also recomputes the
    # baseline's logits from its head input, one more output-head matmul per scored token
    forward += tokens * shape.vocab / scoring_rate(shape.vocab, top_k, reference, device)
    if reference:
        forward += forward_seconds(2 * tokens * shape.vocab * h, 0, compute=compute, device=device, width=h,
                                   rows=chunk_rows(shape.vocab))
    else:  # the baseline's head capture checks on its first batch that h · Wᵀ reproduces the model's logits
        # (llmc.engines.agreement.HeadCapture._verify): one more output-head GEMM over one batch
        forward += forward_seconds(2 * batch * seq_len * shape.vocab * h, 0, compute=compute, device=device,
                                   width=h, rows=chunk_rows(shape.vocab))
    # reading the weights (the baseline's are the source's, which the page cache may hold; an artifact's files were
    # written around it), and an artifact's decompression (streamed or whole, through compressed-tensors)
    # the baseline converted to the compute dtype in one pass over the mapped source where stored in another
    read = (read_seconds(shape.stored_bytes) if reference else
            source_read_seconds(shape.stored_bytes, machine, shape.params * e if stored_elem != e else 0.0))
    io = read + (quantized_params / DECOMPRESS_RATE if artifact_code_bytes else 0.0)
    dense = shape.params * e
    strategy = "streamed (one layer resident)" if streamed else "whole model"
    why = (f"the dense model takes {dense / GB:.1f} GB, {'more' if streamed else 'less'} than half of the "
           f"{(machine.available or 0) / GB:.1f} GB available")
    if machine.available and streamed != (dense > 0.5 * machine.available):  # not auto's choice: set by the user
        why = (f"LLMC_TORCH_EVAL chose it (the dense model takes {dense / GB:.1f} GB of the "
               f"{machine.available / GB:.1f} GB available)")
    gpu = 0.0
    if device != "cpu":
        on_gpu = ("logits", "hidden states of every window", "forward temporaries")
        model = parts.get("layer", shape.layer_params * e) if streamed else shape.params * e
        gpu = CUDA_CONTEXT_BYTES + model + (shape.outer_params * e if streamed else 0.0) + sum(
            parts.get(k, 0.0) for k in on_gpu)
        for k in on_gpu:
            parts.pop(k, None)
    return CostRow(f"eval {label}", device, sum(parts.values()), gpu, 0.0, forward + io, strategy, why, parts,
                   mapped_bytes=mapped)
