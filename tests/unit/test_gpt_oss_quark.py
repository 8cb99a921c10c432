"""gpt-oss quantized to FP8 W8A8 for vLLM in AMD Quark's layout (issue 45): llmc.formats.gpt_oss_quark writes what
vLLM's gpt-oss loader reads with `quant_method: quark` (per-expert `gate_up_proj` with gate/up rows interleaved and
one scale, `down_proj`, 0-dim per-tensor scales, biases), the vllm runtime offers it for gpt_oss for the FP8 layouts
QuarkW8A8Fp8MoEMethod loads on sm89+, and refuses the rest at plan time (exit 3) naming what it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmc.errors import IncompatibleTargetError
from llmc.planning.plan import make_plan
from llmc.recipe.load import parse_recipe
from tests.unit.families import make_tiny

# FP8 layouts (quantization sections) the format takes: per-tensor weights with static per-tensor activations,
# attention FP8 too; per-channel weights with dynamic per-token activations, attention left in float
STATIC = {"weights": {"format": "fp8_e4m3", "strategy": "tensor"},
          "activations": {"format": "fp8_e4m3", "strategy": "tensor"}, "ignore": ["lm_head"]}
DYNAMIC = {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
           "activations": {"format": "fp8_e4m3", "strategy": "token", "dynamic": True},
           "ignore": ["lm_head", "re:.*self_attn.*"]}
FP8_E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return make_tiny("gpt_oss", tmp_path_factory.mktemp("gpt_oss_quark") / "model")


def _recipe(folder: Path, quantization: dict, **target):
    return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)},
                                        "targets": [{"runtime": "vllm", "gpu_arch": "sm90", **target}],
                                        "quantization": quantization}))


@pytest.mark.parametrize("quantization", [STATIC, DYNAMIC,
                                          {**STATIC, "activations": {**STATIC["activations"], "dynamic": True},
                                           "ignore": DYNAMIC["ignore"]}])
def test_fp8_gpt_oss_plans_for_vllm_in_quarks_layout(gpt_oss: Path, quantization: dict) -> None:
    plan = make_plan(_recipe(gpt_oss, quantization), gpt_oss)
    assert [t["exporter"] for t in plan.targets] == ["gpt-oss-quark-fp8"]


@pytest.mark.parametrize("case, quantization, target, match", [
    ("FP8 weight-only", {"weights": {"format": "fp8_e4m3", "strategy": "channel"}, "ignore": ["lm_head"]}, {},
     "not FP8 W8A8"),
    ("per-channel weights, static per-tensor activations",
     {**STATIC, "weights": {"format": "fp8_e4m3", "strategy": "channel"}}, {},
     "does not load channel weights with static tensor activations"),
    ("INT8 W8A8", {"weights": {"format": "int8", "strategy": "channel"},
                   "activations": {"format": "int8", "strategy": "token", "dynamic": True}, "ignore": ["lm_head"]}, {},
     "not FP8 W8A8"),
    ("a KV cache", {**STATIC, "kv_cache": {"format": "fp8_e4m3"}}, {}, "KV cache"),
    ("lm_head quantized", {**STATIC, "ignore": []}, {}, "quantizes lm_head"),
    ("half the attention", {**STATIC, "ignore": ["lm_head", "re:.*self_attn.o_proj"]}, {}, "all of them FP8 or none"),
    ("attention with dynamic per-tensor activations",
     {**STATIC, "activations": {**STATIC["activations"], "dynamic": True}}, {}, "registers no input scale"),
    ("Ampere (Marlin asserts SILU)", STATIC, {"gpu_arch": "sm80"}, "sm89"),
    ("CPU (refused first by the runtime's FP8 rule)", STATIC, {"gpu_arch": "cpu"}, "no CPU support"),
])
def test_every_other_fp8_case_of_gpt_oss_is_refused_for_vllm(gpt_oss: Path, case: str, quantization: dict,
                                                              target: dict, match: str) -> None:
    with pytest.raises(IncompatibleTargetError, match=match) as refused:
        make_plan(_recipe(gpt_oss, quantization, **target), gpt_oss)
    assert refused.value.exit_code == 3, case


def test_a_scheme_neither_gpt_oss_layout_holds_is_refused_naming_both(gpt_oss: Path) -> None:
    """W4A16: neither OpenAI's MXFP4 pass-through nor Quark's FP8 layout: the message names both formats and the fix
    says what each takes."""
    quantization = {"weights": {"format": "int4", "strategy": "group", "group_size": 32}, "ignore": ["lm_head"]}
    with pytest.raises(IncompatibleTargetError, match="gpt-oss-mxfp4 or gpt-oss-quark-fp8") as refused:
        make_plan(_recipe(gpt_oss, quantization), gpt_oss)
    assert refused.value.exit_code == 3
    assert "mxfp4" in refused.value.fix and "fp8_e4m3" in refused.value.fix


# --------------------------------------------------------------------------- the files, as vLLM's loader reads them

def _quantized(folder: Path, quantization: dict, out: Path):
    from llmc.model.source import ModelSource
    from llmc.quant import stream
    from llmc.quant.canonical import QuantizedModel
    from tests.unit.test_families import _ids

    scheme = _recipe(folder, quantization).quantization.to_scheme()
    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, out, stream.Calibration(_ids(4, 1), batch_size=2))
    return QuantizedModel.open(out)


def _vllm_param(name: str) -> tuple[str, int | None]:
    """What vLLM's gpt-oss quark loader makes of a checkpoint name (vllm/model_executor/models/gpt_oss.py,
    `GptOssForCausalLM.hf_to_vllm_mapper` and `GptOssModel._load_weights_quark`, read at 004b19d and in the search
    index's copies, written out here): the mapper's suffixes, then a name with two numbers is expert `ids[-1]` of the
    fused parameter named without it. Returns (parameter name, expert id or None)."""
    suffixes = {".gate_up_proj.weight": ".w13_weight", ".gate_up_proj.weight_scale": ".w13_weight_scale",
                ".gate_up_proj.bias": ".w13_bias", ".gate_up_proj.input_scale": ".w13_input_scale",
                ".down_proj.weight": ".w2_weight", ".down_proj.weight_scale": ".w2_weight_scale",
                ".down_proj.bias": ".w2_bias", ".down_proj.input_scale": ".w2_input_scale"}
    name = name.replace(".self_attn.", ".attn.")
    for old, new in suffixes.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
            break
    if "experts" not in name:
        return name, None
    parts = name.split(".")
    ids = [p for p in parts if p.isdigit()]
    assert len(ids) == 2, name  # one expert of one layer: the per-expert (amd-quark) branch
    parts.pop(len(parts) - 1 - parts[::-1].index(ids[-1]))
    return ".".join(parts), int(ids[-1])


@pytest.mark.parametrize("quantization", [STATIC, DYNAMIC], ids=["tensor-static", "channel-token-dynamic"])
def test_the_files_hold_the_names_shapes_and_dtypes_vllms_quark_loader_reads(gpt_oss: Path, tmp_path: Path,
                                                                             quantization: dict) -> None:
    """Every expert tensor maps to a slot of QuarkW8A8Fp8MoEMethod's parameters for gpt_oss (quark_moe.py at 004b19d:
    w13_weight [E, 2I, H] fp8; per-tensor w13_weight_scale [E, 1] and w2_weight_scale [E], per-channel [E, 2I] and
    [E, H]; static input scales [E]; w13_bias [E, 2I], w2_bias [E, H]) with the shape of that expert's slice (an
    input scale 0-dim: the loader copies it into a 0-dim slot); no per-expert gate_proj / up_proj remain;
    config.json's quantization_config is one global FP8 scheme QuarkConfig matches, the unquantized Linears in
    `exclude`."""
    from llmc.formats.gpt_oss_quark import GptOssQuarkFp8, export_gpt_oss_quark

    static = quantization is STATIC
    qm = _quantized(gpt_oss, quantization, tmp_path / "q")
    export_gpt_oss_quark(qm, tmp_path / "export")
    assert GptOssQuarkFp8().recognizes(tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    E, H, I = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    slots = {"w13_weight": ((2 * I, H), torch.float8_e4m3fn), "w13_weight_scale": ((() if static else (2 * I,)),
                                                                                torch.float32),
             "w13_bias": ((2 * I,), None), "w2_weight": ((H, I), torch.float8_e4m3fn),
             "w2_weight_scale": ((() if static else (H,)), torch.float32), "w2_bias": ((H,), None)}
    if static:
        slots.update({"w13_input_scale": ((), torch.float32), "w2_input_scale": ((), torch.float32)})
    written = {k: v for f in (tmp_path / "export").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    seen: dict[tuple[str, int], set[str]] = {}
    for name, t in written.items():
        param, expert = _vllm_param(name)
        if expert is None:
            continue
        slot = param.rsplit(".", 1)[1]
        shape, dtype = slots[slot]
        assert tuple(t.shape) == shape and (dtype is None or t.dtype == dtype), (name, t.shape, t.dtype)
        seen.setdefault((param.rsplit(".", 1)[0], expert), set()).add(slot)
    assert len(seen) == config["num_hidden_layers"] * E and all(s == set(slots) for s in seen.values())
    assert not [n for n in written if n.endswith((".gate_proj.weight", ".up_proj.weight", "gate_up_proj_blocks"))]
    # attention FP8 (QuarkW8A8Fp8: per-tensor weight_scale and input_scale per shard) or float; router / sinks / head
    # float
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        a = f"model.layers.1.self_attn.{p}"
        assert written[f"{a}.weight"].dtype == (torch.float8_e4m3fn if static else torch.float32)
        assert [tuple(written[f"{a}.{k}"].shape) for k in ("weight_scale", "input_scale") if f"{a}.{k}" in written] \
            == ([(), ()] if static else [])
    assert written["model.layers.0.mlp.router.weight"].dtype == torch.float32
    assert "model.layers.0.self_attn.sinks" in written
    q = config["quantization_config"]
    w, a = q["global_quant_config"]["weight"], q["global_quant_config"]["input_tensors"]
    # QuarkConfig._is_fp8_w8a8 (quark.py at 006bce4), written out: fp8 weights static per-tensor / per-channel,
    # fp8 inputs, static ones per-tensor; QuarkW8A8Fp8MoEMethod: per-tensor weights with per-tensor inputs
    assert q["quant_method"] == "quark" and w["dtype"] == a["dtype"] == "fp8_e4m3" and not w["is_dynamic"]
    assert (w["qscheme"], a["qscheme"], a["is_dynamic"]) == (("per_tensor", "per_tensor", False) if static else
                                                              ("per_channel", "per_channel", True))
    assert q["export"]["kv_cache_group"] == [] and q["layer_quant_config"] == {} and q["layer_type_quant_config"] == {}
    assert {"lm_head", "model.layers.0.mlp.router"} <= set(q["exclude"])
    # attention: quantized, or every Linear named exactly (the checkpoint names; vLLM maps .self_attn. to .attn.)
    attention = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert {n for n in q["exclude"] if "self_attn" in n} == (set() if static else attention)


# --------------------------------------------------------------------------- decoded, it computes llmc's logits

def _fq(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize: with a static per-tensor scale, or per token from x's absmax (dynamic)."""
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _decode(export: Path, source: Path):
    """The Quark artifact read by this test alone: FP8 codes x scales (per-tensor 0-dim or per row), gate / up taken
    back from the even / odd rows of gate_up_proj, loaded into transformers' own GptOssForCausalLM (fused experts
    [E, H, 2I] transposed, gate at even columns as transformers reads them); the stored input scales (or per-token
    dynamic FP8) applied to the quantized Linears' inputs by hooks: attention Linears, each layer's experts' input (one
    w13 scale per layer: the max over the experts, as vLLM keeps) and their gated output (the w2 scale)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((export / "config.json").read_text())
    dynamic = config["quantization_config"]["global_quant_config"]["input_tensors"]["is_dynamic"]
    raw = {k: v for f in export.glob("*.safetensors") for k, v in load_file(str(f)).items()}

    def weight(p: str) -> torch.Tensor:
        codes, scale = raw[f"{p}.weight"].float(), raw[f"{p}.weight_scale"].float()
        return codes * (scale if scale.dim() == 0 else scale[:, None])

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    state = {k: v for k, v in raw.items() if ".experts." not in k and not k.endswith(("_scale", ".weight"))}
    state.update({k: v for k, v in raw.items() if k.endswith(".weight") and ".experts." not in k
                  and f"{k[:-len('.weight')]}.weight_scale" not in raw})
    for i, layer in enumerate(model.model.layers):
        experts, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
        with torch.no_grad():
            for e in range(experts.gate_up_proj.shape[0]):
                gate_up = weight(f"{p}.{e}.gate_up_proj")  # [2I, H]: gate row i at 2i, up row i at 2i + 1
                experts.gate_up_proj[e][:, 0::2] = gate_up[0::2].T
                experts.gate_up_proj[e][:, 1::2] = gate_up[1::2].T
                experts.gate_up_proj_bias[e] = raw[f"{p}.{e}.gate_up_proj.bias"]
                experts.down_proj[e] = weight(f"{p}.{e}.down_proj").T
                experts.down_proj_bias[e] = raw[f"{p}.{e}.down_proj.bias"]
        n = experts.gate_up_proj.shape[0]
        s13 = None if dynamic else torch.stack([raw[f"{p}.{e}.gate_up_proj.input_scale"] for e in range(n)]).max()
        s2 = None if dynamic else torch.stack([raw[f"{p}.{e}.down_proj.input_scale"] for e in range(n)]).max()
        experts.register_forward_pre_hook(lambda m, args, s=s13: (_fq(args[0], s), *args[1:]))
        gate = experts._apply_gate
        experts._apply_gate = lambda x, gate=gate, s=s2: _fq(gate(x), s)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            a = f"model.layers.{i}.self_attn.{name}"
            if f"{a}.weight_scale" in raw:
                state[f"{a}.weight"] = weight(a)
                s = raw.get(f"{a}.input_scale")
                getattr(layer.self_attn, name).register_forward_pre_hook(lambda m, args, s=s: (_fq(args[0], s),))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".experts." in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("quantization", [STATIC, DYNAMIC], ids=["tensor-static", "channel-token-dynamic"])
def test_the_artifact_decoded_in_transformers_gives_llmcs_logits(gpt_oss: Path, tmp_path: Path,
                                                                 quantization: dict) -> None:
    """The Quark files decoded by this test (`_decode`) and run by transformers' own GptOss forward give the logits of
    llmc's torch engine on the same canonical form (through its compressed-tensors export, the form llmc's gates
    score), within float tolerance; the experts' gate / up weights decoded from the interleaved rows equal the canonical
    form's dequantized gate / up exactly; and the quantization is visible."""
    from llmc.engines.torch_ref import TorchEngine
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.gpt_oss_quark import export_gpt_oss_quark
    from tests.unit.test_families import _ids

    qm = _quantized(gpt_oss, quantization, tmp_path / "q")
    export_gpt_oss_quark(qm, tmp_path / "quark")
    export_compressed_tensors(qm, tmp_path / "ct")
    model = _decode(tmp_path / "quark", gpt_oss)
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    experts = model.model.layers[1].mlp.experts
    for e in range(experts.gate_up_proj.shape[0]):
        for proj, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
            name = f"model.layers.1.mlp.experts.{e}.{proj}"
            assert torch.equal(experts.gate_up_proj[e][:, cols].T, qm.dequantized_weight(canonical, name).float())
    ids = _ids(2, 2)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        llmc_logits = TorchEngine(tmp_path / "ct", streamed=False).model(input_ids=ids, use_cache=False).logits
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (plain - base).abs().max().item() > 1e-3, "quantization must be visible"
    assert (plain - llmc_logits).abs().max().item() < 1e-4 * max(llmc_logits.abs().max().item(), 1.0)


def test_unequal_gate_and_up_scales_are_refused_not_requantized(gpt_oss: Path, tmp_path: Path) -> None:
    """The quantize stage gives an expert's gate and up one per-tensor scale (llmc.quant.runtime_scales); a canonical
    form where they differ is refused by the exporter (it would have to requantize codes llmc evaluated)."""
    from safetensors.torch import save_file

    from llmc.formats.gpt_oss_quark import export_gpt_oss_quark
    from llmc.quant.canonical import QuantizedModel

    qm = _quantized(gpt_oss, STATIC, tmp_path / "q")
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    for f in qm.files():
        t = load_file(str(f))
        if name in t:
            t[name] = t[name] * 2
            save_file(t, str(f))
    with pytest.raises(IncompatibleTargetError, match="different per-tensor FP8 scales"):
        export_gpt_oss_quark(QuantizedModel.open(tmp_path / "q"), tmp_path / "export")


@pytest.mark.slow  # a whole build on the shared 2-core machine
def test_llmc_build_of_fp8_gpt_oss_for_vllm_sm90_writes_quarks_layout(gpt_oss: Path, tmp_path: Path) -> None:
    """`llmc build` for a vllm sm90 target of the tiny gpt-oss with FP8 static per-tensor W8A8: the export stage is
    gpt-oss-quark-fp8 and writes the per-expert fused layout; no engine here reads it, so its gates are left
    unevaluated (allow_unevaluated)."""
    from llmc.build import build
    from llmc.storage.store import Store
    from tests.unit.test_build import recipe_text

    overrides = {"quantization": STATIC, "eval.runtimes": ["torch"], "gates.allow_unevaluated": True}
    result = build(parse_recipe(recipe_text(gpt_oss, tmp_path / "registry", **overrides)), Store(tmp_path / "cache"),
                   publish=False)
    assert result.passed
    (artifact,) = result.artifacts.values()
    assert artifact.format == "gpt-oss-quark-fp8"
    written = {k: v for f in artifact.dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert written["model.layers.1.mlp.experts.3.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    assert json.loads((artifact.dir / "config.json").read_text())["quantization_config"]["quant_method"] == "quark"
