"""llmc's NVFP4 / MXFP4 / MXFP8 / block-FP8 tensors decode, through compressed-tensors' own compressors and through
transformers loading a whole checkpoint, to exactly llmc's dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmc.formats.microscaling_export import (
    COMPRESSED_TENSORS_FORMATS,
    compressed_tensors_fp8_block_tensors,
    compressed_tensors_scheme,
    compressed_tensors_tensors,
    modelopt_nvfp4_tensors,
)
from llmc.quant.block_fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from llmc.quant.microscaling import (
    MICROSCALING_FORMATS,
    NVFP4,
    BlockQuantized,
    dequantize_blocks,
    e2m1_decode,
    fused_groups,
    nvfp4_global_scale,
    nvfp4_global_scales,
    quantize_blocks,
    unpack_e2m1,
)

pytest.importorskip("compressed_tensors")


def _weight(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3, 40] = 0.5  # outlier
    w[5, :32] = 0.0  # zero blocks
    w[6, 32:64] *= 1e-5  # tiny blocks: subnormal E4M3 scales, small E8M0 exponents
    return w


def _quantized(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(stored tensors, llmc's float32 dequantized weight)."""
    if name == "fp8_block":
        codes, scale = quantize_fp8_blocks(w)
        return compressed_tensors_fp8_block_tensors(codes, scale), dequantize_fp8_blocks(codes, scale)
    q = quantize_blocks(w, MICROSCALING_FORMATS[name])
    return compressed_tensors_tensors(q), dequantize_blocks(q)


@pytest.mark.parametrize("name", list(COMPRESSED_TENSORS_FORMATS))
def test_compressed_tensors_compressor_decodes_llmc_bytes_exactly(name: str) -> None:
    from compressed_tensors.compressors import BaseCompressor

    w = _weight()
    stored, ours = _quantized(name, w)
    compressor = BaseCompressor.get_value_from_registry(COMPRESSED_TENSORS_FORMATS[name][0])
    decoded = compressor.decompress(stored, compressed_tensors_scheme(name, ["Linear"]))["weight"]
    # compressed-tensors decodes FP4 into bf16 (its unpacking's dtype): llmc's float32 values rounded once to bf16.
    # MX and block-FP8 values are code x power of two / float32 scale: exact in float32.
    expected = ours.to(decoded.dtype)
    assert decoded.shape == w.shape
    assert torch.equal(decoded, expected), (decoded.float() - expected.float()).abs().max()


def _write_checkpoint(base: Path, out: Path, name: str) -> dict[str, torch.Tensor]:
    """A copy of `base` with every decoder-layer Linear in `name`, configured with compressed-tensors' preset;
    returns llmc's dequantized weights by parameter name."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    tensors, reference = {}, {}
    for key, value in load_file(base / "model.safetensors").items():
        if not key.endswith("_proj.weight"):
            tensors[key] = value
            continue
        stored, reference[key] = _quantized(name, value)
        module = key.removesuffix(".weight")
        tensors.update({f"{module}.{local}": t for local, t in stored.items()})
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    quant = QuantizationConfig(config_groups={"group_0": compressed_tensors_scheme(name, ["Linear"])},
                               format=COMPRESSED_TENSORS_FORMATS[name][0], quantization_status="compressed",
                               ignore=["lm_head"]).model_dump(mode="json")
    config["quantization_config"] = {**quant, "quant_method": "compressed-tensors",
                                     "version": compressed_tensors.__version__}
    (out / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("name", list(COMPRESSED_TENSORS_FORMATS))
def test_transformers_decompresses_an_llmc_checkpoint_to_llmc_weights(name: str, tiny_model_factory,
                                                                      tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    base = tiny_model_factory(tmp_path / "base", hidden=128, intermediate=256)
    reference = _write_checkpoint(base, tmp_path / name, name)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    state = model.state_dict()
    assert len(reference) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for key, ours in reference.items():
        expected = ours.to(torch.bfloat16).float() if name == "nvfp4" else ours
        assert torch.equal(state[key], expected), (key, (state[key] - expected).abs().max())


def test_each_group_names_its_compression_format() -> None:
    """A mixed-precision checkpoint's loaders read each config group's own `format` (llm-compressor writes it)."""
    for name, (compression, _, _) in COMPRESSED_TENSORS_FORMATS.items():
        assert compressed_tensors_scheme(name, ["Linear"]).format == compression


def test_fused_siblings_share_one_global_scale_so_a_fused_loader_decodes_each() -> None:
    """vLLM and SGLang load q/k/v (and gate/up) as one matmul with one NVFP4 global scale, the largest stored
    (`weight_global_scale.max()`): with per-tensor scales the other siblings decode wrong; shared, exactly."""
    g = torch.Generator().manual_seed(5)
    spread = {"self_attn.q_proj": 0.02, "self_attn.k_proj": 0.05, "self_attn.v_proj": 0.01,
              "self_attn.o_proj": 0.03, "mlp.gate_proj": 0.02, "mlp.up_proj": 0.04, "mlp.down_proj": 0.02}
    weights = {f"model.layers.0.{local}": torch.randn(32, 64, generator=g) * std for local, std in spread.items()}
    names = list(weights)
    q, k, v, o, gate, up, down = names
    assert fused_groups(names) == [[q, k, v], [o], [gate, up], [down]]
    assert fused_groups([q, k, o]) == [[q], [k], [o]]  # a set fuses only when all of it is there
    scales = nvfp4_global_scales(weights)
    joint = nvfp4_global_scale(torch.stack([weights[n].abs().amax() for n in (q, k, v)]).amax())
    assert all(torch.equal(scales[n], joint) for n in (q, k, v))
    assert torch.equal(scales[o], nvfp4_global_scale(weights[o].abs().amax()))

    def fused_load(group: list[str], given: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_blocks(weights[n], NVFP4, global_scale=given.get(n)) for n in group]
        fused = BlockQuantized(codes=torch.cat([p.codes for p in parts]), scale=torch.cat([p.scale for p in parts]),
                               global_scale=torch.stack([p.global_scale for p in parts]).amax().reshape(1),
                               format=NVFP4)
        return dequantize_blocks(fused), torch.cat([dequantize_blocks(p) for p in parts])

    for group in ([q, k, v], [gate, up]):
        runtime, ours = fused_load(group, scales)
        assert torch.equal(runtime, ours)
        runtime, ours = fused_load(group, {})
        assert (runtime - ours).abs().max() > 0.1 * ours.abs().max()


def test_modelopt_layout_is_the_same_bytes_with_the_reciprocal_global_scale() -> None:
    w = _weight(seed=2)
    q = quantize_blocks(w, NVFP4)
    ct, mo = compressed_tensors_tensors(q), modelopt_nvfp4_tensors(q)
    assert torch.equal(mo["weight"], ct["weight_packed"]) and mo["weight"].dtype == torch.uint8
    assert torch.equal(mo["weight_scale"].view(torch.uint8), ct["weight_scale"].view(torch.uint8))
    assert mo["weight_scale_2"].shape == () and mo["weight_scale_2"].dtype == torch.float32
    # ModelOpt's decode (NVFP4QTensor.dequantize): e2m1[nibble] x (weight_scale x weight_scale_2), per 16 elements.
    modelopt = (e2m1_decode(unpack_e2m1(mo["weight"])).unflatten(-1, (-1, 16))
                * (mo["weight_scale"].float() * mo["weight_scale_2"]).unsqueeze(-1)).flatten(-2)
    ours = dequantize_blocks(q)
    assert (modelopt - ours).abs().max().item() <= ours.abs().max().item() * 2.0**-23
    with pytest.raises(ValueError, match="nvfp4"):
        modelopt_nvfp4_tensors(quantize_blocks(w, MICROSCALING_FORMATS["mxfp4"]))


# --------------------------------------------------------------------------- GGUF


def test_gguf_mxfp4_blocks_decode_through_gguf_py_to_llmc_weights() -> None:
    from gguf import GGMLQuantizationType, quants

    from llmc.formats.microscaling_export import gguf_mxfp4_blocks

    w = _weight()
    q = quantize_blocks(w, MICROSCALING_FORMATS["mxfp4"])
    raw = gguf_mxfp4_blocks(q)
    assert raw.shape == (64, 256 // 32 * 17) and raw.dtype == "uint8"
    # byte order spelled out for the first block of row 0: exponent, then element j | element j + 16 << 4
    codes = q.codes[0, :32]
    assert raw[0, 0] == q.scale[0, 0].item()
    assert raw[0, 1:17].tolist() == (codes[:16] | (codes[16:] << 4)).tolist()
    decoded = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.MXFP4))
    assert torch.equal(decoded, dequantize_blocks(q))


def test_gguf_nvfp4_blocks_decode_through_gguf_py_to_llmc_weights() -> None:
    from gguf import GGMLQuantizationType, quants

    from llmc.formats.microscaling_export import gguf_nvfp4_blocks

    w = _weight()
    q = quantize_blocks(w, NVFP4)
    raw, scale = gguf_nvfp4_blocks(q)
    assert raw.shape == (64, 256 // 64 * 36) and scale.dtype == "float32"
    codes = q.codes[0, :64]
    assert raw[0, :4].tolist() == q.scale[0, :4].view(torch.uint8).tolist()
    assert raw[0, 4:12].tolist() == (codes[:8] | (codes[8:16] << 4)).tolist()  # sub-block 0: j | j + 8
    assert raw[0, 12:20].tolist() == (codes[16:24] | (codes[24:32] << 4)).tolist()  # sub-block 1
    # gguf-py decodes code x block scale (no global scale: llama.cpp multiplies the product by `.scale`).
    decoded = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.NVFP4))
    block_scale = q.scale.float().repeat_interleave(16, -1)
    assert torch.equal(decoded, e2m1_decode(q.codes) * block_scale)
    ours = dequantize_blocks(q)
    assert ((decoded * torch.from_numpy(scale) - ours).abs() <= ours.abs() * 2.0**-22).all()


def test_gguf_file_round_trip_of_both_fp4_types(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

    from llmc.formats.microscaling_export import gguf_mxfp4_blocks, gguf_nvfp4_blocks

    w = _weight(seed=4)
    mx = quantize_blocks(w, MICROSCALING_FORMATS["mxfp4"])
    nv = quantize_blocks(w, NVFP4)
    nv_raw, nv_scale = gguf_nvfp4_blocks(nv)
    writer = GGUFWriter(tmp_path / "fp4.gguf", "llama")
    writer.add_tensor("blk.0.ffn_up.weight", gguf_mxfp4_blocks(mx), raw_dtype=GGMLQuantizationType.MXFP4)
    writer.add_tensor("blk.0.ffn_down.weight", nv_raw, raw_dtype=GGMLQuantizationType.NVFP4)
    writer.add_tensor("blk.0.ffn_down.scale", nv_scale)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in GGUFReader(tmp_path / "fp4.gguf").tensors}
    up, down = tensors["blk.0.ffn_up.weight"], tensors["blk.0.ffn_down.weight"]
    assert up.tensor_type == GGMLQuantizationType.MXFP4 and down.tensor_type == GGMLQuantizationType.NVFP4
    assert [int(n) for n in down.shape] == [256, 64]  # ggml order: row length first
    assert torch.equal(torch.from_numpy(quants.dequantize(up.data, up.tensor_type)), dequantize_blocks(mx))
    scaled = quants.dequantize(down.data, down.tensor_type) * tensors["blk.0.ffn_down.scale"].data
    assert torch.allclose(torch.from_numpy(scaled), dequantize_blocks(nv), rtol=2.0**-22, atol=0)


def test_gguf_blocks_refuse_widths_the_layout_cannot_hold() -> None:
    from llmc.formats.microscaling_export import gguf_mxfp4_blocks, gguf_nvfp4_blocks

    with pytest.raises(ValueError, match="multiple of 64"):
        gguf_nvfp4_blocks(quantize_blocks(torch.ones(2, 48), NVFP4))
    with pytest.raises(ValueError, match="GGUF MXFP4"):
        gguf_mxfp4_blocks(quantize_blocks(torch.ones(2, 64), NVFP4))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
def test_compressed_tensors_own_quantizer_gives_llmc_bytes(name: str) -> None:
    """compressed-tensors' observer math (generate_gparam, calculate_qparams) and compressor on the same weight give
    llmc's bytes, except in two kinds of block. NVFP4: where the block scale rounds to 0 in E4M3 (an all-zero block,
    or one below 2^-10 of the largest block's scale) compressed-tensors stores its dtype's eps, 0.125, which zeroes
    the block's codes; llmc stores 0 for an all-zero block and 2^-9 for a live one, keeping its values. MX: where the
    block's absmax mantissa is 1.75 or more, compressed-tensors rounds the absmax up to the next power of two before
    taking its exponent (`round_to_power_2`), one above OCP's floor(log2(amax)) - emax_elem that llmc (and ggml's
    quantizer) follows."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = _weight()
    fmt = MICROSCALING_FORMATS[name]
    scheme = compressed_tensors_scheme(name, ["Linear"])
    blocks = w.unflatten(-1, (-1, fmt.block_size))
    state = {"weight": w}
    global_scale = None
    if name == "nvfp4":
        global_scale = state["weight_global_scale"] = generate_gparam(w.min(), w.max())
    state["weight_scale"], _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale)
    compressor = BaseCompressor.get_value_from_registry(COMPRESSED_TENSORS_FORMATS[name][0])
    theirs = compressor.compress(state, scheme)
    ours = compressed_tensors_tensors(quantize_blocks(w, fmt))
    codes = "weight" if name == "mxfp8" else "weight_packed"
    if name == "nvfp4":
        assert torch.equal(theirs["weight_global_scale"], ours["weight_global_scale"])
        their_scale, our_scale = theirs["weight_scale"].float(), ours["weight_scale"].float()
        underflow = (blocks.abs().amax(-1) / 6 * global_scale).to(torch.float8_e4m3fn).float() == 0
        assert 0 < underflow.sum() < underflow.numel()
        assert torch.equal(their_scale[~underflow], our_scale[~underflow])
        assert (their_scale[underflow] == 0.125).all() and (our_scale[underflow] <= 2.0**-9).all()
        same = ~underflow.repeat_interleave(8, -1)  # 8 packed bytes per 16-element block
        assert torch.equal(theirs[codes][same], ours[codes][same])
        return
    amax = blocks.abs().amax(-1)
    mantissa, _ = torch.frexp(amax)  # amax = mantissa x 2^e, mantissa in [0.5, 1)
    rounds_up = (amax > 0) & (mantissa >= 0.875)
    shift = theirs["weight_scale"].to(torch.int16) - ours["weight_scale"].to(torch.int16)
    assert torch.equal(shift, rounds_up.to(torch.int16))
    assert 0 < rounds_up.sum() < rounds_up.numel()
    same = ~rounds_up.repeat_interleave(theirs[codes].shape[-1] // rounds_up.shape[-1], -1)
    assert torch.equal(theirs[codes].view(torch.uint8)[same], ours[codes].view(torch.uint8)[same])
