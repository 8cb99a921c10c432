"""GGUF for Gemma-4 text (issue 45): a tiny random Gemma-4 with every feature llama.cpp's gemma4 reads beyond Gemma 3's
(per-layer input embeddings, full layers with wider heads than the sliding ones, KV-shared trailing layers with
double-wide MLPs: tests/unit/families.py GEMMA4_GGUF), quantized by llmc, exported, and read back with gguf-py. The
tensors and shapes below are written out from the llama.cpp that llama-cpp-python 0.3.36 vendors
(src/models/gemma4.cpp `load_arch_tensors`, names from src/llama-arch.cpp), the keys from its `load_arch_hparams` and
conversion/gemma.py Gemma4Model, not from the exporter's own tables. Scored in llama.cpp against the torch reference
by tests/integration/test_gguf_moe_llamacpp.py (slow, llama)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from llmc.errors import IncompatibleTargetError
from llmc.formats import gguf as G
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
from tests.unit.families import GEMMA4_GGUF, make_tiny

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-gemma4")
    folder = make_tiny("gemma4", root / "model", **GEMMA4_GGUF)
    quantize_model(ModelSource(folder, "t", str(folder)), Scheme(TensorSpec("int8", "channel")), root / "q", None)
    qm = QuantizedModel.open(root / "q")
    return folder, qm, G.export_gguf(qm, root / "out")


def _expected_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """gemma4.cpp load_arch_tensors (ggml ne order: input dim first), for this config's layers: the sliding layers'
    head width head_dim and num_key_value_heads, the full layers' 32 and 1 KV head (per_layer_config) with no attn_v
    (attention_k_eq_v: llama.cpp takes V from K); the KV-shared layers (the last num_kv_shared_layers, hparams.has_kv
    false) without k/v and k norm, their MLPs twice intermediate_size."""
    h, n_head, n_kv, v = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    n, pl, ff = c["num_hidden_layers"], c["hidden_size_per_layer_input"], c["intermediate_size"]
    first_shared = n - c["num_kv_shared_layers"]
    want = {"token_embd.weight": (h, v), "output_norm.weight": (h,),  # tied: llama.cpp duplicates token_embd
            "per_layer_token_embd.weight": (pl * n, v), "per_layer_model_proj.weight": (h, pl * n),
            "per_layer_proj_norm.weight": (pl,), "rope_freqs.weight": (32 // 2,)}
    for i, kind in enumerate(c["layer_types"]):
        hd, kv = (16, n_kv) if kind == "sliding_attention" else (32, 1)
        f = ff if i < first_shared else 2 * ff
        layer = {"attn_norm.weight": (h,), "attn_q.weight": (h, hd * n_head), "attn_output.weight": (hd * n_head, h),
                 "attn_q_norm.weight": (hd,), "post_attention_norm.weight": (h,), "layer_output_scale.weight": (1,),
                 "ffn_norm.weight": (h,), "ffn_gate.weight": (h, f), "ffn_up.weight": (h, f),
                 "ffn_down.weight": (f, h), "post_ffw_norm.weight": (h,), "inp_gate.weight": (h, pl),
                 "proj.weight": (pl, h), "post_norm.weight": (h,)}
        if i < first_shared:
            layer |= {"attn_k.weight": (h, kv * hd), "attn_k_norm.weight": (hd,)}
        if i < first_shared and kind == "sliding_attention":
            layer["attn_v.weight"] = (h, kv * hd)
        want |= {f"blk.{i}.{k}": s for k, s in layer.items()}
    return want


def _field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    assert f is not None, f"missing GGUF key {key}"
    return f.contents()


def test_every_tensor_llama_cpps_gemma4_creates_is_written_with_its_shape(exported) -> None:
    _, qm, res = exported
    c = qm.config
    full = {"head_dim": 32, "num_key_value_heads": 1}
    assert c["per_layer_config"] == {"1": full, "3": full}  # how transformers 5.23 saves the full layers' widths
    reader = GGUFReader(str(res.path))
    assert _field(reader, "general.architecture") == "gemma4"
    assert {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors} == _expected_tensors(c)


def test_the_keys_gemma4_reads_carry_the_configs_values(exported) -> None:
    _, qm, res = exported
    c = qm.config
    reader = GGUFReader(str(res.path))
    rope = c["rope_parameters"]
    want = {"embedding_length": 64, "block_count": 4, "attention.head_count": 4,
            "attention.head_count_kv": [2, 1, 2, 1],  # per layer: the full layers' one (attention_k_eq_v)
            "attention.key_length": 32, "attention.value_length": 32,  # the full layers'
            "attention.key_length_swa": 16, "attention.value_length_swa": 16,
            "rope.dimension_count": 32, "rope.dimension_count_swa": 16,
            "rope.freq_base": rope["full_attention"]["rope_theta"],
            "rope.freq_base_swa": rope["sliding_attention"]["rope_theta"],
            "attention.sliding_window": c["sliding_window"],
            "attention.sliding_window_pattern": [True, False, True, False],
            "embedding_length_per_layer_input": 8, "attention.shared_kv_layers": 2,
            "feed_forward_length": [128, 128, 256, 256]}
    for key, value in want.items():
        got = _field(reader, f"gemma4.{key}")
        assert (got == value if isinstance(value, list) else got == pytest.approx(value)), key
    assert "gemma4.final_logit_softcapping" not in reader.fields  # the tiny config has none: llama.cpp's default 0


def test_every_tensor_decodes_to_llmcs_canonical_values(exported) -> None:
    """Quantized Linears: Q8_0 blocks = the canonical codes with fp16 scales (F16 where the input width, 8, is no
    multiple of 32); everything else as the checkpoint holds it: Gemma-4's norms multiply by the weight itself (no
    +1, unlike Gemma 2/3), layer_scalar, the per-layer embedding and projection; rope_freqs the proportional rope."""
    _, qm, res = exported
    tensors = {t.name: t for t in GGUFReader(str(res.path)).tensors}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    names = G._arch(qm.config).tensor_names()

    def decoded(name: str) -> np.ndarray:
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape([int(d) for d in t.shape[::-1]])

    for module in qm.quantized_modules:
        name = G.gguf_name(f"{module}.weight", names)
        want = qm.dequantized_weight(canonical, module).numpy()
        assert tensors[name].tensor_type.name == ("F16" if want.shape[1] % 32 else "Q8_0"), name
        np.testing.assert_allclose(decoded(name), want, rtol=0, atol=2.0**-10 * float(np.abs(want).max()),
                                   err_msg=name)
    assert len(qm.quantized_modules) == 9 + 8 + 2 * 7  # no v_proj in layer 1 (k_eq_v), no k/v in the shared ones
    kept = [k for k in canonical if k.rsplit(".", 1)[0] not in qm.quantized_modules and ".weight_" not in k]
    for k in kept:
        name = G.gguf_name(k, names)
        want = canonical[k].float().numpy()
        if tensors[name].tensor_type.name == "F32":
            np.testing.assert_array_equal(decoded(name).reshape(want.shape), want, err_msg=name)
        else:  # the embeddings and the outer projection, F16: the checkpoint's values rounded to fp16
            assert tensors[name].tensor_type.name == "F16", name
            np.testing.assert_array_equal(decoded(name), want.astype(np.float16), err_msg=name)
    assert {G.gguf_name(k, names) for k in kept} >= {"blk.0.attn_norm.weight", "blk.0.layer_output_scale.weight",
                                                      "per_layer_token_embd.weight", "per_layer_model_proj.weight"}
    # partial_rotary_factor 0.25 of a 32-wide head: 4 rotated pairs, 12 unrotated (transformers' inv_freq 0 there)
    np.testing.assert_array_equal(tensors["rope_freqs.weight"].data, np.array([1.0] * 4 + [1e30] * 12, np.float32))


def _refused(config: dict, **changes) -> str:
    c = copy.deepcopy(config) | changes
    with pytest.raises(IncompatibleTargetError) as e:
        G._arch(c)
    return str(e.value)


def test_gemma4_configs_llmc_does_not_write_or_llama_cpp_computes_otherwise_are_refused(exported) -> None:
    _, qm, _ = exported
    c = qm.config
    # the MoE variant is written (tests/unit/test_gemma4_moe.py reads its tensors back)
    assert G._arch(copy.deepcopy(c) | {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                       "moe_intermediate_size": 128}).family.arch == "GEMMA4"
    assert "the full layers' KV head counts differ" in _refused(c, per_layer_config={
        "1": {"head_dim": 32, "num_key_value_heads": 1}, "3": {"head_dim": 32, "num_key_value_heads": 2}})
    # transformers' shared layers read the last unshared layer of their type (here 0 full, 1 sliding); llama.cpp's
    # gemma4 reuse callback reads layer n_layer_kv_from_start - 2 for sliding layers, - 1 for full ones
    swapped = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert "llama.cpp reads layer 0 (sliding) and 1 (full)" in _refused(
        c, layer_types=swapped, per_layer_config={"0": c["per_layer_config"]["1"], "3": c["per_layer_config"]["3"]})
    assert "vocab_size_per_layer_input = 299" in _refused(c, vocab_size_per_layer_input=299)
    rope = copy.deepcopy(c["rope_parameters"])
    rope["full_attention"]["factor"] = 8.0
    assert "factor 8.0" in _refused(c, rope_parameters=rope)
    assert "per_layer_config" in c and G._arch(c).head_dim == 32
    assert G._arch({k: v for k, v in c.items() if k != "per_layer_config"}).head_dim == 512  # transformers' default


def _recipe(folder: Path, runtime: str):
    import yaml

    from llmc.recipe.load import parse_recipe

    return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)}, "targets": [
        {"runtime": runtime}], "quantization": {"weights": {"format": "int8", "strategy": "channel"}}}))


def test_llama_cpp_plans_gemma4_natively_and_ollama_refuses_it_with_the_reason(exported) -> None:
    from llmc.planning.plan import make_plan

    folder, _, _ = exported
    plan = make_plan(_recipe(folder, "llama.cpp"), folder)
    assert [(t["exporter"], t["status"]) for t in plan.targets] == [("gguf", "native")]
    with pytest.raises(IncompatibleTargetError, match=r"which Ollama release loads llama\.cpp's gemma4") as e:
        make_plan(_recipe(folder, "ollama"), folder)
    assert e.value.exit_code == 3
