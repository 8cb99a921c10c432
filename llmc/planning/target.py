"""The machine a plan is for, when it is not this one (`llmc plan --machine FILE_OR_PROFILE`).

A machine file is what `llmc probe` writes on the machine that will build: its probed rates (each probe's key and
timed runs, as llmc.planning.probes keeps them), its memory, CPU and GPUs, with the llmc version and file schema
that wrote it. A named profile (llmc.planning.profiles: `h100-sxm`, `h200:8`, ...) is a spec-sheet estimate of the
same. Planning for either, nothing is probed here: every probe key the plan asks for is answered from the target's
rates (`resolve`): the key itself, else the same probe measured at other sizes, else its rate class (a profile's
rates are per class).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llmc import __version__
from llmc.errors import RecipeError
from llmc.planning import probes, profiles

class MachineError(RecipeError):
    """`--machine` names no profile and no usable machine file (exit 2, as a recipe error)."""

    kind = "invalid --machine"


SCHEMA = 1  # the machine file's layout; a file of another schema or llmc version is refused (llmc probe again)
KIND = "llmc-machine"


@dataclass(frozen=True)
class TargetMachine:
    name: str  # the profile's name (with its GPU count) or the file's path
    estimate: bool  # a spec-sheet profile, not measured
    cpu: str
    cpu_flags: str
    cpus: int | None
    memory_bytes: int | None  # host memory available to the build
    gpu: str | None
    gpu_count: int
    gpu_memory_bytes: int | None  # per GPU, free for the build
    rates: dict[str, list[float]] = field(default_factory=dict)  # probe key or rate class -> timed runs
    hostname: str = ""
    measured_at: str = ""  # UTC date the file's rates were measured

    @property
    def device(self) -> str:
        return "cuda:0" if self.gpu_count else "cpu"

    def describe(self) -> str:
        """The plan's line naming the machine and how its numbers were had."""
        gpus = f"{self.gpu_count} x {self.gpu} ({(self.gpu_memory_bytes or 0) / 1e9:.0f} GB each)" \
            if self.gpu_count else "no GPU"
        host = f"{self.cpus} CPUs, {(self.memory_bytes or 0) / 1e9:.0f} GB host memory"
        if self.estimate:
            return (f"profile {self.name}: ESTIMATE from the spec sheet, not measured ({gpus}; {host}; "
                    f"llmc.planning.profiles states the efficiencies and the host assumed)")
        return f"machine file {self.name}: measured on {self.hostname} {self.measured_at} ({gpus}; {host})"

    def device_for(self, requested: str, key: str = "calibration.device") -> str:
        """The device the recipe's `key` names on this machine ("auto": its first GPU, if it has one)."""
        if requested == "auto":
            return self.device
        if requested.startswith("cuda") and not self.gpu_count:
            raise MachineError(f"{key} is '{requested}' but the machine {self.name} has no GPU",
                               fix=f"set {key}: auto (or cpu), or plan for a machine with a GPU "
                                   "(e.g. --machine h100-sxm:8)")
        return requested

    def book(self) -> probes.FixedBook:
        return probes.FixedBook(resolve=self.resolve, label=self.describe())

    def resolve(self, key: str) -> tuple[float, ...]:
        """The timed runs answering probe `key` on this machine (module doc); MachineError naming the key when none."""
        if key in self.rates:
            return tuple(self.rates[key])
        if key.startswith("matmul "):
            points = _matmul_points(self.rates, key)
            if points:
                return (probes.saturating_rate(points, _matmul_flops(key)),)
        cls = rate_class(key)
        if cls in self.rates:
            return tuple(self.rates[cls])
        same = [statistics.median(runs) for k, runs in self.rates.items() if rate_class(k) == cls and runs]
        if same:  # the same kind of probe at another size or spec: the median of them
            return (statistics.median(same),)
        probe = "run `llmc probe --out FILE RECIPE` on that machine with this recipe, and plan with --machine FILE"
        raise MachineError(f"the machine {self.name} has no rate for {key!r} (nor any {cls!r})",
                           fix=f"a profile has its GPUs' rates only: calibrate and evaluate on the GPU (device: "
                               f"auto), or {probe}" if self.estimate else probe)


_active: list[TargetMachine] = []


def active() -> TargetMachine | None:
    """The machine the current plan is for (`planning_for`), or None: this one."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def planning_for(machine: TargetMachine | None) -> Iterator[TargetMachine | None]:
    """Within this block plans are for `machine` (its memory, GPUs and rates; nothing probed here); None: this
    machine, as without the block."""
    if machine is None:
        yield None
        return
    _active.append(machine)
    try:
        with probes.fixed(machine.book()):
            yield machine
    finally:
        _active.pop()


def _params(key: str) -> dict[str, int]:
    return {k: int(v) for k, _, v in (p.partition("=") for p in key.split() if "=" in p) if v.isdigit()}


def _matmul_flops(key: str) -> float:
    p = _params(key)
    return 2.0 * p.get("rows", 1) * p.get("width", 1) * p.get("outputs", 1)


def _matmul_points(rates: dict[str, list[float]], key: str) -> list[tuple[float, float]]:
    """(FLOPs of one call, median rate) of the measured matmuls of `key`'s dtype and device: those of its own
    number of rows where there are any (a CPU's rate moves with them), else all."""
    head = key.split()[:3]
    same = {k: runs for k, runs in rates.items() if k.startswith("matmul ") and k.split()[:3] == head and runs}
    rows = _params(key).get("rows")
    same = {k: runs for k, runs in same.items() if _params(k).get("rows") == rows} or same
    return [(_matmul_flops(k), statistics.median(runs)) for k, runs in same.items()]


def rate_class(key: str) -> str:
    """The kind of rate a probe key measures, the device kind included: `matmul bfloat16 cuda`, `quantize cuda`,
    `fake_quantize cpu`, `stream layers`; keys with no size or device (sha256, the disk's) are their own class."""
    words = key.split()
    device = "cuda" if any(w.startswith("cuda") for w in words) else "cpu"
    if words[0] == "matmul":
        return f"matmul {words[1]} {device}"
    if words[0] in ("quantize", "fake_quantize"):
        return f"{words[0]} {device}"
    if words[0] == "score_logits":  # per logit element, whatever the vocabulary (llmc.engines.agreement)
        return f"score_logits {words[1]} {device}"
    if words[:2] == ["stream", "layers"]:
        return "stream layers"
    if words[:2] == ["source", "decode"]:  # a quantized original's decoder, whatever its format (host side)
        return "source decode"
    # an export's host work per layer count (llmc.formats: the config check's skeleton, torch.onnx's graph), any family
    if words[:2] in (["meta", "skeleton"], ["torch.onnx", "export"], ["onnxruntime-genai", "builder"]):
        return " ".join(words[:2] + [w for w in words if w.startswith("layers=")])
    if words[0] == "insert_qdq":  # the ONNX exporters' codes put into a graph, per weight element, any scheme
        return "insert_qdq"
    if words[1:2] == ["repack"]:  # a repacking exporter's codec (llmc.formats.files.repack_rate), any scheme
        return " ".join(words[:2])
    if words[1:2] == ["convert"]:  # an exporter's packing and check per element of one storage type (GGUF's ggml types)
        return " ".join(words[:3])
    return key


def host_work_seconds(seconds) -> float:
    """`seconds()` (a cost term read from a probe of the host's Python work: an export's skeleton or graph), or 0
    when planning for a named profile, whose spec sheet has no such rate (its plans are labelled estimates; a
    machine file from `llmc probe` has them)."""
    try:
        return seconds()
    except MachineError:
        machine = active()
        if machine is not None and machine.estimate:
            return 0.0
        raise


def per_layer_host_seconds(rate, config: dict, probe_layers: int) -> float:
    """Host seconds of work that grows with a model's depth, from `rate(config, layers)` (runs/s, probed on a tiny
    model of the family) at 1 and `probe_layers` layers: the 1-layer time plus each further layer at the probed
    difference (`host_work_seconds`: 0 for a named profile)."""
    def seconds() -> float:
        one = 1.0 / rate(config, 1)
        more = 1.0 / rate(config, probe_layers)
        per_layer = max(more - one, 0.0) / (probe_layers - 1)
        return one + per_layer * (max(int(config.get("num_hidden_layers") or 1), 1) - 1)

    return host_work_seconds(seconds)


def from_profile(spec: str) -> TargetMachine:
    """`name` or `name:COUNT` from llmc.planning.profiles."""
    name, _, count = spec.partition(":")
    p = profiles.PROFILES[name]
    if count and not (count.isdigit() and 1 <= int(count) <= 64):
        raise MachineError(f"--machine {spec}: the GPU count after ':' must be a number from 1 to 64",
                           fix=f"write e.g. --machine {name}:8")
    n = int(count or 1)
    return TargetMachine(name=f"{name}:{n}", estimate=True, cpu="(host of a GPU node: assumed)", cpu_flags="",
                         cpus=p.host_cpus_per_gpu * n, memory_bytes=int(p.host_memory_gb_per_gpu * n * 1e9),
                         gpu=p.gpu, gpu_count=n, gpu_memory_bytes=int(p.memory_gb * 1e9),
                         rates={k: [v] for k, v in profiles.rates(p).items()})


def load(spec: str) -> TargetMachine:
    """A named profile, or a machine file `llmc probe` wrote; RecipeError (exit 2) naming the fix otherwise."""
    if spec.partition(":")[0] in profiles.PROFILES:
        return from_profile(spec)
    path = Path(spec).expanduser()
    fix = f"run `llmc probe --out {path.name}` on the machine the build will run on, or name a profile: " \
          f"{', '.join(profiles.PROFILES)} (with a GPU count, e.g. h100-sxm:8)"
    if not path.is_file():
        raise MachineError(f"--machine {spec}: no such profile or machine file", fix=fix)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MachineError(f"--machine {spec}: not a machine file ({e})", fix=fix) from e
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise MachineError(f"--machine {spec}: not a machine file (no \"kind\": \"{KIND}\")", fix=fix)
    if data.get("schema") != SCHEMA or data.get("llmc") != __version__:
        raise MachineError(f"--machine {spec}: written by llmc {data.get('llmc')} (schema {data.get('schema')}); "
                           f"this is llmc {__version__} (schema {SCHEMA}), whose probes and rates differ",
                           fix=f"run `llmc probe --out {path.name}` again on that machine with this llmc")
    try:
        host, gpu = data["host"], data["gpu"]
        rates = {str(k): [float(x) for x in v] for k, v in data["rates"].items()}
        if any(not v or min(v) <= 0 for v in rates.values()):
            raise ValueError("a rate that is not positive")
        return TargetMachine(name=str(path), estimate=False, cpu=str(host["cpu"]), cpu_flags=str(host["cpu_flags"]),
                             cpus=host["cpus"], memory_bytes=host["memory_bytes"], gpu=gpu["name"],
                             gpu_count=int(gpu["count"]), gpu_memory_bytes=gpu["memory_bytes"], rates=rates,
                             hostname=str(host["hostname"]), measured_at=str(data["measured_at"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MachineError(f"--machine {spec}: a damaged machine file ({type(e).__name__}: {e})", fix=fix) from e


def this_machine(rates: dict[str, list[float]], memory_available: int | None) -> dict:
    """The machine file's content for this machine, these `rates` (probe key -> timed runs) and the host memory
    available to a build (bytes)."""
    import torch  # lazy: a plan for another machine never needs torch here

    fp = probes.fingerprint()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "kind": KIND, "schema": SCHEMA, "llmc": __version__, "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {"hostname": socket.gethostname(), "cpu": fp["cpu"] or platform.processor(),
                 "cpu_flags": fp["cpu_flags"], "cpus": os.cpu_count(), "memory_bytes": memory_available},
        "gpu": {"name": fp["gpu"], "count": count,
                "memory_bytes": torch.cuda.mem_get_info(0)[0] if count else None},
        "rates": {k: list(v) for k, v in sorted(rates.items())},
    }


def write(path: Path, content: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    os.replace(tmp, path)
