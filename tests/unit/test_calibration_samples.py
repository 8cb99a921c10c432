"""Per-sample calibration: padded rows with an attention mask. Padding must not move any scale, Hessian or
search: every algorithm sees each sample at its own length (llmc.quant.flows.unpadded_samples)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import llmc.quant.flows as flows
import llmc.quant.stream as stream
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec

INT4_G16 = TensorSpec("int4", "group", group_size=16)
FP8_KV = TensorSpec("fp8_e4m3", "tensor")
SCHEMES = {
    "rtn-static-kv": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), FP8_KV),
    "smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), FP8_KV, algorithm="smoothquant"),
    "awq": Scheme(INT4_G16, algorithm="awq"),
    "gptq": Scheme(INT4_G16, algorithm="gptq"),
    "smoothquant+gptq": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), FP8_KV,
                               algorithm="smoothquant+gptq"),
}


def _samples(pad_to: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = [9, 16, 5, 12, 16]
    ids = torch.full((len(lengths), pad_to), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 250, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def _quantized(folder: Path, out: Path, scheme: Scheme, ids, mask) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    stream.quantize_model(ModelSource(folder, "t", "t"), scheme, out, stream.Calibration(ids, mask=mask))
    return {f"{p.name}:{k}": v for p in sorted((out / "layers").iterdir()) for k, v in load_file(str(p)).items()}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(SCHEMES))
def test_appending_padding_changes_no_scale(name: str, tmp_path: Path, tiny_model_session: Path) -> None:
    scheme = SCHEMES[name]
    short = _quantized(tiny_model_session, tmp_path / "a", scheme, *_samples(16, pad_id=2))
    padded = _quantized(tiny_model_session, tmp_path / "b", scheme, *_samples(40, pad_id=7))
    assert short.keys() == padded.keys()
    for k in short:
        assert torch.equal(short[k], padded[k]), f"{name}: {k} moved when padding was appended"
    # ...while the pad tokens, were they calibrated on, would move them: the test can fail.
    ids, mask = _samples(40, pad_id=7)
    unmasked = _quantized(tiny_model_session, tmp_path / "c", scheme, ids, torch.ones_like(mask))
    assert any(not torch.equal(short[k], unmasked[k]) for k in short)


def test_rows_must_be_right_padded() -> None:
    ids = torch.arange(8).view(2, 4)
    assert [t.tolist() for t in flows.unpadded_samples(ids, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))] == [
        [[0, 1]], [[4, 5, 6, 7]]]
    with pytest.raises(ValueError, match="right-padded"):
        flows.unpadded_samples(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
