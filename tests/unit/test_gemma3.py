"""Gemma 3 through llmc's layer streaming: sliding-window and global layers (different attention masks,
local and global rotary tables), (1 + weight) RMSNorms and a separate pre-feedforward norm, on a tiny
random Gemma3ForCausalLM built here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from llmc.model.source import ModelSource
from llmc.quant import flows, stream
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.algorithms.awq import AwqOptions, awq_layer, fake_quantize_weight
from llmc.quant.algorithms.mappings import layer_mappings
from llmc.quant.algorithms.catalog import Observe
from llmc.quant.numerics import static_scale
from llmc.quant.observe import LayerStats, observing
from llmc.quant.spec import Scheme, TensorSpec

from tests.conftest import make_tokenizer

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SEQ = 24  # longer than the sliding window, so sliding layers really mask
INT4_G16 = TensorSpec("int4", "group", group_size=16)
W8A8_STATIC = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"))


def make_tiny_gemma3(folder: Path, *, sliding_window: int = 6, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=sliding_window, layer_types=LAYER_TYPES,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights; norms away from 0 so (1 + weight) matters
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return Path(folder)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "model")


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _linear_input_absmax(model, ids: torch.Tensor, batch: int | None = None) -> dict[str, torch.Tensor]:
    """Per-input-channel max |input| of every decoder-layer Linear, from hooks on the whole model run at once (or on
    `batch` windows at a time)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_m, args):
            a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
            seen[name] = a if name not in seen else torch.maximum(seen[name], a)

        return record

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and ".layers." in n]
    with torch.no_grad():
        for part in ids.split(batch or len(ids)):
            model(input_ids=part)
    for h in hooks:
        h.remove()
    return seen


def observing_channel_absmax(monkeypatch) -> dict[str, torch.Tensor]:
    """The per-channel input ranges the layer stream observes (flows.observe_batches' statistics), filled as it runs."""
    observed: dict[str, torch.Tensor] = {}
    real_observe = flows.observe_batches

    def keep(layer, linears, kv, observe, hidden, extras, stats, sink=None):
        real_observe(layer, linears, kv, observe, hidden, extras, stats, sink)
        observed.update(stats.channel_absmax)

    monkeypatch.setattr(flows, "observe_batches", keep)
    return observed


def test_streamed_calibration_sees_the_whole_models_activations(gemma3: Path, tmp_path: Path, monkeypatch) -> None:
    """Layer by layer, every Linear sees the inputs it gets in the whole model's own forward (per-channel
    ranges equal), and the static activation scales written are theirs: the per-layer-type masks and
    rotary tables captured once are the ones each layer gets."""
    calib = torch.randint(3, 200, (4, SEQ), generator=torch.Generator().manual_seed(1))
    ref = _linear_input_absmax(_load(gemma3), calib)
    # the check can fail: with a window covering the whole sequence, sliding layers compute something else
    wide = _linear_input_absmax(_load(make_tiny_gemma3(tmp_path / "wide", sliding_window=1024)), calib)
    assert not torch.equal(wide["model.layers.0.self_attn.o_proj"], ref["model.layers.0.self_attn.o_proj"])

    observed = observing_channel_absmax(monkeypatch)
    stream.quantize_model(ModelSource(gemma3, "g", "g"), W8A8_STATIC, tmp_path / "q",
                          stream.Calibration(calib, batch_size=2))
    written = {}
    for f in sorted((tmp_path / "q" / "layers").glob("*.safetensors")):
        written.update(load_file(str(f)))
    assert len(ref) == len(observed) == len(LAYER_TYPES) * 7
    for name, absmax in ref.items():
        torch.testing.assert_close(observed[name], absmax, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(written[f"{name}.input_scale"], static_scale(absmax.amax(), W8A8_STATIC.activations),
                                   rtol=1e-5, atol=0, msg=name)


def test_streamed_rtn_export_reproduces_direct_fake_quantization(gemma3: Path, tmp_path: Path) -> None:
    """RTN W4A16 g16 through quantize → compressed-tensors export → torch engine gives the logits of the
    original model with each decoder Linear's weight replaced by its direct fake-quantization."""
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.engines.torch_ref import TorchEngine
    from llmc.quant.canonical import QuantizedModel

    scheme = Scheme(INT4_G16)
    stream.quantize_model(ModelSource(gemma3, "g", "g"), scheme, tmp_path / "q", None)
    export_compressed_tensors(QuantizedModel.open(tmp_path / "q"), tmp_path / "export")
    ids = torch.randint(3, 200, (2, SEQ), generator=torch.Generator().manual_seed(2))

    direct = _load(gemma3)
    with torch.no_grad():
        base = direct(input_ids=ids).logits
        n = 0
        for name, m in direct.named_modules():
            if isinstance(m, nn.Linear) and name != "lm_head":
                m.weight.data = fake_quantize_weight(m.weight.data, INT4_G16)
                n += 1
        expected = direct(input_ids=ids).logits
        got = TorchEngine(tmp_path / "export", streamed=False).model(input_ids=ids, use_cache=False).logits
    assert n == len(LAYER_TYPES) * 7
    assert (expected - base).abs().max() > 1e-2  # quantization is visible
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _layer_io(model, index: int, ids: torch.Tensor):
    captured = {}

    def hook(_m, _args, _kwargs, out):
        captured["out"] = out[0] if isinstance(out, tuple) else out

    h = model.model.layers[index].register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    h.remove()
    return captured["out"], logits


@pytest.mark.parametrize("index", [0, 1], ids=["sliding", "full"])
def test_smoothquant_and_awq_scaling_keep_a_gemma3_layers_function(gemma3: Path, index: int) -> None:
    """Smoothing folds 1/s into Gemma's (1 + weight) norms (input_layernorm for q/k/v, pre_feedforward_layernorm
    for gate/up; post_attention_layernorm normalizes the attention output and is no producer)."""
    ids = torch.randint(3, 200, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for algorithm in ("smoothquant", "awq"):
        model = _load(gemma3)
        layer = model.model.layers[index]
        assert [m.producer for m in layer_mappings(layer) if m.from_norm] == ["input_layernorm", "pre_feedforward_layernorm"]
        before, logits_before = _layer_io(model, index, ids)
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        observe = Observe(hessians=False, module_calls=tuple(sorted({m.parent for m in layer_mappings(layer)} | set(linears))))
        stats = LayerStats()
        with observing(layer, linears, stats, {}, observe), torch.no_grad():
            model(input_ids=ids, use_cache=False)
        norms = {n: layer.get_submodule(n).weight.clone() for n in ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm")}
        if algorithm == "smoothquant":
            scheme = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True), algorithm="smoothquant")
            assert AlgorithmSteps.of(scheme).transform_layer(layer, "", stats)
        else:
            awq_layer(layer, "", stats, INT4_G16, AwqOptions(clip=False))
        after, logits_after = _layer_io(model, index, ids)
        assert torch.equal(norms["post_attention_layernorm"], layer.post_attention_layernorm.weight)
        if algorithm == "smoothquant":  # AWQ may find s = 1 best on random weights; SmoothQuant always rescales
            assert not torch.equal(norms["input_layernorm"], layer.input_layernorm.weight)
            assert not torch.equal(norms["pre_feedforward_layernorm"], layer.pre_feedforward_layernorm.weight)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4, msg=algorithm)
        torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4, msg=algorithm)
