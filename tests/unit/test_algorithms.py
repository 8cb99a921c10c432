"""SmoothQuant, AWQ and GPTQ against direct, slow reference computations on small random tensors
and tiny random models."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from llmc.model.source import ModelSource
from llmc.quant import stream
from llmc.quant.algorithms.catalog import Observe, AlgorithmSteps
from llmc.quant.algorithms.awq import (
    AwqOptions,
    awq_layer,
    candidate_scales,
    fake_quantize_weight,
    search_clip,
    search_scale,
)
from llmc.quant.algorithms.gptq import GptqOptions, accumulate_hessian, gptq_quantize
from llmc.quant.algorithms.mappings import layer_mappings
from llmc.quant.algorithms.smoothquant import smoothing_scales
from llmc.quant.numerics import dequantize_weight, quantize_weight
from llmc.quant.observe import LayerStats, observing
from llmc.quant.spec import Scheme, TensorSpec

INT4_G16 = TensorSpec("int4", "group", group_size=16)
INT8_CH = TensorSpec("int8", "channel")


def correlated_inputs(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Token rows with correlated channels and a few outlier channels, like LLM activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ (torch.eye(d, dtype=torch.float64) + mix)
    x[:, :3] *= 8
    return x


def layer_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ (w.double() - q.double()).T) ** 2).sum())


def obq_reference(w: torch.Tensor, hessian: torch.Tensor, spec: TensorSpec, damp: float, order: torch.Tensor) -> torch.Tensor:
    """Optimal Brain Quantization, one column at a time, inverting the remaining Hessian afresh for
    each column: the computation GPTQ reorganizes into Cholesky blocks."""
    w = w.double().clone()
    h = hessian.double().clone()
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    scale, zp = quantize_weight(w.float(), spec).scale, quantize_weight(w.float(), spec).zero_point
    q = torch.zeros_like(w)
    col_spec = replace(spec, strategy="channel", group_size=None)
    from llmc.quant.numerics import dequantize, quantize_with

    remaining = [int(c) for c in order]
    while remaining:
        c = remaining[0]
        h_inv = torch.linalg.inv(h[remaining][:, remaining])
        j = c // spec.group_size if spec.strategy == "group" else 0
        s = scale[:, j : j + 1] if spec.strategy != "tensor" else scale.reshape(1, 1)
        z = None if zp is None else zp[:, j : j + 1]
        q[:, c] = dequantize(quantize_with(w[:, c : c + 1], s, z, col_spec), s, z, col_spec)[:, 0].double()
        err = (w[:, c] - q[:, c]) / h_inv[0, 0]
        rest = remaining[1:]
        w[:, rest] -= err[:, None] * h_inv[0, 1:][None, :]
        remaining = rest
    return q


@pytest.mark.parametrize("spec", [INT4_G16, INT8_CH, TensorSpec("fp8_e4m3", "channel"), TensorSpec("int4", "group", 16, symmetric=False)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_column_by_column_obq(spec: TensorSpec, act_order: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 64) * 0.1
    x = correlated_inputs(512, 64)
    h = 2 * x.T @ x / x.shape[0]
    qw, loss = gptq_quantize(w, h, spec, GptqOptions(block_size=16, dampening=0.01, act_order=act_order))
    q = dequantize_weight(qw, spec).double()
    order = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(64)
    ref = obq_reference(w, h, spec, 0.01, order)
    same = (q - ref).abs() < 1e-6
    assert same.float().mean() > 0.99, f"only {same.float().mean():.3f} of the codes agree with OBQ"
    assert layer_error(w, q, x) == pytest.approx(layer_error(w, ref, x), rel=1e-3)
    # and GPTQ beats round-to-nearest on the objective it minimizes
    rtn = dequantize_weight(quantize_weight(w, spec), spec)
    assert layer_error(w, q, x) < 0.8 * layer_error(w, rtn, x)
    assert loss > 0


def test_gptq_is_deterministic_and_keeps_scales() -> None:
    torch.manual_seed(1)
    w = torch.randn(16, 32)
    x = correlated_inputs(128, 32, seed=3)
    h = 2 * x.T @ x / 128
    a, _ = gptq_quantize(w, h, INT4_G16)
    b, _ = gptq_quantize(w, h, INT4_G16)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert torch.equal(a.scale, quantize_weight(w, INT4_G16).scale)  # scales from the original weight


def test_gptq_dead_inputs_are_zeroed() -> None:
    w = torch.randn(8, 32)
    x = correlated_inputs(64, 32)
    x[:, 5] = 0  # a channel that never fires
    h = 2 * x.T @ x / 64
    qw, _ = gptq_quantize(w, h, INT8_CH)
    assert torch.all(qw.codes[:, 5] == 0)


def test_hessian_accumulates_over_batches_exactly() -> None:
    x = correlated_inputs(300, 16).float()
    h, n = None, 0
    for part in x.split(70):
        h, n = accumulate_hessian(h, n, part)
    assert n == 300
    torch.testing.assert_close(h.double(), 2 * x.double().T @ x.double() / 300, rtol=1e-5, atol=1e-5)


def test_smoothing_scales_balance_activation_and_weight_ranges() -> None:
    torch.manual_seed(0)
    act = torch.rand(32) * 10 + 0.1
    weights = [torch.randn(8, 32), torch.randn(4, 32)]
    s = smoothing_scales(act, weights, alpha=0.5)
    w_max = torch.cat(weights).abs().amax(0)
    # at alpha 0.5 both sides end with the same per-channel range: sqrt(max|x| · max|W|)
    torch.testing.assert_close(act / s, w_max * s)
    s_all = smoothing_scales(act, weights, alpha=1.0)
    torch.testing.assert_close(act / s_all, torch.ones(32))  # alpha 1 moves everything to the weights
    zero = smoothing_scales(torch.zeros(32), weights, alpha=0.5)
    assert torch.all(zero == 1)


def test_awq_scale_search_picks_the_grid_minimum() -> None:
    torch.manual_seed(0)
    x = correlated_inputs(256, 64).float()
    w = torch.randn(32, 64) * 0.05
    ref = x @ w.T
    x_mean = x.abs().mean(0)
    opts = AwqOptions(n_grid=10)

    def err(s: torch.Tensor) -> float:
        return float(((x @ (fake_quantize_weight(w * s, INT4_G16) / s).T - ref) ** 2).mean())

    best, errors = search_scale(x_mean, None, err, opts.model_copy(update={"search": "grid"}))
    # recompute every candidate directly and check the choice
    direct = [err(torch.ones(64))] + [err(candidate_scales(x_mean, None, i / 10)) for i in range(10)]
    assert errors == pytest.approx(direct)
    assert err(best) == min(direct)
    assert err(best) <= err(torch.ones(64))  # never worse than plain RTN on the calibration data
    refined, tried = search_scale(x_mean, None, err, opts)  # coarse-to-fine: fewer evaluations, same pick here
    assert len(tried) < len(errors) and err(refined) == min(direct)


@pytest.mark.parametrize("search", ["grid", "refine"])
@pytest.mark.parametrize("n_grid", [20, 10, 7])
def test_awq_plans_as_many_candidate_scales_as_the_search_scores(search: str, n_grid: int) -> None:
    """The planner times AWQ's search by `search_evaluations()` candidates per mapping: what search_scale scores
    when the best ratio is inside the grid (at an end, refinement has fewer neighbours: fewer)."""
    options = AwqOptions(n_grid=n_grid, search=search)
    x_mean = torch.linspace(0.5, 2.0, 8)
    for best in (n_grid // 2, 0):  # an error unimodal in the ratio, lowest at `best`
        calls = []

        def error(s: torch.Tensor) -> float:
            calls.append(s)
            ratios = [i / n_grid for i in range(n_grid)]
            i = next((i for i, r in enumerate(ratios) if torch.equal(s, candidate_scales(x_mean, None, r))), -1)
            return 1e9 if i < 0 else float((i - best) ** 2)

        search_scale(x_mean, None, error, options)
        if best:
            assert len(calls) == options.search_evaluations()
        assert len(calls) <= options.search_evaluations()


@pytest.mark.parametrize("rows", [128, 8])  # the group errors through Gram matrices, and through the rows
def test_awq_clip_minimizes_each_groups_output_error(rows: int) -> None:
    torch.manual_seed(0)
    x = correlated_inputs(rows, 32).float()
    w = torch.randn(4, 32) * 0.05
    w[0, 3] = 1.0  # an outlier weight that clipping should trade off
    opts = AwqOptions(clip_grid=10, max_shrink=0.5)
    clipped = search_clip(w, x, INT4_G16, opts)
    for o in range(4):
        for gi in range(2):
            cols = slice(gi * 16, gi * 16 + 16)
            xg, wg = x[:, cols], w[o, cols]
            chosen = clipped[o, cols].abs().max()
            spec1 = TensorSpec("int4", "channel")

            def err(max_val: torch.Tensor, xg=xg, wg=wg, spec1=spec1) -> float:
                q = fake_quantize_weight(wg.clamp(-max_val, max_val)[None], spec1)[0]
                return float(((xg @ q - xg @ wg) ** 2).mean())

            candidates = [wg.abs().max() * (1 - i / 10) for i in range(5)]
            assert err(chosen) == pytest.approx(min(err(c) for c in candidates), rel=1e-5)


def _tiny_layer(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model, model.model.layers[0]


def _layer_out(model, layer, ids):
    captured = {}

    def hook(_m, args, kwargs, out):
        captured["out"] = out[0] if isinstance(out, tuple) else out

    h = layer.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        logits = model(ids).logits
    h.remove()
    return captured["out"], logits


def _observed(model, layer, ids) -> LayerStats:
    """Layer 0's activation statistics ("l." prefix) from one forward of the whole model."""
    linears = {f"l.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    stats = LayerStats()
    with observing(layer, linears, stats, {}), torch.no_grad():
        model(ids)
    return stats


def test_smoothquant_preserves_the_layer_function(tiny_model: Path) -> None:
    model, layer = _tiny_layer(tiny_model)
    ids = torch.randint(3, 200, (2, 24))
    before, logits_before = _layer_out(model, layer, ids)
    stats = _observed(model, layer, ids)
    norm_before = layer.input_layernorm.weight.clone()
    scheme = Scheme(INT8_CH, TensorSpec("int8", "token", dynamic=True), algorithm="smoothquant")
    assert AlgorithmSteps.of(scheme).transform_layer(layer, "l.", stats)
    after, logits_after = _layer_out(model, layer, ids)
    assert not torch.equal(norm_before, layer.input_layernorm.weight)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4)


def test_smoothing_assigns_new_weights_and_never_writes_into_the_old_ones() -> None:
    """Pair discovery (mappings._preserves) restores a rescaled pair by reference to its old tensors, without
    cloning them: that is exact only while divide_output and multiply_input leave those tensors untouched."""
    from llmc.quant.algorithms.smoothquant import divide_output, multiply_input

    torch.manual_seed(0)
    norm, up, down = nn.RMSNorm(8), nn.Linear(8, 12, bias=True), nn.Linear(12, 8)
    s8 = torch.rand(8, dtype=torch.float64) + 0.5
    s4 = torch.rand(4, dtype=torch.float64) + 0.5
    for module in (norm, up, down):
        module.double()
    modules = {"norm": norm, "up": up, "down": down}
    old = {(m, k): p.data for m, mod in modules.items() for k, p in mod.named_parameters()}
    values = {key: t.clone() for key, t in old.items()}
    divide_output(norm, s8)
    multiply_input([up], s8)
    divide_output(up, s4, rows=(4, 8))  # a fused producer's slice of rows
    multiply_input([down], torch.cat([torch.ones(4, dtype=torch.float64), s4, torch.ones(4, dtype=torch.float64)]))
    for (m, k), tensor in old.items():
        if (m, k) != ("down", "bias"):  # every weight and up's bias were replaced by new storage ...
            assert modules[m].get_parameter(k).data_ptr() != tensor.data_ptr()
        assert torch.equal(tensor, values[(m, k)])  # ... and every old tensor still holds its values


def test_smoothquant_for_static_activations_also_smooths_down_proj(tiny_model: Path) -> None:
    """Static per-tensor activations: SmoothQuant also folds a scale into up_proj -> down_proj (alpha 1.0 by
    default, as ModelOpt), keeps the layer's function, and leaves down_proj an input whose channels all
    peak at the same value; dynamic per-token schemes keep the norms-only default."""
    def smooth_and_alpha(scheme: Scheme) -> tuple[str, float]:
        options = AlgorithmSteps.of(scheme).transforms[0].options
        return options.smooth, options.alpha

    static = Scheme(INT8_CH, TensorSpec("int8", "tensor"), algorithm="smoothquant")
    dynamic = Scheme(INT8_CH, TensorSpec("int8", "token", dynamic=True), algorithm="smoothquant")
    assert smooth_and_alpha(static) == ("all", 1.0)
    assert smooth_and_alpha(dynamic) == ("norms", 0.5)
    explicit = Scheme(INT8_CH, TensorSpec("int8", "tensor"), algorithm="smoothquant",
                      algorithm_options=(("smooth", "norms"), ("alpha", 0.5)))
    assert smooth_and_alpha(explicit) == ("norms", 0.5)

    model, layer = _tiny_layer(tiny_model)
    ids = torch.randint(3, 200, (2, 24))
    before, logits_before = _layer_out(model, layer, ids)
    stats = _observed(model, layer, ids)
    up_before = layer.mlp.up_proj.weight.clone()
    assert AlgorithmSteps.of(static).transform_layer(layer, "l.", stats)
    assert not torch.equal(up_before, layer.mlp.up_proj.weight)
    after, logits_after = _layer_out(model, layer, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4)
    smoothed = _observed(model, layer, ids)  # alpha 1: every input channel of down_proj now peaks at 1
    torch.testing.assert_close(smoothed.channel_absmax["l.mlp.down_proj"],
                               torch.ones_like(smoothed.channel_absmax["l.mlp.down_proj"]), rtol=1e-4, atol=1e-4)


def test_awq_transform_lowers_quantized_layer_error(tiny_model: Path) -> None:
    model, layer = _tiny_layer(tiny_model)
    ids = torch.randint(3, 200, (4, 32))
    with torch.no_grad():  # give the inputs outlier channels, as trained models have
        layer.input_layernorm.weight[:4] *= 20
        layer.post_attention_layernorm.weight[:4] *= 20
    before, _ = _layer_out(model, layer, ids)

    def quantized_error() -> float:
        saved = {n: m.weight.data.clone() for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        for n, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                m.weight.data = fake_quantize_weight(m.weight.data, INT4_G16)
        out, _ = _layer_out(model, layer, ids)
        for n, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                m.weight.data = saved[n]
        return float(((out - before) ** 2).mean())

    rtn_error = quantized_error()
    scheme = Scheme(INT4_G16, algorithm="awq")
    obs = Observe(hessians=False, module_calls=tuple(sorted({m.parent for m in layer_mappings(layer)} | {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)})))
    stats = LayerStats()
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    with observing(layer, linears, stats, {}, obs), torch.no_grad():
        model(ids)
    awq_layer(layer, "", stats, scheme.weights, AwqOptions(clip=False))
    scaled_fp, _ = _layer_out(model, layer, ids)
    torch.testing.assert_close(scaled_fp, before, rtol=1e-4, atol=1e-4)  # scaling alone keeps the function
    assert quantized_error() < rtn_error


@pytest.mark.parametrize("algorithm,weights,acts", [
    ("gptq", INT4_G16, None),
    pytest.param("awq", INT4_G16, None, marks=pytest.mark.heavy),  # 7 s of CPU on the 2-core EPYC (load ~15)
    ("smoothquant", INT8_CH, TensorSpec("int8", "tensor")),
    ("smoothquant+gptq", INT8_CH, TensorSpec("int8", "token", dynamic=True)),
])
def test_streamed_algorithms_are_deterministic(algorithm, weights, acts, tmp_path: Path, tiny_model_session: Path) -> None:
    scheme = Scheme(weights, acts, TensorSpec("fp8_e4m3", "tensor"), algorithm=algorithm)
    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    src = ModelSource(tiny_model_session, "t", "t")
    outs = []
    for run in ("a", "b"):
        stream.quantize_model(src, scheme, tmp_path / run, stream.Calibration(calib, batch_size=2))
        outs.append(load_file(str(tmp_path / run / "layers" / "00001.safetensors")))
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k
    assert "model.layers.1.self_attn.k_scale" in outs[0]
    if acts is not None and not acts.dynamic:
        assert "model.layers.1.mlp.down_proj.input_scale" in outs[0]


@pytest.mark.parametrize("algorithm", ["gptq", pytest.param("awq", marks=pytest.mark.heavy)])  # awq: 8 s of CPU
def test_w4afp8_scales_stay_on_vllms_fp8_row_grid(algorithm: str, tmp_path: Path, tiny_model_session: Path) -> None:
    """GPTQ and AWQ quantize with the group scales vLLM's W4A8-FP8 kernel will use: every stored scale is a fixed
    point of its load-time conversion (without the grid, GPTQ's and AWQ's scales are not)."""
    from llmc.quant.numerics import fp8_row_group_scales

    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    src = ModelSource(tiny_model_session, "t", "t")
    for grid in ("fp8_row", None):
        scheme = Scheme(replace(INT4_G16, scale_grid=grid), TensorSpec("fp8_e4m3", "token", dynamic=True),
                        algorithm=algorithm)
        stream.quantize_model(src, scheme, tmp_path / str(grid), stream.Calibration(calib, batch_size=2))
        scales = {k: v for k, v in load_file(str(tmp_path / str(grid) / "layers" / "00001.safetensors")).items()
                  if k.endswith("weight_scale")}
        assert len(scales) == 7
        on_grid = [torch.equal(fp8_row_group_scales(s), s) for s in scales.values()]
        assert all(on_grid) if grid else not any(on_grid)


@pytest.mark.parametrize("tokens", [200, 40])  # more rows than input channels: the Gram matrix; fewer: the rows
def test_awq_linear_search_through_gram_matrix_equals_direct_outputs(tokens: int) -> None:
    from llmc.quant.algorithms.awq import _search_linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x = correlated_inputs(tokens, 64).float()
    calls = [((x[: tokens // 2],), {}), ((x[tokens // 2 :],), {})]
    x_mean = x.abs().mean(0)
    s = _search_linear(lin, calls, x_mean, None, INT4_G16, AwqOptions(n_grid=8, search="grid"))
    w = lin.weight.data

    def direct(s: torch.Tensor) -> float:
        return float(((x @ (fake_quantize_weight(w * s, INT4_G16) / s).T - x @ w.T) ** 2).mean())

    _, errors = search_scale(x_mean, None, direct, AwqOptions(n_grid=8, search="grid"))
    candidates = [torch.ones(64)] + [candidate_scales(x_mean, None, i / 8) for i in range(8)]
    assert torch.equal(s, candidates[min(range(len(errors)), key=errors.__getitem__)])


@pytest.mark.parametrize("spec", [
    INT4_G16,
    TensorSpec("int4", "group", group_size=16, symmetric=False),
    TensorSpec("int8", "channel"),
    TensorSpec("int4", "group", group_size=16, scale_grid="fp8_row"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_fake_quantization_in_row_blocks_equals_quantize_then_dequantize(spec: TensorSpec, dtype,
                                                                            monkeypatch) -> None:
    """AWQ's block-by-block fake quantization (its search's main cost on the host) gives the values
    quantize_with + dequantize give, with and without a candidate scale, bit for bit (a -0.0 equals 0.0)."""
    from llmc.quant import numerics
    from llmc.quant.algorithms import awq

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3000, 64, generator=g) * 0.05).to(dtype)  # 3000 rows: several blocks of BLOCK_ELEMENTS
    w[5, :32] = 0  # all-zero groups (scale 1) and a lone outlier
    w[7, 3] = 2.0
    s = torch.rand(64, generator=g) + 0.5

    def reference(x: torch.Tensor) -> torch.Tensor:
        scale, zp = numerics.compute_qparams(x, spec)
        return numerics.dequantize(numerics.quantize_with(x, scale, zp, spec), scale, zp, spec)

    monkeypatch.setattr(awq, "BLOCK_ELEMENTS", 64 * 1000)  # three blocks of 1000 rows
    plain, scaled = fake_quantize_weight(w, spec), awq.quantized_at_scale(w, s, spec)
    assert plain.dtype == dtype and scaled.dtype == torch.float32
    assert torch.equal(plain, reference(w).to(dtype))
    assert torch.equal(scaled, reference(w.float() * s) / s)
    assert not torch.equal(plain.float(), w.float())  # it quantized


@pytest.mark.parametrize("rows", [64, 8])  # more sampled rows than a group's width (Gram matrices), and fewer
def test_awq_clip_group_errors_equal_the_outputs_multiplied_out(rows: int) -> None:
    """The clip search scores a weight change per (output channel, group) as mean_t (x_g · Δ)², through each group's
    Gram matrix or the sampled rows: the same as x_g·q − x_g·w multiplied out, up to float rounding."""
    from llmc.quant.algorithms.awq import _group_basis, _group_errors

    x = correlated_inputs(rows, 48).float().reshape(rows, 3, 16)  # [t, G, g]
    g = torch.Generator().manual_seed(1)
    w, q = torch.randn(5, 3, 16, generator=g), torch.randn(5, 3, 16, generator=g)
    direct = (torch.einsum("tGg,oGg->oGt", x, q) - torch.einsum("tGg,oGg->oGt", x, w)).pow(2).mean(-1, keepdim=True)
    basis = _group_basis(x)
    assert basis[1] == (rows > 16)
    torch.testing.assert_close(_group_errors(q - w, basis), direct, rtol=1e-5, atol=1e-6)


def test_gptq_on_stacked_linears_equals_one_at_a_time() -> None:
    from llmc.quant.algorithms.gptq import gptq_quantize_shared

    torch.manual_seed(0)
    x = correlated_inputs(256, 32)
    h = (2 * x.T @ x / 256).float()
    ws = [torch.randn(8, 32), torch.randn(4, 32) * 3]
    for spec in (INT4_G16, TensorSpec("fp8_e4m3", "tensor"), TensorSpec("int4", "group", 16, symmetric=False)):
        shared, _ = gptq_quantize_shared(ws, h, spec)
        for w, q in zip(ws, shared):
            single, _ = gptq_quantize(w, h, spec)
            assert torch.equal(q.scale, single.scale)
            assert (q.codes.float() == single.codes.float()).float().mean() > 0.99


_BLOCK_COMPARISON = """
import json, sys, torch
from llmc.quant.algorithms import gptq
from llmc.quant.numerics import compute_qparams
from llmc.quant.spec import TensorSpec
spec = TensorSpec(**json.loads(sys.argv[1]))
device = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
out, n = 72, 96  # a partial row tile and a block width that is not a power of two
block = torch.randn(out, n, generator=g)
x = torch.randn(n, 3 * n, generator=g)
h_chol, _ = gptq._prepare_inverse(x @ x.T / n, 0.01)
scale, zp = compute_qparams(block, spec)
group = torch.arange(n) // 32 if spec.strategy == "group" else torch.zeros(n, dtype=torch.long)
args = [None if t is None else t.to(device) for t in (scale[:, group], None if zp is None else zp.float()[:, group], h_chol)]
eager_codes, eager_err = gptq.gptq_block_eager(block.clone().to(device), *args, spec)
codes, err = gptq.gptq_block_triton(block.clone().to(device), *args, spec)
assert codes.dtype == torch.int8 and codes.shape == eager_codes.shape
same = (codes == eager_codes).all(dim=1)  # rows whose codes all agree must carry the same errors
print(json.dumps({"differing_codes": (codes != eager_codes).float().mean().item(),
                  "max_code_step": (codes.int() - eager_codes.int()).abs().max().item(),
                  "max_error_diff": (err[same] - eager_err[same]).abs().max().item() if same.any() else 0.0,
                  "rows_compared": int(same.sum())}))
"""


@pytest.mark.parametrize("spec", [TensorSpec("int4", "group", group_size=32),
                                  TensorSpec("int4", "group", group_size=32, symmetric=False),
                                  TensorSpec("int8", "channel")], ids=["int4-sym", "int4-asym", "int8"])
@pytest.mark.heavy
def test_triton_gptq_block_matches_the_eager_loop(spec: TensorSpec) -> None:
    """One kernel launch per block must give the eager column loop's codes and errors. Without a GPU the
    kernel runs in Triton's interpreter, which must be on before triton is first imported: a child process.
    (On a GPU the kernel may fuse multiply-adds, so a rare code may round the other way.)"""
    import json
    import os
    import subprocess
    import sys
    from dataclasses import asdict

    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", _BLOCK_COMPARISON, json.dumps(asdict(spec))],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["differing_codes"] <= 0.01 and m["max_code_step"] <= 1, m
    assert m["rows_compared"] >= 36 and m["max_error_diff"] <= 1e-4, m


@pytest.mark.parametrize("spec", [INT4_G16, TensorSpec("int4", "group", 16, symmetric=False), INT8_CH])
def test_compiled_cpu_gptq_block_matches_the_eager_loop(spec: TensorSpec) -> None:
    """The numba column loop (the CPU default) against the torch-op loop: same codes, same errors to float
    rounding (its rank-1 update may fuse into a multiply-add)."""
    from llmc.quant.algorithms import gptq
    from llmc.quant.numerics import compute_qparams

    torch.manual_seed(0)
    x = correlated_inputs(512, 64)
    h_chol, _ = gptq._prepare_inverse(2 * x.T @ x / 512, 0.01)
    w = torch.randn(48, 64)
    scale, zp = compute_qparams(w, spec)
    group = torch.arange(64) // 16 if spec.strategy == "group" else torch.zeros(64, dtype=torch.long)
    s_cols = scale[:, group] if spec.strategy == "group" else scale.expand(48, 64)
    z_cols = None if zp is None else zp.float()[:, group]
    eager_codes, eager_err = gptq._integer_block(w.clone(), s_cols, z_cols, h_chol, spec)
    codes, err = gptq.gptq_block_cpu(w.clone(), s_cols, z_cols, h_chol, spec)
    assert codes.dtype == torch.int8 and (codes == eager_codes).float().mean() > 0.995
    torch.testing.assert_close(err, eager_err, rtol=1e-4, atol=1e-4)
    assert gptq.use_numba(w, spec) and not gptq.use_numba(w, TensorSpec("fp8_e4m3", "channel"))


def test_gptq_inverse_factor_is_the_upper_cholesky_factor_of_the_damped_inverse() -> None:
    from llmc.quant.algorithms import gptq

    torch.manual_seed(0)
    x = correlated_inputs(300, 48)
    x[:, 5] = 0  # a dead input
    h = 2 * x.T @ x / 300
    u, dead = gptq._prepare_inverse(h, 0.01)
    assert dead.tolist() == [i == 5 for i in range(48)]
    damped = h.double().clone()
    damped[5, 5] = 1.0
    damped += 0.01 * torch.diag(damped).mean() * torch.eye(48, dtype=torch.float64)
    assert torch.equal(u, u.triu()) and bool((torch.diag(u) > 0).all())
    torch.testing.assert_close(u.double().T @ u.double(), torch.linalg.inv(damped), rtol=1e-5, atol=1e-6)


def test_gram_from_three_quadrants_is_exactly_symmetric_and_equals_xtx() -> None:
    from llmc.quant.algorithms.gptq import gram

    x = correlated_inputs(300, 600)
    g = gram(x)
    assert torch.equal(g, g.T)
    torch.testing.assert_close(g, x.T @ x, rtol=1e-5, atol=1e-3)
