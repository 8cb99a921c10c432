"""GGUF export (llama.cpp / Ollama): stream-quantize a tiny llama, export, read the file back with
gguf's own GGUFReader and check every key llama.cpp needs, every tensor's name/shape/type, and that the
decoded weights equal the canonical dequantized weights within the block format's error bound."""

from __future__ import annotations

import dataclasses

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from llmc.formats import gguf as G
from llmc.errors import IncompatibleTargetError
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model

SCHEMES = {
    "w8a16": Scheme(TensorSpec("int8", "channel")),
    "w8a16-tensor": Scheme(TensorSpec("int8", "tensor")),
    "w4a16-g32": Scheme(TensorSpec("int4", "group", group_size=32)),
    "w4a16-g64-asym": Scheme(TensorSpec("int4", "group", group_size=64, symmetric=False)),
    "w4a16-g16": Scheme(TensorSpec("int4", "group", group_size=16)),  # not a multiple of 32: requantized
    "w8a8-dynamic": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True)),
}
EXPECTED = {  # scheme -> (weight type, method, general.file_type)
    "w8a16": ("Q8_0", "repacked", 7),
    "w8a16-tensor": ("Q8_0", "repacked", 7),
    "w4a16-g32": ("Q4_0", "repacked", 2),
    "w4a16-g64-asym": ("Q4_1", "repacked", 3),
    "w4a16-g16": ("Q4_0", "requantized", 2),
    "w8a8-dynamic": ("Q8_0", "repacked", 7),
}
LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm")
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
FP16_EPS = 2.0**-11  # fp16's relative rounding error (unit roundoff)


def _quantized(model: Path, scheme: Scheme, out: Path) -> QuantizedModel:
    quantize_model(ModelSource(model, "test", str(model)), scheme, out, None)
    return QuantizedModel.open(out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_session: Path) -> dict[str, tuple[QuantizedModel, G.GGUFExport]]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, scheme in SCHEMES.items():
        qm = _quantized(tiny_model_session, scheme, root / f"q-{name}")
        if name == "w8a16":  # give one form a ChatML template, as SmolLM2-Instruct has
            (qm.root / "chat_template.jinja").write_text(
                "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
                "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
            )
        out[name] = (qm, G.export_gguf(qm, root / f"gguf-{name}"))
    return out


def _field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    assert f is not None, f"missing GGUF key {key}"
    return f.contents()


def _canonical_tensors(qm: QuantizedModel) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in qm.iter_files():
        out.update(t)
    return out


def _decoded(t) -> np.ndarray:
    """A tensor read back by GGUFReader, decoded to float32 in numpy (row-major [rows, cols])."""
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32)
    return dequantize(np.asarray(t.data), t.tensor_type)


def test_metadata_llama_cpp_needs(exported, tiny_model_session: Path) -> None:
    qm, res = exported["w8a16"]
    cfg = qm.config
    r = GGUFReader(res.path)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    expected = {
        "general.architecture": "llama",
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": cfg["num_attention_heads"],
        "llama.attention.head_count_kv": cfg["num_key_value_heads"],
        "llama.rope.dimension_count": head_dim,
        "llama.vocab_size": cfg["vocab_size"],
        "general.file_type": 7,
        "general.quantization_version": 2,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",  # the fixture's pre-tokenizer is plain ByteLevel
        "tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
        "tokenizer.ggml.eos_token_id": cfg["eos_token_id"],
        "tokenizer.ggml.add_bos_token": False,  # the HF tokenizer adds no BOS: llama.cpp must not either
        "llmc.gguf.weight_type": "Q8_0",
        "llmc.gguf.weight_method": "repacked",
        "llmc.scheme": "W8A16-INT8",
    }
    for key, value in expected.items():
        assert _field(r, key) == value, key
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    assert _field(r, "llama.rope.freq_base") == pytest.approx(rope)
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])

    tj = json.loads((qm.root / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tj["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tj["added_tokens"]}
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"]
    assert all(tokens[i] == vocab[i] for i in vocab)
    types = _field(r, "tokenizer.ggml.token_type")
    specials = {a["id"] for a in tj["added_tokens"] if a["special"]}
    assert {i for i, t in enumerate(types) if t == 3} == specials  # CONTROL
    assert all(types[i] == 1 for i in vocab if i not in specials)  # NORMAL
    merges = _field(r, "tokenizer.ggml.merges")
    assert merges == [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert "<|im_start|>" in _field(r, "tokenizer.chat_template")


def test_tensor_names_shapes_and_types(exported) -> None:
    for name, (qm, res) in exported.items():
        cfg = qm.config
        wtype, method, ftype = EXPECTED[name]
        assert (res.plan.weight_type, res.plan.method) == (wtype, method)
        r = GGUFReader(res.path)
        assert _field(r, "general.file_type") == ftype
        got = {t.name: t for t in r.tensors}
        want = {"token_embd.weight", "output_norm.weight"} | {
            f"blk.{i}.{n}.weight" for i in range(cfg["num_hidden_layers"]) for n in LAYER_TENSORS
        }
        assert set(got) == want  # tied: no output.weight, llama.cpp reuses token_embd
        canonical = _canonical_tensors(qm)
        for gname, t in got.items():
            if gname == "token_embd.weight":
                hf = "model.embed_tokens.weight"
                assert t.tensor_type == GGMLQuantizationType.F16
            elif gname == "output_norm.weight":
                hf = "model.norm.weight"
                assert t.tensor_type == GGMLQuantizationType.F32
            else:
                _, i, short, _ = gname.split(".")
                hf = f"model.layers.{i}.{HF[short]}.weight"
                is_norm = short.endswith("norm")
                assert t.tensor_type == (GGMLQuantizationType.F32 if is_norm else GGMLQuantizationType[wtype])
            # GGUF stores ggml's ne order: the Hugging Face shape reversed
            assert [int(x) for x in t.shape] == list(reversed(canonical[hf].shape)), gname


def _bound(canonical: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, qtype: str, method: str) -> np.ndarray:
    """Per-weight bound on |decoded - canonical| for the written block type.

    repacked: codes are copied, only the scale (and Q4_1's minimum) are rounded to fp16:
        |q * (fp16(s) - s)| <= |x| * eps, plus |fp16(m) - m| <= |m| * eps for Q4_1 (m = -(zp + 8) * s).
    requantized from the canonical values x (blocks of 32, gguf's numpy quantizers):
        Q8_0: d = amax/127, error <= d/2 + 127 * d * eps;  Q4_0: d = amax/8, error <= d (+ fp16);
        Q4_1: d = (max - min)/15, error <= d/2 + 15 * d * eps + |min| * eps.
    """
    tiny = 1e-7
    if method == "repacked":
        b = np.abs(canonical) * FP16_EPS
        if qtype == "Q4_1":
            b = b + np.abs((zp + 8.0) * scale) * FP16_EPS + 15 * scale * FP16_EPS
        return b * 1.01 + tiny
    rows, cols = canonical.shape
    blocks = canonical.reshape(rows, cols // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    if qtype == "Q8_0":
        d = amax / 127
        b = d / 2 + 127 * d * FP16_EPS
    elif qtype == "Q4_0":
        d = amax / 8
        b = d + 8 * d * FP16_EPS
    else:
        lo, hi = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
        d = (hi - lo) / 15
        b = d / 2 + 15 * d * FP16_EPS + np.abs(lo) * FP16_EPS
    return (np.broadcast_to(b, blocks.shape).reshape(rows, cols)) * 1.01 + tiny


def _expand(p: torch.Tensor, cols: int) -> np.ndarray:
    p = p.float().reshape(p.shape[0] if p.dim() > 1 else 1, -1)
    return p.repeat_interleave(cols // p.shape[1], dim=1).numpy()


@pytest.mark.parametrize("name", SCHEMES)
def test_decoded_weights_match_canonical_within_bound(exported, name: str) -> None:
    qm, res = exported[name]
    cfg = qm.config
    wtype, method, _ = EXPECTED[name]
    canonical = _canonical_tensors(qm)
    got = {t.name: t for t in GGUFReader(res.path).tensors}
    worst = 0.0
    for i in range(cfg["num_hidden_layers"]):
        for short in LAYER_TENSORS:
            t = got[f"blk.{i}.{short}.weight"]
            module = f"model.layers.{i}.{HF[short]}"
            dec = torch.from_numpy(_decoded(t).reshape(list(reversed([int(x) for x in t.shape]))).copy())
            if short == "attn_q":
                dec = G.llama_unpermute(dec, cfg["num_attention_heads"])
            elif short == "attn_k":
                dec = G.llama_unpermute(dec, cfg["num_key_value_heads"])
            if short.endswith("norm"):
                assert torch.equal(dec, canonical[f"{module}.weight"].float())  # norms: exact
                continue
            ref = qm.dequantized_weight(canonical, module).numpy()
            cols = ref.shape[1]
            scale = _expand(canonical[f"{module}.weight_scale"], cols)
            zp = canonical.get(f"{module}.weight_zero_point")
            zp = _expand(zp, cols) if zp is not None else None
            err = np.abs(dec.numpy() - ref)
            bound = _bound(ref, scale, zp, wtype, method)
            assert (err <= bound).all(), f"{name} {t.name}: max excess {(err - bound).max()}"
            worst = max(worst, float(np.sqrt((err**2).sum() / (ref**2).sum())))
    emb = got["token_embd.weight"]
    assert np.array_equal(np.asarray(emb.data), canonical["model.embed_tokens.weight"].half().numpy())
    reported = res.weight_error["worst_tensor_relative_rms"]
    assert reported == pytest.approx(worst, rel=1e-3, abs=1e-9)
    if method == "repacked":  # only the fp16 rounding of scales: far below any quantization step
        assert worst < 2 * FP16_EPS
    else:
        assert worst > 1e-2  # fresh rounding onto a different grid


def test_requantizing_adds_error_that_repacking_avoids(exported, tmp_path: Path) -> None:
    qm, repacked = exported["w8a16"]
    requant = G.export_gguf(qm, tmp_path / "requant", requantize=True)
    assert requant.plan.method == "requantized" and requant.plan.weight_type == "Q8_0"
    assert requant.weight_error["relative_rms"] > 5 * repacked.weight_error["relative_rms"]
    serve = json.loads((tmp_path / "requant" / "llmc-serve.json").read_text())
    assert serve["gguf"]["type_plan"]["method"] == "requantized"
    assert serve["gguf"]["added_error_vs_canonical"]["relative_rms"] == requant.weight_error["relative_rms"]


def test_permutation_round_trips_and_matches_interleaved_rope() -> None:
    torch.manual_seed(0)
    n_head, head_dim, hidden = 3, 8, 12
    w = torch.randn(n_head * head_dim, hidden)
    p = G.llama_permute(w, n_head)
    assert torch.equal(G.llama_unpermute(p, n_head), w)
    assert not torch.equal(p, w)
    assert torch.equal(G.llama_permute(torch.arange(8.0), 1), torch.tensor([0.0, 4, 1, 5, 2, 6, 3, 7]))

    # HF llama rotates (x_i, x_{i+d/2}); llama.cpp's NORM rope rotates (x_{2i}, x_{2i+1}). The permuted weight
    # under llama.cpp's rope must give the permuted HF result, i.e. the same attention scores.
    x = torch.randn(hidden)
    pos, theta = 5.0, 10000.0
    inv = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)

    def hf_rope(q):  # [heads, d]
        a, b = q[..., : head_dim // 2], q[..., head_dim // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    def ggml_rope(q):
        a, b = q[..., 0::2], q[..., 1::2]
        out = torch.empty_like(q)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    hf = hf_rope((w @ x).view(n_head, head_dim)).reshape(-1)
    gg = ggml_rope((p @ x).view(n_head, head_dim)).reshape(-1)
    assert torch.allclose(G.llama_unpermute(gg, n_head), hf, atol=1e-5)
    # attention logits are invariant: q.k is the same in both layouts
    assert torch.allclose((gg.view(n_head, -1) ** 2).sum(-1), (hf.view(n_head, -1) ** 2).sum(-1), atol=1e-4)


def test_modelfile_maps_chatml_template_and_stops(exported) -> None:
    _, res = exported["w8a16"]
    text = res.modelfile.read_text()
    assert "FROM ./model.gguf" in text.splitlines()
    assert 'TEMPLATE """' in text and "{{ .Content }}<|im_end|>" in text
    assert 'SYSTEM """You are a helpful AI assistant"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "<|im_start|>"' in text
    assert 'PARAMETER stop "</s>"' in text  # the tokenizer's EOS
    serve = json.loads((res.path.parent / "llmc-serve.json").read_text())
    assert serve["ollama"]["template"] == "chatml" and serve["llama.cpp"]["model"] == "model.gguf"
    _, plain = exported["w4a16-g32"]  # no chat template: no TEMPLATE line, Ollama reads the GGUF's
    assert "TEMPLATE" not in plain.modelfile.read_text()


def test_w8a8_notes_that_activations_are_llama_cpp_s_own(exported) -> None:
    _, res = exported["w8a8-dynamic"]
    assert any("activations" in n for n in res.notes)
    notes = _field(GGUFReader(res.path), "llmc.gguf.notes")
    assert any("activations" in n for n in notes)


def test_untied_lm_head_is_written_as_output(tiny_model_factory, tmp_path: Path) -> None:
    model = tiny_model_factory(tmp_path / "untied", tie=False)
    qm = _quantized(model, SCHEMES["w8a16"], tmp_path / "q")
    res = G.export_gguf(qm, tmp_path / "out")
    got = {t.name: t for t in GGUFReader(res.path).tensors}
    lm_head = _canonical_tensors(qm)["lm_head.weight"]
    assert got["output.weight"].tensor_type == GGMLQuantizationType.F16
    assert np.array_equal(np.asarray(got["output.weight"].data), lm_head.half().numpy())
    q8 = G.export_gguf(qm, tmp_path / "out-q8", embedding_type="q8_0")
    got = {t.name: t for t in GGUFReader(q8.path).tensors}
    assert got["output.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert got["token_embd.weight"].tensor_type == GGMLQuantizationType.Q8_0


def test_fp8_and_unsupported_architectures_are_refused(tiny_model_session: Path, tmp_path: Path) -> None:
    qm = _quantized(tiny_model_session, Scheme(TensorSpec("fp8_e4m3", "channel")), tmp_path / "fp8")
    with pytest.raises(IncompatibleTargetError, match="no fp8_e4m3 weight type"):
        G.export_gguf(qm, tmp_path / "out-fp8")
    assert not (tmp_path / "out-fp8" / "model.gguf").exists()

    qm = _quantized(tiny_model_session, SCHEMES["w8a16"], tmp_path / "q-int8")
    falcon = dataclasses.replace(qm, meta={**qm.meta, "config": {**qm.config, "model_type": "falcon"}})
    with pytest.raises(IncompatibleTargetError, match="GGUF exporter writes the families .*'falcon'"):
        G.export_gguf(falcon, tmp_path / "out-falcon")


def test_planner_refuses_fp8_for_llama_cpp_and_accepts_int() -> None:
    from llmc.runtimes import catalog as targets

    assert targets.is_implemented("gguf")
    for name in ("llama.cpp", "ollama"):
        rules = targets.runtime(name).rules
        assert targets.runtime(name).format == "gguf"
        assert "W8A16-FP8" not in rules and "W8A8-FP8" not in rules
        assert "W8A16-INT8" in rules and "W4A16-INT" in rules


def test_a_failed_write_leaves_no_gguf(exported, tmp_path: Path, monkeypatch) -> None:
    qm, _ = exported["w8a16"]
    calls = {"n": 0}
    real = G._convert

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("simulated crash mid-write")
        return real(*args, **kwargs)

    monkeypatch.setattr(G, "_convert", flaky)
    with pytest.raises(OSError, match="simulated"):
        G.export_gguf(qm, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # no model.gguf, no temp file, no Modelfile


def test_export_is_deterministic(exported, tmp_path: Path) -> None:
    qm, res = exported["w4a16-g64-asym"]
    again = G.export_gguf(qm, tmp_path / "again")
    assert again.path.read_bytes() == res.path.read_bytes()
    assert math.isfinite(again.weight_error["relative_rms"])


def test_build_exports_gguf_and_compressed_tensors_from_one_quantization(tiny_model_session: Path,
                                                                         tmp_path: Path) -> None:
    import yaml

    from llmc.build import build_until
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store

    recipe = parse_recipe(yaml.safe_dump({
        "name": "tiny-w8",
        "model": {"source": str(tiny_model_session)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"}},
        "targets": [{"runtime": "llama.cpp", "gpu_arch": "cpu"}, {"runtime": "ollama", "gpu_arch": "cpu"},
                    {"runtime": "vllm", "gpu_arch": "sm90"}],
    }))
    store = Store(tmp_path / "cache")
    result = build_until(recipe, store, "export")
    assert sum(s.name.startswith("quantize") for s in result.stages) == 1
    arts = result.artifacts
    for label in ("llama.cpp-cpu-tp1", "ollama-cpu-tp1"):
        a = arts[label]
        assert a.format == "gguf" and {"model.gguf", "Modelfile", "llmc-serve.json"} <= set(a.files)
    # the same GGUF for both runtimes: identical content, so it is evaluated once
    assert arts["llama.cpp-cpu-tp1"].content_key == arts["ollama-cpu-tp1"].content_key
    assert "config.json" in arts["vllm-sm90-tp1"].files
    again = build_until(recipe, store, "export")
    assert all(s.cached for s in again.stages if s.name.startswith("export"))


def _reference_logits(model: Path, qm: QuantizedModel, ids: torch.Tensor) -> torch.Tensor:
    """The Hugging Face model with the canonical dequantized weights put in (llmc's torch reference)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tensors = _canonical_tensors(qm)
    sd = ref.state_dict()
    for module in qm.quantized_modules:
        sd[f"{module}.weight"] = qm.dequantized_weight(tensors, module)
    ref.load_state_dict(sd)
    with torch.no_grad():
        return ref(input_ids=ids).logits


@pytest.mark.parametrize("name", ["w8a16", "w4a16-g64-asym"])
def test_transformers_gguf_reader_reproduces_the_reference(exported, tiny_model_session: Path, name: str,
                                                            tmp_path: Path, monkeypatch) -> None:
    """An independent consumer: transformers' GGUF loader (its own tensor map, its own q/k un-permutation,
    its own tokenizer rebuild from tokenizer.ggml.*) gives the torch reference's logits and token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    qm, res = exported[name]
    ids = torch.randint(3, qm.config["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    ref = _reference_logits(tiny_model_session, qm, ids)
    loaded = AutoModelForCausalLM.from_pretrained(res.path.parent, gguf_file=res.path.name, dtype=torch.float32)
    with torch.no_grad():
        got = loaded.eval()(input_ids=ids).logits
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 5e-3 * scale  # F16 embeddings + fp16 block scales/minimums only

    text = "It is a truth universally acknowledged, 0123 said the jury."
    tok = AutoTokenizer.from_pretrained(res.path.parent, gguf_file=res.path.name)
    assert tok(text)["input_ids"] == AutoTokenizer.from_pretrained(qm.root)(text)["input_ids"]

    # the check has teeth: without llama.cpp's q/k permutation the same reader computes something else
    monkeypatch.setattr(G, "llama_permute", lambda t, n_head: t)
    bad = G.export_gguf(qm, tmp_path / "unpermuted")
    wrong = AutoModelForCausalLM.from_pretrained(bad.path.parent, gguf_file=bad.path.name, dtype=torch.float32)
    with torch.no_grad():
        assert (wrong.eval()(input_ids=ids).logits - ref).abs().max().item() > 0.1 * scale


def _progress_lines(stderr: str, stage_prefix: str) -> list[dict]:
    import json

    lines = [json.loads(ln.split(" ", 1)[1]) for ln in stderr.splitlines() if ln.startswith("llmc-progress ")]
    return [ln for ln in lines if ln["stage"].startswith(stage_prefix)]


def test_exporting_and_unpacking_a_gguf_report_progress(exported, tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 35: an export counts the canonical files it has written out (one a decoder layer), and unpacking a GGUF
    source each of its steps, as `llmc-progress` lines where stderr is no terminal (CI), bars on one."""
    from llmc.model.source import UNPACK_STEPS, _unpack_gguf

    monkeypatch.setenv("LLMC_PROGRESS_JSON", "1")
    qm, _ = exported["w8a16"]
    capsys.readouterr()
    res = G.export_gguf(qm, tmp_path / "again")
    files = _progress_lines(capsys.readouterr().err, "export: canonical files")
    assert [ln["done"] for ln in files][-1] == len(qm.files()) and files[-1]["total"] == len(qm.files())

    _unpack_gguf(res.path, tmp_path / "unpacked", "float32")
    unpack = _progress_lines(capsys.readouterr().err, f"unpack {res.path.name}")
    assert [ln["done"] for ln in unpack] == list(range(1, len(UNPACK_STEPS) + 1))
    assert unpack[-1]["unit"] == "step" and "eta_s" in unpack[0]
    assert (tmp_path / "unpacked" / "model.safetensors").is_file()
