"""The layer loop's writes overlapped with the next layer's compute, and its weight reads with the previous layer's
(llmc.quant.overlap, issue 31): the same bytes as the loop without overlap for every data flow, in memory and
spilled; the overlap is real (layer 0's file is still being written while layer 1 computes); a full disk in the
writer is the same clear error as without overlap, and progress never passes the failed write. Kill -9 during an
overlapped write: tests/unit/test_kill_anywhere.py."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

import llmc.quant.stream as stream
from llmc.errors import ResourceError
from llmc.model.source import ModelSource
from llmc.quant.overlap import WRITER_THREAD, LayerWriter, Prefetcher, on_host
from llmc.quant.spec import Scheme, TensorSpec
from llmc.telemetry import events
from tests.unit.test_resource_errors import FullDisk

SCHEMES = {
    "rtn-w8": Scheme(TensorSpec("int8", "channel")),  # data-free
    "fp8-static-kv": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                            TensorSpec("fp8_e4m3", "tensor")),  # sequential, original outputs passed on
    "smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True),
                          algorithm="smoothquant"),  # sequential, quantized outputs passed on (one more pass)
    "gptq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"),  # true-sequential
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("overlap") / "model", layers=3)


def _quantize(model: Path, scheme: Scheme, out: Path, *, overlap: bool, spill: str = "never") -> None:
    calibration = stream.Calibration(torch.randint(3, 200, (6, 24), generator=torch.Generator().manual_seed(0)),
                                     batch_size=2, spill=spill) if scheme.needs_calibration else None
    stream.quantize_model(ModelSource(model, "t", "t"), scheme, out, calibration,
                          stream.StreamOptions(overlap=overlap,  # as the quantize stage reports each layer
                                               on_layer_done=lambda i: events.emit(f"quantize:layer:{i}")))


def _hashes(out: Path) -> dict[str, str]:
    return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(out.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("spill", ["never", "always"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_overlap_writes_the_same_bytes_on_the_writer_thread(model: Path, name: str, spill: str,
                                                              tmp_path: Path) -> None:
    if spill == "always" and not SCHEMES[name].needs_calibration:
        pytest.skip("nothing to spill")
    threads: dict[str, set[str]] = {}
    listener = events.subscribe(lambda e: threads.setdefault(e, set()).add(threading.current_thread().name))
    try:
        _quantize(model, SCHEMES[name], tmp_path / "serial", overlap=False, spill=spill)
        serial_threads = dict(threads)
        threads.clear()
        _quantize(model, SCHEMES[name], tmp_path / "overlap", overlap=True, spill=spill)
    finally:
        events.unsubscribe(listener)
    assert _hashes(tmp_path / "overlap") == _hashes(tmp_path / "serial")
    assert not (tmp_path / "overlap" / "state").exists()
    for event in ("file:00001.safetensors", "file:progress.json", "quantize:layer:1"):
        assert serial_threads[event] == {"MainThread"}, event
        assert {t.rsplit("_", 1)[0] for t in threads[event]} == {WRITER_THREAD}, event


def test_layer_0_is_still_being_written_while_layer_1_computes(model: Path, tmp_path: Path, monkeypatch) -> None:
    """The writer's layer-0 file waits until the loop has quantized layer 1: only an overlapped loop gets there."""
    layer_1_quantized = threading.Event()
    real_tensors, real_save = stream._layer_tensors, stream.atomic_save_safetensors

    def layer_tensors(layer, prefix, *args):
        if prefix.endswith(".1."):
            layer_1_quantized.set()
        return real_tensors(layer, prefix, *args)

    def save(path, tensors, *args, **kwargs):
        if path.name == "00000.safetensors" and not layer_1_quantized.wait(timeout=60):
            raise AssertionError("layer 1 was not computed while layer 0 was being written")
        return real_save(path, tensors, *args, **kwargs)

    monkeypatch.setattr(stream, "_layer_tensors", layer_tensors)
    monkeypatch.setattr(stream, "atomic_save_safetensors", save)
    _quantize(model, SCHEMES["fp8-static-kv"], tmp_path / "out", overlap=True)
    assert (tmp_path / "out" / "layers" / "00000.safetensors").is_file()


@pytest.mark.parametrize("pattern", ["*/layers/.00001.safetensors*",  # a layer's file
                                     "*/state/inputs-00002.partial/batches.safetensors",  # next layer's inputs
                                     "*/state/.progress.json.*"])
def test_full_disk_in_the_writer_is_the_loop_s_clear_error(model: Path, pattern: str, tmp_path: Path,
                                                            monkeypatch) -> None:
    scheme = SCHEMES["fp8-static-kv"]
    _quantize(model, scheme, tmp_path / "clean", overlap=False)
    errors = {}
    for overlap in (False, True):
        out = tmp_path / f"overlap-{overlap}"
        with pytest.MonkeyPatch.context() as mp:
            disk = FullDisk(mp, pattern)
            with pytest.raises(ResourceError) as failed:
                _quantize(model, scheme, out, overlap=overlap)
        assert disk.hits
        errors[overlap] = str(failed.value).replace(str(out), "<out>")
        # progress never passed layer 1, whose write failed (the writer runs nothing after a failed job)
        progress = out / "state" / "progress.json"
        assert not progress.exists() or json.loads(progress.read_text())["next_layer"] <= 1
        _quantize(model, scheme, out, overlap=overlap)  # space freed: resumes
        assert _hashes(out) == _hashes(tmp_path / "clean")
    assert errors[True] == errors[False]
    assert errors[True].startswith("disk full writing") and "<out>" in errors[True]


def test_the_writer_keeps_one_layer_in_flight_and_stops_at_the_first_error() -> None:
    writer, ran, release = LayerWriter(), [], threading.Event()
    writer.submit(0, lambda: (release.wait(5), ran.append("0a")))
    writer.submit(0, lambda: ran.append("0b"))  # same layer: queued, not waited for
    assert ran == []
    release.set()
    writer.submit(1, lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))  # waits for layer 0
    assert ran == ["0a", "0b"]
    writer.submit(1, lambda: ran.append("1b"))  # after the failing job: never runs
    with pytest.raises(OSError, match="No space left"):
        writer.close()
    assert ran == ["0a", "0b"]


def test_the_writer_takes_only_host_tensors_and_the_prefetcher_reads_one_layer_ahead() -> None:
    assert on_host({"w": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="not on the host"):
        on_host({"w": torch.zeros(2, device="meta")})
    reads: list[int] = []
    prefetch = Prefetcher(lambda i: (reads.append(i), {"i": torch.tensor(i)})[1], range(2, 5))
    assert [int(prefetch.take(i)["i"]) for i in (2, 3, 4)] == [2, 3, 4]
    prefetch.close()
    assert reads == [2, 3, 4]  # each layer read once, in order


OVERLAP_PARTS = ("previous layer being written", "next layer read ahead")


@pytest.mark.parametrize("layers, held", [(1, ()), (2, ("next layer read ahead",)), (3, OVERLAP_PARTS)])
def test_the_plan_holds_only_the_neighbours_a_model_of_that_depth_has(layers: int, held: tuple[str, ...],
                                                                     monkeypatch) -> None:
    """The writer holds the previous layer's codes and the prefetcher reads the next layer while a layer computes:
    a first layer has no previous one and a last no next, so the quantize row's peak counts neither for one decoder
    layer, the larger of the two for two (here the read-ahead: bf16 weights against one-byte codes), both from three
    (one gpt-oss-120b-width layer counted as a middle one: planned 6.60 GB, 2.47 GB of it these two, peak 4.98 GB;
    benchmarks/results/gptoss_full_width.jsonl)."""
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape, from_config
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from tests.unit.build_helpers import layer_loop
    from tests.unit.test_plan_honest import QWEN2_7B_WIDTHS, pin_probes

    pin_probes(monkeypatch, matmul=(10e9,), quantize=(1e8,))
    config = {**QWEN2_7B_WIDTHS, "num_hidden_layers": layers}
    shape = Shape.of(from_config(config), config, 2)
    fp8 = AlgorithmSteps.of(SCHEMES["fp8-static-kv"])
    row = quantize_cost(shape, layer_loop(fp8, activations="memory", windows=1, seq_len=128, batch=4), fp8,
                        compute="bfloat16", stored_elem=2, machine=Machine(available=None, gpu_free=None, device="cpu"))
    assert {k for k in OVERLAP_PARTS if row.parts[k]} == set(held)
    expected = {"previous layer being written": shape.layer_params * 1.0,  # one-byte codes
                "next layer read ahead": shape.layer_params * 2}  # bf16 weights
    for k in held:
        assert row.parts[k] == expected[k]
    assert row.host_bytes >= sum(row.parts.values())  # the parts are the peak's (a floor may lie above them)
