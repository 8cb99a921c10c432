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
WRITTEN = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2")
# config overrides for the GGUF: Qwen2-MoE's published checkpoints keep the softmax weights unnormalised, as
# llama.cpp's qwen2moe graph does (the tests' tiny model normalises: refused below)
GGUF_OVERRIDES = {"qwen2_moe": {"norm_topk_prob": False},
                  "deepseek_v3": {"first_k_dense_replace": 1}}  # layer 0 a dense MLP, as DeepSeek-V3's first three


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
    if arch == "LLAMA":  # llama.cpp: Mixtral's experts, no shared expert
        return {**gqa, "ffn_norm.weight": (h,), **exps}
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
    if arch == "GLM4_MOE":  # q/k/v biases; the pre-FFN norm is attn_post_norm ("post_attention_norm")
        return {**gqa, "attn_q.bias": (n_head * hd,), "attn_k.bias": (n_kv * hd,), "attn_v.bias": (n_kv * hd,),
                "post_attention_norm.weight": (h,), **exps, **shared}
    assert arch == "DEEPSEEK2"  # MLA without key_length_mla: llama.cpp's attn_kv_b (decompressed) branch
    qr, kvr, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    return {"attn_norm.weight": (h,), "attn_q_a_norm.weight": (qr,), "attn_kv_a_norm.weight": (kvr,),
            "attn_q_a.weight": (h, qr), "attn_q_b.weight": (qr, n_head * (nope + rope)),
            "attn_kv_a_mqa.weight": (h, kvr + rope), "attn_kv_b.weight": (kvr, n_head * (nope + v)),
            "attn_output.weight": (n_head * v, h), "ffn_norm.weight": (h,), **exps, **shared}


def _expected_keys(arch: str, c: dict) -> dict[str, object]:
    """The per-architecture keys its load_arch_hparams reads (beyond the common ones), with the config's values."""
    out: dict[str, object] = {"expert_count": 4, "expert_used_count": 2}
    if arch != "LLAMA":
        out["expert_feed_forward_length"] = c.get("moe_intermediate_size") or c["intermediate_size"]
    if arch == "QWEN2MOE":
        out["expert_shared_feed_forward_length"] = c["shared_expert_intermediate_size"]
    if arch in ("DEEPSEEK2", "GLM4_MOE"):
        out |= {"expert_shared_count": 1, "leading_dense_block_count": c["first_k_dense_replace"],
                "expert_weights_norm": True,
                "expert_weights_scale": c["routed_scaling_factor"], "expert_gating_func": 2}  # 2: sigmoid
    if arch == "MINIMAXM2":
        out |= {"expert_gating_func": 2, "rope.dimension_count": c["rotary_dim"]}
    if arch == "GLM4_MOE":
        out["rope.dimension_count"] = c["head_dim"] // 2  # partial_rotary_factor 0.5
    if arch == "DEEPSEEK2":
        out |= {"attention.q_lora_rank": c["q_lora_rank"], "attention.kv_lora_rank": c["kv_lora_rank"],
                "attention.key_length": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
                "attention.value_length": c["v_head_dim"], "attention.head_count_kv": c["num_attention_heads"],
                "rope.dimension_count": c["qk_rope_head_dim"]}
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
    prefix = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]]
    reader = GGUFReader(str(res.path))
    assert _field(reader, "general.architecture") == prefix
    got = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    want = {"token_embd.weight": (c["hidden_size"], c["vocab_size"]), "output_norm.weight": (c["hidden_size"],)}
    for layer in range(2):
        want |= {f"blk.{layer}.{k}": v for k, v in _expected_layer(arch, c, layer).items()}
    if arch in ("MINIMAXM2", "QWEN2MOE"):  # tied, but their loaders require output.weight (flags 0): written
        want["output.weight"] = want["token_embd.weight"]
    assert got == want  # the others tied: no output.weight, llama.cpp duplicates token_embd
    for key, value in _expected_keys(arch, c).items():
        assert _field(reader, f"{prefix}.{key}") == pytest.approx(value), key
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
    assert checked == len(qm.quantized_modules) and checked >= 3 * 4 + 4
    router = canonical[next(k for k in canonical if k.startswith("model.layers.1.")
                            and k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))]
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


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "llama4_text"])
def test_families_without_a_gguf_writer_are_refused_by_the_plan_with_the_reason(family: str, tmp_path: Path) -> None:
    """llama.cpp has these architectures, llmc's GGUF exporter does not write them: `llmc plan` says so (exit 3)
    before any weight loads, for llama.cpp and Ollama alike, and names the runtimes that take the family."""
    from llmc.planning.plan import make_plan

    folder = make_tiny(family, tmp_path / "model")
    for runtime in ("llama.cpp", "ollama"):
        with pytest.raises(IncompatibleTargetError, match=r"llama\.cpp has the \S+ architecture \(src/models/") as e:
            make_plan(_recipe(folder, runtime, W8), folder)
        # vLLM takes Qwen3-Next and Llama-4 text; gpt-oss's per-expert export it refuses too (llmc.runtimes.vllm)
        assert e.value.exit_code == 3 and ("vllm" in e.value.fix) == (family != "gpt_oss")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_the_moe_families_llmc_writes_plan_for_llama_cpp(family: str, tmp_path: Path) -> None:
    from llmc.planning.plan import make_plan

    folder = make_tiny(family, tmp_path / "model")
    plan = make_plan(_recipe(folder, "llama.cpp", W8), folder)
    assert [(t["exporter"], t["status"]) for t in plan.targets] == [("gguf", "native")]
