"""Planning the models people ship: offline from the config kept beside each recipe, per stage and device, refusing
what does not fit before any weight loads, counting shared files once, and in the checkpoint's own dtype."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

import llmc.planning.plan
from llmc.errors import ResourceError
from llmc.quant.numerics import BLOCK_ELEMENTS
from llmc.model.families import expert_count
from llmc.model.shape_rows import SHAPE_ROWS
from llmc.pipeline.ids import Kind
from llmc.quant.algorithms.awq import AwqOptions
from llmc.planning.plan import make_plan, plan_recipe
from llmc.planning.shapes import from_config
from llmc.recipe.load import load_recipe, parse_recipe
from llmc.storage.store import Store

REPO = Path(__file__).resolve().parents[2]
SCALE_RECIPES = ["llama70b-fp8", "llama31-8b-int4-awq", "llama31-8b-w8a8-sq", "qwen3-8b-fp8", "qwen3-30b-a3b-fp8",
                 "mixtral-8x7b-int4", "llama405b-fp8-plan", "llama31-8b-mixed-nvfp4", "qwen3-30b-a3b-mixed-nvfp4",
                 "qwen3-next-80b-fp8", "llama4-scout-w4a16", "glm45-fp8", "deepseek-r1-nvfp4", "kimi-k2-nvfp4",
                 "deepseek-v3-fp8-block-vllm", "gpt-oss-20b-q8-llamacpp", "gpt-oss-120b-mxfp4-vllm",
                 "gpt-oss-120b-fp8-vllm"]
# parameters of the published checkpoints (their model.safetensors.index.json total_size / 2 bytes)
PUBLISHED = {"Llama-3.1-8B": 8_030_261_248, "Llama-3.3-70B-Instruct": 70_553_706_496,
             "Llama-3.1-405B-Instruct": 405_853_388_800, "Qwen3-8B": 8_190_735_360,
             "Qwen3-30B-A3B": 30_532_122_624, "Mixtral-8x7B-Instruct-v0.1": 46_702_792_704}


# totals the model cards state, in billions to their precision (their checkpoints' index files are not kept here)
CARD_BILLIONS = {"DeepSeek-R1": (671, 0), "Qwen3-Next-80B-A3B-Instruct": (80, 0), "gpt-oss-120b": (116.83, 2),
                 "gpt-oss-20b": (20.91, 2)}


@pytest.mark.parametrize("model", CARD_BILLIONS)
def test_config_shapes_give_the_model_cards_totals(model: str) -> None:
    config = json.loads((REPO / "recipes" / "configs" / model / "config.json").read_text())
    billions, digits = CARD_BILLIONS[model]
    assert round(from_config(config).params / 1e9, digits) == billions


@pytest.mark.parametrize("model", ["DeepSeek-R1", "Kimi-K2-Instruct", "GLM-4.5", "Qwen3-Next-80B-A3B-Instruct",
                                   "Llama-4-Scout-17B-16E-Instruct", "gpt-oss-120b", "gpt-oss-20b"])
def test_config_shapes_are_transformers_own_model_of_the_config(model: str) -> None:
    """The tensors planned from config.json are those transformers builds for it (on the meta device: no memory):
    every non-expert tensor by name and shape (MLA, gated-DeltaNet, sinks, shared experts), and the total with its
    fused experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((REPO / "recipes" / "configs" / model / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "quantization_config")}
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **kwargs))
    theirs = {n: tuple(t.shape) for n, t in built.state_dict().items()}
    planned = from_config(config)
    assert {n: s for n, s in planned.shapes.items() if ".experts." not in n} == {
        n: s for n, s in theirs.items() if ".experts." not in n}
    assert planned.params == sum(torch.Size(s).numel() for s in theirs.values())


@pytest.mark.parametrize("model", sorted(p.parent.name for p in (REPO / "recipes" / "configs").glob("*/config.json")))
def test_a_config_states_the_router_scale_its_config_class_would_default(model: str) -> None:
    """routed_scaling_factor multiplies the routed experts' sum; no plan line reads it, so a config that leaves it out
    plans the same but hands the config class's default (DeepseekV3Config 2.5, Glm4MoeConfig 1.0; Kimi-K2 2.827,
    GLM-4.5 2.5) to the compare_exports stand-in's router and the GGUF header (expert_weights_scale)."""
    from transformers import AutoConfig

    config = json.loads((REPO / "recipes" / "configs" / model / "config.json").read_text())
    if hasattr(AutoConfig.for_model(config["model_type"]), "routed_scaling_factor"):
        assert isinstance(config.get("routed_scaling_factor"), float), f"{model}: set routed_scaling_factor"


def test_a_quantized_original_planned_from_its_config_costs_its_stored_bytes() -> None:
    """DeepSeek-R1's FP8 block-wise Linears take a byte an element plus a float32 scale per 128 x 128 block, its
    router and embeddings bf16; gpt-oss's MXFP4 experts half a byte plus a scale byte per 32."""
    r1 = from_config(json.loads((REPO / "recipes/configs/DeepSeek-R1/config.json").read_text()))
    p = "model.layers.3."
    kv_b = r1.shapes[p + "self_attn.kv_b_proj.weight"]
    assert kv_b == (128 * (128 + 128), 512)  # MLA: per head the no-rope key and the value, from the 512-wide latent
    assert r1.stored_bytes[p + "self_attn.kv_b_proj.weight"] == kv_b[0] * kv_b[1] + (kv_b[0] // 128) * (512 // 128) * 4
    assert r1.stored_bytes[p + "mlp.gate.weight"] == 2 * 256 * 7168
    assert r1.stored_bytes["model.embed_tokens.weight"] == 2 * 129280 * 7168
    assert 1.0 < r1.stored_total(2) / r1.params < 1.01
    oss = from_config(json.loads((REPO / "recipes/configs/gpt-oss-120b/config.json").read_text()))
    expert = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert oss.stored_bytes[expert] == 2880 * 2880 * 17 // 32
    assert oss.stored_bytes["model.layers.0.self_attn.q_proj.weight"] == 2 * 64 * 64 * 2880


@pytest.mark.parametrize("model", PUBLISHED)
def test_config_shapes_give_the_published_parameter_counts(model: str) -> None:
    config = json.loads((REPO / "recipes" / "configs" / model / "config.json").read_text())
    assert from_config(config).params == PUBLISHED[model]


@pytest.fixture(scope="module")
def rates_store(tmp_path_factory) -> Store:
    """One cache for the recipes' plans: the machine's rates are probed by the first plan and read by the rest (a
    plan's probes take most of its time; the rates are what a second `llmc plan` reads too)."""
    return Store(tmp_path_factory.mktemp("rates") / "cache")


# probes of NVFP4 emulation in bf16 at their widths, or Kimi-K2's 70k Linears: 7-10 s of CPU each on the 2-core EPYC
# (load ~15); the fast tier plans the FP8, INT4, AWQ, SmoothQuant and block-FP8 recipes
HEAVY_RECIPES = {"llama31-8b-mixed-nvfp4", "qwen3-30b-a3b-mixed-nvfp4", "deepseek-r1-nvfp4", "kimi-k2-nvfp4"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.heavy] if n in HEAVY_RECIPES else [])
                                  for n in SCALE_RECIPES])
def test_llmc_plan_runs_offline_on_each_shipped_hub_recipe(name: str, rates_store: Store) -> None:
    path = REPO / "recipes" / f"{name}.yaml"
    recipe = load_recipe(path)
    assert recipe.model.source.startswith("hf:") and recipe.model.config
    config = json.loads((path.parent / recipe.model.config).read_text())
    # its wall time is measured in benchmarks/results/planner-log.md, not asserted
    plan = plan_recipe(recipe, rates_store, path)
    if expert_count(config) > 1:  # MoE (Qwen3-30B-A3B, Mixtral): planned now that experts are quantized (issue 21);
        # gpt-oss for llama.cpp: its experts merged into GGUF's 3-D tensors; for vLLM: OpenAI's MXFP4 layout, or FP8
        # in AMD Quark's per-expert one
        assert all(t["exporter"] in ("compressed-tensors", "gguf", "gpt-oss-mxfp4", "gpt-oss-quark-fp8")
                   for t in plan.targets)
    rows = plan.rows
    assert [r for r in rows if r.id.kind is Kind.QUANTIZE]
    assert sum(r.id.kind is Kind.EXPORT for r in rows) == len(recipe.targets)
    assert all(r.host_bytes > 0 and r.seconds >= 0 for r in rows)
    text = plan.render()
    assert "planned from" in text and "config.json" in text and "host RAM" in text
    assert plan.costed_for.dtype == "bfloat16"  # dtype: auto, the published checkpoints are bf16


def test_the_70b_plan_streams_evaluation_and_stores_the_shared_vllm_weights_once(tmp_path: Path) -> None:
    path = REPO / "recipes" / "llama70b-fp8.yaml"
    plan = plan_recipe(load_recipe(path), Store(tmp_path / "cache"), path)
    by = {r.name: r for r in plan.rows}
    tp4, tp8 = by["export vllm-sm90-tp4"], by["export vllm-sm90-tp8"]
    assert tp4.disk_bytes > 70e9 and tp8.disk_bytes == 0 and "hard links" in tp8.why
    if plan.costed_for.available_gb < 141 / 2:
        assert by["eval torch baseline"].strategy.startswith("streamed")
        assert by["eval torch baseline"].host_bytes < 141e9 / 4  # one layer resident, not the 141 GB model


def test_the_70b_plan_counts_what_the_full_width_builds_measured(tmp_path: Path, monkeypatch) -> None:
    """The terms benchmarks/results/planner-log.md ("Planner at full width") measured at 70B width: FP8 exports pass
    the codes through (the process alone allocated), the TensorRT-LLM export shares the shards of the weights outside
    the layers with the vLLM one, the artifact's streamed evaluation holds one layer's codes and one block of float32
    decompressed rows on top of the baseline's, and reads the baseline's output head mapped (no copy)."""
    monkeypatch.setenv("LLMC_TORCH_EVAL", "streamed")
    path = REPO / "recipes" / "llama70b-fp8.yaml"
    plan = plan_recipe(load_recipe(path), Store(tmp_path / "cache"), path)
    by = {r.name: r for r in plan.rows}
    config = json.loads((REPO / "recipes" / "configs" / "Llama-3.3-70B-Instruct" / "config.json").read_text())
    outer = from_config(config).outer_params * 2  # embeddings, head, final norm in bf16
    vllm, trt = by["export vllm-sm90-tp4"], by["export tensorrt-llm-sm90-tp4"]
    assert vllm.host_bytes < 1e9 and vllm.mapped_bytes > 2e9
    assert trt.disk_bytes == pytest.approx(vllm.disk_bytes - outer, rel=1e-6)
    head = config["vocab_size"] * config["hidden_size"] * 2
    baseline, artifact = by["eval torch baseline"], by["eval torch W8A8-FP8"]
    layer_codes = max(from_config(config).layer_params().values())  # FP8: one byte per weight
    block_fp32 = 4 * BLOCK_ELEMENTS  # decompressed a block of rows at a time, not the whole Linear
    assert artifact.host_bytes - baseline.host_bytes == pytest.approx(layer_codes + block_fp32, rel=0.01)
    assert artifact.mapped_bytes - baseline.mapped_bytes == pytest.approx(head, rel=1e-6)
    quantize = by["quantize W8A8-FP8"]
    assert quantize.seconds == pytest.approx(quantize.layer_seconds * 80 + quantize.fixed_seconds)
    assert "per decoder layer x 80 layers" in plan.render()


def _tiny_recipe(source: Path, **sections) -> object:
    return parse_recipe(yaml.safe_dump({
        "name": "t", "model": {"source": str(source)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                         "activations": {"format": "int8", "strategy": "tensor"}},
        "targets": [{"runtime": "vllm"}], **sections}))


def test_a_plan_that_does_not_fit_refuses_before_loading_naming_the_cheaper_strategy(
        tiny_model: Path, monkeypatch) -> None:
    recipe = _tiny_recipe(tiny_model, calibration={"samples": 1024, "seq_len": 1024, "spill_activations": "never"})
    need = make_plan(recipe, tiny_model).peak_memory_gb
    monkeypatch.setattr(llmc.planning.plan, "memory_available", lambda: int(need * 1e9 * 0.8))
    with pytest.raises(ResourceError) as e:
        make_plan(recipe, tiny_model)
    assert f"~{need:.1f} GB of host memory" in e.value.message and "available" in e.value.message
    assert "spill_activations" in e.value.fix and e.value.exit_code == 4


def test_a_build_whose_plan_does_not_fit_exits_4_before_any_weight_loads(tiny_model: Path, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """`llmc build` plans from headers, and a plan over the machine's memory stops it: exit 4, no tensor read from
    the checkpoint, no stage written."""
    from llmc.build import build
    from llmc.model.checkpoint import CheckpointReader

    recipe = _tiny_recipe(tiny_model, calibration={"samples": 4, "seq_len": 32})
    need = make_plan(recipe, tiny_model).peak_memory_gb
    monkeypatch.setattr(llmc.planning.plan, "memory_available", lambda: int(need * 1e9 * 0.5))
    read: list[str] = []
    real_get_many = CheckpointReader.get_many
    # the recipe's model: the planner's own probe streams a tiny random model of its own (llmc.quant.stream_probe)
    monkeypatch.setattr(CheckpointReader, "get_many", lambda self, names: (
        read.extend(names) if self.folder == tiny_model else None) or real_get_many(self, names))
    with pytest.raises(ResourceError, match="GB of host memory") as e:
        build(recipe, Store(tmp_path / "cache"), publish=False)
    assert e.value.exit_code == 4 and read == []
    assert not any((tmp_path / "cache" / "stages").glob("*/*"))  # no stage output (a missing folder globs empty)


def test_forced_whole_model_evaluation_that_does_not_fit_names_streaming(tiny_model_factory, tmp_path: Path,
                                                                         monkeypatch) -> None:
    model = tiny_model_factory(tmp_path / "wide", hidden=512, layers=12, heads=8, kv_heads=4, intermediate=2048)
    monkeypatch.setenv("LLMC_TORCH_EVAL", "whole")
    recipe = _tiny_recipe(model, eval={"windows": 2, "seq_len": 16, "batch_size": 1},
                          calibration={"samples": 4, "seq_len": 64})
    plan = make_plan(recipe, model)
    base = next(r for r in plan.rows if r.name == "eval torch baseline")
    assert base.strategy == "whole model"
    need = base.host_bytes + base.mapped_bytes  # the whole model mapped from its files, kept resident
    quantize = next(r for r in plan.rows if r.id.kind is Kind.QUANTIZE)
    assert quantize.host_bytes + quantize.mapped_bytes < need * 0.9  # so that the evaluation is what does not fit
    monkeypatch.setattr(llmc.planning.plan, "memory_available", lambda: int(need * 0.95))
    with pytest.raises(ResourceError, match="eval torch baseline") as e:
        make_plan(recipe, model)
    assert "LLMC_TORCH_EVAL=streamed" in e.value.fix


def test_auto_dtype_keeps_a_bf16_checkpoint_in_bf16_and_halves_the_layer(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in tiny_model.glob("tokenizer*"):
        (bf16 / f.name).write_bytes(f.read_bytes())
    auto = make_plan(_tiny_recipe(bf16, model={"source": str(bf16), "dtype": "auto"}), bf16)
    fp32 = make_plan(_tiny_recipe(bf16, model={"source": str(bf16), "dtype": "float32"}), bf16)
    assert auto.costed_for.dtype == "bfloat16" and fp32.costed_for.dtype == "float32"
    assert auto.peak_memory_gb < fp32.peak_memory_gb


def test_the_disk_check_counts_only_stages_not_cached(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    plan = make_plan(_tiny_recipe(tiny_model), tiny_model)
    total = sum(row.disk_bytes for row in plan.rows) / 1e9
    quantize = next(row.disk_bytes for row in plan.rows if row.id.kind is Kind.QUANTIZE) / 1e9
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, int((total - quantize / 2) * 1e9)))
    with pytest.raises(ResourceError, match="the build needs"):
        llmc.planning.plan.check_disk(plan, tmp_path)  # everything still to write: does not fit
    with pytest.raises(ResourceError, match="the build needs"):  # pending: every row, named by its stage's ids
        llmc.planning.plan.check_disk(plan, tmp_path, {row.id for row in plan.rows})
    cached_quantize = {row.id for row in plan.rows if row.id.kind is not Kind.QUANTIZE}
    llmc.planning.plan.check_disk(plan, tmp_path, cached_quantize)  # the canonical form is cached: the rest fits


def test_each_evaluation_corpus_is_planned_its_time_and_disk(tiny_model: Path, tmp_path: Path) -> None:
    """eval.corpus naming two corpora evaluates each on its own windows, one after another: the plan's evaluation
    rows take twice the time and disk of one corpus, and the same memory (never both at once)."""
    text = tmp_path / "austen.txt"
    text.write_text("It is a truth universally acknowledged. " * 400)
    (tmp_path / "c1").mkdir(), (tmp_path / "c2").mkdir()
    one = make_plan(_tiny_recipe(tiny_model, eval={"corpus": "brown"}), tiny_model, tmp_path / "c1")
    two = make_plan(_tiny_recipe(tiny_model, eval={"corpus": ["brown", {"kind": "text", "path": str(text)}]}), tiny_model, tmp_path / "c2")
    rows_one = {r.name: r for r in one.rows if r.id.kind is Kind.EVAL}
    rows_two = {r.name: r for r in two.rows if r.id.kind is Kind.EVAL}
    assert rows_one and rows_one.keys() == rows_two.keys()
    for name, row in rows_two.items():
        assert row.seconds == pytest.approx(2 * rows_one[name].seconds, rel=1e-9)
        assert row.disk_bytes == pytest.approx(2 * rows_one[name].disk_bytes, rel=1e-9)
        assert row.host_bytes == pytest.approx(rows_one[name].host_bytes, rel=1e-9)
        assert "2 corpora" in row.strategy


def test_rtn_counts_one_block_of_float32_temporaries_and_whole_weight_algorithms_the_whole_linear() -> None:
    """RTN quantizes a block of rows at a time (llmc.quant.numerics.BLOCK_ELEMENTS), so at 70B width its float32
    temporaries are one block's, not the 8192 x 28672 MLP projection's (1.9 GB); GPTQ and the smoothing transforms
    still copy the whole Linear, and are counted so."""
    from llmc.model.dtype import BYTES
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape
    from llmc.quant.numerics import BLOCK_ELEMENTS

    config = json.loads((REPO / "recipes" / "configs" / "Llama-3.3-70B-Instruct" / "config.json").read_text())
    shape = Shape.of(from_config(config), config, BYTES["bfloat16"])
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from llmc.quant.spec import Scheme, TensorSpec
    from tests.unit.build_helpers import layer_loop

    kwargs = dict(compute="bfloat16", stored_elem=2, machine=Machine(available=None, gpu_free=None, device="cpu"))
    int8 = TensorSpec("int8", "channel")
    rtn_pipe, sq_pipe = (AlgorithmSteps.of(Scheme(int8, TensorSpec("int8", "token", dynamic=True), algorithm=a))
                         for a in ("rtn", "smoothquant"))  # SmoothQuant copies whole Linears, observes no Hessian
    rtn = quantize_cost(shape, layer_loop(rtn_pipe), rtn_pipe, **kwargs)
    whole = quantize_cost(shape, layer_loop(sq_pipe), sq_pipe, **kwargs)
    assert shape.largest_linear == config["hidden_size"] * config["intermediate_size"]
    assert rtn.parts["quantizer float32 copy"] == 2 * 4 * BLOCK_ELEMENTS
    assert whole.parts["quantizer float32 copy"] == 2 * 4 * shape.largest_linear
    assert sum(whole.parts.values()) - sum(rtn.parts.values()) == pytest.approx(
        8 * (shape.largest_linear - BLOCK_ELEMENTS))


def test_smoothing_algorithms_plan_the_first_layers_float64_pair_discovery(tmp_path: Path) -> None:
    """SmoothQuant (and AWQ, GPTQ's true-sequential order) find the first layer's smoothing pairs in float64 before
    calibrating it: at 8B width the layer (1.75 GB in float64) and a candidate's rescaled gate and up (0.94 GB) on
    top of the weights outside the layers, the build's quantize peak (measured: benchmarks/results/planner-log.md).
    The same scheme by RTN traces nothing."""
    path = REPO / "recipes" / "llama31-8b-w8a8-sq.yaml"
    config = json.loads((REPO / "recipes" / "configs" / "Llama-3.1-8B" / "config.json").read_text())
    tensors = from_config(config)
    layer, outer = max(tensors.layer_params().values()), tensors.outer_params
    largest = config["hidden_size"] * config["intermediate_size"]
    by_algorithm = {}
    for algorithm in ("smoothquant", "rtn"):
        sets = [f"quantization.algorithm={algorithm}"] + ([] if algorithm == "smoothquant" else ["quantization.options={}"])
        plan = plan_recipe(load_recipe(path, sets), Store(tmp_path / "cache"), path)
        by_algorithm[algorithm] = plan.rows[0]
    sq, rtn = by_algorithm["smoothquant"], by_algorithm["rtn"]
    from llmc.planning.machine import PROCESS_BYTES

    discovery = PROCESS_BYTES + outer * 2 + 8 * (layer + 2 * largest)
    assert sq.host_bytes >= discovery - 0.01e9 and sq.host_bytes > rtn.host_bytes + 1e9
    assert "smoothing pairs are found in float64" in sq.why and "float64" not in rtn.why
    assert sq.fixed_seconds > rtn.fixed_seconds


def test_awq_plans_its_scale_and_clip_search_per_layer() -> None:
    """AWQ's search is weight-bound, not token-bound: at 8B width with 32 calibration tokens it was 229 s of a
    layer whose forwards take 2 (benchmarks/results/planner-log.md). Each candidate scale of the lone up -> down mapping
    costs out x in x tokens float32 FLOPs on its 32 input rows (fewer than its input channels; out x in² through the
    Gram matrix otherwise, issue 48); the full grid scores about twice refine's candidates."""
    from llmc.model.dtype import BYTES
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine, matmul_rate
    from llmc.planning.shapes import Shape
    from llmc.quant.spec import TensorSpec

    config = json.loads((REPO / "recipes" / "configs" / "Llama-3.1-8B" / "config.json").read_text())
    shape = Shape.of(from_config(config), config, BYTES["bfloat16"])
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from llmc.quant.spec import Scheme
    from tests.unit.build_helpers import layer_loop

    class WithoutSearch(AlgorithmSteps):
        search_cost = None  # the same pipeline, its search left out: what the search adds

    kwargs = dict(compute="bfloat16", stored_elem=2, machine=Machine(available=None, gpu_free=None, device="cpu"))
    refine = AwqOptions()
    grid = AwqOptions(search="grid")
    pipes = {o.search: AlgorithmSteps.of(Scheme(TensorSpec("int4", "group", group_size=128), algorithm="awq",
                                          algorithm_options=(("search", o.search),))) for o in (refine, grid)}
    loop = layer_loop(pipes["refine"], windows=1, seq_len=32, activations="memory")
    plain_pipe = WithoutSearch(pipes["refine"].scheme, pipes["refine"].steps, pipes["refine"].propagate)
    plain = quantize_cost(shape, loop, plain_pipe, **kwargs)
    per_layer = {name: quantize_cost(shape, loop, pipe, **kwargs).layer_seconds - plain.layer_seconds
                 for name, pipe in pipes.items()}
    down_candidate = 2 * config["hidden_size"] * config["intermediate_size"] * 32 / matmul_rate(
        "float32", "cpu", config["intermediate_size"], 128)
    assert per_layer["refine"] > refine.search_evaluations() * down_candidate * 0.8
    assert 1.5 < per_layer["grid"] / per_layer["refine"] < 2.2


def test_gptq_and_awq_layouts_plan_one_shard_of_repacked_layers_and_their_repacking_time(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """The GPTQ / AWQ layouts repack a block of rows at a time (llmc.formats.files.write_repacked_checkpoint): one
    shard of packed layers allocated, the largest Linear's packed blocks twice (the blocks and their concatenation)
    and one block's temporaries, not compressed-tensors' one shard + one layer's codes; and the repacking's time on
    top of writing and hashing the same number of bytes."""
    from llmc.formats.files import MAX_SHARD_BYTES
    from llmc.formats import awq_format
    from llmc.formats.base import REPACK_BLOCK_BYTES
    from llmc.pipeline.export import canonical_read_seconds
    from llmc.planning.machine import PROCESS_BYTES, verify_seconds, write_rate
    from llmc.storage.direct_io import held_bytes

    repack_rate = 5e7  # the AWQ codec's probe (llmc.formats.files.repack_rate), pinned
    monkeypatch.setattr(awq_format, "repack_rate", lambda weights: repack_rate)
    path = REPO / "recipes" / "llama31-8b-int4-awq.yaml"
    plan = plan_recipe(load_recipe(path), Store(tmp_path / "cache"), path)
    by = {r.name: r for r in plan.rows}
    awq, vllm = by["export lmdeploy-sm80-tp1"], by["export vllm-sm80-tp1"]
    config = json.loads((REPO / "recipes" / "configs" / "Llama-3.1-8B" / "config.json").read_text())
    largest = config["hidden_size"] * config["intermediate_size"]
    layer_linears = sum(a * b for name, (a, b) in from_config(config).linear_shapes().items()
                        if name.startswith("model.layers."))
    repacked = layer_linears * 4 / 8  # int4; lm_head is ignored by the recipe
    assert repacked > MAX_SHARD_BYTES  # so one shard of them is what is held
    # + the direct-I/O buffers of checking and writing GB files (llmc.storage.direct_io.held_bytes)
    expected = PROCESS_BYTES + MAX_SHARD_BYTES + 2 * largest * 4 / 8 + REPACK_BLOCK_BYTES + held_bytes(MAX_SHARD_BYTES)
    assert awq.host_bytes == pytest.approx(expected, rel=1e-6)
    assert awq.host_bytes < vllm.host_bytes
    # each writes and hashes its own files (AWQ: float16 scales and packed zero points; compressed-tensors: float32
    # scales), and AWQ repacks on top
    io = (awq.disk_bytes - vllm.disk_bytes) / write_rate()  # GB-sized shards: the probed write (+ hash) rate
    # the first export of the quantized form verifies it (read from the disk while hashed), once per build, and
    # reads it from the disk; a later one reads it from the page cache (8 GB: the machine's memory holds it)
    canonical = next(r for r in plan.rows if r.id.kind is Kind.QUANTIZE).disk_bytes
    outer = from_config(config).outer_params * 2
    available = int(plan.costed_for.available_gb * 1e9) or None
    first, later = (canonical_read_seconds(canonical, outer, config["num_hidden_layers"], first=f, available=available)
                    for f in (True, False))
    assert first > later + verify_seconds(canonical - outer, files=config["num_hidden_layers"]) + verify_seconds(outer)
    names = [r.name for r in plan.rows]
    read = (first - later) * (1 if names.index("export lmdeploy-sm80-tp1") < names.index("export vllm-sm80-tp1") else -1)
    assert awq.seconds - vllm.seconds == pytest.approx(layer_linears / repack_rate + io + read, rel=1e-3)


def test_on_a_gpu_with_room_the_activations_are_planned_there_and_the_io_overlaps(monkeypatch) -> None:
    """Calibrating on a GPU whose free memory holds two copies of the activations four times over, the plan puts them
    there (as llmc.quant.stream does: quant.activations.stays_on_device), says why, counts them on the GPU (one host
    copy, for a resume point), counts no materialized attention scores (SDPA), and takes the slower of the layer's
    I/O and its compute as its time (the writer and reader threads run beside the GPU)."""
    import llmc.planning.machine as machine
    import llmc.pipeline.quantize as quantize
    from llmc.model.dtype import BYTES
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape
    from llmc.quant.activations import stays_on_device

    monkeypatch.setattr(machine, "matmul_rate", lambda *a, **k: 4e14)  # no GPU here to probe
    monkeypatch.setattr(quantize, "matmul_rate", lambda *a, **k: 4e14)
    monkeypatch.setattr(quantize, "quantize_rate", lambda *a, **k: 1e11)
    config = json.loads((REPO / "recipes" / "configs" / "Llama-3.3-70B-Instruct" / "config.json").read_text())
    shape = Shape.of(from_config(config), config, BYTES["bfloat16"])
    tokens, seq_len, gb = 128 * 2048, 2048, 1e9
    copy = tokens * shape.hidden * 2
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from llmc.quant.spec import Scheme, TensorSpec
    from tests.unit.build_helpers import layer_loop

    fp8 = AlgorithmSteps.of(Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")))  # one pass
    kwargs = dict(compute="bfloat16", stored_elem=2)
    assert stays_on_device(torch.device("cuda"), copy, int(80 * gb)) and not stays_on_device(
        torch.device("cuda"), copy, int(16 * gb)) and not stays_on_device(torch.device("cpu"), copy, int(80 * gb))
    gpu = Machine(available=int(100 * gb), gpu_free=int(80 * gb), device="cuda:0")
    from llmc.quant.loop_plan import LoopFacts, decide_layer_loop

    # the stage's decision on that GPU, and on one with too little room for them (the stream's same function)
    facts = LoopFacts(calibrates=True, windows=128, seq_len=seq_len, masked=False, batch_size=4, spill_mode="auto",
                      hidden=shape.hidden, intermediate=shape.intermediate, heads=shape.heads, elem=2, moe=False,
                      device="cuda:0", host_available=int(100 * gb), device_free=int(80 * gb), shared_stats=False,
                      shared_covered=False)
    on_gpu, short = decide_layer_loop(fp8, facts), decide_layer_loop(fp8, replace(facts, device_free=int(16 * gb)))
    assert (on_gpu.activations, short.activations) == ("device", "memory")
    resident = quantize_cost(shape, on_gpu, fp8, machine=gpu, **kwargs)
    batches = quantize_cost(shape, short, fp8, machine=gpu, **kwargs)
    assert resident.strategy == "activations on the GPU" and "stay there between layers" in resident.why
    assert resident.gpu_bytes - batches.gpu_bytes == pytest.approx(2 * copy - 2 * 4 * seq_len * shape.hidden * 2)
    assert resident.parts["activations"] == copy and batches.parts["activations"] == 2 * copy
    cpu = quantize_cost(shape, layer_loop(fp8, activations="memory", windows=128, seq_len=seq_len, batch=4), fp8,
                        machine=Machine(available=int(100 * gb), gpu_free=None, device="cpu"), **kwargs)
    scores = 4 * shape.heads * seq_len ** 2 * 2
    forward = 4 * seq_len * (4 * shape.hidden + 3 * shape.intermediate) * 2
    assert cpu.parts["forward temporaries"] == pytest.approx(forward + scores)
    from llmc.quant.numerics import BLOCK_ELEMENTS  # RTN's float32 temporaries: one block of rows

    assert batches.gpu_bytes == pytest.approx(machine.CUDA_CONTEXT_BYTES + shape.layer_params * 2
                                              + 8 * min(shape.largest_linear, BLOCK_ELEMENTS)
                                              + 2 * 4 * seq_len * shape.hidden * 2 + forward)  # no scores
    io = machine.read_seconds(shape.layer_params * 2) + machine.file_write_seconds(shape.layer_params)
    assert resident.layer_seconds == pytest.approx(max(io, resident.layer_seconds))  # never below the layer's I/O
    assert cpu.layer_seconds > io  # the CPU adds its I/O to its compute


# buffers there that the Hub checkpoints hold as tensors: the sigmoid routers' score correction (DeepSeek, GLM,
# MiniMax), Gemma-4's per-layer scalar
_CHECKPOINT_BUFFERS = ("e_score_correction_bias", "layer_scalar")


def _meta_params(model_type: str, **config) -> int:
    """Parameters of transformers' own model of this config, built on the meta device (no memory), with the buffers
    the Hub checkpoints hold as tensors (_CHECKPOINT_BUFFERS)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    return sum(p.numel() for p in built.parameters()) + sum(
        b.numel() for n, b in built.named_buffers() if n.endswith(_CHECKPOINT_BUFFERS))


# every family with a config-only row (llmc.model.shape_rows), at transformers' default widths with 4 layers and a
# small vocabulary: enough layers for each interleave (DeepSeek's 3 dense first layers, Qwen3.5's 3 linear-attention
# layers then a full one, Llama-4's MoE layers)
_TINY = {"num_hidden_layers": 4, "vocab_size": 128, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("model_type", sorted(SHAPE_ROWS))
def test_each_family_row_plans_the_parameters_transformers_builds(model_type: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **_TINY).to_dict()
    planned = from_config(config).params
    # exact, not just within 0.1%: a per-head norm planned at full width is 4e-5 of OLMo-3's total
    assert planned == _meta_params(model_type, **_TINY), model_type


# shipped configs whose tensors the name-by-name test above does not already hold to transformers' model
_SHIPPED_TOTALS = ["Llama-3.1-8B", "Llama-3.3-70B-Instruct", "Mixtral-8x7B-Instruct-v0.1", "Qwen2-7B", "Qwen3-30B-A3B",
                   "Qwen3-8B", "DeepSeek-V3"]


@pytest.mark.parametrize("model", _SHIPPED_TOTALS)
def test_shipped_configs_plan_the_parameters_transformers_builds_at_full_width(model: str) -> None:
    config = json.loads((REPO / "recipes" / "configs" / model / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "quantization_config")}
    planned = from_config(config).params
    assert planned == _meta_params(config["model_type"], **kwargs), model


_GEMMA4_TYPES = {"layer_types": ["sliding_attention", "full_attention"] * 2}


@pytest.mark.parametrize(("variant", "hub_form"), [
    ({}, False),  # per-layer inputs, the full layers' 512-wide heads (transformers' default global_head_dim)
    ({"num_kv_shared_layers": 2, "use_double_wide_mlp": True, "global_head_dim": 64}, False),
    ({"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 64}, False),
    # the Hub's form: global_head_dim / num_global_key_value_heads named, no per_layer_config
    ({"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 64,
      "num_kv_shared_layers": 2}, True),
    # without attention_k_eq_v transformers gives the full layers num_key_value_heads, whatever the global count
    ({"num_global_key_value_heads": 1, "global_head_dim": 64}, True),
    ({"hidden_size_per_layer_input": 0}, False),
])
def test_gemma4_is_planned_tensor_by_tensor_as_transformers_builds_it(variant: dict, hub_form: bool) -> None:
    """Gemma-4 from config.json alone (llmc.model.shape_rows gemma4_text): each layer's head width and KV heads by
    its type, KV-shared layers without k/v (and double-wide MLPs), full layers without v_proj under
    attention_k_eq_v, the per-layer inputs and layer_scalar: every tensor transformers' model holds, by name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**_TINY, **_GEMMA4_TYPES, **variant}
    config = AutoConfig.for_model("gemma4_text", **kwargs).to_dict()
    if hub_form:
        config = {k: v for k, v in config.items() if k != "per_layer_config"} | variant
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_text", **kwargs))
    theirs = {n: tuple(t.shape) for n, t in built.state_dict().items() if n != "lm_head.weight"}  # tied
    assert from_config(config).shapes == theirs
