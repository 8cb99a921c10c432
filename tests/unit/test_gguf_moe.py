"""GGUF for the Mixture-of-Experts families llama.cpp has (issue 45): a tiny random model of each, quantized by llmc,
exported, and read back with gguf-py's GGUFReader. Every tensor carries the name and shape llama.cpp's loader creates
for that architecture, written out below from the llama.cpp that llama-cpp-python 0.3.36 vendors
(src/models/<arch>.cpp `load_arch_tensors`, names from src/llama-arch.cpp), not from the exporter's own tables;
the per-architecture keys its `load_arch_hparams` reads are present with the config's values; each expert's slice of
a merged `*_exps` tensor decodes to llmc's canonical weights of that expert. Families llama.cpp would compute
differently, or whose tensors llmc does not write, are refused at plan time with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from llmc.errors import IncompatibleTargetError
from llmc.formats import gguf as G
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
from tests.unit.families import make_tiny

pytestmark = pytest.mark.heavy

SCHEMES = {"w8a16": Scheme(TensorSpec("int8", "channel")),
           "w4a16-g32": Scheme(TensorSpec("int4", "group", group_size=32))}
WRITTEN = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v32", "glm4_moe", "minimax_m2", "gpt_oss",
           "qwen3_next", "qwen3_5_moe", "llama4_text")
# config overrides for the GGUF: Qwen2-MoE's published checkpoints keep the softmax weights unnormalised, as
# llama.cpp's qwen2moe graph does (the tests' tiny model normalises: refused below)
QWEN35_ROPE = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default", "mrope_section": [1, 1, 0]}
GGUF_OVERRIDES = {"qwen2_moe": {"norm_topk_prob": False},
                  "deepseek_v3": {"first_k_dense_replace": 1},  # layer 0 a dense MLP, as DeepSeek-V3's first three
                  # llama.cpp's indexer rotation is 64 wide (refused below otherwise)
                  "deepseek_v32": {"first_k_dense_replace": 1, "index_head_dim": 64},
                  "gpt_oss": {"swiglu_limit": 7.0},  # the published clamp, which llama.cpp fixes
                  # rope sections that fit the tiny heads (transformers' default [11, 11, 10] needs 64 rotary dims)
                  "qwen3_5_moe": {"rope_parameters": QWEN35_ROPE},
                  # llama.cpp's fixed chunk; 4 layers, so that one is a no-rope layer (llama.cpp needs one)
                  "llama4_text": {"attention_chunk_size": 8192, "num_hidden_layers": 4}}


# llama.cpp's names (src/llama-arch.cpp) of the architectures the gguf package (0.19) does not name
LLAMA_ARCH_NAMES = {"DEEPSEEK32": "deepseek32"}


def _expected_layer(arch: str, c: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """A layer's tensors as llama.cpp creates them (ggml ne order: input dim first), src/models/<arch>.cpp."""
    h, n_head, e = c["hidden_size"], c["num_attention_heads"], 4
    n_kv, hd = c.get("num_key_value_heads") or n_head, c.get("head_dim") or h // n_head
    ff = c.get("moe_intermediate_size") or c["intermediate_size"]
    exps = {"ffn_gate_inp.weight": (h, e), "ffn_gate_exps.weight": (h, ff, e), "ffn_up_exps.weight": (h, ff, e),
            "ffn_down_exps.weight": (ff, h, e)}
    if layer < c.get("first_k_dense_replace", 0):  # leading dense layers: a plain MLP of intermediate_size
        f = c["intermediate_size"]
        exps = {"ffn_gate.weight": (h, f), "ffn_up.weight": (h, f), "ffn_down.weight": (f, h)}
    gqa = {"attn_norm.weight": (h,), "attn_q.weight": (h, n_head * hd), "attn_k.weight": (h, n_kv * hd),
           "attn_v.weight": (h, n_kv * hd), "attn_output.weight": (n_head * hd, h)}
    if arch == "LLAMA4":  # src/models/llama4.cpp: MoE every interleave_moe_layer_step-th layer, a shared expert
        if (layer + 1) % c["interleave_moe_layer_step"]:
            f = c["intermediate_size_mlp"]
            exps = {"ffn_gate.weight": (h, f), "ffn_up.weight": (h, f), "ffn_down.weight": (f, h)}
        else:
            exps |= {"ffn_gate_shexp.weight": (h, ff), "ffn_up_shexp.weight": (h, ff), "ffn_down_shexp.weight": (ff, h)}
        return {**gqa, "ffn_norm.weight": (h,), **exps}
    if arch == "LLAMA":  # llama.cpp: Mixtral's experts, no shared expert
        return {**gqa, "ffn_norm.weight": (h,), **exps}
    if arch == "GPT_OSS":  # src/models/openai-moe.cpp: biases everywhere, sinks, the router's bias
        return {**gqa, "attn_q.bias": (n_head * hd,), "attn_k.bias": (n_kv * hd,), "attn_v.bias": (n_kv * hd,),
                "attn_output.bias": (h,), "attn_sinks.weight": (n_head,), "post_attention_norm.weight": (h,), **exps,
                "ffn_gate_inp.bias": (e,), "ffn_gate_exps.bias": (ff, e), "ffn_up_exps.bias": (ff, e),
                "ffn_down_exps.bias": (h, e)}
    if arch in ("QWEN3NEXT", "QWEN35MOE"):  # src/models/qwen3next.cpp, qwen35moe.cpp: gated DeltaNet where
        # layer_types says linear_attention
        fs = c["shared_expert_intermediate_size"]
        shared = {"ffn_gate_inp_shexp.weight": (h, 1), "ffn_gate_shexp.weight": (h, fs),
                  "ffn_up_shexp.weight": (h, fs), "ffn_down_shexp.weight": (fs, h)}
        common = {"attn_norm.weight": (h,), "post_attention_norm.weight": (h,), **exps, **shared}
        if c["layer_types"][layer] == "full_attention":  # q_proj twice as wide: the output gate
            return {**common, "attn_q.weight": (h, 2 * n_head * hd), "attn_k.weight": (h, n_kv * hd),
                    "attn_v.weight": (h, n_kv * hd), "attn_output.weight": (n_head * hd, h),
                    "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
        hk, hv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        nk, nv, conv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_conv_kernel_dim"]
        gates = {"ssm_ba.weight": (h, 2 * nv)} if arch == "QWEN3NEXT" else {"ssm_alpha.weight": (h, nv),
                                                                            "ssm_beta.weight": (h, nv)}
        return {**common, "attn_qkv.weight": (h, 2 * nk * hk + nv * hv), "attn_gate.weight": (h, nv * hv),
                "ssm_conv1d.weight": (conv, 2 * nk * hk + nv * hv), "ssm_dt.bias": (nv,), "ssm_a": (nv,),
                **gates, "ssm_norm.weight": (hv,), "ssm_out.weight": (nv * hv, h)}
    if arch == "QWEN3MOE":
        return {**gqa, "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,), "ffn_norm.weight": (h,), **exps}
    if arch == "QWEN2MOE":
        fs = c["shared_expert_intermediate_size"]
        return {**gqa, "ffn_norm.weight": (h,), **exps, "ffn_gate_inp_shexp.weight": (h, 1),
                "ffn_gate_shexp.weight": (h, fs), "ffn_up_shexp.weight": (h, fs), "ffn_down_shexp.weight": (fs, h)}
    if arch == "MINIMAXM2":  # q/k norms over all heads
        return {**gqa, "attn_q_norm.weight": (n_head * hd,), "attn_k_norm.weight": (n_kv * hd,),
                "ffn_norm.weight": (h,), **exps, "exp_probs_b.bias": (e,)}
    fs = ff * c["n_shared_experts"]
    shared = {"ffn_gate_shexp.weight": (h, fs), "ffn_up_shexp.weight": (h, fs), "ffn_down_shexp.weight": (fs, h),
              "exp_probs_b.bias": (e,)} if "ffn_gate_inp.weight" in exps else {}
    if arch == "GLM4_MOE":  # q/k/v biases; the pre-FFN norm is attn_post_norm ("post_attention_norm"); per-head
        # q/k norms where use_qk_norm (GLM-4.5; src/models/glm4-moe.cpp loads them as optional, {n_embd_head_k})
        norms = {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)} if c.get("use_qk_norm") else {}
        return {**gqa, "attn_q.bias": (n_head * hd,), "attn_k.bias": (n_kv * hd,), "attn_v.bias": (n_kv * hd,),
                **norms, "post_attention_norm.weight": (h,), **exps, **shared}
    assert arch in ("DEEPSEEK2", "DEEPSEEK32")
    qr, kvr, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    mla = {"attn_norm.weight": (h,), "attn_q_a_norm.weight": (qr,), "attn_kv_a_norm.weight": (kvr,),
           "attn_q_a.weight": (h, qr), "attn_q_b.weight": (qr, n_head * (nope + rope)),
           "attn_kv_a_mqa.weight": (h, kvr + rope), "attn_output.weight": (n_head * v, h), "ffn_norm.weight": (h,),
           **exps, **shared}
    if arch == "DEEPSEEK2":  # MLA without key_length_mla: llama.cpp's attn_kv_b (decompressed) branch
        return {**mla, "attn_kv_b.weight": (kvr, n_head * (nope + v))}
    # src/models/deepseek32.cpp: the absorbed form (wk_b {qk_nope, kv_lora_rank, n_head}, wv_b {kv_lora_rank,
    # v_head_dim, n_head}, no attn_kv_b) and the lightning indexer
    ih, ihd = c["index_n_heads"], c["index_head_dim"]
    return {**mla, "attn_k_b.weight": (nope, kvr, n_head), "attn_v_b.weight": (kvr, v, n_head),
            "indexer.attn_q_b.weight": (qr, ih * ihd), "indexer.attn_k.weight": (h, ihd),
            "indexer.k_norm.weight": (ihd,), "indexer.k_norm.bias": (ihd,), "indexer.proj.weight": (h, ih)}


def _expected_keys(arch: str, c: dict) -> dict[str, object]:
    """The per-architecture keys its load_arch_hparams reads (beyond the common ones), with the config's values."""
    out: dict[str, object] = {"expert_count": 4, "expert_used_count": 2}
    if arch != "LLAMA":
        out["expert_feed_forward_length"] = c.get("moe_intermediate_size") or c["intermediate_size"]
    if arch == "QWEN2MOE":
        out["expert_shared_feed_forward_length"] = c["shared_expert_intermediate_size"]
    if arch in ("DEEPSEEK2", "DEEPSEEK32", "GLM4_MOE"):
        out |= {"expert_shared_count": 1, "leading_dense_block_count": c["first_k_dense_replace"],
                "expert_weights_norm": True,
                "expert_weights_scale": c["routed_scaling_factor"], "expert_gating_func": 2}  # 2: sigmoid
    if arch == "MINIMAXM2":
        out |= {"expert_gating_func": 2, "rope.dimension_count": c["rotary_dim"]}
    if arch == "LLAMA4":
        out |= {"expert_feed_forward_length": c["intermediate_size"], "feed_forward_length": c["intermediate_size_mlp"],
                "interleave_moe_layer_step": c["interleave_moe_layer_step"]}
    if arch == "GPT_OSS":
        rope = c["rope_parameters"]
        out |= {"expert_feed_forward_length": c["intermediate_size"], "attention.sliding_window": c["sliding_window"],
                "attention.sliding_window_pattern": [t == "sliding_attention" for t in c["layer_types"]],
                "rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
                "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                "rope.freq_base": rope["rope_theta"]}
    if arch == "QWEN35MOE":
        out["rope.dimension_sections"] = [*c["rope_parameters"]["mrope_section"], 0]
    if arch in ("QWEN3NEXT", "QWEN35MOE"):
        out |= {"expert_shared_feed_forward_length": c["shared_expert_intermediate_size"],
                "ssm.conv_kernel": c["linear_conv_kernel_dim"], "ssm.state_size": c["linear_key_head_dim"],
                "ssm.group_count": c["linear_num_key_heads"], "ssm.time_step_rank": c["linear_num_value_heads"],
                "ssm.inner_size": c["linear_value_head_dim"] * c["linear_num_value_heads"],
                "attention.recurrent_layers": [t == "linear_attention" for t in c["layer_types"]],
                "rope.dimension_count": int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"])}
    if arch == "GLM4_MOE":
        out["rope.dimension_count"] = c["head_dim"] // 2  # partial_rotary_factor 0.5
    if arch == "DEEPSEEK2":
        out |= {"attention.q_lora_rank": c["q_lora_rank"], "attention.kv_lora_rank": c["kv_lora_rank"],
                "attention.key_length": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
                "attention.value_length": c["v_head_dim"], "attention.head_count_kv": c["num_attention_heads"],
                "rope.dimension_count": c["qk_rope_head_dim"]}
    if arch == "DEEPSEEK32":  # the absorbed form: one KV head, the latent (+ the shared rope key) as key and value
        out |= {"attention.q_lora_rank": c["q_lora_rank"], "attention.kv_lora_rank": c["kv_lora_rank"],
                "attention.key_length": c["kv_lora_rank"] + c["qk_rope_head_dim"],
                "attention.value_length": c["kv_lora_rank"], "attention.head_count_kv": 1,
                "attention.key_length_mla": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
                "attention.value_length_mla": c["v_head_dim"], "rope.dimension_count": c["qk_rope_head_dim"],
                "attention.indexer.head_count": c["index_n_heads"], "attention.indexer.key_length": c["index_head_dim"],
                "attention.indexer.top_k": c["index_topk"]}
    return out


def _build(family: str, root: Path, scheme: Scheme, **config) -> QuantizedModel:
    folder = make_tiny(family, root / "model", **config)
    quantize_model(ModelSource(folder, "t", str(folder)), scheme, root / "q", None)
    return QuantizedModel.open(root / "q")


@pytest.fixture(scope="module", params=[(f, s) for f in WRITTEN for s in SCHEMES if s == "w8a16" or f == "deepseek_v3"],
                ids=lambda p: f"{p[0]}-{p[1]}")
def exported(request, tmp_path_factory):
    family, scheme = request.param
    root = tmp_path_factory.mktemp(f"gguf-{family}-{scheme}")
    qm = _build(family, root, SCHEMES[scheme], **GGUF_OVERRIDES.get(family, {}))
    res = G.export_gguf(qm, root / "out")
    return family, scheme, qm, res


def _field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    assert f is not None, f"missing GGUF key {key}"
    return f.contents()


def test_every_tensor_has_llama_cpps_name_and_shape_and_every_key_is_written(exported) -> None:
    import gguf

    family, _, qm, res = exported
    c = qm.config
    arch = G.GGUF_FAMILIES[c["model_type"]].arch
    prefix = LLAMA_ARCH_NAMES.get(arch) or gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]]
    reader = GGUFReader(str(res.path))
    assert _field(reader, "general.architecture") == prefix
    got = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    want = {"token_embd.weight": (c["hidden_size"], c["vocab_size"]), "output_norm.weight": (c["hidden_size"],)}
    for layer in range(c["num_hidden_layers"]):
        want |= {f"blk.{layer}.{k}": v for k, v in _expected_layer(arch, c, layer).items()}
    if arch in ("MINIMAXM2", "QWEN2MOE", "GPT_OSS"):  # tied, but their loaders require output.weight: written
        want["output.weight"] = want["token_embd.weight"]
    assert got == want  # the others tied: no output.weight, llama.cpp duplicates token_embd
    for key, value in _expected_keys(arch, c).items():
        got_value = _field(reader, f"{prefix}.{key}")
        assert (got_value == value if isinstance(value, (str, list)) else got_value == pytest.approx(value)), key
    # routers in F32 (convert_hf_to_gguf.py keeps FFN_GATE_INP / FFN_GATE_INP_SHEXP F32), experts in the scheme's type
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"
    assert types["blk.1.ffn_down_exps.weight"] == res.plan.weight_type


def test_each_experts_slice_decodes_to_llmcs_canonical_weights(exported) -> None:
    _, _, qm, res = exported
    reader = GGUFReader(str(res.path))
    tensors = {t.name: t for t in reader.tensors}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    names = G._arch(qm.config).tensor_names()
    checked = 0
    for module in qm.quantized_modules:
        if ".linear_attn." in module or (qm.config["model_type"] == "deepseek_v32" and module.endswith("kv_b_proj")):
            # split or reordered: test_qwen3_next_*, test_qwen3_5_*, test_deepseek_v32_* below
            checked += 1
            continue
        name = G.gguf_name(f"{module}.weight", names)
        t = tensors[name]
        decoded = dequantize(t.data, t.tensor_type).reshape([int(d) for d in t.shape[::-1]])
        if ".experts." in module:  # [E, rows, cols]: this expert's slice
            decoded = decoded[int(module.rsplit(".experts.", 1)[1].split(".")[0])]
        if G.GGUF_FAMILIES[qm.config["model_type"]].permute_qk and module.endswith(("q_proj", "k_proj")):
            heads = qm.config["num_attention_heads"] if module.endswith("q_proj") else qm.config["num_key_value_heads"]
            decoded = G.llama_unpermute(torch.from_numpy(decoded.copy()), heads).numpy()
        want = qm.dequantized_weight(canonical, module).numpy()
        # only each block scale's rounding to fp16 separates them (relative 2^-11 of the block's largest weight)
        np.testing.assert_allclose(decoded, want, rtol=0, atol=2.0**-10 * float(np.abs(want).max()))
        checked += 1
    assert checked == len(qm.quantized_modules) and checked >= 3 * 4 + 2
    router = canonical[next(k for k in canonical if k.startswith("model.layers.1.")
                            and k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight",
                                                          "feed_forward.router.weight")))]
    np.testing.assert_array_equal(tensors["blk.1.ffn_gate_inp.weight"].data, router.numpy())  # F32: exact


def test_a_config_llama_cpp_would_compute_differently_is_refused_naming_the_source(tmp_path: Path) -> None:
    """The tests' tiny Qwen2-MoE renormalises its top-k weights; llama.cpp's qwen2moe graph never does."""
    qm = _build("qwen2_moe", tmp_path, SCHEMES["w8a16"])
    with pytest.raises(IncompatibleTargetError, match=r"norm_topk_prob = True.*src/models/qwen2moe\.cpp"):
        G.export_gguf(qm, tmp_path / "out")
    assert not (tmp_path / "out" / G.GGUF_FILE).exists()


def _recipe(folder: Path, runtime: str, weights: dict):
    import yaml

    from llmc.recipe.load import parse_recipe

    return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)}, "targets": [
        {"runtime": runtime}], "quantization": {"weights": weights}}))


W8 = {"format": "int8", "strategy": "channel"}


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_the_moe_families_llmc_writes_plan_for_llama_cpp(family: str, tmp_path: Path) -> None:
    from llmc.planning.plan import make_plan

    folder = make_tiny(family, tmp_path / "model")
    plan = make_plan(_recipe(folder, "llama.cpp", W8), folder)
    assert [(t["exporter"], t["status"]) for t in plan.targets] == [("gguf", "native")]


def _decoded(t) -> np.ndarray:
    return dequantize(t.data, t.tensor_type).reshape([int(d) for d in t.shape[::-1]])


def test_qwen3_next_linear_attention_is_split_and_transformed_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """in_proj_qkvz ([q, k, v, z] per key head) becomes attn_qkv (every q, k, v) and attn_gate (every z) with the
    canonical codes; A_log becomes A = -exp(A_log), dt_bias ssm_dt.bias, the conv kernel [C, 1, K] -> [C, K] in F32;
    the (1 + weight) norms carry the +1, the gated ssm_norm does not (conversion/qwen.py Qwen3NextModel)."""
    qm = _build("qwen3_next", tmp_path, SCHEMES["w8a16"])
    res = G.export_gguf(qm, tmp_path / "out")
    tensors = {t.name: t for t in GGUFReader(str(res.path)).tensors}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    c, la = qm.config, "model.layers.0.linear_attn."
    hk, hv, nk, nv = (c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_num_key_heads"],
                      c["linear_num_value_heads"])
    qkvz = qm.dequantized_weight(canonical, la + "in_proj_qkvz").reshape(nk, 2 * hk + 2 * nv // nk * hv, -1)
    q, k, v, z = torch.split(qkvz, [hk, hk, nv // nk * hv, nv // nk * hv], dim=1)
    want_qkv = torch.cat([q.reshape(-1, c["hidden_size"]), k.reshape(-1, c["hidden_size"]),
                          v.reshape(-1, c["hidden_size"])])
    for name, want in (("blk.0.attn_qkv.weight", want_qkv), ("blk.0.attn_gate.weight", z.reshape(-1, c["hidden_size"]))):
        assert tensors[name].tensor_type.name == "Q8_0"
        np.testing.assert_allclose(_decoded(tensors[name]), want.numpy(), rtol=0,
                                   atol=2.0**-10 * float(want.abs().max()))
    assert "blk.0.ssm_in.weight" not in tensors
    np.testing.assert_allclose(tensors["blk.0.ssm_a"].data, -np.exp(canonical[la + "A_log"].numpy()), rtol=1e-6)
    np.testing.assert_array_equal(tensors["blk.0.ssm_dt.bias"].data, canonical[la + "dt_bias"].numpy())
    conv = tensors["blk.0.ssm_conv1d.weight"]
    assert conv.tensor_type.name == "F32"
    np.testing.assert_array_equal(conv.data, canonical[la + "conv1d.weight"][:, 0, :].numpy())
    assert tensors["blk.0.ssm_ba.weight"].tensor_type.name == "F32"
    np.testing.assert_array_equal(tensors["blk.0.ssm_norm.weight"].data, canonical[la + "norm.weight"].numpy())
    np.testing.assert_allclose(tensors["blk.0.attn_norm.weight"].data,
                               canonical["model.layers.0.input_layernorm.weight"].numpy() + 1, rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.1.attn_q_norm.weight"].data,
                               canonical["model.layers.1.self_attn.q_norm.weight"].numpy() + 1, rtol=1e-6)


def test_deepseek_v32_mla_is_absorbed_and_its_indexer_written_as_llama_cpps_deepseek32_reads_it(tmp_path: Path) -> None:
    """kv_b_proj ([k rows, v rows] per head) becomes attn_v_b (each head's value rows, the canonical Q8_0 codes) and
    attn_k_b (each head's key rows transposed, [heads, kv_lora_rank, qk_nope] in numpy order: F16 of the dequantized
    weights); kv_b_proj itself is not written. The indexer: wq_b quantized as attention (Q8_0, canonical codes), wk and
    weights_proj kept in the model's dtype (F16 / F32), k_norm a LayerNorm with its bias (F32, exact)."""
    qm = _build("deepseek_v32", tmp_path, SCHEMES["w8a16"], **GGUF_OVERRIDES["deepseek_v32"])
    res = G.export_gguf(qm, tmp_path / "out")
    tensors = {t.name: t for t in GGUFReader(str(res.path)).tensors}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    c, at = qm.config, "model.layers.1.self_attn."
    n_head, nope, v, kvr = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    kv_b = qm.dequantized_weight(canonical, at + "kv_b_proj").reshape(n_head, nope + v, kvr)
    assert "blk.1.attn_kv_b.weight" not in tensors
    v_b, k_b = tensors["blk.1.attn_v_b.weight"], tensors["blk.1.attn_k_b.weight"]
    assert (v_b.tensor_type.name, k_b.tensor_type.name) == ("Q8_0", "F16")
    want_v = kv_b[:, nope:, :]  # [heads, v_head_dim, kv_lora_rank]
    np.testing.assert_allclose(_decoded(v_b), want_v.numpy(), rtol=0, atol=2.0**-10 * float(want_v.abs().max()))
    want_k = kv_b[:, :nope, :].transpose(1, 2)  # [heads, kv_lora_rank, qk_nope]
    np.testing.assert_allclose(_decoded(k_b), want_k.numpy(), rtol=2.0**-11, atol=2.0**-25)
    ix = at + "indexer."
    wq_b = qm.dequantized_weight(canonical, ix + "wq_b")
    assert tensors["blk.1.indexer.attn_q_b.weight"].tensor_type.name == "Q8_0"
    np.testing.assert_allclose(_decoded(tensors["blk.1.indexer.attn_q_b.weight"]), wq_b.numpy(), rtol=0,
                               atol=2.0**-10 * float(wq_b.abs().max()))
    assert ix + "wk" not in qm.quantized_modules and ix + "weights_proj" not in qm.quantized_modules
    assert tensors["blk.1.indexer.attn_k.weight"].tensor_type.name == "F16"
    # float16's rounding: half an ulp, or half the subnormal step (2^-25) below its smallest normal
    np.testing.assert_allclose(_decoded(tensors["blk.1.indexer.attn_k.weight"]), canonical[ix + "wk.weight"].numpy(),
                               rtol=2.0**-11, atol=2.0**-25)
    for name, hf in (("indexer.proj.weight", "weights_proj.weight"), ("indexer.k_norm.weight", "k_norm.weight"),
                     ("indexer.k_norm.bias", "k_norm.bias")):
        assert tensors[f"blk.1.{name}"].tensor_type.name == "F32", name
        np.testing.assert_array_equal(_decoded(tensors[f"blk.1.{name}"]), canonical[ix + hf].numpy(), err_msg=name)
    assert any("attn_k_b" in n for n in res.notes)


def test_gpt_oss_sinks_and_biases_are_written_in_f32_and_its_yarn_rounding_is_said(tmp_path: Path) -> None:
    qm = _build("gpt_oss", tmp_path, SCHEMES["w8a16"], swiglu_limit=7.0)
    res = G.export_gguf(qm, tmp_path / "out")
    tensors = {t.name: t for t in GGUFReader(str(res.path)).tensors}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    np.testing.assert_array_equal(tensors["blk.1.attn_sinks.weight"].data,
                                  canonical["model.layers.1.self_attn.sinks"].numpy())
    bias = tensors["blk.1.ffn_gate_exps.bias"].data  # [E, I]: expert e's gate half of gate_up_proj_bias
    for e in range(4):
        np.testing.assert_array_equal(bias[e], canonical[f"model.layers.1.mlp.experts.{e}.gate_proj.bias"].numpy())
    # the tiny model's config says truncate=false (as gpt-oss's does); ggml's YaRN rounds: said in the notes
    assert any("truncate=false" in n for n in res.notes)


@pytest.mark.parametrize(("family", "config", "match"), [
    ("gpt_oss", {}, r"swiglu_limit = 0\.7.*LLM_FFN_SWIGLU_OAI_MOE"),  # the tiny model's lowered clamp
    ("gpt_oss", {"swiglu_limit": 7.0, "rope_parameters": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 16.0, "beta_slow": 1.0, "original_max_position_embeddings": 32,
        "rope_theta": 150000.0}}, r"beta_fast = 16\.0, llama\.cpp computes with 32\.0"),
    ("qwen3_next", {"norm_topk_prob": False}, r"norm_topk_prob = False.*qwen3next\.cpp"),
    ("llama4_text", {"num_hidden_layers": 4}, r"attention_chunk_size = 8, but llama\.cpp computes with 8192"),
    ("llama4_text", {"attention_chunk_size": 8192}, r"2 layers: llama\.cpp's llama4 graph"),
    ("llama4_text", {"attention_chunk_size": 8192, "num_hidden_layers": 4, "use_qk_norm": False},
     r"use_qk_norm = False"),
])
def test_what_llama_cpp_fixes_for_gpt_oss_qwen3_next_and_llama4_is_refused(family: str, config: dict, match: str,
                                                                     tmp_path: Path) -> None:
    qm = _build(family, tmp_path, SCHEMES["w8a16"], **config)
    with pytest.raises(IncompatibleTargetError, match=match):
        G.export_gguf(qm, tmp_path / "out")


def _tiled(t: torch.Tensor, nk: int, r: int, width: int, dim: int = 0) -> torch.Tensor:
    """Value heads grouped by key head -> tiled (k0v0, k1v0, k0v1, ...), as conversion/qwen.py reorders them."""
    t = t.movedim(dim, 0)
    t = t.reshape(nk, r, width, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return t.movedim(0, dim)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_value_heads_are_reordered_for_llama_cpps_broadcast(family: str, tmp_path: Path) -> None:
    """Qwen3.5's 4 value heads on 2 key heads: every tensor indexed by value head (in_proj_qkv's v rows, in_proj_z,
    in_proj_a / in_proj_b, A_log, dt_bias, the convolution's v channels) and out_proj's input columns are in llama.cpp's
    tiled order, the quantized ones with the canonical codes; A = -exp(A_log); the rope sections are written; the tiny
    model's default sections (11 + 11 + 10 > its 16-wide heads) are refused naming ggml's assertion."""
    qm = _build(family, tmp_path / "ok", SCHEMES["w8a16"], rope_parameters=QWEN35_ROPE)
    res = G.export_gguf(qm, tmp_path / "ok" / "out")
    reader = GGUFReader(str(res.path))
    tensors = {t.name: t for t in reader.tensors}
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    c, la = qm.config, "model.layers.0.linear_attn."
    hk, hv, nk, nv = (c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_num_key_heads"],
                      c["linear_num_value_heads"])
    r, qk = nv // nk, 2 * nk * hk
    assert r == 2
    qkv = qm.dequantized_weight(canonical, la + "in_proj_qkv")
    quantized = {"blk.0.attn_qkv.weight": torch.cat([qkv[:qk], _tiled(qkv[qk:], nk, r, hv)]),
                 "blk.0.attn_gate.weight": _tiled(qm.dequantized_weight(canonical, la + "in_proj_z"), nk, r, hv),
                 "blk.0.ssm_out.weight": _tiled(qm.dequantized_weight(canonical, la + "out_proj"), nk, r, hv, dim=1)}
    for name, want in quantized.items():
        assert tensors[name].tensor_type.name == "Q8_0", name
        np.testing.assert_allclose(_decoded(tensors[name]), want.numpy(), rtol=0,
                                   atol=2.0**-10 * float(want.abs().max()), err_msg=name)
    conv = canonical[la + "conv1d.weight"][:, 0, :]
    exact = {"blk.0.ssm_alpha.weight": _tiled(canonical[la + "in_proj_a.weight"], nk, r, 1),
             "blk.0.ssm_beta.weight": _tiled(canonical[la + "in_proj_b.weight"], nk, r, 1),
             "blk.0.ssm_dt.bias": _tiled(canonical[la + "dt_bias"], nk, r, 1),
             "blk.0.ssm_conv1d.weight": torch.cat([conv[:qk], _tiled(conv[qk:], nk, r, hv)])}
    for name, want in exact.items():
        assert tensors[name].tensor_type.name == "F32", name
        np.testing.assert_array_equal(tensors[name].data, want.numpy(), err_msg=name)
    np.testing.assert_allclose(tensors["blk.0.ssm_a"].data,
                               -np.exp(_tiled(canonical[la + "A_log"], nk, r, 1).numpy()), rtol=1e-6)
    prefix = _field(reader, "general.architecture")
    assert _field(reader, f"{prefix}.rope.dimension_sections") == [1, 1, 0, 0]

    default = _build(family, tmp_path / "default", SCHEMES["w8a16"])
    with pytest.raises(IncompatibleTargetError, match=r"\[11, 11, 10, 0\].*sect_dims <= ne0"):
        G.export_gguf(default, tmp_path / "default" / "out")


def test_a_v32_indexer_narrower_than_llama_cpps_rotation_is_refused() -> None:
    """llama.cpp rotates the indexer's q/k by a Hadamard matrix at least 64 wide: the tests' tiny V3.2 (index_head_dim
    16) aborted its first matmul (GGML_ASSERT ggml_can_mul_mat) before this check; 64 passes."""
    from transformers import AutoConfig

    from tests.unit.families import _COMMON, MOE_FAMILIES

    model_type, base = MOE_FAMILIES["deepseek_v32"]

    def config(**overrides) -> dict:
        return AutoConfig.for_model(model_type, vocab_size=300, **{**_COMMON, **base, **overrides}).to_dict()

    with pytest.raises(IncompatibleTargetError, match=r"index_head_dim 16 is not a multiple of 64.*Hadamard"):
        G._arch(config())
    G._arch(config(**GGUF_OVERRIDES["deepseek_v32"]))
