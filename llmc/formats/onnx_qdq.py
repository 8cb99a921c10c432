"""Export a scheme as a standard-op ONNX graph with Q/DQ nodes: the graph TensorRT builds engines from
(the `tensorrt` target; onnxruntime scores it here). `insert_qdq` also puts 8-bit codes into
onnxruntime-genai's graph for `onnxruntime` targets (llmc.formats.onnx_genai).

torch.onnx (the dynamo exporter, opset 21) writes the model's float graph with the dequantized
weights. llmc then puts the scheme into the graph the way TensorRT and ONNX Runtime read quantization:
each quantized Linear's weight initializer is replaced by its codes feeding a DequantizeLinear
(int8 per channel, int4 in blocks along the input dimension — opset 21's blocked DQ — or fp8), and
static activations get a QuantizeLinear -> DequantizeLinear pair with the calibrated scale on the
MatMul's input. Every replaced initializer is first checked to hold the canonical dequantized weight,
so a MatMul attributed to the wrong module cannot pass unnoticed.

    <out>/model.onnx, model.onnx.data   input_ids [batch, seq] int64 -> logits [batch, seq, vocab] fp32
    <out>/tokenizer files
    <out>/llmc-serve.json               graph, Q/DQ placement, how to build a TensorRT engine from it

The graph has no KV cache: it scores whole sequences (prefill), which is what perplexity and agreement
need; decode with a cache is what TensorRT-LLM and onnxruntime-genai (INT4: llmc.formats.onnx_genai)
are for. Dynamic per-token activation scales have no standard ONNX operator, so schemes with dynamic
activations are refused with the fix (static per-tensor activations, or weight-only).
"""

from __future__ import annotations

import ast
import logging
import re
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmc import __version__
from llmc.formats.base import ArtifactFormat, ExportLayout, ExportRequest, ExportWork, read_json
from llmc.formats.registry import register_format
from llmc.formats.files import SERVE_FILE, copy_tokenizer_files
from llmc.errors import EngineFailed, IncompatibleTargetError
from llmc.planning import probes
from llmc.planning.rows import CostRow
from llmc.planning.target import host_work_seconds, per_layer_host_seconds
from llmc.telemetry.progress import log
from llmc.quant.canonical import QuantizedModel
from llmc.quant.numerics import quantize_rate, quantize_weight
from llmc.quant.spec import Scheme, TensorSpec, probe_text
from llmc.storage.resource_errors import raise_if_resource
from llmc.storage.store import atomic_write_json

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
OPSET = 21  # blocked DequantizeLinear (INT4 groups) and INT4/FP8 tensor types


def check_scheme(scheme: Scheme, target: str = "the ONNX Q/DQ exporter") -> None:
    """Raise IncompatibleTargetError unless a standard Q/DQ graph carries the scheme exactly."""
    w, a = scheme.weights, scheme.activations
    if w.format == "nvfp4":
        raise IncompatibleTargetError(f"{target} does not write NVFP4 (FP4 Q/DQ needs opset 23 and Blackwell)",
                                      fix="use FP8, INT8 or INT4 weights for this target")
    if w.format == "fp8_e4m3" and w.strategy == "group":
        raise IncompatibleTargetError(f"{target}: FP8 weights in groups have no DequantizeLinear form TensorRT reads",
                                      fix="use strategy: tensor or channel for FP8 weights")
    if a is not None:
        if a.dynamic:
            raise IncompatibleTargetError(
                f"{target} carries static activation scales: per-token dynamic quantization has no standard "
                "ONNX operator, and TensorRT's Q/DQ INT8/FP8 GEMMs read calibrated per-tensor scales",
                fix="use static activations (activations: {strategy: tensor, dynamic: false}; calibrated) "
                    "or a weight-only scheme")
        if a.strategy != "tensor" or not a.symmetric:
            raise IncompatibleTargetError(f"{target}: activations must be per-tensor and symmetric, got "
                                          f"{a.describe()}", fix="use activations with strategy: tensor, symmetric")
    if scheme.kv_cache is not None:
        raise IncompatibleTargetError(f"{target} writes a graph without a KV cache, so it cannot carry KV-cache "
                                      "scales", fix="drop kv_cache from the scheme for this target")


def float_model(qm: QuantizedModel) -> nn.Module:
    """The canonical model with dequantized weights, in float32, as a transformers module."""
    from llmc.model.skeleton import build_skeleton, materialize

    model = build_skeleton(qm.config, torch.float32)
    quantized = qm.quantized_modules
    suffixes = (".weight_scale", ".weight_zero_point", ".input_scale", ".k_scale", ".v_scale")
    for tensors in qm.iter_files():
        plain = {k: v for k, v in tensors.items() if not k.endswith(suffixes)}
        for m in quantized:
            if f"{m}.weight" in plain:
                plain[f"{m}.weight"] = qm.dequantized_weight(tensors, m)
        materialize(model, plain, torch.float32)
    if qm.config.get("tie_word_embeddings"):
        model.tie_weights()
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise EngineFailed(f"{qm.root}: the canonical form lacks {', '.join(meta[:4])}",
                           fix="re-run the quantize stage (the form is incomplete)")
    return model


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _export_float_graph(model: nn.Module, max_len: int):
    """The model's float graph as an onnx ModelProto (dynamic batch and sequence)."""
    from torch.export import Dim

    ids = torch.zeros((2, 16), dtype=torch.long)
    shapes = {"input_ids": {0: Dim("batch", max=4096), 1: Dim("sequence", max=max_len)}}
    onnx_logger = logging.getLogger("torch.onnx")  # it lists every optional op library it did not find
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree deprecation notices from inside torch.export
            program = torch.onnx.export(_Logits(model).eval(), (ids,), dynamo=True, opset_version=OPSET,
                                        input_names=["input_ids"], output_names=["logits"],
                                        dynamic_shapes=shapes, verbose=False)
    except Exception as e:  # the exporter raises many types for unsupported code
        raise_if_resource(e, "torch.onnx exporting the graph")
        raise EngineFailed(f"torch.onnx could not export {type(model).__name__}: {type(e).__name__}: {e}",
                           fix="the Q/DQ exporter supports the Llama family that torch.onnx traces; use the "
                               "onnxruntime (INT4) or llama.cpp target for this model") from None
    finally:
        onnx_logger.setLevel(level)
    return program.model_proto


STACK_TRACE = "pkg.torch.onnx.stack_trace"


def drop_stack_traces(proto) -> int:
    """Remove the Python stack trace torch.onnx records in each node's metadata; returns how many it removed.

    The traces hold the absolute paths of llmc's checkout and of the Python environment, and source line numbers:
    the artifact's bytes would depend on where, and from which source lines, it was built, and publishing it would
    publish those paths. The exporter's name scopes stay (`_module_of` reads them)."""
    removed = 0
    for node in _every_node(proto):
        keep = [p for p in node.metadata_props if p.key != STACK_TRACE]
        if len(keep) != len(node.metadata_props):
            removed += len(node.metadata_props) - len(keep)
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
    return removed


def _every_node(proto) -> Iterator:
    """The nodes of the graph and of every function it holds."""
    for nodes in (proto.graph.node, *(f.node for f in proto.functions)):
        yield from nodes


WRAPPER_NAME = "llmc.Logits"  # how the graph's metadata names llmc's wrapper module, wherever its code lives


def name_wrapper_stably(proto) -> int:
    """Name llmc's wrapper module `WRAPPER_NAME` in the exporter's metadata (class hierarchy, name scopes), which
    records its Python import path: moving llmc's code to another module must not change an artifact's bytes.
    Returns how many metadata values it rewrote."""
    path = f"{_Logits.__module__}.{_Logits.__qualname__}"
    rewritten = 0
    for prop in (prop for node in _every_node(proto) for prop in node.metadata_props):
        if path in prop.value:
            prop.value = prop.value.replace(path, WRAPPER_NAME)
            rewritten += 1
    return rewritten


def _module_of(node, prefix: str = "model.") -> str | None:
    """The Linear module a MatMul came from, from the exporter's name-scope metadata."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            # the last scope is the aten op, numbered per module: linear, linear_1, ...
            if len(scopes) >= 2 and re.fullmatch(r"linear(_\d+)?", scopes[-1]) and scopes[-2].startswith(prefix):
                return scopes[-2][len(prefix):]
    return None


def _tensor(name: str, array: np.ndarray, onnx_type: int):
    """A TensorProto from a numpy array; int4 is packed two per byte (low nibble first), fp8 from raw bytes."""
    from onnx import TensorProto, helper

    dims = list(array.shape)
    if onnx_type == TensorProto.INT4:
        flat = array.astype(np.int8).reshape(-1)
        if flat.size % 2:
            flat = np.concatenate([flat, np.zeros(1, np.int8)])
        nib = (flat & 0x0F).astype(np.uint8)
        return helper.make_tensor(name, onnx_type, dims, (nib[0::2] | (nib[1::2] << 4)).tobytes(), raw=True)
    return helper.make_tensor(name, onnx_type, dims, np.ascontiguousarray(array).tobytes(), raw=True)


def _codes_type(spec: TensorSpec) -> int:
    from onnx import TensorProto

    return {"int8": TensorProto.INT8, "int4": TensorProto.INT4, "fp8_e4m3": TensorProto.FLOAT8E4M3FN}[spec.format]


def _weight_dq(name: str, modules: list[str], tensors: dict[str, torch.Tensor], spec: TensorSpec
               ) -> tuple[list, object]:
    """Initializers and the DequantizeLinear node for one MatMul weight, laid out as the graph's [in, out] B.
    Several modules (a packed q/k/v) are concatenated along the output dimension; per-tensor scales then
    become per-output-channel, which is the same function."""
    from onnx import TensorProto, helper

    codes = torch.cat([tensors[f"{m}.weight"] for m in modules]).t().contiguous()  # [in, out]
    if spec.strategy == "tensor" and len(modules) > 1:
        scale = torch.cat([tensors[f"{m}.weight_scale"].float().reshape(1).expand(tensors[f"{m}.weight"].shape[0])
                           for m in modules])
        zp = None
        strategy = "channel"
    else:
        scale = torch.cat([tensors[f"{m}.weight_scale"].float() for m in modules])
        zps = [tensors.get(f"{m}.weight_zero_point") for m in modules]
        zp = None if zps[0] is None else torch.cat(zps)
        strategy = spec.strategy
    kind = _codes_type(spec)
    raw = codes.view(torch.uint8).numpy() if spec.info.is_float else codes.numpy()
    attrs: dict = {}
    if strategy == "tensor":
        scale_np, zp_np = scale.reshape(()).numpy(), None if zp is None else zp.reshape(()).numpy()
    elif strategy == "channel":
        scale_np, zp_np = scale.reshape(-1).numpy(), None if zp is None else zp.reshape(-1).numpy()
        attrs["axis"] = 1
    else:  # groups run along the input dimension, which is axis 0 of B
        scale_np = scale.t().contiguous().numpy()
        zp_np = None if zp is None else zp.t().contiguous().numpy()
        attrs.update(axis=0, block_size=spec.group_size)
    inits = [_tensor(f"{name}.weight_q", raw, kind),
             helper.make_tensor(f"{name}.weight_scale", TensorProto.FLOAT, list(scale_np.shape),
                                np.ascontiguousarray(scale_np, np.float32).tobytes(), raw=True)]
    inputs = [f"{name}.weight_q", f"{name}.weight_scale"]
    if zp_np is not None:
        inits.append(_tensor(f"{name}.weight_zero_point", zp_np, kind))
        inputs.append(f"{name}.weight_zero_point")
    node = helper.make_node("DequantizeLinear", inputs, [f"{name}.weight_dq"], name=f"{name}/weight_dq", **attrs)
    return inits, node


def _input_qdq(name: str, source: str, scale: torch.Tensor, spec: TensorSpec) -> tuple[list, list]:
    """QuantizeLinear -> DequantizeLinear on a MatMul's input with the calibrated per-tensor scale."""
    from onnx import TensorProto, helper

    kind = _codes_type(spec)
    zero = np.zeros((), np.uint8 if spec.info.is_float else np.int8)  # fp8 zero is the all-zero byte
    inits = [helper.make_tensor(f"{name}.input_scale", TensorProto.FLOAT, [],
                                np.float32(scale.reshape(()).item()).tobytes(), raw=True),
             _tensor(f"{name}.input_zero_point", zero, kind)]
    names = [f"{name}.input_scale", f"{name}.input_zero_point"]
    nodes = [helper.make_node("QuantizeLinear", [source, *names], [f"{name}.input_q"], name=f"{name}/input_q"),
             helper.make_node("DequantizeLinear", [f"{name}.input_q", *names], [f"{name}.input_dq"],
                              name=f"{name}/input_dq")]
    return inits, nodes


def torch_onnx_weights(graph) -> dict[str, list[str]]:
    """{weight initializer: [module]} for a torch.onnx graph, from the exporter's name-scope metadata."""
    out: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type == "MatMul":
            module = _module_of(node)
            if module is not None:
                out[node.input[1]] = [module]
    return out


def insert_qdq(graph_model, qm: QuantizedModel, weights: dict[str, list[str]]) -> dict:
    """Rewrite a float graph in place: codes + DequantizeLinear for each MatMul whose weight initializer
    `weights` maps to quantized modules (several for a packed projection), Q/DQ on static activations.
    Returns counts for the summary."""
    from onnx import numpy_helper

    scheme = qm.scheme
    graph = graph_model.graph
    inits = {t.name: t for t in graph.initializer}
    weights = {w: ms for w, ms in weights.items() if all(m in qm.quantized_modules for m in ms)}
    missing = sorted(set(qm.quantized_modules) - {m for ms in weights.values() for m in ms})
    if missing:
        raise EngineFailed(f"the exported graph has no MatMul for {', '.join(missing[:4])}"
                           f"{' ...' if len(missing) > 4 else ''}", fix="report this as an llmc bug")
    consumers: dict[str, list] = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights:
            consumers.setdefault(node.input[1], []).append(node)
    new_nodes: dict[int, list] = {}  # id(matmul) -> nodes to put before it
    for tensors in qm.iter_files():
        for w, modules in weights.items():
            if f"{modules[0]}.weight" not in tensors:
                continue
            expected = torch.cat([qm.dequantized_weight(tensors, m).float() for m in modules]).t().numpy()
            got = numpy_helper.to_array(inits[w]) if w in inits else None
            if got is None or got.shape != expected.shape or not np.allclose(
                    got, expected, rtol=1e-5, atol=1e-6 * float(np.abs(expected).max())):
                raise EngineFailed(f"{', '.join(modules)}: the graph's weight {w} is not "
                                   "the dequantized weight of these modules", fix="report this as an llmc bug")
            name = modules[0] if len(modules) == 1 else w.removesuffix(".weight")
            w_inits, dq = _weight_dq(name, modules, tensors, scheme.weights)
            graph.initializer.extend(w_inits)
            input_scale = None
            if scheme.activations is not None:
                scales = [tensors[f"{m}.input_scale"] for m in modules]
                if any(not torch.equal(scales[0], x) for x in scales[1:]):
                    raise EngineFailed(f"{', '.join(modules)} share one MatMul in the graph but have different "
                                       "input scales", fix="report this as an llmc bug")
                input_scale = scales[0]
            for i, node in enumerate(consumers[w]):
                nodes = [dq] if i == 0 else []
                node.input[1] = dq.output[0]
                if input_scale is not None:
                    a_inits, qdq = _input_qdq(f"{name}.{i}" if i else name, node.input[0], input_scale,
                                              scheme.activations)
                    graph.initializer.extend(a_inits)
                    node.input[0] = qdq[-1].output[0]
                    nodes = qdq + nodes
                new_nodes[id(node)] = nodes
    still_used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name not in weights or t.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    ordered = []
    for node in graph.node:
        ordered += new_nodes.get(id(node), [])
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(ordered)
    return {"quantized_matmuls": len(new_nodes), "activation_qdq": bool(scheme.activations)}


def scheme_summary(scheme: Scheme) -> dict:
    """What a Q/DQ graph holds, for llmc-serve.json (this exporter's and the ONNX Runtime folder's)."""
    out = {
        "scheme": scheme.name,
        "weights": f"{scheme.weights.describe()} as codes -> DequantizeLinear",
        "activations": (f"{scheme.activations.describe()}: QuantizeLinear -> DequantizeLinear with the "
                        "calibrated scale" if scheme.activations else "float (weight-only)"),
        "unquantized": list(scheme.ignore),
    }
    if scheme.activations is not None and scheme.activations.format == "int8":
        out["onnxruntime"] = {
            "exact_session_config": {"session.disable_quant_qdq": "1"},
            "note": "ORT fuses int8 Q/DQ MatMuls into its u8s8 int8 kernel; on x86 CPUs without VNNI that kernel "
                    "saturates 16-bit pair sums (measured +0.54% perplexity on SmolLM2 W8A8, docs/formats-and-runtimes.md). "
                    "The session config above runs the graph exactly (float MatMul) at the cost of speed."}
    return out


def export_onnx_qdq(qm: QuantizedModel, out: Path) -> dict:
    """Write the Q/DQ ONNX folder for `qm` into `out`; returns the summary (also in llmc-serve.json)."""
    import onnx

    check_scheme(qm.scheme)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    max_len = int(qm.config.get("max_position_embeddings") or 4096)
    log("export: torch.onnx float graph (opset 21), then Q/DQ from the canonical codes")
    with torch.no_grad():
        proto = _export_float_graph(float_model(qm), max_len)
    counts = insert_qdq(proto, qm, torch_onnx_weights(proto.graph))
    drop_stack_traces(proto)
    name_wrapper_stably(proto)
    onnx.save(proto, str(out / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
              location=DATA_FILE, size_threshold=1024)
    del proto
    try:  # by path: the checker reads external data there, and has no 2 GB protobuf limit
        onnx.checker.check_model(str(out / MODEL_FILE))
    except onnx.checker.ValidationError as e:
        raise EngineFailed(f"the Q/DQ graph does not validate: {e}", fix="report this as an llmc bug") from None
    copy_tokenizer_files(qm.root, out)
    scheme = qm.scheme
    summary = {
        "llmc_version": __version__,
        "kind": "onnx-qdq",
        "graph": {"file": MODEL_FILE, "opset": OPSET, "inputs": {"input_ids": ["batch", "sequence"]},
                  "outputs": {"logits": ["batch", "sequence", "vocab"]}, "kv_cache": False,
                  "max_sequence": max_len},
        **scheme_summary(scheme),
        **counts,
        "tensorrt": {"build": f"trtexec --onnx={MODEL_FILE} --stronglyTyped --saveEngine=model.plan "
                              "--minShapes=input_ids:1x1 --optShapes=input_ids:1x512 --maxShapes=input_ids:8x2048",
                     "python": "llmc.engines.tensorrt.build_engine(folder)"},
    }
    atomic_write_json(out / SERVE_FILE, summary)
    return summary


# torch.onnx's export (torch.export's trace, the translation to ONNX, its optimizer) costs per traced op, whatever the
# widths: a part per export and a part per decoder layer (SmolLM2-135M's graph: 2,201 nodes, 71 per layer; the tiny
# models' 141 and 354 nodes at 1 and 4 layers). The plan times it on tiny models of the model's own family of 1 and
# GRAPH_PROBE_LAYERS layers and fits the two (benchmarks/results/planner-log.md, "The export stages' own work").
GRAPH_PROBE_LAYERS = 3
GRAPH_PROBE_REPEATS = 2  # timed runs per size: one export of the tiny model takes seconds, minutes under load
GRAPH_PROBE_SEQUENCE = 256  # the tiny models' max_position_embeddings (the dynamic sequence dimension's bound)


def graph_probe_config(config: dict, layers: int) -> dict:
    """A tiny model of `config`'s family (its model_type and the flags that change its graph: biases, tied
    embeddings) with `layers` decoder layers, for the graph export's probe."""
    kept = ("model_type", "architectures", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act")
    return {**{k: config[k] for k in kept if k in config}, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
            "max_position_embeddings": GRAPH_PROBE_SEQUENCE, "num_hidden_layers": layers}


def graph_export_rate(config: dict, layers: int) -> float:
    """Exports/s of a tiny model of `config`'s family with `layers` decoder layers through `_export_float_graph`
    (llmc.planning.probes: timed, cached per machine)."""
    key = f"torch.onnx export {config.get('model_type')} tied={bool(config.get('tie_word_embeddings'))} layers={layers}"
    return probes.rate(key, _graph_timer(graph_probe_config(config, layers)), repeats=GRAPH_PROBE_REPEATS)


def graph_export_seconds(config: dict) -> float:
    """Seconds torch.onnx takes to export the float graph of the model of `config` (its num_hidden_layers): the
    probed export at 1 layer, plus the probed time of each further layer (GRAPH_PROBE_LAYERS against 1)."""
    return per_layer_host_seconds(graph_export_rate, config, GRAPH_PROBE_LAYERS)


# The float model's dequantized copy of each quantized weight (`float_model`), in units of one `quantize_weight` of it
# (the quantizer's probed elementwise rate, llmc.quant.numerics.quantize_rate), counted from the code above.
FLOAT_MODEL_PASSES = 1


def weight_pass_seconds(work: ExportWork) -> float:
    """Seconds of the exporter's passes over the quantized weights: the float model's dequantized copy
    (FLOAT_MODEL_PASSES at the probed quantizer's rate) and `insert_qdq` putting the codes into the graph
    (`insert_qdq_seconds`)."""
    seconds = 0.0
    for w in work.written:
        elements = sum(o * i for o, i in w.linears)
        if elements:
            seconds += FLOAT_MODEL_PASSES * elements / quantize_rate(w.weights, work.compute,
                                                                     elements=work.shape.largest_linear)
    return seconds + insert_qdq_seconds(work)


# The insert_qdq probe's one Linear (out, in): large enough that its per-element work (the dequantization, the float
# comparison with the graph's initializer, the codes' transposed copy into protobuf, the initializers rebuilt) is what
# is timed, small enough to take well under a second.
INSERT_PROBE_SHAPE = (1024, 1024)


def insert_qdq_seconds(work: ExportWork) -> float:
    """Seconds `insert_qdq` takes over every quantized weight the export writes, at its probed rate
    (`insert_qdq_rate`: the function itself run on a graph of one Linear of the scheme); 0 for a named profile."""
    def seconds() -> float:
        total = 0.0
        for w in work.written:
            elements = sum(o * i for o, i in w.linears)
            if elements:
                total += elements / insert_qdq_rate(w.weights, w.static_input_scales)
        return total

    return host_work_seconds(seconds)


def insert_qdq_rate(weights: TensorSpec, static_inputs: bool) -> float:
    """Quantized weight elements/s `insert_qdq` puts into a float graph as codes -> DequantizeLinear (with Q/DQ on
    the input where the activations are static), timed on a graph of one INSERT_PROBE_SHAPE MatMul and cached per
    machine (llmc.planning.probes)."""
    out, inp = INSERT_PROBE_SHAPE
    return probes.rate(f"insert_qdq {probe_text(weights)} static_inputs={static_inputs} elements={out * inp}",
                       _insert_timer(weights, static_inputs))


class _OneFile(QuantizedModel):
    """A canonical form held in memory (one file of tensors), for the insert_qdq probe."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(Path("."), meta)
        self.tensors = tensors

    def iter_files(self, progress: str = "") -> Iterator[dict[str, torch.Tensor]]:
        yield self.tensors


def _insert_timer(weights: TensorSpec, static_inputs: bool):
    """A function timing `insert_qdq` on a fresh copy of a one-MatMul float graph, repeated for at least
    `probes.MIN_SAMPLE_S` of its own time, and returning quantized weight elements/s (the graph and the codes made on
    first call)."""
    state: dict = {}

    def run_once() -> float:
        # lazy: onnx is the exporter's optional dependency (ArtifactFormat.libraries)
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        if not state:
            out, inp = INSERT_PROBE_SHAPE
            activations = TensorSpec(weights.format, "tensor") if static_inputs else None
            with torch.random.fork_rng(devices=[]):  # the build's own random state stays as it was
                torch.manual_seed(0)
                w = torch.randn(out, inp)
            q = quantize_weight(w, weights)
            tensors = {"l.weight": q.codes, "l.weight_scale": q.scale}
            if q.zero_point is not None:
                tensors["l.weight_zero_point"] = q.zero_point
            if activations is not None:
                tensors["l.input_scale"] = torch.tensor([0.01])
            qm = _OneFile({"scheme": Scheme(weights, activations).to_dict(), "modules": {"l": {}}, "config": {}},
                          tensors)
            dequantized = qm.dequantized_weight(tensors, "l").float().t().contiguous().numpy()
            graph = helper.make_graph(
                [helper.make_node("MatMul", ["x", "l.weight"], ["y"], name="l/MatMul")], "probe",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, inp])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out])],
                [numpy_helper.from_array(dequantized, "l.weight")])
            state.update(model=helper.make_model(graph), qm=qm)
        elapsed, n = 0.0, 0
        while elapsed < probes.MIN_SAMPLE_S:
            model = onnx.ModelProto()
            model.CopyFrom(state["model"])
            start = time.perf_counter()
            insert_qdq(model, state["qm"], {"l.weight": ["l"]})
            elapsed += time.perf_counter() - start
            n += 1
        return n * INSERT_PROBE_SHAPE[0] * INSERT_PROBE_SHAPE[1] / elapsed

    return run_once


def _graph_timer(tiny: dict):
    """A function timing one export of the tiny model `tiny` and returning exports/s (the model built on first
    call: a cached rate builds none)."""
    state: dict = {}

    def run_once() -> float:
        if not state:
            from transformers import AutoConfig, AutoModelForCausalLM  # lazy: a plan with cached rates skips it

            config = AutoConfig.for_model(**tiny)
            config._attn_implementation = "sdpa"  # as llmc.model.skeleton.build_skeleton builds the real one
            with torch.random.fork_rng(devices=[]):  # the build's own random state stays as it was
                torch.manual_seed(0)
                state["model"] = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            return probes.sustained_rate(1.0, lambda: _export_float_graph(state["model"], GRAPH_PROBE_SEQUENCE))

    return run_once


@register_format
class OnnxQdq(ArtifactFormat):
    name = "onnx-qdq"
    libraries = ("onnx",)
    unquantized_elem = 4  # the graph is traced in float32: every unquantized initializer is float32
    families = frozenset({"llama", "mistral", "qwen2"})
    families_source = "the Q/DQ graph export is verified on Llama-family models only"
    read_by = ("onnxruntime", "tensorrt")
    layout = ExportLayout(whole_model=True)
    measures_decode = False  # input_ids -> logits, no KV cache
    triton_backend = "onnxruntime"
    unevaluated = "not evaluated: add onnxruntime to eval.runtimes (or tensorrt, on a GPU machine with TensorRT)"
    proof = ("the standard-op Q/DQ graph is loaded and scored in onnxruntime 1.32 here (CPU EP; default test "
             "run, tiny model): without ORT's int8 kernel fusions it reproduces the torch reference of the same codes "
             "(KL < 2e-5); a TensorRT engine is built and scored from it only on a GPU machine with TensorRT (test "
             "marked gpu, not run)")

    def check_scheme(self, scheme) -> None:
        check_scheme(scheme)

    def cost(self, label: str, work: ExportWork) -> CostRow:
        """Its files written and hashed (`ArtifactFormat.cost`), and what the graph's making adds: torch.onnx's
        export of the float graph (probed on tiny models of the family: `graph_export_seconds`) and the passes over
        every weight (the float model's dequantized copy; `insert_qdq` checking each replaced initializer against the
        canonical weight and putting the codes in, at its probed rate: `weight_pass_seconds`)."""
        row = super().cost(label, work)
        row.seconds += graph_export_seconds(work.config) + weight_pass_seconds(work)
        return row

    def stage_config(self, request: ExportRequest) -> dict:
        return {"opset": OPSET}  # the graph does not depend on the target: onnxruntime and tensorrt share one export

    def write(self, request: ExportRequest, out: Path) -> None:
        export_onnx_qdq(request.quantized, out)

    def recognizes(self, path: Path) -> bool:
        return (path / MODEL_FILE).is_file() and not (path / "genai_config.json").is_file()

    def describe(self, path: Path) -> str:
        import onnx  # lazy: onnx is the exporter's optional dependency (ArtifactFormat.libraries)

        graph = onnx.load(str(path / MODEL_FILE), load_external_data=False).graph
        ops = Counter(n.op_type for n in graph.node)
        extra = read_json(path / SERVE_FILE) or {}
        return "\n".join([
            f"ONNX Q/DQ graph at {path} (input_ids -> logits, no KV cache)",
            f"  ops: {ops['DequantizeLinear']} DequantizeLinear, {ops['QuantizeLinear']} QuantizeLinear, "
            f"{ops['MatMul']} MatMul, {sum(ops.values())} nodes in all",
            f"  scheme {extra.get('scheme', '?')}: weights {extra.get('weights', 'not written by llmc')}; "
            f"activations {extra.get('activations', '?')}",
            "  accepted by: onnxruntime (CPU EP here), TensorRT (engine: "
            + extra.get("tensorrt", {}).get("build", "trtexec --onnx=model.onnx --stronglyTyped") + ")",
        ])
