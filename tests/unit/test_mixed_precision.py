"""Mixed precision (issue 34): module groups with their own schemes in one model — the recipe's groups, their
resolution by name / regex / role / layer, one calibration pass writing each Linear in its group's scheme, the
canonical form recording it, and the exports and engine that read it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from llmc.errors import RecipeError
from llmc.quant import groups
from llmc.recipe.schema import SCHEME_SETTINGS, QuantizationSection
from llmc.quant.spec import SCHEMES

# the recipe's common deployment: attention FP8, MLP NVFP4, first and last decoder layer left in the model's dtype
MIXED = {"groups": [
    {"name": "edges", "layers": ["first 1", "last 1"], "ignore": True},
    {"name": "attention", "roles": ["attention"], "exclude_layers": ["first 1", "last 1"], "scheme": "W8A8-FP8"},
    {"name": "mlp", "roles": ["mlp"], "exclude_layers": ["first 1", "last 1"], "scheme": "W4A16-NVFP4"},
]}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def _names(layers: int = 4, proj=PROJ) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(layers) for p in proj]


def _scheme(q: dict):
    return QuantizationSection.model_validate(q).to_scheme()


def test_scheme_settings_name_every_scheme() -> None:
    assert set(SCHEME_SETTINGS) == set(SCHEMES.values())
    for name in SCHEME_SETTINGS:  # each spelled-out scheme is the scheme its name says
        s = _scheme({"groups": [{"name": "all", "layers": ["0-99"], "scheme": name}]})
        assert s.members()["all"].name == name


def test_groups_resolve_by_role_and_layers() -> None:
    scheme = _scheme(MIXED)
    got = groups.resolve(scheme, _names(), 4, "llama")
    for name, group in got.items():
        layer = groups.site_of(name)[0]
        expected = None if layer in (0, 3) else ("attention" if ".self_attn." in name else "mlp")
        assert group == expected, name
    assert scheme.name == "MIXED-W4A16-NVFP4+W8A8-FP8"
    assert scheme.members()["attention"].name == "W8A8-FP8" and scheme.needs_calibration  # static FP8 activations


def test_groups_resolve_by_name_regex_and_explicit_layers() -> None:
    scheme = _scheme({"groups": [
        {"name": "down", "names": ["re:.*\\.down_proj$"], "layers": [1, "2-3"], "scheme": "W8A16-INT8"},
        {"name": "o", "names": ["o_proj"], "scheme": "W8A8-FP8"},
        {"name": "rest", "layers": ["0-3"], "names": ["re:.*_proj$"], "exclude_layers": [], "ignore": True},
    ]})
    with pytest.raises(RecipeError) as e:  # `rest` overlaps both
        groups.resolve(scheme, _names(), 4, "llama")
    assert "groups down and rest both select model.layers.1.mlp.down_proj" in e.value.message
    assert "groups o and rest both select model.layers.0.self_attn.o_proj" in e.value.message
    ok = _scheme({"groups": [
        {"name": "down", "names": ["re:.*\\.down_proj$"], "layers": [1, "2-3"], "scheme": "W8A16-INT8"},
        {"name": "o", "names": ["o_proj"], "scheme": "W8A8-FP8"},
        {"name": "rest", "names": ["re:.*(q|k|v|gate|up)_proj$"], "ignore": True},
        {"name": "down0", "names": ["down_proj"], "layers": [0], "ignore": True},
    ]})
    got = groups.resolve(ok, _names(), 4, "llama")
    assert got["model.layers.2.mlp.down_proj"] == "down" and got["model.layers.0.mlp.down_proj"] is None
    assert got["model.layers.3.self_attn.o_proj"] == "o" and got["model.layers.3.mlp.up_proj"] is None


def test_unmatched_linear_is_named() -> None:
    scheme = _scheme({"groups": [{"name": "attention", "roles": ["attention"], "scheme": "W8A8-FP8"}]})
    with pytest.raises(RecipeError) as e:
        groups.resolve(scheme, _names(2), 2, "llama")
    assert "no group selects model.layers.0.mlp.gate_proj" in e.value.message and "(role mlp)" in e.value.message
    assert e.value.fix and "ignore: true" in e.value.fix
    # quantization.ignore leaves a Linear out explicitly
    ignored = _scheme({"groups": [{"name": "attention", "roles": ["attention"], "scheme": "W8A8-FP8"}],
                       "ignore": ["lm_head", "re:.*\\.mlp\\..*"]})
    assert set(groups.resolve(ignored, _names(2), 2, "llama").values()) == {"attention", None}


def test_roles_come_from_the_family_table() -> None:
    from llmc.model.families import linear_role

    assert linear_role("phi3", "self_attn.qkv_proj") == "attention"
    assert linear_role("phi3", "mlp.gate_up_proj") == "mlp"
    assert linear_role("qwen3_moe", "mlp.experts.7.down_proj") == "experts"
    assert linear_role("qwen3_moe", "mlp.gate") == "router"
    assert linear_role("qwen3_moe", "mlp.up_proj") == "mlp"  # a dense layer (mlp_only_layers)
    assert linear_role("mixtral", "block_sparse_moe.experts.0.w1") == "experts"
    assert linear_role("qwen2_moe", "mlp.shared_expert.up_proj") == "shared_experts"
    assert linear_role("qwen2_moe", "mlp.shared_expert_gate") == "router"


@pytest.mark.parametrize("group, message", [
    ({"name": "a", "roles": ["attention"]}, "gives no scheme"),
    ({"name": "a", "roles": ["attention"], "scheme": "W8A8-FP8", "ignore": True}, "gives scheme and ignore"),
    ({"name": "a", "scheme": "W8A8-FP8"}, "selects nothing in particular"),
    ({"name": "a", "roles": ["attention"], "layers": ["first two"], "scheme": "W8A8-FP8"}, "is not 'first N'"),
    ({"name": "a", "roles": ["attention"], "layers": ["5-2"], "scheme": "W8A8-FP8"}, "is not 'first N'"),
    ({"name": "a", "roles": ["ffn"], "scheme": "W8A8-FP8"}, "roles"),
    ({"name": "a", "roles": ["mlp"], "weights": {"format": "int4", "strategy": "group", "group_size": 128},
      "activations": {"format": "int8", "strategy": "token", "dynamic": True}}, "is not a scheme any runtime"),
])
def test_group_validation_errors(group: dict, message: str) -> None:
    from llmc.recipe.load import parse_recipe

    recipe = {"version": 1, "name": "x", "model": {"source": "demo:smollm2-135m"},
              "quantization": {"groups": [group]}, "targets": [{"runtime": "vllm"}]}
    import yaml

    with pytest.raises(RecipeError) as e:
        parse_recipe(yaml.safe_dump(recipe))
    assert message in str(e.value)


def test_mixed_refuses_what_its_quantizer_cannot_do() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="mixed-precision groups are quantized by rtn"):
        _scheme({**MIXED, "algorithm": "smoothquant"})
    with pytest.raises(ValidationError, match="true_sequential: false"):
        _scheme({**MIXED, "algorithm": "gptq"})
    int4 = {"groups": [{"name": "m", "roles": ["mlp"], "scheme": "W4A16-INT"},
                       {"name": "a", "roles": ["attention"], "scheme": "W8A8-FP8"}],
            "algorithm": "gptq", "options": {"true_sequential": False}}
    assert _scheme(int4).members()["m"].algorithm == "gptq"
    # GPTQ quantizes NVFP4 groups with the format's own block scales (llmc.quant.algorithms.gptq)
    gptq_nvfp4 = _scheme({**MIXED, "algorithm": "gptq", "options": {"true_sequential": False}})
    assert gptq_nvfp4.members()["mlp"].algorithm == "gptq"
    # a group whose scheme the quantizer cannot quantize: GPTQ and block-wise FP8
    block = {"groups": [{"name": "m", "roles": ["mlp"], "scheme": "W8A8-FP8-BLOCK"},
                        {"name": "a", "roles": ["attention"], "scheme": "W8A8-FP8"}],
             "algorithm": "gptq", "options": {"true_sequential": False}}
    with pytest.raises(ValidationError, match=r"group m \(W8A8-FP8-BLOCK\): gptq does not quantize block-wise FP8"):
        _scheme(block)
    with pytest.raises(ValidationError, match="groups and also weights"):
        _scheme({**MIXED, "weights": {"format": "int8", "strategy": "channel"}})


def test_plain_schemes_keep_their_dumps() -> None:
    q = QuantizationSection.model_validate({"weights": {"format": "int8", "strategy": "channel"}})
    assert "groups" not in q.model_dump(mode="json") and "groups" not in q.to_scheme().to_dict()


@pytest.fixture(scope="module")
def mixed_build(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer tiny Llama quantized with MIXED in one calibration pass: (model folder, canonical folder)."""
    from tests.conftest import make_tiny_model
    import llmc.quant.stream as stream
    from llmc.model.source import ModelSource

    root = tmp_path_factory.mktemp("mixed")
    folder = make_tiny_model(root / "model", layers=4)
    calib = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    stream.quantize_model(ModelSource(folder, "t", "t"), _scheme(MIXED), root / "q", stream.Calibration(calib))
    return folder, root / "q"


def test_canonical_form_records_each_modules_scheme(mixed_build) -> None:
    from safetensors.torch import load_file

    from llmc.quant.canonical import QuantizedModel

    folder, out = mixed_build
    qm = QuantizedModel.open(out)
    assert qm.scheme == _scheme(MIXED)  # the groups round-trip through quantized.json
    modules = qm.quantized_modules
    assert {n for n in modules if ".layers.0." in n or ".layers.3." in n} == set()  # edges: not quantized
    assert sorted(qm.modules_by_group()) == ["attention", "mlp"]
    layer1 = load_file(out / "layers" / "00001.safetensors")
    assert qm.scheme_of("model.layers.1.self_attn.q_proj").name == "W8A8-FP8"
    assert layer1["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.self_attn.q_proj.input_scale" in layer1  # calibrated static FP8 activation scale
    assert qm.scheme_of("model.layers.1.mlp.up_proj").name == "W4A16-NVFP4"
    assert layer1["model.layers.1.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.up_proj.input_scale" not in layer1
    edge = load_file(out / "layers" / "00000.safetensors")
    source = load_file(folder / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(edge[name], source[name])  # unquantized, as the source holds it
    # dequantized weights are near the source's
    w = qm.dequantized_weight(layer1, "model.layers.1.mlp.up_proj")
    ref = source["model.layers.1.mlp.up_proj.weight"]
    assert (w - ref).abs().max() < 0.25 * ref.abs().max()


@pytest.fixture(scope="module")
def mixed_artifact(mixed_build, tmp_path_factory) -> Path:
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.quant.canonical import QuantizedModel

    out = tmp_path_factory.mktemp("ct") / "artifact"
    export_compressed_tensors(QuantizedModel.open(mixed_build[1]), out)
    return out


def test_compressed_tensors_config_matches_every_linear_by_its_own_code(mixed_build, mixed_artifact) -> None:
    """compressed-tensors' apply_quantization_config (its own target matching) gives every Linear of the model the
    scheme llmc quantized it with, and none to the Linears left unquantized."""
    import json

    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.quant.canonical import QuantizedModel

    qcfg = json.loads((mixed_artifact / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "mixed-precision"
    assert {g["format"] for g in qcfg["config_groups"].values()} == {"float-quantized", "nvfp4-pack-quantized"}
    config = QuantizationConfig.model_validate(qcfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(mixed_build[0]))
    apply_quantization_config(model, config)
    qm = QuantizedModel.open(mixed_build[1])
    seen = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        got = getattr(module, "quantization_scheme", None)
        if name not in qm.quantized_modules:
            assert got is None, name  # edges and lm_head: unquantized
            continue
        want = qm.scheme_of(name)
        assert got is not None, name
        assert (got.weights.num_bits, got.weights.type, got.weights.group_size) == (
            want.weights.bits, "float", want.weights.group_size), name
        assert (got.input_activations is None) == (want.activations is None), name
        seen += 1
    assert seen == len(qm.quantized_modules) == 2 * 7


def test_exact_targets_generalize_expert_indices_only_when_exact() -> None:
    import re

    from llmc.formats.compressed_tensors import exact_targets

    universe = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(3) for e in range(4) for p in ("w1", "w2")}
    chosen = sorted(n for n in universe if ".layers.2." not in n and not n.endswith("experts.3.w2"))
    targets = exact_targets(chosen, universe)
    assert any("\\d+" in t for t in targets)  # experts' w1: every index
    matched = {n for n in universe if any(re.match(t[3:], n) for t in targets)}
    assert matched == set(chosen)


def test_torch_engine_loads_a_mixed_artifact(mixed_build, mixed_artifact) -> None:
    """The engine decodes each Linear to exactly the canonical form's weights, and quantizes the FP8 group's inputs
    (static scales) but not the NVFP4 group's (weight-only)."""
    from safetensors.torch import load_file

    from llmc.engines.torch_ref import TorchEngine
    from llmc.quant.canonical import QuantizedModel

    qm = QuantizedModel.open(mixed_build[1])
    engine = TorchEngine(mixed_artifact, streamed=False)
    model = engine.model
    layer1 = load_file(mixed_build[1] / "layers" / "00001.safetensors")
    params = dict(model.named_parameters())
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
        assert torch.equal(params[f"{name}.weight"].float(), qm.dequantized_weight(layer1, name).float()), name
    edge = load_file(mixed_build[0] / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(params["model.layers.0.mlp.up_proj.weight"], edge)
    hooked = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m._forward_pre_hooks}
    assert hooked == {n for n in qm.quantized_modules if ".self_attn." in n}
    nll = engine.token_nll(torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(1)))
    assert torch.isfinite(nll).all()


def _recipe(quant: dict, *targets: dict, source: str = "demo:smollm2-135m", **extra):
    import yaml

    from llmc.recipe.load import parse_recipe

    return parse_recipe(yaml.safe_dump({"name": "m", "model": {"source": source}, "quantization": quant,
                                        "targets": list(targets), **extra}))


def test_plan_shows_each_groups_bytes(mixed_build) -> None:
    from llmc.planning.plan import make_plan

    folder = mixed_build[0]
    plan = make_plan(_recipe(MIXED, {"runtime": "vllm", "gpu_arch": "sm100"}, source=str(folder)), folder,
                     refuse=False)
    rows = {g["group"]: g for g in plan.groups[""]}
    attn, mlp = 2 * (64 * 64 * 2 + 32 * 64 * 2), 2 * 3 * 64 * 128  # layers 1-2; q, o [64, 64], k, v [32, 64]
    assert rows["attention"] == {"group": "attention", "quantized": True, "scheme": "W8A8-FP8", "linears": 8,
                                 "params": attn, "bytes": attn * 1.0}
    assert rows["mlp"]["scheme"] == "W4A16-NVFP4" and rows["mlp"]["bytes"] == mlp * 4.5 / 8
    assert rows["edges"]["scheme"] == "unquantized" and rows["edges"]["linears"] == 14
    assert rows["edges"]["bytes"] == rows["edges"]["params"] * 4  # float32 model
    text = plan.render()
    assert "mixed precision" in text and "W4A16-NVFP4" in text and plan.scheme.name in text
    # the stage column is as wide as its longest name: never cut
    assert re.search(rf"quantize {re.escape(plan.scheme.name)} +cpu ", text)
    assert plan.seconds > 0 and plan.peak_memory_gb > 0  # memory / time still planned


def test_plan_names_linears_no_group_selects(mixed_build) -> None:
    from llmc.planning.plan import make_plan

    folder = mixed_build[0]
    partial = {"groups": MIXED["groups"][1:]}  # no edges group: layers 0 and 3 in none
    with pytest.raises(RecipeError, match="no group selects model.layers.0"):
        make_plan(_recipe(partial, {"runtime": "vllm", "gpu_arch": "sm100"}, source=str(folder)), folder,
                  refuse=False)


def test_a_format_that_cannot_express_mixed_schemes_refuses_at_plan_time() -> None:
    from llmc.errors import IncompatibleTargetError
    from llmc.planning.plan import make_plan

    int8 = {"groups": [{"name": "a", "roles": ["attention"], "scheme": "W8A8-INT8"},
                       {"name": "m", "roles": ["mlp"], "scheme": "W8A16-INT8"}]}
    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(_recipe(int8, {"runtime": "onnxruntime", "gpu_arch": "cpu"}))
    assert "the onnx format holds one scheme for every quantized Linear" in e.value.message
    assert "W8A16-INT8, W8A8-INT8" in e.value.message and "compressed-tensors" in e.value.fix
    # a runtime must run every group's scheme: TGI has no NVFP4
    with pytest.raises(IncompatibleTargetError, match="tgi does not run W4A16-NVFP4"):
        make_plan(_recipe(MIXED, {"runtime": "tgi", "gpu_arch": "sm90"}))
    make_plan(_recipe(MIXED, {"runtime": "vllm", "gpu_arch": "sm100"}))  # vLLM runs both


def test_a_group_that_selects_nothing_is_named_in_a_warning(mixed_build) -> None:
    from llmc.planning.plan import make_plan

    folder = mixed_build[0]
    quant = {"groups": [*MIXED["groups"], {"name": "experts", "roles": ["experts"], "scheme": "W4A16-NVFP4"}]}
    plan = make_plan(_recipe(quant, {"runtime": "vllm", "gpu_arch": "sm100"}, source=str(folder)), folder,
                     refuse=False)
    assert "quantization.groups experts select no Linear of this model (roles experts)" in plan.warnings


def test_moe_experts_and_attention_in_their_own_groups(tmp_path: Path) -> None:
    """Qwen3-MoE: experts (per-expert Linears under the Hub names) NVFP4, attention FP8, first layer unquantized;
    the router is no Linear and stays as it is. compressed-tensors' own matching agrees per Linear."""
    import json

    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM

    import llmc.quant.stream as stream
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from tests.unit.families import make_tiny

    folder = make_tiny("qwen3_moe", tmp_path / "moe", num_hidden_layers=3)
    scheme = _scheme({"groups": [
        {"name": "edges", "layers": ["first 1"], "ignore": True},
        {"name": "experts", "roles": ["experts"], "exclude_layers": ["first 1"], "scheme": "W4A16-NVFP4"},
        {"name": "attention", "roles": ["attention", "shared_experts"], "exclude_layers": ["first 1"],
         "scheme": "W8A8-FP8"},
    ]})
    calib = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, tmp_path / "q", stream.Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "q")
    groups_ = qm.modules_by_group()
    assert len(groups_["experts"]) == 2 * 4 * 3 and len(groups_["attention"]) == 2 * 4
    assert all(".mlp.experts." in n for n in groups_["experts"])
    export_compressed_tensors(qm, tmp_path / "ct")
    qcfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert any("\\d+" in t for t in qcfg["config_groups"]["experts"]["targets"])  # every expert: one pattern
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    from llmc.quant.moe import unfuse_experts

    unfuse_experts(model)  # per-expert Linears under the Hub names, as vLLM's loaders name them
    apply_quantization_config(model, QuantizationConfig.model_validate(qcfg))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            got = getattr(module, "quantization_scheme", None)
            if name in qm.quantized_modules:
                assert got is not None and got.weights.num_bits == qm.scheme_of(name).weights.bits, name
            else:
                assert got is None, name


def test_modelopt_writes_per_layer_quant_config(tmp_path: Path) -> None:
    """ModelOpt's MIXED_PRECISION: quantized_layers names each quantized Linear's quant_algo (as ModelOpt's
    process_layer_quant_config writes it), the tensors follow each layer's layout and decode to the canonical
    weights; Linears left unquantized are in no entry and stored as they were."""
    import json

    from safetensors.torch import load_file

    import llmc.quant.stream as stream
    from llmc.formats.modelopt_hf import HF_QUANT_CONFIG, export_modelopt_hf, unpack_int4_rows
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "model", layers=3)
    scheme = _scheme({"groups": [
        {"name": "edges", "layers": ["last 1"], "ignore": True},
        {"name": "attention", "roles": ["attention"], "exclude_layers": ["last 1"], "scheme": "W8A8-FP8"},
        {"name": "mlp", "roles": ["mlp"], "exclude_layers": ["last 1"],
         "weights": {"format": "int4", "strategy": "group", "group_size": 32}},
    ]})
    calib = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, tmp_path / "q", stream.Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "q")
    out = tmp_path / "modelopt"
    export_modelopt_hf(qm, out)
    hq = json.loads((out / HF_QUANT_CONFIG).read_text())["quantization"]
    assert hq["quant_algo"] == "MIXED_PRECISION" and "exclude_modules" not in hq
    layers = hq["quantized_layers"]
    assert set(layers) == set(qm.quantized_modules)
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers["model.layers.1.mlp.down_proj"] == {"quant_algo": "W4A16_AWQ", "group_size": 32,
                                                      "has_zero_point": False, "pre_quant_scale": True}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_algo"] == "MIXED_PRECISION" and config["quantized_layers"] == layers
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    q = "model.layers.0.self_attn.q_proj"
    assert written[f"{q}.weight"].dtype == torch.float8_e4m3fn and written[f"{q}.weight_scale"].dim() == 0
    assert torch.equal(written[f"{q}.weight"].float() * written[f"{q}.weight_scale"],
                       qm.dequantized_weight(canonical, q).float())
    d = "model.layers.1.mlp.down_proj"
    codes = unpack_int4_rows(written[f"{d}.weight"]).float()
    scale = written[f"{d}.weight_scale"].repeat_interleave(32, dim=1)
    assert torch.equal(codes * scale, qm.dequantized_weight(canonical, d).float())
    edge = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(written[edge], load_file(folder / "model.safetensors")[edge])
    from llmc.runtimes import catalog

    text = catalog.artifact_format("modelopt-hf").describe(out)
    assert "quant_algo MIXED_PRECISION" in text and "8 FP8" in text and "6 W4A16_AWQ" in text


def test_modelopt_refuses_a_group_scheme_tensorrt_llm_cannot_load(tmp_path: Path) -> None:
    from llmc.errors import IncompatibleTargetError
    from llmc.planning.plan import make_plan
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "model", hidden=128, intermediate=256)  # widths block FP8's groups divide

    attention = {"name": "a", "roles": ["attention"], "scheme": "W8A8-FP8"}
    # weight-only NVFP4: ModelOpt's W4A16_NVFP4 is no QuantAlgo of TensorRT-LLM's
    with pytest.raises(IncompatibleTargetError, match="does not run W4A16-NVFP4"):
        make_plan(_recipe({"groups": [attention, {"name": "m", "roles": ["mlp"], "scheme": "W4A16-NVFP4"}]},
                          {"runtime": "tensorrt-llm", "gpu_arch": "sm100"}))
    # block FP8: TensorRT-LLM translates ModelOpt's fp8_pb_wo only as the whole checkpoint's quant_algo
    with pytest.raises(IncompatibleTargetError, match="group m: .*fp8_pb_wo"):
        make_plan(_recipe({"groups": [attention, {"name": "m", "roles": ["mlp"], "scheme": "W8A8-FP8-BLOCK"}]},
                          {"runtime": "tensorrt-llm", "gpu_arch": "sm100"}, source=str(folder)))


def test_gguf_types_each_tensor_by_its_group(tmp_path: Path) -> None:
    """GGUF: attention W8A16-INT8 as Q8_0 and MLP W4A16-MXFP4 as MXFP4 in one file, the last layer F16, each
    decoded (gguf's own dequantizers) to the canonical weights up to Q8_0's fp16 scales; FP8 groups are refused."""
    from gguf import GGUFReader

    import llmc.quant.stream as stream
    from llmc.errors import IncompatibleTargetError
    from llmc.formats.gguf import export_gguf
    from llmc.model.source import ModelSource
    from llmc.planning.plan import make_plan
    from llmc.quant.canonical import QuantizedModel
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "model", layers=3)
    quant = {"groups": [
        {"name": "edges", "layers": ["last 1"], "ignore": True},
        {"name": "attention", "roles": ["attention"], "exclude_layers": ["last 1"], "scheme": "W8A16-INT8"},
        {"name": "mlp", "roles": ["mlp"], "exclude_layers": ["last 1"], "scheme": "W4A16-MXFP4"},
    ]}
    make_plan(_recipe(quant, {"runtime": "llama.cpp", "gpu_arch": "cpu"}))  # llama.cpp runs both
    stream.quantize_model(ModelSource(folder, "t", "t"), _scheme(quant), tmp_path / "q", None)
    result = export_gguf(QuantizedModel.open(tmp_path / "q"), tmp_path / "gguf")
    types = {t.name: t.tensor_type.name for t in GGUFReader(result.path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.1.attn_output.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "MXFP4" and types["blk.1.ffn_up.weight"] == "MXFP4"
    assert types["blk.2.attn_q.weight"] == "F16" and types["blk.2.ffn_down.weight"] == "F16"
    assert result.weight_error["relative_rms"] < 1e-3  # Q8_0's fp16 block scales; MXFP4 exact
    fp8 = {"groups": [{"name": "a", "roles": ["attention"], "scheme": "W8A8-FP8"},
                      {"name": "m", "roles": ["mlp"], "scheme": "W4A16-MXFP4"}]}
    with pytest.raises(IncompatibleTargetError, match="llama.cpp does not run W8A8-FP8"):
        make_plan(_recipe(fp8, {"runtime": "llama.cpp", "gpu_arch": "cpu"}))


def test_inspect_describes_each_config_group(mixed_artifact) -> None:
    from llmc.runtimes import catalog

    text = catalog.artifact_format("compressed-tensors").describe(mixed_artifact)
    assert "mixed precision: format mixed-precision, 2 config groups" in text
    assert "group attention: format float-quantized" in text and "group mlp: format nvfp4-pack-quantized" in text


@pytest.mark.heavy  # probes at the 30B's widths and schemes: 12 s of CPU on the 2-core EPYC
def test_qwen3_moe_mixed_recipe_plans_every_group_from_the_config(tmp_path: Path) -> None:
    from llmc.planning.plan import plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    path = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-30b-a3b-mixed-nvfp4.yaml"
    plan = plan_recipe(load_recipe(path), Store(tmp_path / "cache"), path)
    rows = {g["group"]: g for g in plan.groups[""]}
    assert not any("select no Linear" in w for w in plan.warnings)  # every group selects some
    layers, experts = 48, 128
    assert rows["experts"]["linears"] == (layers - 2) * experts * 3 and rows["experts"]["scheme"] == "W4A4-NVFP4"
    assert rows["router"]["linears"] == layers - 2 and rows["router"]["scheme"] == "unquantized"
    assert rows["attention-shared"]["linears"] == (layers - 2) * 4  # no shared experts, no dense MLP in this model
    assert rows["edges"]["linears"] == 2 * (4 + 1 + experts * 3)


def test_inspect_and_default_gates_of_a_mixed_canonical_form(mixed_build) -> None:
    from llmc.eval.gates import scheme_family
    from llmc.publish.inspect import _describe_folder

    text = _describe_folder(mixed_build[1])
    assert "group edges (layers first 1, last 1): unquantized" in text
    assert "group mlp (roles mlp; except layers first 1, last 1): W4A16-NVFP4, 6 Linears" in text
    assert scheme_family(_scheme(MIXED)) == "4-bit"  # its NVFP4 group's defaults
    fp8_int8 = {"groups": [{"name": "a", "roles": ["attention"], "scheme": "W8A8-FP8"},
                           {"name": "m", "roles": ["mlp"], "scheme": "W8A16-INT8"}]}
    assert scheme_family(_scheme(fp8_int8)) == "8-bit"


def test_groups_that_split_a_fused_gemm_are_refused_for_runtimes_that_fuse(mixed_build) -> None:
    from llmc.errors import IncompatibleTargetError
    from llmc.planning.plan import make_plan

    folder = mixed_build[0]
    split = {"groups": [{"name": "q", "names": ["q_proj"], "scheme": "W8A8-FP8"},
                        {"name": "rest", "names": ["re:.*(k|v|o|gate|up|down)_proj$"], "scheme": "W8A16-FP8"}]}
    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(_recipe(split, {"runtime": "vllm", "gpu_arch": "sm90"}, source=str(folder)), folder, refuse=False)
    assert "model.layers.0.self_attn.q_proj (q), model.layers.0.self_attn.k_proj (rest)" in e.value.message
    assert "3 more such sets" in e.value.message and "q/k/v" in e.value.fix


@pytest.mark.heavy
def test_llmc_build_of_a_mixed_recipe_end_to_end(tmp_path: Path) -> None:
    """plan -> one calibration -> quantize -> compressed-tensors export -> torch evaluation -> gates -> publish."""
    import yaml

    from llmc.build import build
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store
    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "model", layers=4)
    recipe = parse_recipe(yaml.safe_dump({
        "name": "tiny-mixed", "model": {"source": str(model)}, "quantization": MIXED,
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm100"}],
        "eval": {"seq_len": 64, "windows": 6, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 200},
        "gates": {"max_ppl_increase_pct": 50.0},
        "publish": {"registry": str(tmp_path / "registry")},
    }))
    result = build(recipe, Store(tmp_path / "cache"))
    assert result.passed and result.published is not None
    [artifact] = result.artifacts.values()
    assert artifact.scheme == "MIXED-W4A16-NVFP4+W8A8-FP8"
    assert [g["name"] for g in artifact.scheme_detail["groups"]] == ["edges", "attention", "mlp"]
