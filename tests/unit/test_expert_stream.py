"""Expert-by-expert streaming (llmc.quant.expert_stream; issue 46): decided in the layer loop's decision, and the
canonical form it writes is the whole-layer path's, byte for byte."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmc.model.source import ModelSource
from llmc.planning.shapes import from_config
from llmc.quant import stream
from llmc.quant.algorithms.catalog import AlgorithmSteps
from llmc.quant.loop_plan import LoopFacts, decide_layer_loop
from llmc.quant.spec import Scheme, TensorSpec
from tests.unit.families import make_tiny
from tests.unit.test_families import _ids
from tests.unit.test_source_formats import save_fp8_block

NVFP4 = Scheme(TensorSpec("nvfp4", "group", group_size=16), TensorSpec("nvfp4", "group", group_size=16))
FP8_STATIC = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))
FP8_BLOCK = Scheme(TensorSpec("fp8_e4m3", "block"))


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 (layer 0 dense, layers 1-2 MoE with a shared expert) saved FP8 block-wise as it ships."""
    work = tmp_path_factory.mktemp("experts")
    tiny = make_tiny("deepseek_v3", work / "tiny", num_hidden_layers=3, first_k_dense_replace=1)
    return save_fp8_block(tiny, work / "fp8")


def _build(source: Path, scheme: Scheme, out: Path, mode: str, all_experts: bool) -> stream.StreamResult:
    cal = stream.Calibration(_ids(4, 1), batch_size=2, moe_all_experts=all_experts, stream_experts=mode)
    return stream.quantize_model(ModelSource(source, "d", "d"), scheme, out, cal)  # data-free: only its mode read


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.heavy
@pytest.mark.parametrize("scheme,all_experts", [(NVFP4, True), (FP8_STATIC, False), (FP8_BLOCK, False)],
                         ids=["nvfp4-all-experts", "fp8-static-routed", "fp8-block-pass-through"])
def test_expert_by_expert_writes_the_whole_layer_paths_bytes(deepseek_fp8: Path, tmp_path: Path, scheme: Scheme,
                                                             all_experts: bool) -> None:
    whole = _build(deepseek_fp8, scheme, tmp_path / "whole", "never", all_experts)
    by_expert = _build(deepseek_fp8, scheme, tmp_path / "experts", "always", all_experts)
    assert not whole.loop.expert_stream and by_expert.loop.expert_stream
    a, b = _files(tmp_path / "whole"), _files(tmp_path / "experts")
    assert sorted(a) == sorted(b) and "layers/00002.safetensors" in a
    differing = [f for f in a if a[f] != b[f]]
    assert differing == ["quantized.json"]  # it records the decision executed, and nothing else differs:
    meta_a, meta_b = json.loads(a["quantized.json"]), json.loads(b["quantized.json"])
    assert meta_b["layer_loop"].pop("experts") == "one at a time"
    assert meta_a == meta_b
    assert not list((tmp_path / "experts").glob("state*"))  # the spilled experts are gone


def test_the_check_can_fail_an_expert_quantized_on_other_inputs_differs(deepseek_fp8: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """Running each expert on only the first kept call (the other batch's routed tokens lost) changes the written
    input scales: the comparison above sees the inputs each expert is calibrated on."""
    from llmc.quant import expert_stream

    run = expert_stream.DeferredExperts.run_expert

    def first_call_only(self, experts, e):
        calls, self.calls = self.calls, self.calls[:1]
        try:
            run(self, experts, e)
        finally:
            self.calls = calls

    whole = _files(_build(deepseek_fp8, FP8_STATIC, tmp_path / "whole", "never", False) and tmp_path / "whole")
    monkeypatch.setattr(expert_stream.DeferredExperts, "run_expert", first_call_only)
    _build(deepseek_fp8, FP8_STATIC, tmp_path / "experts", "always", False)
    assert _files(tmp_path / "experts")["layers/00001.safetensors"] != whole["layers/00001.safetensors"]


def _facts(**kw) -> LoopFacts:
    base = dict(calibrates=True, windows=128, seq_len=512, masked=False, batch_size=4, spill_mode="auto",
                hidden=7168, intermediate=18432, heads=128, elem=2, moe=True, device="cpu",
                host_available=21_000_000_000, device_free=None, shared_stats=False, shared_covered=False,
                layer_bytes=22_548_000_000, experts_streamable=True)
    return LoopFacts(**{**base, **kw})


def test_the_decision_streams_experts_only_where_the_layer_does_not_fit_and_the_pipeline_allows() -> None:
    rtn = AlgorithmSteps.of(NVFP4)
    loop = decide_layer_loop(rtn, _facts())
    assert loop.expert_stream and loop.as_dict()["experts"] == "one at a time"
    assert "routed experts one at a time" in loop.describe() and "21.0 GB available" in loop.describe()
    assert not decide_layer_loop(rtn, _facts(layer_bytes=2_800_000_000)).expert_stream  # Mixtral's layer fits
    assert "experts" not in decide_layer_loop(rtn, _facts(layer_bytes=2_800_000_000)).as_dict()
    assert decide_layer_loop(rtn, _facts(layer_bytes=1, stream_experts="always")).expert_stream
    assert not decide_layer_loop(rtn, _facts(stream_experts="never")).expert_stream
    assert not decide_layer_loop(rtn, _facts(ranks=2)).expert_stream
    fused = decide_layer_loop(rtn, _facts(experts_streamable=False))
    assert not fused.expert_stream and "fused" in fused.describe()
    gptq = decide_layer_loop(AlgorithmSteps.of(replace(NVFP4, activations=None, algorithm="gptq")), _facts())
    assert not gptq.expert_stream and "gptq pipeline" in gptq.describe()
    assert not decide_layer_loop(rtn, _facts(moe=False)).expert_stream


def test_the_plan_prices_one_expert_at_a_time_at_deepseek_v3_width(monkeypatch) -> None:
    """DeepSeek-V3's widths (1 dense + 1 MoE layer): the whole-layer path holds the 11.3 B-parameter layer in bf16,
    its codes and the next layer's read-ahead; expert by expert, the layer less its routed experts plus one
    expert (~3 GB with the skeleton), the expert codes and their E4M3 scales spilled to disk per layer named in the row
    (measured: 46.79 MB an expert, benchmarks/results/deepseek_full_width.md)."""
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape, from_config
    from tests.unit.build_helpers import layer_loop
    from tests.unit.test_plan_honest import pin_probes

    pin_probes(monkeypatch, matmul=(10e9,), quantize=(1e8,))
    config = json.loads((Path(__file__).parents[2] / "recipes" / "configs" / "DeepSeek-V3" / "config.json").read_text())
    config = {k: v for k, v in config.items() if k != "quantization_config"} | {"num_hidden_layers": 2,
                                                                                 "first_k_dense_replace": 1}
    shape = Shape.of(from_config(config), config, 2)
    assert shape.expert_params == 3 * 7168 * 2048 and shape.routed_params == 256 * shape.expert_params
    rtn = AlgorithmSteps.of(NVFP4)
    whole = layer_loop(rtn, windows=1, seq_len=128, batch=4, activations="memory")
    by_expert = replace(whole, expert_stream=True)
    kwargs = dict(compute="bfloat16", stored_elem=1, machine=Machine(available=None, gpu_free=None, device="cpu"))
    a, b = quantize_cost(shape, whole, rtn, **kwargs), quantize_cost(shape, by_expert, rtn, **kwargs)
    # the layer, its codes and one neighbour (of two layers, the first reads the second ahead; the second has the
    # first's codes being written: llmc.pipeline.quantize.overlap_bytes)
    assert a.host_bytes > 2 * shape.layer_params * 2
    assert b.parts["layer"] == (shape.layer_params - shape.routed_params + shape.expert_params) * 2
    assert b.host_bytes < 0.1 * a.host_bytes
    assert "per expert: 0.18 GB" in b.why and "12.0 GB of expert codes and scales spilled" in b.why
    assert b.layer_seconds > a.layer_seconds  # the spill and the second forward cost time


def test_a_layer_over_half_the_gpu_s_free_memory_streams_its_experts_whatever_the_host_holds() -> None:
    """Calibrating on a GPU, the whole layer lives there too: DeepSeek-V3's 22.5 GB layer on a 24 GB GPU streams even
    with 256 GB of host memory; on an H200's 141 GB it fits, and a CPU build ignores the GPU."""
    rtn = AlgorithmSteps.of(NVFP4)
    big_host = dict(host_available=256_000_000_000, device="cuda:0")
    small_gpu = decide_layer_loop(rtn, _facts(**big_host, device_free=24_000_000_000))
    assert small_gpu.expert_stream and "over half of the GPU's 24.0 GB free" in small_gpu.describe()
    assert not decide_layer_loop(rtn, _facts(**big_host, device_free=141_000_000_000)).expert_stream
    assert not decide_layer_loop(rtn, _facts(host_available=256_000_000_000, device_free=1)).expert_stream


def test_calibration_stream_experts_is_a_recipe_key_that_leaves_other_keys_as_they_were() -> None:
    """The recipe's `calibration.stream_experts` reaches the decision; at its default it leaves the section's dump
    (build ids) as it was, and never the calibrate stage's key (it changes no token)."""
    from llmc.data.stages import calibration_config
    from llmc.data.tokens import TokenSet
    from llmc.recipe.schema import CalibrationSection

    default, always = CalibrationSection(), CalibrationSection(stream_experts="always")
    assert "stream_experts" not in default.model_dump(mode="json")
    assert always.model_dump(mode="json")["stream_experts"] == "always"
    with pytest.raises(ValueError, match="stream_experts"):
        CalibrationSection(stream_experts="sometimes")
    tokens = TokenSet(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=None, provenance=[])
    custom = {"kind": "jsonl", "path": "x.jsonl", "field": "text"}
    assert calibration_config(CalibrationSection(dataset=custom), tokens) == calibration_config(
        CalibrationSection(dataset=custom, stream_experts="always"), tokens)


@pytest.mark.heavy
def test_deepseek_r1_on_one_h200_plans_under_64_gb_of_host_memory(tmp_path: Path) -> None:
    """Issue 46: `llmc plan recipes/deepseek-r1-nvfp4.yaml --machine h200` states host RAM under 64 GB, the GPU peak,
    disk and time per layer and in all, with the decision that makes it so printed; the recipe's
    `calibration.stream_experts: always` is what does (at auto the 256 GB host holds the whole 23 GB layer: ~72 GB)."""
    from tests.unit.test_plan_machine import REPO, _plan_json

    def plan(*sets: str) -> tuple[dict, dict]:
        p = _plan_json([str(REPO / "recipes" / "deepseek-r1-nvfp4.yaml"), "--machine", "h200",
                        "--cache-dir", str(tmp_path / "c"), *[a for s in sets for a in ("--set", s)]])
        return p, next(r for r in p["estimates"]["stages"] if r["stage"].startswith("quantize"))

    shipped, quantize = plan()
    assert quantize["decision"]["experts"] == "one at a time"
    assert "calibration.stream_experts: always" in quantize["why"] and "per expert" in quantize["why"]
    assert max(r["host_gb"] for r in shipped["estimates"]["stages"]) < 64
    assert 0 < quantize["gpu_gb"] < 141 and quantize["disk_gb"] > 300  # the expert codes of 58 MoE layers
    # the 3 dense first layers priced by their size, not as the MoE layers (a full-width run measured the stage at
    # about half the plan that priced every layer as the largest: benchmarks/results/deepseek_full_width.md)
    config = json.loads((REPO / "recipes" / "configs" / "DeepSeek-R1" / "config.json").read_text())
    sizes = sorted(from_config(config).layer_params().values())
    assert len(set(sizes)) == 2 and sizes.count(sizes[0]) == config["first_k_dense_replace"] == 3
    layers = (58 + 3 * sizes[0] / sizes[-1])
    assert quantize["seconds"] - quantize["fixed_seconds"] == pytest.approx(quantize["layer_seconds"] * layers,
                                                                            rel=1e-6)
    assert 58 < layers < 59
    whole = plan("calibration.stream_experts=auto")[1]
    assert "experts" not in whole["decision"] and whole["host_gb"] > 64 > quantize["host_gb"]
    assert whole["gpu_gb"] > quantize["gpu_gb"]
