"""Layer streaming: at most one decoder layer holds real weights at any time, whatever the depth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import llmc.quant.stream as stream
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec


@pytest.mark.parametrize("depth", [2, 6])
def test_at_most_one_layer_materialized(depth: int, tmp_path: Path, monkeypatch, tiny_model_factory) -> None:
    folder = tiny_model_factory(tmp_path / "m", layers=depth)
    captured = {}
    real_build = stream.build_skeleton

    def capture(*a, **k):
        captured["model"] = real_build(*a, **k)
        return captured["model"]

    monkeypatch.setattr(stream, "build_skeleton", capture)
    seen: list[int] = []

    def real_layers() -> int:
        _, layers = stream.decoder_layers(captured["model"])
        return sum(any(p.device.type != "meta" for p in layer.parameters()) for layer in layers)

    real_materialize = stream.materialize

    def checked_materialize(module, tensors, dtype):
        real_materialize(module, tensors, dtype)
        seen.append(real_layers())

    monkeypatch.setattr(stream, "materialize", checked_materialize)
    scheme = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"))  # static: runs the layers
    calib = torch.randint(3, 200, (4, 16))
    result = stream.quantize_model(
        ModelSource(folder, "t", "t"), scheme, tmp_path / "q", calibration=calib,
        on_layer_done=lambda i: seen.append(real_layers()),
    )
    assert result.layers == depth and result.calibrated
    assert max(seen) <= 1  # never two layers at once
    assert seen[-1] == 0  # and none left at the end
