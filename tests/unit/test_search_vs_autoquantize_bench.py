"""benchmarks/search_vs_autoquantize.py's bookkeeping: the hand mix and searched units cover every decoder Linear once,
its byte count is the search's own (the hand mix of recipes/smollm2-mixed-nvfp4.yaml on SmolLM2's shapes lands on that
recipe's search twin's budget), ModelOpt's choices are mapped per Linear or refused when one is missing, and another
tool's lm_head inputs are scored through the baseline's head exactly as the baseline scores itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmc.engines.agreement import score_logits
from llmc.recipe.load import load_recipe
from tests.unit.bench_modules import benchmark_module

REPO = Path(__file__).resolve().parents[2]

bench = benchmark_module("search_vs_autoquantize")


def smollm2_linears(layers: int = 30) -> dict[str, int]:
    """SmolLM2-135M's decoder Linears (hidden 576, 3 KV heads of 64, MLP 1536): name -> params."""
    shapes = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
              "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
              "mlp.down_proj": (576, 1536)}
    return {f"model.layers.{i}.{k}": a * b for i in range(layers) for k, (a, b) in shapes.items()}


def test_hand_mix_costs_the_budget_the_search_recipe_names() -> None:
    recipe = load_recipe(REPO / "recipes" / "smollm2-search-nvfp4.yaml")
    params = smollm2_linears()
    hand = bench.hand_assignment(params)
    assert hand["model.layers.0.mlp.up_proj"] is None and hand["model.layers.29.self_attn.q_proj"] is None
    assert hand["model.layers.5.self_attn.o_proj"] == "W8A8-FP8" and hand["model.layers.5.mlp.down_proj"] == "W4A16-NVFP4"
    costs = bench.mix_costs(hand, params, bench.candidate_specs(recipe))
    assert costs["llmc_bytes"] == recipe.quantization.search.budget.bytes  # the recipe's "hand mix's stored bytes"
    # ModelOpt's accounting: 2 float layers at 16 bits, attention 8, MLP 4.5
    layer, attn = sum(params[n] for n in params if ".layers.0." in n), 884_736
    expected = (2 * layer * 16 + 28 * attn * 8 + 28 * (layer - attn) * 4.5) / (30 * layer)
    assert costs["bits16"] == pytest.approx(expected)


def test_searched_units_cover_each_linear_of_their_layer_and_role_only() -> None:
    params = smollm2_linears(2)
    units = {"layers.0.attention": "bf16", "layers.0.mlp": "W8A8-FP8", "layers.1": "W4A16-NVFP4"}
    got = bench.searched_assignment({"units": units}, params)
    assert set(got) == set(params)
    assert {got[n] for n in params if ".layers.0.self_attn." in n} == {None}
    assert {got[n] for n in params if ".layers.0.mlp." in n} == {"W8A8-FP8"}
    assert {got[n] for n in params if ".layers.1." in n} == {"W4A16-NVFP4"}


def test_autoquant_choices_map_per_linear_and_a_missing_one_is_refused() -> None:
    params = smollm2_linears(1)
    names = {"self_attn.q_proj": "W4A16_NVFP4_CFG(effective-bits: 4.5)", "self_attn.k_proj": "W4A16_NVFP4_CFG(effective-bits: 4.5)",
             "self_attn.v_proj": "W4A16_NVFP4_CFG(effective-bits: 4.5)", "self_attn.o_proj": "FP8_DEFAULT_CFG(effective-bits: 8.0)",
             "mlp.gate_proj": "NONE(effective-bits: 16.0)", "mlp.up_proj": "NONE(effective-bits: 16.0)",
             "mlp.down_proj": "FP8_DEFAULT_CFG(effective-bits: 8.0)"}
    chosen = {f"model.layers.0.{k}": v for k, v in names.items()}
    got = bench.autoquant_assignment(chosen, params)
    assert got["model.layers.0.self_attn.k_proj"] == "W4A16-NVFP4" and got["model.layers.0.mlp.up_proj"] is None
    assert got["model.layers.0.mlp.down_proj"] == "W8A8-FP8"
    del chosen["model.layers.0.mlp.up_proj"]
    with pytest.raises(SystemExit, match="chose nothing for 1 decoder Linears"):
        bench.autoquant_assignment(chosen, params)


def test_hidden_states_scored_through_the_baseline_head() -> None:
    torch.manual_seed(0)
    windows, seq, hidden, vocab = 3, 9, 8, 20
    ids = torch.randint(0, vocab, (windows, seq))
    h = torch.randn(windows, seq, hidden)
    weight = torch.randn(vocab, hidden)
    base = score_logits(torch.nn.functional.linear(h[:, :-1], weight), ids[:, 1:], 5)
    reference = {**base, "head_input": h[:, :-1], "head_weight": weight, "head_scale": torch.tensor(1.0, dtype=torch.float64),
                 "head_softcap": torch.tensor(0.0, dtype=torch.float64)}
    same = bench.score_hidden(h, ids, reference)
    assert same["window_nll"] == pytest.approx(base["nll"].mean(dim=1).tolist())
    assert max(same["window_kl"]) < 1e-9 and same["window_top1"] == [1.0] * windows
    other = bench.score_hidden(h + 0.5 * torch.randn_like(h), ids, reference)
    assert min(other["window_kl"]) > 1e-3


def test_modelopt_bits_count_the_disabled_head_at_16() -> None:
    # ModelOpt 0.47 on SmolLM2-135M with lm_head disabled refused 6.0833 with "the minimum achievable effective bits
    # is 6.9211": every decoder Linear NVFP4 (4.5) and the tied 49,152 x 576 head at 16 bits
    decoder, head = sum(smollm2_linears().values()), 49_152 * 576
    assert bench.modelopt_bits(4.5, decoder, head) == pytest.approx(6.9211, abs=1e-4)
    assert bench.modelopt_bits(16.0, decoder, head) == 16.0
