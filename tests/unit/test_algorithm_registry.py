"""The algorithm registry and the composed, resolved view of a scheme's algorithm: lookups, composition, option
validation, defaults, and the stage-key / planner numbers it must keep exactly as the code before it made them."""

from __future__ import annotations

import itertools

import pytest
import torch
import yaml
from torch import nn

from llmc.errors import RecipeError
from llmc.quant.algorithms.catalog import IMPLEMENTED, ALGORITHMS, AlgorithmSteps, calibration_passes, names, quantize_stage_config
from llmc.quant.algorithms.awq import AwqOptions
from llmc.quant.algorithms.gptq import GptqOptions
from llmc.quant.algorithms.registry import AlgorithmOptions, register
from llmc.quant.spec import Scheme, TensorSpec
from llmc.recipe.load import parse_recipe
from llmc.storage.store import canonical_json

INT4_G16 = TensorSpec("int4", "group", group_size=16)
INT8_CH = TensorSpec("int8", "channel")
STATIC = TensorSpec("int8", "tensor")
DYNAMIC = TensorSpec("int8", "token", dynamic=True)
FP8_TOKEN = TensorSpec("fp8_e4m3", "token", dynamic=True)
KV = TensorSpec("fp8_e4m3", "tensor")


# --------------------------------------------------------------------------- the formulas before the registry
# Copied from llmc/quant/algorithms/__init__.py, llmc/build.py::_quantize, llmc/planning/plan.py::_calibration_passes and
# llmc/quant/stream.py as they were: cache keys and estimates must not move.


def _old_steps(s: Scheme) -> list[str]:
    return s.algorithm.split("+")


def _old_propagate(s: Scheme) -> str:
    o = dict(s.algorithm_options)
    if "propagate" in o:
        return o["propagate"]
    return "quantized" if ("gptq" in _old_steps(s) or "awq" in _old_steps(s)) else "original"


def _old_true_sequential(s: Scheme) -> bool:
    applies = _old_steps(s) == ["gptq"] and _old_propagate(s) == "quantized"
    return applies and bool(dict(s.algorithm_options).get("true_sequential", True))


def _old_static_per_tensor(s: Scheme) -> bool:
    a = s.activations
    return a is not None and not a.dynamic and a.strategy == "tensor"


def _old_smooth(s: Scheme) -> str:
    o = dict(s.algorithm_options)
    return str(o["smooth"]) if "smooth" in o else "all" if _old_static_per_tensor(s) else "norms"


def _old_alpha(s: Scheme) -> float:
    o = dict(s.algorithm_options)
    return float(o["alpha"]) if "alpha" in o else 1.0 if _old_static_per_tensor(s) else 0.5


def _old_quantize_stage_config(s: Scheme) -> dict:
    cfg = {"scheme": s.to_dict(), "dtype": "float32", "propagate": _old_propagate(s)}
    if "smoothquant" in s.algorithm and _old_smooth(s) == "all":
        cfg["smoothquant"] = {"smooth": "all", "alpha": _old_alpha(s)}
    if _old_true_sequential(s):
        cfg["gptq"] = {"true_sequential": True}
    return cfg


def _old_calibration_passes(s: Scheme) -> float:
    static_acts = s.activations is not None and not s.activations.dynamic
    if not (static_acts or s.kv_cache is not None or s.algorithm != "rtn"):
        return 0.0
    steps = _old_steps(s)
    passes = 1.0 if s.algorithm == "rtn" else 2.0
    if "awq" in steps:  # the reference outputs, then each candidate scale: 1 + the grid or its refinement
        options = dict(s.algorithm_options)
        n_grid = int(options.get("n_grid", 20))
        passes += 2 + (n_grid if options.get("search") == "grid" else len(range(0, n_grid, 4)) + 4)
    if "gptq" in steps:
        passes += 1.0
    return passes


def _old_reads_statistics(s: Scheme) -> bool:
    static_acts = s.activations is not None and not s.activations.dynamic
    return static_acts or s.kv_cache is not None or "gptq" in s.algorithm


OPTIONS = {
    "rtn": [()],
    "smoothquant": [(), (("alpha", 0.7),), (("smooth", "all"),), (("alpha", 1), ("smooth", "norms")),
                    (("propagate", "quantized"),)],
    "gptq": [(), (("propagate", "original"),), (("true_sequential", False),), (("act_order", True), ("block_size", 64)),
             (("dampening", 0.1), ("true_sequential", True))],
    "smoothquant+gptq": [(), (("smooth", "all"),), (("alpha", 0.8), ("true_sequential", False)),
                         (("propagate", "original"),)],
    "awq": [(), (("n_grid", 10),), (("clip", False), ("search", "grid")), (("propagate", "original"),)],
}
SCHEMES = [
    Scheme(weights, activations, kv, algorithm=algorithm, algorithm_options=options)
    for weights, activations, kv in itertools.product((INT4_G16, INT8_CH), (None, STATIC, DYNAMIC, FP8_TOKEN),
                                                      (None, KV))
    for algorithm, option_sets in OPTIONS.items()
    for options in option_sets
]


def test_quantize_stage_config_is_byte_for_byte_the_old_formula() -> None:
    for s in SCHEMES:
        new = {"scheme": s.to_dict(), "dtype": "float32", **quantize_stage_config(s)}
        assert canonical_json(new) == canonical_json(_old_quantize_stage_config(s)), s


def test_calibration_passes_and_stream_properties_are_the_old_ones() -> None:
    for s in SCHEMES:
        p = AlgorithmSteps.of(s)
        assert calibration_passes(s) == _old_calibration_passes(s), s
        assert p.propagate == _old_propagate(s)
        assert p.true_sequential == _old_true_sequential(s)
        old_shares = _old_propagate(s) == "original" and not {"gptq", "awq"} & set(_old_steps(s))
        assert p.shares_statistics == old_shares
        assert p.reads_statistics_after_transform == _old_reads_statistics(s)
        # when the stream reuses shared statistics (AWQ, which needs inputs after its transform too, never shares)
        old_reuse = old_shares and not ("smoothquant" in s.algorithm and _old_reads_statistics(s))
        assert (p.shares_statistics and not p.needs_inputs_after_transform) == old_reuse
        assert s.needs_calibration == (_old_calibration_passes(s) > 0)
        assert p.replays_module_calls == ("awq" in s.algorithm)  # plan.py's memory estimate asks this


# --------------------------------------------------------------------------- registry and composition


def test_each_algorithm_is_registered_once_with_its_kind() -> None:
    assert names() == ("awq", "gptq", "rtn", "scale_search", "smoothquant")
    assert {n: ALGORITHMS[n].kind for n in names()} == {"awq": "transform", "gptq": "quantizer", "rtn": "quantizer",
                                                     "scale_search": "quantizer", "smoothquant": "transform"}
    assert ALGORITHMS["gptq"].options is GptqOptions and ALGORITHMS["awq"].options is AwqOptions
    assert [n for n in names() if not ALGORITHMS[n].calibrates] == ["rtn", "scale_search"]
    # microscaling weights (awq: NVFP4 / MXFP4 weight-only, its options' check)
    assert [n for n in names() if ALGORITHMS[n].block_scaled] == ["awq", "gptq", "rtn", "scale_search"]
    assert IMPLEMENTED == {"rtn", "gptq", "smoothquant", "smoothquant+gptq", "awq", "scale_search"}
    with pytest.raises(ValueError, match="registered twice"):
        register("gptq", kind="quantizer", options=GptqOptions)(lambda *a: {})


def test_a_transform_alone_is_followed_by_rtn() -> None:
    p = AlgorithmSteps.of(Scheme(INT8_CH, DYNAMIC, algorithm="smoothquant"))
    assert [s.name for s in p.steps] == ["smoothquant", "rtn"]
    assert [s.name for s in p.transforms] == ["smoothquant"] and p.quantizer.name == "rtn"
    assert [s.name for s in AlgorithmSteps.of(Scheme(INT4_G16, algorithm="gptq")).steps] == ["gptq"]


def _recipe(quantization: dict) -> str:
    return yaml.safe_dump({"name": "r", "model": {"source": "demo:smollm2-135m"}, "quantization": quantization,
                           "targets": [{"runtime": "vllm"}]})


W8A8 = {"weights": {"format": "int8", "strategy": "channel"},
        "activations": {"format": "int8", "strategy": "token", "dynamic": True}}


@pytest.mark.parametrize("spellings", [
    (["smoothquant", "gptq"], "smoothquant+gptq", "smoothquant + gptq"),
    (["smoothquant", "rtn"], ["smoothquant"], "smoothquant+rtn", "smoothquant"),
    (["gptq"], "gptq"),
    (["rtn"], "rtn"),
])
def test_a_list_and_the_plus_spelling_give_the_same_scheme_and_build(spellings) -> None:
    recipes = [parse_recipe(_recipe({**W8A8, "algorithm": a, "options": {"alpha": 0.6} if "smoothquant" in str(a)
                                     else {}})) for a in spellings]
    schemes = {r.quantization.to_scheme() for r in recipes}
    assert len(schemes) == 1
    assert len({canonical_json(r.model_dump(mode="json")) for r in recipes}) == 1  # the build id hashes this


@pytest.mark.parametrize("algorithm, needles", [
    ("sq", ["'quantization.algorithm'", "unknown algorithm 'sq'", "fix: use awq, gptq, rtn, scale_search, smoothquant"]),
    (["smoothquant", "gtpq"], ["unknown algorithm 'gtpq' in 'smoothquant+gtpq'", "fix:"]),
    (["gptq", "smoothquant"], ["'gptq+smoothquant' rewrites weights after quantizing them",
                               "fix: put the transform (awq, smoothquant) first, the quantizer (gptq, rtn, scale_search) last"]),
    ("rtn+gptq", ["'rtn+gptq' quantizes twice", "fix: keep one quantizer"]),
    (["smoothquant", "awq"], ["more than one weight transform", "fix: keep one of awq, smoothquant"]),
    ([], ["the algorithm list is empty", "fix:"]),
    ({"name": "gptq"}, ["is not an algorithm", "fix:"]),
])
def test_unknown_algorithms_and_impossible_orders_are_recipe_errors(algorithm, needles) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(_recipe({**W8A8, "algorithm": algorithm}), source="r.yaml")
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_awq_then_gptq_parses_but_is_not_implemented() -> None:
    from llmc.errors import IncompatibleTargetError
    from llmc.planning.plan import make_plan

    recipe = parse_recipe(_recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 64},
                                   "algorithm": ["awq", "gptq"]}))
    assert recipe.quantization.to_scheme().algorithm == "awq+gptq"
    with pytest.raises(IncompatibleTargetError, match="'awq\\+gptq' is not implemented"):
        make_plan(recipe)


@pytest.mark.parametrize("algorithm, options, needles", [
    ("gptq", {"n_grid": 4, "alpha": 0.5}, ["options alpha, n_grid do not apply to algorithm gptq",
                                           "fix: use act_order, block_scales, block_size, dampening, propagate, true_sequential"]),
    ("rtn", {"propagate": "original"}, ["options propagate do not apply to algorithm rtn", "fix: use no options"]),
    ("smoothquant", {"smooth": "foo"}, ["options.smooth = 'foo'", "fix: set options.smooth to 'norms'", "'all'"]),
    ("smoothquant", {"alpha": 1.5}, ["options.alpha = 1.5", "less than or equal to 1", "fix:"]),
    ("gptq", {"block_size": True}, ["options.block_size = True", "valid integer", "fix:"]),
    ("awq", {"search": "exhaustive"}, ["options.search = 'exhaustive'", "'grid' or 'refine'", "fix:"]),
    ("gptq", {"propagate": "later"}, ["options.propagate = 'later'", "fix: set options.propagate to 'quantized'"]),
    ("gptq", {"true_sequential": "yes"}, ["options.true_sequential = 'yes'", "true or false", "fix:"]),
    (["smoothquant", "gptq"], {"true_sequential": True}, ["it needs algorithm gptq alone", "fix:"]),
])
def test_options_are_checked_against_the_steps_option_models(algorithm, options, needles) -> None:
    quantization = {**W8A8, "algorithm": algorithm, "options": options}
    if algorithm == "awq":
        quantization = {"weights": {"format": "int4", "strategy": "group", "group_size": 64}, **quantization}
        del quantization["activations"]
    with pytest.raises(RecipeError) as e:
        parse_recipe(_recipe(quantization), source="r.yaml")
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_defaults_come_from_the_option_models() -> None:
    gptq = AlgorithmSteps.of(Scheme(INT4_G16, algorithm="gptq"))
    assert gptq.quantizer.options == GptqOptions() and gptq.quantizer.options.block_size == 128
    assert AlgorithmSteps.of(Scheme(INT4_G16, algorithm="awq")).transforms[0].options == AwqOptions()
    assert AwqOptions().n_grid == 20 and calibration_passes(Scheme(INT4_G16, algorithm="awq")) == 2 + 1 + 1 + 5 + 4
    given = AlgorithmSteps.of(Scheme(INT4_G16, algorithm="gptq", algorithm_options=(("block_size", 64),))).quantizer.options
    assert given == GptqOptions(block_size=64)
    # scheme-dependent defaults are resolved on the options model: SmoothQuant for static per-tensor activations
    for acts, expected in ((STATIC, ("all", 1.0)), (DYNAMIC, ("norms", 0.5))):
        sq = AlgorithmSteps.of(Scheme(INT8_CH, acts, algorithm="smoothquant")).transforms[0]
        assert (sq.given.smooth, sq.given.alpha) == (None, None)
        assert (sq.options.smooth, sq.options.alpha) == expected
    # the composition resolves GPTQ's true-sequential default: not after a transform
    assert not AlgorithmSteps.of(Scheme(INT8_CH, DYNAMIC, algorithm="smoothquant+gptq")).quantizer.options.true_sequential


def test_a_new_algorithm_is_one_registered_function() -> None:
    class DoubleOptions(AlgorithmOptions):
        factor: float = 2.0

    def double_layer(layer, prefix, stats, weights, options) -> bool:
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                m.weight.data *= options.factor
        return True

    register("double", kind="transform", options=DoubleOptions)(double_layer)
    try:
        scheme = parse_recipe(_recipe({"weights": {"format": "int8", "strategy": "channel"},
                                       "algorithm": ["double"], "options": {"factor": 3}})).quantization.to_scheme()
        assert (scheme.algorithm, scheme.algorithm_options) == ("double", (("factor", 3),))
        p = AlgorithmSteps.of(scheme)
        assert [s.name for s in p.steps] == ["double", "rtn"] and p.calibrates and p.propagate == "original"
        layer = nn.Sequential(nn.Linear(4, 4, bias=False))
        w = layer[0].weight.data.clone()
        assert p.transform_layer(layer, "", None)
        assert torch.equal(layer[0].weight.data, w * 3)
    finally:
        ALGORITHMS.remove("double")
