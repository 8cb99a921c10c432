"""Layer streaming: at most one decoder layer holds real weights at any time, whatever the depth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import llmc.model.skeleton as skeleton
import llmc.quant.flows as flows
import llmc.quant.stream as stream
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec


@pytest.mark.parametrize("depth", [2, 6])
def test_at_most_one_layer_materialized(depth: int, tmp_path: Path, monkeypatch, tiny_model_factory) -> None:
    folder = tiny_model_factory(tmp_path / "m", layers=depth)
    captured = {}
    real_build = skeleton.build_skeleton

    def capture(*a, **k):
        captured["model"] = real_build(*a, **k)
        return captured["model"]

    monkeypatch.setattr(stream, "build_skeleton", capture)
    seen: list[int] = []

    def real_layers() -> int:
        _, layers = skeleton.decoder_layers(captured["model"])
        return sum(any(p.device.type != "meta" for p in layer.parameters()) for layer in layers)

    real_materialize = skeleton.materialize

    def checked_materialize(module, tensors, dtype):
        real_materialize(module, tensors, dtype)
        seen.append(real_layers())

    monkeypatch.setattr(stream, "materialize", checked_materialize)
    real_release, after_release = skeleton.release, []

    def checked_release(module) -> None:
        real_release(module)
        after_release.append(real_layers())

    monkeypatch.setattr(stream, "release", checked_release)
    scheme = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"))  # static: runs the layers
    calib = torch.randint(3, 200, (4, 16))
    result = stream.quantize_model(ModelSource(folder, "t", "t"), scheme, tmp_path / "q",
                                   stream.Calibration(calib),
                                   stream.StreamOptions(on_layer_done=lambda i: seen.append(real_layers())))
    assert result.layers == depth and result.calibrated
    assert max(seen) <= 1  # never two layers at once
    # and none left once a layer is released (asked on the loop's thread: on_layer_done runs on the layer writer's,
    # which may report the last layer before the loop releases it)
    assert len(after_release) > depth and set(after_release) == {0}


# --------------------------------------------------------------------------- activations between layers

GPTQ = Scheme(TensorSpec("int4", "group", group_size=16), algorithm="gptq")  # propagates quantized outputs
SMOOTHQUANT = Scheme(  # propagates original outputs, static activation scales + KV scales
    TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), TensorSpec("fp8_e4m3", "tensor"),
    algorithm="smoothquant",
)


def _layer_files(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "layers").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("scheme", [GPTQ, SMOOTHQUANT], ids=["gptq", "smoothquant"])
def test_spilled_activations_give_identical_results_one_batch_resident(
    scheme: Scheme, tmp_path: Path, monkeypatch, tiny_model_factory
) -> None:
    folder = tiny_model_factory(tmp_path / "m", layers=3)
    calib = torch.randint(3, 200, (8, 16))
    source = ModelSource(folder, "t", "t")
    stream.quantize_model(source, scheme, tmp_path / "mem", stream.Calibration(calib, batch_size=2, spill="never"))

    resident: list[int | None] = []
    real_observe = flows.observe_batches

    def observe(layer, linears, kv, obs, hidden, *rest):
        resident.append(None if hidden._tensors is None else len(hidden._tensors))
        return real_observe(layer, linears, kv, obs, hidden, *rest)

    real_true_sequential = flows.quantize_true_sequential  # GPTQ: Hessians inside the outputs' forward

    def true_sequential(layer, prefix, linears, kv, hidden, *rest):
        resident.append(None if hidden._tensors is None else len(hidden._tensors))
        return real_true_sequential(layer, prefix, linears, kv, hidden, *rest)

    monkeypatch.setattr(flows, "observe_batches", observe)
    monkeypatch.setattr(flows, "quantize_true_sequential", true_sequential)
    stream.quantize_model(source, scheme, tmp_path / "disk", stream.Calibration(calib, batch_size=2, spill="always"))
    assert resident and all(r is None for r in resident)  # every layer read its inputs from disk
    _assert_same(_layer_files(tmp_path / "mem"), _layer_files(tmp_path / "disk"))
    assert not (tmp_path / "disk" / "state").exists()  # spill files go once the form is complete


@pytest.mark.parametrize(("spill", "resume_spill"), [("never", "never"), ("always", "always"), ("never", "always")])
def test_killed_between_inputs_and_progress_resumes_exactly(
    spill: str, resume_spill: str, tmp_path: Path, monkeypatch, tiny_model_factory
) -> None:
    """The next layer's inputs are on disk but progress still names this layer: redo it from its own inputs
    (also when the rerun spills where the killed run kept activations in memory)."""
    folder = tiny_model_factory(tmp_path / "m", layers=3)
    calib = torch.randint(3, 200, (4, 16))
    source = ModelSource(folder, "t", "t")
    stream.quantize_model(source, GPTQ, tmp_path / "clean", stream.Calibration(calib, batch_size=2))

    real_write = stream.atomic_write_json

    def die_on_second_layer(path, data):
        if data.get("next_layer") == 2:
            raise KeyboardInterrupt("killed")
        real_write(path, data)

    monkeypatch.setattr(stream, "atomic_write_json", die_on_second_layer)
    with pytest.raises(KeyboardInterrupt):
        stream.quantize_model(source, GPTQ, tmp_path / "crashy", stream.Calibration(calib, batch_size=2, spill=spill))
    assert (tmp_path / "crashy" / "state" / "inputs-00002").is_dir()  # written before the kill
    monkeypatch.setattr(stream, "atomic_write_json", real_write)
    stream.quantize_model(source, GPTQ, tmp_path / "crashy",
                          stream.Calibration(calib, batch_size=2, spill=resume_spill))
    _assert_same(_layer_files(tmp_path / "clean"), _layer_files(tmp_path / "crashy"))


@pytest.mark.parametrize("scheme", [GPTQ, SMOOTHQUANT], ids=["gptq", "smoothquant"])
def test_resume_points_every_few_seconds_resume_exactly(scheme: Scheme, tmp_path: Path, monkeypatch,
                                                        tiny_model_factory) -> None:
    """With `resume_every_s` (the default when activations stay on a GPU) only some layers are resume points: a run
    killed between two of them saved no inputs for the layers in between, and its rerun redoes them from the last
    resume point's inputs to the clean run's bits."""
    folder = tiny_model_factory(tmp_path / "m", layers=4)
    calib = torch.randint(3, 200, (4, 16))
    source = ModelSource(folder, "t", "t")
    stream.quantize_model(source, scheme, tmp_path / "clean", stream.Calibration(calib, batch_size=2))

    # The loop reads the clock once at the start, then once per layer (and once more after each resume point):
    # 10 s between resume points makes layer 1 one (its check reads 12 s) and not layer 0 (5 s) or layer 2 (15 s).
    clock = iter([0.0, 5.0, 12.0, 12.0, 15.0, 30.0, 30.0])
    monkeypatch.setattr(stream, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(clock))}))
    state = tmp_path / "crashy" / "state"
    seen: list[list[str]] = []

    def killed_after_layer_2(i: int) -> None:
        seen.append(sorted(p.name for p in state.iterdir()) if state.is_dir() else [])
        if i == 2:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        stream.quantize_model(source, scheme, tmp_path / "crashy", stream.Calibration(calib, batch_size=2),
                              stream.StreamOptions(resume_every_s=10.0, on_layer_done=killed_after_layer_2))
    assert "progress.json" not in seen[0] and not any(n.startswith("inputs-00001") for n in seen[0])  # layer 0: none
    assert seen[1] == ["inputs-00002", "progress.json"]  # layer 1 is a resume point
    assert json.loads((state / "progress.json").read_text())["next_layer"] == 2
    assert not (state / "inputs-00003").exists()  # layer 2 is not
    monkeypatch.undo()
    stream.quantize_model(source, scheme, tmp_path / "crashy", stream.Calibration(calib, batch_size=2))
    _assert_same(_layer_files(tmp_path / "clean"), _layer_files(tmp_path / "crashy"))
    assert not state.exists()


def test_auto_spill_rule() -> None:
    from llmc.quant.activations import should_spill

    gb = 1 << 30
    assert not should_spill("auto", 1 * gb, 16 * gb)  # two copies: 2 GB of 16 available
    assert should_spill("auto", 3 * gb, 16 * gb)  # 6 GB > a quarter of 16
    assert not should_spill("auto", 3 * gb, None)  # unknown memory: keep in memory
    assert should_spill("always", 1, 16 * gb) and not should_spill("never", 100 * gb, gb)


# --------------------------------------------------------------------------- statistics shared between schemes

FP8_STATIC_KV = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"),
                       TensorSpec("fp8_e4m3", "tensor"))
INT8_STATIC_KV = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "tensor"), TensorSpec("int8", "tensor"))
SQ_DYNAMIC = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True), algorithm="smoothquant")


@pytest.mark.parametrize("second", [INT8_STATIC_KV, SQ_DYNAMIC], ids=["int8-static-kv", "smoothquant-dynamic"])
def test_second_scheme_reuses_statistics_without_a_forward_and_gets_identical_results(
    second: Scheme, tmp_path: Path, monkeypatch, tiny_model_factory
) -> None:
    folder = tiny_model_factory(tmp_path / "m", layers=3)
    calib = torch.randint(3, 200, (8, 16))
    source = ModelSource(folder, "t", "t")
    stream.quantize_model(source, second, tmp_path / "alone", stream.Calibration(calib))  # no sharing

    shared = tmp_path / "shared"
    stream.quantize_model(source, FP8_STATIC_KV, tmp_path / "first", stream.Calibration(calib, shared_stats=shared))
    assert (shared / "complete.json").is_file()

    def no_forward(*a, **k):
        raise AssertionError("calibration forward run although the statistics were shared")

    real_capture = skeleton.capture_layer_inputs

    def structure_probe_only(model, layers, batches, *a, **k):
        # SmoothQuant still traces each layer's structure (llmc.quant.algorithms.mappings): one short window
        if any(b.shape[0] > 1 or b.shape[1] > stream.PROBE_TOKENS for b in batches):
            no_forward()
        return real_capture(model, layers, batches, *a, **k)

    monkeypatch.setattr(stream, "capture_layer_inputs", structure_probe_only)  # the structure probe
    monkeypatch.setattr(flows, "capture_layer_inputs", structure_probe_only)  # the calibration inputs
    monkeypatch.setattr(flows, "observe_batches", no_forward)
    stream.quantize_model(source, second, tmp_path / "second", stream.Calibration(calib, shared_stats=shared))
    _assert_same(_layer_files(tmp_path / "alone"), _layer_files(tmp_path / "second"))


def test_statistics_are_not_shared_where_they_depend_on_the_scheme(tmp_path: Path, tiny_model_factory) -> None:
    folder = tiny_model_factory(tmp_path / "m", layers=2)
    calib = torch.randint(3, 200, (4, 16))
    source = ModelSource(folder, "t", "t")
    # GPTQ calibrates each layer on the quantized previous one: nothing it sees is reusable
    stream.quantize_model(source, GPTQ, tmp_path / "gptq", stream.Calibration(calib, shared_stats=tmp_path / "s1"))
    assert not (tmp_path / "s1").exists()
    # statistics without KV ranges do not cover a KV-cache scheme: it calibrates (and completes them again)
    stream.quantize_model(source, SQ_DYNAMIC, tmp_path / "sq", stream.Calibration(calib, shared_stats=tmp_path / "s2"))
    covered = json.loads((tmp_path / "s2" / "complete.json").read_text())
    assert covered["kv_modules"] == []
    stream.quantize_model(source, FP8_STATIC_KV, tmp_path / "kv",
                          stream.Calibration(calib, shared_stats=tmp_path / "s2"))
    assert json.loads((tmp_path / "s2" / "complete.json").read_text())["kv_modules"]
