"""The planner's rate probes run for every scheme the recipe validator accepts."""

from __future__ import annotations

import pytest

from llmc.quant.numerics import quantize_rate
from llmc.quant.spec import TensorSpec


@pytest.mark.parametrize("group_size", [32, 48, 96, 192, 128, 320])
def test_the_quantizer_probe_takes_any_group_size(group_size: int) -> None:
    """48, 96 and 192 divide SmolLM2's widths but not 256: bb4e556's probe quantized a fixed 256 x 256 matrix and
    crashed `llmc plan` for them."""
    rate = quantize_rate(TensorSpec("int4", "group", group_size=group_size), "float32", elements=1 << 16)
    assert rate > 0


@pytest.mark.parametrize("spec", [TensorSpec("fp8_e4m3", "tensor"),  # static: the stored scale
                                  TensorSpec("int8", "token", dynamic=True),
                                  TensorSpec("fp8_e4m3", "group", group_size=128, dynamic=True),  # block-wise FP8
                                  TensorSpec("nvfp4", "group", group_size=16),  # under its global scale
                                  TensorSpec("mxfp4", "group", group_size=32, dynamic=True)])
def test_the_activation_emulation_probe_takes_every_activation_format(spec: TensorSpec) -> None:
    """The evaluation's cost times the torch engine's `fake_quantize` of each activation spec, on a width (SmolLM2's
    576) the block sizes must divide."""
    from llmc.quant.numerics import fake_quantize_rate

    assert fake_quantize_rate(spec, "float32", width=576, rows=8) > 0


# Bounded matmul probes (issue 50, item 2): a wide model's rate from small GEMMs and a saturating fit


def test_the_fit_never_extrapolates_a_rate_upward_past_the_fastest_measured() -> None:
    from llmc.planning.probes import saturating_rate

    rising = [(1e9, 80e9), (4e9, 120e9), (16e9, 160e9)]  # small GEMMs slower per FLOP: a fixed cost per call
    assert saturating_rate(rising, 1e12) == 160e9
    falling = [(1e9, 30e9), (4e9, 25e9), (16e9, 22e9)]  # operands leaving the cache: slower as the GEMM grows
    assert 22e9 < saturating_rate(falling, 8e9) < 25e9  # the fit's trend between the points...
    assert saturating_rate(falling, 1e12) == 22e9  # ...and never below the slowest measured
    assert saturating_rate([(1e9, 5e9)], 1e12) == 5e9
    # t = t0 + work / R exactly: read back inside the measured range
    exact = [(w, w / (0.01 + w / 100e9)) for w in (1e9, 2e9, 8e9)]
    assert saturating_rate(exact, 4e9) == pytest.approx(4e9 / (0.01 + 4e9 / 100e9))


def _fake_gemms(monkeypatch, peak: float, fixed_s: float) -> list[tuple[int, int, int]]:
    """The CPU's matmul probe timed as `fixed_s` per call plus its FLOPs at `peak` (not timed): the shapes it built."""
    from llmc.planning import machine, probes

    monkeypatch.setattr(probes, "_book", probes.RateBook())
    built: list[tuple[int, int, int]] = []

    def timer(dtype_name, device, width, rows, outputs=128):
        flops = 2.0 * rows * width * outputs

        def run_once() -> float:
            if (width, rows, outputs) not in built:  # the real timer makes its operands on its first run
                built.append((width, rows, outputs))
            return flops / (fixed_s + flops / peak)
        return run_once

    monkeypatch.setattr(machine, "_matmul_timer", timer)
    return built


def test_a_405b_width_is_probed_at_small_widths_and_read_from_their_fit(monkeypatch) -> None:
    """8a48c9f probed a [512, 16384] x [16384, 49152] GEMM (824 GFLOP over 3.2 GB of operands) for a 405B plan:
    minutes per timed run on a CPU, and a plan killed meanwhile cached nothing."""
    from llmc.planning import machine

    built = _fake_gemms(monkeypatch, peak=200e9, fixed_s=0.002)
    rate = machine.matmul_rate("bfloat16", "cpu", 16384, 512)
    assert built and max(w for w, _, _ in built) <= 8192 and all(w < 16384 for w, _, _ in built)
    assert all(2 * r * w * o / 200e9 <= 2 * machine.MAX_PROBE_CALL_S for w, r, o in built)  # each call bounded
    fastest_measured = max(2 * r * w * o / (0.002 + 2 * r * w * o / 200e9) for w, r, o in built)
    assert rate == pytest.approx(fastest_measured)  # capped at the fastest measured point, not the fit's 200e9
    widths = [w for w, _, _ in built]
    assert machine.matmul_rate("bfloat16", "cpu", 16384, 512) == rate and [w for w, _, _ in built] == widths


def test_a_slow_cpu_stops_at_the_smallest_width_and_a_small_model_is_probed_at_its_own(monkeypatch) -> None:
    from llmc.planning import machine

    built = _fake_gemms(monkeypatch, peak=2e9, fixed_s=0.0)  # a bf16 GEMM without bf16 instructions
    assert machine.matmul_rate("bfloat16", "cpu", 8192, 512) == pytest.approx(2e9)
    assert [w for w, _, _ in built] == [machine.CPU_PROBE_WIDTHS[0]]  # 1024 would take 1.6 s per call
    built.clear()
    machine.matmul_rate("float32", "cpu", 576, 512)  # SmolLM2: its own width, as before
    assert [w for w, _, _ in built] == [576]


def _recorded_probes(monkeypatch) -> list[str]:
    """Every key any RateBook measures (not read from its cache), in order; each measurement answered at once
    with a plausible rate (100 GFLOP/s for a matmul, else 1e9 per second) instead of being timed."""
    from llmc.planning import probes

    measured: list[str] = []
    real = probes.RateBook.probe

    def probe(self, key, run_once, repeats=probes.REPEATS, max_age_s=None):
        if key not in self.probes:
            measured.append(key)
            run_once = lambda: 1e11 if key.startswith("matmul") else 1e9  # noqa: E731
        return real(self, key, run_once, repeats, max_age_s)

    monkeypatch.setattr(probes.RateBook, "probe", probe)
    return measured


@pytest.mark.heavy
def test_a_cold_plan_of_a_big_recipe_measures_each_probe_once_and_only_those_its_costs_read(
        tmp_path, monkeypatch) -> None:
    """A cold 405B plan costs each stage three times (median, fastest, slowest) and reads the float32 rate again
    for its slow-dtype check: every probe is measured once, the keys measured are exactly those the costs read,
    and a second plan on the same cache measures nothing."""
    from pathlib import Path

    from llmc.planning import probes
    from llmc.planning.plan import plan_recipe
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    monkeypatch.delenv("LLMC_REPROBE", raising=False)
    monkeypatch.setattr(probes, "_book", probes.RateBook())
    measured = _recorded_probes(monkeypatch)
    path = Path(__file__).resolve().parents[2] / "recipes" / "llama405b-fp8-plan.yaml"
    store = Store(tmp_path / "cache")
    plan_recipe(load_recipe(path), store, path)
    assert len(measured) == len(set(measured)), measured
    assert set(measured) == set(probes.book().used), (measured, list(probes.book().used))
    assert probes.book().measured_now == measured
    kinds = {k.split()[0] for k in measured}
    assert {"matmul", "disk", "stream", "quantize"} <= kinds, kinds
    widths = [int(k.split("width=")[1].split()[0]) for k in measured if k.startswith("matmul")]
    assert max(widths) <= 8192  # the ladder, never the model's 16384
    measured.clear()
    monkeypatch.setattr(probes, "_book", probes.RateBook())  # a new process: reads the cache file
    plan_recipe(load_recipe(path), store, path)
    assert measured == []


def test_a_probe_stops_at_three_runs_that_agree_and_takes_all_five_when_they_scatter() -> None:
    from llmc.planning import probes

    book = probes.RateBook()
    quiet = iter([100.0, 104.0, 98.0, 500.0, 500.0])
    assert book.probe("quiet", lambda: next(quiet)).samples == (100.0, 104.0, 98.0)
    busy = iter([100.0, 60.0, 140.0, 95.0, 105.0])
    assert book.probe("busy", lambda: next(busy)).samples == (100.0, 60.0, 140.0, 95.0, 105.0)
    fixed = iter([1.0, 1.0, 1.0])
    assert book.probe("io", lambda: next(fixed), repeats=3).samples == (1.0, 1.0, 1.0)
    assert book.measured_now == ["quiet", "busy", "io"]


@pytest.mark.slow
def test_a_cold_405b_plan_is_bounded_and_a_killed_one_keeps_what_it_measured(tmp_path) -> None:
    """Real probes on a cold cache (not pinned). 8a48c9f: over 300 s for this plan, and a plan killed meanwhile left
    no rates. The bound is loose (a shared machine): the plan's own target is 30 s, docs/reliability.md."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from llmc.planning import probes

    repo = Path(__file__).resolve().parents[2]
    env = {**{k: v for k, v in os.environ.items() if k != "LLMC_REPROBE"}, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-m", "llmc", "plan", str(repo / "recipes" / "llama405b-fp8-plan.yaml"), "--cache-dir",
           str(tmp_path / "cache")]
    rates = tmp_path / "cache" / probes.RATES_FILE
    killed = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and killed.poll() is None:
        if rates.is_file() and len(json.loads(rates.read_text())["rates"]) >= 2:  # replaced whole: never torn
            break
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    kept = json.loads(rates.read_text())["rates"]
    assert len(kept) >= 2
    started = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    seconds = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(kept)} read from the cache" in r.stdout, r.stdout[-2000:]
    assert seconds < 120, seconds
    after = json.loads(rates.read_text())["rates"]
    assert all(len(after[k]["runs"]) == 1 for k in kept)  # not measured again
    # each CPU matmul point is probed only while one call of it stays short (machine._cpu_width_points): on an
    # AVX2 EPYC the ladder stops at 8192; on an AMX Xeon bf16 reaches 16384 (one 52-GFLOP call in ~0.2 s)
    from statistics import median

    from llmc.planning import machine

    calls = {k: machine._cpu_gemm_flops(int(k.split("width=")[1].split()[0]), int(k.split("rows=")[1].split()[0]))
             / median(s for run in after[k]["runs"] for s in run["samples"])
             for k in after if k.startswith("matmul") and " cpu " in k}
    assert calls and max(calls.values()) <= 2 * machine.MAX_PROBE_CALL_S, calls
