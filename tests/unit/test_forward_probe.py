"""The calibration and evaluation forwards of a small dense model are planned at the share of the matmul rate a layer
of its own widths was measured to reach (llmc.quant.forward_probe), not at the constant measured at 8B widths."""

from __future__ import annotations

import dataclasses

import pytest

from llmc.planning import probes
from llmc.planning.machine import Machine
from llmc.planning.shapes import Shape
from llmc.quant import forward_probe
from tests.unit.test_plan_honest import own_rates, pin_probes  # noqa: F401  (own_rates: autouse, fresh rates)

# a tiny Llama's widths: hidden 64, MLP 128, 4 heads of 16, 2 key/value heads
TINY = Shape(params=1_000_000, layers=4, hidden=64, heads=4, vocab=256, layer_params=2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128,
             outer_params=2 * 256 * 64, largest_linear=64 * 128, widest_input=128, intermediate=128, attn_width=64,
             active=1.0, stored_bytes=4_000_000, kv_heads=2)
CPU = Machine(available=None, gpu_free=None, device="cpu")


def test_a_small_layer_is_timed_at_its_own_widths_and_its_share_of_the_matmul_rate_read(monkeypatch) -> None:
    observed_calls = []
    real_observing = forward_probe_observing()
    monkeypatch.setattr("llmc.quant.observe.observing",
                        lambda *a, **k: observed_calls.append(sorted(a[1])) or real_observing(*a, **k))
    share = forward_probe.measured_efficiency(TINY, batch=2, seq_len=16, compute="float32", device="cpu",
                                              observed=False)
    key = "layer forward float32 cpu hidden=64 intermediate=128 heads=4/2x16 tokens=2x16"
    calls_per_s = probes.book().probes[key].read("median")
    widths = forward_probe.LayerWidths.of(TINY)
    assert widths == forward_probe.LayerWidths(64, 128, 4, 2, 16)
    assert share == pytest.approx(widths.ideal_seconds(2, 16, "float32") * calls_per_s)
    assert share > 0 and observed_calls == []
    # as the stream runs it: its range hooks on every Linear of the layer (and a key of its own)
    observed = forward_probe.measured_efficiency(TINY, batch=2, seq_len=16, compute="float32", device="cpu",
                                                 observed=True)
    assert observed > 0 and f"{key} observed" in probes.book().probes
    assert observed_calls and observed_calls[0] == sorted(
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"])


def forward_probe_observing():
    from llmc.quant import observe

    return observe.observing


def test_a_moe_layer_a_gpu_a_wide_layer_and_another_machines_rates_keep_the_constant() -> None:
    kwargs = dict(batch=4, seq_len=256, compute="float32", observed=True)
    assert forward_probe.measured_efficiency(dataclasses.replace(TINY, active=0.25), device="cpu", **kwargs) is None
    assert forward_probe.measured_efficiency(TINY, device="cuda", **kwargs) is None
    wide = dataclasses.replace(TINY, hidden=8192, intermediate=28672, heads=64, attn_width=8192, kv_heads=8)
    assert forward_probe.measured_efficiency(wide, device="cpu", **kwargs) is None
    another_machine = probes.FixedBook(resolve=lambda key: (1e10,) if key.startswith("matmul") else (),
                                       label="a machine file: its matmul rates, no layer's forward")
    with probes.fixed(another_machine):
        assert forward_probe.measured_efficiency(TINY, device="cpu", **kwargs) is None
    assert not any(k.startswith("layer forward") for k in probes.book().probes)  # nothing was built or timed


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_the_quantize_stages_forward_is_the_measured_layer_forward_per_batch(compute: str, monkeypatch) -> None:
    from llmc.pipeline.quantize import quantize_cost
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from llmc.quant.spec import Scheme, TensorSpec
    from tests.unit.build_helpers import layer_loop

    fp8 = AlgorithmSteps.of(Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")))

    def per_layer(forwards_per_s: float) -> float:
        probes._book = probes.RateBook()
        calls = pin_probes(monkeypatch, matmul=(10e9,), layer_forward=(forwards_per_s,))
        row = quantize_cost(TINY, layer_loop(fp8, activations="memory", windows=8, seq_len=32, batch=4), fp8,
                            compute=compute, stored_elem=2, machine=CPU)
        assert calls["layer forward"] > 0
        return row.layer_seconds

    # 8 windows in batches of 4: two measured forwards a layer
    assert per_layer(5.0) - per_layer(50.0) == pytest.approx(2 * (1 / 5 - 1 / 50))


def test_an_evaluation_plans_its_layers_at_the_measured_forward_and_its_head_at_the_constant(monkeypatch) -> None:
    from llmc.engines.torch_cost import eval_cost

    def seconds(forwards_per_s: float) -> float:
        probes._book = probes.RateBook()
        pin_probes(monkeypatch, matmul=(10e9,), layer_forward=(forwards_per_s,))
        return eval_cost(TINY, label="torch baseline", compute="float32", windows=8, seq_len=32, batch=4,
                         streamed=False, reference=False, artifact_code_bytes=0.0, top_k=10, throughput_tokens=0,
                         machine=CPU).seconds

    # 4 layers x 2 batches of the measured forward; nothing else moves with it (the output head's GEMM neither)
    assert seconds(5.0) - seconds(50.0) == pytest.approx(TINY.layers * 2 * (1 / 5 - 1 / 50))
