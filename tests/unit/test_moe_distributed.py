"""Mixture-of-Experts calibration under torchrun (llmc.distributed), bit-identical to one process.

Each rank routes its own block of windows, so an expert may see tokens on one rank and none on another. The default
run checks the combination in two real gloo processes (seconds): ranges and Hessians over the union of the ranks'
Linears, the Hessians chained through the ranks so every float32 step is one process's (`chain_hessians`), the routed
counts summed, FP8 codes through the object collectives, and the loop's decision. The slow tests launch torchrun with
two CPU ranks on tiny DeepSeek-V3 and Qwen3-MoE models (tests/unit/dist_child.py, as tests/unit/test_distributed.py
does for dense models): GPTQ W4A16 and FP8 W8A8 static, every byte of the canonical form equal to one process's.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import llmc
from llmc import distributed
from llmc.quant.algorithms.gptq import accumulate_hessian
from llmc.quant.observe import LayerStats

CHILD = Path(__file__).with_name("dist_child.py")
REPO = Path(llmc.__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the combination (two gloo processes)

# Hessian calls in window order, as an observer records them: (key, rows); rank 0 holds the first three
CALLS = [("a", 5), ("c", 3), ("a", 7), ("a", 2), ("b", 4), ("b", 1)]
SPLIT = 3
WIDTH = 6


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, WIDTH, generator=g) * (1 + i) for i, (_, rows) in enumerate(CALLS)]


def _one_process() -> dict[str, tuple[torch.Tensor, int]]:
    out: dict[str, tuple[torch.Tensor | None, int]] = {}
    for (key, _), x in zip(CALLS, _inputs()):
        out[key] = accumulate_hessian(*out.get(key, (None, 0)), x)
    return out


def _combine(rank: int, world: int, init_file: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    stats = LayerStats(exact=True, defer_hessians=rank > 0)
    mine = range(SPLIT) if rank == 0 else range(SPLIT, len(CALLS))
    xs = _inputs()
    for i in mine:  # what the observer's hook does with each call
        key, x = CALLS[i][0], xs[i]
        stats.hessian_of[key] = key
        if stats.defer_hessians:
            stats.deferred.setdefault(key, []).append(x)
        else:
            stats.hessians[key], stats.hessian_tokens[key] = accumulate_hessian(stats.hessians.get(key),
                                                                              stats.hessian_tokens.get(key, 0), x)
        a = x.abs().amax(dim=0)
        stats.channel_absmax[key] = torch.maximum(stats.channel_absmax[key], a) if key in stats.channel_absmax else a
        stats.input_absmax[key] = stats.channel_absmax[key].amax()
    distributed.reduce_layer_stats(stats)
    routed = {"mlp": torch.tensor([3, 0, 5, 0]) if rank == 0 else torch.tensor([1, 0, 0, 2])}
    distributed.sum_counts(routed)
    fp8 = {"codes": torch.linspace(-3, 3, 7).to(torch.float8_e4m3fn), "rank": rank}
    torch.save({"hessians": stats.hessians, "tokens": stats.hessian_tokens, "channel": stats.channel_absmax,
                "input": stats.input_absmax, "routed": routed, "deferred": dict(stats.deferred),
                "fp8": distributed.gather_objects(fp8), "fp8_bcast": distributed.broadcast_object(fp8, src=1)},
               f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.heavy  # two processes importing torch: ~25 s on the shared 2-core machine
def test_experts_statistics_combine_over_ranks_as_one_process_computes_them(tmp_path: Path) -> None:
    """Key "a" is seen on both ranks, "c" on rank 0 only, "b" on rank 1 only (an expert routed no token of the
    other rank's windows): every rank ends with every key, each Hessian equal bit for bit to one process
    accumulating all six calls in order, the ranges the maxima over the ranks that saw them."""
    mp.spawn(_combine, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    one = _one_process()
    xs = _inputs()
    for res in results:
        assert sorted(res["hessians"]) == ["a", "b", "c"] and not res["deferred"]
        for key, (hessian, tokens) in one.items():
            assert torch.equal(res["hessians"][key], hessian), key
            assert res["tokens"][key] == tokens
        for key in one:
            ranges = torch.stack([x.abs().amax(dim=0) for (k, _), x in zip(CALLS, xs) if k == key]).amax(dim=0)
            assert torch.equal(res["channel"][key], ranges) and torch.equal(res["input"][key], ranges.amax())
        assert res["routed"]["mlp"].tolist() == [4, 0, 5, 2]  # expert 1 starved on every rank: starved
        codes = torch.linspace(-3, 3, 7).to(torch.float8_e4m3fn)
        assert [g["rank"] for g in res["fp8"]] == [0, 1] and all(g["codes"].dtype == torch.float8_e4m3fn
                                                                 and torch.equal(g["codes"].view(torch.uint8),
                                                                                 codes.view(torch.uint8))
                                                                 for g in res["fp8"])
        assert res["fp8_bcast"]["rank"] == 1 and res["fp8_bcast"]["codes"].dtype == torch.float8_e4m3fn
    # the check can fail: the dense path's combination (token-weighted means in float64) differs in the last bits
    a0, n0 = accumulate_hessian(accumulate_hessian(None, 0, xs[0])[0], 5, xs[2])
    a1, n1 = accumulate_hessian(None, 0, xs[3])
    weighted = ((a0.double() * n0 + a1.double() * n1) / (n0 + n1)).float()
    assert not torch.equal(weighted, one["a"][0])


def test_gptq_on_moe_takes_the_two_forward_order_on_any_number_of_ranks() -> None:
    """GPTQ inside one forward sums an expert's Hessian over its rows of every window at once, which a split of the
    windows does not reproduce: an MoE model is calibrated batch by batch, in one process as on several (the plan
    says why), so its codes do not depend on the number of ranks; a dense model keeps the one forward."""
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from llmc.quant.loop_plan import LoopFacts, decide_layer_loop
    from llmc.quant.spec import Scheme, TensorSpec

    pipeline = AlgorithmSteps.of(Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"))

    def decide(moe: bool, ranks: int):
        return decide_layer_loop(pipeline, LoopFacts(
            calibrates=True, windows=8, seq_len=24, masked=False, batch_size=4, spill_mode="never", hidden=64,
            intermediate=128, heads=4, elem=4, moe=moe, device="cpu", host_available=1 << 34, device_free=None,
            shared_stats=False, shared_covered=False, ranks=ranks))

    assert decide(False, 1).one_forward and decide(False, 2).one_forward
    for ranks in (1, 2):
        moe = decide(True, ranks)
        assert not moe.one_forward and moe.flow == "sequential" and "Mixture-of-Experts" in moe.describe()


def test_the_plan_costs_a_moe_layer_per_rank_with_the_experts_share_of_the_tokens() -> None:
    """Per rank, the plan figures a Mixture-of-Experts model on its first layer with experts (DeepSeek's first
    layers are dense) and adds what a rank after the first keeps of its Hessian inputs: every token's row of each
    shared input, top-k / experts of them for an expert's (hand-computed here: 4 experts, top-2, 100 tokens)."""
    from llmc.planning.scaling import deferred_bytes, layer_shapes, moe_layer

    shapes = {"model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.up_proj.weight": (128, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 128)}
    for e in range(4):
        shapes |= {f"model.layers.1.mlp.experts.{e}.{p}.weight": s for p, s in
                   (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32)))}
    shapes |= {"model.layers.1.self_attn.o_proj.weight": (64, 64)}
    assert moe_layer(shapes) == 1 and moe_layer({"model.layers.0.mlp.down_proj.weight": (64, 128)}) == 0
    layer = layer_shapes({n.removesuffix(".weight"): v for n, v in shapes.items()}, 1)
    # o_proj: 100 rows x 64; each expert: 100 x 2/4 rows of its gate/up input (64) and of its down input (32)
    assert deferred_bytes(layer, 100, 0.5, 2) == (100 * 64 + 4 * 50 * (64 + 32)) * 2


# --------------------------------------------------------------------------- torchrun, two CPU ranks (slow)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(args: list[str], ranks: int, **env: str) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    return subprocess.run([*launcher, str(CHILD), *args], env=_env(**env), capture_output=True, text=True,
                          timeout=900, check=False)


SCHEMES = ["w4a16-gptq", "fp8-static"]
FAMILIES = {  # DeepSeek-V3 (and V3.2) with a dense first layer (first_k_dense_replace) before two MoE layers
    "deepseek_v3": {"num_hidden_layers": 3, "first_k_dense_replace": 1},
    "deepseek_v32": {"num_hidden_layers": 3, "first_k_dense_replace": 1},  # V3 plus the sparse-attention indexer
    "qwen3_moe": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_write_the_canonical_form_of_one_process_byte_for_byte(family: str, tmp_path: Path) -> None:
    """Every file of the canonical form (layer files, quantized.json with its token report, moe_tokens.json, the rest)
    byte-identical, the activations in memory on both sides (one process takes the two-forward order as the ranks
    do: test_gptq_on_moe_takes_the_two_forward_order_on_any_number_of_ranks)."""
    from tests.unit.families import make_tiny

    model = make_tiny(family, tmp_path / "model", **FAMILIES[family])
    for ranks, out in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        r = _run([str(model), str(out), ",".join(SCHEMES)], ranks)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for scheme in SCHEMES:
        one, two = tmp_path / "one" / scheme, tmp_path / "two" / scheme
        files = sorted(str(f.relative_to(one)) for f in one.rglob("*") if f.is_file())
        assert files == sorted(str(f.relative_to(two)) for f in two.rglob("*") if f.is_file())
        assert "moe_tokens.json" in files and len([f for f in files if f.startswith("layers/")]) == \
            FAMILIES[family].get("num_hidden_layers", 2)
        _, mismatch, errors = filecmp.cmpfiles(one, two, files, shallow=False)
        assert not mismatch and not errors, (scheme, mismatch, errors)
        tokens = json.loads((two / "moe_tokens.json").read_text())["blocks"]
        assert tokens and all(sum(b["tokens"]) == 16 * 24 * 2 for b in tokens.values())  # every rank's tokens, top-2


EXPERT, CHANNEL = 3, 5


def _route_by_vocabulary(folder: Path) -> Path:
    """The Qwen3-MoE model with layer 0's router picking expert EXPERT for every token id from 100 and never below:
    embedding channel CHANNEL is -3 below id 100 and +3 from it (the norm before the experts keeps its sign), the
    router's row EXPERT reads that channel alone, x50, and the other rows ignore it. With the split-vocab windows
    (tests/unit/dist_child.py) rank 0's block never reaches the expert and rank 1's does."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    embed = state["model.embed_tokens.weight"]
    embed[:, CHANNEL] = torch.where(torch.arange(embed.shape[0]) < 100, -3.0, 3.0)
    if "lm_head.weight" in state:
        state["lm_head.weight"] = embed.clone()
    state["model.layers.0.post_attention_layernorm.weight"][CHANNEL] = 1.0
    router = state["model.layers.0.mlp.gate.weight"]
    router[:, CHANNEL] = 0.0
    router[EXPERT] = 0.0
    router[EXPERT, CHANNEL] = 50.0
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _routed_in_layer0(folder: Path, ids: torch.Tensor) -> list[int]:
    """Tokens of `ids` transformers' own forward routes to each expert of layer 0 (per-expert Linears counting)."""
    from transformers import AutoModelForCausalLM

    from llmc.quant import moe

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    moe.unfuse_experts(model)
    counts: dict[str, torch.Tensor] = {}
    with torch.no_grad(), moe.observing_experts(model.model.layers[0], False, counts):
        model(input_ids=ids)
    return counts["mlp"].tolist()


@pytest.mark.slow
def test_an_expert_only_one_ranks_windows_reach_is_calibrated_as_in_one_process(tmp_path: Path) -> None:
    """Layer 0's expert 3 is routed tokens of rank 1's windows only: rank 0 holds no statistic for it at all (the
    case the combination over the union of the ranks' Linears exists for). GPTQ W4A16 and FP8 static: the canonical
    form byte-identical to one process's, the expert GPTQ-quantized with a static scale from rank 1's tokens."""
    from tests.unit.dist_child import CALIBRATION
    from tests.unit.families import make_tiny

    model = _route_by_vocabulary(make_tiny("qwen3_moe", tmp_path / "model"))
    env = {"LLMC_TEST_SPILL": "always", "LLMC_TEST_CALIBRATION": "split-vocab"}
    os.environ.update(env)
    try:
        from tests.unit.dist_child import calibration_windows

        windows = calibration_windows()
    finally:
        for k in env:
            os.environ.pop(k)
    half = CALIBRATION[0] // 2
    assert _routed_in_layer0(model, windows[:half])[EXPERT] == 0 < _routed_in_layer0(model, windows[half:])[EXPERT]
    for ranks, out in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        r = _run([str(model), str(out), ",".join(SCHEMES)], ranks, **env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for scheme in SCHEMES:
        one, two = tmp_path / "one" / scheme, tmp_path / "two" / scheme
        files = sorted(str(f.relative_to(one)) for f in one.rglob("*") if f.is_file())
        _, mismatch, errors = filecmp.cmpfiles(one, two, files, shallow=False)
        assert not mismatch and not errors, (scheme, mismatch, errors)
        tokens = json.loads((two / "moe_tokens.json").read_text())["blocks"]["model.layers.0.mlp"]
        assert tokens["tokens"][EXPERT] > 0 and not tokens["starved"]


def _build(recipe: Path, cache: Path, nproc: int) -> dict[str, Path]:
    """`llmc build RECIPE --nproc N` in its own cache; the exported artifacts by label."""
    r = subprocess.run([sys.executable, "-m", "llmc", "build", str(recipe), "--no-publish", "--cache-dir", str(cache),
                        "--report-dir", str(cache / "report"), "--nproc", str(nproc)],
                       env=_env(LLMC_PROGRESS_JSON="0"), capture_output=True, text=True, timeout=1200, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {line.split()[1].rstrip(":"): Path(line.split()[2]) for line in (r.stdout + r.stderr).splitlines()
            if line.startswith("artifact ")}


@pytest.mark.slow  # two builds of two variants with their evaluations: ~6 min on the shared 2-core machine
def test_llmc_build_nproc_2_exports_a_tiny_deepseek_v3_byte_for_byte_as_one_process(tmp_path: Path) -> None:
    """`llmc build --nproc 2` (torchrun's launcher, gloo) of a tiny DeepSeek-V3 in FP8 W8A8 static and W4A16 GPTQ for
    vLLM: every file of both compressed-tensors exports byte-identical to `--nproc 1`'s (the completion marker
    aside: it names the stage key, which counts the ranks where sums are taken), and the same evaluations."""
    import yaml

    from tests.unit.families import make_tiny

    folder = make_tiny("deepseek_v3", tmp_path / "model", num_hidden_layers=3, first_k_dense_replace=1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "tiny-moe-dist", "model": {"source": str(folder)},
        # per-tensor weights: vLLM's fused MoE refuses per-channel weights with static activations (issue 45)
        "variants": [{"name": "fp8", "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "tensor"},
                                                      "activations": {"format": "fp8_e4m3", "strategy": "tensor"}}},
                     {"name": "w4a16", "quantization": {"weights": {"format": "int4", "strategy": "group",
                                                                    "group_size": 32}, "algorithm": "gptq"}}],
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 64, "windows": 4, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 100,
                 "runtimes": ["torch"]},
        "gates": {"max_ppl_increase_pct": 1000.0}}))
    one, two = _build(recipe, tmp_path / "c1", 1), _build(recipe, tmp_path / "c2", 2)
    assert sorted(one) == sorted(two) == ["fp8/vllm-sm90-tp1", "w4a16/vllm-sm90-tp1"]
    for label in one:
        files = sorted(str(f.relative_to(one[label])) for f in one[label].rglob("*")
                       if f.is_file() and f.name != ".llmc-complete")
        assert "model.safetensors" in files and "moe_tokens.json" in files
        assert files == sorted(str(f.relative_to(two[label])) for f in two[label].rglob("*")
                               if f.is_file() and f.name != ".llmc-complete")
        _, mismatch, errors = filecmp.cmpfiles(one[label], two[label], files, shallow=False)
        assert not mismatch and not errors, (label, mismatch, errors)
    evals = [json.loads((c / "report" / "report.json").read_text())["evals"] for c in (tmp_path / "c1", tmp_path / "c2")]
    assert {k: (v["perplexity"], v.get("kld")) for k, v in evals[0].items()} == \
        {k: (v["perplexity"], v.get("kld")) for k, v in evals[1].items()}
