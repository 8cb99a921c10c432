"""What vLLM / SGLang serve from an FP8 artifact is what llmc evaluated (issue 45; llmc.quant.runtime_scales).

The reference here is written from the runtimes' load-time rule as read in their sources, not from llmc's code:
vLLM's CompressedTensorsW8A8Fp8MoEMethod.process_weights_after_loading (and SGLang's) keeps ONE static input scale
per fused-MoE layer for gate/up (w13) and one for down (w2), the max over the experts, and per expert one weight scale
for w13: gate's and up's per-tensor FP8 codes dequantized (codes as float16 times their scale) and quantized again
with the larger scale; its dense fused Linears (q/k/v, gate/up: QKVParallelLinear / MergedColumnParallelLinear) do
the same with `requantize_with_max_scale` and take the max of their input scales. The rule is applied to the
per-expert artifact llmc wrote before issue 45 (the same build with the unification switched off); llmc's artifact
must hold exactly those tensors, and llmc's torch engine must compute the same logits on both."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.pipeline.context import Build
from llmc.quant import runtime_scales
from llmc.quant.spec import Scheme, TensorSpec
from tests.unit.families import make_tiny
from tests.unit.test_families import _ids
from tests.unit.test_moe import _quantize

FP8_TENSOR_STATIC = Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"), ignore=("lm_head",))
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
EXPERT_INPUT = re.compile(r"^(.*\.experts)\.\d+\.([^.]+)\.input_scale$")


def _vllm_load_rule(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the runtime computes with, written back per Linear (each member of a fused set given the set's
    one scale and its requantized codes; each expert given its layer's one input scale)."""
    t = dict(t)
    parents = {k.rsplit(".", 2)[0] for k in t if k.endswith(".weight_scale")}
    for parent in parents:
        for members in FUSED:
            names = [f"{parent}.{m}" for m in members]
            if not all(f"{n}.weight_scale" in t for n in names):
                continue
            top = max(t[f"{n}.weight_scale"].float().max() for n in names)
            for n in names:
                dq = t[f"{n}.weight"].to(torch.float16) * t[f"{n}.weight_scale"].float().reshape(())
                t[f"{n}.weight"] = (dq.float() * (1.0 / top)).clamp(-448, 448).to(torch.float8_e4m3fn)
                t[f"{n}.weight_scale"] = top.reshape(t[f"{n}.weight_scale"].shape).clone()
            top_in = max(t[f"{n}.input_scale"].max() for n in names)
            for n in names:
                t[f"{n}.input_scale"] = top_in.reshape(t[f"{n}.input_scale"].shape).clone()
    per_layer: dict[tuple[str, str], list[str]] = {}
    for k in t:
        m = EXPERT_INPUT.match(k)
        if m:
            per_layer.setdefault((m[1], "w2" if m[2] in ("down_proj", "w2") else "w13"), []).append(k)
    for keys in per_layer.values():
        top = max(t[k].max() for k in keys)
        for k in keys:
            t[k] = top.reshape(t[k].shape).clone()
    return t


def one_input_scale_per_moe_layer(scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`scales` (Linear name -> its own static input scale) with each routed expert's replaced by its MoE layer's one
    for its operand (gate/up: w13, down: w2): the max over the layer's experts, as vLLM / SGLang load them."""
    top: dict[tuple[str, str], torch.Tensor] = {}
    for name, scale in scales.items():
        m = EXPERT_INPUT.match(f"{name}.input_scale")
        if m:
            key = (m[1], "w2" if m[2] in ("down_proj", "w2") else "w13")
            top[key] = torch.maximum(top.get(key, scale), scale)
    out = dict(scales)
    for name in scales:
        m = EXPERT_INPUT.match(f"{name}.input_scale")
        if m:
            out[name] = top[(m[1], "w2" if m[2] in ("down_proj", "w2") else "w13")]
    return out


def _tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from llmc.engines.torch_ref import TorchEngine

    with torch.no_grad():
        return TorchEngine(folder, streamed=False).model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "llama"])
def test_the_fp8_artifact_is_what_vllm_computes_from_the_per_expert_one(family: str, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """FP8 W8A8, per-tensor weights and static per-tensor activations: the exported experts' input scales are one
    value per layer and operand, the max of the per-expert calibrated ones; gate/up (an expert's w13, a dense MLP's)
    and q/k/v share one weight scale with the codes the runtime's requantization gives; llmc's torch engine on the
    export equals it on the per-expert artifact with the runtime's rule applied, and differs from the per-expert
    artifact as written."""
    folder = make_tiny(family, tmp_path / "model")
    export_compressed_tensors(_quantize(folder, FP8_TENSOR_STATIC, tmp_path / "q"), tmp_path / "export")
    with monkeypatch.context() as m:  # the artifact as llmc wrote it before issue 45: each Linear's own scales
        m.setattr(runtime_scales, "unify_fused_weight_scales", lambda tensors, specs: [])
        m.setattr(runtime_scales, "unify_expert_input_scales", lambda tensors, specs: {})
        export_compressed_tensors(_quantize(folder, FP8_TENSOR_STATIC, tmp_path / "q-own"), tmp_path / "own")
    shutil.copytree(tmp_path / "own", tmp_path / "ruled")
    own, got = _tensors(tmp_path / "own"), _tensors(tmp_path / "export")
    assert own.keys() == got.keys()
    changed = 0
    for file, tensors in own.items():
        ruled = _vllm_load_rule(tensors)
        save_file(ruled, str(tmp_path / "ruled" / file), metadata={"format": "pt"})
        assert ruled.keys() == got[file].keys()
        for k, v in ruled.items():
            assert v.dtype == got[file][k].dtype and v.shape == got[file][k].shape, k
            assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                               got[file][k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got[file][k]), k
            changed += not torch.equal(v.float(), tensors[k].float())
    assert changed, "the runtime's rule must change the per-expert artifact"
    scales = {k: v for t in got.values() for k, v in t.items() if k.endswith(".input_scale") and ".experts." in k}
    if family != "llama":  # one value per layer and operand, the max of the experts' own
        own_scales = {k: v for t in own.values() for k, v in t.items() if k in scales}
        for layer in range(2):
            for down in (True, False):
                keys = [k for k in scales if f"layers.{layer}." in k and (".w2." in k or ".down_proj." in k) == down]
                assert len(keys) == 4 * (1 if down else 2)
                assert len({scales[k].item() for k in keys}) == 1
                assert scales[keys[0]].item() == max(own_scales[k].item() for k in keys)
                assert len({own_scales[k].item() for k in keys}) > 1, "the experts' own scales differ"
    ids = _ids(2, 2)
    logits, ruled_logits = _logits(tmp_path / "export", ids), _logits(tmp_path / "ruled", ids)
    assert torch.equal(logits, ruled_logits)
    assert (_logits(tmp_path / "own", ids) - logits).abs().max().item() > 0


def test_requantize_fp8_is_the_identity_under_the_same_scale() -> None:
    """A member already at the group's scale keeps its codes (vLLM requantizes every member on load, the largest
    included): every E4M3 code, under scales across the range a weight's takes."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    for scale in (1e-4, 3.7e-3, 0.05, 1.0):
        s = torch.tensor([scale])
        again = runtime_scales.requantize_fp8(codes, s, s)
        assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)), scale


def test_the_plan_says_which_scales_are_unified_and_why(tmp_path: Path) -> None:
    """`llmc plan` on a tiny Qwen3-MoE: FP8 per-tensor weights with static activations name both unifications and
    the runtimes' rule; per-channel weights with dynamic activations neither."""
    import yaml

    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    folder = make_tiny("qwen3_moe", tmp_path / "model")

    def notes(weights: str, dynamic: bool) -> list[str]:
        acts = {"format": "fp8_e4m3", "strategy": "token" if dynamic else "tensor", "dynamic": dynamic}
        recipe = parse_recipe(yaml.safe_dump({
            "name": "p", "model": {"source": str(folder)},
            "quantization": {"weights": {"format": "fp8_e4m3", "strategy": weights}, "activations": acts},
            "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}]}))
        return [w for w in make_plan(recipe, folder, check_time=False).warnings
                if "max over the layer's experts" in w or "unified to their max" in w]

    both = notes("tensor", False)
    assert len(both) == 2 and "fused-MoE" in both[0] and "requantized" in both[1]
    assert notes("channel", True) == []


def _build(source) -> Build:
    """A build as far as a quantize stage's key reads it: the source, the dtype, the device, the calibration key."""
    import types

    return Build(recipe=types.SimpleNamespace(calibration=types.SimpleNamespace(moe_calibrate_all_experts=False)),
                 runner=None, result=types.SimpleNamespace(dtype="float32", source=source),
                 device=torch.device("cpu"), tokenizer=None, calibration=None, evaluation=None, calib_key="c")


def test_the_quantize_stage_key_names_the_rules_only_where_they_change_the_form(tmp_path: Path) -> None:
    """A canonical form cached before the rules must not be read as one written by them: the stage key names the
    rules the scheme gets on this model; schemes they leave alone keep their keys."""
    import json
    import types

    from llmc.pipeline.quantize import Quantize

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for folder, config in ((dense, {"model_type": "llama"}), (moe, {"model_type": "qwen3_moe", "num_experts": 4})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))

    def key(folder: Path, weights: str, static: bool) -> str:
        scheme = Scheme(weights=TensorSpec(format="fp8_e4m3", strategy=weights),
                        activations=TensorSpec(format="fp8_e4m3", strategy="tensor" if static else "token",
                                               dynamic=not static))
        source = types.SimpleNamespace(sha256="s", config=lambda: json.loads((folder / "config.json").read_text()))
        return Quantize("", scheme).key(_build(source))

    def rekeyed(folder: Path, weights: str, static: bool) -> bool:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runtime_scales, "rules_applied", lambda scheme, moe: [])
            before = key(folder, weights, static)  # the key as it was before the rules
        return key(folder, weights, static) != before

    assert rekeyed(moe, "channel", True) and not rekeyed(dense, "channel", True)  # static inputs: MoE only
    assert rekeyed(dense, "tensor", False) and rekeyed(moe, "tensor", False)  # per-tensor weights: both
    assert not rekeyed(moe, "channel", False) and not rekeyed(dense, "channel", False)


def test_a_build_reads_the_sources_config_once_for_every_quantize_key(tmp_path: Path) -> None:
    """Issue 44: Quantize.key read config.json on every call (each stage lookup, each pending check): the build
    reads it once, and every variant's key, asked any number of times, is the same as with a fresh read."""
    import json
    import types

    from llmc.pipeline.quantize import Quantize

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    reads: list[int] = []

    def config() -> dict:
        reads.append(1)
        return json.loads((tmp_path / "config.json").read_text())

    source = types.SimpleNamespace(sha256="s", config=config)
    stages = [Quantize(name, Scheme(weights=TensorSpec(format="fp8_e4m3", strategy=strategy),
                                    activations=TensorSpec(format="fp8_e4m3", strategy="tensor", dynamic=False)))
              for name, strategy in (("a", "channel"), ("b", "tensor"))]
    build = _build(source)
    keys = [s.key(build) for _ in range(3) for s in stages]
    assert len(reads) == 1
    assert keys == [s.key(_build(source)) for _ in range(3) for s in stages]  # each fresh build: one read more
    assert len(reads) == 1 + 6 and keys[0] != keys[1]
