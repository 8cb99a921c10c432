"""What a runtime target is, as types: capability rules, runtimes, and the artifact formats they read.

A *runtime* (vLLM, TensorRT-LLM, llama.cpp, ...) runs some schemes on some GPU archs from some version on
(its `Rule`s), and reads one artifact *format* for a given version range. A *format* (compressed-tensors,
GGUF, ...) is written by one exporter with one signature, `write(request, out)`, and knows the options that
enter its stage key, whether the exporter holds the whole model in memory, its Triton backend, how
`llmc inspect` recognises it, which evaluation engines load it, and how its artifacts are proven.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from llmc.errors import IncompatibleTargetError
from llmc.quant.spec import BLOCK_SHAPE, KV_CACHE_SCHEMES, Scheme, TensorSpec

if TYPE_CHECKING:
    from llmc.quant.canonical import QuantizedModel

# Every NVIDIA GPU architecture a rule or a recipe target names, oldest first (the recipe's `gpu_arch` takes these
# and "cpu"): one line each.
ARCH_ORDER: tuple[str, ...] = (
    "sm70",  # Volta (V100)
    "sm75",  # Turing (T4)
    "sm80",  # Ampere (A100)
    "sm86",  # Ampere (A10, RTX 30xx)
    "sm89",  # Ada Lovelace (L4, L40S, RTX 40xx): first FP8 tensor cores
    "sm90",  # Hopper (H100, H200)
    "sm100",  # Blackwell (B200): first FP4 tensor cores
    "sm120",  # Blackwell (RTX 50xx, RTX PRO 6000)
)


def arch_at_least(arch: str, minimum: str) -> bool:
    return ARCH_ORDER.index(arch) >= ARCH_ORDER.index(minimum)


def arch_rank(arch: str | None) -> int:
    return ARCH_ORDER.index(arch) if arch else -1


def arch_span(native_from: str, native_until: str | None = None) -> str:
    """The archs a kernel runs on, as the docs and `llmc inspect` print them: sm80+, sm90 only, sm80-sm90."""
    if native_until is None:
        return f"{native_from}+"
    return f"{native_from} only" if native_until == native_from else f"{native_from}-{native_until}"


@dataclass(frozen=True)
class Rule:
    """How one runtime runs one capability (a GEMM scheme or a KV-cache format)."""

    native_from: str | None  # minimum GPU arch for the full scheme; None: no GPU support
    degraded_from: str | None = None  # below native_from but at least this: loads, degraded
    degraded_effect: str = ""
    cpu: bool = False  # runs on the runtime's CPU build (checked on this machine where noted)
    cpu_note: str = ""
    since: str | None = None  # first runtime version with the support
    refuse_reason: str = ""  # why older archs are refused
    native_until: str | None = None  # newest arch with the kernel, where a runtime drops it on newer ones
    until_reason: str = ""  # why newer archs are refused (refuse_reason when empty)
    # where the rule was read: a file, PR or issue in the runtime's own repository (or a measurement here); a test
    # refuses a rule without one, so every arch bound can be checked against its runtime again
    source: str = ""


def scheme_keys(scheme: Scheme) -> list[str]:
    """Capability keys a scheme needs: its GEMM scheme's name and, if any, its KV-cache format's
    (`llmc.quant.spec.SCHEMES`, `KV_CACHE_SCHEMES`)."""
    gemm = sorted({m.name for m in scheme.members().values()})  # a mixed scheme: every group's
    return gemm + ([KV_CACHE_SCHEMES[scheme.kv_cache.format]] if scheme.kv_cache else [])


class RuntimeTarget(Protocol):
    """A recipe target as the runtimes and formats read it (`llmc.recipe.schema.Target` is one). Named by what is
    read, not by the recipe's class: the recipe schema imports the runtimes (their names are its `runtime:` choices,
    `ARCH_ORDER` its `gpu_arch:` ones), so importing it here would close a circle (docs/architecture.md, "Layers")."""

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

    def scales(self, out: int, inp: int) -> int:
        """Scale entries of one (out, in) Linear under the scheme's strategy (microscaling: in its stored bits)."""
        w = self.weights
        if w.info.microscaling:
            return 1  # the global scale at most (NVFP4); the block scales are in stored_bits
        return {"tensor": 1, "channel": out,
                "group": out * -(-inp // (w.group_size or inp)),
                "block": -(-out // BLOCK_SHAPE[0]) * -(-inp // BLOCK_SHAPE[1])}.get(w.strategy, out)


class ArtifactFormat:
    """One kind of artifact: its exporter and everything the build, planner, inspector and reports need to know.

    Subclasses set the class attributes and implement `write`; `stage_config` says what enters the export
    stage's cache key (the exporter's options, the target where the artifact depends on it)."""

    name: ClassVar[str]
    read_by: ClassVar[tuple[str, ...]] = ()  # evaluation engines that load this format
    whole_model: ClassVar[bool] = False  # the exporter holds the whole model in memory (else streams layers)
    shards_by_tp: ClassVar[bool] = False  # its weight files depend on tensor_parallel (else targets share them)
    repacks_layers: ClassVar[bool] = False  # writes the layers' codes in its own layout a block at a time
    # 8-bit codes are written as the canonical form stores them: read through mmap, never copied (the planner's cost)
    passes_8bit_codes: ClassVar[bool] = False
    # the weights outside the layers are written unchanged, last, as shard files of their own once they exceed one
    # shard: byte-identical between the formats that set this, so the store keeps one copy (hard links)
    outer_weights_as_stored: ClassVar[bool] = False
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
    unquantized_elem: ClassVar[int | None] = None
    per_input_bytes: ClassVar[int] = 0
    copies_tokenizer_files: ClassVar[bool] = True
    # The Python packages its exporter imports beyond torch and safetensors: `llmc build` imports them before its
    # first stage (llmc.runtimes.registry.import_libraries), so that a broken install fails before any weight loads
    # and an export's time is its own work (compressed-tensors' import takes 0.4-2 s, longer than exporting a
    # 135M model's FP8 weights)
    libraries: ClassVar[tuple[str, ...]] = ()

    def code_bytes(self, weights: TensorSpec) -> float:
        """Bytes one quantized weight's code takes in its files: packed at its bits (microscaling: with its
        block scales)."""
        return weights.stored_bits / 8

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

    def check_scheme(self, scheme: Scheme) -> None:
        """Raise IncompatibleTargetError when the format (or the kernel it feeds) cannot hold the scheme."""

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


@dataclass(frozen=True)
class MatrixRow:
    runtime: str  # as shown in the table
    format: str
    versions: tuple[str, ...]


@dataclass
class Runtime:
    """One serving runtime: what it runs (rules by capability key), its known releases, the format it reads."""

    name: str
    format: str  # the artifact format its targets get
    rules: dict[str, Rule]
    known_versions: tuple[str, ...]
    # model_type -> why this runtime does not serve that family from its format's artifact (the source read), for
    # families the format itself writes (`ArtifactFormat.moe_families`): refused at plan time
    refused_families: dict[str, str] = field(default_factory=dict)
    # the scheme keys its fused-MoE layer runs for a Mixture-of-Experts model (None: every key in `rules`), and where
    # that was read; "W8A8-INT8" there means dynamic per-token activations only (`registry.check_moe_scheme`)
    moe_schemes: frozenset[str] | None = None
    moe_schemes_source: str = ""

    def format_for(self, version: str | None) -> str:
        """The artifact format a target pinned to `version` (a PEP 440 range, or None) gets."""
        del version
        return self.format

    def plan_warnings(self, scheme: Scheme) -> list[str]:
        """What the plan should tell the user this runtime changes in the scheme (empty: nothing)."""
        del scheme
        return []

    def matrix_rows(self) -> list[MatrixRow]:
        return [MatrixRow(self.name, self.format, self.known_versions)]


def read_json(path: Path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (recognizers must not raise)."""
    import json

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
    from llmc.formats.files import SERVE_FILE

    serve = read_json(Path(folder) / SERVE_FILE)
    return [f"  serve with: {serve['command']}"] if serve and "command" in serve else []
