"""Quantized originals (llmc.model.source_formats): each decoder bit for bit against the format's reference decoder
in transformers, their detection, and builds of a tiny model saved as DeepSeek-V3 ships (FP8 block-wise): planned
with the decoded original as baseline, quantized layer by layer, and its codes passed through unchanged where the
target is the source's own format."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmc.cli import main
from llmc.errors import InputError
from llmc.model import source_formats as sf
from llmc.model.checkpoint import CheckpointReader
from llmc.quant.block_fp8 import quantize_fp8_blocks
from llmc.quant.microscaling import MXFP4, pack_e2m1, quantize_blocks

sys.path.insert(0, str(Path(__file__).parent))
from build_helpers import save_as_mxfp4_original  # noqa: E402
from families import make_tiny  # noqa: E402
from test_build import recipe_text  # noqa: E402

BLOCK = (128, 128)
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _hf_fp8_encoder(block: tuple[int, int] | None):
    """transformers' own FP8 encoder (the op its FP8 save runs), for whole blocks."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=block)
    return Fp8Quantize(SimpleNamespace(quantization_config=config))


def _hf_fp8_decoder():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: blocks get scales apart by orders of magnitude
    return torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-2]).unsqueeze(-1)


# --------------------------------------------------------------------------- FP8 against transformers' decoders

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_decoder_is_bit_exact_against_transformers_on_whole_blocks(dtype: torch.dtype) -> None:
    w = _weight(384, 256)
    stored = _hf_fp8_encoder([128, 128])._quantize_one("m.weight", w)
    codes, scale = stored["m.weight"], stored["m.weight_scale_inv"]
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    reference = _hf_fp8_decoder()._dequantize_one(codes, scale, output_dtype=dtype)
    ours = sf.decode_fp8(codes, scale, BLOCK, dtype)
    assert ours.dtype == dtype and torch.equal(ours, reference)
    # and the encoder round-trips: every block within FP8 E4M3's half-step (2^-4 relative) of the original
    assert ((sf.decode_fp8(codes, scale, BLOCK) - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()


def test_fp8_block_decoder_handles_partial_edge_blocks_as_transformers_backward_decoder_does() -> None:
    """DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4.5 blocks. transformers' load-time Fp8Dequantize derives the
    block from the scale grid (576 rows / 5 scale rows); its `_dequantize_fp8_weight` takes the block size, as here."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = _weight(200, 300, seed=1)
    codes, scale = quantize_fp8_blocks(w, BLOCK)  # llmc's encoder: DeepSeek's amax / 448 per block
    assert scale.shape == (2, 3)
    reference = _dequantize_fp8_weight(codes, scale, [128, 128], torch.float32)
    assert ((reference - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()  # the encoder, checked
    assert torch.equal(sf.decode_fp8(codes, scale, BLOCK), reference)
    # fused experts [experts, rows, cols] with scales [experts, row blocks, col blocks]
    stacked = torch.stack([codes, quantize_fp8_blocks(_weight(200, 300, seed=2), BLOCK)[0]])
    scales = torch.stack([scale, scale * 2])
    assert torch.equal(sf.decode_fp8(stacked, scales, BLOCK),
                       _dequantize_fp8_weight(stacked, scales, [128, 128], torch.float32))


def test_per_tensor_fp8_decoder_is_bit_exact_against_transformers() -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = _weight(96, 64, seed=3)
    stored = _hf_fp8_encoder(None)._quantize_one("m.weight", w)
    codes, scale = stored["m.weight"], stored["m.weight_scale_inv"].reshape(())
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(sf.decode_fp8(codes, scale, None, dtype), _hf_fp8_decoder()._dequantize_one(
            codes, scale.reshape(1, 1), output_dtype=dtype))
    assert torch.equal(sf.decode_fp8(codes, scale, None), _dequantize_fp8_weight(codes, scale, None, torch.float32))


# --------------------------------------------------------------------------- MXFP4 against transformers' decoder

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decoder_is_bit_exact_against_transformers(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 40, 4), generator=g, dtype=torch.uint8)  # gpt-oss's range of exponents
    reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = sf.decode_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 128, 40) and ours.dtype == dtype and torch.equal(ours, reference)


def test_mxfp4_decoder_over_the_whole_e8m0_range_and_a_nan_scale() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    scales = torch.arange(0, 255, dtype=torch.uint8).reshape(1, 255, 1)  # 2^-127 .. 2^127; 0xFF is NaN
    blocks = torch.randint(0, 256, (1, 255, 1, 16), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(sf.decode_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(InputError, match="0xFF"):
        sf.decode_mxfp4(blocks, torch.full_like(scales, 0xFF))


def test_llmc_mxfp4_codes_packed_as_gpt_oss_decode_to_what_llmc_quantized() -> None:
    """An encoder for MXFP4 sources (llmc's own MXFP4 quantizer, packed two codes a byte) checked against the
    reference decoder: what a tiny gpt-oss-layout checkpoint is saved with."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _weight(2, 48, 64, seed=4)  # [experts, rows (out), in]
    q = quantize_blocks(w, MXFP4)
    blocks = pack_e2m1(q.codes).reshape(2, 48, 2, 16)
    scales = q.scale  # [experts, rows, in / 32]
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    from llmc.quant.microscaling import dequantize_blocks
    assert torch.equal(reference, dequantize_blocks(q).transpose(1, 2))
    assert torch.equal(sf.decode_mxfp4(blocks, scales), reference)


# --------------------------------------------------------------------------- detection

def test_source_format_from_quantization_config() -> None:
    assert sf.source_format({"quantization_config": FP8_BLOCK_CONFIG}) == sf.SourceFormat("fp8-block", "fp8", BLOCK)
    assert sf.source_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}).name == \
        "fp8-tensor"
    assert sf.source_format({"quantization_config": {"quant_method": "mxfp4"}}).name == "mxfp4"
    assert sf.source_format({"quantization_config": {"quant_method": "hqq"}}) is None
    assert sf.source_format({}) is None
    with pytest.raises(InputError, match="fmt 'e5m2'"):
        sf.source_format({"quantization_config": {**FP8_BLOCK_CONFIG, "fmt": "e5m2"}})
    with pytest.raises(InputError, match="weight_block_size"):
        sf.source_format({"quantization_config": {**FP8_BLOCK_CONFIG, "weight_block_size": [128]}})


def test_the_decoded_header_and_its_refusals() -> None:
    fmt = sf.SourceFormat("fp8-block", "fp8", BLOCK)
    header = {"a.weight": ("F8_E4M3", (576, 7168)), "a.weight_scale_inv": ("F32", (5, 56)),
              "n.weight": ("BF16", (7168,)), "a.activation_scale": ("F32", ())}
    assert sf.decoded_header(fmt, header) == {"a.weight": ("F32", (576, 7168)), "n.weight": ("BF16", (7168,))}
    with pytest.raises(InputError, match=r"has shape \[4, 56\]"):
        sf.decoded_header(fmt, {**header, "a.weight_scale_inv": ("F32", (4, 56))})
    with pytest.raises(InputError, match="F8_E4M3 matrices"):
        sf.decoded_header(fmt, {**header, "a.weight": ("BF16", (576, 7168))})
    mx = sf.SourceFormat("mxfp4", "mxfp4")
    experts = {"e.gate_up_proj_blocks": ("U8", (32, 5760, 90, 16)), "e.gate_up_proj_scales": ("U8", (32, 5760, 90))}
    assert sf.decoded_header(mx, experts) == {"e.gate_up_proj": ("F32", (32, 2880, 5760))}
    with pytest.raises(InputError, match="has no 'e.gate_up_proj_scales'"):
        sf.decoded_header(mx, {"e.gate_up_proj_blocks": experts["e.gate_up_proj_blocks"]})


# --------------------------------------------------------------------------- a tiny model saved as DeepSeek ships

def _fp8_block_encoded(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' own encoder where the weight is whole blocks (it leaves other weights unquantized); llmc's,
    checked against the reference decoder above, where edge blocks are partial."""
    if t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0:
        return _hf_fp8_encoder([128, 128])._quantize_one(name, t)
    codes, scale = quantize_fp8_blocks(t, BLOCK)
    return {name: codes, f"{name}_scale_inv": scale}


def save_fp8_block(tiny: Path, out: Path) -> Path:
    """`tiny` re-saved as an FP8 block-wise original: every Linear weight of the decoder layers as F8_E4M3 codes
    and a float32 weight_scale_inv per 128x128 block, the rest as it was."""
    out.mkdir()
    tensors = {}
    for f in sorted(tiny.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            linear = ".layers." in name and name.endswith("_proj.weight") and t.dim() == 2
            tensors.update(_fp8_block_encoded(name, t) if linear else {name: t})
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((tiny / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_BLOCK_CONFIG}))
    for f in tiny.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("fp8src")
    tiny = make_tiny("llama", work / "tiny", hidden_size=256, intermediate_size=384, num_attention_heads=4,
                     num_key_value_heads=2)
    return save_fp8_block(tiny, work / "fp8")


def test_the_reader_lists_and_decodes_the_original(fp8_source: Path) -> None:
    reader = CheckpointReader(fp8_source, torch.bfloat16)
    names = reader.names()
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert not any(n.endswith("_scale_inv") for n in names)
    assert "quantization_config" not in reader.config()
    with safe_open(str(fp8_source / "model.safetensors"), "pt") as h:
        codes = h.get_tensor("model.layers.1.mlp.down_proj.weight")
        scale = h.get_tensor("model.layers.1.mlp.down_proj.weight_scale_inv")
    got = reader.get("model.layers.1.mlp.down_proj.weight")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _hf_fp8_decoder()._dequantize_one(codes, scale, output_dtype=torch.bfloat16))
    layer = reader.with_prefix("model.layers.0.")
    assert "mlp.up_proj.weight" in layer and not any("scale" in n for n in layer)


def test_the_plan_sizes_the_decoded_tensors_and_reads_the_stored_bytes(fp8_source: Path) -> None:
    from llmc.planning.shapes import from_headers

    tensors = from_headers(fp8_source)
    assert not any(n.endswith("_scale_inv") for n in tensors.shapes)
    assert tensors.linear_shapes()["model.layers.0.mlp.down_proj"] == (256, 384)
    f = fp8_source / "model.safetensors"
    header = int.from_bytes(f.read_bytes()[:8], "little")
    assert sum(tensors.stored_bytes.values()) == f.stat().st_size - 8 - header  # every stored part, read


def test_the_torch_engine_scores_the_decoded_original_whole_and_streamed(fp8_source: Path, tmp_path: Path) -> None:
    """The baseline: the source scored as the plain folder of its decoded weights scores, by both torch paths."""
    from llmc.engines.torch_ref import TorchEngine

    plain = tmp_path / "decoded"
    plain.mkdir()
    reader = CheckpointReader(fp8_source)
    save_file(reader.get_many(reader.names()), str(plain / "model.safetensors"))
    (plain / "config.json").write_text(json.dumps(reader.config()))
    for f in fp8_source.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, plain / f.name)
    vocab = reader.config()["vocab_size"]
    windows = torch.randint(3, vocab, (3, 24), generator=torch.Generator().manual_seed(0))
    expected = TorchEngine(plain, streamed=False).score(windows, batch_size=2)["nll"]
    for streamed in (False, True):
        assert torch.equal(TorchEngine(fp8_source, streamed=streamed).score(windows, batch_size=2)["nll"], expected)


def test_the_reader_equals_transformers_dequantizing_load_of_the_fp8_original(fp8_source: Path) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    reference = AutoModelForCausalLM.from_pretrained(
        fp8_source, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32).state_dict()
    reader = CheckpointReader(fp8_source)
    decoded = [n for n in reader.names() if reader.encoded(n) is not None]
    assert len(decoded) == 14
    for name in decoded:
        assert torch.equal(reader.get(name), reference[name]), name


def save_mxfp4_gpt_oss(folder: Path) -> Path:
    """A tiny gpt-oss saved as OpenAI ships it: the experts' gate_up_proj / down_proj as MXFP4 `_blocks` + `_scales`
    (llmc's MXFP4 quantizer, packed two codes a byte), everything else as it was."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(folder / "dense")
    tok.save_pretrained(folder)
    save_as_mxfp4_original(folder / "dense", folder)
    shutil.rmtree(folder / "dense")
    return folder


def test_an_mxfp4_gpt_oss_reads_as_transformers_dequantizing_load_gives_it(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from llmc.model import checks
    from llmc.model.checkpoint import check_safetensors_header

    folder = save_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    reference = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).state_dict()
    reader = CheckpointReader(folder)
    assert sorted(reader.names()) == sorted(n for n in reference if not n.endswith("rotary_emb.inv_freq"))
    assert sum(reader.encoded(n) is not None for n in reader.names()) == 4  # 2 layers x gate_up, down
    for name in reader.names():
        assert torch.equal(reader.get(name), reference[name]), name
    from llmc.engines.torch_stream import dense_bytes  # the torch engine's whole-or-streamed decision sizes it so
    assert dense_bytes(folder, torch.float32) == sum(t.numel() * 4 for t in reference.values()
                                                     if t.is_floating_point()) + sum(
        reader.get_stored([reader.encoded(n).scale])[reader.encoded(n).scale].numel() for n in reader.names()
        if reader.encoded(n) is not None)
    # detected as a source llmc decodes: the plan's checks see float experts, nothing left quantized
    config = json.loads((folder / "config.json").read_text())
    fmt = sf.source_format(config)
    header = {n: (i["dtype"], tuple(i["shape"])) for n, i in
              check_safetensors_header(folder / "model.safetensors").items() if n != "__metadata__"}
    assert checks.quantized_kind(config, header).kind == "mxfp4"
    assert checks.quantized_kind(sf.decoded_config(config), sf.decoded_header(fmt, header)) is None



def test_a_fused_layer_is_read_one_expert_at_a_time_into_the_same_per_expert_tensors(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """llmc.quant.moe.read_layer (the layer stream's read of gpt-oss's fused experts) gives the per-expert tensors
    `per_expert_tensors` splits the whole layer into, bit for bit and in order, with each decode given one expert's
    codes: the fused tensors are never decoded whole beside their per-expert copies (which held gpt-oss-120b's
    layer twice). The MXFP4 original, decoded to float32 and bf16, and the same model stored fused in float32."""
    from llmc.model.families import LAYOUTS
    from llmc.quant import moe

    folder = save_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    plain = tmp_path / "plain"
    plain.mkdir()
    reader = CheckpointReader(folder)
    save_file(reader.get_many(reader.names()), str(plain / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    experts_seen: list[int] = []
    decode = sf.decode

    def one_expert_at_a_time(fmt, encoded, parts, dtype=torch.float32):
        experts_seen.append(parts[encoded.codes].shape[0])
        return decode(fmt, encoded, parts, dtype)

    monkeypatch.setattr(sf, "decode", one_expert_at_a_time)
    layout = LAYOUTS["gpt_oss"]
    for source, dtype, decodes in ((folder, torch.float32, [1] * 8), (folder, torch.bfloat16, [1] * 8),
                                   (plain, torch.float32, [])):
        reader = CheckpointReader(source, dtype)
        for layer in (0, 1):
            prefix = f"model.layers.{layer}."
            whole = moe.per_expert_tensors(reader.with_prefix(prefix), layout)
            experts_seen.clear()
            split = moe.read_layer(reader, prefix, layout)
            assert experts_seen == decodes  # 4 experts x (gate_up, down), one expert's codes each
            assert list(split) == list(whole)
            assert sum(".experts.3." in n for n in split) == 6  # gate, up, down: weights and biases
            for name, t in whole.items():
                assert split[name].dtype == t.dtype and split[name].is_contiguous(), name
                assert torch.equal(split[name], t), name


def _plan(source: Path, tmp_path: Path, **overrides) -> tuple[int, str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text(source, tmp_path / "reg", **overrides))
    result = CliRunner().invoke(main, ["plan", str(recipe), "--cache-dir", str(tmp_path / "cache")])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_the_plan_says_the_baseline_is_the_decoded_original(fp8_source: Path, tmp_path: Path) -> None:
    code, out = _plan(fp8_source, tmp_path)
    assert code == 0, out
    assert "FP8 E4M3 block-wise (128x128 blocks" in out and "the baseline is the decoded original" in out


def test_an_unknown_quantization_config_is_still_exit_7_naming_it(fp8_source: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(fp8_source, tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "hqq"}}))
    code, out = _plan(model, tmp_path)
    assert code == 7 and "already quantized (hqq" in out and "quant_method 'hqq'" in out, out


def test_other_checks_still_apply_to_a_decoded_source(fp8_source: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(fp8_source, tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    code, out = _plan(model, tmp_path)
    assert code == 7 and "vocab_size" in out, out


W4A16 = {"weights": {"format": "int4", "strategy": "group", "group_size": 128}}
FP8_BLOCK = {"weights": {"format": "fp8_e4m3", "strategy": "block"},
             "activations": {"format": "fp8_e4m3", "strategy": "group", "group_size": 128, "dynamic": True}}


def _build(source: Path, tmp_path: Path, quantization: dict, **overrides) -> tuple[int, str]:
    recipe = tmp_path / "recipe.yaml"
    text = yaml.safe_load(recipe_text(source, tmp_path / "reg", **overrides))
    text["quantization"] = quantization
    recipe.write_text(yaml.safe_dump(text))
    result = CliRunner().invoke(main, ["build", str(recipe), "--cache-dir", str(tmp_path / "cache"),
                                       "--report-dir", str(tmp_path / "report"), "--no-publish"])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _artifact(tmp_path: Path) -> Path:
    found = sorted((tmp_path / "cache").rglob("model.safetensors"))
    found = [f for f in found if json.loads((f.parent / "config.json").read_text()).get("quantization_config", {})
             .get("quant_method") == "compressed-tensors"]
    assert len(found) == 1, found
    return found[0].parent


W8A8_FP8 = yaml.safe_load(recipe_text(Path("m"), Path("r")))["quantization"]  # per-channel FP8, FP8 KV cache


@pytest.mark.parametrize("quantization, bits", [(W4A16, 4), (W8A8_FP8, 8)], ids=["W4A16", "W8A8-FP8"])
def test_build_from_the_fp8_original(quantization: dict, bits: int, fp8_source: Path, tmp_path: Path) -> None:
    code, out = _build(fp8_source, tmp_path, quantization, **{"gates.max_ppl_increase_pct": 1000.0})
    assert code == 0, out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "the baseline is the decoded original" in report and "FP8 E4M3 block-wise" in report
    config = json.loads((_artifact(tmp_path) / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == bits
    assert "weight_block_size" not in json.dumps(config)  # the artifact does not carry the source's config
    (meta,) = [json.loads(f.read_text()) for f in (tmp_path / "cache").rglob("quantized.json")]
    assert meta["source"]["decoded_from"].startswith("FP8 E4M3 block-wise (128x128 blocks")


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_fp8_block_target_passes_the_source_codes_through(dtype: str, fp8_source: Path, tmp_path: Path) -> None:
    """Quantizing the decoded weights again would not give them back (float32: other block scales; bf16: the
    decoded values are rounded first): the source's codes and scales are written as they are."""
    code, out = _build(fp8_source, tmp_path, FP8_BLOCK, **{"eval.windows": 2, "calibration.samples": 2,
                                                          "model.dtype": dtype})
    assert code == 0, out
    artifact = _artifact(tmp_path)
    source = load_file(str(fp8_source / "model.safetensors"))
    written = {}
    for f in artifact.glob("*.safetensors"):
        written.update(load_file(str(f)))
    linears = [n for n in source if n.endswith("_proj.weight")]
    assert len(linears) == 14
    for name in linears:
        assert written[name].dtype == torch.float8_e4m3fn
        assert written[name].view(torch.uint8).equal(source[name].view(torch.uint8)), name
        assert written[name.replace(".weight", ".weight_scale")].equal(source[name + "_scale_inv"]), name


def test_a_per_tensor_fp8_source_keeps_its_codes_for_a_per_tensor_fp8_target(tmp_path: Path) -> None:
    from llmc.model.source import ModelSource
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    tiny = make_tiny("qwen3", tmp_path / "tiny")
    source = tmp_path / "fp8"
    source.mkdir()
    encoder = _hf_fp8_encoder(None)
    tensors = {}
    for name, t in load_file(str(tiny / "model.safetensors")).items():
        linear = ".layers." in name and name.endswith("_proj.weight")
        tensors.update(encoder._quantize_one(name, t) if linear else {name: t})
    save_file(tensors, str(source / "model.safetensors"))
    config = json.loads((tiny / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": None}
    (source / "config.json").write_text(json.dumps(config))
    quantize_model(ModelSource(source, "t", "t"), Scheme(TensorSpec("fp8_e4m3", "tensor")), tmp_path / "q", None)
    written = load_file(str(tmp_path / "q" / "layers" / "00001.safetensors"))
    linears = [n for n in tensors if n.startswith("model.layers.1.") and n.endswith("_proj.weight")]
    assert len(linears) == 7
    # fused siblings (q/k/v, gate/up) share their largest scale, the others' codes requantized as vLLM / SGLang do on
    # load (codes as float16 times their scale, times 1/max; issue 45); o_proj and down_proj keep theirs bit for bit
    top = {}
    for name in linears:
        group = "qkv" if ".self_attn." in name and not name.endswith("o_proj.weight") else (
            "gate_up" if name.endswith(("gate_proj.weight", "up_proj.weight")) else name)
        top[name] = group
    for name in linears:
        members = [n for n in linears if top[n] == top[name]]
        scale = max(tensors[n + "_scale_inv"].float().max() for n in members)
        dq = tensors[name].to(torch.float16) * tensors[name + "_scale_inv"].float().reshape(())
        want = (dq.float() * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
        if len(members) == 1:
            want = tensors[name]
        assert written[name].view(torch.uint8).equal(want.view(torch.uint8)), name
        assert written[name + "_scale"].equal(scale.reshape(1)), name
    assert any(not written[n].view(torch.uint8).equal(tensors[n].view(torch.uint8)) for n in linears)


def test_a_mixture_of_experts_fp8_original_is_quantized_from_its_decoded_experts(tmp_path: Path) -> None:
    """Qwen3-MoE as Qwen's FP8 releases store it (every expert's projections FP8 block-wise, hidden 64: partial
    blocks): each expert is quantized from its decoded weight."""
    from llmc.model.source import ModelSource
    from llmc.quant.numerics import quantize_weight
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    source = save_fp8_block(make_tiny("qwen3_moe", tmp_path / "tiny"), tmp_path / "fp8")
    spec = TensorSpec("int4", "group", group_size=32)
    quantize_model(ModelSource(source, "t", "t"), Scheme(spec), tmp_path / "q", None)
    reader = CheckpointReader(source)
    written = load_file(str(tmp_path / "q" / "layers" / "00000.safetensors"))
    experts = [n for n in reader.names() if n.startswith("model.layers.0.mlp.experts.") and n.endswith("_proj.weight")]
    assert len(experts) == 12 and all(reader.encoded(n) is not None for n in experts)
    for name in experts:
        assert torch.equal(written[name], quantize_weight(reader.get(name), spec).codes), name
