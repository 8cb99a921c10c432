"""Issue 44: plans for the machine the build will run on (`llmc plan --machine FILE_OR_PROFILE`, `llmc probe`), and
the disk's rates probed per machine instead of constants from one VM."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc import __version__
from llmc.cli import main
from llmc.planning import disk, probes, profiles, target
from tests.unit.test_plan_honest import pin_probes

REPO = Path(__file__).resolve().parents[2]
LLAMA70B = REPO / "recipes" / "llama70b-fp8.yaml"  # planned offline from its config.json: no weights here


@pytest.fixture(autouse=True)
def _own_rates():
    """Each test starts from a process-only rate book and leaves none behind for the next."""
    previous = probes._book
    probes._book = probes.RateBook()
    yield
    probes._book = previous


def _plan_json(args: list[str]) -> dict:
    result = CliRunner().invoke(main, ["--quiet", "plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# disk rates


def test_the_disk_probes_are_bounded_cached_and_leave_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    probes.use_cache(cache)
    start = time.perf_counter()
    write, read = disk.write_rate(), disk.read_rate()
    elapsed = time.perf_counter() - start
    assert write > 0 and read > 0
    # 3 runs of >= 0.1 s each, 64 MB per call: ~1 s quiet; bounded well inside issue 50's 30 s cold plan
    assert elapsed < 15, elapsed
    saved = json.loads((cache / probes.RATES_FILE).read_text())["rates"]
    assert len(saved[disk.WRITE_KEY]["runs"][0]["samples"]) == disk.REPEATS
    assert len(saved[disk.READ_KEY]["runs"][0]["samples"]) == disk.REPEATS
    assert [p.name for p in cache.iterdir()] == [probes.RATES_FILE]  # the probe's 64 MB file is gone
    # a warm cache: the next plan reads them, measures nothing
    monkeypatch.setattr(disk, "_timer", lambda which: lambda: pytest.fail(f"disk {which} measured again"))
    probes._book = probes.RateBook()
    probes.use_cache(cache)
    assert (disk.write_rate(), disk.read_rate()) == (write, read)
    # --reprobe measures them again (and pools the new runs with the cached ones)
    runs: list[str] = []
    monkeypatch.setattr(disk, "_timer", lambda which: lambda: runs.append(which) or 1e9)
    probes.use_cache(cache, reprobe=True)
    disk.write_rate(), disk.read_rate()
    assert runs == ["write"] * disk.REPEATS + ["read"] * disk.REPEATS
    saved = json.loads((cache / probes.RATES_FILE).read_text())["rates"]
    assert len(saved[disk.WRITE_KEY]["runs"]) == 2


def test_gigabyte_terms_follow_the_probed_disk_rates(monkeypatch) -> None:
    """A layer's read, its spilled activations and small files' fsync move with the disk's probed rates."""
    from llmc.planning import machine

    def at(read: float, write: float) -> tuple[float, float, float]:
        probes._book = probes.RateBook()
        pin_probes(monkeypatch, disk_read=(read,), disk_write=(write,))
        return machine.read_seconds(2e9), machine.spill_seconds(1e9), machine.file_write_seconds(1e6)

    fast, slow = at(2e9, 1e9), at(0.5e9, 0.25e9)
    assert fast[0] == pytest.approx(1.0) and slow[0] == pytest.approx(4.0)
    assert fast[1] == pytest.approx(1.5) and slow[1] == pytest.approx(6.0)
    assert slow[2] - fast[2] == pytest.approx(1e6 / 0.25e9 - 1e6 / 1e9)


# machine files and profiles


def test_a_probe_file_round_trips_and_answers_every_size_of_a_probe(tmp_path: Path, monkeypatch) -> None:
    pin_probes(monkeypatch, matmul=(4e9, 5e9, 6e9), disk_read=(1.2e9,), disk_write=(0.7e9,))
    out = tmp_path / "m.json"
    result = CliRunner().invoke(main, ["--quiet", "probe", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert (saved["kind"], saved["schema"], saved["llmc"]) == (target.KIND, target.SCHEMA, __version__)
    assert saved["host"]["cpu"] and saved["host"]["cpus"] and saved["measured_at"]
    assert saved["rates"][disk.READ_KEY] == [1.2e9] * disk.REPEATS
    m = target.load(str(out))
    assert not m.estimate and m.hostname == saved["host"]["hostname"]
    assert m.rates == saved["rates"]
    assert m.resolve(disk.WRITE_KEY) == (0.7e9,) * disk.REPEATS
    key = next(k for k in saved["rates"] if k.startswith("matmul float32 cpu"))
    assert m.resolve(key) == tuple(saved["rates"][key])  # a key it measured: its own runs
    # a width it did not measure: from the same dtype's measured points, within their rates
    other = m.resolve("matmul float32 cpu width=3000 rows=128 outputs=9000")
    assert len(other) == 1 and 4e9 <= other[0] <= 6e9
    # planning with it probes nothing here
    with target.planning_for(m):
        assert probes.book().describe() == ""
        assert disk.read_rate() == 1.2e9
    assert not isinstance(probes.book(), probes.FixedBook)  # the block's end restores this machine's
    # and a whole plan made with it measures nothing here and says whose rates it read
    monkeypatch.setattr(probes, "sustained_rate", lambda *a, **k: pytest.fail("a machine file's plan measured here"))
    plan = _plan_json([str(LLAMA70B), "--machine", str(out), "--cache-dir", str(tmp_path / "c2")])
    assert plan["estimates"]["machine"] == f"the machine {out}" and plan["estimates"]["device"] == "cpu"
    assert plan["rates"].startswith(f"rates of machine file {out}: measured on {saved['host']['hostname']}")


@pytest.mark.parametrize("content, says", [
    (None, "no such profile or machine file"),
    ("{not json", "not a machine file"),
    (json.dumps({"kind": target.KIND, "schema": target.SCHEMA, "llmc": "0.0.1", "rates": {}}), "written by llmc 0.0.1"),
    (json.dumps({"kind": target.KIND, "schema": 99, "llmc": __version__}), "schema 99"),
    (json.dumps({"kind": target.KIND, "schema": target.SCHEMA, "llmc": __version__, "rates": {"x": [-1]}}),
     "damaged machine file"),
])
def test_a_bad_or_foreign_machine_file_exits_2_naming_the_fix(tmp_path: Path, content, says) -> None:
    path = tmp_path / "machine.json"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(main, ["plan", str(LLAMA70B), "--machine", str(path),
                                       "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 2, result.output
    assert says in result.output and "llmc probe" in result.output
    assert not (tmp_path / "c").exists()  # refused before anything was planned


def test_a_profile_plans_the_70b_build_for_its_gpus_not_this_cpu(tmp_path: Path, monkeypatch) -> None:
    # every probe's timed run goes through sustained_rate: none may run here
    monkeypatch.setattr(probes, "sustained_rate", lambda *a, **k: pytest.fail("a profile's plan measured here"))
    plan = _plan_json([str(LLAMA70B), "--machine", "h100-sxm:8", "--cache-dir", str(tmp_path / "c")])
    est = plan["estimates"]
    assert est["device"] == "cuda:0" and est["machine"] == "the machine h100-sxm:8 (an estimate)"
    assert est["available_gb"] == pytest.approx(8 * profiles.PROFILES["h100-sxm"].host_memory_gb_per_gpu)
    assert "ESTIMATE from the spec sheet, not measured" in plan["rates"]
    quantize = next(r for r in est["stages"] if r["stage"].startswith("quantize"))
    assert quantize["device"] == "cuda:0" and quantize["gpu_gb"] > 0
    assert est["seconds"] < 3 * 3600  # hours at most, where a CPU plans it at tens to thousands
    assert not any("slower than float32" in w for w in plan["warnings"])  # no bf16-on-this-CPU warning


def test_a_profiles_gpu_memory_bounds_its_stages(tmp_path: Path) -> None:
    """The 70B's torch evaluation holds the whole bf16 model (~145 GB) on one GPU when the host has twice that (two
    H200s' 512 GB, eight B200s'): over an H200's 141 GB, inside a B200's 180 GB. The plan (offline: the source is not
    here) says so for the H200 only; one L40S's host (128 GB) streams the evaluation, one layer on the GPU."""
    h200 = _plan_json([str(LLAMA70B), "--machine", "h200:2", "--cache-dir", str(tmp_path / "c1")])
    b200 = _plan_json([str(LLAMA70B), "--machine", "b200:8", "--cache-dir", str(tmp_path / "c2")])
    l40s = _plan_json([str(LLAMA70B), "--machine", "l40s", "--cache-dir", str(tmp_path / "c3")])
    assert any("the machine h200:2 could not run the build" in w and "141.0 GB are free" in w
               for w in h200["warnings"]), h200["warnings"]
    for fits in (b200, l40s):
        assert not any("could not run the build" in w for w in fits["warnings"]), fits["warnings"]
    evals = [r for r in l40s["estimates"]["stages"] if r["stage"].startswith("eval torch")]
    assert evals and all(r["gpu_gb"] < 48 and r["strategy"].startswith("streamed") for r in evals)
    assert b200["estimates"]["seconds"] < l40s["estimates"]["seconds"]  # the faster GPU


def test_a_profile_gpu_count_must_be_a_number_and_its_rates_are_its_gpus() -> None:
    with pytest.raises(target.MachineError, match="GPU count"):
        target.load("h100-sxm:x")
    assert target.load("h200:4").gpu_count == 4 and target.load("h200").gpu_count == 1
    # a profile knows its GPUs, not its host's CPU: a CPU rate is refused with the way out, never guessed
    with pytest.raises(target.MachineError, match="GPUs' rates only") as refused:
        target.load("h100-sxm:8").resolve("matmul bfloat16 cpu width=8192 rows=512 outputs=24576")
    assert refused.value.exit_code == 2


def test_a_profile_plans_a_quantized_original_s_decode_on_its_host(tmp_path: Path, monkeypatch) -> None:
    """DeepSeek-R1 ships as FP8 block-wise codes: the stream decodes each layer's codes on the host, a rate a profile
    states as its host's assumption ("source decode", whatever the format) instead of refusing the plan."""
    monkeypatch.setattr(probes, "sustained_rate", lambda *a, **k: pytest.fail("a profile's plan measured here"))
    assert target.rate_class("source decode fp8-block") == target.rate_class("source decode gptq  4") == \
        "source decode"
    plan = _plan_json([str(REPO / "recipes" / "deepseek-r1-nvfp4.yaml"), "--machine", "h200",
                       "--cache-dir", str(tmp_path / "c")])
    quantize = next(r for r in plan["estimates"]["stages"] if r["stage"].startswith("quantize"))
    assert quantize["device"] == "cuda:0" and 0 < quantize["gpu_gb"] < 141
    # every weight decoded once at the profile's host rate: the layers' time cannot be less (they overlap the GPU)
    decoded = 671e9 / profiles.PROFILES["h200"].host_decode_elements_s
    assert 0.9 * decoded <= quantize["seconds"] <= 3 * decoded
