"""What an artifact format is, as a type: `ArtifactFormat`, the one class each format module beside this file
defines and registers (`llmc.formats.registry`), and what an exporter reads (`ExportRequest`) and the planner counts
(`WrittenTensors`, `ExportWork`).

A *format* (compressed-tensors, GGUF, ...) is written by one exporter with one signature, `write(request, out)`, and
knows the options that enter its stage key, how its exporter works (`ExportLayout`) and so what its export stage
costs (`cost`, `written_bytes`), its Triton backend, how `llmc inspect` recognises and describes it, which evaluation
engines load it, and how its artifacts are proven. The runtimes that read a format are data in `llmc.runtimes`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from llmc.errors import IncompatibleTargetError
from llmc.formats.described import check_seconds
from llmc.formats.files import MAX_SHARD_BYTES, SERVE_FILE
from llmc.model.dtype import BYTES
from llmc.planning.machine import PROCESS_BYTES, Machine, file_write_seconds
from llmc.planning.rows import GB, CostRow
from llmc.planning.shapes import Shape
from llmc.quant.spec import BLOCK_SHAPE, Scheme, TensorSpec
from llmc.storage.direct_io import held_bytes

if TYPE_CHECKING:
    from llmc.quant.canonical import QuantizedModel


class RuntimeTarget(Protocol):
    """A recipe target as the runtimes and formats read it (`llmc.recipe.schema.Target` is one). Named by what is
    read, not by the recipe's class: the recipe sits a layer above the plugins (docs/architecture.md, "Layers")."""

    @property
    def runtime(self) -> str: ...

    @property
    def version(self) -> str | None: ...  # a PEP 440 specifier of the runtime versions

    @property
    def gpu_arch(self) -> str: ...

    @property
    def tensor_parallel(self) -> int: ...

    @property
    def triton(self) -> bool: ...

    @property
    def label(self) -> str: ...

    def model_dump(self, *, mode: str = ..., exclude: set[str] | None = ...) -> dict: ...


def target_key(target: RuntimeTarget) -> dict:
    """The target as it enters stage keys; `triton` only when set, so older keys stay valid."""
    return target.model_dump(mode="json", exclude=set() if target.triton else {"triton"})


@dataclass(frozen=True)
class ExportRequest:
    """Everything an exporter may read: the canonical form, the target, and the recipe's serving settings."""

    quantized: QuantizedModel
    target: RuntimeTarget
    max_model_len: int  # the context the runtime is configured to serve (llmc.pipeline.export.served_context)
    max_batch_size: int  # the recipe's eval.batch_size


@dataclass(frozen=True)
class WrittenTensors:
    """What an export writes, in the counts `llmc plan` knows before any weight loads (tensor shapes from the
    checkpoint's headers or its config), for `ArtifactFormat.written_bytes`."""

    linears: tuple[tuple[int, int], ...]  # every quantized Linear's (out, in)
    weights: TensorSpec  # the scheme's weights
    layer_unquantized: int  # elements inside the decoder layers left unquantized (norms, biases, ignored Linears)
    outer: int  # elements outside the decoder layers (embeddings, final norm, head)
    elem: int  # bytes per element of the compute dtype (the canonical form's unquantized layer tensors)
    kept_elem: int  # ... of the weights outside the layers as the canonical form keeps them (model.dtype.kept_dtype)
    side_files: int = 0  # bytes of the tokenizer files and config.json the source folder holds
    static_input_scales: bool = False  # one input scale per quantized Linear
    # The same tensors by name, for a format that types each tensor on its own (GGUF's `written_bytes` runs its
    # exporter's own choice of each tensor's type): the quantized Linears' module names in `linears`' order, and
    # every other tensor by its checkpoint name with its shape (a mixed scheme: in the first entry). Empty where the
    # plan knows no names: the counts above serve.
    linear_names: tuple[str, ...] = ()
    other_tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    config: dict = field(default_factory=dict, compare=False)  # the model's config.json (with the names)

    def scales(self, out: int, inp: int) -> int:
        """Scale entries of one (out, in) Linear under the scheme's strategy (microscaling: in its stored bits)."""
        w = self.weights
        if w.info.microscaling:
            return 1  # the global scale at most (NVFP4); the block scales are in stored_bits
        return {"tensor": 1, "channel": out,
                "group": out * -(-inp // (w.group_size or inp)),
                "block": -(-out // BLOCK_SHAPE[0]) * -(-inp // BLOCK_SHAPE[1])}.get(w.strategy, out)


@dataclass(frozen=True)
class ExportLayout:
    """How a format's exporter reads and writes, as its export stage is costed (`ArtifactFormat.cost`) and the
    planner checks memory (a whole-model exporter must fit)."""

    whole_model: bool = False  # the exporter holds the whole model in memory (else streams layers)
    shards_by_tp: bool = False  # its weight files depend on tensor_parallel (else targets share them)
    repacks_layers: bool = False  # writes the layers' codes in its own layout a block at a time
    # 8-bit codes are written as the canonical form stores them: read through mmap, never copied (the planner's cost)
    passes_8bit_codes: bool = False
    # the weights outside the layers are written unchanged, last, as shard files of their own once they exceed one
    # shard: byte-identical between the formats that set this, so the store keeps one copy (hard links)
    outer_weights_as_stored: bool = False


@dataclass(frozen=True)
class ExportWork:
    """What one export stage asks its format to cost (`ArtifactFormat.cost`): the model, what the format writes for
    the scheme, and what the build's earlier stages already did."""

    shape: Shape
    written: Sequence[WrittenTensors]  # the counts its files are made of (llmc.pipeline.export.written_tensors)
    bits: int  # the scheme's weight bits
    packed_bytes: float  # the layers' quantized weights packed at their bits (the quantize stage's sizes)
    outer_bytes: float  # the weights outside the layers as the canonical form keeps them
    read_seconds: float  # verifying and reading the canonical form's files (0: an earlier export did)
    shared_with: str | None  # the earlier export whose weight files this one shares (hard links)
    # an earlier export of the same scheme wrote the outer weights as stored: identical files are linked
    outer_written_before: bool
    compute: str  # the compute dtype's name
    machine: Machine
    config: dict = field(default_factory=dict)  # the model's config.json (a format whose work follows its family)


class ArtifactFormat:
    """One kind of artifact: its exporter and everything the build, planner, inspector and reports need to know.

    Subclasses set the class attributes and implement `write`; `stage_config` says what enters the export
    stage's cache key (the exporter's options, the target where the artifact depends on it); `cost` is its export
    stage's row of the plan, from `layout` and `written_bytes`."""

    name: ClassVar[str]
    read_by: ClassVar[tuple[str, ...]] = ()  # evaluation engines that load this format
    layout: ClassVar[ExportLayout] = ExportLayout()  # how its exporter reads and writes (its cost)
    measures_decode: ClassVar[bool] = True  # the artifact has a KV cache, so decode tok/s can be measured
    triton_backend: ClassVar[str | None] = None  # "vllm" | "onnxruntime" | "tensorrt_llm" | None
    triton_refusal: ClassVar[tuple[str, str] | None] = None  # (why, fix) where a backend is impossible, not missing
    proof: ClassVar[str] = ""  # how its artifacts are proven (docs/compatibility.md)
    unevaluated: ClassVar[str] = ""  # the report's reason when no engine in eval.runtimes loads it

    # Hugging Face model_types (model families) the format's exporter and runtime handle; None: any decoder-only
    # causal LM transformers builds. `families_source` says where the list comes from. `llmc plan` refuses other
    # families before any weight loads (`llmc.runtimes.registry.check_family`).
    families: ClassVar[frozenset[str] | None] = None
    families_source: ClassVar[str] = ""
    # Mixture-of-Experts model_types whose per-expert export this format's exporter writes and a test round-trips
    # (llmc.quant.moe); every other format refuses MoE models at plan time, whatever `families` says.
    moe_families: ClassVar[frozenset[str]] = frozenset()
    # the format holds a mixed-precision scheme (`Scheme.groups`: each group of Linears its own scheme); formats that
    # do not are refused such schemes at plan time (`check_mixed`)
    mixed_precision: ClassVar[bool] = False
    # its runtime runs q/k/v and gate/up as one GEMM each, so a mixed scheme must give them one group
    fuses_projections: ClassVar[bool] = False

    # What its files hold, for the planner's count of its writes (`written_bytes`): bytes of one weight scale and
    # one zero point, bytes per unquantized element where the format converts them (None: as the canonical form
    # holds them), bytes per input feature of each quantized Linear (GPTQ's g_idx), and whether it copies the
    # source's tokenizer files beside its weights.
    scale_bytes: ClassVar[float] = 4
    zero_point_bytes: ClassVar[float] = 1
    # what the format needs of asymmetric integer zero points (`llmc.quant.spec.ZeroGrid`; None: any): the plan sets
    # it on every scheme of a recipe with a target in this format (`llmc.quant.spec.with_zero_grid`), so the one
    # canonical form, and every artifact made from it, holds only zero points each of its readers reads alike
    zero_grid: ClassVar[str | None] = None
    unquantized_elem: ClassVar[int | None] = None
    per_input_bytes: ClassVar[int] = 0
    copies_tokenizer_files: ClassVar[bool] = True
    # its config.json's quantization_config names how each Linear is stored, which the export stage checks against
    # the model's Linears after writing (llmc.formats.described.check_export: the model's skeleton built on the meta
    # device, costed per decoder layer at a probed rate)
    describes_linears: ClassVar[bool] = False
    # The Python packages its exporter imports beyond torch and safetensors: `llmc build` imports them before its
    # first stage (llmc.formats.registry.import_libraries), so that a broken install fails before any weight loads
    # and an export's time is its own work (compressed-tensors' import takes 0.4-2 s, longer than exporting a
    # 135M model's FP8 weights)
    libraries: ClassVar[tuple[str, ...]] = ()

    def code_bytes(self, weights: TensorSpec) -> float:
        """Bytes one quantized weight's code takes in its files: packed at its bits (microscaling: with its
        block scales)."""
        return weights.stored_bits / 8

    def linear_weight_bytes(self, shape: tuple[int, int], weights: TensorSpec | None, elem: int) -> Fraction:
        """Bytes one decoder-layer Linear's weight (`shape`: out, in) takes in this format's files, exactly: its codes
        packed at their bits, microscaling block scales included (`weights` None: left unquantized, `elem` bytes a
        weight, or the format's own `unquantized_elem`). What quantization.search budgets per candidate; a format
        whose blocks hold more than the codes (GGUF) says so by overriding it. Other scales are the format's
        metadata, not counted."""
        n = shape[0] * shape[1]
        if weights is None:
            return Fraction(n * (self.unquantized_elem or elem))
        return n * Fraction(weights.stored_bits).limit_denominator(64) / 8

    def written_bytes(self, w: WrittenTensors) -> float:
        """Bytes of every file this format writes for the model: codes, scales, zero points, the unquantized tensors
        (copied or converted), the tokenizer files and config; the small JSON files around them are within the
        count's tolerance (tests/unit/test_export_writes.py)."""
        elems = sum(o * i for o, i in w.linears)
        scales = sum(w.scales(o, i) for o, i in w.linears)
        total = elems * self.code_bytes(w.weights) + scales * self.scale_bytes
        if not w.weights.symmetric:
            total += scales * self.zero_point_bytes
        total += sum(i for _, i in w.linears) * self.per_input_bytes
        if w.static_input_scales:
            total += len(w.linears) * 4
        inner, outer = (w.elem, w.kept_elem) if self.unquantized_elem is None else (self.unquantized_elem,) * 2
        total += w.layer_unquantized * inner + w.outer * outer
        return total + (w.side_files if self.copies_tokenizer_files else 0)

    def files_key(self, target: RuntimeTarget) -> tuple:
        """What fixes this format's weight files for a target besides the quantized form: its name (and, where the
        files depend on it, the tensor-parallel degree). Exports of one quantized form with equal keys share files."""
        return (self.name,) + ((target.tensor_parallel,) if self.layout.shards_by_tp else ())

    def writes_outer_as_stored(self, outer_bytes: float) -> bool:
        """Whether the weights outside the layers go into shard files of their own, byte-identical between the
        formats that write them so (`ExportLayout.outer_weights_as_stored`)."""
        return self.layout.outer_weights_as_stored and outer_bytes > MAX_SHARD_BYTES

    def cost(self, label: str, work: ExportWork) -> CostRow:
        """Its export stage's row of the plan: every file it writes (`written_bytes`), less the outer weights'
        shards an earlier export of the same scheme already wrote identically (hard links), with the memory and
        time of how its exporter works (`layout`, `export_cost`)."""
        artifact = sum(self.written_bytes(w) for w in work.written)
        new_bytes = artifact
        if work.outer_written_before and self.writes_outer_as_stored(work.outer_bytes):
            new_bytes -= work.outer_bytes
        row = export_cost(work.shape, label=label, artifact_bytes=artifact, new_bytes=new_bytes,
                           read_seconds=work.read_seconds, whole_model=self.layout.whole_model,
                           shared_with=work.shared_with, compute=work.compute, machine=work.machine,
                           max_shard_bytes=MAX_SHARD_BYTES,
                           passes_codes_through=work.bits == 8 and self.layout.passes_8bit_codes,
                           repacked_bytes=work.packed_bytes if self.layout.repacks_layers else None, bits=work.bits,
                           repack_seconds=self.repack_seconds(work) if self.layout.repacks_layers else 0.0)
        if self.describes_linears and work.config:
            row.seconds += check_seconds(work.config)
        return row

    def repack_seconds(self, work: ExportWork) -> float:
        """Seconds a repacking format's exporter (`layout.repacks_layers`) spends repacking and checking the quantized
        weights (llmc.formats.gptq_format.RepackedCheckpoint: probed per machine); 0 for the others."""
        return 0.0

    def check_scheme(self, scheme: Scheme) -> None:
        """Raise IncompatibleTargetError when the format (or the kernel it feeds) cannot hold the scheme."""

    def check_config(self, config: dict) -> None:
        """Raise IncompatibleTargetError when the format's exporter (or its runtime) cannot take this model's
        config.json, a family it covers: `llmc plan` asks before any weight loads, the exporter asks again."""

    def check_model(self, target: RuntimeTarget, scheme: Scheme, config: dict) -> None:
        """Raise IncompatibleTargetError when the format cannot hold this scheme of this model (config.json) for this
        target: for a format a runtime offers for one family only (`Runtime.family_formats`), what the model and the
        scheme decide together. Nothing for the others (check_scheme and check_config say it)."""

    def check_mixed(self, scheme: Scheme) -> None:
        """IncompatibleTargetError for a mixed-precision scheme this format cannot express; else each group's scheme
        through `check_scheme`."""
        if not scheme.mixed:
            return self.check_scheme(scheme)
        if not self.mixed_precision:
            raise IncompatibleTargetError(
                f"the {self.name} format holds one scheme for every quantized Linear; this recipe's groups use "
                f"{', '.join(sorted({m.name for m in scheme.members().values()}))}",
                fix="target a runtime whose format holds mixed precision (vllm / sglang: compressed-tensors), or give "
                    "this target a variant with one scheme (variants:)")
        for member in scheme.members().values():
            self.check_scheme(member)

    def stage_config(self, request: ExportRequest) -> dict:
        """What enters the export stage key besides the format's name."""
        return {"target": target_key(request.target)}

    def write(self, request: ExportRequest, out: Path) -> None:
        raise NotImplementedError

    def recognizes(self, path: Path) -> bool:
        """Whether `path` is an artifact of this format (for `llmc inspect`)."""
        return False

    def describe(self, path: Path) -> str:
        """What `llmc inspect` prints for an artifact of this format."""
        raise NotImplementedError


# llmc.formats.files.REPACK_BLOCK_ELEMENTS (2^20) x ~10 int32 / float32 temporaries of the packing and its check
REPACK_BLOCK_BYTES = 40e6


def export_cost(shape: Shape, *, label: str, artifact_bytes: float, whole_model: bool, shared_with: str | None,
                compute: str, machine: Machine, passes_codes_through: bool = False,
                max_shard_bytes: float = 2 << 30, new_bytes: float | None = None,
                repacked_bytes: float | None = None, bits: int = 4, read_seconds: float = 0.0,
                repack_seconds: float = 0.0) -> CostRow:
    """One export. Streaming exporters read the quantized form through mmap and write one shard at a time
    (llmc.formats.files.write_shards): what they pass through unchanged stays file pages (`mapped_bytes`: one
    shard), what they create is allocated. `passes_codes_through`: 8-bit codes written as stored: the process alone.
    `repacked_bytes`: the layers' weights in a repacking format's layout (llmc.formats.files.
    write_repacked_checkpoint, a block of rows at a time): one shard of them, and the largest Linear's packed blocks
    joined. Otherwise one shard of new tensors and one layer's codes (an upper bound). Whole-model exporters hold
    the float32 model three times (weights, the graph's copy, the codes). The figures measured against each case:
    docs/planner-constants.md#export-memory. `read_seconds`: verifying and reading the canonical form's files.
    `repack_seconds`: the exporter's repack and check of the quantized weights, at its probed rate
    (`ArtifactFormat.repack_seconds`; docs/planner-constants.md#repack_rate)."""
    e = BYTES[compute]
    mapped = 0.0
    # the largest shard: write_shards never splits one canonical file, and the weights outside the layers are one
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
    if not whole_model:  # the direct I/O buffers of checking the canonical files and writing the shards
        host += held_bytes(max(shard, shape.outer_params * e))
    new_bytes = artifact_bytes if new_bytes is None else new_bytes  # less what identical files already hold
    disk = 0.0 if shared_with else new_bytes
    why = (f"same weight files as {shared_with} (hard links)" if shared_with else
           "its own files" if new_bytes >= artifact_bytes else
           f"its own files, but for {(artifact_bytes - new_bytes) / GB:.2f} GB of shards identical to an earlier "
           "export's (hard links)")
    # read the canonical form, serialize, fsync and hash the artifact (the store's record), a shard at a time
    # (a file identical to an earlier export's is then linked to it: the earlier file's digest is the one this
    # process wrote it with, llmc.storage.store.current_sha256, so nothing is read again)
    seconds = read_seconds + file_write_seconds(artifact_bytes, files=max(1, math.ceil(artifact_bytes / max_shard_bytes)))
    seconds += repack_seconds
    return CostRow(f"export {label}", "cpu", host, 0.0, disk, seconds,
                   "whole model in memory" if whole_model else "one shard at a time", why, mapped_bytes=mapped)


def read_json(path: Path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (recognizers must not raise)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def quantization_config(folder: Path) -> dict | None:
    """The `quantization_config` of a Hugging Face folder's config.json (None: absent, or not a folder)."""
    config = read_json(Path(folder) / "config.json")
    q = config.get("quantization_config") if config else None
    return q if isinstance(q, dict) else None


def architectures(config: dict) -> str:
    """A Hugging Face config's architectures as `llmc inspect` prints them ("?" when it names none)."""
    return ", ".join(config.get("architectures", []) or ["?"])


def serve_line(folder: Path) -> list[str]:
    """`llmc inspect`'s 'serve with' line from the artifact's serve file, where it has one."""
    serve = read_json(Path(folder) / SERVE_FILE)
    return [f"  serve with: {serve['command']}"] if serve and "command" in serve else []
