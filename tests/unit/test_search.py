"""quantization.search's pieces (llmc.quant.search): the exact multiple-choice knapsack against brute force, the
Pareto front, the units (fused siblings never split for fusing runtimes), and the assignment as groups."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from llmc.quant.search import BF16, Unit, assignment_groups, make_units, solve, unit_bytes
from llmc.quant.spec import ModuleGroup, ModuleTargets, TensorSpec


def _brute(sizes, damage, budget):
    """(least damage, its bytes) over every assignment within the budget; None when none fits."""
    best = None
    for choice in itertools.product(*(range(len(r)) for r in sizes)):
        b = sum(Fraction(sizes[u][c]) for u, c in enumerate(choice))
        d = sum(damage[u][c] for u, c in enumerate(choice))
        if b <= budget and (best is None or d < best[0] - 1e-12):
            best = (d, b)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_solve_matches_brute_force(seed):
    rng = random.Random(seed)
    units, cands = rng.randint(1, 5), rng.randint(1, 4)
    # fractional bytes as NVFP4's 4.5 bits give them; some candidates the same size
    sizes = [[Fraction(rng.randint(1, 40), rng.choice([1, 2, 16])) for _ in range(cands)] for _ in range(units)]
    damage = [[rng.random() for _ in range(cands)] for _ in range(units)]
    total_min = sum(min(r) for r in sizes)
    total_max = sum(max(r) for r in sizes)
    for budget in (total_min - Fraction(1, 32), total_min, (total_min + total_max) / 2, total_max, total_max + 5,
                   Fraction(rng.randint(0, 200), 4)):
        expect = _brute(sizes, damage, budget)
        got = solve(sizes, damage, budget)
        if expect is None:
            assert got is None
            continue
        assert got is not None and got.exact
        assert got.damage == pytest.approx(expect[0], abs=1e-12)
        assert Fraction(got.bytes) <= budget  # the budget is never exceeded
        assert sum(Fraction(sizes[u][c]) for u, c in enumerate(got.choice)) == Fraction(got.bytes)
        assert sum(damage[u][c] for u, c in enumerate(got.choice)) == pytest.approx(got.damage)


@pytest.mark.parametrize("seed", range(10))
def test_front_is_every_budget_optimum_and_monotone(seed):
    rng = random.Random(100 + seed)
    sizes = [[rng.randint(1, 12) for _ in range(3)] for _ in range(4)]
    damage = [[rng.random() for _ in range(3)] for _ in range(4)]
    front = solve(sizes, damage, 10**6).front
    xs, ys = [b for b, _ in front], [d for _, d in front]
    assert xs == sorted(xs) and all(a > b for a, b in zip(ys, ys[1:]))  # more bytes, strictly less damage
    for b, d in front:  # each point is the brute-force optimum at its bytes
        assert _brute(sizes, damage, b)[0] == pytest.approx(d)
    # a tighter budget never gives less damage (nor more bytes) than a looser one
    budgets = sorted({rng.randint(int(min(xs)), int(max(xs)) + 3) for _ in range(8)})
    sols = [solve(sizes, damage, b) for b in budgets]
    for tight, loose in zip(sols, sols[1:]):
        assert tight.damage >= loose.damage - 1e-12


def test_coarsened_grid_still_respects_budget():
    rng = random.Random(7)
    sizes = [[rng.randint(1000, 90000) for _ in range(3)] for _ in range(6)]
    damage = [[rng.random() for _ in range(3)] for _ in range(6)]
    budget = sum(min(r) for r in sizes) + 60000
    got = solve(sizes, damage, budget, max_cells=2000)  # forces a coarse byte axis
    assert not got.exact and got.bytes <= budget
    assert got.damage >= _brute(sizes, damage, budget)[0] - 1e-12


def _linears(layers=2):
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
    part = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    return {f"model.layers.{i}.{part.get(n, 'mlp')}.{n}": s for i in range(layers) for n, s in shapes.items()}


def test_units_never_split_fused_siblings_for_fusing_runtimes():
    linears = _linears()
    fused = make_units(linears, "linear", "llama", fuse=True)
    loose = make_units(linears, "linear", "llama", fuse=False)
    assert len(loose) == 14 and len(fused) == 8  # per layer: qkv, o, gate+up, down
    for unit in fused:
        locals_ = {n.rsplit(".", 1)[1] for n in unit.linears}
        assert locals_ in ({"q_proj", "k_proj", "v_proj"}, {"o_proj"}, {"gate_proj", "up_proj"}, {"down_proj"})
    assert sum(u.params for u in fused) == sum(a * b for a, b in linears.values())
    roles = make_units(linears, "role", "llama", fuse=True)
    assert [u.name for u in roles] == ["layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp"]
    assert len(make_units(linears, "layer", "llama", fuse=True)) == 2


def test_expert_gate_up_stay_together():
    linears = {f"model.layers.0.mlp.experts.{e}.{p}": (16, 8) for e in range(2) for p in ("gate_proj", "up_proj",
                                                                                          "down_proj")}
    units = make_units(linears, "linear", "qwen3_moe", fuse=True)
    assert sorted(len(u.linears) for u in units) == [1, 1, 2, 2]


def test_unit_bytes_and_groups():
    nvfp4 = TensorSpec("nvfp4", "group", 16)
    assert unit_bytes(160, nvfp4, 4) == Fraction(160 * 9, 16)  # 4 bits + an 8-bit scale per 16
    assert unit_bytes(10, None, 4) == 40
    units = [Unit("a", ("x.a",), 1), Unit("b", ("x.b",), 1), Unit("c", ("x.c",), 1)]
    member = {"W4A16-NVFP4": ModuleGroup("", ModuleTargets(), nvfp4)}
    groups = assignment_groups(units, ["W4A16-NVFP4", BF16], [0, 1, 0], lambda c: member[c], ["x.p"])
    assert [(g.name, g.targets.names, g.quantized) for g in groups] == [
        ("search-w4a16-nvfp4", ("x.a", "x.c"), True), ("search-bf16", ("x.b", "x.p"), False)]
