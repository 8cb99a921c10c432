"""ONNX Runtime export: the GPTQ-format intermediate, the onnxruntime-genai folder built from it, and
the onnxruntime engine; and the AWQ (GEMM) format, read back by onnxruntime-genai's own AWQ loader.
Tiny random llama; onnxruntime runs on the CPU in the default test run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from llmc.formats import awq_format as AF
from llmc.formats import gptq_format as GF
from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.formats.onnx_genai import UNQUANTIZED_NODES, check_scheme, export_onnx
from llmc.engines.agreement import EXACT, kld_kind
from llmc.engines.onnxrt import OnnxRuntimeEngine
from llmc.engines.torch_ref import TorchEngine
from llmc.errors import EngineFailed, IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
from tests.conftest import make_tiny_model

SCHEMES = {
    "g32-sym": Scheme(TensorSpec("int4", "group", group_size=32)),
    "g32-asym": Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False)),
}


def _quantized(model: Path, scheme: Scheme, out: Path) -> QuantizedModel:
    """Quantize, then round the scales to float16-representable values (GPTQ/MatMulNBits store fp16
    scales): the ONNX and compressed-tensors exports then hold the very same weights, and any
    difference between the runtimes is arithmetic alone."""
    from safetensors.torch import load_file, save_file

    quantize_model(ModelSource(model, "test", str(model)), scheme, out, None)
    qm = QuantizedModel.open(out)
    for f in qm.files():
        t = load_file(str(f))
        t = {k: v.half().float() if k.endswith(".weight_scale") else v for k, v in t.items()}
        save_file(t, str(f))
    return qm


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[QuantizedModel, Path, Path]]:
    """scheme -> (canonical form, ONNX folder at accuracy_level 1, compressed-tensors export). From a model of its
    own, not the session's shared one: the rotary checks below hold the builder's cos cache, sized from the
    config's context length, to 1e-4, and a config another test changed would move it."""
    root = tmp_path_factory.mktemp("onnx")
    model = make_tiny_model(root / "model")
    out = {}
    for name, scheme in SCHEMES.items():
        qm = _quantized(model, scheme, root / f"q-{name}")
        export_onnx(qm, root / f"onnx-{name}", accuracy_level=1)
        export_compressed_tensors(qm, root / f"ct-{name}")
        out[name] = (qm, root / f"onnx-{name}", root / f"ct-{name}")
    return out


def _canonical(qm: QuantizedModel) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in qm.iter_files():
        out.update(t)
    return out


# --- GPTQ format ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (64, 24), generator=g)
    words = GF.pack_along_rows(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (64 * bits // 32, 24)
    assert torch.equal(GF.unpack_rows(words, bits), codes)


def test_packing_matches_the_gptq_bit_layout() -> None:
    # input row 8k + j of column o sits at bits 4j..4j+3 of qweight[k, o] (low nibble first)
    codes = torch.zeros(8, 1, dtype=torch.int64)
    codes[1, 0], codes[7, 0] = 0x3, 0xF
    word = int(GF.pack_along_rows(codes, 4)[0, 0]) & 0xFFFFFFFF
    assert word == (0x3 << 4) | (0xF << 28)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_tensors_decode_to_the_canonical_weights(symmetric: bool) -> None:
    g = torch.Generator().manual_seed(1)
    out_f, in_f, group = 16, 64, 32
    codes = torch.randint(-8, 8, (out_f, in_f), generator=g, dtype=torch.int8)
    # fp16-representable scales: the conversion must then be exact
    scale = (torch.rand(out_f, in_f // group, generator=g) * 0.05 + 0.01).half().float()
    # zero points the v1 layout holds unambiguously: -8 (unsigned 0) is refused (test_gptq_zero.py)
    zp = torch.randint(-7, 8, scale.shape, generator=g, dtype=torch.int8) if not symmetric else None
    t = GF.to_gptq(codes, scale, zp, 4)
    zero = zp.float()[..., None] if zp is not None else 0.0
    expected = ((codes.float().reshape(out_f, -1, group) - zero) * scale[..., None]).reshape(out_f, in_f)
    assert torch.equal(GF.dequantize_gptq(t, 4), expected)
    assert t.qweight.shape == (in_f // 8, out_f) and t.qzeros.shape == (in_f // group, out_f // 8)
    assert t.scales.dtype == torch.float16 and torch.equal(t.g_idx, torch.arange(in_f, dtype=torch.int32) // group)
    if symmetric:  # zero 8 stored as 7 in every nibble (the v1 format's offset)
        assert (t.qzeros == 0x77777777).all()


def test_gptq_checkpoint_config(exported, tmp_path: Path) -> None:
    qm, _, _ = exported["g32-asym"]
    summary = GF.export_gptq(qm, tmp_path / "gptq")
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"]) == ("gptq", 4, 32, False, False)
    assert summary["max_relative_weight_error_fp16_scales"] == 0.0  # the fixture's scales are fp16 already
    from safetensors import safe_open

    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    m = "model.layers.0.self_attn.q_proj"
    assert {f"{m}.qweight", f"{m}.qzeros", f"{m}.scales", f"{m}.g_idx"} <= names and f"{m}.weight" not in names


@pytest.mark.parametrize("fmt, spec", [
    ("awq", TensorSpec("int4", "group", group_size=32, symmetric=False)),
    ("gptq", TensorSpec("int4", "group", group_size=32)),
    ("gptq", TensorSpec("int8", "channel")),
    ("gptq", TensorSpec("int8", "tensor")),
])
def test_repacking_a_block_of_rows_at_a_time_writes_the_same_checkpoint(
        fmt: str, spec: TensorSpec, tiny_model_session: Path, tmp_path: Path, monkeypatch) -> None:
    """Blocks of 24 output rows (64-row Linears: 24 + 24 + 16, so the last block is short) against one block per
    Linear: the same bytes in every file, and the same float16-scale error (nonzero: these scales are float32)."""
    from llmc.formats import files

    quantize_model(ModelSource(tiny_model_session, "test", str(tiny_model_session)), Scheme(spec), tmp_path / "q", None)
    qm = QuantizedModel.open(tmp_path / "q")
    export = AF.export_awq if fmt == "awq" else GF.export_gptq
    whole = export(qm, tmp_path / "whole")
    in_features = qm.config["hidden_size"]
    monkeypatch.setattr(files, "REPACK_BLOCK_ELEMENTS", 24 * in_features)
    blocked = export(qm, tmp_path / "blocked")
    assert whole["max_relative_weight_error_fp16_scales"] > 0
    assert blocked == whole
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "blocked").iterdir())
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "blocked" / name).read_bytes(), name


# --- ONNX folder ----------------------------------------------------------------------------------------

def _matmulnbits_weights(folder: Path) -> dict[str, np.ndarray]:
    """Decode every MatMulNBits node's B / scales / zero_points to float [N, K] (ORT's documented layout)."""
    model = onnx.load(str(folder / "model.onnx"))
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, k, block, bits = attrs["N"], attrs["K"], attrs["block_size"], attrs["bits"]
        assert bits == 4
        blob = init[node.input[1]].reshape(n, -1)  # [N, n_blocks * block/2] bytes
        q = np.stack([blob & 0x0F, blob >> 4], axis=-1).reshape(n, -1)[:, :k].astype(np.float64)
        blocks = -(-k // block)
        scales = init[node.input[2]].reshape(n, blocks).astype(np.float64)
        if len(node.input) > 3 and node.input[3]:
            zb = init[node.input[3]].reshape(n, -1)
            zp = np.stack([zb & 0x0F, zb >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float64)
        else:
            zp = np.full((n, blocks), 8.0)
        out[node.name] = ((q - np.repeat(zp, block, 1)[:, :k]) * np.repeat(scales, block, 1)[:, :k])
    return out


@pytest.mark.parametrize("name", SCHEMES)
def test_matmulnbits_blocks_hold_the_canonical_codes(exported, name: str) -> None:
    qm, folder, _ = exported[name]
    decoded = _matmulnbits_weights(folder)
    tensors = _canonical(qm)
    deq = {m: qm.dequantized_weight(tensors, m).double().numpy() for m in qm.quantized_modules}
    layers = qm.config["num_hidden_layers"]
    checked = set()
    for i in range(layers):
        p = f"model.layers.{i}"
        want = {
            f"/model/layers.{i}/attn/qkv_proj/MatMulNBits": np.concatenate(
                [deq[f"{p}.self_attn.{x}_proj"] for x in "qkv"]),
            f"/model/layers.{i}/attn/o_proj/MatMulNBits": deq[f"{p}.self_attn.o_proj"],
            f"/model/layers.{i}/mlp/gate_proj/MatMulNBits": deq[f"{p}.mlp.gate_proj"],
            f"/model/layers.{i}/mlp/up_proj/MatMulNBits": deq[f"{p}.mlp.up_proj"],
            f"/model/layers.{i}/mlp/down_proj/MatMulNBits": deq[f"{p}.mlp.down_proj"],
        }
        for node, w in want.items():
            got = decoded[node]
            checked.add(node)
            # the fixture's scales are fp16-representable: the blocks decode to the canonical weights exactly
            assert np.array_equal(got, w), node
    assert checked == set(decoded)  # q/k/v fused into one node per layer; nothing else quantized


def test_graph_uses_ort_fused_ops_and_keeps_unquantized_tensors_float(exported) -> None:
    _, folder, _ = exported["g32-sym"]
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert {"MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    assert "GatherBlockQuantized" not in ops  # the embedding stays float (not in the scheme)
    names = {n.name for n in graph.node}
    assert "/lm_head/MatMul" in names and "/model/embed_tokens/Gather" in names
    assert UNQUANTIZED_NODES == ("/lm_head/MatMul", "/model/embed_tokens/Gather")
    genai = json.loads((folder / "genai_config.json").read_text())["model"]
    assert genai["decoder"]["filename"] == "model.onnx" and genai["type"] == "llama"
    serve = json.loads((folder / "llmc-serve.json").read_text())
    assert serve["accuracy_level"] == 1 and serve["rotary_cache_max_error"] < 1e-4



def test_rotary_check_catches_a_misread_rope_theta(exported) -> None:
    from llmc.formats.onnx_genai import _rotary_error

    qm, folder, _ = exported["g32-sym"]
    config = dict(qm.config)
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    # float32 angles round by ~p * 2^-24 at position p: the bound below holds for the 1,024 positions made here
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    (rows, _), = [list(i.dims) for i in graph.initializer if i.name == "cos_cache"]
    assert rows == config["max_position_embeddings"] == 1024, "the builder sized its cos cache from another context"
    assert _rotary_error(folder, config) < 1e-4
    wrong = {**config, "rope_theta": theta * 10, "rope_parameters": {"rope_type": "default", "rope_theta": theta * 10}}
    assert _rotary_error(folder, wrong) > 0.1  # what a builder falling back to another theta would show


@pytest.mark.parametrize("name", SCHEMES)
def test_onnxruntime_reproduces_the_torch_reference(exported, name: str) -> None:
    """fp32 compute (accuracy_level 1): same codes, same function -> same NLL and logits to rounding."""
    _, folder, ct = exported[name]
    windows = torch.randint(3, 290, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = TorchEngine(ct, streamed=False).score(windows, reference=None)
    ort = OnnxRuntimeEngine(folder)
    got = ort.score(windows, reference=ref)
    assert torch.allclose(got["nll"], ref["nll"], atol=2e-4, rtol=0), (got["nll"] - ref["nll"]).abs().max()
    assert got["kl"].max().item() < 1e-5 and kld_kind(got) == EXACT  # full-vocabulary KL, from the reference head
    assert got["top1"].mean().item() == 1.0
    again = ort.score(windows, reference=ref)
    assert torch.equal(again["nll"], got["nll"])  # deterministic


def test_decode_with_kv_cache_matches_full_forward(exported) -> None:
    _, folder, _ = exported["g32-sym"]
    ort = OnnxRuntimeEngine(folder)
    ids = torch.randint(3, 290, (1, 20), generator=torch.Generator().manual_seed(2)).numpy()
    full, _ = ort._run(ids)
    logits, past = ort._run(ids[:, :12])
    steps = [logits[:, -1]]
    for t in range(12, 19):
        logits, past = ort._run(ids[:, t : t + 1], past, t)
        steps.append(logits[:, -1])
    assert np.allclose(np.stack(steps, 1), full[:, 11:19], atol=1e-4)
    tput = ort.throughput(torch.from_numpy(ids), decode_tokens=4, repeats=1)
    assert tput["prefill_tokens_per_s"]["median"] > 0 and tput["decode_tokens_per_s"]["n"] == 1


def test_default_accuracy_level_quantizes_activations_and_stays_close(exported, tmp_path: Path) -> None:
    qm, _, ct = exported["g32-sym"]
    export_onnx(qm, tmp_path / "acc4")  # ORT's CPU default: int8 activations inside MatMulNBits
    graph = onnx.load(str(tmp_path / "acc4" / "model.onnx"), load_external_data=False).graph
    levels = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}
    windows = torch.randint(3, 290, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = TorchEngine(ct, streamed=False).score(windows)
    got = OnnxRuntimeEngine(tmp_path / "acc4").score(windows)
    change = got["nll"].mean().exp() / ref["nll"].mean().exp() - 1
    assert 0 < abs(change.item()) < 0.02  # different arithmetic, same weights


def test_refuses_what_matmulnbits_cannot_hold_exactly() -> None:
    bad = {  # (8-bit weights go in as Q/DQ instead: tests/unit/test_onnx_qdq.py)
        "channel": Scheme(TensorSpec("int4", "channel")),
        "g48": Scheme(TensorSpec("int4", "group", group_size=48)),
        "w8a8-dynamic": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True)),
        "w4a8": Scheme(TensorSpec("int4", "group", group_size=32), TensorSpec("int8", "token", dynamic=True)),
        "kv": Scheme(TensorSpec("int4", "group", group_size=32), kv_cache=TensorSpec("fp8_e4m3", "tensor")),
    }
    for name, scheme in bad.items():
        with pytest.raises(IncompatibleTargetError) as e:
            check_scheme(scheme)
        assert e.value.fix, name
    check_scheme(SCHEMES["g32-asym"])
    check_scheme(Scheme(TensorSpec("int8", "channel")))
    check_scheme(Scheme(TensorSpec("fp8_e4m3", "channel")))


def test_planner_accepts_w4a16_and_refuses_dynamic_w8a8_for_onnxruntime() -> None:
    from llmc.planning.plan import check_target
    from llmc.recipe.schema import Target

    target = Target(runtime="onnxruntime", gpu_arch="cpu")
    assert check_target(SCHEMES["g32-sym"], target)[0] == "cpu"
    # 8-bit schemes go to the Q/DQ exporter (tests/unit/test_onnx_qdq.py), which needs static activations
    with pytest.raises(IncompatibleTargetError, match="static activation scales"):
        check_target(Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True)), target)
    with pytest.raises(IncompatibleTargetError, match="MatMulNBits"):
        check_target(Scheme(TensorSpec("int4", "channel")), target)


def test_engine_names_a_damaged_artifact(exported, tmp_path: Path) -> None:
    import shutil

    _, folder, _ = exported["g32-sym"]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "model.onnx").write_bytes((folder / "model.onnx").read_bytes()[:1000])
    with pytest.raises(EngineFailed, match="could not load"):
        OnnxRuntimeEngine(broken)
    (broken / "genai_config.json").unlink()
    with pytest.raises(EngineFailed, match="genai_config.json"):
        OnnxRuntimeEngine(broken)


def test_inspect_describes_the_folder(exported) -> None:
    from llmc.publish.inspect import describe

    _, folder, _ = exported["g32-sym"]
    text = describe(folder)
    assert "ONNX Runtime model folder" in text and "MatMulNBits" in text and "accuracy_level 1" in text


def test_float32_scales_round_to_fp16_within_its_unit_roundoff() -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-8, 8, (8, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(8, 2, generator=g) * 0.05 + 0.01
    exact = (codes.float().reshape(8, 2, 32) * scale[..., None]).reshape(8, 64)
    err = (GF.dequantize_gptq(GF.to_gptq(codes, scale, None, 4), 4) - exact).abs()
    assert 0 < err.max() and (err <= exact.abs() * 2.0**-11 + 1e-12).all()


# --- AWQ format (LMDeploy / vLLM awq) and GPTQ format as targets ----------------------------------------

def test_awq_packing_uses_the_interleaved_nibble_order() -> None:
    # output column 8j + AWQ_ORDER[k] sits in nibble k: columns 0..7 holding codes 0..7 pack to 0x75316420
    codes = torch.arange(8, dtype=torch.int64).reshape(1, 8)
    assert int(AF.pack_columns(codes)[0, 0]) & 0xFFFFFFFF == 0x75316420
    g = torch.Generator().manual_seed(5)
    many = torch.randint(0, 16, (24, 64), generator=g)
    assert torch.equal(AF.unpack_columns(AF.pack_columns(many)), many)


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_tensors_decode_to_the_canonical_weights(symmetric: bool) -> None:
    g = torch.Generator().manual_seed(2)
    out_f, in_f, group = 16, 64, 32
    codes = torch.randint(-8, 8, (out_f, in_f), generator=g, dtype=torch.int8)
    scale = (torch.rand(out_f, in_f // group, generator=g) * 0.05 + 0.01).half().float()
    zp = torch.randint(-8, 8, scale.shape, generator=g, dtype=torch.int8) if not symmetric else None
    t = AF.to_awq(codes, scale, zp)
    zero = zp.float()[..., None] if zp is not None else 0.0
    expected = ((codes.float().reshape(out_f, -1, group) - zero) * scale[..., None]).reshape(out_f, in_f)
    assert torch.equal(AF.dequantize_awq(t, group), expected)
    assert t["qweight"].shape == (in_f, out_f // 8) and t["qzeros"].shape == (in_f // group, out_f // 8)
    assert t["scales"].shape == (in_f // group, out_f) and t["scales"].dtype == torch.float16
    if symmetric:  # unsigned zero 8 in every nibble
        assert (t["qzeros"] == -0x77777778).all()  # 0x88888888 as int32


def test_awq_refuses_what_the_format_cannot_hold() -> None:
    for scheme in (Scheme(TensorSpec("int8", "channel")), Scheme(TensorSpec("int4", "channel")),
                   Scheme(TensorSpec("fp8_e4m3", "channel")),
                   Scheme(TensorSpec("int4", "group", group_size=32), TensorSpec("int8", "token", dynamic=True))):
        with pytest.raises(IncompatibleTargetError) as e:
            AF.check_scheme(scheme)
        assert e.value.fix
    assert AF.check_scheme(SCHEMES["g32-asym"]) == 32


@pytest.mark.parametrize("name", SCHEMES)
def test_onnxruntime_genai_awq_loader_reads_llmc_awq_to_the_canonical_weights(exported, name: str, tmp_path: Path) -> None:
    """An independent reader of the AWQ layout (onnxruntime-genai's loader, written for AutoAWQ
    checkpoints) turns llmc's files into exactly the weights llmc quantized."""
    import subprocess
    import sys

    qm, _, _ = exported[name]
    summary = AF.export_awq(qm, tmp_path / "awq", serve=AF.serve_args(tensor_parallel=2))
    assert summary["max_relative_weight_error_fp16_scales"] == 0.0
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["version"], q["bits"], q["group_size"], q["zero_point"]) == ("awq", "gemm", 4, 32, True)
    serve = json.loads((tmp_path / "awq" / "llmc-serve.json").read_text())
    assert "--model-format awq" in serve["command"] and "--tp 2" in serve["command"]
    proc = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tmp_path / "awq"), "-o",
         str(tmp_path / "onnx"), "-p", "int4", "-e", "cpu", "-c", str(tmp_path / "cache"), "--extra_options",
         "nodes_to_exclude=" + ",".join(UNQUANTIZED_NODES), "accuracy_level=1"],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    decoded = _matmulnbits_weights(tmp_path / "onnx")
    tensors = _canonical(qm)
    for i in range(qm.config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for node, module in ((f"/model/layers.{i}/attn/o_proj/MatMulNBits", f"{p}.self_attn.o_proj"),
                             (f"/model/layers.{i}/mlp/down_proj/MatMulNBits", f"{p}.mlp.down_proj"),
                             (f"/model/layers.{i}/mlp/gate_proj/MatMulNBits", f"{p}.mlp.gate_proj")):
            assert np.array_equal(decoded[node], qm.dequantized_weight(tensors, module).double().numpy()), node


def test_lmdeploy_and_exllamav2_targets_plan_build_and_inspect(exported, tmp_path: Path) -> None:
    from llmc.planning.plan import check_target
    from llmc.recipe.schema import Target
    from llmc.publish.inspect import describe

    assert check_target(SCHEMES["g32-sym"], Target(runtime="lmdeploy", gpu_arch="sm80"))[0] == "native"
    with pytest.raises(IncompatibleTargetError, match="sm75"):
        check_target(SCHEMES["g32-sym"], Target(runtime="lmdeploy", gpu_arch="sm70"))
    with pytest.raises(IncompatibleTargetError, match="CPU"):
        check_target(SCHEMES["g32-sym"], Target(runtime="exllamav2", gpu_arch="cpu"))
    with pytest.raises(IncompatibleTargetError, match="W8A16-INT8"):
        check_target(Scheme(TensorSpec("int8", "channel")), Target(runtime="exllamav2", gpu_arch="sm90"))
    qm, _, _ = exported["g32-asym"]
    AF.export_awq(qm, tmp_path / "awq", serve=AF.serve_args())
    GF.export_gptq(qm, tmp_path / "gptq", serve=GF.serve_args())
    awq, gptq = describe(tmp_path / "awq"), describe(tmp_path / "gptq")
    assert "AWQ checkpoint (GEMM layout)" in awq and "LMDeploy" in awq and "lmdeploy serve" in awq
    assert "GPTQ-format checkpoint" in gptq and "ExLlamaV2" in gptq and "serve with" in gptq


def test_the_model_builder_stamps_its_own_commit_not_the_enclosing_repository_s(tmp_path: Path) -> None:
    """onnxruntime-genai's builder stamps producer_version with `git rev-parse HEAD` run five folders above its own
    file: inside a project whose .venv holds it, that is the project's commit, and the artifact's bytes changed with
    every commit (scripts/compare_exports.py found model.onnx differing between two builds of the same tree). Here
    the builder's module believes it lives in a fresh git repository; with llmc's builder environment it reports
    the wheel's commit, without it the repository's."""
    import os
    import subprocess
    import sys

    og = pytest.importorskip("onnxruntime_genai")
    from llmc.formats.onnx_genai import builder_env

    repo = tmp_path / "project"
    builders = repo / "lib" / "python" / "site-packages" / "onnxruntime_genai" / "builders"  # repo: 5 folders up
    builders.mkdir(parents=True)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    probe = [sys.executable, "-c", "import onnxruntime_genai.models.builders.base as b; "
                                   f"b.__file__ = {str(builders / 'base.py')!r}; print(b.Model.get_genai_commit())"]
    plain = subprocess.run(probe, capture_output=True, text=True, env=dict(os.environ), check=True).stdout.strip()
    ours = subprocess.run(probe, capture_output=True, text=True, env=builder_env(), check=True).stdout.strip()
    assert plain == head  # the builder's own behaviour: the enclosing repository's commit
    assert ours != head and ours == str(og.__commit__ or None)
