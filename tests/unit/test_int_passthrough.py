"""Integer originals passed through (llmc.quant.int_source): a GPTQ, AWQ or compressed-tensors source whose integer
scheme is the target's keeps its codes, scales and zero points, and the target's format writes them again bit for
bit; a scheme that differs (another group size, another symmetry, an algorithm that chooses its own codes) requantizes
the decoded values, and the plan says which and why.

The sources are a tiny llama quantized by llmc and saved by its GPTQ, AWQ and compressed-tensors exporters (GPTQModel
and AutoAWQ are not installed here; the exporters' formats are checked against GPTQModel's and AutoAWQ's formulas and
compressed-tensors' own decompressor in test_packed_sources.py). The compressed-tensors sources get bfloat16 scales,
as llm-compressor writes them, so that requantizing (float32 scales) could not give the same tensors by chance."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from llmc.cli import main
from llmc.model.checkpoint import CheckpointReader
from llmc.quant import int_source
from llmc.quant.spec import Scheme, TensorSpec

sys.path.insert(0, str(Path(__file__).parent))
from build_helpers import stored as _stored  # noqa: E402
from families import make_tiny  # noqa: E402
from test_build import recipe_text  # noqa: E402

SYM64 = Scheme(TensorSpec("int4", "group", group_size=64))
ASYM32 = Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False))
INT8 = Scheme(TensorSpec("int8", "channel"))
W8A8 = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True))
# source -> (the scheme it holds, the format written again, the stored tensors compared)
CASES = {
    "gptq-sym64": (SYM64, "gptq", ("qweight", "qzeros", "scales", "g_idx")),
    "gptq-asym32": (ASYM32, "gptq", ("qweight", "qzeros", "scales", "g_idx")),
    "gptq-int8": (INT8, "gptq", ("qweight", "qzeros", "scales", "g_idx")),
    "awq": (ASYM32, "awq", ("qweight", "qzeros", "scales")),
    "ct-sym64": (SYM64, "ct", ("weight_packed", "weight_scale", "weight_shape")),
    "ct-asym32": (ASYM32, "ct", ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")),
    "ct-int8": (INT8, "ct", ("weight_packed", "weight_scale", "weight_shape")),
    "ct-w8a8": (W8A8, "ct", ("weight", "weight_scale")),
}


def _export(kind: str, canonical: Path, out: Path) -> Path:
    from llmc.formats import awq_format, gptq_format
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.quant.canonical import QuantizedModel

    qm = QuantizedModel.open(canonical)
    {"gptq": gptq_format.export_gptq, "awq": awq_format.export_awq, "ct": export_compressed_tensors}[kind](qm, out)
    return out


def _bf16_scales(folder: Path) -> None:
    """compressed-tensors checkpoints as llm-compressor writes them: bfloat16 scales."""
    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({n: t.bfloat16() if n.endswith("weight_scale") else t for n, t in tensors.items()}, str(f),
                  metadata={"format": "pt"})


def _clip(canonical: Path, bits: int) -> None:
    """Codes kept off both ends of their range, as GPTQ's and AWQ's clipped or error-compensated codes often are:
    requantizing such a group's decoded values picks another scale (an RTN source requantizes to itself)."""
    from llmc.quant.canonical import QuantizedModel

    qm = QuantizedModel.open(canonical)
    top = (1 << (bits - 1)) - 1
    for f in qm.files():
        tensors = load_file(str(f))
        tensors = {n: t.clamp(-top, top - 1) if n.endswith(".weight") and n[: -len(".weight")] in qm.quantized_modules
                   else t for n, t in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from llmc.model.source import ModelSource
    from llmc.quant.stream import quantize_model

    root = tmp_path_factory.mktemp("int-sources")
    tiny = make_tiny("llama", root / "tiny", hidden_size=256, intermediate_size=384, num_attention_heads=4,
                     num_key_value_heads=2)
    out = {"tiny": tiny}
    for name, scheme in {"sym64": SYM64, "asym32": ASYM32, "int8": INT8, "w8a8": W8A8}.items():
        quantize_model(ModelSource(tiny, "t", "t"), scheme, root / f"q-{name}", None)
        _clip(root / f"q-{name}", scheme.weights.bits)
    for kind, (scheme, fmt, _) in CASES.items():
        made = {SYM64: "sym64", ASYM32: "asym32", INT8: "int8", W8A8: "w8a8"}[scheme]
        out[kind] = _export(fmt, root / f"q-{made}", root / kind)
        if fmt == "ct":
            _bf16_scales(out[kind])
    return out


def _quantize(source: Path, scheme: Scheme, out: Path) -> Path:
    from llmc.model.source import ModelSource
    from llmc.quant.stream import quantize_model

    quantize_model(ModelSource(source, "t", "t"), scheme, out, None)
    return out


def _canonical(folder: Path) -> dict[str, torch.Tensor]:
    from llmc.quant.canonical import QuantizedModel

    tensors = {}
    for f in QuantizedModel.open(folder).files():
        tensors.update(load_file(str(f)))
    return tensors


LINEARS = 14  # 2 layers x q, k, v, o, gate, up, down


@pytest.mark.heavy
@pytest.mark.parametrize("kind", list(CASES))
def test_the_sources_scheme_writes_the_sources_codes_again(kind: str, sources: dict, tmp_path: Path, capsys) -> None:
    """Decoded, kept, and written in the source's own format: every stored tensor of every Linear byte for byte
    (compressed-tensors: codes, zero points and shapes byte for byte, the bfloat16 scales' values in the float32 the
    artifact stores). Requantizing the decoded values would have given other scales (checked: the test can fail)."""
    from llmc.quant.numerics import quantize_weight

    scheme, fmt, parts = CASES[kind]
    canonical = _quantize(sources[kind], scheme, tmp_path / "q")
    assert f"{LINEARS} Linear(s) kept the codes and scales" in capsys.readouterr().err
    written, source = _stored(_export(fmt, canonical, tmp_path / "again")), _stored(sources[kind])
    modules = sorted({n.rsplit(".", 1)[0] for n in source if n.endswith(f".{parts[1]}")})  # [0] may be "weight"
    assert len(modules) == LINEARS
    for m in modules:
        for p in parts:
            a, b = written[f"{m}.{p}"], source[f"{m}.{p}"]
            if p == "weight_scale" and b.dtype == torch.bfloat16:
                assert a.dtype == torch.float32 and torch.equal(a, b.float()), (m, p)
            else:
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8),
                                                                                  b.view(torch.uint8)), (m, p)
    reader, kept = CheckpointReader(sources[kind]), _canonical(canonical)
    redone = [torch.equal(quantize_weight(reader.get(f"{m}.weight"), scheme.weights).scale, kept[f"{m}.weight_scale"])
              for m in modules]
    assert not all(redone), "requantizing gives the same scales: this case cannot tell passing through from it"


def _gptq_codes(stored: dict[str, torch.Tensor], m: str, bits: int) -> torch.Tensor:
    """GPTQ's unsigned codes [out, in], unpacked element by element as GPTQModel's formula does."""
    qweight = stored[f"{m}.qweight"].long()
    per = 32 // bits
    rows = qweight.shape[0] * per
    q = torch.stack([(qweight[i // per] >> (bits * (i % per))) & ((1 << bits) - 1) for i in range(rows)])
    return q.t()


@pytest.mark.heavy
def test_a_gptq_source_to_vllm_and_gguf_keeps_its_codes(sources: dict, tmp_path: Path) -> None:
    """GPTQ 4-bit symmetric groups of 64 -> compressed-tensors pack-quantized (vLLM) and GGUF Q4_0 (llama.cpp): the
    same unsigned codes (compressed-tensors packs code - 8, GGUF's nibble is the code) and the same float16 scales."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from gguf import GGMLQuantizationType, GGUFReader

    from llmc.formats import gguf as G
    from llmc.quant.canonical import QuantizedModel

    canonical = _quantize(sources["gptq-sym64"], SYM64, tmp_path / "q")
    source = _stored(sources["gptq-sym64"])
    ct = _stored(_export("ct", canonical, tmp_path / "ct"))
    res = G.export_gguf(QuantizedModel.open(canonical), tmp_path / "gguf")
    tensors = {t.name: t for t in GGUFReader(res.path).tensors}
    for m in sorted(n[: -len(".qweight")] for n in source if n.endswith(".qweight")):
        q, scales = _gptq_codes(source, m, 4), source[f"{m}.scales"].t()  # [out, in], [out, groups]
        unpacked = unpack_from_int32(ct[f"{m}.weight_packed"], 4, torch.Size(q.shape))
        assert torch.equal(unpacked.long() + 8, q), m
        assert torch.equal(ct[f"{m}.weight_scale"], scales.float()), m
        layer, leaf = m.split(".")[2], m.rsplit(".", 1)[-1]
        if leaf in ("q_proj", "k_proj"):  # llama.cpp's rows are permuted for its rope: compared on the others
            continue
        name = {"v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                "down_proj": "ffn_down"}[leaf]
        t = tensors[f"blk.{layer}.{name}.weight"]
        assert t.tensor_type == GGMLQuantizationType.Q4_0
        blocks = np.asarray(t.data).reshape(q.shape[0], -1, 18)
        d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])  # [out, in / 32]
        nibbles = torch.from_numpy(np.concatenate([blocks[..., 2:] & 0xF, blocks[..., 2:] >> 4], axis=-1).astype(
            np.int64)).reshape(q.shape)
        assert torch.equal(nibbles, q), m
        assert torch.equal(d, scales.repeat_interleave(2, dim=1)), m


@pytest.mark.heavy
def test_an_awq_source_to_vllm_keeps_codes_and_zero_points(sources: dict, tmp_path: Path) -> None:
    """AWQ GEMM (asymmetric groups of 32) -> compressed-tensors pack-quantized asymmetric: codes and zero points
    the AWQ ones less 8 (compressed-tensors' signed convention), scales the float16 ones."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from llmc.formats.awq_format import unpack_columns

    canonical = _quantize(sources["awq"], ASYM32, tmp_path / "q")
    source, ct = _stored(sources["awq"]), _stored(_export("ct", canonical, tmp_path / "ct"))
    for m in sorted(n[: -len(".qweight")] for n in source if n.endswith(".qweight")):
        q, z = unpack_columns(source[f"{m}.qweight"]).t(), unpack_columns(source[f"{m}.qzeros"]).t()
        assert torch.equal(unpack_from_int32(ct[f"{m}.weight_packed"], 4, torch.Size(q.shape)).int() + 8, q), m
        zero = unpack_from_int32(ct[f"{m}.weight_zero_point"], 4, torch.Size(z.shape), packed_dim=0)
        assert torch.equal(zero.int() + 8, z), m
        assert torch.equal(ct[f"{m}.weight_scale"], source[f"{m}.scales"].t().float()), m


def test_another_scheme_or_an_algorithm_requantizes_and_says_why(sources: dict, tmp_path: Path, capsys) -> None:
    """A group-64 source, a group-128 recipe: llmc's quantization of the decoded values (nothing kept)."""
    from llmc.quant.numerics import quantize_weight

    g128 = Scheme(TensorSpec("int4", "group", group_size=128))
    canonical = _canonical(_quantize(sources["gptq-sym64"], g128, tmp_path / "q"))
    assert "kept the codes" not in capsys.readouterr().err
    reader = CheckpointReader(sources["gptq-sym64"])
    names = [n for n in reader.names() if reader.encoded(n) is not None]
    assert len(names) == LINEARS
    for n in names:
        assert torch.equal(canonical[n], quantize_weight(reader.get(n), g128.weights).codes), n
    fmt = reader.source_format
    assert int_source.decide(fmt, g128) == int_source.Decision(False, "the recipe's group size is 128, the source's 64")
    assert int_source.decide(fmt, SYM64).keeps
    assert "symmetric, the source's asymmetric" in int_source.decide(
        CheckpointReader(sources["awq"]).source_format, Scheme(TensorSpec("int4", "group", group_size=32))).why
    gptq = int_source.decide(fmt, Scheme(SYM64.weights, algorithm="gptq"))
    assert not gptq.keeps and "algorithm gptq chooses its own codes" in gptq.why
    assert int_source.decide(fmt, Scheme(TensorSpec("fp8_e4m3", "channel"))) is None  # not an integer target


def _stored_zero_15(tensors: dict[str, torch.Tensor], m: str) -> None:
    tensors[f"{m}.qzeros"][0, 0] |= 0xF  # the first output column's first group: a stored zero of 15


def _awq_zero_0(tensors: dict[str, torch.Tensor], m: str) -> None:
    tensors[f"{m}.qzeros"][0, 0] &= ~0xF  # AWQ's first output column (shift 0), first group: a zero point of 0


def _act_order(tensors: dict[str, torch.Tensor], m: str) -> None:
    g_idx = tensors[f"{m}.g_idx"]
    tensors[f"{m}.g_idx"] = g_idx[torch.randperm(len(g_idx), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("kind, edit, scheme, why", [
    ("gptq-asym32", _stored_zero_15, ASYM32, "a v1 stored zero point of 15"),
    ("gptq-sym64", _act_order, SYM64, "g_idx not in input order (desc_act)"),
    # the scheme the plan gives a recipe with a gptq-format target (test_gptq_zero.py): v1 cannot store a zero of 0
    ("awq", _awq_zero_0, Scheme(replace(ASYM32.weights, zero_grid="nonzero")), "a zero point of 0 (unsigned)")],
    ids=["v1-zero-15", "act-order", "zero-0-for-gptq"])
def test_a_linear_the_target_cannot_hold_is_requantized(kind: str, edit, scheme: Scheme, why: str, sources: dict,
                                                       tmp_path: Path, capsys) -> None:
    """GPTQ v1 stores zero - 1: a stored 15 is 16 to vLLM, ExLlamaV2 and llmc's decoder, 0 to onnxruntime-genai and
    GPTQModel (docs/model-sources.md); a g_idx out of input order (desc_act) groups inputs the target's groups cannot;
    an AWQ zero of 0 bound for a GPTQ v1 artifact would be stored as 15. That Linear is requantized from its decoded
    values and counted with the reason; the others keep their codes."""
    import shutil

    from llmc.quant.numerics import quantize_weight

    folder = Path(shutil.copytree(sources[kind], tmp_path / "src"))
    (f,) = folder.glob("*.safetensors")
    tensors = load_file(str(f))
    target = "model.layers.0.self_attn.v_proj"
    edit(tensors, target)
    save_file(tensors, str(f), metadata={"format": "pt"})
    canonical = _canonical(_quantize(folder, scheme, tmp_path / "q"))
    err = capsys.readouterr().err
    assert f"{LINEARS - 1} Linear(s) kept the codes" in err
    assert "1 Linear(s) whose target scheme is the source's were requantized" in err and why in err, err
    reader = CheckpointReader(folder)
    assert torch.equal(canonical[f"{target}.weight"], quantize_weight(reader.get(f"{target}.weight"),
                                                                      scheme.weights).codes)


def _plan(source: Path, tmp_path: Path, quantization: dict) -> str:
    recipe = yaml.safe_load(recipe_text(source, tmp_path / "reg"))
    recipe["quantization"] = quantization
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "recipe.yaml"), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


@pytest.mark.slow  # ~25-30 s on the shared 2-core machine
def test_the_plan_says_which_happens_and_why(sources: dict, tmp_path: Path) -> None:
    g64 = {"weights": {"format": "int4", "strategy": "group", "group_size": 64}}
    g128 = {"weights": {"format": "int4", "strategy": "group", "group_size": 128}}
    out = _plan(sources["gptq-sym64"], tmp_path, g64)
    assert "integer codes pass through bit for bit" in out, out
    out = _plan(sources["gptq-sym64"], tmp_path, g128)
    assert "are requantized from their decoded values: the recipe's group size is 128, the source's 64" in out, out
    out = _plan(sources["gptq-sym64"], tmp_path, {**g64, "algorithm": "gptq"})
    assert "algorithm gptq chooses its own codes" in out, out


@pytest.mark.slow  # ~25-30 s on the shared 2-core machine
def test_a_build_reports_the_pass_through(sources: dict, tmp_path: Path) -> None:
    """`llmc build` from a GPTQ source to vLLM with the source's scheme: report.json says the codes pass through,
    and the artifact's codes are the source's."""
    recipe = yaml.safe_load(recipe_text(sources["gptq-sym64"], tmp_path / "reg", **{
        "eval.windows": 2, "calibration.samples": 2, "gates.max_ppl_increase_pct": 1000.0}))
    recipe["quantization"] = {"weights": {"format": "int4", "strategy": "group", "group_size": 64}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(main, ["build", str(tmp_path / "recipe.yaml"), "--cache-dir", str(tmp_path / "cache"),
                                       "--report-dir", str(tmp_path / "report"), "--no-publish"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert any("integer codes pass through bit for bit" in w for w in report["warnings"]), report["warnings"]
    (artifact,) = [f.parent for f in (tmp_path / "cache").rglob("config.json")
                   if json.loads(f.read_text()).get("quantization_config", {}).get("quant_method")
                   == "compressed-tensors"]
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    written, source = _stored(artifact), _stored(sources["gptq-sym64"])
    m = "model.layers.1.mlp.down_proj"
    q = _gptq_codes(source, m, 4)
    assert torch.equal(unpack_from_int32(written[f"{m}.weight_packed"], 4, torch.Size(q.shape)).long() + 8, q)


def test_a_mixed_scheme_keeps_the_codes_of_the_group_whose_scheme_is_the_sources(sources: dict, tmp_path: Path,
                                                                                  capsys) -> None:
    """Mixed precision: the MLP group (the source's int4 g64) keeps its codes, the attention group (int8 per channel)
    quantizes the decoded values; the plan's notes say so group by group."""
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import ModuleGroup, ModuleTargets

    int8 = TensorSpec("int8", "channel")
    mixed = Scheme(SYM64.weights, groups=(ModuleGroup("mlp", ModuleTargets(roles=("mlp",)), SYM64.weights),
                                          ModuleGroup("attn", ModuleTargets(roles=("attention",)), int8)))
    canonical = _canonical(_quantize(sources["gptq-sym64"], mixed, tmp_path / "q"))
    assert "6 Linear(s) kept the codes" in capsys.readouterr().err  # 2 layers x gate, up, down
    source, reader = _stored(sources["gptq-sym64"]), CheckpointReader(sources["gptq-sym64"])
    for name in [n for n in reader.names() if reader.encoded(n) is not None]:
        m = name[: -len(".weight")]
        if ".mlp." in name:
            assert torch.equal(canonical[name].long() + 8, _gptq_codes(source, m, 4)), name
        else:
            assert torch.equal(canonical[name], quantize_weight(reader.get(name), int8).codes), name
    notes = int_source.plan_notes(reader.source_format, {"": mixed})
    assert [n.split(":")[0] for n in notes] == ["group mlp", "group attn"]
    assert "pass through bit for bit" in notes[0] and "requantized" in notes[1], notes
