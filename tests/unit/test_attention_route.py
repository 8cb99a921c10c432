"""llmc.model.attention: a KV wrapper runs the model's own attention (SDPA, or the family's eager function where
that is what it ran), sees every layer's keys and values, and gives the configs back on unroute."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.model.attention import register_kv_attention, route_kv, unroute_kv
from tests.unit.families import _COMMON, FAMILIES


def _model(family: str, attn: str):
    model_type, overrides = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **overrides, "vocab_size": 97})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize(("family", "attn"), [("llama", "sdpa"), ("gemma2", "eager")])
def test_wrapper_runs_the_base_attention_and_sees_every_layer(family: str, attn: str) -> None:
    model = _model(family, attn)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
    seen: list[tuple[int, tuple[int, ...]]] = []

    def record(module, key, value):
        seen.append((id(module), tuple(key.shape)))
        return key, value

    register_kv_attention(f"test_route_{family}", record)
    attentions = [layer.self_attn for layer in model.model.layers]
    route_kv([(a, model.config) for a in attentions], f"test_route_{family}")
    with torch.no_grad():
        routed = model(ids).logits
    torch.testing.assert_close(routed, base, rtol=0, atol=0)  # the very function the model ran before
    assert [s[0] for s in seen] == [id(a) for a in attentions]
    assert all(shape[0] == 2 and shape[2] == 12 for _, shape in seen)
    unroute_kv([(a, model.config) for a in attentions])
    assert model.config._attn_implementation == attn  # every module shares the config: each got its base back


def test_a_wrapper_that_changes_the_keys_changes_the_output() -> None:
    model = _model("llama", "sdpa")
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(ids).logits
    register_kv_attention("test_route_zero_values", lambda m, k, v: (k, torch.zeros_like(v)))
    pairs = [(layer.self_attn, model.config) for layer in model.model.layers]
    route_kv(pairs, "test_route_zero_values")
    try:
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, base)
    finally:
        unroute_kv(pairs)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=0)


def test_routed_eager_attention_stays_causal() -> None:
    """Gemma 2 runs its own eager attention; the wrapper must hand it the eager (float) mask. Given SDPA's boolean
    mask, as llmc did before, it added 0/1 and every position attended to the tokens after it."""
    model = _model("gemma2", "eager")
    register_kv_attention("test_route_causal", lambda m, k, v: (k, v))
    pairs = [(layer.self_attn, model.config) for layer in model.model.layers]
    route_kv(pairs, "test_route_causal")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(3))
    changed_future = ids.clone()
    changed_future[0, 5:] = (changed_future[0, 5:] + 1) % 97
    try:
        with torch.no_grad():
            a, b = model(ids).logits, model(changed_future).logits
    finally:
        unroute_kv(pairs)
    torch.testing.assert_close(a[0, :5], b[0, :5], rtol=0, atol=0)
