"""The GGUF export in `llmc plan` (issue 44): its bytes are each tensor at the ggml type `export_gguf` gives it (one
decision, `gguf.tensor_items`, read by both), checked against the file written for tiny models; its time is the
exporter's own work, `_convert` on every tensor and the vocabulary's keys, at rates probed by running those functions
(benchmarks/results/planner-log.md, "The GGUF export's packing and its check")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from llmc.formats import base
from llmc.formats import gguf as G
from llmc.planning.machine import Machine
from llmc.planning.shapes import Shape
from llmc.quant.spec import TensorSpec
from llmc.runtimes import catalog as targets

INT4 = TensorSpec("int4", "group", group_size=64)
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True,
         "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
         "vocab_size": 49152, "num_hidden_layers": 30}


def _work(linears: tuple = ((1536, 576), (576, 1536)) * 30) -> targets.ExportWork:
    shape = Shape(params=134_500_000, layers=30, hidden=576, heads=9, vocab=49152, layer_params=3_540_000,
                  outer_params=28_300_000, largest_linear=1536 * 576, widest_input=1536, intermediate=1536,
                  attn_width=576, active=1.0, stored_bytes=538_000_000)
    written = targets.WrittenTensors(linears=linears, weights=INT4, layer_unquantized=20_000,
                                     outer=shape.outer_params, elem=4, kept_elem=4)
    return targets.ExportWork(shape=shape, written=[written], bits=4, packed_bytes=sum(o * i for o, i in linears) / 2,
                              outer_bytes=shape.outer_params * 4.0, read_seconds=0.0, shared_with=None,
                              outer_written_before=False, compute="float32",
                              machine=Machine(available=None, gpu_free=None, device="cpu"), config=LLAMA)


@pytest.fixture
def pinned(monkeypatch) -> dict:
    """Rates that are functions of what the cost asks: Q4_0 packing 4e6 elements/s, F16 copies 2e7, F32 copies 1e8,
    the vocabulary 1e4 tokens/s; writing and hashing 1 GB/s. Records each kind asked."""
    asked: dict = {}
    rates = {"Q4_0": 4e6, "F16": 2e7, "F32": 1e8}

    def rate(kind: G.ConvertWork) -> float:
        asked[kind] = asked.get(kind, 0) + 1
        return rates[kind.qtype]

    monkeypatch.setattr(G, "convert_rate", rate)
    monkeypatch.setattr(G, "vocabulary_rate", lambda: 1e4)
    monkeypatch.setattr(base, "file_write_seconds", lambda nbytes, files=1: nbytes / 1e9)
    return asked


def test_the_gguf_export_time_grows_with_the_elements_it_packs_and_the_vocabulary(pinned) -> None:
    """`Gguf.cost` adds `_convert`'s work (each kind's elements at its probed rate) and the vocabulary to the files'
    write: drop a term and the difference no longer matches; twice the Linears, twice their part."""
    fmt = targets.artifact_format("gguf")
    work = _work()
    elements = sum(o * i for o, i in work.written[0].linears)
    added = fmt.cost("llama.cpp", work).seconds - base.ArtifactFormat.cost(fmt, "llama.cpp", work).seconds
    want = elements / 4e6 + 20_000 / 1e8 + work.shape.outer_params / 2e7 + 49152 / 1e4
    assert added == pytest.approx(want)
    assert {k.qtype for k in pinned} == {"Q4_0", "F32", "F16"}
    assert next(k for k in pinned if k.qtype == "Q4_0") == G.ConvertWork("Q4_0", "repacked", INT4)
    doubled = _work(((1536, 576), (576, 1536)) * 60)
    added2 = fmt.cost("llama.cpp", doubled).seconds - base.ArtifactFormat.cost(fmt, "llama.cpp", doubled).seconds
    assert added2 - added == pytest.approx(elements / 4e6)
    no_vocab = replace(work, config={**LLAMA, "vocab_size": 0}, shape=replace(work.shape, vocab=0))
    assert fmt.cost("l", work).seconds - fmt.cost("l", no_vocab).seconds == pytest.approx(49152 / 1e4)


def test_the_convert_probe_runs_the_exporters_packer_and_its_check(monkeypatch) -> None:
    """The probe's timer runs `_convert` itself: the Q4_0 packer on the canonical codes, then gguf.quants' decode of
    every block (its check), and returns elements/s; an unquantized tensor's timer takes the F16 copy path."""
    packed: list[tuple[int, ...]] = []
    decoded: list[int] = []
    real_pack, real_decode = G.pack_q4_0, G._gguf().quants.dequantize

    def pack(codes, scales):
        packed.append(codes.shape)
        return real_pack(codes, scales)

    def decode(data, qtype):
        decoded.append(data.size)
        return real_decode(data, qtype)

    monkeypatch.setattr(G, "pack_q4_0", pack)
    monkeypatch.setattr(G._gguf().quants, "dequantize", decode)
    rate = G._convert_timer(G.ConvertWork("Q4_0", "repacked", INT4))()
    assert 0 < rate < 1e12
    assert packed and packed[0] == G.CONVERT_PROBE_SHAPE and len(decoded) == len(packed)
    calls: list[str] = []
    real_convert = G._convert

    def convert(qm, tensors, item, plan_of, errors):
        calls.append(item.qtype)
        return real_convert(qm, tensors, item, plan_of, errors)

    monkeypatch.setattr(G, "_convert", convert)
    assert G._convert_timer(G.ConvertWork("F16", "copy", None, "bfloat16"))() > 0
    assert calls and set(calls) == {"F16"}


def test_the_vocabulary_probe_reads_and_writes_a_tokenizer_as_the_exporter_does(monkeypatch) -> None:
    """`read_vocab` of a byte-level BPE tokenizer.json and `_write_vocab` into a GGUF's keys, timed as tokens/s."""
    seen: list[int] = []
    real = G._write_vocab

    def write(writer, vocab):
        seen.append(len(vocab.tokens))
        assert len(vocab.merges) == len(vocab.tokens)
        return real(writer, vocab)

    monkeypatch.setattr(G, "_write_vocab", write)
    assert G._vocabulary_timer()() > 0 and seen and seen[0] == G.VOCAB_PROBE_TOKENS


def test_a_profile_plans_no_gguf_host_work() -> None:
    """A spec-sheet profile has no rate for the exporter's Python work (its plans are estimates): the term is 0."""
    from llmc.planning import target

    with target.planning_for(target.load("h100-sxm")):
        assert G.convert_seconds(_work()) == 0.0


# a tiny deepseek_v32 (absorbed MLA: attn_k_b F16 from the quantized kv_b_proj; the indexer's attn_k F16, proj and the
# router F32), which the count missed by -5.5% before it ran `tensor_items`, and a dense family (llama: rope_freqs)
INT8 = {"format": "int8", "strategy": "channel"}
CASES = [("deepseek_v32", INT8), ("deepseek_v32", {"format": "int4", "strategy": "group", "group_size": 32}),
         ("llama", {"format": "int4", "strategy": "group", "group_size": 32, "symmetric": False})]
OVERRIDES = {"deepseek_v32": {"first_k_dense_replace": 1, "index_head_dim": 64}}


@pytest.mark.parametrize("family, weights", CASES, ids=["deepseek_v32-q8_0", "deepseek_v32-q4_0", "llama-q4_1"])
def test_the_planned_gguf_counts_each_tensor_at_the_type_it_is_written(family: str, weights: dict,
                                                                       tmp_path: Path) -> None:
    """The plan's disk for a GGUF export is model.gguf and its side files within 2%: each tensor at the type
    `export_gguf` writes (the same `tensor_items`), aligned, with its header entry. What is left is the vocabulary's
    keys, counted as the tokenizer files' bytes (the tiny models' 8 kB tokenizer.json against 6.7 kB of keys)."""
    from llmc.build import build_until
    from llmc.pipeline.ids import Kind
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import COMPLETE_MARKER, Store
    from tests.unit.families import make_tiny

    folder = make_tiny(family, tmp_path / "model", **OVERRIDES.get(family, {}))
    r = parse_recipe(yaml.safe_dump({
        "name": "g", "model": {"source": str(folder)}, "quantization": {"weights": weights, "algorithm": "rtn"},
        "targets": [{"runtime": "llama.cpp", "gpu_arch": "cpu"}], "gates": {"allow_unevaluated": True}}))
    result = build_until(r, Store(tmp_path / "cache"), "export")
    [artifact] = result.artifacts.values()
    written = sum(f.stat().st_size for f in artifact.dir.rglob("*") if f.is_file() and f.name != COMPLETE_MARKER)
    [row] = [x for x in result.plan.rows if x.id.kind is Kind.EXPORT]
    assert row.disk_bytes == pytest.approx(written, rel=0.02), (row.disk_bytes, written)
