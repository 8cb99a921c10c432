"""Kill -9 anywhere, resume byte-identical, as a property: a build is SIGKILLed at the n-th event it emits
(llmc.telemetry.events: every file written atomically, calibration, each quantized layer, each export, each evaluation,
publication), for seeded random n across all stages; nothing half-written looks complete, and the rerun publishes
artifact files whose sha256 equal a clean build's. A few points run by default, many more under -m slow."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.publish.local import verify_entry
from tests.unit.build_helpers import (every_stage_recipe, nothing_half_written_looks_complete,
                                      published_artifact_hashes, small_corpus_file)

pytestmark = pytest.mark.heavy  # whole builds in child processes, killed and resumed

REPO = Path(__file__).resolve().parents[2]

# `llmc build` in a child that either records every event it emits, or SIGKILLs itself at the n-th.
_CHILD = """
import os, signal, sys
sys.path.insert(0, sys.argv.pop(1))
from llmc.telemetry import events
from tests.unit.build_helpers import use_corpus_file
use_corpus_file(sys.argv.pop(1))
mode, arg = sys.argv.pop(1), sys.argv.pop(1)
if mode == "record":
    log = open(arg, "w")
    events.subscribe(lambda event: (log.write(event + "\\n"), log.flush()))
elif "#" in arg:  # the k-th time the event `name` is emitted
    name, left = arg.rsplit("#", 1)
    left = [int(left)]

    def die_at_named(event):
        left[0] -= event == name
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    events.subscribe(die_at_named)
else:
    left = [int(arg)]

    def die_at_nth(event):
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    events.subscribe(die_at_nth)
from llmc.cli import main
main()
"""


def _build(root: Path, corpus: Path, mode: str, arg: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMC_PROGRESS_JSON": "0"}
    return subprocess.run([sys.executable, "-c", _CHILD, str(REPO), str(corpus), mode, arg, "build",
                           str(root / "recipe.yaml"), "--cache-dir", str(root / "cache")],
                          env=env, capture_output=True, text=True, timeout=600)


def _recipe(root: Path, model: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe.yaml").write_text(every_stage_recipe(model, root / "registry"))
    return root


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_model_session: Path) -> tuple[Path, list[str], dict[str, str]]:
    """(corpus file, the events of a clean build in order, its published artifact hashes)."""
    tmp = tmp_path_factory.mktemp("kill-anywhere")
    corpus = small_corpus_file(tmp / "corpus.json")
    root = _recipe(tmp / "clean", tiny_model_session)
    done = _build(root, corpus, "record", str(tmp / "events.txt"))
    assert done.returncode == 0, done.stderr
    events = (tmp / "events.txt").read_text().split()
    hashes = published_artifact_hashes(root / "registry")
    assert hashes
    return corpus, events, hashes


def test_the_build_emits_an_event_in_every_stage(clean) -> None:
    _, events, _ = clean
    for expected in ("file:tokens.safetensors", "calibrate:written", "file:b00000.safetensors", "quantize:layer:0",
                     "quantize:layer:1", "file:00001.safetensors", "file:model.safetensors", "file:model.gguf",
                     "export:written", "file:scores.safetensors", "eval:written", "file:manifest.json",
                     "publish:done", "file:report.md"):
        assert expected in events, expected
    order = [events.index(e) for e in ("calibrate:written", "quantize:layer:1", "export:written", "eval:written",
                                       "publish:done")]
    assert order == sorted(order)


def _kill_and_resume(n: int | str, root: Path, clean) -> subprocess.CompletedProcess:
    """Kill the build at its n-th event, or at the event named `n` ("name#k": its k-th emission), then rerun it."""
    corpus, events, hashes = clean
    at = n if isinstance(n, str) else f"event {n} ({events[n - 1]})"
    killed = _build(root, corpus, "kill", str(n))
    assert killed.returncode == -9, f"not killed at {at}: {killed.stderr[-2000:]}"
    assert nothing_half_written_looks_complete(root / "cache", root / "registry") == []
    resumed = _build(root, corpus, "kill", "0")  # 0: never
    assert resumed.returncode == 0, resumed.stderr
    assert published_artifact_hashes(root / "registry") == hashes, f"killed at {at}"
    entries = [e for e in (root / "registry").glob("*/*") if not e.name.startswith(".") and not e.parent.name.startswith(".")]
    assert len(entries) == 1 and verify_entry(entries[0]) == []
    return resumed


def test_killed_mid_quantize_resumes_at_the_next_layer(clean, tmp_path: Path, tiny_model_session: Path) -> None:
    # by name: the layer writer's thread emits its file events interleaved with the loop's differently from run to
    # run, so the clean build's position of "quantize:layer:0" can fall on an event before it (a flake in CI)
    resumed = _kill_and_resume("quantize:layer:0#1", _recipe(tmp_path, tiny_model_session), clean)
    assert "resuming quantization at layer 1" in resumed.stderr


NAMED = ["calibrate:written", "quantize:layer:1", "file:model.gguf", "export:written", "eval:written",
         "file:manifest.json", "publish:done"]


@pytest.mark.slow
@pytest.mark.parametrize("event", NAMED)
def test_killed_at_each_stage_resumes_identical(event: str, clean, tmp_path: Path, tiny_model_session: Path) -> None:
    _kill_and_resume(f"{event}#1", _recipe(tmp_path, tiny_model_session), clean)


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in range(1, 16)])
def test_killed_at_a_random_event_resumes_identical(seed: int, clean, tmp_path: Path, tiny_model_session: Path) -> None:
    n = random.Random(seed).randrange(len(clean[1])) + 1
    _kill_and_resume(n, _recipe(tmp_path, tiny_model_session), clean)


# --------------------------------------------------------------------------- killed during an overlapped write

# The quantize stage's layer loop alone (quicker than a build), its writes overlapped with the next layer's compute
# (llmc.quant.overlap): records each event with the thread that emitted it, or SIGKILLs itself at the k-th time an
# event is emitted (by name: events of two threads interleave differently from run to run).
_QUANTIZE_CHILD = """
import collections, os, signal, sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from llmc.model.source import ModelSource
from llmc.quant import stream
from llmc.quant.spec import Scheme, TensorSpec
from llmc.telemetry import events
model, out, spill, mode, arg = sys.argv[2:7]
if mode == "record":
    log = open(arg, "w")
    events.subscribe(lambda e: (log.write(f"{e} {threading.current_thread().name}\\n"), log.flush()))
elif mode == "kill":
    name, k = arg.rsplit("#", 1)
    seen = collections.Counter()

    def die(event):
        seen[event] += 1
        if event == name and seen[event] == int(k):
            os.kill(os.getpid(), signal.SIGKILL)

    events.subscribe(die)
scheme = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"), TensorSpec("fp8_e4m3", "tensor"))
ids = torch.randint(3, 200, (6, 24), generator=torch.Generator().manual_seed(0))
stream.quantize_model(ModelSource(Path(model), "t", "t"), scheme, Path(out), stream.Calibration(ids, batch_size=2, spill=spill),
                      stream.StreamOptions(on_layer_done=lambda i: events.emit(f"quantize:layer:{i}")))
"""


def _quantize_child(model: Path, out: Path, spill: str, mode: str, arg: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _QUANTIZE_CHILD, str(REPO), str(model), str(out), spill, mode, arg],
                          env={**os.environ, "LLMC_PROGRESS_JSON": "0"}, capture_output=True, text=True, timeout=600)


def _tree_hashes(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    """A 3-layer model, and per spill mode (run once, when first asked for): a clean run's files, and the events its
    writer thread emitted, each as `name#k` (its k-th emission)."""
    from llmc.quant.overlap import WRITER_THREAD
    from tests.conftest import make_tiny_model

    tmp = tmp_path_factory.mktemp("overlapped-kill")
    model = make_tiny_model(tmp / "model", layers=3)
    runs: dict[str, tuple[dict[str, str], list[str]]] = {}

    def clean(spill: str) -> tuple[dict[str, str], list[str]]:
        if spill not in runs:
            done = _quantize_child(model, tmp / f"clean-{spill}", spill, "record", str(tmp / f"events-{spill}.txt"))
            assert done.returncode == 0, done.stderr
            seen: dict[str, int] = {}
            on_writer = []
            for line in (tmp / f"events-{spill}.txt").read_text().splitlines():
                event, thread = line.split()
                seen[event] = seen.get(event, 0) + 1
                if thread.startswith(WRITER_THREAD):
                    on_writer.append(f"{event}#{seen[event]}")
            runs[spill] = (_tree_hashes(tmp / f"clean-{spill}"), on_writer)
        return runs[spill]

    return model, clean


def _writer_events(spill: str, default: str) -> list:
    """Every event of the writer's jobs in the 3-layer run: layer files, the next layer's inputs (in memory: written,
    then fsynced and renamed; none after the last layer, which has no next), progress, the layer-done report. One by
    default, all under -m slow."""
    per_layer = ["file:{i:05d}.safetensors#1", "file:progress.json#{n}", "quantize:layer:{i}#1"]
    with_inputs = [*per_layer[:1], "file:batches.safetensors#{n}", *per_layer[1:]] if spill == "never" else per_layer
    points = [e.format(i=i, n=i + 1) for i in range(3) for e in (with_inputs if i < 2 else per_layer)]
    return [pytest.param(spill, p, marks=() if p == default else pytest.mark.slow, id=f"{spill}-{p}") for p in points]


@pytest.mark.parametrize("spill, event", _writer_events("never", "file:batches.safetensors#2")
                         + _writer_events("always", "file:00001.safetensors#1"))
def test_killed_during_an_overlapped_write_resumes_identical(spill: str, event: str, overlapped,
                                                            tmp_path: Path) -> None:
    model, clean = overlapped
    hashes, on_writer = clean(spill)
    assert event in on_writer, f"{event} is not emitted on the writer's thread: {on_writer}"
    out = tmp_path / "out"
    killed = _quantize_child(model, out, spill, "kill", event)
    assert killed.returncode == -9, f"not killed at {event}: {killed.stderr[-2000:]}"
    resumed = _quantize_child(model, out, spill, "kill", "never#1")
    assert resumed.returncode == 0, resumed.stderr
    assert _tree_hashes(out) == hashes, f"killed at {event}"
    if event.startswith("quantize:layer:"):  # reported once progress has moved past that layer
        assert f"resuming quantization at layer {int(event.split(':')[2].split('#')[0]) + 1}/3" in resumed.stderr


# --------------------------------------------------------------------------- killed between two timed resume points

# The GPU path's layer loop (activations resident on a fake 80 GB GPU: tests/unit/fake_cuda.py), where a resume point
# is made only every `resume_every_s`: a clock that moves 5 s per read and an interval of 10 s make layer 1 a resume
# point and layer 2 not (the loop reads the clock at the start, at each layer's end, and after each resume point).
_RESIDENT_CHILD = """
import itertools, os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from llmc.model.source import ModelSource
from llmc.quant import stream
from llmc.quant.spec import Scheme, TensorSpec
from llmc.telemetry import events
from tests.unit.fake_cuda import fake_cuda
model, out, kill_at = sys.argv[2:5]
ticks = itertools.count(0.0, 5.0)
stream.time = type("Clock", (), {"monotonic": staticmethod(lambda: next(ticks))})
events.subscribe(lambda event: os.kill(os.getpid(), signal.SIGKILL) if event == kill_at else None)
scheme = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))
ids = torch.randint(3, 200, (6, 24), generator=torch.Generator().manual_seed(0))
with fake_cuda(total_memory=80 * 2**30):
    stream.quantize_model(ModelSource(Path(model), "t", "t"), scheme, Path(out), stream.Calibration(ids, batch_size=2),
                          stream.StreamOptions(device="cuda", resume_every_s=10.0,
                                               on_layer_done=lambda i: events.emit(f"quantize:layer:{i}")))
"""


def _resident_child(model: Path, out: Path, kill_at: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RESIDENT_CHILD, str(REPO), str(model), str(out), kill_at],
                          env={**os.environ, "LLMC_PROGRESS_JSON": "0"}, capture_output=True, text=True, timeout=600)


def test_killed_between_timed_resume_points_on_the_gpu_path_resumes_identical(tmp_path: Path) -> None:
    """kill -9 after layer 2 of 4, the last resume point after layer 1: the rerun redoes layers 2 and 3 from the inputs
    saved there (copied off the fake GPU) and writes the clean run's bytes; a kill loses the work since the last resume
    point, not more."""
    import json

    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "model", layers=4)
    clean = _resident_child(model, tmp_path / "clean", "never")
    assert clean.returncode == 0, clean.stderr[-3000:]
    loop = json.loads((tmp_path / "clean" / "quantized.json").read_text())["layer_loop"]
    assert loop["activations"] == "device" and loop["resume_every_s"] == 10.0  # the resident path, timed points

    killed = _resident_child(model, tmp_path / "out", "quantize:layer:2")
    assert killed.returncode == -9, killed.stderr[-3000:]
    state = tmp_path / "out" / "state"
    assert json.loads((state / "progress.json").read_text())["next_layer"] == 2  # layer 1's point, not layer 2's
    assert (state / "inputs-00002").exists() and not (state / "inputs-00003").exists()
    resumed = _resident_child(model, tmp_path / "out", "never")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming quantization at layer 2/4" in resumed.stderr
    assert _tree_hashes(tmp_path / "out") == _tree_hashes(tmp_path / "clean")
