"""DeepSeek-V3 (and Kimi-K2, the same model_type), DeepSeek-V3.2 (V3 plus its sparse-attention indexer) and GLM-4.5
beyond what tests/unit/test_moe.py checks on every MoE family: the layer stream's calibration forward on a model
mixing a dense first layer (first_k_dense_replace) with MoE layers under multi-head latent attention, the MTP layer
DeepSeek checkpoints carry (skipped and said), the latent KV cache (refused), the roles of the family tables, vLLM's
fused-MoE scheme rule, V3.2's indexer (which Linears are quantized, GGUF refused, its config-only planner row) and
`llmc build` end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmc.errors import IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant import moe, stream
from llmc.quant.numerics import static_scale
from llmc.quant.spec import Scheme, TensorSpec
from tests.unit.families import make_tiny
from tests.unit.test_families import _ids
from tests.unit.test_gemma3 import _linear_input_absmax as linear_input_absmax, observing_channel_absmax
from tests.unit.test_runtime_scales import one_input_scale_per_moe_layer

FP8_STATIC = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))
# per-tensor weights: vLLM's fused MoE refuses per-channel weights with static activations (issue 45)
FP8_KV = {"weights": {"format": "fp8_e4m3", "strategy": "tensor"},
          "activations": {"format": "fp8_e4m3", "strategy": "tensor"}}
W4A16_GPTQ = {"weights": {"format": "int4", "strategy": "group", "group_size": 32}, "algorithm": "gptq"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Three layers: layer 0 a dense MLP (first_k_dense_replace 1), layers 1-2 MoE with a shared expert; MLA with
    q_lora_rank set (q_a_proj -> q_a_layernorm -> q_b_proj) and interleaved rope."""
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("deepseek") / "model", num_hidden_layers=3,
                     first_k_dense_replace=1)


def _float_model(folder: Path, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **config).eval()


def _linear_input_absmax(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-input-channel max |input| of every decoder-layer Linear (experts as per-expert Linears, each seeing its
    routed tokens), from hooks on transformers' whole model, two windows a forward."""
    moe.unfuse_experts(model)
    return linear_input_absmax(model, ids, batch=2)


def test_the_layer_streams_calibration_forward_is_transformers_full_forward(mixed: Path, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """Layer by layer, every Linear of the dense layer, the MLA projections, each routed expert and the shared
    expert sees exactly the inputs it gets in transformers' whole-model forward on the same tokens (the rope split
    and interleave, the latent norms, the sigmoid router with its correction bias, the dense/MoE interleave), and
    the static scales written are theirs."""
    calib = _ids(4, 1)
    ref = _linear_input_absmax(_float_model(mixed), calib)
    # the check can fail: rope applied without DeepSeek's interleave gives other attention outputs
    plain_rope = _linear_input_absmax(_float_model(mixed, rope_interleave=False), calib)
    assert not torch.allclose(plain_rope["model.layers.0.self_attn.o_proj"], ref["model.layers.0.self_attn.o_proj"])

    observed = observing_channel_absmax(monkeypatch)
    written = _fp8_static_layers(mixed, calib, tmp_path / "q")
    mla = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    dense = {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert dense <= set(ref) and not any(".layers.0.mlp.experts." in n for n in ref)
    assert {f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in mla} <= set(ref)
    assert len(ref) == len(observed) == 3 * 5 + 3 + 2 * (4 * 3 + 3)  # MLA x3, dense MLP, 2 x (experts + shared)
    _assert_ranges_and_scales_are_transformers(observed, ref, written)


def test_glm45s_qk_norms_are_in_the_layer_streams_calibration_forward(tmp_path: Path, monkeypatch) -> None:
    """GLM-4.5 (use_qk_norm, as its published config; transformers' default is off): layer by layer, every Linear
    of a dense first layer and an MoE layer sees transformers' whole-model inputs, o_proj's behind the per-head q/k
    RMSNorms; the check can fail: the same weights without the q/k norms give o_proj other inputs."""
    folder = make_tiny("glm4_moe", tmp_path / "glm", first_k_dense_replace=1)
    calib = _ids(4, 1)
    model = _float_model(folder)
    assert model.config.use_qk_norm and model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    ref = _linear_input_absmax(model, calib)
    without = _linear_input_absmax(_float_model(folder, use_qk_norm=False), calib)
    for i in range(2):
        o_proj = f"model.layers.{i}.self_attn.o_proj"
        assert not torch.allclose(without[o_proj], ref[o_proj], rtol=1e-3), o_proj
    observed = observing_channel_absmax(monkeypatch)
    written = _fp8_static_layers(folder, calib, tmp_path / "q")
    assert len(observed) == len(ref) == 2 * 4 + 3 + (4 * 3 + 3)  # attention x2, dense MLP, experts + shared
    _assert_ranges_and_scales_are_transformers(observed, ref, written)


def _fp8_static_layers(model: Path, calib: torch.Tensor, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the decoder layers' files after FP8 static calibration of `model` on `calib`, layer by layer."""
    stream.quantize_model(ModelSource(model, "d", "d"), FP8_STATIC, out, stream.Calibration(calib, batch_size=2))
    written = {}
    for f in sorted((out / "layers").glob("*.safetensors")):
        written.update(load_file(str(f)))
    return written


def _assert_ranges_and_scales_are_transformers(observed: dict, ref: dict, written: dict) -> None:
    """Each observed Linear's per-channel input absmax is transformers' whole-model one, its written static scale
    the one that absmax gives."""
    # the routed experts' written scale: their MoE layer's one, the max of theirs (llmc.quant.runtime_scales)
    want = one_input_scale_per_moe_layer({n: static_scale(ref[n].amax(), FP8_STATIC.activations) for n in observed})
    for name, absmax in observed.items():
        torch.testing.assert_close(absmax, ref[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(written[f"{name}.input_scale"], want[name], rtol=1e-5, atol=0, msg=name)


def test_roles_name_mla_shared_experts_router_and_the_dense_mlp() -> None:
    """The family tables: MLA's projections are attention, the shared expert its own role before the dense MLP it
    would match, the router (never quantized) and the first layers' dense MLP."""
    from llmc.model.families import linear_role

    for family in ("deepseek_v3", "glm4_moe"):
        assert linear_role(family, "mlp.shared_experts.down_proj") == "shared_experts"
        assert linear_role(family, "mlp.experts.7.up_proj") == "experts"
        assert linear_role(family, "mlp.gate") == "router"
        assert linear_role(family, "mlp.down_proj") == "mlp"
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj"):
        assert linear_role("deepseek_v3", f"self_attn.{proj}") == "attention"


def _add_mtp_layer(folder: Path) -> int:
    """Append what a DeepSeek-V3 checkpoint stores as model.layers.<num_hidden_layers>: the MTP layer's own tensors
    (enorm, hnorm, eh_proj, shared_head) and a decoder layer's (copied from the last layer). Returns its index."""
    config = json.loads((folder / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    state = load_file(str(folder / "model.safetensors"))
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone() for k, v in state.items()
           if k.startswith(f"model.layers.{n - 1}.")}
    mtp |= {f"model.layers.{n}.enorm.weight": torch.ones(h), f"model.layers.{n}.hnorm.weight": torch.ones(h),
            f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h),
            f"model.layers.{n}.shared_head.norm.weight": torch.ones(h)}
    save_file({**state, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return n


def _recipe(folder: Path, quantization: dict, *targets: dict, **extra):
    from llmc.recipe.load import parse_recipe

    return parse_recipe(yaml.safe_dump({"name": "d", "model": {"source": str(folder)}, "quantization": quantization,
                                        "targets": list(targets) or [{"runtime": "vllm", "gpu_arch": "sm90"}],
                                        **extra}))


def test_the_mtp_layer_is_skipped_and_said(tmp_path: Path, capsys) -> None:
    """A checkpoint with DeepSeek's MTP layer (model.layers.<num_hidden_layers>.*, which transformers does not load):
    the plan and the quantize log say it is skipped; nothing of it is quantized or exported; no error."""
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.planning.plan import make_plan
    from llmc.quant.canonical import QuantizedModel

    folder = make_tiny("deepseek_v3", tmp_path / "model")
    n = _add_mtp_layer(folder)
    plan = make_plan(_recipe(folder, {"weights": {"format": "int4", "strategy": "group", "group_size": 32}}), folder)
    said = [w for w in plan.warnings if f"model.layers.{n}.*" in w]
    assert len(said) == 1 and "multi-token-prediction" in said[0] and "skipped" in said[0]
    stream.quantize_model(ModelSource(folder, "d", "d"), Scheme(TensorSpec("int4", "group", group_size=32)),
                          tmp_path / "q", None)
    assert f"note: model.layers.{n}.*" in capsys.readouterr().err
    qm = QuantizedModel.open(tmp_path / "q")
    assert qm.quantized_modules and not [m for m in qm.quantized_modules if f".layers.{n}." in m]
    export_compressed_tensors(qm, tmp_path / "export")
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        assert not [k for k in f.keys() if k.startswith(f"model.layers.{n}.")]


def test_the_latent_kv_cache_is_refused_naming_mla(mixed: Path, tmp_path: Path) -> None:
    """KV-cache quantization of DeepSeek's latent cache: refused at plan time (exit 3) and by the stream for a direct
    caller, naming multi-head latent attention and the fix; without kv_cache the plan goes through."""
    from llmc.planning.plan import make_plan

    with pytest.raises(IncompatibleTargetError, match="multi-head latent attention caches the compressed latent") as no:
        make_plan(_recipe(mixed, {**FP8_KV, "kv_cache": {"format": "fp8_e4m3"}}), mixed)
    assert no.value.exit_code == 3 and "kv_cache" in no.value.fix
    with pytest.raises(IncompatibleTargetError, match="latent"):
        stream.quantize_model(ModelSource(mixed, "d", "d"), Scheme(FP8_STATIC.weights, FP8_STATIC.activations,
                                                                   kv_cache=TensorSpec("fp8_e4m3", "tensor")),
                              tmp_path / "q", stream.Calibration(_ids(2, 1)))
    make_plan(_recipe(mixed, FP8_KV), mixed)


def test_vllm_takes_the_families_only_with_schemes_its_fused_moe_runs(mixed: Path) -> None:
    """vLLM's compressed-tensors MoE method dispatch (its source named in the refusal): FP8 W8A8 and W4A16 plan;
    FP8 weight-only and static INT8 activations have no fused-MoE kernel and are refused at plan time; llama.cpp's
    GGUF plans, Ollama's is refused."""
    from llmc.planning.plan import make_plan

    for quantization in (FP8_KV, W4A16_GPTQ):
        assert [t["exporter"] for t in make_plan(_recipe(mixed, quantization), mixed).targets] == ["compressed-tensors"]
    for quantization, key in (({"weights": {"format": "fp8_e4m3", "strategy": "channel"}}, "W8A16-FP8"),
                              ({"weights": {"format": "int8", "strategy": "channel"},
                                "activations": {"format": "int8", "strategy": "tensor"}},
                               "W8A8-INT8 with static activations")):
        with pytest.raises(IncompatibleTargetError, match="no fused Mixture-of-Experts kernel") as refused:
            make_plan(_recipe(mixed, quantization), mixed)
        assert key in str(refused.value) and "compressed_tensors_moe.py" in str(refused.value)
        assert "W4A16-INT" in refused.value.fix
    # llama.cpp's deepseek2 takes llmc's GGUF (tests/unit/test_gguf_moe.py); Ollama is refused, unrun
    assert [t["exporter"] for t in make_plan(_recipe(mixed, W4A16_GPTQ, {"runtime": "llama.cpp"}), mixed).targets] == [
        "gguf"]
    with pytest.raises(IncompatibleTargetError, match="ollama does not load llmc's gguf artifact"):
        make_plan(_recipe(mixed, W4A16_GPTQ, {"runtime": "ollama"}), mixed)
    # mixed precision: only the groups that select experts need a fused-MoE kernel (FP8 weight-only attention and
    # shared expert run in dense GEMMs); FP8 weight-only experts are refused
    def groups(experts: str) -> dict:
        return {"groups": [{"name": "router", "roles": ["router"], "ignore": True},
                           {"name": "experts", "roles": ["experts"], "scheme": experts},
                           {"name": "rest", "roles": ["attention", "shared_experts", "mlp"], "scheme": "W8A16-FP8"}]}

    make_plan(_recipe(mixed, groups("W8A8-FP8")), mixed)
    with pytest.raises(IncompatibleTargetError, match="no fused Mixture-of-Experts kernel for W8A16-FP8"):
        make_plan(_recipe(mixed, groups("W8A16-FP8")), mixed)


@pytest.mark.slow  # two quantized variants and their evaluations
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "deepseek_v32"])
def test_llmc_build_of_a_tiny_model_in_fp8_and_w4a16_gptq(family: str, tmp_path: Path) -> None:
    """`llmc build` of a tiny random DeepSeek-V3 (dense first layer, MLA, shared expert, MTP layer in the
    checkpoint) and GLM-4.5: FP8 W8A8 (static activations) and W4A16 GPTQ variants for vLLM, exported as
    compressed-tensors and scored from the exported files by the torch engine; every expert quantized, the routers
    in the ignore list, the MTP layer absent."""
    from llmc.build import build
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store

    folder = make_tiny(family, tmp_path / "model", num_hidden_layers=3, first_k_dense_replace=1)
    mtp = _add_mtp_layer(folder) if family.startswith("deepseek") else None
    recipe = parse_recipe(yaml.safe_dump({
        "name": f"tiny-{family}", "model": {"source": str(folder)},
        "variants": [{"name": "fp8", "quantization": FP8_KV}, {"name": "w4a16", "quantization": W4A16_GPTQ}],
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"seq_len": 64, "windows": 4, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 100,
                 "runtimes": ["torch"]},
        "gates": {"max_ppl_increase_pct": 1000.0},
        "publish": {"registry": str(tmp_path / "registry")}}))
    store = Store(tmp_path / "cache")
    result = build(recipe, store, publish=False)
    assert result.passed and len(result.artifacts) == 2
    for artifact in result.artifacts.values():
        export = Path(artifact.dir)
        config = json.loads((export / "config.json").read_text())
        ignore = config["quantization_config"]["ignore"]
        assert "re:.*\\.mlp\\.gate$" in ignore
        with safe_open(str(next(export.glob("*.safetensors"))), "pt") as f:
            names = set(f.keys())
        assert "model.layers.2.mlp.experts.3.down_proj.weight_scale" in names
        assert "model.layers.2.mlp.shared_experts.down_proj.weight_scale" in names
        assert "model.layers.0.mlp.down_proj.weight_scale" in names  # the dense first layer
        if family == "deepseek_v32":  # the indexer: wq_b quantized, wk / weights_proj in float and ignored
            assert "model.layers.2.self_attn.indexer.wq_b.weight_scale" in names
            for kept in ("wk", "weights_proj"):
                assert f"model.layers.2.self_attn.indexer.{kept}.weight" in names
                assert any(re.fullmatch(p[3:] if p.startswith("re:") else re.escape(p),
                                        f"model.layers.2.self_attn.indexer.{kept}") for p in ignore)
        if mtp is not None:
            assert not [k for k in names if k.startswith(f"model.layers.{mtp}.")]


def test_the_routers_correction_bias_stays_float32_in_a_bf16_build(tmp_path: Path) -> None:
    """transformers keeps e_score_correction_bias in float32 whatever the model's dtype (its rounding moves the
    top-k choice): quantized in bf16, the canonical form and the export hold the checkpoint's float32 values bit for
    bit, while the router weight is bf16 like the rest of the layer."""
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.quant.canonical import QuantizedModel

    folder = make_tiny("deepseek_v3", tmp_path / "model")
    state = load_file(str(folder / "model.safetensors"))
    bias = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 0.3 + 1.0  # bf16 would round these
    state["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert not torch.equal(bias.bfloat16().float(), bias)
    stream.quantize_model(ModelSource(folder, "d", "d"), Scheme(TensorSpec("int4", "group", group_size=32)),
                          tmp_path / "q", None, stream.StreamOptions(dtype=torch.bfloat16))
    qm = QuantizedModel.open(tmp_path / "q")
    tensors = {k: v for t in qm.iter_files() for k, v in t.items()}
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["model.layers.1.mlp.gate.e_score_correction_bias"], bias)
    export_compressed_tensors(qm, tmp_path / "export")
    with safe_open(str(next((tmp_path / "export").glob("*.safetensors"))), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias"), bias)


# DeepSeek-V3.2 (model_type deepseek_v32): DeepSeek-V3's layers plus the lightning indexer in every attention block
# (tests/unit/families.py: 4 index heads of 16, index_topk 8 of the tests' 24 tokens)
V32_INDEXER = ("wq_b", "wk", "weights_proj")


@pytest.fixture(scope="module")
def v32(tmp_path_factory) -> Path:
    """Three layers as `mixed` (a dense first layer, then MoE), each attention block with its indexer."""
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("deepseek_v32") / "model", num_hidden_layers=3,
                     first_k_dense_replace=1)


def test_deepseek_v32_is_a_row_of_the_family_tables() -> None:
    """config.json of DeepSeek-V3.2 is quantizable; its indexer's wq_b (reading the query latent) is attention and
    quantized, wk and weights_proj (vLLM's unquantized wk_weights_proj) stay in the dtype, the rest is DeepSeek-V3's
    table."""
    from llmc.model.families import check_quantizable, kept_in_dtype, linear_role

    check_quantizable({"model_type": "deepseek_v32", "n_routed_experts": 256})
    assert linear_role("deepseek_v32", "self_attn.indexer.wq_b") == "attention"
    assert kept_in_dtype("deepseek_v32", "model.layers.4.self_attn.indexer.wq_b") is None
    for kept in ("wk", "weights_proj"):
        assert "wk_weights_proj" in kept_in_dtype("deepseek_v32", f"model.layers.4.self_attn.indexer.{kept}")
        assert kept_in_dtype("deepseek_v3", f"model.layers.4.self_attn.indexer.{kept}") is None
    for name, role in (("mlp.shared_experts.down_proj", "shared_experts"), ("mlp.experts.7.up_proj", "experts"),
                       ("mlp.gate", "router"), ("mlp.down_proj", "mlp"), ("self_attn.kv_b_proj", "attention")):
        assert linear_role("deepseek_v32", name) == role


@pytest.mark.heavy  # ~8 s here
def test_the_v32_layer_streams_calibration_forward_is_transformers_full_forward(v32: Path, tmp_path: Path,
                                                                                monkeypatch) -> None:
    """Layer by layer, every quantized Linear of DeepSeek-V3.2 (MLA, the indexer's wq_b, the dense MLP, each routed
    expert, the shared expert) sees the per-channel input ranges transformers' whole-model forward gives it, so the
    indexer's top-k selection (the mask it adds) is computed as there; the written static scales are theirs; the kept
    wk / weights_proj are never observed."""
    calib = _ids(4, 1)
    ref = _linear_input_absmax(_float_model(v32), calib)
    # the check can fail: keeping every token (index_topk >= the window) gives other attention outputs
    dense = _linear_input_absmax(_float_model(v32, index_topk=1024), calib)
    assert not torch.allclose(dense["model.layers.1.self_attn.o_proj"], ref["model.layers.1.self_attn.o_proj"])

    observed = observing_channel_absmax(monkeypatch)
    written = _fp8_static_layers(v32, calib, tmp_path / "q")
    kept = {f"model.layers.{i}.self_attn.indexer.{p}" for i in range(3) for p in ("wk", "weights_proj")}
    assert kept <= set(ref) and not kept & set(observed)
    assert {f"model.layers.{i}.self_attn.indexer.wq_b" for i in range(3)} <= set(observed)
    # (MLA 5 + wq_b) x3, the dense MLP, 2 x (experts + shared)
    assert len(observed) == len(ref) - len(kept) == 3 * 6 + 3 + 2 * (4 * 3 + 3)
    _assert_ranges_and_scales_are_transformers(observed, ref, written)
    for name in kept:  # in the model's dtype, no scale
        assert written[f"{name}.weight"].dtype == torch.float32 and f"{name}.input_scale" not in written


@pytest.mark.heavy  # seven plans: ~12 s here
def test_v32_targets_vllm_and_llama_cpp_and_refuses_the_latent_kv_cache_and_unread_runtimes(v32: Path,
                                                                                           tmp_path: Path) -> None:
    """vLLM plans (FP8 W8A8, W4A16); the KV cache is refused as DeepSeek-V3's (MLA); llama.cpp plans its GGUF (the
    absorbed MLA form deepseek32 requires: tests/unit/test_gguf_moe.py, scored in
    tests/integration/test_gguf_moe_llamacpp.py); Ollama is refused as for every MoE family (not run in Ollama);
    SGLang and TGI, whose V3.2 indexers were not read, are refused naming that."""
    from llmc.formats.gguf import _arch
    from llmc.planning.plan import make_plan

    for quantization in (FP8_KV, W4A16_GPTQ):
        assert [t["exporter"] for t in make_plan(_recipe(v32, quantization), v32).targets] == ["compressed-tensors"]
    with pytest.raises(IncompatibleTargetError, match="multi-head latent attention caches the compressed latent") as no:
        make_plan(_recipe(v32, {**FP8_KV, "kv_cache": {"format": "fp8_e4m3"}}), v32)
    assert no.value.exit_code == 3
    # the tiny indexer (16 dims) is narrower than llama.cpp's 64-wide rotation of its q/k: refused; 64 plans
    with pytest.raises(IncompatibleTargetError, match="index_head_dim 16 is not a multiple of 64") as narrow:
        make_plan(_recipe(v32, W4A16_GPTQ, {"runtime": "llama.cpp"}), v32)
    assert narrow.value.exit_code == 3
    wide = make_tiny("deepseek_v32", tmp_path / "wide", num_hidden_layers=3, first_k_dense_replace=1,
                     index_head_dim=64)
    llama = make_plan(_recipe(wide, W4A16_GPTQ, {"runtime": "llama.cpp"}), wide)
    assert [(t["exporter"], t["status"]) for t in llama.targets] == [("gguf", "native")]
    with pytest.raises(IncompatibleTargetError, match="proven in llama.cpp only") as ollama:
        make_plan(_recipe(wide, W4A16_GPTQ, {"runtime": "ollama"}), wide)
    assert ollama.value.exit_code == 3
    arch = _arch(json.loads((wide / "config.json").read_text()))
    assert (arch.arch_name, arch.n_head_kv) == ("deepseek32", 1)  # the absorbed form: one latent KV head
    for runtime in ("sglang", "tgi"):
        with pytest.raises(IncompatibleTargetError, match="sparse-attention indexer was not checked"):
            make_plan(_recipe(v32, W4A16_GPTQ, {"runtime": runtime}), v32)


def test_v32_is_planned_from_its_config_tensor_by_tensor_as_transformers_builds_it() -> None:
    """The config-only planner row (llmc.model.shape_rows deepseek_v32) at transformers' default (flagship) widths,
    4 layers (3 dense, 1 MoE): every tensor of transformers' own model of that config, by name and shape (its fused
    experts split per expert under the Hub names), the indexer's included."""
    from dataclasses import replace

    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.model.families import LAYOUTS
    from llmc.planning.shapes import from_config

    kwargs = {"num_hidden_layers": 4, "vocab_size": 128, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    config = AutoConfig.for_model("deepseek_v32", **kwargs)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    theirs = moe.per_expert_shapes({n: tuple(t.shape) for n, t in built.state_dict().items()},
                                   replace(LAYOUTS["deepseek_v32"], checkpoint_fused=True))
    planned = from_config(config.to_dict()).shapes
    assert planned == theirs
    assert planned["model.layers.3.self_attn.indexer.wq_b.weight"] == (64 * 128, 1536)
    assert planned["model.layers.3.self_attn.indexer.k_norm.bias"] == (128,)


@pytest.mark.heavy  # ~9 s here
def test_v32_smoothing_pairs_take_the_indexer_with_the_norms_it_reads(v32: Path) -> None:
    """What discovery traces in a DeepSeek-V3.2 layer: input_layernorm feeds the indexer's kept wk / weights_proj
    beside q_a_proj and kv_a_proj_with_mqa (scaled with them, so the layer's function holds); q_a_layernorm feeds
    q_b_proj and the indexer's wq_b, scored by AWQ at q_b_proj (self_attn's own input is the hidden state, not
    theirs)."""
    from llmc.quant.algorithms import mappings

    model = _float_model(v32).double()
    layer = model.model.layers[0]
    x = torch.randn(1, 16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    position = torch.arange(16)[None]
    rotary = model.model.rotary_emb(x, position)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None]  # the causal mask the model gives the indexer

    def run():
        return layer(x, attention_mask=mask, position_ids=position, position_embeddings=rotary)

    found = {m.producer: m for m in mappings.discover(layer, lambda: (x, run()))}
    attention = found["input_layernorm"]
    assert set(attention.consumers) == {f"self_attn.{p}" for p in ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk",
                                                                   "indexer.weights_proj")}
    latent = found["self_attn.q_a_layernorm"]
    assert (latent.consumers, latent.parent) == (("self_attn.q_b_proj", "self_attn.indexer.wq_b"), "self_attn.q_b_proj")
