"""Recipe schema v1: what to build, typed.

Every model forbids unknown keys. Checks that need only the recipe live here as validators and
raise ValueError with a message of the form "<what is wrong>; fix: <how>" — `load.py` turns those
into one RecipeError naming the key. Checks that need the model's shape or the runtime's
capabilities (the target registry, `llmc.runtimes`) live in `llmc.planning.plan`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from llmc.data.sources import BrownSource, DataSource, EvalCorpora
from llmc.engines import ENGINE_NAMES
from llmc.engines.registry import REFERENCE_ENGINE
from llmc.storage.paths import SAFE_NAME
from llmc.quant.algorithms.catalog import AlgorithmSteps, compose, steps_of
from llmc.quant.groups import check_layer_spec
from llmc.quant.spec import (BLOCK_SHAPE, FORMATS, ROLES, SCHEMES, ModuleGroup, ModuleTargets, Scheme, TensorSpec,
                             pair_name, weight_kind)
from llmc.runtimes.names import ARCH_ORDER, RUNTIME_NAMES

SCHEMA_VERSION = 1

Runtime = Literal[RUNTIME_NAMES]  # every runtime in the target registry (a test keeps the two equal)
GpuArch = Literal[("cpu", *ARCH_ORDER)]  # every arch the runtimes' rules know (llmc.runtimes.names)


class _Strict(BaseModel):
    # NaN and ±inf are no setting of anything; every number below also has a range (`ge`/`le`)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSection(_Strict):
    source: str = Field(
        description="'demo:smollm2-135m', a local Hugging Face folder, or a local .gguf file"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="the dtype weights are held and unquantized tensors stored in; auto: the checkpoint's own "
        "(bf16 for most Hub models), float32 only inside the arithmetic that needs it (llmc.model.dtype)")
    name: str | None = Field(default=None, pattern=SAFE_NAME, description="name used in the registry")
    config: str | None = Field(
        default=None, max_length=4096,
        description="a copy of the model's config.json (relative to the recipe's folder) that `llmc plan` reads when "
        "the source is not on this machine (a Hub id offline): shapes, memory, disk and time without the weights")

    @model_serializer(mode="wrap")
    def _compact(self, handler):
        return _drop_defaults(handler(self), {"config": None})


class TensorQuant(_Strict):
    format: Literal["fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "mxfp8"]
    strategy: Literal["tensor", "channel", "group", "token", "block"] = Field(
        description="block: weights only, fp8_e4m3, one scale per {}x{} tile (block-wise FP8)".format(*BLOCK_SHAPE))
    group_size: int | None = Field(default=None, ge=1, le=65536)
    symmetric: bool = True
    dynamic: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> "TensorQuant":
        if self.strategy == "group":
            if self.group_size is None:
                raise ValueError(
                    "strategy 'group' needs group_size; fix: add group_size: 128 (or 64/32)"
                )
            if self.group_size <= 0 or self.group_size % 16:
                raise ValueError(
                    f"group_size {self.group_size} is not a positive multiple of 16; "
                    "fix: use 32, 64, 128 or 256"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"group_size is only meaningful with strategy 'group' (strategy is '{self.strategy}'); "
                "fix: remove group_size or set strategy: group"
            )
        block = FORMATS[self.format].scale_block
        if block is not None and (self.strategy != "group" or self.group_size != block):
            raise ValueError(f"{self.format} uses {block}-element groups; fix: strategy: group, group_size: {block}")
        if block is not None and not self.symmetric:
            raise ValueError(f"{self.format} is symmetric only; fix: remove symmetric: false")
        if self.format == "fp8_e4m3" and not self.symmetric:
            raise ValueError("fp8_e4m3 is symmetric only; fix: remove symmetric: false")
        return self

    def to_spec(self) -> TensorSpec:
        return TensorSpec(
            format=self.format,
            strategy=self.strategy,
            group_size=self.group_size,
            symmetric=self.symmetric,
            dynamic=self.dynamic,
        )


class WeightQuant(TensorQuant):
    scale_grid: Literal["float", "fp8_row"] | None = Field(
        default=None,
        description="'fp8_row': group scales on the per-row FP8 grid vLLM's W4A8-FP8 kernel converts them to, so "
        "the served weights are the ones calibrated and scored; 'float': plain float32 scales. Default: fp8_row for "
        "int4 groups with dynamic per-token fp8 activations (vLLM's W4AFP8) quantized by rtn or gptq, float otherwise "
        "(awq on the grid measured worse than plain scales)",
    )

    @model_validator(mode="after")
    def _weights(self) -> "WeightQuant":
        if self.strategy == "token":
            raise ValueError(
                "weights have no 'token' strategy; fix: use tensor, channel or group"
            )
        if self.dynamic:
            raise ValueError("weights are always static; fix: remove dynamic: true")
        if self.strategy == "block" and self.format != "fp8_e4m3":
            raise ValueError(f"strategy 'block' is block-wise FP8, not {self.format}; fix: format: fp8_e4m3, or "
                             "strategy group/channel")
        if self.scale_grid == "fp8_row" and (self.format != "int4" or self.strategy != "group" or not self.symmetric):
            raise ValueError(
                "scale_grid fp8_row is for symmetric int4 group scales (vLLM's W4A8-FP8 kernel); "
                "fix: remove scale_grid, or use format int4, strategy group, symmetric"
            )
        return self


class ActivationQuant(TensorQuant):
    @model_validator(mode="after")
    def _activations(self) -> "ActivationQuant":
        if self.strategy == "block":
            raise ValueError("activations have no 'block' strategy; block-wise FP8 takes dynamic groups of 128; "
                             "fix: strategy: group, group_size: 128, dynamic: true")
        fp8_groups = self.format == "fp8_e4m3" and self.strategy == "group"  # block-wise FP8's 1x128 groups
        if fp8_groups and (self.group_size != BLOCK_SHAPE[1] or not self.dynamic):
            raise ValueError(f"fp8_e4m3 activation groups are block-wise FP8's dynamic 1x{BLOCK_SHAPE[1]} groups; "
                             f"fix: group_size: {BLOCK_SHAPE[1]}, dynamic: true")
        if self.strategy in ("channel", "group") and not FORMATS[self.format].microscaling and not fp8_groups:
            raise ValueError(
                f"activation strategy '{self.strategy}' has no runtime kernel; "
                "fix: use tensor (static or dynamic) or token (dynamic)"
            )
        if self.format in ("mxfp4", "mxfp8") and not self.dynamic:
            raise ValueError(f"{self.format} activations are scaled per block at run time; fix: dynamic: true")
        if self.format == "nvfp4" and self.dynamic:
            raise ValueError("nvfp4 activations take a calibrated global scale (their block scales are computed at "
                             "run time anyway); fix: remove dynamic: true")
        if self.strategy == "token" and not self.dynamic:
            raise ValueError(
                "per-token activation scales are computed at run time; fix: set dynamic: true"
            )
        if self.format == "int4":
            raise ValueError(
                "4-bit integer activations have no runtime kernel; fix: use int8 or fp8_e4m3"
            )
        return self


class KvCacheQuant(_Strict):
    format: Literal["fp8_e4m3", "int8"]


# A module group's `scheme: <name>` (`SCHEMES`' names) spelled out: compressed-tensors' preset of the same name where
# it has one (W8A8-FP8 its "FP8": per-tensor weights, static per-tensor activations, what ModelOpt's FP8 also is;
# W4A16-NVFP4 its "NVFP4A16"), so every exporter that writes the scheme at all writes these settings. A group gives
# `weights:` / `activations:` instead for other settings.
SCHEME_SETTINGS: dict[str, dict] = {
    "W8A8-FP8": {"weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                 "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
    "W8A16-FP8": {"weights": {"format": "fp8_e4m3", "strategy": "channel"}},
    "W8A8-INT8": {"weights": {"format": "int8", "strategy": "channel"},
                  "activations": {"format": "int8", "strategy": "token", "dynamic": True}},
    "W8A16-INT8": {"weights": {"format": "int8", "strategy": "channel"}},
    "W4A16-INT": {"weights": {"format": "int4", "strategy": "group", "group_size": 128}},
    "W4AFP8": {"weights": {"format": "int4", "strategy": "group", "group_size": 128},
               "activations": {"format": "fp8_e4m3", "strategy": "token", "dynamic": True}},
    "W4A4-NVFP4": {"weights": {"format": "nvfp4", "strategy": "group", "group_size": 16},
                   "activations": {"format": "nvfp4", "strategy": "group", "group_size": 16}},
    "W4A16-NVFP4": {"weights": {"format": "nvfp4", "strategy": "group", "group_size": 16}},
    "W4A16-MXFP4": {"weights": {"format": "mxfp4", "strategy": "group", "group_size": 32}},
    "W8A8-MXFP8": {"weights": {"format": "mxfp8", "strategy": "group", "group_size": 32},
                   "activations": {"format": "mxfp8", "strategy": "group", "group_size": 32, "dynamic": True}},
    "W8A8-FP8-BLOCK": {"weights": {"format": "fp8_e4m3", "strategy": "block"},
                       "activations": {"format": "fp8_e4m3", "strategy": "group", "group_size": BLOCK_SHAPE[1],
                                       "dynamic": True}},
}


def _scheme_pair_error(weights: "WeightQuant", activations: "ActivationQuant | None") -> str | None:
    """What is wrong with a weight/activation pair no runtime executes, in the recipe's form; None when it is one."""
    pair = (weight_kind(weights.format, weights.strategy), activations.format if activations else None)
    if pair not in SCHEMES:
        known = ", ".join(f"{pair_name(*p)} ({name})" for p, name in SCHEMES.items())
        return (f"weights {pair[0]} with activations {pair[1] or 'none'} is not a scheme any runtime executes; "
                f"fix: pick one of {known}")
    a = activations
    groups = a is not None and a.format == "fp8_e4m3" and a.strategy == "group"
    if (weights.strategy == "block") != groups:
        return ("block-wise FP8 pairs 128x128 weight blocks with dynamic 1x128 activation groups, and only those; "
                "fix: weights {format: fp8_e4m3, strategy: block}, activations {format: fp8_e4m3, strategy: group, "
                "group_size: 128, dynamic: true}")
    return None


def _scale_grid(weights: "WeightQuant", activations: "ActivationQuant | None",
                algorithm: str) -> Literal["fp8_row"] | None:
    """The weights' scale_grid, or its default: vLLM's W4A8-FP8 kernel (int4 groups x dynamic per-token FP8) rounds
    group scales onto a per-row FP8 grid at load, so RTN and GPTQ quantize on that grid from the start. Not an
    algorithm registered with fp8_row_by_default False: AWQ, measured worse on the grid (awq.py)."""
    grid = weights.scale_grid
    if grid is None:
        a = activations
        vllm_w4afp8 = (weights.format == "int4" and weights.strategy == "group" and weights.symmetric
                       and a is not None and a.format == "fp8_e4m3" and a.strategy == "token")
        on_grid = all(step.fp8_row_by_default for step in steps_of(algorithm))
        grid = "fp8_row" if vllm_w4afp8 and on_grid else "float"
    return None if grid == "float" else grid


class ModuleGroupSection(_Strict):
    """One group of a mixed-precision quantization: the Linears it selects (every criterion given at once) and
    their scheme, or `ignore: true` to leave them unquantized."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    scheme: Literal[tuple(SCHEME_SETTINGS)] | None = Field(
        default=None, description="a scheme name (W8A8-FP8, W4A16-NVFP4, ...; SCHEME_SETTINGS spells each out), or "
        "give weights (and activations) instead")
    weights: WeightQuant | None = None
    activations: ActivationQuant | None = None
    ignore: bool = Field(default=False, description="leave the group's Linears unquantized (the model's dtype)")
    names: tuple[str, ...] = Field(default=(), description="module names: exact, a trailing part ('o_proj'), or "
                                   "'re:<regex>' matched from the start of the full name, as quantization.ignore")
    roles: tuple[Literal[ROLES], ...] = Field(
        default=(), description="attention, mlp, experts, shared_experts, router: as the model family's table names "
        "its Linears (llmc.model.families.LINEAR_ROLES)")
    layers: tuple[int | str, ...] = Field(
        default=(), description="decoder layers: 'first N', 'last N', an index or a range 'I-J'; none: every layer")
    exclude_layers: tuple[int | str, ...] = Field(default=(), description="decoder layers left out, as layers")

    @field_validator("names")
    @classmethod
    def _name_regexes(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        return QuantizationSection._ignore_regexes(patterns)

    @field_validator("layers", "exclude_layers")
    @classmethod
    def _layer_specs(cls, specs: tuple[int | str, ...]) -> tuple[str, ...]:
        return tuple(check_layer_spec(str(s)) for s in specs)

    @model_validator(mode="after")
    def _one_scheme(self) -> "ModuleGroupSection":
        given = [k for k, v in (("scheme", self.scheme), ("weights", self.weights), ("ignore", self.ignore)) if v]
        if len(given) != 1:
            raise ValueError(f"group {self.name} gives {' and '.join(given) or 'no scheme'}; fix: give exactly one of "
                             "scheme: <name>, weights: {...} (with activations: {...} if any), or ignore: true")
        if self.activations is not None and self.weights is None:
            raise ValueError(f"group {self.name} gives activations without weights; fix: add weights: {{...}}, or "
                             "use scheme: <name>")
        if not (self.names or self.roles or self.layers):
            raise ValueError(f"group {self.name} selects nothing in particular; fix: give names, roles or layers")
        if self.weights is not None:
            problem = _scheme_pair_error(self.weights, self.activations)
            if problem:
                raise ValueError(f"group {self.name}: {problem}")
        return self

    def quant(self) -> tuple[WeightQuant | None, ActivationQuant | None]:
        """The group's weight and activation settings (None, None: unquantized)."""
        if self.scheme is not None:
            settings = SCHEME_SETTINGS[self.scheme]
            acts = settings.get("activations")
            return WeightQuant(**settings["weights"]), ActivationQuant(**acts) if acts else None
        return self.weights, self.activations

    def to_group(self, algorithm: str) -> ModuleGroup:
        weights, acts = self.quant()
        targets = ModuleTargets(names=self.names, roles=self.roles, layers=self.layers,
                                exclude_layers=self.exclude_layers)
        if weights is None:
            return ModuleGroup(self.name, targets)
        return ModuleGroup(self.name, targets, replace(weights.to_spec(), scale_grid=_scale_grid(weights, acts, algorithm)),
                           acts.to_spec() if acts else None)


class SearchBudget(_Strict):
    """What the searched mix may take: its decoder-layer Linears' stored bytes (as `llmc plan` counts a group's
    bytes), or the same as effective bits per weight."""

    effective_bits: float | None = Field(default=None, gt=0, le=64)
    bytes: int | None = Field(default=None, gt=0, le=2**60)

    @model_validator(mode="after")
    def _one(self) -> "SearchBudget":
        if (self.effective_bits is None) == (self.bytes is None):
            raise ValueError("quantization.search.budget gives both or neither of effective_bits and bytes; fix: give "
                             "exactly one, e.g. budget: {effective_bits: 5.5}")
        return self


class SearchCandidate(_Strict):
    """A search candidate spelled out (`quantization.search.candidates`), for settings no scheme name has: e.g. a
    llama.cpp target's Q4_0, `{name: Q4_0, weights: {format: int4, strategy: group, group_size: 32}}`, which GGUF
    stores in its own blocks of 32 exactly."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                      description="what the plan, the groups (search-<name>) and the records call it")
    weights: WeightQuant
    activations: ActivationQuant | None = None

    @model_validator(mode="after")
    def _runs(self) -> "SearchCandidate":
        if self.name in SCHEME_SETTINGS or self.name == "bf16":
            raise ValueError(f"search candidate {self.name} spells out settings under a scheme's own name; fix: name "
                             f"it otherwise (e.g. {self.name}-custom), or give the name alone for its usual settings")
        problem = _scheme_pair_error(self.weights, self.activations)
        if problem:
            raise ValueError(f"search candidate {self.name}: {problem}")
        return self


class SearchSection(_Strict):
    """Mixed precision chosen by measurement (llmc.quant.search): each unit's damage under each candidate is measured
    on the calibration activations while its layer is resident, and an exact knapsack picks the mix of least
    predicted damage within the budget."""

    candidates: tuple[Literal[(*SCHEME_SETTINGS, "bf16")] | SearchCandidate, ...] = Field(
        min_length=2, description="scheme names (W4A16-NVFP4, W8A8-FP8, ...), candidates spelled out ({name, weights, "
        "activations}) and bf16 (left in the model's dtype); those a target runtime cannot run at its arch are "
        "removed at plan time, with the reason")
    budget: SearchBudget
    granularity: Literal["layer", "role", "linear"] = Field(
        default="role", description="what one unit is: a decoder layer, a role of one (attention, mlp, ...), or one "
        "Linear (fused siblings of a fusing runtime stay one unit)")
    protect: tuple[str, ...] = Field(
        default=(), description="Linears kept in the model's dtype, not searched: layer selectors ('first 1', 'last 1', "
        "'3-5') or module names (exact, a trailing part, or 're:<regex>')")
    proxy: Literal["fisher", "output", "update", "token"] = Field(
        default="fisher", description="each unit's damage: fisher (default; the loss gradient at the layer's output "
        "squared times the output's change squared, an estimate of the end-to-end KL divergence, a backward pass "
        "layer by layer after the forward), or from the forward alone: the output's relative squared error (output), "
        "relative to the layer's update (update), or per token (token); llmc.quant.search.layer_damages")

    @field_validator("candidates")
    @classmethod
    def _distinct(cls, v: tuple) -> tuple:
        names = [c if isinstance(c, str) else c.name for c in v]
        if len(set(names)) != len(names):
            raise ValueError(f"quantization.search.candidates repeat: {names}; fix: name each candidate once")
        if all(c == "bf16" for c in v):
            raise ValueError("quantization.search.candidates holds no scheme; fix: add a scheme such as W4A16-NVFP4")
        return v

    @field_validator("protect")
    @classmethod
    def _protect_patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        QuantizationSection._ignore_regexes(tuple(p for p in v if p.startswith("re:")))  # refused regexes: exit 2
        return tuple(p.strip() for p in v)

    @property
    def names(self) -> tuple[str, ...]:
        """The candidates' names, in the recipe's order (bf16 among them where given)."""
        return tuple(c if isinstance(c, str) else c.name for c in self.candidates)

    def members(self, algorithm: str) -> dict[str, ModuleGroup]:
        """Each scheme candidate's formats, as a group of that scheme would have them (scale grid defaults too)."""
        def group(c) -> ModuleGroupSection:
            if isinstance(c, str):
                return ModuleGroupSection(name="candidate", scheme=c, roles=("attention",))
            return ModuleGroupSection(name="candidate", weights=c.weights, activations=c.activations,
                                      roles=("attention",))

        return {name: group(c).to_group(algorithm) for name, c in zip(self.names, self.candidates) if c != "bf16"}


class QuantizationSection(_Strict):
    weights: WeightQuant | None = Field(default=None, description="the weights' format (or give groups)")
    activations: ActivationQuant | None = None
    kv_cache: KvCacheQuant | None = None
    algorithm: str = Field(
        default="rtn",
        description="rtn, gptq, smoothquant or awq, or a list applied in order: a transform (smoothquant, awq) then "
        "a quantizer (rtn, gptq; rtn when none is named), e.g. [smoothquant, gptq], also spelled smoothquant+gptq",
    )
    ignore: tuple[str, ...] = ("lm_head",)
    options: dict[str, float | int | bool | str] = Field(
        default_factory=dict, description="the algorithm's options, e.g. smoothquant alpha (llmc.quant.algorithms)"
    )
    groups: tuple[ModuleGroupSection, ...] = Field(
        default=(), description="mixed precision: groups of Linears, each with its own scheme (or ignore: true), "
        "selected by names, roles and layers; every Linear not in `ignore` must be in exactly one group (checked "
        "against the model at plan time). Algorithm, options and kv_cache apply to every group")
    search: SearchSection | None = Field(
        default=None, description="mixed precision chosen by measurement within a budget (llmc.quant.search); groups "
        "and search are exclusive (search.protect keeps Linears out of it)")

    @model_serializer(mode="wrap")
    def _compact(self, handler):  # plain quantizations dump (stage keys, build ids) as before groups existed
        return _drop_defaults(handler(self), {"groups": [], "weights": None, "search": None})

    @field_validator("ignore")
    @classmethod
    def _ignore_regexes(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        """Compile every 're:' pattern now, with the linear-time matcher the build uses (llmc.inputs.patterns): a
        bad one, or one it cannot run (a backreference, a lookaround), is the recipe's error, not a crash or a
        hang mid-build."""
        from llmc.inputs.patterns import PatternRefused, check_patterns

        try:
            check_patterns(patterns)
        except PatternRefused as e:
            raise ValueError(f"{e.message}; fix: {e.fix}") from None
        return patterns

    @field_validator("algorithm", mode="before")
    @classmethod
    def _composed(cls, v: object) -> str:
        return compose(v)  # one "+"-joined spelling, so a list and the string give the same scheme and keys

    @model_validator(mode="after")
    def _pair(self) -> "QuantizationSection":
        if self.search is not None:
            return self._searched()
        if self.groups:
            return self._mixed()
        if self.weights is None:
            raise ValueError("quantization gives neither weights nor groups; fix: add weights: {format: ..., "
                             "strategy: ...}, or groups: [...] for mixed precision")
        problem = _scheme_pair_error(self.weights, self.activations)
        if problem:
            raise ValueError(problem)
        AlgorithmSteps.of(self.to_scheme()).check()  # unknown options, bad values, what the algorithm cannot do
        return self

    def _mixed(self) -> "QuantizationSection":
        if self.weights is not None or self.activations is not None:
            raise ValueError("quantization gives groups and also weights/activations; fix: give each group its "
                             "scheme, and remove the top-level weights and activations")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names repeat: {names}; fix: give each group a distinct name")
        scheme = self.to_scheme()
        if not scheme.members():
            raise ValueError("every group is ignore: true, so nothing is quantized; fix: give a group a scheme")
        pipeline = AlgorithmSteps.of(scheme)
        if pipeline.transforms or pipeline.true_sequential:
            raise ValueError(
                f"mixed-precision groups are quantized by rtn, or gptq with options.true_sequential: false, in this "
                f"llmc version, not {scheme.algorithm}"
                + (" (true-sequential)" if pipeline.true_sequential else "")
                + "; fix: algorithm: rtn, or algorithm: gptq with options: {true_sequential: false}")
        for group, member in scheme.members().items():
            try:
                AlgorithmSteps.of(member).check()  # what the quantizer cannot do for this group's scheme
            except ValueError as e:
                raise ValueError(f"group {group} ({member.name}): {e}") from None
        return self

    def _searched(self) -> "QuantizationSection":
        if self.weights is not None or self.activations is not None:
            raise ValueError("quantization gives search and also weights/activations; fix: name the schemes in "
                             "search.candidates, and remove the top-level weights and activations")
        scheme = self.to_scheme()
        pipeline = AlgorithmSteps.of(scheme)
        if pipeline.transforms or pipeline.true_sequential:
            raise ValueError("a searched mix is quantized by rtn, or gptq with options.true_sequential: false, in this "
                             f"llmc version, not {self.algorithm}; fix: algorithm: rtn, or algorithm: gptq with "
                             "options: {true_sequential: false}")
        for candidate, group in self.search.members(self.algorithm).items():
            try:
                AlgorithmSteps.of(scheme.member(group)).check()  # what the quantizer cannot do for this candidate
            except ValueError as e:
                raise ValueError(f"search candidate {candidate}: {e}") from None
        if self.groups:
            raise ValueError("quantization gives both search and groups, so the same Linears would have a scheme from "
                             "each; fix: keep one of the two — to keep Linears out of the search, list them in "
                             "search.protect (left in the model's dtype) or quantization.ignore")
        return self

    def weight_scale_grid(self) -> Literal["fp8_row"] | None:
        """The recipe's scale_grid, or its default (`_scale_grid`)."""
        return _scale_grid(self.weights, self.activations, self.algorithm)

    def to_scheme(self) -> Scheme:
        """The scheme; with `search`, a stand-in until the build's search resolves it (`llmc.pipeline.search`): every
        Linear under the scheme candidate that stores the most bytes (what the plan costs and checks first)."""
        groups = tuple(g.to_group(self.algorithm) for g in self.groups)
        if self.search is not None:
            members = self.search.members(self.algorithm)
            lead = members[max(members, key=lambda c: members[c].weights.stored_bits)]
            return Scheme(weights=lead.weights, activations=lead.activations,
                          kv_cache=TensorSpec(format=self.kv_cache.format, strategy="tensor") if self.kv_cache else None,
                          algorithm=self.algorithm, ignore=tuple(self.ignore),
                          algorithm_options=tuple(sorted(self.options.items())))
        if groups:  # the member with the fewest weight bits stands for the scheme (default gates)
            lead = min((g for g in groups if g.quantized), key=lambda g: g.weights.bits, default=None)
            weights, activations = (lead.weights, lead.activations) if lead else (TensorSpec("int8", "channel"), None)
        else:
            weights = replace(self.weights.to_spec(), scale_grid=self.weight_scale_grid())
            activations = self.activations.to_spec() if self.activations else None
        return Scheme(
            weights=weights,
            activations=activations,
            kv_cache=(
                TensorSpec(format=self.kv_cache.format, strategy="tensor")
                if self.kv_cache
                else None
            ),
            algorithm=self.algorithm,
            ignore=tuple(self.ignore),
            algorithm_options=tuple(sorted(self.options.items())),
            groups=groups,
        )


class Variant(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    quantization: QuantizationSection


def _drop_defaults(data: dict, defaults: dict) -> dict:
    """Keys added after a section shipped leave its dump (stage keys, build ids) while they hold their defaults."""
    def same(a, b) -> bool:  # a json dump gives lists where a python dump gives tuples
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b

    return {k: v for k, v in data.items() if not (k in defaults and same(v, defaults[k]))}


class CalibrationSection(_Strict):
    dataset: DataSource = Field(default=BrownSource(), description="a data source (llmc.data.sources): brown, "
                                "hf:<id>, or a mapping such as {kind: jsonl, path: x.jsonl, field: text}")
    packing: Literal["windows", "samples"] = Field(
        default="windows",
        description="windows: rows joined and cut into full seq_len windows (every token is text); samples: one "
        "row per sample, truncated to seq_len, each run at its own length (chat data: every sample's start is seen)",
    )
    samples: int = Field(default=32, ge=1, le=4096)
    seq_len: int = Field(default=512, ge=16, le=32768)
    seed: int = Field(default=0, ge=-(2**63), le=2**64 - 1, description="torch.Generator's seed range")
    spill_activations: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="keep the activations passed between layers on disk, one batch in memory at a time; "
        "auto: when two copies would take over a quarter of the available memory. Never changes results.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="where each decoder layer is calibrated and quantized; auto: the first CUDA GPU when "
        "torch sees one, else the CPU. Results agree to float rounding, not bit for bit, across devices.",
    )

    moe_calibrate_all_experts: bool = Field(
        default=False,
        description="Mixture-of-Experts: run every expert on every calibration token for statistics only (the "
        "layer's output stays the routed one), so no expert's scales rest on few tokens; costs one expert forward "
        "per token per expert instead of top-k (llm-compressor's moe_calibrate_all_experts)",
    )
    moe_min_tokens: int | None = Field(
        default=None, ge=0, le=2**40,
        description="Mixture-of-Experts: experts routed fewer calibration tokens are named in a warning; default: a "
        "tenth of an even share (tokens x top-k / experts / 10)",
    )
    stream_experts: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Mixture-of-Experts: read, calibrate, quantize and write a layer's routed experts one at a time "
        "(the router run once), so a layer is never whole in memory; auto: where the layer in the compute dtype is "
        "over half the available memory. Only RTN's ranges or a data-free scheme stream (each expert's statistics "
        "its own). Never changes results (llmc.quant.expert_stream)",
    )
    resume_every_s: float | None = Field(
        default=None, ge=0, le=86400,
        description="seconds between the quantize stage's resume points (the next layer's inputs saved, so a killed "
        "build resumes there): 0 makes every layer one; default: every layer, or every 60 s where the activations "
        "stay on the GPU (saving a layer's inputs there takes longer than computing it). The files are the same",
    )

    @model_serializer(mode="wrap")
    def _compact(self, handler):
        return _drop_defaults(handler(self), {"packing": "windows", "moe_calibrate_all_experts": False,
                                              "moe_min_tokens": None, "resume_every_s": None,
                                              "stream_experts": "auto"})


# runtimes whose llmc engine runs on the CPU (llama-cpp-python with no GPU layers, ONNX Runtime's
# CPUExecutionProvider): a target of one that leaves gpu_arch at its default (sm90) is shown as running on the CPU
CPU_ENGINE_RUNTIMES = frozenset({"llama.cpp", "ollama", "onnxruntime"})


class Target(_Strict):
    runtime: Runtime
    version: str | None = Field(
        default=None, description="PEP 440 specifier of the runtime versions to support, e.g. '>=0.9'"
    )
    gpu_arch: GpuArch = "sm90"
    tensor_parallel: int = Field(default=1, ge=1, le=64)
    # the artifact's folder name in the cache's labels and the registry (artifacts/<name>): one safe component
    name: str | None = Field(default=None, pattern=SAFE_NAME)
    triton: bool = Field(
        default=False,
        description="also lay the artifact out as a Triton Inference Server model repository "
        "(vllm/sglang/tgi targets: vLLM backend; onnxruntime and tensorrt: ONNX Runtime backend; "
        "tensorrt-llm with the ModelOpt checkpoint: Python backend on the LLM API)",
    )

    @field_validator("tensor_parallel")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(
                f"tensor_parallel {v} is not a power of two; runtimes shard over 1, 2, 4, 8 GPUs; "
                "fix: use 1, 2, 4 or 8"
            )
        return v

    @field_validator("version")
    @classmethod
    def _specifier(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        try:
            SpecifierSet(v)
        except InvalidSpecifier:
            raise ValueError(
                f"'{v}' is not a version range; fix: write it like '>=0.9,<0.12'"
            ) from None
        return v

    @property
    def label(self) -> str:
        return self.name or f"{self.runtime}-{self.gpu_arch}-tp{self.tensor_parallel}"

    @property
    def runs_on(self) -> str:
        """What the target runs on: its gpu_arch, or "cpu" where gpu_arch was left at its default and llmc scores
        the runtime on the CPU (CPU_ENGINE_RUNTIMES)."""
        if "gpu_arch" not in self.model_fields_set and self.runtime in CPU_ENGINE_RUNTIMES:
            return "cpu"
        return self.gpu_arch

    @property
    def shown_label(self) -> str:
        """The label `llmc plan` prints for the target: `label` with `runs_on` for a defaulted gpu_arch. Stage ids,
        cache keys and artifact names keep `label`: the arch is in the export's stage key
        (llmc.formats.base.target_key), so renaming it would orphan the exports already cached."""
        return self.name or f"{self.runtime}-{self.runs_on}-tp{self.tensor_parallel}"


class EvalSection(_Strict):
    corpus: EvalCorpora = Field(default=BrownSource(), description="a data source, as calibration.dataset, or "
                                "several: a list of sources or a mapping label -> source, each scored with the "
                                "same windows protocol and gated on its own")
    allow_calibration_overlap: bool = Field(
        default=False, description="accept evaluation documents that the calibration data also holds"
    )
    tasks: tuple[str, ...] = Field(
        default=(), description="lm-evaluation-harness tasks (names with offline data, or task YAML paths) run on "
        "the baseline and each artifact through the torch engine (optional extra: llmc[harness])",
    )
    task_limit: int | None = Field(default=None, ge=1, description="at most this many documents per task")
    seq_len: int = Field(default=512, ge=16, le=32768)
    windows: int = Field(default=16, ge=2, le=100000)
    batch_size: int = Field(default=4, ge=1, le=1024)
    decode_tokens: int = Field(default=16, ge=0, le=4096)
    throughput_repeats: int = Field(default=3, ge=1, le=100)
    throughput_batch_sizes: tuple[Annotated[int, Field(ge=1, le=1024)], ...] = Field(
        default=(1,),
        min_length=1,
        max_length=16,
        description="batch sizes tokens/s is measured at (torch engine; other engines measure batch 1); "
        "gates and the report's headline use the first",
    )
    bootstrap_samples: int = Field(default=1000, ge=100, le=100000)
    kl_top_k: int = Field(default=256, ge=1, le=4096, description="baseline log-probs kept per token for the top-k "
                          "KL bound (reported beside the exact KL; alone where that is unavailable)")
    runtimes: tuple[Literal[ENGINE_NAMES], ...] = Field(  # every engine in the engine registry
        default=(REFERENCE_ENGINE,),
        description="engines that evaluate each artifact they load: torch and vllm read compressed-tensors "
        "exports, llama.cpp reads GGUF exports, onnxruntime reads ONNX exports (both paired with the torch "
        "baseline; ONNX Q/DQ graphs too), tensorrt-llm reads ModelOpt checkpoints (NVIDIA GPU, its own environment), "
        "tensorrt builds an engine from ONNX Q/DQ graphs (NVIDIA GPU with the tensorrt package)",
    )

    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="where the torch reference engine scores (baseline and artifacts; one decoder layer at a time "
        "when the model does not fit); auto: the first CUDA GPU when torch sees one, else the CPU. Scores agree to "
        "float rounding across devices; other engines run where they run. Under torchrun: the CPU",
    )

    @model_serializer(mode="wrap")
    def _compact(self, handler):
        return _drop_defaults(handler(self), {"allow_calibration_overlap": False, "tasks": [], "task_limit": None,
                                              "device": "auto"})

    @model_validator(mode="after")
    def _tasks_run_on_torch(self) -> "EvalSection":
        if self.tasks and REFERENCE_ENGINE not in self.runtimes:
            raise ValueError(f"eval.tasks run through the {REFERENCE_ENGINE} engine; fix: add {REFERENCE_ENGINE} "
                             "to eval.runtimes")
        return self


class CorpusGates(_Strict):
    """Quality thresholds on one evaluation corpus (`gates.corpora.<label>`), replacing the recipe-wide ones it
    sets; the others apply as everywhere."""

    max_ppl_increase_pct: float | None = Field(default=None, gt=0, le=1e6)
    max_mean_kld: float | None = Field(default=None, gt=0, le=1e3)
    min_top1_agreement_pct: float | None = Field(default=None, gt=0, le=100)


class Gates(_Strict):
    """Thresholds applied to every artifact (docs/evaluation.md, "Default gates"). A recipe without a `gates:`
    section gets the default quality gates of each variant's scheme family (`defaults: true`); a `gates:`
    section holds exactly what it says, plus the defaults for the keys it leaves out when `defaults: true`."""

    defaults: bool = Field(
        default=False,
        description="start from the scheme family's default quality gates (8-bit / 4-bit, llmc.eval.gates); "
        "keys set here override them. A recipe without a gates section gets them",
    )
    allow_unevaluated: bool = Field(
        default=False,
        description="let a gate that no engine in eval.runtimes measured for an artifact pass, reported as not "
        "measured (default: it fails, so nothing publishes unmeasured)",
    )
    max_ppl_increase_pct: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="fail when the upper 95% bound of the paired perplexity increase exceeds this",
    )
    max_mean_kld: float | None = Field(
        default=None, gt=0, le=1e3,
        description="fail when the upper 95% bound of mean per-token KL(base||quant) exceeds this"
    )
    min_top1_agreement_pct: float | None = Field(
        default=None, gt=0, le=100, description="fail when the lower 95% bound of top-1 agreement is below this"
    )
    min_prefill_tokens_per_s: float | None = Field(default=None, gt=0, le=1e9)
    min_decode_tokens_per_s: float | None = Field(default=None, gt=0, le=1e9)
    min_task_accuracy_ratio: float | None = Field(
        default=None, gt=0, le=1, description="fail when an eval.tasks accuracy's lower 95% bound, divided by the "
        "baseline's accuracy, is below this")
    corpora: dict[str, CorpusGates] = Field(
        default={}, description="per evaluation corpus (a label of eval.corpus): quality thresholds that replace "
        "the ones above on that corpus; every gate applies on every corpus")

    @model_serializer(mode="wrap")
    def _compact(self, handler):
        return _drop_defaults(handler(self), {"min_task_accuracy_ratio": None, "corpora": {}})


class PublishSection(_Strict):
    registry: str = "./registry"
    # also push each build to the Hugging Face Hub (llmc.publish.hub): one branch per build
    hub: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$",
                            description="Hugging Face Hub repository 'org/name'")


class ResourcesSection(_Strict):
    max_hours: float | None = Field(
        default=None, gt=0, le=1e5,
        description="the longest this build may take: `llmc plan` and `llmc build` refuse (exit 4) before any weight "
                    "loads when the plan predicts more for the stages still to run")

    @model_serializer(mode="wrap")
    def _compact(self, handler):
        return _drop_defaults(handler(self), {"max_hours": None})


class Recipe(_Strict):
    version: Literal[1] = SCHEMA_VERSION
    name: str = Field(pattern=SAFE_NAME)  # the registry folder <registry>/<name>/
    model: ModelSection
    quantization: QuantizationSection | None = None
    variants: tuple[Variant, ...] = Field(
        default=(), description="several quantizations built, evaluated and reported side by side"
    )
    calibration: CalibrationSection = CalibrationSection()
    targets: tuple[Target, ...] = Field(min_length=1)
    eval: EvalSection = EvalSection()
    gates: Gates = Gates(defaults=True)  # no gates section: the scheme family's default gates
    publish: PublishSection = PublishSection()
    resources: ResourcesSection = ResourcesSection()

    @model_serializer(mode="wrap")
    def _compact(self, handler):  # recipes without a budget dump (job ids, manifests) as before it existed
        return _drop_defaults(handler(self), {"resources": {}})

    @model_validator(mode="after")
    def _quantization_or_variants(self) -> "Recipe":
        if (self.quantization is None) == (not self.variants):
            raise ValueError(
                "give either 'quantization' (one scheme) or 'variants' (a list of named quantizations); "
                "fix: keep exactly one of the two keys"
            )
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names repeat: {names}; fix: give each variant a distinct name")
        return self

    def variant_sections(self) -> list[tuple[str, QuantizationSection]]:
        """(name, quantization) for every scheme this recipe builds; one unnamed scheme -> ('', q)."""
        if self.quantization is not None:
            return [("", self.quantization)]
        return [(v.name, v.quantization) for v in self.variants]

    @model_validator(mode="after")
    def _corpus_gates_name_corpora(self) -> "Recipe":
        from llmc.data.sources import corpora_of

        labels = [x for x in corpora_of(self.eval.corpus) if x is not None]
        unknown = sorted(set(self.gates.corpora) - set(labels))
        if unknown:
            raise ValueError(
                f"gates.corpora names {unknown}, which eval.corpus does not label "
                f"({', '.join(labels) if labels else 'eval.corpus is one unlabelled corpus'}); fix: use a label of "
                "eval.corpus (a list labels its corpora brown / the file stem / the Hub id's last part), or give "
                "eval.corpus as a mapping label -> source")
        return self

    @model_validator(mode="after")
    def _unique_targets(self) -> "Recipe":
        labels = [t.label for t in self.targets]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(
                f"targets repeat {dupes}; fix: give each target a distinct runtime/gpu_arch/"
                "tensor_parallel or a name"
            )
        return self
