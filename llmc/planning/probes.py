"""This machine's probed rates, each measured several times, summarized, and kept per machine across plans.

A probe (`matmul_rate`, the quantizer's `quantize_rate`) is one timed call of a few milliseconds to a second; on a
shared machine one call lands in a quiet or a busy moment, and two plans of one recipe two minutes apart once said
46 s and 12 min for a stage that took 315 s. So each probe is timed `REPEATS` times after a warm-up
(`SETTLED_REPEATS` when those agree within `SETTLED_SPREAD`), and the plan reads the **median**: a stage runs for
minutes through the machine's quiet and busy moments, and the median is what a typical moment delivers, where the
best of N is the one quiet moment (it predicts the machine as if nothing else ran, and a busy machine's stages then
overrun it). The fastest and the slowest run bound the plan's time range
(`reading`).

The samples are kept in `<cache>/machine-rates.json` with the machine they were measured on (CPU model and flags,
core count, torch threads, GPU name) and llmc's and torch's versions: a plan reads them instead of probing again
while they are younger than `MAX_AGE_S` and the machine is the same, so plans of one recipe agree with each other.
`llmc plan --reprobe` (or `LLMC_REPROBE=1`) measures every probe once more and **adds** its runs to the last
`POOLED_PROBES` probes' (older ones are dropped): the median is then taken over up to `POOLED_PROBES x REPEATS` runs
spread over the plans that made them, not over the two seconds one probe lasts, which a burst of another process's
work can fill (benchmarks/results/planner-log.md "Accuracy under load"). Deleting the file forgets them. Without a
cache folder (tests, a bare `make_plan`) the samples are kept for the process only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RATES_FILE = "machine-rates.json"
REPEATS = 5  # timed runs of each probe at most (after one warm-up)
# A probe stops after SETTLED_REPEATS runs when they lie within SETTLED_SPREAD of their median (max - min over the
# median): a quiet machine's runs agree, and two more would move neither the median nor the range's ends by more
# than that spread; a busy machine's runs scatter (0.1-0.8 at load 7-9 on the shared 2-core VM) and get all REPEATS.
SETTLED_REPEATS = 3
SETTLED_SPREAD = 0.10
POOLED_PROBES = 5  # the last probes of one key whose runs a plan reads together
MAX_AGE_S = 7 * 24 * 3600  # cached rates older than this are measured again
READINGS = ("median", "fastest", "slowest")
# Each timed run repeats its call until this long has passed. One call of a few milliseconds measures how soon the
# scheduler runs both of torch's threads on a busy machine, not the share of the CPU a stage lasting minutes gets (on
# the shared 2-core VM at load 13, single 4 ms matmuls read 0.8-149 GFLOP/s where the same GEMM sustained 2.3):
# docs/planner-constants.md#min_sample_s.
MIN_SAMPLE_S = 0.25


def sustained_rate(work: float, call: Callable[[], object], sync: Callable[[], None] = lambda: None,
                   min_s: float = MIN_SAMPLE_S) -> float:
    """`work` units per second of `call`, repeated until `min_s` has passed (`sync`: wait for a device to finish)."""
    sync()
    start, n = time.perf_counter(), 0
    while True:
        call()
        n += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return work * n / elapsed


@dataclass(frozen=True)
class Probe:
    """One probe's timed runs (rates, higher is faster), when they were measured, and whether this process did."""

    samples: tuple[float, ...]
    at: float  # time.time() of the measurement
    probed_now: bool

    def read(self, which: str) -> float:
        if which == "fastest":
            return max(self.samples)
        if which == "slowest":
            return min(self.samples)
        return statistics.median(self.samples)


@functools.cache
def fingerprint() -> dict:
    """What the rates depend on besides the probe's arguments: the CPU (model, instruction-set flags, cores), the
    threads torch uses, the GPU, and the software that runs the probes."""
    import torch

    from llmc import __version__

    model, flags = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cpu_flags": flags, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": gpu, "llmc": __version__, "torch": torch.__version__}


@dataclass
class RateBook:
    """The probes' samples: those read from the cache file (`path`, None: this process only) and those measured
    now. `used` records what the current plan read, for the plan's line saying where its rates came from."""

    path: Path | None = None
    reprobe: bool = False
    max_age_s: float = MAX_AGE_S
    probes: dict[str, Probe] = field(default_factory=dict)
    used: dict[str, Probe] = field(default_factory=dict)
    # per key, the cached probes' runs (samples, when), oldest first
    history: dict[str, list[tuple[tuple[float, ...], float]]] = field(default_factory=dict)
    # the keys this process measured, in order (each once: a key measured is kept in `probes`)
    measured_now: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.path is not None:
            self.history = self._read()
            if not self.reprobe:
                self.probes = {key: _pooled(runs, probed_now=False) for key, runs in self.history.items()}

    def _read(self) -> dict[str, list[tuple[tuple[float, ...], float]]]:
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # absent or unreadable: probed again and rewritten
        if not isinstance(saved, dict) or saved.get("machine") != fingerprint():
            return {}  # another machine, or another llmc or torch: none of its rates apply
        out = {}
        now = time.time()
        for key, entry in (saved.get("rates") or {}).items():
            runs = []
            entry = entry if isinstance(entry, dict) else {}
            # {"runs": [...]}; an older file's {"samples", "at"} is one probe
            for run in entry["runs"] if isinstance(entry.get("runs"), list) else [entry]:
                try:
                    samples = tuple(float(x) for x in run["samples"])
                    at = float(run["at"])
                except (KeyError, TypeError, ValueError):
                    continue
                if samples and all(x > 0 for x in samples) and 0 <= now - at <= self.max_age_s:
                    runs.append((samples, at))
            if runs:
                out[key] = sorted(runs, key=lambda r: r[1])[-POOLED_PROBES:]
        return out

    def probe(self, key: str, run_once: Callable[[], float], repeats: int = REPEATS,
              max_age_s: float | None = None) -> Probe:
        """The samples of probe `key` (`run_once` times one run and returns its rate), cached or measured now (and
        then pooled with the cached probes' runs). `max_age_s`: this key's runs are kept that long, where the book's
        `max_age_s` is too long for what it measures (the host's pace of the moment)."""
        found = self.probes.get(key)
        if found is not None and max_age_s is not None and not found.probed_now:
            fresh = self._runs(key, max_age_s)
            found = _pooled(fresh, probed_now=False) if fresh else None
        if found is None:
            run = (_timed_runs(run_once, repeats), time.time())
            self.measured_now.append(key)
            self.history[key] = [*self._runs(key, max_age_s), run][-POOLED_PROBES:]
            found = _pooled(self.history[key], probed_now=True)
            self.probes[key] = found
            self._write(key, run)
        self.used[key] = found
        return found

    def cached(self, key: str, max_age_s: float | None = None) -> bool:
        """Whether `key`'s samples are at hand (read from the cache or measured by this process; with `max_age_s`,
        as `probe` reads them: measured now or a cached run younger than that)."""
        found = self.probes.get(key)
        return found is not None and (max_age_s is None or found.probed_now or bool(self._runs(key, max_age_s)))

    def _runs(self, key: str, max_age_s: float | None) -> list[tuple[tuple[float, ...], float]]:
        """`key`'s runs at hand, only those younger than `max_age_s` where it is given."""
        now = time.time()
        return [r for r in self.history.get(key, []) if max_age_s is None or now - r[1] <= max_age_s]

    def _write(self, key: str, run: tuple[tuple[float, ...], float]) -> None:
        """Add one probe's runs to the file (read again first: another plan may have added others meanwhile)."""
        if self.path is None:
            return
        try:
            saved = json.loads(self.path.read_text())
            if not isinstance(saved, dict) or saved.get("machine") != fingerprint():
                saved = {}
        except (OSError, ValueError):
            saved = {}
        rates = saved.get("rates") if isinstance(saved.get("rates"), dict) else {}
        entry = rates.get(key) if isinstance(rates.get(key), dict) else {}
        runs = entry["runs"] if isinstance(entry.get("runs"), list) else [entry] if "samples" in entry else []
        runs = [*runs, {"samples": list(run[0]), "at": run[1]}][-POOLED_PROBES:]
        rates[key] = {"runs": runs}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:  # a cache that cannot be written costs a probe next time, never the plan
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"machine": fingerprint(), "rates": rates}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def describe(self) -> str:
        """Where the rates the current plan read came from: cached (when), probed now, or both."""
        if not self.used:
            return ""
        cached = [p for p in self.used.values() if not p.probed_now]
        now = len(self.used) - len(cached)
        parts = []
        if cached:
            oldest = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(min(p.at for p in cached)))
            parts.append(f"{len(cached)} read from the cache (measured since {oldest}; --reprobe measures them "
                         "again)")
        if now:
            parts.append(f"{now} probed now")
        where = f", kept in {self.path}" if self.path else ""
        runs = max(len(p.samples) for p in self.used.values())
        return f"rates of this machine (median of up to {runs} timed runs each{where}): {'; '.join(parts)}"


def _timed_runs(run_once: Callable[[], float], repeats: int) -> tuple[float, ...]:
    """`repeats` runs of `run_once`, or fewer once SETTLED_REPEATS of them agree within SETTLED_SPREAD."""
    samples: list[float] = []
    while len(samples) < repeats:
        samples.append(run_once())
        if len(samples) >= SETTLED_REPEATS and _spread(samples) <= SETTLED_SPREAD:
            break
    return tuple(samples)


def _spread(samples: Sequence[float]) -> float:
    """(fastest - slowest) / median of `samples`."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def _pooled(runs: list[tuple[tuple[float, ...], float]], *, probed_now: bool) -> Probe:
    """One probe of the runs of several: their samples together, dated by the newest."""
    return Probe(tuple(x for samples, _ in runs for x in samples), max(at for _, at in runs), probed_now)


@dataclass
class FixedBook(RateBook):
    """Another machine's rates (`llmc plan --machine`: a machine file or a named profile): `resolve` answers each
    probe's key from them, and nothing is measured here."""

    resolve: Callable[[str], tuple[float, ...]] = lambda key: ()
    label: str = ""

    def probe(self, key: str, run_once: Callable[[], float], repeats: int = REPEATS,
              max_age_s: float | None = None) -> Probe:
        found = self.probes.get(key)
        if found is None:
            found = Probe(tuple(self.resolve(key)), 0.0, probed_now=False)
            self.probes[key] = found
        self.used[key] = found
        return found

    def cached(self, key: str, max_age_s: float | None = None) -> bool:
        return True  # every key is read from the machine's rates, at any width (none is probed by parts)

    def describe(self) -> str:
        return f"rates of {self.label}: {len(self.used)} read from it, none probed here" if self.used else ""


_book: RateBook = RateBook()
_reading = "median"


def book() -> RateBook:
    return _book


@contextlib.contextmanager
def fixed(rates: FixedBook) -> Iterator[FixedBook]:
    """Within this block every probe reads `rates` (another machine's) and `use_cache` keeps them."""
    global _book
    previous, _book = _book, rates
    try:
        yield rates
    finally:
        _book = previous


def use_cache(folder: Path | None, *, reprobe: bool = False) -> RateBook:
    """Read and write the probes' samples in `folder` (the llmc cache; None: this process only). `reprobe` (or
    LLMC_REPROBE=1) ignores what is cached and measures every probe again. Under `fixed` (another machine's
    rates) nothing changes."""
    global _book
    if isinstance(_book, FixedBook):
        return _book
    reprobe = reprobe or os.environ.get("LLMC_REPROBE", "") not in ("", "0")
    path = Path(folder) / RATES_FILE if folder is not None else None
    if path != _book.path or reprobe:
        _book = RateBook(path, reprobe=reprobe)
    return _book


def reread() -> RateBook:
    """Read the cache file again, for rates another process measured meanwhile (a torchrun job's other ranks after
    rank 0 probed); nothing is measured again (not even under --reprobe, which that process has honoured)."""
    global _book
    if not isinstance(_book, FixedBook):
        _book = RateBook(_book.path)
    return _book


@contextlib.contextmanager
def reading(which: str) -> Iterator[None]:
    """Within this block every probe reads its `which` sample: "median" (the plan's point), "fastest" or
    "slowest" (the ends of its time range)."""
    global _reading
    if which not in READINGS:
        raise ValueError(f"unknown reading {which!r}: one of {READINGS}")
    previous, _reading = _reading, which
    try:
        yield
    finally:
        _reading = previous


def rate(key: str, run_once: Callable[[], float], repeats: int = REPEATS, max_age_s: float | None = None) -> float:
    """Probe `key`'s rate as the current `reading` reads it."""
    return measured(key, run_once, repeats, max_age_s).read(_reading)


def measured(key: str, run_once: Callable[[], float], repeats: int = REPEATS,
             max_age_s: float | None = None) -> Probe:
    """Probe `key`'s samples (cached or measured now), for a caller that reads them another way than `rate`."""
    return _book.probe(key, run_once, repeats, max_age_s)


def current_reading() -> str:
    return _reading


def saturating_rate(points: Sequence[tuple[float, float]], work: float) -> float:
    """The rate of one call doing `work` units, from rates measured at calls doing less: (work, rate) `points`.

    A call costs a fixed time plus its work at a sustained rate, t = t0 + work / R (least squares over the points'
    times, work / rate): the fixed part (dispatch, packing the operands, threads starting) is why small GEMMs run
    slower per FLOP. The answer stays within the measured rates: a rate still rising at the largest point is
    capped there (never extrapolated upward past what was measured), a falling one follows the fit but not below
    the slowest point (benchmarks/results/planner-log.md, "Probes")."""
    if not points:
        raise ValueError("no measured points")
    points = sorted(points)
    rates = [r for _, r in points]
    if len(points) == 1:
        return rates[0]
    works, times = [w for w, _ in points], [w / r for w, r in points]
    mean_w, mean_t = sum(works) / len(works), sum(times) / len(times)
    spread = sum((w - mean_w) ** 2 for w in works)
    per_unit = sum((w - mean_w) * (t - mean_t) for w, t in zip(works, times)) / spread if spread else 0.0
    predicted = mean_t + per_unit * (work - mean_w)
    if per_unit <= 0 or predicted <= 0:  # times not growing with the work: noise, not a trend to extrapolate
        return rates[-1]
    return min(max(rates), max(min(rates), work / predicted))
