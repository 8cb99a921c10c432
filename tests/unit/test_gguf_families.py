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
from tests.unit.families import FAMILIES, make_tiny

W8A16 = Scheme(TensorSpec("int8", "channel"))
# architectures transformers' GGUF loader reads back (transformers.integrations.ggml.GGUF_CONFIG_MAPPING); it has no
# granite or olmo2 mapping; it has qwen3, but its mapping takes head_dim from Qwen3Config's default 128 rather than attention.key_length: the
# tiny model's 16 does not load; gemma2/gemma3 it builds with their default sliding-window layer pattern)
TRANSFORMERS_READS = ("llama", "mistral", "qwen2", "phi3")


# the dense families the GGUF exporter writes (G.GGUF_FAMILIES; the others are refused by the exporter's family
# check, llmc/formats/gguf.py). Qwen3.5's linear attention, whose value heads llama.cpp reorders, and whose tiny
# model's default rope sections llama.cpp refuses, has its own tests (tests/unit/test_gguf_moe.py)
@pytest.fixture(scope="module", params=[f for f, (model_type, _) in FAMILIES.items()
                                        if model_type in G.GGUF_FAMILIES and model_type != "qwen3_5_text"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    folder = make_tiny(request.param, root / "model")
    quantize_model(ModelSource(folder, "t", str(folder)), W8A16, root / "q", None)
    qm = QuantizedModel.open(root / "q")
    G.export_gguf(qm, root / "out")
    return request.param, folder, qm, root / "out" / G.GGUF_FILE


def test_tensors_carry_the_architectures_names_and_llmcs_weights(exported) -> None:
    import gguf

    family, _, qm, path = exported
    reader = GGUFReader(str(path))
    fam = G.GGUF_FAMILIES[FAMILIES[family][0]]
    arch = gguf.MODEL_ARCH[fam.arch]
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == gguf.MODEL_ARCH_NAMES[arch]
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[arch] for b in range(2)}
    got = {t.name: t for t in reader.tensors}
    assert {n.rsplit(".", 1)[0] for n in got} <= allowed
    names = gguf.get_tensor_name_map(arch, 2)
    canonical = {k: v for t in qm.iter_files() for k, v in t.items()}
    for module in qm.quantized_modules:
        t = got[names.get_name(f"{module}.weight", try_suffixes=(".weight",))]
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist()).copy())
        if fam.permute_qk and module.endswith(("q_proj", "k_proj")):
            heads = qm.config["num_attention_heads"] if module.endswith("q_proj") else qm.config["num_key_value_heads"]
            weight = G.llama_unpermute(weight, heads)
        want = qm.dequantized_weight(canonical, module)
        torch.testing.assert_close(weight, want, rtol=0, atol=2e-3 * want.abs().max().item())  # fp16 block scales
    norm = got["blk.0.attn_q_norm.weight" if family == "olmo2" else "blk.0.attn_norm.weight"]
    source = canonical["model.layers.0." + ("self_attn.q_norm" if family == "olmo2" else "input_layernorm") + ".weight"]
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
