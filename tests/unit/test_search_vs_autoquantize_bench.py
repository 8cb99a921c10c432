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


def gemma3_linears(layers: int = 18) -> dict[str, int]:
    """Gemma-3-270M's decoder Linears (hidden 640, 4 query heads and 1 KV head of 256, MLP 2048): name -> params."""
    shapes = {"self_attn.q_proj": (1024, 640), "self_attn.k_proj": (256, 640), "self_attn.v_proj": (256, 640),
              "self_attn.o_proj": (640, 1024), "mlp.gate_proj": (2048, 640), "mlp.up_proj": (2048, 640),
              "mlp.down_proj": (640, 2048)}
    return {f"model.layers.{i}.{k}": a * b for i in range(layers) for k, (a, b) in shapes.items()}


def test_budgets_and_bits_follow_the_model_not_smollm2() -> None:
    # Gemma-3-270M: 18 layers, its own widths, a 262,144 x 640 head (62% of ModelOpt's count), roles by its family
    recipe = load_recipe(REPO / "recipes" / "smollm2-search-nvfp4.yaml")
    specs = bench.candidate_specs(recipe)
    params = gemma3_linears()
    hand = bench.hand_assignment(params, "gemma3_text")
    assert hand["model.layers.17.mlp.up_proj"] is None and hand["model.layers.16.mlp.up_proj"] == "W4A16-NVFP4"
    assert hand["model.layers.1.self_attn.k_proj"] == "W8A8-FP8"
    layer = sum(params[n] for n in params if ".layers.0." in n)
    attn = 1024 * 640 * 2 + 256 * 640 * 2
    costs = bench.mix_costs(hand, params, specs, 4)
    fp8, nvfp4 = specs["W8A8-FP8"].stored_bits, specs["W4A16-NVFP4"].stored_bits
    assert costs["llmc_bytes"] == pytest.approx(2 * layer * 4 + 16 * attn * fp8 / 8 + 16 * (layer - attn) * nvfp4 / 8)
    assert costs["bits16"] == pytest.approx((2 * layer * 16 + 16 * attn * 8 + 16 * (layer - attn) * 4.5) / (18 * layer))
    # float32 edges make the hand mix larger than uniform FP8 here (not so on SmolLM2); 'hand*F' and 'uniform:X'
    costs_of = lambda a: bench.mix_costs(a, params, specs, 4)  # noqa: E731
    hand_bytes = bench.budget_bytes("hand", params, "gemma3_text", costs_of)
    fp8_bytes = bench.budget_bytes("uniform:W8A8-FP8", params, "gemma3_text", costs_of)
    assert hand_bytes == int(costs["llmc_bytes"]) and fp8_bytes == int(18 * layer * fp8 / 8) < hand_bytes
    assert bench.budget_bytes("hand*0.8", params, "gemma3_text", costs_of) == int(costs["llmc_bytes"] * 0.8)
    assert bench.budget_bytes("123", params, None, costs_of) == 123
    # a bf16 model stores an unquantized Linear in 2 bytes
    assert bench.mix_costs({}, params, specs, 2)["llmc_bytes"] == 2 * sum(params.values())
    # ModelOpt's whole-model floor: every decoder Linear NVFP4, the 262k head at 16 bits
    floor = bench.modelopt_bits(4.5, sum(params.values()), 262_144 * 640)
    assert floor == pytest.approx((4.5 * 18 * layer + 16 * 262_144 * 640) / (18 * layer + 262_144 * 640))
    assert 11.6 < floor < 11.8


def test_searched_units_by_the_familys_roles_and_fused_linear_units() -> None:
    params = gemma3_linears(1)
    got = bench.searched_assignment({"units": {"layers.0.attention": "W8A8-FP8", "layers.0.mlp": "bf16"}},
                                    params, "gemma3_text")
    assert {got[n] for n in params if ".self_attn." in n} == {"W8A8-FP8"}
    assert {got[n] for n in params if ".mlp." in n} == {None}
    fused = "+".join(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    got = bench.searched_assignment({"units": {fused: "W4A16-NVFP4"}}, params, "gemma3_text")
    assert sorted(got) == sorted(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")


def qwen25_05b_linears(layers: int = 24) -> dict[str, int]:
    """Qwen2.5-0.5B's decoder Linears (hidden 896, 2 KV heads of 64, MLP 4864): name -> params."""
    shapes = {"self_attn.q_proj": (896, 896), "self_attn.k_proj": (128, 896), "self_attn.v_proj": (128, 896),
              "self_attn.o_proj": (896, 896), "mlp.gate_proj": (4864, 896), "mlp.up_proj": (4864, 896),
              "mlp.down_proj": (896, 4864)}
    return {f"model.layers.{i}.{k}": a * b for i in range(layers) for k, (a, b) in shapes.items()}


@pytest.mark.parametrize("elem", [4, 2])
def test_hand_mix_bytes_on_another_shape_keep_the_edges_in_the_model_dtype(elem: int) -> None:
    # the edges' bytes follow the dtype the recipe stores unquantized weights in (float32: 4, bfloat16: 2)
    recipe = load_recipe(REPO / "recipes" / "smollm2-search-nvfp4.yaml")
    params = qwen25_05b_linears()
    costs = bench.mix_costs(bench.hand_assignment(params, "qwen2"), params, bench.candidate_specs(recipe), elem)
    layer = sum(params[n] for n in params if ".layers.0." in n)
    attn = sum(params[n] for n in params if ".layers.0.self_attn." in n)
    assert costs["llmc_bytes"] == 2 * layer * elem + 22 * (attn * 8 + (layer - attn) * 4.5) / 8
    assert costs["bits16"] == pytest.approx((2 * layer * 16 + 22 * (attn * 8 + (layer - attn) * 4.5)) / (24 * layer))


def test_stored_elem_is_the_recipes_dtype_or_the_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    recipe = load_recipe(REPO / "recipes" / "smollm2-search-nvfp4.yaml")  # model.dtype: float32
    assert bench.stored_elem(recipe, tmp_path) == 4
    auto = load_recipe(REPO / "recipes" / "smollm2-search-nvfp4.yaml", ["model.dtype=auto"])
    assert bench.stored_elem(auto, tmp_path) == 2
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text"}')
    assert bench.model_type(tmp_path) == "gemma3_text"


def test_overrides_reach_the_uniform_recipe_as_the_others() -> None:
    # --set shrinks every row's windows alike: the uniform rows are built from the hand recipe's text, not loaded
    recipe = bench._uniform(REPO / "recipes" / "smollm2-mixed-nvfp4.yaml", "demo:qwen2.5-coder-0.5b", "W8A8-FP8",
                            ["eval.seq_len=128", "calibration.samples=8"])
    assert recipe.eval.seq_len == 128 and recipe.calibration.samples == 8
    assert recipe.model.source == "demo:qwen2.5-coder-0.5b"
    assert [g.scheme for g in recipe.quantization.groups] == ["W8A8-FP8"]


def _worktree_layout(root: Path, venv_in: str | None) -> tuple[Path, Path]:
    """A main checkout and a git worktree of it, as `git worktree add` lays them out (the worktree's .git a file
    naming main/.git/worktrees/<name>, whose commondir leads back), the ModelOpt venv in `venv_in` (or nowhere)."""
    main, tree = root / "main", root / "wt-x"
    (main / ".git" / "worktrees" / "wt-x").mkdir(parents=True)
    (main / ".git" / "worktrees" / "wt-x" / "commondir").write_text("../..\n")
    tree.mkdir()
    (tree / ".git").write_text(f"gitdir: {main / '.git' / 'worktrees' / 'wt-x'}\n")
    if venv_in:
        python = root / venv_in / ".venv-modelopt" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
    return main, tree


@pytest.mark.parametrize("venv_in", ["main", "wt-x"])
def test_the_modelopt_venv_is_found_from_a_worktree_as_from_the_main_checkout(tmp_path: Path, monkeypatch,
                                                                               venv_in: str) -> None:
    """setup-peers.sh makes .venv-modelopt in the main checkout; the benchmark run from a worktree finds it there (its
    own checkout's first, when it has one)."""
    monkeypatch.delenv(bench.PEER_VARIABLE, raising=False)
    main, tree = _worktree_layout(tmp_path, venv_in)
    assert bench.peer_python(tree, bench.PEER_VENV, bench.PEER_VARIABLE) == tmp_path / venv_in / ".venv-modelopt" / \
        "bin" / "python"
    if venv_in == "main":
        assert bench.peer_python(main, bench.PEER_VENV, bench.PEER_VARIABLE) == main / ".venv-modelopt/bin/python"


def test_the_modelopt_variable_wins_and_a_missing_venv_names_where_it_looked(tmp_path: Path, monkeypatch) -> None:
    main, tree = _worktree_layout(tmp_path, "main")
    elsewhere = tmp_path / "opt" / "python"
    elsewhere.parent.mkdir()
    elsewhere.write_text("")
    monkeypatch.setenv(bench.PEER_VARIABLE, str(elsewhere))
    assert bench.peer_python(tree, bench.PEER_VENV, bench.PEER_VARIABLE) == elsewhere
    monkeypatch.setenv(bench.PEER_VARIABLE, str(tmp_path / "typo"))  # set but wrong: said, not looked past
    with pytest.raises(SystemExit, match=r"\$LLMC_MODELOPT_PYTHON names .*typo, which does not exist"):
        bench.peer_python(tree, bench.PEER_VENV, bench.PEER_VARIABLE)
    monkeypatch.delenv(bench.PEER_VARIABLE)
    _, bare = _worktree_layout(tmp_path / "bare", None)
    with pytest.raises(SystemExit) as e:
        bench.peer_python(bare, bench.PEER_VENV, bench.PEER_VARIABLE)
    assert str(bare / ".venv-modelopt/bin/python") in str(e.value)
    assert str(tmp_path / "bare/main/.venv-modelopt/bin/python") in str(e.value) and "setup-peers.sh" in str(e.value)
