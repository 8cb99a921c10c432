"""llmc.telemetry.progress: what a long step tells a log (JSON lines with an ETA), and which steps tell it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmc.storage import store
from llmc.telemetry import progress


def _lines(err: str) -> list[dict]:
    return [json.loads(line.removeprefix("llmc-progress ")) for line in err.splitlines()
            if line.startswith("llmc-progress ")]


@pytest.fixture
def json_progress(monkeypatch):
    monkeypatch.setenv("LLMC_PROGRESS_JSON", "1")


def test_steps_print_a_line_per_item_with_its_eta(json_progress, capsys) -> None:
    assert list(progress.steps(range(4), "quantize layers", unit="layer")) == [0, 1, 2, 3]
    lines = _lines(capsys.readouterr().err)
    assert [(d["done"], d["total"], d["unit"]) for d in lines] == [(i, 4, "layer") for i in range(1, 5)]
    assert lines[-1]["eta_s"] == 0 and all(d["eta_s"] >= 0 for d in lines)


def test_a_throttled_meter_prints_the_last_step_even_within_its_interval(json_progress, capsys) -> None:
    with progress.Meter("hash x", 10, unit="B", every_s=3600) as meter:
        for _ in range(10):
            meter.advance()
    lines = _lines(capsys.readouterr().err)
    assert [d["done"] for d in lines] == [10]  # the first nine fell within the hour


def test_steps_say_nothing_when_json_is_off(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LLMC_PROGRESS_JSON", "0")
    list(progress.steps(range(3), "x"))
    assert _lines(capsys.readouterr().err) == []


def test_hashing_a_large_file_reports_its_bytes(json_progress, capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(store, "_METERED_HASH_BYTES", 1 << 20)
    big, small = tmp_path / "model.safetensors", tmp_path / "config.json"
    big.write_bytes(b"\x01" * (3 << 20))
    small.write_bytes(b"{}")
    import hashlib

    assert store.sha256_file(big, chunk=1 << 20) == hashlib.sha256(big.read_bytes()).hexdigest()
    store.sha256_file(small)
    lines = _lines(capsys.readouterr().err)
    assert [(d["stage"], d["done"], d["total"], d["unit"]) for d in lines][-1] == (
        "hash model.safetensors", 3 << 20, 3 << 20, "B")
    assert all(d["stage"] == "hash model.safetensors" for d in lines)  # the small file says nothing


def test_the_torch_engine_reports_its_batches(json_progress, capsys, tiny_model_session) -> None:
    import torch

    from llmc.engines.torch_ref import TorchEngine

    windows = torch.randint(0, 100, (5, 16), generator=torch.Generator().manual_seed(0))
    TorchEngine(tiny_model_session, streamed=False).token_nll(windows, batch_size=2)
    lines = [d for d in _lines(capsys.readouterr().err) if d["stage"].startswith("score windows")]
    assert lines and lines[-1]["done"] == lines[-1]["total"]
