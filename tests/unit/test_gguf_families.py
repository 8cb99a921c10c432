"""GGUF for every dense family through the gguf package's own tables (tiny random models from transformers'
config classes, tests/unit/families.py): each family's tensors get the names llama.cpp's architecture reads,
Gemma's norms carry the +1 llama.cpp expects, the repacked Q8_0 weights decode to llmc's canonical weights,
and where transformers' GGUF loader knows the architecture, the file loads back into the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from llmc.formats import gguf as G
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
from tests.unit.families import FAMILIES, NEWCOMER_FAMILIES, make_tiny

W8A16 = Scheme(TensorSpec("int8", "channel"))
# a norm each family's layer 0 holds, where it has no input_layernorm -> attn_norm (OLMo's and EXAONE 4's post-norms)
NORMS = {"olmo2": ("blk.0.attn_q_norm.weight", "self_attn.q_norm"),
         "olmo3": ("blk.0.attn_q_norm.weight", "self_attn.q_norm"),
         "exaone4": ("blk.0.post_attention_norm.weight", "post_attention_layernorm"),
         "apertus": ("blk.0.attn_norm.weight", "attention_layernorm")}
# architectures transformers' GGUF loader reads back (transformers.integrations.ggml.GGUF_CONFIG_MAPPING); it has no
# granite, olmo2 (OLMo 3's too), smollm3, exaone4, seed_oss or apertus mapping (the newcomers' names, shapes and keys
# are checked against llama.cpp's loader below); it has qwen3, but its mapping takes head_dim from Qwen3Config's default 128 rather than attention.key_length: the
# tiny model's 16 does not load; gemma2/gemma3 it builds with their default sliding-window layer pattern)
TRANSFORMERS_READS = ("llama", "mistral", "qwen2", "phi3")


DENSE = {**FAMILIES, **NEWCOMER_FAMILIES}
# the dense newcomers (issue 45) as llama.cpp 0.3.36 runs them: SmolLM3 with 4 layers, so that layer 3 is a no-rope
# layer; EXAONE 4 without a sliding window (every layer full and roped: llama.cpp runs its sliding layers only in
# 64-layer models, refused below)
GGUF_OVERRIDES = {"smollm3": {"num_hidden_layers": 4},
                  "exaone4": {"sliding_window": None, "layer_types": ["full_attention"] * 2}}


# the dense families the GGUF exporter writes (G.GGUF_FAMILIES; the others are refused by the exporter's family
# check, llmc/formats/gguf.py). Qwen3.5's linear attention, whose value heads llama.cpp reorders, and whose tiny
# model's default rope sections llama.cpp refuses, has its own tests (tests/unit/test_gguf_moe.py). The newcomers:
# heavy (one build each)
@pytest.fixture(scope="module", params=[f for f, (model_type, _) in FAMILIES.items()
                                        if model_type in G.GGUF_FAMILIES and model_type != "qwen3_5_text"]
                + [pytest.param(f, marks=pytest.mark.heavy) for f in NEWCOMER_FAMILIES])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    folder = make_tiny(request.param, root / "model", **GGUF_OVERRIDES.get(request.param, {}))
    quantize_model(ModelSource(folder, "t", str(folder)), W8A16, root / "q", None)
    qm = QuantizedModel.open(root / "q")
    G.export_gguf(qm, root / "out")
    return request.param, folder, qm, root / "out" / G.GGUF_FILE


def test_tensors_carry_the_architectures_names_and_llmcs_weights(exported) -> None:
    import gguf

    family, _, qm, path = exported
    reader = GGUFReader(str(path))
    fam = G.GGUF_FAMILIES[DENSE[family][0]]
    arch = gguf.MODEL_ARCH[fam.arch]
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == gguf.MODEL_ARCH_NAMES[arch]
    n_layers = qm.config["num_hidden_layers"]
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[arch] for b in range(n_layers)}
    got = {t.name: t for t in reader.tensors}
    assert {n.rsplit(".", 1)[0] for n in got} <= allowed
    names = gguf.get_tensor_name_map(arch, n_layers)
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    for module in qm.quantized_modules:
        t = got[names.get_name(f"{module}.weight", try_suffixes=(".weight",))]
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist()).copy())
        if fam.permute_qk and module.endswith(("q_proj", "k_proj")):
            heads = qm.config["num_attention_heads"] if module.endswith("q_proj") else qm.config["num_key_value_heads"]
            weight = G.llama_unpermute(weight, heads)
        want = qm.dequantized_weight(canonical, module)
        torch.testing.assert_close(weight, want, rtol=0, atol=2e-3 * want.abs().max().item())  # fp16 block scales
    gguf_norm, hf_norm = NORMS.get(family, ("blk.0.attn_norm.weight", "input_layernorm"))
    norm = got[gguf_norm]
    source = canonical[f"model.layers.0.{hf_norm}.weight"]
    np.testing.assert_allclose(norm.data, source.numpy() + fam.norm_offset, rtol=1e-6)
    assert (fam.norm_offset == 1.0) == family.startswith("gemma")


def test_transformers_gguf_loader_reads_back_the_same_model(exported) -> None:
    """transformers dequantizes the GGUF (un-permuting q/k where llama.cpp permutes them) into the model that
    computes the canonical form's logits, up to the fp16 block scales."""
    from transformers import AutoModelForCausalLM

    family, folder, qm, path = exported
    if family not in TRANSFORMERS_READS:
        pytest.skip(f"tiny {family}: not read back by transformers' GGUF loader (TRANSFORMERS_READS says why)")
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    for module in qm.quantized_modules:
        reference.get_submodule(module).weight.data = qm.dequantized_weight(canonical, module)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def _newcomer_layer(family: str, c: dict) -> dict[str, tuple[int, ...]]:
    """One layer's tensors as llama.cpp 0.3.36 creates them (ggml ne order: input dim first), written out from
    src/models/<arch>.cpp load_arch_tensors, not from the exporter's tables."""
    h, nh, ff = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    nkv, hd = c["num_key_value_heads"], c.get("head_dim") or h // nh
    attn = {"attn_q.weight": (h, nh * hd), "attn_k.weight": (h, nkv * hd), "attn_v.weight": (h, nkv * hd),
            "attn_output.weight": (nh * hd, h)}
    mlp = {"ffn_gate.weight": (h, ff), "ffn_up.weight": (h, ff), "ffn_down.weight": (ff, h)}
    if family == "smollm3":  # smollm3.cpp: Llama's layer
        return {**attn, **mlp, "attn_norm.weight": (h,), "ffn_norm.weight": (h,)}
    if family == "olmo3":  # olmo2.cpp: q/k norms over all heads, post-norms
        return {**attn, **mlp, "attn_q_norm.weight": (h,), "attn_k_norm.weight": (nkv * hd,),
                "post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    if family == "exaone4":  # exaone4.cpp: per-head q/k norms, post-norms
        return {**attn, **mlp, "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
                "post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    if family == "seed_oss":  # seed-oss.cpp: q/k/v biases, the pre-MLP norm is attn_post_norm
        return {**attn, **mlp, "attn_q.bias": (nh * hd,), "attn_k.bias": (nkv * hd,), "attn_v.bias": (nkv * hd,),
                "attn_norm.weight": (h,), "post_attention_norm.weight": (h,)}
    assert family == "apertus"  # apertus.cpp: up/down MLP (xIELU), per-head q/k norms
    return {**attn, "ffn_up.weight": (h, ff), "ffn_down.weight": (ff, h), "attn_norm.weight": (h,),
            "ffn_norm.weight": (h,), "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}


def test_the_newcomers_tensors_and_keys_are_what_llama_cpp_reads(exported) -> None:
    """Every tensor with the name and shape llama.cpp's loader creates (output.weight where it requires one, the
    llama3 rope as rope_freqs), OLMo 3's sliding window and per-layer pattern, Apertus' xIELU parameters as the
    per-layer key arrays llama.cpp reads, each the checkpoint's own value."""
    family, _, qm, path = exported
    if family not in NEWCOMER_FAMILIES:
        pytest.skip("the older dense families: test_tensors_carry_the_architectures_names_and_llmcs_weights")
    c = qm.config
    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    got = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    want = {"token_embd.weight": (c["hidden_size"], c["vocab_size"]), "output_norm.weight": (c["hidden_size"],)}
    for layer in range(c["num_hidden_layers"]):
        want |= {f"blk.{layer}.{k}": v for k, v in _newcomer_layer(family, c).items()}
    if family in ("olmo3", "apertus"):  # tied, but olmo2.cpp / apertus.cpp create `output` with flags 0
        want["output.weight"] = want["token_embd.weight"]
    if family == "apertus":  # Apertus' default llama3 rope scaling: rope_freqs [head_dim / 2]
        want["rope_freqs.weight"] = (c["hidden_size"] // c["num_attention_heads"] // 2,)
    assert got == want

    def field(key: str):
        return reader.fields[key].contents() if key in reader.fields else None

    sliding = c.get("sliding_window")
    assert field(f"{arch}.attention.sliding_window") == (sliding if family == "olmo3" else None)
    if family == "olmo3":
        assert field(f"{arch}.attention.sliding_window_pattern") == [t == "sliding_attention" for t in c["layer_types"]]
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    for key in ("alpha_p", "alpha_n", "beta", "eps"):
        values = field(f"xielu.{key}")
        if family != "apertus":
            assert values is None
            continue
        assert not any(k.endswith(f"act_fn.{key}") for k in reader.fields)  # keys, not tensors
        layer_values = [float(canonical[f"model.layers.{i}.mlp.act_fn.{key}"]) for i in range(c["num_hidden_layers"])]
        assert values == pytest.approx(layer_values, rel=1e-7)
    if family == "apertus":  # the tiny model's random alpha_p / alpha_n differ per layer: the values are each layer's
        assert field("xielu.alpha_p")[0] != field("xielu.alpha_p")[1]


def _config(family: str, **overrides) -> dict:
    from transformers import AutoConfig

    model_type, base = NEWCOMER_FAMILIES[family]
    return AutoConfig.for_model(model_type, vocab_size=300, **{"hidden_size": 64, "intermediate_size": 128,
                                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                                               **base, **overrides}).to_dict()


@pytest.mark.parametrize(("family", "overrides", "match"), [
    # the tests' tiny EXAONE 4 (window 6, layer 0 sliding): llama.cpp would run both layers full and roped
    ("exaone4", {}, r"sliding-window attention only when the model has 64 layers.*exaone4\.cpp"),
    ("exaone4", {"num_hidden_layers": 64, "sliding_window": None, "layer_types": ["full_attention"] * 64},
     r"64 layers without sliding layers"),
    ("smollm3", {"no_rope_layers": [1, 0]}, r"no_rope_layers = \[1, 0\], but llama\.cpp skips rope on every 4th"),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 6}, r"use_sliding_window = True.*smollm3\.cpp"),
    ("seed_oss", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "original_max_position_embeddings": 256, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0}}, r"rope_type = 'llama3': its graph applies no rope"),
    ("olmo3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"the sliding layers' rope_type = 'linear'"),
])
def test_what_llama_cpp_fixes_for_the_newcomers_is_refused_naming_the_source(family: str, overrides: dict,
                                                                           match: str) -> None:
    from llmc.errors import IncompatibleTargetError

    with pytest.raises(IncompatibleTargetError, match=match):
        G._arch(_config(family, **overrides))
    G._arch(_config(family, **GGUF_OVERRIDES.get(family, {})))  # as the tests above export them: accepted


@pytest.mark.heavy
@pytest.mark.parametrize("family", list(NEWCOMER_FAMILIES))
def test_llama_cpp_plans_the_newcomers_natively_and_ollama_refuses_them(family: str, tmp_path) -> None:
    import yaml

    from llmc.errors import IncompatibleTargetError
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    folder = make_tiny(family, tmp_path / "model", **GGUF_OVERRIDES.get(family, {}))

    def recipe(runtime: str):
        return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)}, "targets": [
            {"runtime": runtime}], "quantization": {"weights": {"format": "int8", "strategy": "channel"}}}))

    plan = make_plan(recipe("llama.cpp"), folder)
    assert [(t["exporter"], t["status"]) for t in plan.targets] == [("gguf", "native")]
    with pytest.raises(IncompatibleTargetError, match=r"proven in llama\.cpp only") as e:
        make_plan(recipe("ollama"), folder)
    assert e.value.exit_code == 3
