"""gpt-oss's MXFP4 experts without a second rounding (issue 46): the exact MXFP4 -> NVFP4 cast
(llmc.quant.microscaling.mxfp4_to_nvfp4) against decoding and requantizing, and the layer stream keeping a tiny
MXFP4 original's expert codes (llmc.quant.mxfp4_source): passed through to an MXFP4 target, cast to an NVFP4 one,
exported to compressed-tensors and decoded there to the original's values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.quant.microscaling import (MXFP4, NVFP4, BlockQuantized, dequantize_blocks, mxfp4_cast_global_scale,
                                     mxfp4_to_nvfp4, pack_e2m1, quantize_blocks, quantize_with_scales, unpack_e2m1)

sys.path.insert(0, str(Path(__file__).parent))
from test_source_formats import save_mxfp4_gpt_oss  # noqa: E402


def _mx(rows: int, cols: int, low: int, high: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes (every code, some all-zero blocks) and E8M0 exponents in [low, high]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    codes[0, :16] = 0  # half an MX block of zeros: its NVFP4 block holds nothing to scale
    codes[1, 32:64] = 8  # a whole block of negative zeros
    exponents = torch.randint(low, high + 1, (rows, cols // 32), generator=g, dtype=torch.uint8)
    return codes, exponents


def _decoded(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    return dequantize_blocks(BlockQuantized(codes, exponents, None, MXFP4))


@pytest.mark.parametrize("low, high", [(110, 127), (1, 18), (230, 247)], ids=["gpt-oss-range", "tiny", "huge"])
def test_the_cast_keeps_every_code_and_decodes_to_the_mxfp4_values_bit_for_bit(low: int, high: int) -> None:
    """Exponents spanning 17 (E4M3's powers of two 2^-9..2^8 hold 18): every block casts exactly, at either end of
    E8M0's range. Requantizing the decoded values under the cast's scales gives its codes back, bit for bit; plain
    round-to-nearest NVFP4 of the same values (llmc's quantizer, 448 * 6 / amax) does not give the values back."""
    codes, exponents = _mx(64, 256, low, high)
    exponents[2, 0], exponents[3, 1] = low, high  # the span is used in full
    values = _decoded(codes, exponents)
    g = mxfp4_cast_global_scale([(codes, exponents)])
    assert torch.equal(g, torch.tensor([2.0 ** (8 - (high - 127))]))  # the largest block's scale lands on 2^8
    cast = mxfp4_to_nvfp4(codes, exponents, g)
    q = cast.nvfp4
    assert cast.requantized_blocks == 0 and cast.exact_blocks == 64 * 16 - 3  # three all-zero 16-blocks
    assert torch.equal(q.codes, codes)
    assert torch.equal(dequantize_blocks(q), values)
    again = quantize_with_scales(values, q.scale, NVFP4, q.global_scale)
    assert torch.equal(again.codes, q.codes)
    assert not torch.equal(dequantize_blocks(quantize_blocks(values, NVFP4)), values)


def test_a_block_below_e4m3s_reach_is_requantized_under_the_same_global_scale() -> None:
    """Exponents spanning 18: the lowest block's scale would be 2^-10 under the global scale, which E4M3 lacks. It
    is requantized from its decoded values exactly as llmc's NVFP4 quantizer does under that global scale; every
    other block keeps its codes."""
    codes, exponents = _mx(8, 64, 120, 137)
    codes[5, 32:64] = 7  # a live block, then moved 18 below the largest exponent
    exponents[2, 0], exponents[5, 1] = 137, 119
    g = mxfp4_cast_global_scale([(codes, exponents)])
    cast = mxfp4_to_nvfp4(codes, exponents, g)
    assert cast.requantized_blocks == 2  # the MX block's two 16-element halves
    values = _decoded(codes, exponents)
    rtn = quantize_blocks(values[5:6, 32:64], NVFP4, global_scale=g)
    assert torch.equal(cast.nvfp4.codes[5, 32:64], rtn.codes[0]) and torch.equal(cast.nvfp4.scale[5, 2:4], rtn.scale[0])
    keep = torch.ones_like(codes, dtype=torch.bool)
    keep[5, 32:64] = False
    assert torch.equal(cast.nvfp4.codes[keep], codes[keep])
    assert torch.equal(dequantize_blocks(cast.nvfp4)[keep], values[keep])


def test_the_global_scale_is_shared_a_power_of_two_and_required_so() -> None:
    a, b = _mx(4, 64, 100, 110, seed=1), _mx(4, 64, 112, 120, seed=2)
    g = mxfp4_cast_global_scale([a, b])
    assert torch.equal(g, mxfp4_cast_global_scale([b]))  # the pair's largest exponent decides
    assert torch.equal(mxfp4_cast_global_scale([(torch.zeros(2, 32, dtype=torch.uint8),
                                                 torch.full((2, 1), 200, dtype=torch.uint8))]), torch.ones(1))
    with pytest.raises(ValueError, match="power-of-two"):
        mxfp4_to_nvfp4(*a, torch.tensor([3.0]))


# --------------------------------------------------------------------------- the layer stream on a tiny original

def _narrow_codes_source(tmp_path: Path) -> Path:
    """A tiny gpt-oss MXFP4 original whose codes llmc's MXFP4 quantizer would not give back from the decoded
    values: every magnitude at most 3 (code 5), so the OCP exponent rule picks one exponent lower and doubles the
    codes (the same values, other codes); its exponents are kept."""
    folder = save_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        shape = tensors[name].shape
        magnitude = torch.randint(0, 6, (*shape[:-1], 32), generator=g, dtype=torch.uint8)
        sign = torch.randint(0, 2, magnitude.shape, generator=g, dtype=torch.uint8) << 3
        tensors[name] = pack_e2m1(magnitude | sign)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _source_expert_codes(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-expert Linear -> (codes, exponents), sliced straight from the stored tensors as gpt-oss lays them out:
    rows are output features, gate and up interleaved (gate the even rows)."""
    stored = load_file(str(folder / "model.safetensors"))
    out = {}
    for name in [n for n in stored if n.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        blocks, scales = stored[name], stored[base + "_scales"]
        prefix = base.rsplit(".", 1)[0]
        for e in range(blocks.shape[0]):
            codes = unpack_e2m1(blocks[e].reshape(blocks.shape[1], -1))
            if base.endswith("gate_up_proj"):
                out[f"{prefix}.{e}.gate_proj"] = (codes[0::2], scales[e, 0::2])
                out[f"{prefix}.{e}.up_proj"] = (codes[1::2], scales[e, 1::2])
            else:
                out[f"{prefix}.{e}.down_proj"] = (codes, scales[e])
    return out


def _quantize(folder: Path, fmt: str, out: Path) -> dict[str, torch.Tensor]:
    from llmc.model.source import ModelSource
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    spec = TensorSpec(fmt, "group", group_size=MXFP4.block_size if fmt == "mxfp4" else NVFP4.block_size)
    quantize_model(ModelSource(folder, "t", "t"), Scheme(spec), out, None)
    written = {}
    for f in sorted((out / "layers").glob("*.safetensors")):
        written.update(load_file(str(f)))
    return written


@pytest.mark.heavy
def test_an_mxfp4_target_keeps_the_originals_expert_codes_bit_for_bit(tmp_path: Path) -> None:
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import TensorSpec

    folder = _narrow_codes_source(tmp_path)
    expected = _source_expert_codes(folder)
    assert len(expected) == 2 * 4 * 3
    written = _quantize(folder, "mxfp4", tmp_path / "q")
    requantized_differs = 0
    for name, (codes, exponents) in expected.items():
        assert torch.equal(written[f"{name}.weight"], codes), name
        assert torch.equal(written[f"{name}.weight_scale"], exponents), name
        again = quantize_weight(_decoded(codes, exponents), TensorSpec("mxfp4", "group", group_size=32))
        requantized_differs += not torch.equal(again.codes, codes)
    assert requantized_differs == len(expected)  # what the pass-through saves: a requantize changes every one


@pytest.mark.heavy
def test_an_nvfp4_target_gets_the_exact_cast_and_compressed_tensors_decodes_the_original(tmp_path: Path) -> None:
    """The NVFP4 experts keep the original's codes, share one power-of-two global scale per gate/up pair, and the
    compressed-tensors artifact, decoded by compressed-tensors (in float32), equals the decoded MXFP4 original."""
    from compressed_tensors.quantization import QuantizationScheme
    from test_frontier_proof import _nvfp4_float32

    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.quant.canonical import QuantizedModel

    folder = _narrow_codes_source(tmp_path)
    expected = _source_expert_codes(folder)
    written = _quantize(folder, "nvfp4", tmp_path / "q")
    for name, (codes, exponents) in expected.items():
        assert torch.equal(written[f"{name}.weight"], codes), name
        g = written[f"{name}.weight_global_scale"]
        assert torch.equal(torch.frexp(g).mantissa, torch.tensor([0.5])), name  # a power of two
        if name.endswith("gate_proj"):
            assert torch.equal(g, written[name.replace("gate_proj", "up_proj") + ".weight_global_scale"]), name
    export_compressed_tensors(QuantizedModel.open(tmp_path / "q"), tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    (group,) = config["quantization_config"]["config_groups"].values()
    assert group["format"] == "nvfp4-pack-quantized"
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    raw = {k: v for f in (tmp_path / "export").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for name, (codes, exponents) in expected.items():
        theirs = _nvfp4_float32(raw[f"{name}.weight_packed"], raw[f"{name}.weight_scale"],
                                raw[f"{name}.weight_global_scale"], scheme)
        assert torch.equal(theirs, _decoded(codes, exponents)), name


def test_a_changed_weight_keeps_the_quantizers_codes_and_so_does_its_gate_up_sibling() -> None:
    """A Linear an algorithm changed (its weight no longer the decoded original) is not replaced; its gate/up sibling
    is not either (the pair must keep one global scale); the untouched down projection is cast."""
    from llmc.quant.mxfp4_source import keep_source_codes
    from llmc.quant.numerics import quantize_weights
    from llmc.quant.spec import TensorSpec

    spec = TensorSpec("nvfp4", "group", group_size=16)
    source, weights = {}, {}
    for i, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
        codes, exponents = _mx(32, 64, 118, 126, seed=10 + i)
        source[f"e.0.{proj}"] = (pack_e2m1(codes), exponents)
        weights[f"e.0.{proj}"] = _decoded(codes, exponents)
    weights["e.0.up_proj"] = weights["e.0.up_proj"] * 1.01  # what GPTQ's updates would do
    quantized = quantize_weights(weights, spec)
    before = {n: q.codes.clone() for n, q in quantized.items()}
    kept = keep_source_codes(quantized, weights, dict.fromkeys(weights, spec), source)
    assert (kept.cast, kept.passed_through) == (1, 0)
    assert torch.equal(quantized["e.0.gate_proj"].codes, before["e.0.gate_proj"])
    assert torch.equal(quantized["e.0.up_proj"].codes, before["e.0.up_proj"])
    assert torch.equal(quantized["e.0.down_proj"].codes, unpack_e2m1(source["e.0.down_proj"][0]))
    assert not torch.equal(before["e.0.down_proj"], quantized["e.0.down_proj"].codes)  # RTN had other codes


NVFP4_EXPERTS = {"algorithm": "rtn", "groups": [{"name": "router", "roles": ["router"], "ignore": True},
                                                {"name": "experts", "roles": ["experts"], "scheme": "W4A4-NVFP4"},
                                                {"name": "bf16", "roles": ["attention"], "ignore": True}]}


def _cli(folder: Path, tmp_path: Path, command: str) -> tuple[int, str]:
    import yaml
    from click.testing import CliRunner
    from test_build import recipe_text

    from llmc.cli import main

    recipe = yaml.safe_load(recipe_text(folder, tmp_path / "reg", **{"eval.windows": 2, "calibration.samples": 2}))
    recipe["quantization"] = NVFP4_EXPERTS
    recipe["targets"] = [{"runtime": "vllm", "gpu_arch": "sm100"}]
    recipe["gates"] = {"max_ppl_increase_pct": 1000.0}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    args = [command, str(path), "--cache-dir", str(tmp_path / "cache")]
    if command == "build":
        args += ["--report-dir", str(tmp_path / "report"), "--no-publish"]
    result = CliRunner().invoke(main, args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


@pytest.mark.heavy
def test_vllm_refuses_the_nvfp4_experts_of_an_mxfp4_gpt_oss_naming_what_its_loader_reads(tmp_path: Path) -> None:
    code, out = _cli(save_mxfp4_gpt_oss(tmp_path / "gpt-oss"), tmp_path, "plan")
    # the gpt-oss-mxfp4 format (vLLM's reading of the original) holds only the codes passed through: NVFP4 experts
    # are refused by it, naming vLLM's loader and the pass-through recipe that it does read
    assert code == 3 and "fused 3-D tensors" in out and "group_size: 32" in out, out


@pytest.mark.slow
def test_llmc_build_of_the_mxfp4_original_to_nvfp4_experts_with_the_vllm_refusal_lifted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole build (plan, calibration, the layer stream's cast, the compressed-tensors export, the torch engine's
    evaluation of the files) on the tiny MXFP4 original, with vLLM's gpt-oss refusal lifted in this test only: what a
    runtime that loads per-expert NVFP4 gpt-oss experts would get. The experts' exported codes are the original's."""
    from llmc.runtimes.catalog import runtime_names
    from llmc.runtimes.registry import RUNTIMES

    assert "vllm" in runtime_names()  # the catalog registered the runtimes
    monkeypatch.delitem(RUNTIMES["vllm"].refused_families, "gpt_oss")
    monkeypatch.delitem(RUNTIMES["vllm"].family_formats, "gpt_oss")  # compressed-tensors, not OpenAI's layout
    folder = _narrow_codes_source(tmp_path)
    code, out = _cli(folder, tmp_path, "build")
    assert code == 0, out
    (export,) = [p.parent for p in (tmp_path / "cache").rglob("config.json")
                 if json.loads(p.read_text()).get("quantization_config", {}).get("quant_method") == "compressed-tensors"]
    raw = {k: v for f in export.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    expected = _source_expert_codes(folder)
    for name, (codes, _) in expected.items():
        assert torch.equal(unpack_e2m1(raw[f"{name}.weight_packed"]), codes), name
    report = (tmp_path / "report" / "report.md").read_text()
    assert "the baseline is the decoded original" in report and "cast with the codes kept" in report
