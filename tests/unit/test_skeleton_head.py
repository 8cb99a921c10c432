"""The calibration skeleton leaves an untied output head unread (issue 35: a 7B's 152k-row head was read and
converted to float32 for a forward that stops at the first decoder layer): the same codes, the head still in the
canonical form, and the tied case unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import llmc.quant.stream as stream
from llmc.model.checkpoint import CheckpointReader
from llmc.model.skeleton import build_skeleton, output_head_names
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec
from tests.conftest import make_tiny_model

SCHEMES = {
    "fp8-static": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
    "smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True),
                          algorithm="smoothquant"),  # traces the first layer's structure through the skeleton
    "gptq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"),
}


def _quantize(model: Path, scheme: Scheme, out: Path) -> None:
    calibration = stream.Calibration(torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0)),
                                     batch_size=2)
    stream.quantize_model(ModelSource(model, "t", "t"), scheme, out, calibration)


@pytest.mark.parametrize("tie", [False, True])
def test_the_output_head_is_named_tied_or_not(tmp_path: Path, tie: bool) -> None:
    folder = make_tiny_model(tmp_path / "m", tie=tie)
    model = build_skeleton(CheckpointReader(folder).config(), torch.float32)
    assert output_head_names(model) == {"lm_head.weight"}
    assert ("lm_head.weight" in CheckpointReader(folder)) is not tie  # a tied checkpoint stores none


@pytest.mark.parametrize("name", list(SCHEMES))
def test_an_untied_head_is_not_read_for_calibration_and_the_output_is_unchanged(tmp_path: Path, monkeypatch,
                                                                               name: str) -> None:
    folder = make_tiny_model(tmp_path / "m", tie=False)
    reads: list[str] = []
    mapped_reads: list[str] = []
    get_many, mapped = CheckpointReader.get_many, CheckpointReader.mapped

    def recording(self, names, widen_to=None):
        reads.extend(names)
        return get_many(self, names, widen_to)

    def recording_mapped(self, name):
        mapped_reads.append(name)
        return mapped(self, name)

    monkeypatch.setattr(CheckpointReader, "get_many", recording)
    monkeypatch.setattr(CheckpointReader, "mapped", recording_mapped)
    _quantize(folder, SCHEMES[name], tmp_path / "skipped")
    assert "lm_head.weight" not in reads  # never copied: not for calibration, and not for rest.safetensors,
    assert mapped_reads.count("lm_head.weight") == 1  # which the last step writes from the mapped file
    rest = load_file(tmp_path / "skipped" / "rest.safetensors")
    source = CheckpointReader(folder)
    assert torch.equal(rest["lm_head.weight"], source.get("lm_head.weight"))

    # the same run with the head read and materialized, as before: byte-identical layers
    monkeypatch.setattr(stream, "output_head_names", lambda model: set())
    _quantize(folder, SCHEMES[name], tmp_path / "read")

    def digests(out: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "layers").iterdir())}

    assert digests(tmp_path / "skipped") == digests(tmp_path / "read")
