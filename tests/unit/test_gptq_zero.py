"""GPTQ v1 artifacts mean one thing to every reader (issue 46's zero point of 0).

The v1 layout (`checkpoint_format: gptq`, llmc's `gptq` format) stores zero - 1, so an asymmetric unsigned zero of 0
would be stored as 2^b - 1, which GPTQ's readers read three ways (read in their sources, docs/model-sources.md):

- zero = field + 1 = 2^b: vLLM's gptq_gemm (v1: zero_offset 1), ExLlamaV2's GPTQ kernel, AutoGPTQ's cuda and triton
  kernels (`_plus_one` below);
- zero = (field + 1) mod 2^b = 0: onnxruntime-genai's GPTQ loader (loaders/gptq.py, handle_qzeros), AutoGPTQ's
  cuda_old torch path, GPTQModel's offline dequantizer (`_wrapped`);
- GPTQModel's v1 -> v2 conversion before its v2 kernels (torch, exllamav2, ...; transformers and optimum call it):
  0x11111111 added to each int32 word, so the field reads 0 and its carry adds 1 to the next column's zero
  (`_word_add`).

llmc's gptq format asks the quantizer to keep zero points off 0 (`zero_grid: nonzero`; such a range takes a
one-level narrower grid) and its exporter refuses a zero of 0. These decoders are written here from that
description, not taken from any of those libraries (none is installed here).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from llmc.errors import IncompatibleTargetError
from llmc.formats import gptq_format as GF
from llmc.model.checkpoint import CheckpointReader
from llmc.quant.numerics import dequantize, qparams_from_range, quantize_weight
from llmc.quant.spec import Scheme, TensorSpec, with_zero_grid

sys.path.insert(0, str(Path(__file__).parent))
from build_helpers import stored  # noqa: E402
from families import make_tiny  # noqa: E402

ASYM32 = TensorSpec("int4", "group", group_size=32, symmetric=False)
NONNEGATIVE = "model.layers.0.mlp.up_proj"  # its first rows are made >= 0: the plain grid's zero point there is 0


# --------------------------------------------------------------------------- three readers of a v1 checkpoint

def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [n, m] -> their unsigned fields [n, m * 32 / bits], low bits first."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def _plus_one(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return _fields(qzeros, bits) + 1


def _wrapped(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return (_fields(qzeros, bits) + 1) % (1 << bits)


def _word_add(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    ones = sum(1 << s for s in range(0, 32, bits))  # 0x11111111 for 4 bits, 0x01010101 for 8
    return _fields(((qzeros.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF, bits)


READERS = {"plus-one (vLLM, ExLlamaV2)": _plus_one, "wrapped (onnxruntime-genai)": _wrapped,
           "word add (GPTQModel v1->v2)": _word_add}


def _decode(t: dict[str, torch.Tensor], bits: int, zeros_of) -> torch.Tensor:
    """weight [out, in] = scales[g, o] * (q[i, o] - zero[g, o]), g = g_idx[i], in float32."""
    q = _fields(t["qweight"].t().contiguous(), bits).t()  # [in, out]: packed along the input
    out_f = t["scales"].shape[1]
    zero = zeros_of(t["qzeros"], bits)[:, :out_f]  # [groups, out]: packed along the output
    g = t["g_idx"].long()
    return (t["scales"].float()[g] * (q - zero[g]).float()).t()


# --------------------------------------------------------------------------- the quantizer's grid

def test_nonzero_grid_moves_only_the_ranges_whose_zero_was_the_lowest_code() -> None:
    """Ranges whose plain zero point would be qmin (lo > -scale/2; all-zero ones too) get zero qmin + 1 and the
    scale (hi - lo) / (2^b - 2): no value clipped. Every other range keeps its scale and zero point exactly."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g)
    w[:8] = w[:8].abs()  # lo = 0: plain zero point qmin
    w[8:12] = w[8:12].abs() - 0.01  # lo slightly below 0: still rounds to qmin
    w[12, :32] = 0.0  # an all-zero group
    plain = quantize_weight(w, ASYM32)
    grid = quantize_weight(w, replace(ASYM32, zero_grid="nonzero"))
    moved = plain.zero_point == -8
    assert moved[:12].all() and moved[12, 0] and moved.sum() < moved.numel()  # the premise: both kinds occur
    assert (grid.zero_point >= -7).all()
    assert torch.equal(grid.zero_point[~moved], plain.zero_point[~moved])
    assert torch.equal(grid.scale[~moved], plain.scale[~moved])
    assert (grid.zero_point[moved] == -7).all()
    lo, hi = w.reshape(64, 3, 32).amin(-1), w.reshape(64, 3, 32).amax(-1)
    narrow = (hi - lo.clamp(max=0)) / 14
    assert torch.equal(grid.scale[moved & (narrow > 0)], narrow[moved & (narrow > 0)])
    error = (dequantize(grid.codes, grid.scale, grid.zero_point, ASYM32) - w).abs().reshape(64, 3, 32)
    assert (error <= grid.scale[..., None] * 0.5 * (1 + 1e-6)).all()  # rounding only, no clipping


def test_qparams_of_symmetric_and_float_specs_ignore_the_zero_grid() -> None:
    lo, hi = torch.tensor([0.0, -1.0]), torch.tensor([2.0, 3.0])
    for spec in (TensorSpec("int4", "channel"), TensorSpec("fp8_e4m3", "channel")):
        a, b = qparams_from_range(lo, hi, spec), qparams_from_range(lo, hi, replace(spec, zero_grid="nonzero"))
        assert torch.equal(a[0], b[0]) and a[1] is None and b[1] is None


# --------------------------------------------------------------------------- the scheme the plan gives

def _recipe(folder: Path, weights: dict, *targets: dict):
    from llmc.recipe.load import parse_recipe

    return parse_recipe(yaml.safe_dump({"name": "z", "model": {"source": str(folder)},
                                        "quantization": {"weights": weights}, "targets": list(targets)}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny llama whose up_proj has 8 rows >= 0 (groups a plain asymmetric grid gives a zero point of 0)."""
    folder = make_tiny("llama", tmp_path_factory.mktemp("gptq-zero") / "model")
    f = next(folder.glob("*.safetensors"))
    tensors = load_file(str(f))
    w = tensors[f"{NONNEGATIVE}.weight"]
    w[:8] = w[:8].abs()
    save_file(tensors, str(f), metadata={"format": "pt"})
    return folder


ASYM = {"format": "int4", "strategy": "group", "group_size": 32, "symmetric": False}
SYM = {"format": "int4", "strategy": "group", "group_size": 32, "symmetric": True}


def test_the_plan_sets_the_zero_grid_for_a_gptq_target_only(tiny: Path) -> None:
    from llmc.planning.plan import make_plan

    exl = {"runtime": "exllamav2"}
    vllm = {"runtime": "vllm", "gpu_arch": "sm90"}
    plan = make_plan(_recipe(tiny, ASYM, exl), tiny)
    assert plan.schemes[""].weights.zero_grid == "nonzero"
    assert [w for w in plan.warnings if "kept off 0 for the GPTQ-format target(s) exllamav2" in w]
    assert make_plan(_recipe(tiny, ASYM, vllm, exl), tiny).schemes[""].weights.zero_grid == "nonzero"  # one form
    plain = make_plan(_recipe(tiny, ASYM, vllm), tiny).schemes[""]
    assert plain.weights.zero_grid is None and "zero_grid" not in plain.to_dict()["weights"]  # stage keys as before
    sym = make_plan(_recipe(tiny, SYM, exl), tiny).schemes[""]  # the shipped gptq recipe's case: nothing changes
    assert sym.weights.zero_grid is None and "zero_grid" not in sym.to_dict()["weights"]
    assert not [w for w in make_plan(_recipe(tiny, SYM, exl), tiny).warnings if "kept off 0" in w]
    grid = with_zero_grid(Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False)), "nonzero")
    assert grid.to_dict()["weights"]["zero_grid"] == "nonzero" and grid.weights.describe().endswith("/nonzero-zeros")


# --------------------------------------------------------------------------- the artifact, read by each reader

def test_every_reader_decodes_the_gptq_artifact_to_the_canonical_weights(tiny: Path, tmp_path: Path) -> None:
    """A tiny model whose asymmetric export would hold a zero of 0, quantized with the scheme the plan gives an
    exllamav2 target and exported: no stored zero is 2^b - 1, and the three readers' decoders and llmc's own reader
    give the canonical weights (codes x the stored float16 scales) bit for bit. Quantized without the zero grid
    (the old behaviour), the same model's export is refused, and its bytes would read three ways."""
    from llmc.model.source import ModelSource
    from llmc.planning.plan import make_plan
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.stream import quantize_model

    scheme = make_plan(_recipe(tiny, ASYM, {"runtime": "exllamav2"}), tiny).schemes[""]
    quantize_model(ModelSource(tiny, "t", "t"), scheme, tmp_path / "q", None)
    qm = QuantizedModel.open(tmp_path / "q")
    GF.export_gptq(qm, tmp_path / "gptq")
    written = stored(tmp_path / "gptq")
    reader = CheckpointReader(tmp_path / "gptq", torch.float32)
    canonical = {}
    for tensors in qm.iter_files():
        canonical.update(tensors)
    names = [n[: -len(".qweight")] for n in written if n.endswith(".qweight")]
    assert f"{NONNEGATIVE}" in names
    for m in names:
        t = {k: written[f"{m}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
        assert not (_fields(t["qzeros"], 4) == 15).any(), m
        decoded = {name: _decode(t, 4, f) for name, f in READERS.items()}
        first = next(iter(decoded.values()))
        for name, d in decoded.items():
            assert torch.equal(d, first), (m, name)
        assert torch.equal(reader.get(f"{m}.weight").float(), first), m  # llmc's reader of GPTQ sources
        c = canonical  # the canonical codes with the stored float16 scales
        expected = dequantize(c[f"{m}.weight"], t["scales"].float().t(), c[f"{m}.weight_zero_point"], ASYM32)
        assert torch.equal(first, expected), m

    # the old behaviour: the plain grid gives the non-negative rows a zero point of 0
    old = Scheme(replace(scheme.weights, zero_grid=None))
    quantize_model(ModelSource(tiny, "t", "t"), old, tmp_path / "q-old", None)
    old_qm = QuantizedModel.open(tmp_path / "q-old")
    with pytest.raises(IncompatibleTargetError, match="zero point of 0"):
        GF.export_gptq(old_qm, tmp_path / "gptq-old")
    q = quantize_weight(load_file(str(next(tiny.glob("*.safetensors"))))[f"{NONNEGATIVE}.weight"].float(), ASYM32)
    t = vars(GF.to_gptq(q.codes, q.scale, q.zero_point, 4, v1_zeros_checked=False))
    assert (_fields(t["qzeros"], 4) == 15).any()
    decoded = [_decode(t, 4, f) for f in READERS.values()]
    assert not torch.equal(decoded[0], decoded[1]) and not torch.equal(decoded[1], decoded[2])


def test_the_exporter_refuses_a_zero_of_0_and_says_why() -> None:
    codes = torch.zeros(8, 32, dtype=torch.int8)
    scale = torch.ones(8, 1)
    zero = torch.full((8, 1), -7, dtype=torch.int8)
    GF.to_gptq(codes, scale, zero, 4)  # zero 1 (stored 0): fine
    zero[3, 0] = -8
    with pytest.raises(IncompatibleTargetError, match="stores as 15") as e:
        GF.to_gptq(codes, scale, zero, 4)
    assert "zero_grid" in e.value.fix or "symmetric" in e.value.fix
    t = GF.to_gptq(codes, scale, zero, 4, v1_zeros_checked=False)  # onnxruntime-genai's loader reads it as 0
    assert torch.equal(GF.dequantize_gptq(t, 4), _decode(vars(t), 4, _wrapped))
