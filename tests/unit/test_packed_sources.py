"""Packed quantized sources (llmc.model.source_formats): compressed-tensors, NVIDIA ModelOpt, GPTQ and AWQ
checkpoints decoded tensor by tensor as the layer stream reads them. Each decoder against a reference decoder
(compressed-tensors' own checkpoint dequantizer; GPTQModel's and AutoAWQ's dequantization formulas, written out
here; llmc's exporters as the encoders, their own independent decoders as a second check), a build from a tiny
model saved in each format by llmc's exporters, and the refusals of variants no decoder reads."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from llmc.cli import main
from llmc.errors import InputError
from llmc.model import source_formats as sf
from llmc.model.checkpoint import CheckpointReader

sys.path.insert(0, str(Path(__file__).parent))
from build_helpers import stored as _stored  # noqa: E402
from families import make_tiny  # noqa: E402
from test_build import recipe_text  # noqa: E402
from test_source_formats import _build as _build_with  # noqa: E402  (the same CLI build of a recipe)

LINEARS = 14  # the tiny llama's decoder-layer Linears: 2 layers x q, k, v, o, gate, up, down


def _int4_asym():
    from llmc.quant.spec import Scheme, TensorSpec

    return Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False))


def _schemes():
    from llmc.quant.spec import Scheme, TensorSpec

    return {"int4": _int4_asym(),
            "int8": Scheme(TensorSpec("int8", "channel")),
            "fp8": Scheme(TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor")),
            "nvfp4": Scheme(TensorSpec("nvfp4", "group", group_size=16), TensorSpec("nvfp4", "group", group_size=16))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One tiny llama (hidden 256: whole int32 words and 128x128 tiles) saved in every packed format llmc exports:
    compressed-tensors pack-quantized int4 (asymmetric, groups of 32), int-quantized int8, float-quantized FP8 and
    nvfp4-pack-quantized; ModelOpt FP8 and NVFP4; GPTQ and AWQ int4."""
    from llmc.formats import awq_format, gptq_format
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.modelopt_hf import export_modelopt_hf
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.stream import Calibration, quantize_model

    root = tmp_path_factory.mktemp("packed")
    tiny = make_tiny("llama", root / "tiny", hidden_size=256, intermediate_size=384, num_attention_heads=4,
                     num_key_value_heads=2)
    calibration = Calibration(torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0)))
    out = {"tiny": tiny}
    for name, scheme in _schemes().items():
        static = scheme.activations is not None
        quantize_model(ModelSource(tiny, "t", "t"), scheme, root / f"q-{name}", calibration if static else None)
        qm = QuantizedModel.open(root / f"q-{name}")
        out[f"canonical-{name}"] = root / f"q-{name}"
        export_compressed_tensors(qm, root / f"ct-{name}")
        out[f"ct-{name}"] = root / f"ct-{name}"
        if static:
            export_modelopt_hf(qm, root / f"modelopt-{name}")
            out[f"modelopt-{name}"] = root / f"modelopt-{name}"
        if name == "int4":
            gptq_format.export_gptq(qm, root / "gptq")
            awq_format.export_awq(qm, root / "awq")
            out["gptq"], out["awq"] = root / "gptq", root / "awq"
    return out


def _decoded(folder: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder, dtype)
    names = [n for n in reader.names() if reader.encoded(n) is not None]
    assert len(names) == LINEARS, names
    return {n: reader.get(n) for n in names}


# --------------------------------------------------------------------------- compressed-tensors

@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8", "nvfp4"])
def test_compressed_tensors_decoder_equals_compressed_tensors_dequantizer(kind: str, saved: dict) -> None:
    """The reference: compressed-tensors' own checkpoint dequantizer (entrypoints.convert), whole file at once; the
    reader decodes module by module through the same decompressors. NVFP4: compressed-tensors rounds its decoded
    values to bf16 whatever the dtype asked; llmc keeps the float32 product, which rounds to exactly its bf16."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    folder = saved[f"ct-{kind}"]
    stored = _stored(folder)
    # without a model it matches `Linear` targets by tensor name: only the quantized modules' tensors are given
    quantized = {n: t for n, t in stored.items() if f"{n.rsplit('.', 1)[0]}.weight_scale" in stored}
    reference = CompressedTensorsDequantizer(folder, dtype=torch.float32).process(quantized)
    ours = _decoded(folder)
    for name, t in ours.items():
        if kind == "nvfp4":
            assert torch.equal(t.to(torch.bfloat16), reference[name].to(torch.bfloat16)), name
        else:
            assert torch.equal(t, reference[name]), name
    if kind == "nvfp4":  # the float32 product kept: compressed-tensors' values are its bf16 rounding
        assert all(not torch.equal(t, reference[n].float()) for n, t in ours.items())


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8", "nvfp4"])
def test_compressed_tensors_decodes_to_what_llmc_quantized(kind: str, saved: dict) -> None:
    """The encoder's side: llmc's canonical codes x scales (its own dequantization) are the decoded weights."""
    from llmc.quant.canonical import QuantizedModel

    qm = QuantizedModel.open(saved[f"canonical-{kind}"])
    canonical = {}
    for f in qm.files():
        canonical.update(load_file(str(f)))
    ours = _decoded(saved[f"ct-{kind}"])
    for name, t in ours.items():
        expected = qm.dequantized_weight(canonical, name[: -len(".weight")])
        assert torch.equal(t, expected.float()), name


def test_compressed_tensors_source_is_detected_and_variants_refused() -> None:
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                         "strategy": "group", "group_size": 128}}}}
    fmt = sf.source_format({"quantization_config": qc})
    assert fmt.name == "compressed-tensors" and "pack-quantized int4 group" in fmt.describe()
    for change, message in [({"format": "marlin-24"}, "format 'marlin-24'"),
                            ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
                            ({"transform_config": {"config_groups": {}}}, "transform_config"),
                            ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
                            ({"config_groups": {}}, "no config_groups")]:
        with pytest.raises(InputError, match=message):
            sf.source_format({"quantization_config": {**qc, **change}})


# --------------------------------------------------------------------------- ModelOpt

def _modelopt_reference(stored: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """ModelOpt's dequantization as its docs state it, element by element from the definitions: FP8, code x
    weight_scale; NVFP4, E2M1 value (low nibble = even element) x (E4M3 block scale x weight_scale_2)."""
    codes, scale = stored[f"{module}.weight"], stored[f"{module}.weight_scale"]
    if codes.dtype == torch.float8_e4m3fn:
        return codes.float() * scale.float()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    low, high = e2m1[(codes & 0xF).long()], e2m1[(codes >> 4).long()]
    values = torch.stack([low, high], dim=-1).reshape(codes.shape[0], -1)
    block = (scale.float() * stored[f"{module}.weight_scale_2"].float()).repeat_interleave(16, dim=1)
    return values * block


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_modelopt_decoder_against_the_formula_and_llmc_quantized_values(kind: str, saved: dict) -> None:
    from llmc.quant.canonical import QuantizedModel

    folder = saved[f"modelopt-{kind}"]
    stored = _stored(folder)
    ours = _decoded(folder)
    qm = QuantizedModel.open(saved[f"canonical-{kind}"])
    canonical = {}
    for f in qm.files():
        canonical.update(load_file(str(f)))
    for name, t in ours.items():
        module = name[: -len(".weight")]
        assert torch.equal(t, _modelopt_reference(stored, module)), name
        expected = qm.dequantized_weight(canonical, module).float()
        if kind == "fp8":
            assert torch.equal(t, expected), name
        else:  # weight_scale_2 is the float32 reciprocal of the global scale: one rounding apart (modelopt_hf)
            assert torch.allclose(t, expected, rtol=2**-22, atol=0), name
    fmt = CheckpointReader(folder).source_format
    assert fmt.name == "modelopt" and fmt.variant == kind.upper()


def test_modelopt_block_fp8_decodes_as_the_fp8_block_decoder() -> None:
    from llmc.quant.block_fp8 import quantize_fp8_blocks

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize_fp8_blocks(w, (128, 128))
    tiled = scale.reshape(2, 1, 3, 1)  # ModelOpt 0.47's FP8_PB_WO layout
    assert torch.equal(sf.decode_modelopt(codes, tiled, None), sf.decode_fp8(codes, scale, (128, 128)))
    header = {"m.weight": ("F8_E4M3", (200, 300)), "m.weight_scale": ("F32", (2, 1, 3, 1)),
              "m.input_scale": ("F32", ())}
    assert sf.decoded_header(sf.SourceFormat("modelopt", "modelopt"), header) == {"m.weight": ("F32", (200, 300))}


def test_modelopt_variants_refused_naming_them() -> None:
    with pytest.raises(InputError, match="quant_algo 'W4A16_AWQ'"):
        sf.source_format({}, {"quantization": {"quant_algo": "W4A16_AWQ"}})
    with pytest.raises(InputError, match="quant_algo 'INT8_SQ'"):
        sf.source_format({}, {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "a": {"quant_algo": "NVFP4"}, "b": {"quant_algo": "INT8_SQ"}}}})
    assert sf.source_format({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}).name == \
        "modelopt"
    with pytest.raises(InputError, match="pre_quant_scale"):
        sf.decoded_header(sf.SourceFormat("modelopt", "modelopt"), {
            "m.weight": ("U8", (8, 16)), "m.weight_scale": ("F8_E4M3", (8, 2)), "m.pre_quant_scale": ("F16", (32,))})


# --------------------------------------------------------------------------- GPTQ and AWQ

def _gptq_reference(qweight, qzeros, scales, g_idx, bits: int) -> torch.Tensor:
    """GPTQModel's torch kernel (dequantize_weight), v1 checkpoint: unpack along the input (qweight) and the output
    (qzeros), zeros + 1, scales[g_idx] * (weight - zeros[g_idx]); here element-wise, in float64."""
    per, mask = 32 // bits, (1 << bits) - 1
    rows, cols = qweight.shape[0] * per, qweight.shape[1]
    q = torch.empty(rows, cols, dtype=torch.int64)
    for i in range(rows):
        q[i] = (qweight[i // per].long() >> (bits * (i % per))) & mask
    z = torch.empty(qzeros.shape[0], cols, dtype=torch.int64)
    for o in range(cols):
        z[:, o] = (qzeros[:, o // per].long() >> (bits * (o % per))) & mask
    g = g_idx.long()
    return (scales.double()[g] * (q - (z[g] + 1)).double()).t()


def _awq_reference(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: unpack 8 nibbles a word in order, then reorder by AWQ_REVERSE_ORDER
    [0, 4, 1, 5, 2, 6, 3, 7]; (iweight - izeros) * scales, both repeated over each group; float64."""
    shifts = torch.arange(0, 32, 4)
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack(words: torch.Tensor) -> torch.Tensor:
        nibbles = (words.long().unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8] in storage order
        return nibbles[:, :, reverse].reshape(words.shape[0], -1)

    iweight, izeros = unpack(qweight), unpack(qzeros).repeat_interleave(group_size, dim=0)
    return ((iweight - izeros).double() * scales.double().repeat_interleave(group_size, dim=0)).t()


@pytest.mark.heavy  # the element-wise reference is a Python loop
def test_gptq_decoder_against_gptqmodels_formula_and_llmcs_exporter(saved: dict) -> None:
    from llmc.formats.gptq_format import GPTQTensors, dequantize_gptq

    stored = _stored(saved["gptq"])
    ours = _decoded(saved["gptq"])
    for name, t in ours.items():
        m = name[: -len(".weight")]
        parts = (stored[f"{m}.qweight"], stored[f"{m}.qzeros"], stored[f"{m}.scales"], stored[f"{m}.g_idx"])
        assert torch.equal(t.double(), _gptq_reference(*parts, bits=4)), name  # exact: 5-bit x fp16 fits float32
        assert torch.equal(t, dequantize_gptq(GPTQTensors(*parts), 4)), name  # llmc's exporter's own decoder


def test_gptq_act_order_g_idx_and_v2_and_8_bit() -> None:
    """g_idx in a permuted order (desc_act) and 8-bit codes, decoded as GPTQModel's formula does; gptq_v2 stores
    the zero points as they are."""
    from llmc.formats.gptq_format import pack_along_rows

    g = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        rows, cols, group = 64, 16, 16
        q = torch.randint(0, 1 << bits, (rows, cols), generator=g)
        z = torch.randint(0, (1 << bits) - 1, (rows // group, cols), generator=g)
        qweight = pack_along_rows(q, bits)
        qzeros = pack_along_rows(z.t().contiguous(), bits).t().contiguous()
        scales = torch.rand(rows // group, cols, generator=g).half()
        g_idx = torch.randperm(rows, generator=g).int() // group
        ours = sf.decode_gptq(qweight, qzeros, scales, g_idx, bits, group)
        assert torch.equal(ours.double(), _gptq_reference(qweight, qzeros, scales, g_idx, bits)), bits
        v2 = sf.decode_gptq(qweight, qzeros, scales, g_idx, bits, group, zero_offset=0)
        assert torch.equal(v2.double(), _gptq_reference(qweight, qzeros, scales, g_idx, bits)
                           + scales.double()[g_idx.long()].t()), bits


def test_awq_decoder_against_autoawqs_formula_and_llmcs_exporter(saved: dict) -> None:
    from llmc.formats.awq_format import dequantize_awq

    stored = _stored(saved["awq"])
    ours = _decoded(saved["awq"])
    for name, t in ours.items():
        m = name[: -len(".weight")]
        parts = {k: stored[f"{m}.{k}"] for k in ("qweight", "qzeros", "scales")}
        assert torch.equal(t.double(), _awq_reference(*parts.values(), group_size=32)), name
        assert torch.equal(t, dequantize_awq(parts, 32)), name


def test_gptq_and_awq_decode_to_llmcs_codes_with_float16_scales(saved: dict) -> None:
    """The encoder's side: both formats hold llmc's canonical codes and zero points exactly, the scales rounded to
    float16: decoded = (code - zero) x fp16(scale)."""
    from llmc.quant.canonical import QuantizedModel

    qm = QuantizedModel.open(saved["canonical-int4"])
    canonical = {}
    for f in qm.files():
        canonical.update(load_file(str(f)))
    gptq, awq = _decoded(saved["gptq"]), _decoded(saved["awq"])
    for name in gptq:
        m = name[: -len(".weight")]
        codes, zero = canonical[f"{m}.weight"].float(), canonical[f"{m}.weight_zero_point"].float()
        scale = canonical[f"{m}.weight_scale"].half().float()
        expected = ((codes.view(codes.shape[0], -1, 32) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).view(codes.shape)
        assert torch.equal(gptq[name], expected) and torch.equal(awq[name], expected), name


def test_gptq_and_awq_variants_refused_naming_them() -> None:
    for qc, message in [({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
                        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
                         "checkpoint_format 'marlin'"),
                        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
                        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
                        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0")]:
        with pytest.raises(InputError, match=message):
            sf.source_format({"quantization_config": qc})
    fmt = sf.source_format({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    header = {"m.qweight": ("I32", (16, 64)), "m.qzeros": ("I32", (1, 8)), "m.scales": ("F16", (2, 64))}
    with pytest.raises(InputError, match=r"m.scales' is F16 \[2, 64\]; .* F16/BF16/F32 \[1, 64\]"):
        sf.decoded_header(fmt, header)


# --------------------------------------------------------------------------- the plan and a build from each

def _plan(source: Path, tmp_path: Path) -> tuple[int, str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text(source, tmp_path / "reg"))
    result = CliRunner().invoke(main, ["plan", str(recipe), "--cache-dir", str(tmp_path / "cache")])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.mark.heavy
@pytest.mark.parametrize("kind, says", [("ct-int4", "compressed-tensors (pack-quantized int4 group)"),
                                        ("modelopt-nvfp4", "NVIDIA ModelOpt NVFP4"),
                                        ("gptq", "GPTQ 4-bit, groups of 32"),
                                        ("awq", "AWQ GEMM 4-bit, groups of 32")])
def test_the_plan_names_the_source_format_and_reads_its_stored_bytes(kind: str, says: str, saved: dict,
                                                                     tmp_path: Path) -> None:
    from llmc.planning.shapes import Shape, from_headers

    code, out = _plan(saved[kind], tmp_path)
    assert code == 0, out
    assert says in out and "the baseline is the decoded original" in out, out
    tensors = from_headers(saved[kind])
    shape = Shape.of(tensors, json.loads((saved["tiny"] / "config.json").read_text()), 2)
    header_bytes = sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
                       for f in saved[kind].glob("*.safetensors"))
    assert sum(tensors.stored_bytes.values()) == header_bytes  # every stored part counted where it is read
    # the per-layer read: the layer's codes and scales, not 2 bytes a weight; its decoded elements, every Linear's
    linears = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 384
    assert shape.layer_decoded == linears
    assert shape.layer_stored_bytes < shape.layer_params * 2 * 0.6


@pytest.mark.heavy
def test_the_plans_layer_time_adds_the_probed_decode(saved: dict, tmp_path: Path, monkeypatch) -> None:
    """The quantize stage's per-layer time counts decoding the layer at the decoder's probed rate: made 10,000
    elements/s here, the tiny layer's 491,520 decoded elements take ~49 s of it (the plan prints whole seconds)."""
    import re

    from llmc.pipeline import quantize

    def per_layer_seconds() -> float:
        code, out = _plan(saved["gptq"], tmp_path)
        assert code == 0, out
        return float(re.search(r"~([\d.,]+) s per decoder layer", out).group(1).replace(",", ""))

    probed = per_layer_seconds()
    assert sf.decode_rate(sf.source_format(json.loads((saved["gptq"] / "config.json").read_text()))) > 1e5
    monkeypatch.setattr(quantize, "decode_rate", lambda fmt: 10_000.0)
    assert 48 <= per_layer_seconds() - probed <= 50


def _build(source: Path, tmp_path: Path, quantization: dict) -> tuple[int, str]:
    return _build_with(source, tmp_path, quantization, **{"eval.windows": 2, "calibration.samples": 2,
                                                            "gates.max_ppl_increase_pct": 1000.0})


W8A16_INT8 = {"weights": {"format": "int8", "strategy": "channel"}}


@pytest.mark.heavy
@pytest.mark.parametrize("kind, says", [("ct-nvfp4", "compressed-tensors (nvfp4-pack-quantized float4 tensor_group)"),
                                        ("modelopt-fp8", "NVIDIA ModelOpt FP8"),
                                        ("gptq", "GPTQ 4-bit"), ("awq", "AWQ GEMM 4-bit")])
def test_build_from_a_packed_source(kind: str, says: str, saved: dict, tmp_path: Path) -> None:
    """A build from each format: planned and reported with the decoded original as baseline, every Linear
    quantized from its decoded weight (the artifact's codes are llmc's quantization of the decoded values)."""
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import TensorSpec

    code, out = _build(saved[kind], tmp_path, W8A16_INT8)
    assert code == 0, out
    report = (tmp_path / "report" / "report.md").read_text()
    assert says in report and "the baseline is the decoded original" in report
    (meta,) = [json.loads(f.read_text()) for f in (tmp_path / "cache").rglob("quantized.json")]
    assert meta["source"]["decoded_from"].startswith(says)
    canonical = Path(next((tmp_path / "cache").rglob("quantized.json")).parent)
    written = load_file(str(canonical / "layers" / "00001.safetensors"))
    decoded = _decoded(saved[kind])
    layer1 = [n for n in decoded if n.startswith("model.layers.1.")]
    assert len(layer1) == 7
    for name in layer1:
        want = quantize_weight(decoded[name], TensorSpec("int8", "channel")).codes
        assert torch.equal(written[name], want), name


def test_an_unknown_config_is_still_exit_7_and_hf_quant_config_alone_is_decoded(saved: dict, tmp_path: Path) -> None:
    """ModelOpt's hf_quant_config.json alone (an older export: no quantization_config in config.json) is detected;
    a quant_algo no decoder reads is exit 7 naming it."""
    folder = Path(shutil.copytree(saved["modelopt-fp8"], tmp_path / "m"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    assert CheckpointReader(folder).source_format.name == "modelopt"
    hf = json.loads((folder / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = "W4A8_AWQ"
    (folder / "hf_quant_config.json").write_text(json.dumps(hf))
    code, out = _plan(folder, tmp_path)
    assert code == 7 and "quant_algo 'W4A8_AWQ'" in out, out


def test_the_torch_engine_keeps_reading_compressed_tensors_artifacts_as_before(saved: dict) -> None:
    """An artifact's compressed-tensors folder is still decompressed by the engine itself (its activation
    quantization applied), not by the source reader; a GPTQ folder is a decoded original to it."""
    from llmc.engines.torch_stream import LayerDecoder, is_decoded_original

    config = json.loads((saved["ct-fp8"] / "config.json").read_text())
    assert not is_decoded_original(saved["ct-fp8"], config)
    assert LayerDecoder(saved["ct-fp8"], config["quantization_config"]).reader.source_format is None
    assert is_decoded_original(saved["gptq"], json.loads((saved["gptq"] / "config.json").read_text()))


def test_a_packed_sources_other_tensors_read_as_stored(saved: dict) -> None:
    """Everything that is not a quantized Linear (embeddings, norms, the head) reads as it is stored."""
    reader = CheckpointReader(saved["gptq"])
    stored = _stored(saved["gptq"])
    plain = [n for n in reader.names() if reader.encoded(n) is None]
    assert "model.embed_tokens.weight" in plain and not any(n.endswith(("qweight", "qzeros", "g_idx")) for n in plain)
    for name in plain:
        assert torch.equal(reader.get(name), stored[name]), name


@pytest.mark.parametrize("kind", ["ct-fp8", "modelopt-fp8"])
def test_an_fp8_target_of_the_sources_strategy_keeps_its_codes(kind: str, saved: dict, tmp_path: Path) -> None:
    """FP8 per-tensor codes of a compressed-tensors or ModelOpt source, for an FP8 per-tensor target: written byte
    for byte with their scales (quantizing the decoded values again could pick another scale); an FP8 per-channel
    target of the same source quantizes the decoded values (another strategy: nothing to keep)."""
    from llmc.model.source import ModelSource
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    stored = _stored(saved[kind])
    reader = CheckpointReader(saved[kind])
    for strategy in ("tensor", "channel"):
        out = tmp_path / strategy
        quantize_model(ModelSource(saved[kind], "t", "t"), Scheme(TensorSpec("fp8_e4m3", strategy)), out, None)
        written = load_file(str(out / "layers" / "00001.safetensors"))
        linears = [n for n in stored if n.startswith("model.layers.1.") and n.endswith("_proj.weight")]
        assert len(linears) == 7
        for name in linears:
            if strategy == "tensor":
                assert written[name].view(torch.uint8).equal(stored[name].view(torch.uint8)), name
                assert written[name + "_scale"].equal(stored[name + "_scale"].float().reshape(1)), name
            else:
                assert written[name].equal(quantize_weight(reader.get(name), TensorSpec("fp8_e4m3", "channel"))
                                           .codes), name


@pytest.mark.parametrize("kind", ["gptq", "awq", "modelopt-nvfp4"])
def test_the_torch_engine_sizes_a_packed_source_as_decoded(kind: str, saved: dict) -> None:
    """Whole or streamed (torch_stream.decide_torch_loading) is decided on the dense size: each packed weight counts
    its decoded elements, not its stored bytes."""
    from llmc.engines.torch_stream import dense_bytes

    reader = CheckpointReader(saved[kind])
    decoded = sum(4 * reader.get(n).numel() for n in reader.names() if reader.encoded(n) is not None)
    assert dense_bytes(saved[kind], torch.float32) >= decoded


def test_the_statement_says_when_a_compressed_tensors_baseline_quantizes_activations(saved: dict) -> None:
    """The torch engine scores a compressed-tensors folder as it scores llmc's artifacts, activations quantized as
    its config groups say: the plan says so for such a source, and not for a weight-only one."""
    said = "with its activations quantized as its config_groups say"
    assert said in sf.statement(CheckpointReader(saved["ct-fp8"]).source_format, "float32")
    assert said not in sf.statement(CheckpointReader(saved["ct-int4"]).source_format, "float32")
    assert "the baseline is the decoded original" in sf.statement(CheckpointReader(saved["gptq"]).source_format,
                                                                  "bfloat16")
