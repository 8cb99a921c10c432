"""What a runtime target is, as types: capability rules and runtimes.

A *runtime* (vLLM, TensorRT-LLM, llama.cpp, ...) runs some schemes on some GPU archs from some version on
(its `Rule`s), and reads one artifact *format* (`llmc.formats.base.ArtifactFormat`, by name) for a given version
range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.quant.spec import KV_CACHE_SCHEMES, Scheme
from llmc.runtimes.names import ARCH_ORDER


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
    # families the format itself writes (`llmc.formats.base.ArtifactFormat.moe_families`): refused at plan time
    refused_families: dict[str, str] = field(default_factory=dict)
    # the scheme keys its fused-MoE layer runs for a Mixture-of-Experts model (None: every key in `rules`), and where
    # that was read; "W8A8-INT8" there means dynamic per-token activations only (`registry.check_moe_scheme`)
    moe_schemes: frozenset[str] | None = None
    moe_schemes_source: str = ""
    # the W8A8-FP8 layouts its fused-MoE FP8 method loads, each (weight strategy, activation strategy, activations
    # dynamic), and where that was read (None: every layout its rules admit); `registry.check_moe_scheme` refuses others
    moe_fp8_layouts: frozenset[tuple[str, str, bool]] | None = None
    moe_fp8_layouts_source: str = ""
    # model_type -> the artifact formats this runtime reads for that family instead of `format`, in the order they are
    # tried (gpt-oss: OpenAI's own MXFP4 layout, llmc.formats.gpt_oss_mxfp4, then Quark's FP8 one,
    # llmc.formats.gpt_oss_quark): a scheme gets the first whose `check_scheme` takes it, whose `check_model` then
    # decides, in place of `refused_families`, which still says why `format`'s artifact of the family is not read
    family_formats: dict[str, tuple[str, ...]] = field(default_factory=dict)

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
