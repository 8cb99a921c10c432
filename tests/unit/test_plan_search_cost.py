"""quantization.search's measuring pass in `llmc plan` (issue 44): a searched variant's quantize row carries the
measurement it runs first (`llmc.quant.search.measurement_cost`: each layer's forwards per unit and candidate, the
candidates' quantization, the fisher proxy's second pass and output-head gradient), and the stand-in's own
quantization reuses the statistics the measurement records. Probes are pinned, never timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmc.pipeline.quantize import Quantize
from llmc.planning import plan as plan_module
from llmc.planning.plan import make_plan
from llmc.planning.rows import MEASUREMENT_PART
from llmc.planning.shapes import Shape
from llmc.quant import fisher
from llmc.quant import search as S
from llmc.quant.spec import Scheme, TensorSpec
from llmc.recipe.load import parse_recipe
from tests.unit.families import make_tiny
from tests.unit.test_plan_honest import own_rates, pin_probes  # noqa: F401  (own_rates: autouse, fresh rates)

LAYERS = 4
MEASUREMENT = Quantize.measurement  # the stage's own, whatever a test patches in its place


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("search-cost") / "model", num_hidden_layers=LAYERS)


def _recipe(model: Path, proxy: str = "output"):
    return parse_recipe(yaml.safe_dump({
        "name": "tiny-search-cost", "model": {"source": str(model)},
        "quantization": {"search": {"candidates": ["W4A16-NVFP4", "W8A8-FP8", "bf16"], "budget": {"effective_bits": 8.0},
                                    "granularity": "role", "proxy": proxy}},
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm100"}], "eval": {"seq_len": 64, "windows": 4}}))


def _planned(model: Path, monkeypatch, proxy: str = "output", measured: bool = True):
    """(the quantize row, the measurement its first walk costed or None, the plan). Memory the host hands back slowly
    is not planned here (its time would follow the row's peak, which the measurement moves)."""
    monkeypatch.setattr(plan_module, "memory_from_host", lambda: False)
    seen: list = []

    def recording(self, c):
        m = MEASUREMENT(self, c) if measured else None
        seen.append(m)
        return m

    monkeypatch.setattr(Quantize, "measurement", recording)
    plan = make_plan(_recipe(model, proxy), model, refuse=False)
    row = next(r for r in plan.rows if r.id.kind.value == "quantize")
    return row, seen[0], plan


def test_a_searched_recipe_plans_its_measurement_in_the_quantize_row(model: Path, monkeypatch) -> None:
    """The quantize row of a search still to measure adds the measuring pass's time (per layer and once) and its
    peak; without the term the row is the stand-in's quantization alone."""
    pin_probes(monkeypatch)
    row, m, plan = _planned(model, monkeypatch)
    without, none, _ = _planned(model, monkeypatch, measured=False)
    assert none is None and m is not None and m.layer_seconds > 0
    assert row.seconds - without.seconds == pytest.approx(m.seconds(LAYERS))
    assert row.layer_seconds - without.layer_seconds == pytest.approx(m.layer_seconds)
    # the layer's parts name the measurement's terms too, and still sum to the layer's time
    assert {k.removeprefix(MEASUREMENT_PART): v for k, v in row.layer_parts.items()
            if k.startswith(MEASUREMENT_PART)} == m.seconds_parts
    assert sum(row.layer_parts.values()) == pytest.approx(row.layer_seconds, rel=1e-12)
    assert row.host_bytes >= m.host_bytes
    assert "the search's measurement first" in row.why and "the search's measurement" not in without.why
    # the render's per-layer line stays the row's own arithmetic: (seconds - fixed) / per layer = the depth
    assert (row.seconds - row.fixed_seconds) / row.layer_seconds == pytest.approx(LAYERS)
    # the measurement records the ranges: the stand-in's quantization runs no calibration forward of its own
    assert row.decision.flow == "shared-statistics"
    assert m.forwards == plan.search[""].forwards_per_layer() == 1 + 2 * 2  # 2 roles x 2 scheme candidates


def test_the_fisher_proxy_adds_its_backward_pass_and_the_heads_gradient(model: Path, monkeypatch) -> None:
    pin_probes(monkeypatch)
    _, output, _ = _planned(model, monkeypatch, "output")
    _, fisher_m, _ = _planned(model, monkeypatch, "fisher")
    assert fisher_m.forwards == output.forwards + 3
    assert fisher_m.fixed_seconds > output.fixed_seconds  # the head's forward and backward
    assert fisher_m.parts["activations"] > output.parts["activations"]  # every layer's inputs kept



@pytest.mark.parametrize("proxy", ["output", "fisher"])
def test_the_rows_parts_show_which_pass_is_the_peak(model: Path, monkeypatch, proxy: str) -> None:
    """Issue 44 F10: the row's host_bytes is the larger of the loop's peak and the measurement's, and its parts list
    the measurement's terms (named as such) beside the loop's, so the larger chain of them is host_bytes."""
    pin_probes(monkeypatch)
    row, m, _ = _planned(model, monkeypatch, proxy)
    without, _, _ = _planned(model, monkeypatch, proxy, measured=False)
    measured = {k.removeprefix(MEASUREMENT_PART): v for k, v in row.parts.items() if k.startswith(MEASUREMENT_PART)}
    own = {k: v for k, v in row.parts.items() if not k.startswith(MEASUREMENT_PART)}
    assert measured == m.parts and sum(measured.values()) == pytest.approx(m.host_bytes)
    assert own == without.parts  # the loop's terms as they were
    assert row.host_bytes == pytest.approx(max(without.host_bytes, sum(measured.values())))
    if proxy == "fisher":  # every layer's inputs kept for the backward: the measurement is this model's peak
        assert sum(measured.values()) > without.host_bytes
        assert row.host_bytes == pytest.approx(sum(measured.values()))
    assert not any(k.startswith(MEASUREMENT_PART) for k in without.parts)

SHAPE = Shape(params=10_000_000, layers=4, hidden=256, heads=4, vocab=1000, layer_params=2_000_000,
              outer_params=256_000, largest_linear=256 * 1024, widest_input=1024, intermediate=1024, attn_width=256,
              active=1.0, stored_bytes=40_000_000)
LINEARS = {f"model.layers.{i}.{p}": s for i in range(4) for p, s in (
    ("self_attn.q_proj", (256, 256)), ("self_attn.k_proj", (256, 256)), ("self_attn.v_proj", (256, 256)),
    ("self_attn.o_proj", (256, 256)), ("mlp.gate_proj", (1024, 256)), ("mlp.up_proj", (1024, 256)),
    ("mlp.down_proj", (256, 1024)))}


def _space(proxy: str) -> S.SearchSpace:
    fp8, nvfp4 = TensorSpec("fp8_e4m3", "channel"), TensorSpec("nvfp4", "group", group_size=16)
    return S.search_space(LINEARS, candidates=("NVFP4", "FP8", S.BF16), removed=(),
                          specs={"NVFP4": nvfp4, "FP8": fp8}, granularity="role", protect=(), budget_bytes=None,
                          effective_bits=8.0, ignore=(), n_layers=4, model_type="llama", fuse=True, elem=4,
                          matches=lambda n, patterns: False, proxy=proxy)


@pytest.mark.parametrize("proxy", ["output", "fisher"])
def test_the_measurement_is_costed_term_by_term(monkeypatch, proxy: str) -> None:
    """Each layer: its read (twice with the fisher proxy), `forwards_per_layer` forwards over the calibration
    tokens, each unit quantized and dequantized by each scheme candidate (a static-activation candidate also
    fake-quantizes its Linears' inputs in its forward); once: the weights outside the layers, and with the fisher
    proxy the head's forward and backward. Drop any term and the sum no longer matches."""
    flops_rate, read_rate, q_rate, fq_rate = 1e10, 1e9, 1e8, 1e9
    for module in (S, fisher):
        monkeypatch.setattr(module, "forward_seconds", lambda gemm, attn, **_: (gemm + attn) / flops_rate)
    monkeypatch.setattr(S, "source_read_seconds", lambda nbytes, resident=0.0, converted=0.0: nbytes / read_rate)
    monkeypatch.setattr(S, "quantize_rate", lambda spec, dtype, elements, device: q_rate)
    monkeypatch.setattr(S, "fake_quantize_rate", lambda spec, dtype, width, rows, device: fq_rate)
    space = _space(proxy)
    fp8 = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))
    candidates = {"NVFP4": Scheme(TensorSpec("nvfp4", "group", group_size=16)), "FP8": fp8, S.BF16: None}
    tokens, seq = 8 * 64, 64
    m = S.measurement_cost(space, candidates, LINEARS, SHAPE, tokens=tokens, seq_len=seq, batch_tokens=4 * seq,
                           activations="memory", compute="float32", stored_elem=4)
    fisher_proxy = proxy == "fisher"
    forward = (2 * tokens * SHAPE.layer_params + 2 * tokens * seq * SHAPE.attn_width) / flops_rate
    searched = sum(o * i for o, i in LINEARS.values())
    candidates_s = 2 * 2 * searched / q_rate + tokens * sum(i for _, i in LINEARS.values()) / fq_rate
    read = SHAPE.layer_params * 4 / read_rate * (2 if fisher_proxy else 1)
    assert m.forwards == 1 + 2 * 2 + (3 if fisher_proxy else 0)
    assert m.layer_seconds == pytest.approx(read + m.forwards * forward + candidates_s / 4)
    head = 4 * tokens * SHAPE.hidden * SHAPE.vocab / flops_rate if fisher_proxy else 0.0
    assert m.fixed_seconds == pytest.approx(SHAPE.outer_params * 4 / read_rate + head)
    copy = tokens * SHAPE.hidden * 4
    assert m.parts["activations"] == (SHAPE.layers + 3 if fisher_proxy else 2) * copy
    assert m.parts["head gradients"] == (fisher.HEAD_LOGIT_COPIES * 4 * seq * SHAPE.vocab * 4 if fisher_proxy else 0)
