"""The registry of calibration algorithms: one record per algorithm, registered by its own module.

An algorithm is a pydantic options model (its recipe options and their defaults) and one layer function,
registered with what the layer stream must know about it:

    @register("awq", kind="transform", options=AwqOptions, propagate="quantized", module_calls=awq_module_calls)
    def awq_layer(layer, prefix, stats, weights, options) -> bool: ...

  kind "transform"  rewrites a layer's weights in place (SmoothQuant, AWQ): (layer, prefix, stats, weights,
                    options) -> True when weights changed;
  kind "quantizer"  turns each Linear's weight into codes and scales (RTN, GPTQ): (linears, stats, weights,
                    options) -> {name: QuantizedWeight}.

A scheme's `algorithm` names its steps, "+"-joined ("smoothquant+gptq"): at most one transform, then at most
one quantizer (RTN when none is named). `llmc.quant.algorithms.steps` composes and resolves them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict
from torch import nn

from llmc.quant.spec import Scheme
from llmc.registry import Registry

Propagate = Literal["original", "quantized"]
Kind = Literal["transform", "quantizer"]


@dataclass(frozen=True)
class Observe:
    """What the calibration pass over a layer must record for the scheme's algorithm."""

    hessians: bool
    module_calls: tuple[str, ...]  # layer-relative modules whose (args, kwargs) are kept per batch


@dataclass(frozen=True)
class Context:
    """What an algorithm's options are resolved against: the scheme, which outputs of layer i the calibration
    of layer i+1 sees, and whether a weight transform runs before this step in the same layer."""

    scheme: Scheme
    propagate: Propagate
    after_transform: bool


class AlgorithmOptions(BaseModel):
    """An algorithm's recipe options. Fields carry the defaults and, as `description`, the values they take
    (recipe errors quote it: "fix: set options.<key> to <description>")."""

    # strict: a recipe's `true` is no block size and "0.5" no alpha
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def resolve(self, context: Context) -> AlgorithmOptions:
        """These options with the defaults that depend on the scheme or the composition filled in."""
        del context
        return self

    def check(self, context: Context) -> None:
        """Raise ValueError ("<what>; fix: <how>") when the recipe asks what this algorithm cannot do."""
        del context

    def stage_key(self) -> dict | None:
        """What this algorithm adds to the quantize stage's key (None: nothing, so older keys stay valid)."""
        return None

    def extra_calibration_passes(self) -> float:
        """Calibration forwards (in model forwards) beyond observing a layer and propagating its outputs."""
        return 0.0

    def quantizes_in_forward(self) -> bool:
        """True when a quantizer quantizes each Linear inside the forward that makes the next layer's inputs
        (`llmc.quant.true_sequential`; GPTQ's, the only quantizer that can)."""
        return False

    def search_cost(self) -> tuple[int, int, int] | None:
        """What a step that searches over its inputs costs the planner (llmc.pipeline.quantize.quantize_cost): candidate
        scales per mapping, clipping ranges per Linear and the clip search's tokens; None when it searches nothing."""
        return None


@dataclass(frozen=True)
class Algorithm:
    name: str
    kind: Kind
    options: type[AlgorithmOptions]
    layer: Callable  # see the module doc for the two signatures
    calibrates: bool = True  # needs calibration data (RTN alone does not)
    propagate: Propagate = "original"  # outputs the next layer is calibrated on, unless options.propagate says
    hessians: bool = False  # observes every Linear input's Hessian
    module_calls: Callable[[nn.Module], tuple[str, ...]] | None = None  # modules whose calls it replays
    fp8_row_by_default: bool = True  # W4AFP8 for vLLM quantizes on the kernel's scale grid by default
    # quantizes (or, a transform, is measured before) microscaling and block-wise FP8 weights (llmc.quant.numerics
    # `block_scaled`); the others compute per-group float32 scales those formats do not store
    block_scaled: bool = False


ALGORITHMS: Registry[Algorithm] = Registry("algorithm")
DEFAULT_QUANTIZER = "rtn"  # what a list of transforms alone ends with


def register(name: str, *, kind: Kind, options: type[AlgorithmOptions], **facts) -> Callable[[Callable], Callable]:
    """Decorator: record the decorated layer function as algorithm `name` (facts: the other `Algorithm` fields)."""

    def record(layer: Callable) -> Callable:
        ALGORITHMS.add(name, Algorithm(name=name, kind=kind, options=options, layer=layer, **facts))
        return layer

    return record


def names() -> tuple[str, ...]:
    return tuple(sorted(ALGORITHMS))  # not registration order: that follows the package's imports


def _names_of(kind: Kind) -> str:
    return ", ".join(n for n in names() if ALGORITHMS[n].kind == kind)


def compose(algorithm: str | Sequence[str]) -> str:
    """The canonical "+"-joined spelling of an algorithm given as a list or a string; ValueError naming the
    value and the fix for unknown names and impossible orders. A transform followed by RTN is spelled as the
    transform alone ("smoothquant"), the name its cache keys have always had."""
    if isinstance(algorithm, str):
        steps = [s.strip() for s in algorithm.split("+")]
    elif isinstance(algorithm, Sequence) and all(isinstance(s, str) for s in algorithm):
        steps = [s.strip() for s in algorithm]
    else:
        raise ValueError(f"{algorithm!r} is not an algorithm; fix: give a name ({', '.join(names())}) or a list "
                         "of them applied in order, e.g. [smoothquant, gptq]")
    if not steps:
        raise ValueError(f"the algorithm list is empty; fix: name one of {', '.join(names())}")
    shown = "+".join(steps)
    for s in steps:
        if s not in ALGORITHMS:
            where = f" in '{shown}'" if len(steps) > 1 else ""
            raise ValueError(f"unknown algorithm '{s}'{where}; fix: use {', '.join(names())}, or a list of them "
                             "applied in order, e.g. [smoothquant, gptq]")
    kinds = [ALGORITHMS[s].kind for s in steps]
    if kinds.count("quantizer") > 1:
        raise ValueError(f"'{shown}' quantizes twice; fix: keep one quantizer ({_names_of('quantizer')}), last")
    if "quantizer" in kinds[:-1]:
        raise ValueError(f"'{shown}' rewrites weights after quantizing them; fix: put the transform "
                         f"({_names_of('transform')}) first, the quantizer ({_names_of('quantizer')}) last")
    if kinds.count("transform") > 1:
        # the second would search its scales on inputs observed before the first changed the weights
        raise ValueError(f"'{shown}' has more than one weight transform; fix: keep one of "
                         f"{_names_of('transform')}")
    if len(steps) > 1 and steps[-1] == DEFAULT_QUANTIZER:
        steps = steps[:-1]
    return "+".join(steps)


def steps_of(algorithm: str) -> tuple[Algorithm, ...]:
    """The registered steps of a composed algorithm, ending with its quantizer (RTN when none is named)."""
    steps = tuple(ALGORITHMS[s] for s in compose(algorithm).split("+"))
    return steps if steps[-1].kind == "quantizer" else (*steps, ALGORITHMS[DEFAULT_QUANTIZER])


def algorithm_calibrates(algorithm: str) -> bool:
    """Whether any step of `algorithm` needs calibration data."""
    return any(a.calibrates for a in steps_of(algorithm))
