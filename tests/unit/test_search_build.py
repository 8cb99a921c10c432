"""quantization.search end to end on a tiny random Llama (tests/unit/families.py make_tiny): one measuring
calibration pass, the exact solve, the chosen mix quantized, exported, evaluated and gated like any recipe; a new
budget re-solves from the cached measurement (no calibration forward: the events say so)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmc.errors import IncompatibleTargetError, RecipeError
from llmc.quant.groups import site_of
from llmc.quant.microscaling import fused_groups
from llmc.quant.spec import TensorSpec
from llmc.recipe.load import parse_recipe
from llmc.telemetry import events
from tests.unit.families import make_tiny

CANDIDATES = ["W4A16-NVFP4", "W8A8-FP8", "bf16"]
TARGET = {"runtime": "vllm", "gpu_arch": "sm100"}  # fuses q/k/v and gate/up


def _recipe(model: Path, bits: float, root: Path, *, candidates=CANDIDATES, target=TARGET, granularity="linear",
            protect=("first 1",), **extra) -> object:
    return parse_recipe(yaml.safe_dump({
        "name": "tiny-search", "model": {"source": str(model)},
        "quantization": {"search": {"candidates": list(candidates), "budget": {"effective_bits": bits},
                                    "granularity": granularity, "protect": list(protect)}},
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0}, "targets": [target],
        "eval": {"seq_len": 64, "windows": 6, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 200},
        "gates": {"max_ppl_increase_pct": 50.0}, "publish": {"registry": str(root / "registry")}, **extra}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("search")
    make_tiny("llama", root / "model", num_hidden_layers=4)
    return root


def _stored_bytes(meta: dict) -> float:
    """The decoder-layer Linears' weights as quantized.json records them: each module's group's stored bits."""
    groups = {g["name"]: g for g in meta["scheme"]["groups"]}
    total = 0.0
    for name, m in meta["modules"].items():
        w = groups[m["group"]]["weights"]
        total += m["shape"][0] * m["shape"][1] * TensorSpec(**w).stored_bits / 8
    elem = 4  # float32 model: unquantized weights
    for name in meta["unquantized_modules"]:
        total += _shapes(meta)[name] * elem
    return total


def _artifact_linear_bytes(folder: Path, linears: set[str]) -> tuple[int, int]:
    """(bytes of the tensors of `linears` in the artifact's safetensors files, of which per-tensor scalars apart)."""
    from safetensors import safe_open

    tensors = scalars = 0
    for f in folder.rglob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.rsplit(".", 1)[0] not in linears:
                    continue
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = n * {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1}[t.get_dtype()]
                if n <= 1:
                    scalars += size
                else:
                    tensors += size
    return tensors, scalars


def _shapes(meta: dict) -> dict[str, int]:
    c = meta["config"]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    local = {"q_proj": h * h, "o_proj": h * h, "k_proj": h * kv, "v_proj": h * kv, "gate_proj": h * i,
             "up_proj": h * i, "down_proj": h * i}
    return {n: local[n.rsplit(".", 1)[1]] for n in meta["unquantized_modules"]}


def test_search_build_end_to_end(tiny: Path) -> None:
    from llmc.build import build
    from llmc.storage.store import Store

    heard: list[str] = []
    listener = events.subscribe(heard.append)
    try:
        result = build(_recipe(tiny / "model", 14.0, tiny), Store(tiny / "cache"))
    finally:
        events.unsubscribe(listener)
    assert result.passed and result.published is not None
    assert sum(e.startswith("search:layer:") for e in heard) == 4  # one measuring pass over the 4 layers
    chosen = result.search[""]
    meta = json.loads((result.quantized_dirs[""] / "quantized.json").read_text())
    # the written weights are the solved bytes, within the budget
    assert _stored_bytes(meta) == pytest.approx(chosen["bytes"]) and chosen["bytes"] <= chosen["budget_bytes"]
    assert meta["search"]["bytes"] == chosen["bytes"] and "budget_bytes" not in meta["search"]
    # protected layer 0 stays in the model's dtype; every other Linear in one searched group
    layer0 = {n for n in meta["unquantized_modules"] if site_of(n)[0] == 0}
    assert len(layer0) == 7 and not any(site_of(n)[0] == 0 for n in meta["modules"])
    # fused siblings (q/k/v, gate/up) always share their group: the target runs them as one GEMM
    group_of = {**{n: m["group"] for n, m in meta["modules"].items()}, **dict.fromkeys(meta["unquantized_modules"])}
    for siblings in fused_groups(sorted(group_of)):
        assert len({group_of[n] for n in siblings}) == 1, siblings
    # the quantize stage ran no calibration forward: the measuring pass recorded the ranges it needs
    assert meta["layer_loop"]["flow"] in ("shared-statistics", "data-free")
    [artifact] = result.artifacts.values()
    assert artifact.scheme == result.plan.scheme.name and artifact.scheme.startswith("MIXED-")
    # the artifact's files: the decoder-layer Linears' tensors take the solved bytes, per-tensor scalars (global and
    # input scales: the format's metadata) aside
    written, scalars = _artifact_linear_bytes(Path(artifact.dir), set(group_of))
    assert written == chosen["bytes"] and written <= chosen["budget_bytes"] and scalars <= 3 * 4 * len(group_of)
    report = next(Path(result.published).rglob("report.md")).read_text()
    assert "## Mixed precision search" in report and "Pareto front" in report


@pytest.mark.slow  # ~100 s in the default run of 2026-12-02 (two searched builds); issue 47's budget-reuse proof
def test_a_new_budget_resolves_from_the_cached_measurement(tiny: Path, monkeypatch) -> None:
    from llmc.build import build_until
    from llmc.storage.store import Store

    store = Store(tiny / "cache-budgets")
    build_until(_recipe(tiny / "model", 20.0, tiny), store, "quantize")  # measures once
    import llmc.pipeline.search as search_stage

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(search_stage, "measure_model", no_measuring)
    chosen, fronts = [], []
    for bits in (12.0, 13.0, 15.0, 17.0, 20.0, 31.0):
        heard: list[str] = []
        listener = events.subscribe(heard.append)
        try:
            result = build_until(_recipe(tiny / "model", bits, tiny), store, "quantize")
        finally:
            events.unsubscribe(listener)
        assert not any(e.startswith("search:layer:") for e in heard)
        assert [s.cached for s in result.stages if s.name.endswith(":sensitivity")] == [True]
        c = result.search[""]
        meta = json.loads((result.quantized_dirs[""] / "quantized.json").read_text())
        assert _stored_bytes(meta) == pytest.approx(c["bytes"]) and c["bytes"] <= c["budget_bytes"]
        chosen.append(c)
        fronts.append(c["front"])
    assert all(f == fronts[0] for f in fronts)  # the front does not depend on the budget
    full = chosen[0]["bytes"] * 32 / chosen[0]["effective_bits"]  # every decoder-layer Linear in float32
    for tight, loose in zip(chosen, chosen[1:]):  # a tighter budget never saves fewer bytes, never predicts less damage
        assert full - tight["bytes"] >= full - loose["bytes"]
        assert tight["predicted_damage"] >= loose["predicted_damage"]
    assert chosen[0]["bytes"] < chosen[-1]["bytes"] and chosen[0]["predicted_damage"] > 0


def test_budget_below_the_smallest_mix_is_the_recipes_error(tiny: Path) -> None:
    from llmc.planning.plan import make_plan

    with pytest.raises(RecipeError) as e:
        make_plan(_recipe(tiny / "model", 6.0, tiny), tiny / "model", refuse=False)
    assert e.value.exit_code == 2 and "below the smallest mix" in e.value.message and "effective bits" in e.value.fix
    with pytest.raises(RecipeError) as e:  # room for everything unquantized: nothing to search
        make_plan(_recipe(tiny / "model", 32.0, tiny), tiny / "model", refuse=False)
    assert "would quantize nothing" in e.value.message
    with pytest.raises(RecipeError) as e:  # every decoder-layer Linear protected
        make_plan(_recipe(tiny / "model", 20.0, tiny, protect=("0-3",)), tiny / "model", refuse=False)
    assert "nothing to search" in e.value.message and e.value.exit_code == 2


def test_candidates_a_target_cannot_run_are_removed_with_the_reason(tiny: Path) -> None:
    from llmc.planning.plan import make_plan

    # sm90: SGLang runs no W4A4-NVFP4 there (the runtime's own rule: Blackwell only); W8A8-FP8 stays
    plan = make_plan(_recipe(tiny / "model", 20.0, tiny, candidates=["W4A4-NVFP4", "W8A8-FP8", "bf16"],
                             target={"runtime": "sglang", "gpu_arch": "sm90"}), tiny / "model", refuse=False)
    space = plan.search[""]
    assert space.candidates == ("W8A8-FP8", "bf16")
    [(name, why)] = space.removed
    assert name == "W4A4-NVFP4" and "W4A4-NVFP4" in why and "sm90" in why
    assert "candidate W4A4-NVFP4 removed" in plan.render()
    with pytest.raises(IncompatibleTargetError):  # nothing left to search with
        make_plan(_recipe(tiny / "model", 20.0, tiny, candidates=["W4A4-NVFP4", "bf16"],
                          target={"runtime": "sglang", "gpu_arch": "sm90"}), tiny / "model", refuse=False)


def test_search_and_groups_together_are_refused() -> None:
    from llmc.recipe.load import parse_recipe as parse

    with pytest.raises(RecipeError) as e:
        parse(yaml.safe_dump({"name": "x", "model": {"source": "demo:smollm2-135m"}, "targets": [TARGET],
                              "quantization": {"search": {"candidates": CANDIDATES, "budget": {"bytes": 10**6}},
                                               "groups": [{"name": "a", "roles": ["mlp"], "scheme": "W8A8-FP8"}]}}))
    assert e.value.exit_code == 2 and "search and groups" in str(e.value) and "search.protect" in str(e.value)
