"""scripts/compare_exports.py's tiny stand-ins for the recipes whose model is a Hub id (issue 44: the script compares
every shipped recipe): each recipe's own config.json shrinks to tiny widths with its structure kept, the stand-in
saves (FP8 block-wise where the original ships so) and the recipe plans on it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HF_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml")
                    if yaml.safe_load(p.read_text())["model"]["source"].startswith("hf:"))


def _script():
    spec = importlib.util.spec_from_file_location("compare_exports", REPO / "scripts" / "compare_exports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe(path: Path) -> tuple[dict, dict, int]:
    r = yaml.safe_load(path.read_text())
    config = json.loads((path.parent / r["model"]["config"]).read_text())
    return r, config, max(t.get("tensor_parallel", 1) for t in r["targets"])


def test_every_shipped_recipe_has_a_stand_in() -> None:
    ce = _script()
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        r = yaml.safe_load(path.read_text())
        source = r["model"]["source"]
        if source.startswith("hf:"):
            config = json.loads((path.parent / r["model"]["config"]).read_text())
            assert config["model_type"] in ce.HF_FAMILIES, path.name
        else:
            assert source in ce.TINY or path.stem in ce.SKIPPED, path.name


@pytest.mark.parametrize("path", HF_RECIPES, ids=lambda p: p.stem)
def test_the_config_shrinks_with_its_structure_kept(path: Path) -> None:
    from transformers import AutoConfig

    ce = _script()
    _, config, tp = _recipe(path)
    small = ce.shrink(config, tp)
    assert small["hidden_size"] == 128 and small["num_hidden_layers"] <= 4
    assert small["num_attention_heads"] % tp == 0  # vLLM splits the heads over the recipe's ranks
    assert "quantization_config" not in small  # the FP8 original's is written back with its encoded weights
    for key in ("first_k_dense_replace", "n_shared_experts", "interleave_moe_layer_step", "full_attention_interval",
                "decoder_sparse_step", "partial_rotary_factor", "attention_bias", "use_qk_norm", "rope_scaling",
                "tie_word_embeddings", "torch_dtype", "num_nextn_predict_layers"):
        assert small.get(key) == config.get(key), key
    for key in ("q_lora_rank", "kv_lora_rank"):  # MLA keeps its latent ranks (smaller)
        assert (small.get(key) is None) == (config.get(key) is None) and (small.get(key) or 0) <= 128
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)
    if experts:
        assert small.get("first_k_dense_replace", 0) < small["num_hidden_layers"]  # an MoE layer is there
    c = AutoConfig.for_model(small["model_type"], **{k: v for k, v in small.items() if k != "model_type"})
    assert c.hidden_size == 128


@pytest.mark.slow  # 13 stand-ins built, 15 plans: 232 s at load ~9 on the shared 2-core Xeon (2026-12-03)
def test_each_stand_in_saves_and_its_recipe_plans_on_it(tmp_path: Path) -> None:
    from safetensors import safe_open

    from llmc.planning.plan import plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    ce = _script()
    recipes = ce.prepare(HF_RECIPES, "tiny", tmp_path)
    assert [p.stem for p in recipes] == [p.stem for p in HF_RECIPES]
    for path in recipes:
        r = yaml.safe_load(path.read_text())
        folder = Path(r["model"]["source"])
        config = json.loads((folder / "config.json").read_text())
        assert config["hidden_size"] == 128 and "config" not in r["model"]
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            dtypes = {str(f.get_slice(n).get_dtype()) for n in f.keys()}
        if config.get("quantization_config", {}).get("quant_method") == "mxfp4":  # gpt-oss: experts as it ships
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                assert any(n.endswith("experts.down_proj_blocks") for n in f.keys())
        elif "quantization_config" in config:  # DeepSeek-R1/V3, Kimi-K2: FP8 block-wise as they ship
            assert config["quantization_config"]["weight_block_size"] == [128, 128]
            assert "F8_E4M3" in dtypes
        else:
            assert "F8_E4M3" not in dtypes
        assert "BF16" in dtypes  # the originals' dtype
        plan = plan_recipe(load_recipe(path), Store(tmp_path / "cache"), path)
        assert plan.rows, path.stem


def test_a_bytes_budget_becomes_the_same_share_of_the_stand_in(tmp_path: Path) -> None:
    """smollm2-search-nvfp4's 94.9 MB budget (the hand mix's bytes) would hold a stand-in's Linears whole: it is
    handed over as the effective bits it is of the shipped model's decoder-layer Linears (7.15, as
    docs/formats-microscaling.md counts the hand mix)."""
    ce = _script()
    assert ce.budget_as_effective_bits("demo:smollm2-135m", 94887936) == pytest.approx(7.15, abs=0.005)
    (recipe,) = ce.prepare([REPO / "recipes" / "smollm2-search-nvfp4.yaml"], "tiny", tmp_path)
    budget = yaml.safe_load(recipe.read_text())["quantization"]["search"]["budget"]
    assert "bytes" not in budget and budget["effective_bits"] == pytest.approx(7.15, abs=0.005)


def test_a_recipe_without_a_quantization_section_is_prepared(tmp_path: Path) -> None:
    """Variant recipes (smollm2-variants: `variants:` instead of `quantization:`) get a stand-in like the rest: the
    bytes-budget rewrite once read `quantization` unconditionally and stopped the whole comparison."""
    ce = _script()
    (recipe,) = ce.prepare([REPO / "recipes" / "smollm2-variants.yaml"], "tiny", tmp_path)
    r = yaml.safe_load(recipe.read_text())
    assert "quantization" not in r and r["variants"]
    assert Path(r["model"]["source"]).is_dir() and r["calibration"]["samples"] == 4
