"""quantization.search's fisher proxy (llmc.quant.fisher): the loss gradient at each decoder layer's output, carried
back one resident layer at a time, equals the whole model's autograd gradient; the proxies' formulas; the GPU path
mixes no host tensor and measures what the host measures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import llmc.quant.stream as stream
from llmc.model.source import ModelSource
from llmc.quant.fisher import DRAW_SEED, draw_tokens
from llmc.quant.numerics import dequantize_weight, quantize_weights
from llmc.quant.search import Unit, layer_damage, layer_damages
from llmc.quant.spec import Scheme, TensorSpec
from tests.unit.families import make_tiny
from tests.unit.fake_cuda import fake_cuda

INT4 = Scheme(TensorSpec("int4", "group", group_size=16))
WINDOWS = torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("fisher") / "m", num_hidden_layers=3)


def _measured(folder: Path, device: str, tmp: Path, gradients: bool = True) -> dict[int, dict]:
    got: dict[int, dict] = {}

    def measure(i, layer, linears, inputs, extras, outputs, stats, grads) -> None:
        units = [Unit(f"layers.{i}.mlp", tuple(n for n in linears if ".mlp." in n), 0)]
        damage = layer_damages(layer, linears, units, {"int4": INT4, "bf16": None}, inputs, extras, outputs,
                               stats.input_absmax, grads)
        got[i] = {"grads": [g.cpu() for g in grads or []], "outputs": [y.cpu() for y in outputs],
                  "damage": {p: d[units[0].name] for p, d in damage.items()}}

    stream.measure_model(ModelSource(folder, "t", "t"), INT4, stream.Calibration(WINDOWS, batch_size=2),
                         tmp / "work", measure, stream.StreamOptions(device=device), gradients=gradients)
    return got


def _whole_model_gradients(folder: Path) -> list[list[torch.Tensor]]:
    """Per layer, per batch of 2 windows: d(sum log p(drawn))/d(layer output) by autograd over the whole model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, out: (out[0] if isinstance(out, tuple) else out).retain_grad()
                                         or outs.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.requires_grad_())
    draws = torch.Generator().manual_seed(DRAW_SEED)
    per_layer: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    for batch in WINDOWS.split(2):
        outs.clear()
        logp = torch.log_softmax(model(batch, use_cache=False).logits.float(), -1)
        drawn = draw_tokens(logp.detach(), draws)
        logp.gather(-1, drawn.unsqueeze(-1)).sum().backward()
        for i, y in enumerate(outs):
            per_layer[i].append(y.grad.detach())
    for h in hooks:
        h.remove()
    return per_layer


@pytest.mark.heavy
def test_streamed_gradients_are_the_whole_models(tiny: Path, tmp_path: Path) -> None:
    streamed = _measured(tiny, "cpu", tmp_path)
    whole = _whole_model_gradients(tiny)
    assert sorted(streamed) == [0, 1, 2]
    for i, per_batch in enumerate(whole):
        for got, want in zip(streamed[i]["grads"], per_batch, strict=True):
            assert got.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        d = streamed[i]["damage"]
        assert d["fisher"][1] == 0.0 and d["fisher"][0] > 0  # bf16: no damage


@pytest.mark.heavy
def test_the_forward_measurement_on_the_gpu_mixes_no_host_tensor_and_matches_the_host(tiny: Path,
                                                                                        tmp_path: Path) -> None:
    # the forward-only proxies (fake CUDA runs no autograd: the fisher pass's backward is not covered here)
    cpu = _measured(tiny, "cpu", tmp_path / "cpu", gradients=False)
    with fake_cuda():
        gpu = _measured(tiny, "cuda", tmp_path / "cuda", gradients=False)
    assert sorted(cpu[0]["damage"]) == ["output", "token", "update"]
    for i in cpu:
        for p, row in cpu[i]["damage"].items():
            assert gpu[i]["damage"][p] == pytest.approx(row, rel=1e-4), (i, p)


class _Residual(nn.Module):
    """y = x + b(a(x)): a decoder layer's shape, small."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(32, 48, bias=False), nn.Linear(48, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


def test_each_proxy_is_its_formula() -> None:
    layer = _Residual()
    xs = [torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(s)) * (1 + 5 * s) for s in range(2)]
    with torch.no_grad():
        ys = [layer(x) for x in xs]
    gs = [torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + s)) for s, y in enumerate(ys)]
    units = [Unit("a", ("a",), 0), Unit("b", ("b",), 0)]
    got = layer_damages(layer, {"a": layer.a, "b": layer.b}, units, {"int4": INT4, "bf16": None}, xs,
                        [((), {})] * 2, ys, {}, gs)
    w = layer.a.weight.data
    q = dequantize_weight(quantize_weights({"a": w}, INT4.weights)["a"], INT4.weights, w.dtype)
    with torch.no_grad():
        dys = [x + layer.b(x @ q.T) - y for x, y in zip(xs, ys)]
    tokens = 20
    sq = sum(float(d.double().pow(2).sum()) for d in dys)
    assert got["output"]["a"][0] == pytest.approx(sq / sum(float(y.double().pow(2).sum()) for y in ys), rel=1e-6)
    assert got["update"]["a"][0] == pytest.approx(
        sq / sum(float((y - x).double().pow(2).sum()) for x, y in zip(xs, ys)), rel=1e-6)
    assert got["token"]["a"][0] == pytest.approx(sum(
        float((d.double().pow(2).sum(-1) / y.double().pow(2).sum(-1)).sum()) for d, y in zip(dys, ys)) / tokens,
        rel=1e-6)
    assert got["fisher"]["a"][0] == pytest.approx(
        0.5 * sum(float((g.double() ** 2 * d.double() ** 2).sum()) for g, d in zip(gs, dys)) / tokens, rel=1e-6)
    assert all(row[1] == 0.0 for per in got.values() for row in per.values())  # bf16
    # the measure the build asks for is the same number, and fisher needs the gradients
    one = layer_damage(layer, {"a": layer.a, "b": layer.b}, units, {"int4": INT4, "bf16": None}, xs,
                       [((), {})] * 2, ys, {}, proxy="update")
    assert one == got["update"]
    assert "fisher" not in layer_damages(layer, {"a": layer.a}, units[:1], {"int4": INT4}, xs, [((), {})] * 2, ys, {})
    with pytest.raises(ValueError, match="unknown search proxy"):
        layer_damage(layer, {"a": layer.a}, units[:1], {"int4": INT4}, xs, [((), {})] * 2, ys, {}, proxy="kl")


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_head_gradients_in_chunks_of_positions_are_the_whole_batchs(monkeypatch, softcap) -> None:
    # a large vocabulary's head runs a batch's positions in chunks (HEAD_CHUNK_BYTES): the same drawn tokens and the
    # same gradients as one autograd pass over the whole batch, for batches of different shapes
    import llmc.quant.fisher as fisher

    torch.manual_seed(0)
    norm, head = nn.LayerNorm(8), nn.Linear(8, 50, bias=False)
    hidden = [torch.randn(2, 5, 8) * 3, torch.randn(1, 7, 8)]
    draws = torch.Generator().manual_seed(DRAW_SEED)
    want = []
    for h in hidden:
        x = h.clone().requires_grad_(True)
        logits = head(norm(x))
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits, -1)
        drawn = draw_tokens(logp.detach(), draws)
        (g,) = torch.autograd.grad(logp.gather(-1, drawn.unsqueeze(-1)).sum(), x)
        want.append(g)
    whole = fisher.head_gradients(norm, head, hidden, torch.device("cpu"), softcap)
    monkeypatch.setattr(fisher, "HEAD_CHUNK_BYTES", 3 * 4 * 4 * 50)  # 3 positions a chunk: chunks cross rows
    chunked = fisher.head_gradients(norm, head, hidden, torch.device("cpu"), softcap)
    for w, a, b in zip(want, whole, chunked, strict=True):
        assert a.shape == w.shape and a.abs().max() > 0
        torch.testing.assert_close(a, w)
        torch.testing.assert_close(b, w)
