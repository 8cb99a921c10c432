"""The torch reference evaluated one decoder layer at a time gives the whole-model path's scores: the baseline and
artifacts of each kind of compression (FP8 static + FP8 KV, INT8 dynamic, INT4 packed groups)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.engines.torch_ref import TorchEngine
from llmc.engines.torch_stream import choose_streamed
from llmc.model.source import ModelSource
from llmc.quant.canonical import QuantizedModel
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import Calibration, quantize_model

SCHEMES = {
    "fp8-static-kv": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                            kv_cache=TensorSpec("fp8_e4m3", "tensor")),
    "w8a8-int8-dynamic": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True)),
    "w4a16-g32-asym": Scheme(TensorSpec("int4", "group", group_size=32, symmetric=False)),
}


def _ids(vocab: int, n: int, seq: int, seed: int) -> torch.Tensor:
    ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 1
    return ids


def _scores(folder: Path, streamed: bool, windows: torch.Tensor, reference: dict | None = None) -> dict:
    engine = TorchEngine(folder, streamed=streamed)
    assert engine.streamed is streamed
    return engine.score(windows, batch_size=2, reference=reference)


def _assert_close(whole: dict, streamed: dict) -> None:
    assert whole.keys() == streamed.keys()
    for key in whole:
        if whole[key].is_floating_point():
            torch.testing.assert_close(streamed[key], whole[key], rtol=1e-5, atol=1e-5, msg=key)
        else:
            assert torch.equal(streamed[key], whole[key]), key


@pytest.mark.parametrize("name", SCHEMES)
def test_streamed_evaluation_equals_the_whole_model(name: str, tiny_model: Path, tmp_path: Path) -> None:
    scheme = SCHEMES[name]
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    src = ModelSource(folder=tiny_model, sha256="test", origin=str(tiny_model))
    quantize_model(src, scheme, tmp_path / "q",
                   Calibration(_ids(vocab, 4, 32, 0)) if scheme.needs_calibration else None)
    export_compressed_tensors(QuantizedModel.open(tmp_path / "q"), tmp_path / "artifact")
    windows = _ids(vocab, 5, 40, 1)  # an odd count: the last batch is a partial one

    base_whole, base_streamed = _scores(tiny_model, False, windows), _scores(tiny_model, True, windows)
    _assert_close(base_whole, base_streamed)  # NLL, top-k and the recorded output-head inputs
    art_whole = _scores(tmp_path / "artifact", False, windows, reference=base_whole)
    art_streamed = _scores(tmp_path / "artifact", True, windows, reference=base_whole)
    _assert_close(art_whole, art_streamed)  # NLL, exact KL, its top-k bound, top-1
    assert (art_whole["nll"] - base_whole["nll"]).abs().max() > 1e-4  # the artifact is not the baseline


def test_the_streamed_path_reports_no_decode_timing(tiny_model: Path) -> None:
    engine = TorchEngine(tiny_model, streamed=True)
    windows = _ids(300, 2, 16, 2)
    engine.score(windows)
    tput = engine.throughput(windows[:1], decode_tokens=4, repeats=1)
    assert tput["streamed"] and tput["decode_tokens_per_s"] is None and tput["prefill_tokens_per_s"]["median"] > 0


def test_auto_streams_only_when_the_dense_model_does_not_fit(monkeypatch) -> None:
    monkeypatch.delenv("LLMC_TORCH_EVAL", raising=False)
    assert choose_streamed(60, 100) and not choose_streamed(40, 100) and not choose_streamed(40, None)
    monkeypatch.setenv("LLMC_TORCH_EVAL", "streamed")
    assert choose_streamed(1, 100)
    assert not choose_streamed(10**12, 100, setting="whole")


@pytest.mark.parametrize("name", ["fp8-static-kv", "w8a8-int8-dynamic"])
def test_an_artifact_decompressed_in_blocks_of_rows_scores_as_decompressed_whole(
        name: str, tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    """Streamed evaluation decompresses 8-bit codes a block of rows at a time (one block's float32 temporaries):
    with blocks of a few rows, the artifact's scores are the whole-model path's."""
    import llmc.engines.torch_stream as torch_stream

    scheme = SCHEMES[name]
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    src = ModelSource(folder=tiny_model, sha256="test", origin=str(tiny_model))
    quantize_model(src, scheme, tmp_path / "q", Calibration(_ids(vocab, 4, 32, 0)))
    export_compressed_tensors(QuantizedModel.open(tmp_path / "q"), tmp_path / "artifact")
    windows = _ids(vocab, 3, 24, 1)
    base = _scores(tiny_model, False, windows)
    whole = _scores(tmp_path / "artifact", False, windows, reference=base)
    blocks = []
    real = torch_stream.LayerDecoder._decompressed
    monkeypatch.setattr(torch_stream, "BLOCK_ELEMENTS", 3 * 64 + 5)  # a few rows, not dividing any Linear's

    def counting(self, compressor, state, scheme):
        blocks.append(state["weight"].shape[0] > 3)
        return real(self, compressor, state, scheme)

    monkeypatch.setattr(torch_stream.LayerDecoder, "_decompressed", counting)
    _assert_close(whole, _scores(tmp_path / "artifact", True, windows, reference=base))
    assert blocks and all(blocks)  # every quantized Linear went through the blocked path
