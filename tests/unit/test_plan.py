"""The planner: runtime × arch × version compatibility and model-shape checks, before any weight loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmc.errors import IncompatibleTargetError
from llmc.planning.plan import IMPLEMENTED_ALGORITHMS, check_model, make_plan
from llmc.recipe.load import parse_recipe

FP8 = {"weights": {"format": "fp8_e4m3", "strategy": "channel"}, "activations": {"format": "fp8_e4m3", "strategy": "tensor"}}
W8A8 = {"weights": {"format": "int8", "strategy": "channel"},
        "activations": {"format": "int8", "strategy": "token", "dynamic": True}}
W4A16_G128 = {"weights": {"format": "int4", "strategy": "group", "group_size": 128}}
NVFP4 = {"weights": {"format": "nvfp4", "strategy": "group", "group_size": 16},
         "activations": {"format": "nvfp4", "strategy": "group", "group_size": 16}}


def recipe(quant: dict, *targets: dict, **extra):
    return parse_recipe(yaml.safe_dump({"name": "p", "model": {"source": "demo:smollm2-135m"},
                                        "quantization": quant, "targets": list(targets), **extra}))


def test_fp8_for_tensorrt_llm_on_a100_is_refused_with_alternatives() -> None:
    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(recipe(FP8, {"runtime": "tensorrt-llm", "gpu_arch": "sm80"}))
    assert "sm89" in e.value.message and "W8A8-INT8" in e.value.message and "W4A16" in e.value.message
    assert "gpu_arch" in e.value.fix and e.value.exit_code == 3


def test_nvfp4_below_blackwell_on_tensorrt_llm_is_refused() -> None:
    with pytest.raises(IncompatibleTargetError, match="sm100"):
        make_plan(recipe(NVFP4, {"runtime": "tensorrt-llm", "gpu_arch": "sm90"}))


def test_vllm_fp8_on_ampere_degrades_with_the_consequence() -> None:
    try:
        plan = make_plan(recipe(FP8, {"runtime": "vllm", "gpu_arch": "sm80"}))
    except IncompatibleTargetError as e:  # only acceptable reason: nothing but the degrade rule
        pytest.fail(f"vLLM runs FP8 on sm80 (weight-only), it must not be refused: {e}")
    [warning] = plan.warnings
    assert "Marlin" in warning and "weight-only" in warning and "activations stay 16-bit" in warning
    assert plan.targets[0]["status"] == "degraded"


def test_fp8_on_vllm_cpu_is_refused_with_the_measured_reason() -> None:
    with pytest.raises(IncompatibleTargetError, match="vllm-cpu"):
        make_plan(recipe(FP8, {"runtime": "vllm", "gpu_arch": "cpu"}))


def test_w4a16_on_vllm_cpu_needs_avx512() -> None:
    with pytest.raises(IncompatibleTargetError, match="AVX-512"):
        make_plan(recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 64}},
                         {"runtime": "vllm", "gpu_arch": "cpu"}))


def test_w8a8_int8_on_vllm_cpu_is_fine() -> None:
    assert make_plan(recipe(W8A8, {"runtime": "vllm", "gpu_arch": "cpu"})).targets[0]["status"] == "cpu"


def test_a_cpu_scored_target_without_gpu_arch_is_shown_on_the_cpu_and_keeps_its_name() -> None:
    """llama.cpp and ONNX Runtime targets that leave gpu_arch unset are printed as what llmc scores them on (the CPU),
    not the default sm90; their stage, cache-key and artifact name stays the default's (renaming it would orphan
    cached exports), and the plan says so. An arch the recipe names, and a GPU runtime's default, print as before."""
    w8a16 = {"weights": {"format": "int8", "strategy": "channel"}}
    plan = make_plan(recipe(w8a16, {"runtime": "llama.cpp"}, {"runtime": "onnxruntime"},
                            {"runtime": "llama.cpp", "gpu_arch": "sm90", "name": "gpu"}, {"runtime": "vllm"}))
    assert [(t["label"], t["shown_label"], t["runs_on"]) for t in plan.targets] == [
        ("llama.cpp-sm90-tp1", "llama.cpp-cpu-tp1", "cpu"), ("onnxruntime-sm90-tp1", "onnxruntime-cpu-tp1", "cpu"),
        ("gpu", "gpu", "sm90"), ("vllm-sm90-tp1", "vllm-sm90-tp1", "sm90")]
    lines = [line for line in plan.render().splitlines() if line.startswith("  target ")]
    assert lines[0].startswith("  target llama.cpp-cpu-tp1: gguf (")
    assert "default sm90" in lines[0] and "(llama.cpp-sm90-tp1)" in lines[0]
    assert lines[3] == "  target vllm-sm90-tp1: compressed-tensors (native)"
    named = make_plan(recipe(w8a16, {"runtime": "llama.cpp", "gpu_arch": "sm90"}))
    assert named.targets[0]["shown_label"] == "llama.cpp-sm90-tp1" and "gpu_arch left" not in named.render()


def test_int8_kv_cache_is_not_a_vllm_format() -> None:
    with pytest.raises(IncompatibleTargetError, match="KV-INT8"):
        make_plan(recipe({**W8A8, "kv_cache": {"format": "int8"}}, {"runtime": "vllm"}))


def test_version_range_without_support_is_refused() -> None:
    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 128},
                          "activations": {"format": "fp8_e4m3", "strategy": "token", "dynamic": True}},
                         {"runtime": "vllm", "version": "<0.8"}))
    assert "supports W4AFP8 from 0.10.2" in e.value.message and ">=0.10.2" in e.value.fix


W4AFP8_VLLM = {"weights": {"format": "int4", "strategy": "group", "group_size": 128},
               "activations": {"format": "fp8_e4m3", "strategy": "token", "dynamic": True}}
W4AFP8_TRTLLM = {"weights": {"format": "int4", "strategy": "group", "group_size": 128},
                 "activations": {"format": "fp8_e4m3", "strategy": "tensor"}, "algorithm": "awq"}


def test_w4afp8_plans_for_vllm_on_hopper_only() -> None:
    plan = make_plan(recipe(W4AFP8_VLLM, {"runtime": "vllm", "gpu_arch": "sm90"}))
    assert plan.targets[0]["status"] == "native" and plan.scheme.name == "W4AFP8"
    assert plan.scheme.weights.scale_grid == "fp8_row" and not any("FP8 grid" in w for w in plan.warnings)
    float_scales = {**W4AFP8_VLLM, "weights": {**W4AFP8_VLLM["weights"], "scale_grid": "float"}}
    plan = make_plan(recipe(float_scales, {"runtime": "vllm", "gpu_arch": "sm90"}))
    assert any("rounds the int4 group scales onto a per-row FP8 grid" in w and "scale_grid: float" in w
               for w in plan.warnings)
    for arch in ("sm89", "sm100"):  # vLLM matches its W4A8 kernel to sm90 exactly
        with pytest.raises(IncompatibleTargetError, match="Hopper") as e:
            make_plan(recipe(W4AFP8_VLLM, {"runtime": "vllm", "gpu_arch": arch}))
        assert "sm90" in e.value.message + e.value.fix


INT8_W8A8 = {"weights": {"format": "int8", "strategy": "channel"},
             "activations": {"format": "int8", "strategy": "token", "dynamic": True}}


@pytest.mark.parametrize("runtime", ["vllm", "sglang", "tgi"])
def test_int8_w8a8_is_refused_on_blackwell_where_the_runtime_has_no_int8_gemm(runtime: str) -> None:
    """issue 50 item 6: vLLM's SM100/SM120 CUTLASS dispatch has no int8 GEMM (PR #25935 refuses it at load);
    SGLang's sgl-kernel and TGI's vendored kernel stop at sm90 too. The plan used to accept it."""
    assert make_plan(recipe(INT8_W8A8, {"runtime": runtime, "gpu_arch": "sm90"})).targets[0]["status"] == "native"
    for arch in ("sm100", "sm120"):
        with pytest.raises(IncompatibleTargetError) as e:
            make_plan(recipe(INT8_W8A8, {"runtime": runtime, "gpu_arch": arch}))
        assert e.value.exit_code == 3
        assert f"{runtime} runs W8A8-INT8 on " in e.value.message and f"-sm90, gpu_arch is {arch}" in e.value.message
        assert "W8A8-FP8" in e.value.fix and "set gpu_arch to sm90 or older" in e.value.fix


def test_every_runtime_rule_cites_the_runtime_source_it_was_read_from() -> None:
    from llmc.runtimes.catalog import runtimes

    rules = [(rt.name, key, rule) for rt in runtimes() for key, rule in rt.rules.items()]
    assert len(rules) > 40
    missing = [(name, key) for name, key, rule in rules if len(rule.source.strip()) < 10]
    assert not missing, f"rules without a source: {missing}"
    for name, key, rule in rules:  # an upper bound says why newer GPUs lose the kernel
        assert not rule.native_until or rule.until_reason or rule.refuse_reason, (name, key)


def test_w4afp8_activation_kind_follows_the_runtime_kernel() -> None:
    """vLLM's kernel quantizes activations per token at run time; TensorRT-LLM's W4A8_AWQ uses one calibrated
    scale: each refuses the other's recipe, naming the activations it needs."""
    with pytest.raises(IncompatibleTargetError, match="dynamic per-token") as e:
        make_plan(recipe(W4AFP8_TRTLLM, {"runtime": "vllm", "gpu_arch": "sm90"}))
    assert "strategy: token, dynamic: true" in e.value.fix
    with pytest.raises(IncompatibleTargetError, match="static scale per tensor") as e:
        make_plan(recipe(W4AFP8_VLLM, {"runtime": "tensorrt-llm", "gpu_arch": "sm90"}))
    assert "strategy: tensor" in e.value.fix
    plan = make_plan(recipe(W4AFP8_TRTLLM, {"runtime": "tensorrt-llm", "gpu_arch": "sm89"}))
    assert plan.targets[0]["exporter"] == "modelopt-hf"
    with pytest.raises(IncompatibleTargetError, match="sm89"):
        make_plan(recipe(W4AFP8_TRTLLM, {"runtime": "tensorrt-llm", "gpu_arch": "sm80"}))
    with pytest.raises(IncompatibleTargetError, match="groups of 128"):
        make_plan(recipe({**W4AFP8_VLLM, "weights": {"format": "int4", "strategy": "group", "group_size": 64}},
                         {"runtime": "vllm", "gpu_arch": "sm90"}))
    with pytest.raises(IncompatibleTargetError, match="W4AFP8"):  # no W4A8 kernel in llama.cpp
        make_plan(recipe(W4AFP8_VLLM, {"runtime": "llama.cpp", "gpu_arch": "cpu"}))


def test_version_range_check_on_a_supported_scheme() -> None:
    with pytest.raises(IncompatibleTargetError, match="admits no such release"):
        make_plan(recipe(W8A8, {"runtime": "vllm", "version": "<0.5"}))
    make_plan(recipe(W8A8, {"runtime": "vllm", "version": ">=0.9,<1.0"}))


def test_target_without_exporter_says_so(monkeypatch) -> None:
    # every runtime has an exporter today; a runtime whose exporter is missing must be named, with the alternatives
    from llmc.formats import registry as format_registry
    from llmc.runtimes import catalog as targets
    from llmc.runtimes import registry

    assert all(targets.is_implemented(f) for rt in targets.runtimes() for f in {r.format for r in rt.matrix_rows()})
    from llmc.registry import Registry

    formats = Registry(targets.FORMATS.kind)
    for name, fmt in targets.FORMATS.items():
        if name != "onnx":
            formats.add(name, fmt)
    # the lookups' modules (the formats' and the runtimes' over them); the catalog re-exports them
    monkeypatch.setattr(format_registry, "FORMATS", formats)
    monkeypatch.setattr(registry, "FORMATS", formats)
    w4 = {"weights": {"format": "int4", "strategy": "group", "group_size": 32}}
    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(recipe(w4, {"runtime": "onnxruntime", "gpu_arch": "cpu"}))
    assert "onnx exporter for onnxruntime is not in this llmc version" in e.value.message
    assert "vllm" in e.value.fix and "onnxruntime" not in e.value.fix


def test_unimplemented_algorithms_are_refused() -> None:
    for algo, quant in (("smoothquant", W8A8), ("gptq", W4A16_G128), ("awq", W4A16_G128)):
        if algo in IMPLEMENTED_ALGORITHMS:
            continue
        with pytest.raises(IncompatibleTargetError, match="not implemented"):
            make_plan(recipe({**quant, "algorithm": algo}, {"runtime": "vllm"}))


SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "tie_word_embeddings": True}
SMOLLM2_LINEARS = {"model.layers.0.self_attn.q_proj": (576, 576), "model.layers.0.mlp.down_proj": (576, 1536),
                   "model.layers.0.mlp.up_proj": (1536, 576), "lm_head": (49152, 576)}


def test_group_size_must_divide_the_models_inputs() -> None:
    r = recipe(W4A16_G128, {"runtime": "vllm"})
    with pytest.raises(IncompatibleTargetError) as e:
        check_model(r, r.quantization.to_scheme(), SMOLLM2, SMOLLM2_LINEARS)
    assert "576" in e.value.message and "group_size 64" in e.value.fix


def test_a_group_size_that_does_not_divide_names_the_linears_and_their_shapes() -> None:
    """issue 50 item 10: the refusal said 'input dimension(s) [16]' without saying which Linear has that width."""
    r = recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 32}}, {"runtime": "vllm"})
    config = {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256}
    shapes = {f"model.layers.{i}.{n}": shape for i in range(3)
              for n, shape in (("self_attn.q_proj", (64, 64)), ("mlp.down_proj", (64, 256)), ("mlp.odd_proj", (8, 16)))}
    with pytest.raises(IncompatibleTargetError) as e:
        check_model(r, r.quantization.to_scheme(), config, shapes)
    message = e.value.message
    assert "does not divide input dimension(s) [16]" in message
    assert "model.layers.0.mlp.odd_proj (8x16), model.layers.1.mlp.odd_proj (8x16)" in message
    assert "down_proj" not in message and "q_proj" not in message and "(out x in)" in message


@pytest.mark.parametrize("heads, kv, tp, ok", [
    (9, 3, 2, False),   # SmolLM2: 9 heads do not split in 2
    (32, 8, 4, True),
    (32, 4, 8, True),   # more ranks than KV heads: runtimes replicate KV heads
    (12, 6, 4, False),  # 6 KV heads neither divide by 4 nor divide 4
])
def test_tensor_parallel_vs_heads(heads: int, kv: int, tp: int, ok: bool) -> None:
    r = recipe(W8A8, {"runtime": "vllm", "tensor_parallel": tp})
    config = {"num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": 4096}
    shapes = {"model.layers.0.mlp.down_proj": (512, 4096)}
    if ok:
        check_model(r, r.quantization.to_scheme(), config, shapes)
    else:
        with pytest.raises(IncompatibleTargetError, match="tensor_parallel"):
            check_model(r, r.quantization.to_scheme(), config, shapes)


def test_row_parallel_split_must_keep_whole_groups() -> None:
    r = recipe({"weights": {"format": "int4", "strategy": "group", "group_size": 128}},
               {"runtime": "vllm", "tensor_parallel": 8})
    config = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 1536}  # 1536 / 8 = 192
    with pytest.raises(IncompatibleTargetError, match="row-parallel"):
        check_model(r, r.quantization.to_scheme(), config, {"model.layers.0.mlp.down_proj": (512, 1536)})


def test_tied_lm_head_cannot_be_quantized() -> None:
    r = recipe({**W8A8, "ignore": []}, {"runtime": "vllm"})
    with pytest.raises(IncompatibleTargetError, match="tied"):
        check_model(r, r.quantization.to_scheme(), SMOLLM2, SMOLLM2_LINEARS)


def test_variants_are_each_checked_and_named() -> None:
    r = parse_recipe(yaml.safe_dump({
        "name": "v", "model": {"source": "demo:smollm2-135m"},
        "variants": [{"name": "int8", "quantization": W8A8}, {"name": "fp8", "quantization": FP8}],
        "targets": [{"runtime": "vllm", "gpu_arch": "sm80"}],
    }))
    plan = make_plan(r)
    assert [t["label"] for t in plan.targets] == ["int8/vllm-sm80-tp1", "fp8/vllm-sm80-tp1"]
    assert plan.warnings and plan.warnings[0].startswith("fp8: ")


def test_estimates_from_headers_only(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as h:
        params = sum(h.get_slice(k).get_shape().numel() if hasattr(h.get_slice(k).get_shape(), "numel")
                     else _numel(h.get_slice(k).get_shape()) for k in h.keys())
    r = recipe(W8A8, {"runtime": "vllm"})
    plan = make_plan(r, tiny_model, tmp_path)
    assert plan.costed_for.params == params
    assert plan.costed_for.layers == 2 and plan.peak_memory_gb > 0
    assert "plan for 'p'" in plan.render() and "peak memory" in plan.render()


def test_spilled_activations_shrink_the_memory_estimate(tiny_model: Path, tmp_path: Path) -> None:
    static_int8 = {"weights": {"format": "int8", "strategy": "channel"},
                   "activations": {"format": "int8", "strategy": "tensor"}}
    calib = {"samples": 64, "seq_len": 1024}  # tiny_model's max_position_embeddings (llmc.model.checks)
    kept = make_plan(recipe(static_int8, {"runtime": "vllm"}, calibration={**calib, "spill_activations": "never"}),
                     tiny_model, tmp_path)
    spilled = make_plan(recipe(static_int8, {"runtime": "vllm"}, calibration={**calib, "spill_activations": "always"}),
                        tiny_model, tmp_path)
    hidden = 64  # tiny_model's width: two fp32 copies of 64 windows, against one batch of 4 in and out
    drop = (2 * 64 - 2 * 4) * 1024 * hidden * 4 / 1e9
    assert kept.peak_memory_gb - spilled.peak_memory_gb == pytest.approx(drop)
    assert "spilled to disk" in spilled.render() and "spilled to disk" not in kept.render()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_docs_compatibility_matrix_is_generated_from_the_planner_data() -> None:
    from llmc.runtimes.matrix import render_matrix

    docs = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
    assert docs.read_text() == render_matrix(), "regenerate: llmc matrix --write docs/compatibility.md"


def test_whole_model_onnx_export_is_checked_against_memory(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    """The ONNX exporters hold the whole float32 model: the planner estimates it and refuses, with the
    fix, when the machine lacks the memory (before any weight loads)."""
    import llmc.planning.plan
    from llmc.errors import ResourceError

    static_int8 = {"weights": {"format": "int8", "strategy": "channel"},
                   "activations": {"format": "int8", "strategy": "tensor"}}
    plan = make_plan(recipe(static_int8, {"runtime": "onnxruntime", "gpu_arch": "cpu"}), tiny_model, tmp_path)
    need = plan.export_memory_gb
    assert need == pytest.approx(3 * plan.costed_for.params * 4 / 1e9)
    assert "ONNX export" in plan.render()
    assert make_plan(recipe(static_int8, {"runtime": "vllm"}), tiny_model, tmp_path).export_memory_gb is None
    monkeypatch.setattr(llmc.planning.plan, "memory_available", lambda: int(need * 1e9 / 2))
    with pytest.raises(ResourceError, match="holds the whole model in float32") as e:
        make_plan(recipe(static_int8, {"runtime": "onnxruntime", "gpu_arch": "cpu"}), tiny_model, tmp_path)
    assert "more memory" in e.value.fix


def test_a_build_that_stops_at_quantize_is_refused_only_for_the_stages_it_runs(tiny_model: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """`llmc quantize` (build_until(..., "quantize")) runs no export or evaluation: a machine with memory for the
    quantize stage but not for a later stage is refused by `llmc build`, not by `llmc quantize`."""
    import llmc.planning.plan
    from llmc.errors import ResourceError
    from llmc.pipeline.ids import Kind

    def need(row) -> float:
        return row.host_bytes + row.mapped_bytes

    static_int8 = {"weights": {"format": "int8", "strategy": "channel"},
                   "activations": {"format": "int8", "strategy": "tensor"}}
    r = recipe(static_int8, {"runtime": "onnxruntime", "gpu_arch": "cpu"})
    plan = make_plan(r, tiny_model, tmp_path)
    quantize_need = max(need(row) for row in plan.rows if row.id.kind is Kind.QUANTIZE)
    later_need = max([need(row) for row in plan.rows if row.id.kind.comes_after(Kind.QUANTIZE)]
                     + [plan.export_memory_gb * 1e9])
    assert later_need > quantize_need + 1e3, "the test needs a later stage that needs more than the quantize stage"
    monkeypatch.setattr(llmc.planning.plan, "memory_available", lambda: int((quantize_need + later_need) / 2))
    with pytest.raises(ResourceError):
        make_plan(r, tiny_model, tmp_path)
    stops_at_quantize = make_plan(r, tiny_model, tmp_path, last=Kind.QUANTIZE)
    assert [row.name for row in stops_at_quantize.rows] == [row.name for row in plan.rows]  # still planned and shown


def test_decode_gate_on_a_graph_without_kv_cache_is_warned() -> None:
    plan = make_plan(recipe(FP8, {"runtime": "tensorrt", "gpu_arch": "sm90"},
                            gates={"min_decode_tokens_per_s": 5.0}))
    assert any("no KV cache" in w and "tensorrt-sm90-tp1" in w for w in plan.warnings)
    quiet = make_plan(recipe(FP8, {"runtime": "tensorrt", "gpu_arch": "sm90"}))
    assert not any("KV cache" in w for w in quiet.warnings)


def test_w4afp8_on_a_model_whose_widths_128_does_not_divide_says_w4afp8_cannot_fit() -> None:
    """SmolLM2's hidden size 576 rules out the group 128 both W4A8 kernels need: the fix must not suggest
    a smaller group (the exporter would refuse it), but another scheme."""
    r = recipe(W4AFP8_VLLM, {"runtime": "vllm", "gpu_arch": "sm90"})
    with pytest.raises(IncompatibleTargetError, match="576") as e:
        check_model(r, r.quantization.to_scheme(), SMOLLM2, SMOLLM2_LINEARS)
    assert "W4AFP8 needs group_size 128" in e.value.fix and "W4A16 (use group_size 64)" in e.value.fix
