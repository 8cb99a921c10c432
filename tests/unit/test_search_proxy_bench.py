"""benchmarks/search_proxy.py's shortened run (layers i.. on the kept input to layer i) is the model's own forward.

The true per-unit KLDs the proxy is ranked against rest on it: a shortened run that differs from the model even with
nothing quantized adds its own error to every row. Gemma-3 pairs each layer with its mask and rotary embedding by the
loop's index into `config.layer_types`, so a plain slice `layers[i:]` gave layer i layer 0's local rope (found on
Gemma-3-270M: the true KLDs of layers 1-5 were ~0.1 for attention and MLP alike)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.bench_modules import benchmark_module


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                           max_position_embeddings=64)
    return Gemma3ForCausalLM(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("build", [_gemma3, _llama], ids=["gemma3", "llama"])
def test_run_from_reproduces_the_forward(build):
    bench = benchmark_module("search_proxy")
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, 64, (2, 12))  # longer than the sliding window: local and global layers differ
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    originals = list(model.model.layers)
    for i in range(len(originals)):
        got = bench.run_from(model, ids, i, inputs[i])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert list(model.model.layers) == originals  # every layer put back


def test_a_plain_slice_would_not():
    """The old way (the layers sliced) differs on Gemma-3: the check above can fail."""
    torch.manual_seed(0)
    model = _gemma3().eval()
    ids = torch.randint(0, 64, (2, 12))
    inputs: dict[int, torch.Tensor] = {}
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, a: inputs.__setitem__(1, a[0].detach()))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    hook.remove()
    saved = model.model.layers
    emb = model.model.embed_tokens.register_forward_hook(lambda m, a, out: inputs[1])
    model.model.layers = saved[1:]
    try:
        with torch.no_grad():
            sliced = model(ids, use_cache=False).logits
    finally:
        emb.remove()
        model.model.layers = saved
    assert (sliced - want).abs().max() > 1e-3
