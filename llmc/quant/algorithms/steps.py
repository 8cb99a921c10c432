"""A scheme's algorithm steps, composed and resolved: all the layer stream and the build ask about them.

`AlgorithmSteps.of(scheme)` looks up the steps of `scheme.algorithm` in the registry, validates the scheme's options
against the steps' option models (one ValueError "<what>; fix: <how>" for an unknown option or a bad value) and
resolves the defaults that depend on the scheme or the composition. Per layer the stream then asks it what to
observe, runs its transform (if any) and its quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, ValidationError
from torch import nn

from llmc.quant.algorithms.registry import (
    ALGORITHMS,
    Algorithm,
    AlgorithmOptions,
    Context,
    Observe,
    Propagate,
    steps_of,
)
from llmc.quant.numerics import QuantizedWeight, block_scaled
from llmc.quant.spec import Scheme


class PropagateOptions(AlgorithmOptions):
    """Options of the layer stream itself, given wherever a step calibrates.

    propagate: which outputs of layer i the calibration of layer i+1 sees. By default the quantized layer's when
    a step asks for it (GPTQ, AWQ: as llm-compressor's sequential pipeline does; GPTQ calibrated on original
    outputs measured 56-70% worse perplexity change on SmolLM2 W4A16), else the original layer's (RTN,
    SmoothQuant: as ModelOpt does, one layer forward per layer instead of two; SmoothQuant W8A8: 0.48x
    llm-compressor's time instead of 0.81x, perplexity 43.997 vs 43.910 mean over three seeds; llm-compressor
    44.026; docs/calibration.md)."""

    propagate: Propagate | None = Field(
        default=None,
        description="'quantized' (next layer sees this layer quantized) or 'original' (sees it unquantized: "
        "one forward per layer instead of two)",
    )


def _validated(model: type[AlgorithmOptions], raw: dict) -> AlgorithmOptions:
    """`model` from the options it declares; ValueError in the recipe's "<what>; fix: <how>" form."""
    try:
        return model.model_validate({k: v for k, v in raw.items() if k in model.model_fields})
    except ValidationError as e:
        err = e.errors()[0]
        key, msg = err["loc"][0], err["msg"]
        raise ValueError(f"options.{key} = {err['input']!r}: {msg[:1].lower()}{msg[1:]}; "
                         f"fix: set options.{key} to {model.model_fields[key].description}") from None


@dataclass(frozen=True)
class Step:
    algorithm: Algorithm
    given: AlgorithmOptions  # as the scheme states them (checks need what was explicit)
    options: AlgorithmOptions  # resolved: every default filled in
    context: Context

    @property
    def name(self) -> str:
        return self.algorithm.name


@dataclass(frozen=True)
class AlgorithmSteps:
    scheme: Scheme
    steps: tuple[Step, ...]  # the transform (if any), then the quantizer
    propagate: Propagate

    @classmethod
    def of(cls, scheme: Scheme) -> AlgorithmSteps:
        algorithms = steps_of(scheme.algorithm)
        raw = dict(scheme.algorithm_options)
        calibrates = any(a.calibrates for a in algorithms)
        models = ([PropagateOptions] if calibrates else []) + [a.options for a in algorithms]
        known = set().union(*(m.model_fields for m in models))
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"options {', '.join(unknown)} do not apply to algorithm {scheme.algorithm}; "
                f"fix: use {', '.join(sorted(known)) or 'no options'}"
            )
        wanted = "quantized" if any(a.propagate == "quantized" for a in algorithms) else "original"
        propagate = _validated(PropagateOptions, raw).propagate or wanted
        steps = []
        for i, a in enumerate(algorithms):
            given = _validated(a.options, raw)
            context = Context(scheme, propagate, after_transform=any(b.kind == "transform" for b in algorithms[:i]))
            steps.append(Step(a, given, given.resolve(context), context))
        return cls(scheme, tuple(steps), propagate)

    @property
    def transforms(self) -> tuple[Step, ...]:
        return self.steps[:-1]

    @property
    def quantizer(self) -> Step:
        return self.steps[-1]

    @property
    def calibrates(self) -> bool:
        """Whether a step needs calibration data (static activation or KV-cache scales may need it anyway:
        `Scheme.needs_calibration`)."""
        return any(s.algorithm.calibrates for s in self.steps)

    @property
    def true_sequential(self) -> bool:
        """Whether the quantizer runs inside the forward that makes the next layer's inputs."""
        return self.quantizer.options.quantizes_in_forward()

    @property
    def observes_hessians(self) -> bool:
        return any(s.algorithm.hessians for s in self.steps)

    @property
    def replays_module_calls(self) -> bool:
        """True when a step keeps modules' calibration inputs to run them again (AWQ's search): memory."""
        return any(s.algorithm.module_calls for s in self.steps)

    @property
    def copies_whole_weights(self) -> bool:
        """True when a step makes float32 copies of a whole Linear (Hessian-based and smoothing algorithms); RTN
        works a block of rows at a time."""
        return bool(self.transforms) or self.observes_hessians

    @property
    def search_cost(self) -> tuple[int, int, int] | None:
        """The first step's search cost (`AlgorithmOptions.search_cost`), for the planner."""
        return next((c for c in (s.options.search_cost() for s in self.steps) if c is not None), None)

    @property
    def sums_over_windows(self) -> bool:
        """Whether the result depends on sums over the calibration windows (Hessians, AWQ's search), whose last bits
        may depend on how many ranks added them (llmc.distributed); ranges are maxima and do not."""
        return self.observes_hessians or self.replays_module_calls

    @property
    def shares_statistics(self) -> bool:
        """True when calibration sees original outputs and records only ranges (no Hessians, no module
        calls): its statistics are the model's and the data's, not the scheme's (`llmc.quant.shared_stats`)."""
        return self.propagate == "original" and not self.observes_hessians and not self.replays_module_calls

    @property
    def reads_statistics_after_transform(self) -> bool:
        """True when writing the scheme reads activation statistics after any weight transform: stored ranges,
        or the quantizer's Hessians."""
        return self.scheme.stores_ranges or self.observes_hessians

    @property
    def needs_inputs_after_transform(self) -> bool:
        """A transform whose result is observed again needs the layer's inputs: shared statistics cannot
        replace its calibration forward."""
        return bool(self.transforms) and self.reads_statistics_after_transform

    def observe(self, layer: nn.Module) -> Observe:
        calls = set()
        for s in self.steps:
            if s.algorithm.module_calls:
                calls |= set(s.algorithm.module_calls(layer))
        return Observe(hessians=self.observes_hessians, module_calls=tuple(sorted(calls)))

    def transform_layer(self, layer: nn.Module, prefix: str, stats) -> bool:
        """Apply the transform to `layer` in place; True when weights changed."""
        changed = False
        for s in self.transforms:
            changed = s.algorithm.layer(layer, prefix, stats, self.scheme.weights, s.options) or changed
        return changed

    def quantize_layer(self, linears: dict[str, nn.Linear], stats) -> dict[str, QuantizedWeight]:
        """Codes and scales for every target Linear, by the quantizer."""
        return self.quantizer.algorithm.layer(linears, stats, self.scheme.weights, self.quantizer.options)

    def stage_key_config(self) -> dict:
        """The algorithm's part of the quantize stage's key: `propagate`, and each step's own entry only where
        it has one, so the keys of schemes that existed before an entry did stay as they were."""
        cfg: dict = {"propagate": self.propagate}
        for s in self.steps:
            entry = s.options.stage_key()
            if entry:
                cfg[s.name] = entry
        return cfg

    def calibration_passes(self) -> float:
        """Forward passes over the calibration tokens the scheme costs (in model forwards): one to observe, one
        more through the quantized layer where a step calibrates, plus each step's own (AWQ's grid search)."""
        if not self.scheme.needs_calibration:
            return 0.0
        return 1.0 + float(self.calibrates) + sum(s.options.extra_calibration_passes() for s in self.steps)

    def check(self) -> None:
        """ValueError for what a recipe asks that the steps cannot do (the stream would quietly do otherwise)."""
        if block_scaled(self.scheme.weights):
            refused = [s.name for s in self.steps if not s.algorithm.block_scaled]
            if refused:
                able = sorted(n for n, a in ALGORITHMS.items() if a.block_scaled)
                raise ValueError(
                    f"algorithm {'+'.join(refused)} does not quantize {self.scheme.weights.describe()} weights in "
                    f"this llmc version; fix: algorithm {' or '.join(able)}")
        for s in self.steps:
            s.given.check(s.context)


def quantize_stage_config(scheme: Scheme) -> dict:
    """The algorithm-dependent entries of the quantize stage's config (`propagate`, `smoothquant`, `gptq`)."""
    return AlgorithmSteps.of(scheme).stage_key_config()


def calibration_passes(scheme: Scheme) -> float:
    return AlgorithmSteps.of(scheme).calibration_passes()
