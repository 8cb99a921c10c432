"""llmc's TensorRT-LLM (ModelOpt unified HF) export against NVIDIA ModelOpt's own export of the same
tiny model and scheme: identical tensor names, dtypes, shapes and quantization config keys.

ModelOpt runs on the CPU in its own venv (`bash scripts/setup-peers.sh`); the test skips without it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmc.formats.modelopt_hf import (
    HF_QUANT_CONFIG,
    export_modelopt_hf,
    fp8_weight_operand,
    unpack_int4_rows,
)
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.microscaling import e2m1_decode, unpack_e2m1
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model

pytestmark = [pytest.mark.slow, pytest.mark.peers]
REPO = Path(__file__).resolve().parents[2]
MODELOPT_PYTHON = Path(os.environ.get("LLMC_MODELOPT_PYTHON", REPO / ".venv-modelopt" / "bin" / "python"))

_MODELOPT_EXPORT = r"""
import copy, sys, torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM
src, out, cfg_name, kv_name = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
cfg = copy.deepcopy(getattr(mtq, cfg_name))
if kv_name != "-":
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(getattr(mtq, kv_name)["quant_cfg"])
data = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
def loop(m):
    for b in data.split(2):
        m(b)
model = mtq.quantize(model, cfg, loop)
if cfg_name == "W4A8_AWQ_BETA_CFG":  # the weight ModelOpt simulates the FP8 GEMM with, before export packs it
    import os
    os.makedirs(out)
    down = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        torch.save(down.weight_quantizer(down.weight).float(), out + "/simulated_down_proj.pt")
export_hf_checkpoint(model, export_dir=out)
"""

CASES = {
    "fp8+kv": (Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor")),
               "FP8_DEFAULT_CFG", "FP8_KV_CFG"),
    "int8-sq": (Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), algorithm="smoothquant"),
                "INT8_SMOOTHQUANT_CFG", "-"),
    "int4-awq": (Scheme(TensorSpec("int4", "group", group_size=128), algorithm="awq"), "INT4_AWQ_CFG", "-"),
    "w4a8-awq": (Scheme(TensorSpec("int4", "group", group_size=128), TensorSpec("fp8_e4m3", "tensor"), algorithm="awq"),
                 "W4A8_AWQ_BETA_CFG", "-"),
    "nvfp4": (Scheme(TensorSpec("nvfp4", "group", group_size=16), TensorSpec("nvfp4", "group", group_size=16)),
              "NVFP4_DEFAULT_CFG", "-"),
    "fp8-block": (Scheme(TensorSpec("fp8_e4m3", "block"),
                         TensorSpec("fp8_e4m3", "group", group_size=128, dynamic=True)),
                  "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "-"),
}


def _layout(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = s.get_tensor(k)
                out[k] = (str(t.dtype), tuple(t.shape))
    return out


def _keys(d: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in d.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= _keys(v, prefix + k + ".")
    return keys


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not MODELOPT_PYTHON.is_file():
        pytest.skip(f"no ModelOpt venv at {MODELOPT_PYTHON} (bash scripts/setup-peers.sh)")
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mo") / "tiny", hidden=128, intermediate=256, heads=4,
                           kv_heads=2, tie=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_matches_modelopt_export(case: str, tiny: Path, tmp_path: Path) -> None:
    scheme, cfg_name, kv_name = CASES[case]
    ref = tmp_path / "modelopt"
    done = subprocess.run([str(MODELOPT_PYTHON), "-c", _MODELOPT_EXPORT, str(tiny), str(ref), cfg_name, kv_name],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]

    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(ModelSource(tiny, "tiny", "tiny"), scheme, tmp_path / "canonical", Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "canonical")
    ours = tmp_path / "llmc"
    export_modelopt_hf(qm, ours)

    theirs_layout, ours_layout = _layout(ref), _layout(ours)
    assert sorted(ours_layout) == sorted(theirs_layout)
    mismatched = {k: (ours_layout[k], theirs_layout[k]) for k in ours_layout if ours_layout[k] != theirs_layout[k]}
    assert not mismatched, mismatched

    theirs_hq, ours_hq = (json.loads((d / HF_QUANT_CONFIG).read_text()) for d in (ref, ours))
    assert _keys(ours_hq) == _keys(theirs_hq)
    assert {k: v for k, v in ours_hq["quantization"].items()} == theirs_hq["quantization"]
    theirs_qc, ours_qc = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (ref, ours))
    assert _keys(ours_qc) == _keys(theirs_qc)
    assert ours_qc == theirs_qc

    # and the values decode back to the canonical weights exactly
    with safe_open(str(ours / "model.safetensors"), "pt") as s:
        name = "model.layers.1.mlp.down_proj"
        canonical = qm.dequantized_weight(next(t for t in qm.iter_files() if f"{name}.weight" in t), name)
        w, scale = s.get_tensor(f"{name}.weight"), s.get_tensor(f"{name}.weight_scale")
        if case == "nvfp4":  # ModelOpt's decode: code × weight_scale × weight_scale_2 (the reciprocal global scale)
            w = (e2m1_decode(unpack_e2m1(w)) * scale.float().repeat_interleave(16, dim=1)
                 * s.get_tensor(f"{name}.weight_scale_2"))
            torch.testing.assert_close(w, canonical, rtol=2 ** -22, atol=0)
            w = canonical  # within the float32 rounding of 1 / global scale, checked just above
        elif case == "fp8-block":  # [out/128, 1, in/128, 1] tiles, as TensorRT-LLM squeezes them
            tiles = scale.reshape(scale.shape[0], scale.shape[2])
            w = w.float() * tiles.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        elif w.dtype == torch.uint8:
            w = unpack_int4_rows(w).float() * scale.repeat_interleave(128, dim=1)
        elif scale.dim() == 1:
            w = w.float() * scale[:, None]
        else:
            w = w.float() * scale
        torch.testing.assert_close(w, canonical, rtol=0, atol=0)
    if case == "w4a8-awq":  # fp8_weight_operand is ModelOpt's own simulation of the W4A8 GEMM's weight
        with safe_open(str(ref / "model.safetensors"), "pt") as s:
            w, scale, scale_2 = (s.get_tensor(f"model.layers.1.mlp.down_proj.{k}")
                                 for k in ("weight", "weight_scale", "weight_scale_2"))
        dequantized = unpack_int4_rows(w).float() * scale.repeat_interleave(128, dim=1)
        simulated = torch.load(ref / "simulated_down_proj.pt")
        # float32 op order differs (ModelOpt rescales in one fused step): ~1e-8 apart, FP8 steps are ~1e-3
        torch.testing.assert_close(fp8_weight_operand(dequantized, scale_2), simulated, rtol=1e-6, atol=1e-7)
        assert not torch.equal(dequantized, simulated)  # the FP8 rounding is real, not a no-op

    if case == "nvfp4":  # ModelOpt quantizes the same weights to the same bytes, block scales and scale_2
        with (safe_open(str(ours / "model.safetensors"), "pt") as o,
              safe_open(str(ref / "model.safetensors"), "pt") as t):
            for k in o.keys():  # noqa: SIM118
                if ".layers." not in k or "layernorm" in k:
                    continue
                a, b = o.get_tensor(k), t.get_tensor(k)
                if k.endswith("input_scale"):  # amax observed by each tool's own calibration pass, rounded apart
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
                else:
                    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), k

    with safe_open(str(ours / "model.safetensors"), "pt") as s:
        if case == "w4a8-awq":  # one FP8 grid per fused GEMM, spanning its largest dequantized weight
            attn = "model.layers.1.self_attn"
            s2 = {p: s.get_tensor(f"{attn}.{p}.weight_scale_2") for p in ("q_proj", "k_proj", "v_proj")}
            assert s2["q_proj"] == s2["k_proj"] == s2["v_proj"]
            peak = max(qm.dequantized_weight(next(t for t in qm.iter_files() if f"{attn}.{p}.weight" in t),
                                             f"{attn}.{p}").abs().max() for p in s2)
            torch.testing.assert_close(s2["q_proj"], peak / 448, rtol=0, atol=0)


_MODELOPT_LEGACY = r"""
import copy, sys, torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_tensorrt_llm_checkpoint
from transformers import AutoModelForCausalLM
src, out, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"])
data = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
def loop(m):
    for b in data.split(2):
        m(b)
model = mtq.quantize(model, cfg, loop)
export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=out, inference_tensor_parallel=tp)
"""


def test_legacy_tp2_checkpoint_matches_modelopt_and_remerges(tiny: Path, tmp_path: Path) -> None:
    from llmc.formats.trtllm_legacy import export_trtllm_legacy

    ref = tmp_path / "modelopt"
    done = subprocess.run([str(MODELOPT_PYTHON), "-c", _MODELOPT_LEGACY, str(tiny), str(ref), "2"],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    scheme, _, _ = CASES["fp8+kv"]
    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(ModelSource(tiny, "tiny", "tiny"), scheme, tmp_path / "canonical", Calibration(calib))
    qm = QuantizedModel.open(tmp_path / "canonical")
    res1 = export_trtllm_legacy(qm, tmp_path / "tp1", tensor_parallel=1)
    export_trtllm_legacy(qm, tmp_path / "tp2", tensor_parallel=2)

    for r in (0, 1):
        ours, theirs = (_layout_file(d / f"rank{r}.safetensors") for d in (tmp_path / "tp2", ref))
        assert ours == theirs
    cfg_ours, cfg_theirs = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "tp2", ref))
    # rotary_base: ModelOpt 0.47 under transformers 5 omits it (see llmc/formats/trtllm_legacy.py)
    assert _keys(cfg_ours) - {"rotary_base"} == _keys(cfg_theirs)
    assert cfg_ours["mapping"] == cfg_theirs["mapping"] and cfg_ours["quantization"] == cfg_theirs["quantization"]

    # the same weights land under the same names as ModelOpt's. Codes may differ by one FP8 step (ModelOpt
    # rounds once from fp16 weights onto the fused scale; llmc re-rounds its codes onto it), a few % in
    # relative L2; a swapped pair (fc <-> gate) differs by ~100%.
    def dequant(f: Path, name: str) -> torch.Tensor:
        with safe_open(str(f), "pt") as s:
            return s.get_tensor(name + ".weight").float() * s.get_tensor(name + ".weights_scaling_factor")

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    ours1, theirs1 = tmp_path / "tp2" / "rank1.safetensors", ref / "rank1.safetensors"
    for name in ("mlp.fc", "mlp.gate", "mlp.proj", "attention.dense"):
        k = f"transformer.layers.1.{name}"
        assert rel(dequant(ours1, k), dequant(theirs1, k)) < 0.05, k
    assert rel(dequant(ours1, "transformer.layers.1.mlp.fc"), dequant(theirs1, "transformer.layers.1.mlp.gate")) > 0.5

    # (re-merging the shards into the TP=1 tensors is tested in tests/unit/test_modelopt_export.py)
    assert res1.qkv_requantization_error < 0.05


def _layout_file(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(f), "pt") as s:
        return {k: (str(s.get_tensor(k).dtype), tuple(s.get_tensor(k).shape)) for k in s.keys()}  # noqa: SIM118

