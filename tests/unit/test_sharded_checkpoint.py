"""Sharded safetensors (model.safetensors.index.json + model-0000i-of-0000n.safetensors): the index decides which
files are read, and an index that disagrees with its shards is a clear error before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmc.errors import InputError
from llmc.model.checkpoint import INDEX_FILE, CheckpointReader, safetensors_files
from tests.conftest import make_tiny_model


def make_sharded(folder: Path) -> Path:
    """A tiny model saved by transformers itself in several shards."""
    from transformers import AutoModelForCausalLM

    single = make_tiny_model(folder.parent / f"{folder.name}-single")
    model = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")
    for f in single.iterdir():
        if f.name.startswith("tokenizer"):
            (folder / f.name).write_bytes(f.read_bytes())
    assert (folder / INDEX_FILE).is_file() and len(list(folder.glob("model-*.safetensors"))) >= 2
    return folder


@pytest.fixture(scope="module")
def sharded_template(tmp_path_factory) -> Path:
    return make_sharded(tmp_path_factory.mktemp("sharded") / "model")


@pytest.fixture
def sharded(sharded_template, tmp_path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    for f in sharded_template.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_FILE).read_text())


def test_every_indexed_tensor_reads_back_equal_to_the_model(sharded):
    from transformers import AutoModelForCausalLM

    reader = CheckpointReader(sharded)
    weight_map = _index(sharded)["weight_map"]
    assert set(reader.names()) == set(weight_map)
    state = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).state_dict()
    for name in weight_map:
        assert torch.equal(reader.get(name), state[name]), name


def test_files_outside_the_index_are_not_read(sharded):
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    (sharded / "consolidated.safetensors").write_bytes(first.read_bytes())  # a second copy some repos carry
    assert sorted(f.name for f in safetensors_files(sharded)) == sorted(set(_index(sharded)["weight_map"].values()))


def test_a_missing_shard_is_named(sharded):
    shard = sorted(set(_index(sharded)["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(InputError, match=rf"1 of the \d+ shards {INDEX_FILE} lists is missing: {shard}") as e:
        CheckpointReader(sharded)
    assert "download the missing shards" in e.value.fix


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(sharded):
    index = _index(sharded)
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.99.mlp.up_proj.weight"] = shard
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"lacks 1 tensor\(s\) .*model\.layers\.99\.mlp\.up_proj\.weight"):
        safetensors_files(sharded)


def test_a_tensor_the_index_places_elsewhere_is_refused(sharded):
    index = _index(sharded)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]  # now listed in the wrong shard
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(InputError, match="does not list for it|lacks"):
        safetensors_files(sharded)


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/etc/x.safetensors", "weights.bin", ".safetensors"])
def test_an_index_pointing_outside_its_folder_or_at_pickles_is_refused(sharded, shard):
    index = _index(sharded)
    index["weight_map"][next(iter(index["weight_map"]))] = shard
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(InputError, match="not a \\*\\.safetensors file name in the same folder"):
        safetensors_files(sharded)


@pytest.mark.parametrize("text", ["[]", "{}", '{"weight_map": []}', '{"weight_map": {}}', "not json"])
def test_a_malformed_index_is_refused(sharded, text):
    (sharded / INDEX_FILE).write_text(text)
    with pytest.raises(InputError, match="shard index"):
        safetensors_files(sharded)


def test_plan_shapes_come_from_the_indexed_shards_headers(sharded):
    from llmc.planning.shapes import from_headers

    tensors = from_headers(sharded)  # what make_plan reads
    shapes, params = tensors.linear_shapes(), tensors.params
    state_params = sum(t.numel() for t in CheckpointReader(sharded).get_many(CheckpointReader(sharded).names()).values())
    assert params == state_params
    assert shapes["model.layers.0.mlp.up_proj"] == (128, 64)


def test_the_index_enters_the_source_hash(sharded, store):
    from llmc.model.source import resolve_source

    before = resolve_source(str(sharded), store).sha256
    index = _index(sharded)
    index["metadata"] = {"total_size": 1}
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    assert resolve_source(str(sharded), store).sha256 != before


def test_an_export_of_a_sharded_source_reads_its_own_shards(sharded, tmp_path):
    """The source's index names the source's shards: neither the quantized form nor an artifact may carry it (an
    artifact with it would name shards it does not have and fail to load; seen on a 70B-width build)."""
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.modelopt_hf import export_modelopt_hf
    from llmc.model.source import ModelSource
    from llmc.quant import stream
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec

    stream.quantize_model(ModelSource(sharded, "s", "s"), Scheme(TensorSpec("int4", "group", group_size=16)), tmp_path / "q",
                          None)
    assert not (tmp_path / "q" / INDEX_FILE).exists()
    qm = QuantizedModel.open(tmp_path / "q")
    for name, export in (("ct", export_compressed_tensors), ("modelopt", export_modelopt_hf)):
        written = export(qm, tmp_path / name)
        assert [f.name for f in safetensors_files(tmp_path / name)] == [f.name for f in written]
        assert len(CheckpointReader(tmp_path / name).names()) > 0


def test_write_shards_writes_each_shard_before_reading_past_it(tmp_path):
    """An export holds one shard at a time: a shard is on disk before the parts after it are read; the shards and
    the index written at the end read back as the parts."""
    from llmc.formats.files import write_shards

    parts = [{f"t{i}": torch.full((25,), float(i))} for i in range(7)]  # 100 bytes each: shards of two parts

    def produce():
        for i, part in enumerate(parts):
            if i >= 4:  # parts 0-1 overflowed at part 2, parts 2-3 at part 4: shard 1 is written
                assert len(list(tmp_path.glob("*.safetensors"))) >= 1, f"nothing written before part {i}"
            yield part

    written = write_shards(tmp_path, produce(), max_bytes=250)
    assert [f.name for f in written] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([f.name for f in written] + [INDEX_FILE])
    from safetensors.torch import load_file

    weight_map = _index(tmp_path)["weight_map"]
    for part in parts:
        (name, tensor), = part.items()
        assert torch.equal(load_file(tmp_path / weight_map[name])[name], tensor)
    single = write_shards(tmp_path / "one", parts[:2], max_bytes=250)
    assert [f.name for f in single] == ["model.safetensors"] and not (tmp_path / "one" / INDEX_FILE).exists()
