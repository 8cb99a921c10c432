"""How the quantize stage reads its source (issue 44, timed at Qwen2-7B's widths on the 2-core EPYC VM, where new
memory comes at the host's pace):

- a decoder layer stored in a 16-bit float and computed in float32 is read straight into float32 out of the mapped
  file (`CheckpointReader.get_stored`'s `widen_to`): one pass instead of a bf16 clone and a conversion of it
  (`materialize`'s conversion took 0.36-0.54 s a layer beside the clone, which stayed alive through the layer);
- rest.safetensors' embedding and head are written straight from the mapped file (`CheckpointReader.mapped`), not
  from a clone (2.2 GB of new memory at 7B widths).

The same values and codes; the plan holds and times what the build does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import llmc.model.checkpoint as checkpoint
import llmc.quant.stream as stream
from llmc.model.checkpoint import CheckpointReader, read_elem, widened
from llmc.errors import InputError
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec
from tests.conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCHEMES = {
    "fp8-static": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
    "smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True),
                          algorithm="smoothquant"),
    "gptq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"),
}


def _stored_in(folder: Path, dtype: torch.dtype) -> Path:
    for f in folder.glob("*.safetensors"):
        save_file({n: t.to(dtype) if t.is_floating_point() else t for n, t in load_file(f).items()}, f,
                  metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_a_16_bit_float_is_widened_exactly_and_nothing_else_is(stored: torch.dtype) -> None:
    t = torch.randn(8, 16).to(stored)
    wide = widened(t, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, t.clone().float())
    assert widened(t, torch.float64).dtype == torch.float64
    for kept_as_is in (widened(t, None), widened(t, stored), widened(t, torch.bfloat16)):
        assert kept_as_is.dtype == stored and torch.equal(kept_as_is, t)
        assert kept_as_is.data_ptr() != t.data_ptr()  # a copy: the mapped file is closed after the read
    codes = torch.randn(4, 4).to(torch.float8_e4m3fn)  # a quantized original's codes are never widened
    assert widened(codes, torch.float32).dtype == torch.float8_e4m3fn
    ints = torch.arange(6, dtype=torch.int32)
    assert widened(ints, torch.float32).dtype == torch.int32
    full = torch.randn(3)
    assert widened(full, torch.bfloat16).dtype == torch.float32  # never narrowed
    assert (read_elem(2, 4), read_elem(2, 2), read_elem(4, 2), read_elem(1, 4)) == (4, 2, 4, 1)


def test_the_reader_widens_a_layer_and_keeps_the_other_reads_as_stored(tmp_path: Path) -> None:
    reader = CheckpointReader(_stored_in(make_tiny_model(tmp_path / "m"), torch.bfloat16))
    as_stored = reader.with_prefix("model.layers.0.")
    wide = reader.with_prefix("model.layers.0.", torch.float32)
    assert as_stored.keys() == wide.keys() and as_stored
    for name, t in as_stored.items():
        assert t.dtype == torch.bfloat16 and wide[name].dtype == torch.float32
        assert torch.equal(wide[name], t.float())
    assert reader.get_many(["model.embed_tokens.weight"])["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_a_fused_expert_slice_is_widened(tmp_path: Path) -> None:
    from tests.unit.families import make_tiny

    folder = make_tiny("gpt_oss", tmp_path / "m")
    reader = CheckpointReader(folder)
    name = next(n for n in reader.names() if n.endswith("experts.down_proj"))
    stored = reader.get(name)
    for e in range(stored.shape[0]):
        got = reader.expert_slice(name, e, torch.float64)
        assert got.dtype == (torch.float64 if stored.dtype in checkpoint.WIDENED else stored.dtype)
        assert torch.equal(got.to(stored.dtype), stored[e: e + 1])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_codes_are_byte_identical_to_a_layer_read_as_stored_and_converted(tmp_path: Path, monkeypatch,
                                                                              name: str) -> None:
    folder = _stored_in(make_tiny_model(tmp_path / "m", tie=False), torch.bfloat16)
    calibration = stream.Calibration(torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0)),
                                     batch_size=2)
    handed: list[set[torch.dtype]] = []
    materialize = stream.materialize

    def recording(module, tensors, dtype):
        handed.append({t.dtype for t in tensors.values()})
        materialize(module, tensors, dtype)

    monkeypatch.setattr(stream, "materialize", recording)
    stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES[name], tmp_path / "widened", calibration)
    assert handed == [{torch.float32}] * 2  # both layers arrive in the compute dtype: materialize converts nothing
    monkeypatch.setattr(checkpoint, "widened", lambda t, widen_to: t.clone())  # as before: a clone as stored
    handed.clear()
    stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES[name], tmp_path / "as_stored", calibration)
    assert handed == [{torch.bfloat16}] * 2

    def digests(out: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "layers").iterdir())}

    assert digests(tmp_path / "widened") == digests(tmp_path / "as_stored")


def _qwen2_7b_cost(layers: int, compute: str):
    from llmc.model.dtype import BYTES
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape, from_config
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from tests.unit.build_helpers import layer_loop

    config = {**json.loads((REPO / "recipes" / "configs" / "Qwen2-7B" / "config.json").read_text()),
              "num_hidden_layers": layers}
    shape = Shape.of(from_config(config), config, BYTES["bfloat16"])
    fp8 = AlgorithmSteps.of(SCHEMES["fp8-static"])
    row = quantize_cost(shape, layer_loop(fp8, activations="memory"), fp8, compute=compute, stored_elem=2,
                        machine=Machine(available=None, gpu_free=None, device="cpu"))
    return shape, row


def test_the_quantize_plan_reads_ahead_in_the_compute_dtype_and_times_the_conversion() -> None:
    """From bf16 at Qwen2-7B's widths: computed in float32, the layer read ahead is 4 bytes a weight and its read
    writes them (one pass); computed in bf16, 2 bytes and a plain copy, as before."""
    from llmc.planning.disk import converted_read_seconds, source_read_seconds

    shape, wide = _qwen2_7b_cost(4, "float32")
    _, same = _qwen2_7b_cost(4, "bfloat16")
    layer = shape.layer_params
    assert wide.parts["next layer read ahead"] == layer * 4 and same.parts["next layer read ahead"] == layer * 2
    assert wide.layer_parts["read"] == pytest.approx(converted_read_seconds(layer * 2, layer * 4))
    assert same.layer_parts["read"] == pytest.approx(source_read_seconds(layer * 2))
    assert wide.layer_parts["read"] > source_read_seconds(layer * 2)


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status (not Linux)")


def test_a_mapped_tensor_is_the_stored_one_without_new_memory(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    big = torch.randn(4096, 8192).to(torch.bfloat16)  # 64 MiB
    save_file({"model.embed_tokens.weight": big, "model.norm.weight": torch.ones(8)},
              folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8192, "vocab_size": 4096,
                                                    "num_hidden_layers": 1, "num_attention_heads": 64}))
    reader = CheckpointReader(folder)
    before = _rss_anon()
    mapped = reader.mapped("model.embed_tokens.weight")
    assert torch.equal(mapped, big)  # every page read
    grew = _rss_anon() - before
    assert grew < big.numel() * 2 / 4, f"{grew / 2**20:.0f} MiB of new memory for a mapped read"
    copied = reader.get("model.embed_tokens.weight")
    assert _rss_anon() - before - grew > big.numel() * 2 * 3 / 4  # a copy is new memory (the check can fail)
    assert torch.equal(copied, mapped)
    with pytest.raises(InputError, match="not stored as it is read"):
        reader.mapped("lm_head.weight")


def test_rest_is_written_from_the_mapped_file_byte_identical(tmp_path: Path, monkeypatch) -> None:
    folder = _stored_in(make_tiny_model(tmp_path / "m", tie=False), torch.bfloat16)
    source = ModelSource(folder, "t", "t")
    scheme = Scheme(TensorSpec("int8", "channel"))  # weights only: the stream reads no skeleton
    cloned = []
    monkeypatch.setattr(CheckpointReader, "get_many", lambda self, names, widen_to=None: cloned.extend(names) or
                        CheckpointReader.get_stored(self, names, widen_to))
    stream.quantize_model(source, scheme, tmp_path / "mapped", None)
    assert not [n for n in cloned if not n.startswith("model.layers.")]  # nothing outside the layers cloned
    monkeypatch.setattr(CheckpointReader, "mapped", lambda self, name: self.get_stored([name])[name])
    stream.quantize_model(source, scheme, tmp_path / "cloned", None)
    assert ((tmp_path / "mapped" / "rest.safetensors").read_bytes()
            == (tmp_path / "cloned" / "rest.safetensors").read_bytes())


def test_the_quantize_plan_holds_no_copy_of_what_rest_writes_as_stored() -> None:
    """Weights only (no skeleton), a large vocabulary over small layers: the stage's peak was the embedding's
    clone while rest.safetensors was written; read from the mapped file, it is the layer's."""
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import PROCESS_BYTES, Machine
    from llmc.planning.shapes import Shape, from_config
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from tests.unit.build_helpers import layer_loop

    config = {"model_type": "llama", "vocab_size": 1_000_000, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "tie_word_embeddings": False}
    shape = Shape.of(from_config(config), config, 2)
    rtn = AlgorithmSteps.of(Scheme(TensorSpec("int8", "channel")))
    machine = Machine(available=None, gpu_free=None, device="cpu")
    kept = quantize_cost(shape, layer_loop(rtn), rtn, compute="bfloat16", stored_elem=2, machine=machine)
    assert kept.host_bytes == pytest.approx(sum(kept.parts.values()))
    assert kept.host_bytes < PROCESS_BYTES + 1_000_000 * 256 * 2 / 4
    converted = quantize_cost(shape, layer_loop(rtn), rtn, compute="bfloat16", stored_elem=4, machine=machine)
    assert converted.host_bytes == pytest.approx(PROCESS_BYTES + 1_000_000 * 256 * 2)  # float32 -> bf16 copy
