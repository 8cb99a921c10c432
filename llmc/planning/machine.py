"""This machine as the stages' costs see it: its memory and device (`Machine`), its probed matmul rates
(`matmul_rate`, measured at plan time or cached: llmc.planning.probes), the share of them a decoder layer's forward
reaches, its probed disk and hashing rates (`read_seconds`, `file_write_seconds`: llmc.planning.disk), and the sizes
the cost models take as constants (the process, a CUDA context).

The constants were measured on the development VM (2-core AVX2 EPYC); each one's measurement, command and spread is
in docs/planner-constants.md under its name.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.planning import disk, probes
from llmc.storage.direct_io import DIRECT_MIN_BYTES

PROCESS_BYTES = 0.40e9  # python, torch, transformers, tokenizers after a stage: docs/planner-constants.md#process_bytes
CUDA_CONTEXT_BYTES = 0.6e9  # a CUDA context and torch's kernels on the calibration GPU
# bytes/s a VM whose free pages go back to its host (`memory_from_host`) gets new memory when its host is short of
# it (0.24-0.37 GB/s measured, against ~4 GB/s when the host has it to hand), the slow end of every time range there
# (the point reads `host_memory_pace`): docs/planner-constants.md#reclaim_rate
RECLAIM_RATE = 0.33e9

# The cost model's time error per stage kind, (predicted - measured) / measured, lowest and highest measured at full
# width on the quiet development VM (benchmarks/results/planner-log.md, "Planner at full width" and the sections after
# it): quantize -21% (70B, whole stage) to +29% (8B, one layer); exports -52% (a hard-linked export after others'
# writeback) to +40%; evaluations -29% to +10%. Kinds not measured get the widest of these.
TIME_ERROR = {"quantize": (-0.21, 0.29), "export": (-0.52, 0.40), "eval": (-0.29, 0.10)}


@dataclass
class Machine:
    available: int | None  # host bytes available (MemAvailable)
    gpu_free: int | None  # bytes free on the calibration GPU (None: calibrating on the CPU)
    device: str  # "cpu" | "cuda:0"
    cpu_count: int | None = None
    # the share of the model's source files the page cache held when the plan was made (llmc.planning.disk.
    # resident_share; 0 for another machine's plan, and at the slow end of every range: evicted by the build)
    source_resident: float = 0.0


# The pages a stage gets first at memory speed on a VM whose free pages go back to its host: mostly those the stage
# before it freed seconds earlier, not yet reported (2.15 GB of 4.3 freed were still there 3-6 s after the free, 1.07
# GB after 24 s); its new memory past them comes at the host's pace (docs/planner-constants.md, HOST_POOL_BYTES)
HOST_POOL_BYTES = 2.0e9
# `host_memory_pace` first touches chunks of HOST_PACE_CHUNK until one comes at under half the first one's pace
# (past the pages freed in the last seconds, which come at memory speed), HOST_PACE_SKIP_MAX are touched or
# HOST_PACE_SKIP_MAX_S have passed (no such pages: the first chunk came at the host's pace already), then times
# chunks past them, each kept: up to ~4.6 GB for a few seconds, only where twice that is free
HOST_PACE_SKIP_MAX = 3 << 30
HOST_PACE_SKIP_MAX_S = 1.5
HOST_PACE_CHUNK = 256 << 20
HOST_PACE_MAX_AGE_S = 3600.0  # the host's pace moves with its other guests: probed again each hour
HOST_PACE_KEY = f"host memory pace chunk={HOST_PACE_CHUNK}"


def new_memory_seconds(new_bytes: float, pool: float, pace: float | None) -> float:
    """Seconds a stage allocating `new_bytes` on the host waits for its pages: what it needs beyond the `pool` it
    gets at memory speed, at `pace` bytes/s (0 where `pace` is None: not a VM paced by its host)."""
    return max(0.0, new_bytes - pool) / pace if pace else 0.0


def host_memory_pace() -> float | None:
    """Bytes/s at which this VM's host hands a process new pages past the recently freed ones (probed, cached for
    HOST_PACE_MAX_AGE_S; the fastest or slowest run within `probes.reading`), or None where the machine does not
    report its free pages to a host (`memory_from_host`) or has too little free memory to probe without evicting the
    page cache. One run touches a HOST_PACE_CHUNK past what the runs before it kept, so no run reuses another's pages.
    """
    if not memory_from_host():
        return None
    probing = not probes.book().cached(HOST_PACE_KEY, HOST_PACE_MAX_AGE_S)
    if probing and (memory_free() or 0) < 2 * (HOST_PACE_SKIP_MAX + probes.REPEATS * HOST_PACE_CHUNK):
        return None
    return probes.rate(HOST_PACE_KEY, _new_memory_timer(), max_age_s=HOST_PACE_MAX_AGE_S)


def _new_memory_timer():
    kept: list[torch.Tensor] = []

    def touched_chunk() -> float:
        """Bytes/s of one new chunk, kept (a freed one would be handed to the next at memory speed)."""
        start = time.perf_counter()
        kept.append(torch.ones(HOST_PACE_CHUNK, dtype=torch.uint8))
        return HOST_PACE_CHUNK / (time.perf_counter() - start)

    def run_once() -> float:
        if not kept:  # past the recently freed pages first
            started, first = time.perf_counter(), touched_chunk()
            while (len(kept) * HOST_PACE_CHUNK < HOST_PACE_SKIP_MAX
                   and time.perf_counter() - started < HOST_PACE_SKIP_MAX_S and touched_chunk() >= first / 2):
                pass
        return touched_chunk()

    return run_once


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    return _meminfo("MemAvailable")


def memory_free() -> int | None:
    """MemFree from /proc/meminfo in bytes: what is had without evicting the page cache (None where there is no
    such file)."""
    return _meminfo("MemFree")


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon"
VIRTIO_BALLOON_F_REPORTING = 5  # the virtio spec's feature bit: the guest reports its free pages to the host


def memory_from_host(devices: str = BALLOON_DEVICES) -> bool:
    """Whether this machine is a VM that reports its free pages to its host (a virtio balloon negotiated with free
    page reporting): the host takes them back, and a page touched again comes at the host's pace, which moves with
    the other guests' memory and which no counter in the guest shows (docs/planner-constants.md#reclaim_rate)."""
    try:
        for features in Path(devices).glob("*/features"):
            bits = features.read_text().strip()  # one '0'/'1' character per feature bit, bit 0 first
            if len(bits) > VIRTIO_BALLOON_F_REPORTING and bits[VIRTIO_BALLOON_F_REPORTING] == "1":
                return True
    except OSError:
        pass
    return False


def cpu_count() -> int | None:
    return os.cpu_count()


def matmul_rate(dtype_name: str, device: str = "cpu", width: int = 1024, rows: int = 64) -> float:
    """FLOP/s of a [rows, width] x [width, 3 x width] matmul in `dtype_name` on `device` (llmc.planning.probes:
    timed several times, cached per machine; the median, or the fastest or slowest run within `probes.reading`).
    `width` is the model's hidden size and `rows` the tokens of one forward (capped at 512): a CPU's float32 rate
    moves with the rows (memory-bound at few), bf16 without bf16 instructions hardly at all
    (benchmarks/forward_efficiency.py). On a CPU a width over CPU_DIRECT_PROBE_WIDTH is not probed at its size
    (`_cpu_width_points`)."""
    if device != "cpu":  # a GPU: a forward's own GEMM shape (one launch of a 128-column product is launch-bound)
        rows, outputs = max(GPU_PROBE_ROWS, min(rows, 4 * GPU_PROBE_ROWS)), width
        return probes.rate(f"matmul {dtype_name} {device} width={width} rows={rows} outputs={outputs}",
                           _matmul_timer(dtype_name, device, width, rows, outputs))
    # a forward's MLP GEMM (intermediate ~3x the width), most of a layer's FLOPs: a 128-column product ran at a
    # tenth of them on an AVX-512 VM (2.3 against 20-28 GFLOP/s at SmolLM2's width, benchmarks/results/planner-log.md
    # "Accuracy under load")
    rows = max(1, min(rows, 512))
    points = {w: _cpu_matmul_probe(dtype_name, w, rows) for w in _cpu_width_points(dtype_name, width, rows)}
    if width in points:
        return points[width].read(probes.current_reading())
    return probes.saturating_rate([(_cpu_gemm_flops(w, rows), p.read(probes.current_reading()))
                                   for w, p in points.items()], _cpu_gemm_flops(width, rows))


# A CPU's matmul probe at a model's own width only up to this; a wider model's rate comes from the widths
# CPU_PROBE_WIDTHS, each measured only while one call of it (predicted at the last width's median rate) takes at most
# MAX_PROBE_CALL_S, and extrapolated (probes.saturating_rate). At a 405B model's width (16384) one call is 824 GFLOP
# over 3.2 GB of float32 operands: minutes per timed run on a CPU (benchmarks/results/planner-log.md, "Probes").
CPU_DIRECT_PROBE_WIDTH = 1024
CPU_PROBE_WIDTHS = (512, 1024, 2048, 4096, 8192)
MAX_PROBE_CALL_S = 0.5
CPU_PROBE_OUTPUTS_PER_WIDTH = 3  # columns of the CPU's probe GEMM per unit of width


def _cpu_gemm_flops(width: int, rows: int) -> float:
    return 2.0 * rows * width * CPU_PROBE_OUTPUTS_PER_WIDTH * width


def _cpu_matmul_key(dtype_name: str, width: int, rows: int) -> str:
    return f"matmul {dtype_name} cpu width={width} rows={rows} outputs={CPU_PROBE_OUTPUTS_PER_WIDTH * width}"


def _cpu_matmul_probe(dtype_name: str, width: int, rows: int) -> probes.Probe:
    return probes.measured(_cpu_matmul_key(dtype_name, width, rows),
                           _matmul_timer(dtype_name, "cpu", width, rows, CPU_PROBE_OUTPUTS_PER_WIDTH * width))


def _cpu_width_points(dtype_name: str, width: int, rows: int) -> list[int]:
    """The widths the CPU's probe measures for a model of `width`: the width itself up to CPU_DIRECT_PROBE_WIDTH;
    above it the smallest of CPU_PROBE_WIDTHS, then each wider one (and the model's own width last) while its one
    call, at the median rate of the widest measured so far, takes at most MAX_PROBE_CALL_S. Which points that is
    depends only on cached or measured medians, so every reading of one plan (median, fastest, slowest) uses the
    same ones and probes nothing new. A rate cached at the model's own width is read as it is."""
    if width <= CPU_DIRECT_PROBE_WIDTH or probes.book().cached(_cpu_matmul_key(dtype_name, width, rows)):
        return [width]
    ladder = [w for w in CPU_PROBE_WIDTHS if w < width] + [width]
    points = [ladder[0]]
    for w in ladder[1:]:
        rate = _cpu_matmul_probe(dtype_name, points[-1], rows).read("median")
        if _cpu_gemm_flops(w, rows) / rate > MAX_PROBE_CALL_S:
            break
        points.append(w)
    return points


GPU_PROBE_ROWS = 4096  # tokens of a GPU's probe GEMM at least (a calibration batch is 4 x seq_len)


def _matmul_timer(dtype_name: str, device: str, width: int, rows: int, outputs: int = 128):
    """A function timing one [rows, width] x [width, outputs] matmul and returning its FLOP/s (the operands made and
    warmed up on first call)."""
    state: dict = {}

    def run_once() -> float:
        if not state:
            dtype = getattr(torch, dtype_name)
            dev = torch.device(device)
            state.update(dev=dev, a=torch.randn(rows, width, dtype=dtype, device=dev),
                         w=torch.randn(outputs, width, dtype=dtype, device=dev))
            torch.nn.functional.linear(state["a"], state["w"])  # warm-up: first-call dispatch
        dev = state["dev"]
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        return probes.sustained_rate(2 * rows * width * outputs,
                                     lambda: torch.nn.functional.linear(state["a"], state["w"]),
                                     sync)

    return run_once


HASH_PROBE_BYTES = 16 << 20


def hash_rate() -> float:
    """Bytes/s sha256 (hashlib) digests, as the store reads back and hashes what a stage wrote (its files are in
    the page cache then): CPU work, so probed like the matmul rate rather than taken as a constant."""
    return probes.rate("sha256", _hash_timer())


def _hash_timer():
    data: list[bytes] = []  # made on the first run: a cached rate never makes them

    def run_once() -> float:
        if not data:
            data.append(os.urandom(HASH_PROBE_BYTES))
        return probes.sustained_rate(HASH_PROBE_BYTES, lambda: hashlib.sha256(data[0]).digest())

    return run_once


IO_PROBE_BYTES = DIRECT_MIN_BYTES  # the smallest file the stages write around the page cache


def write_rate() -> float:
    """Bytes/s a stage's large file is written, made durable and hashed for the store's record: the store's own
    `atomic_save_safetensors` of IO_PROBE_BYTES into the cache's filesystem, timed (direct I/O where the filesystem
    allows it, llmc.storage.direct_io, else through the page cache and read back to hash)."""
    return probes.rate("write+sha256", _write_timer())


def file_write_seconds(nbytes: float, files: int = 1) -> float:
    """Seconds to write `nbytes` in `files` files of about equal size, durable and hashed: at the probed
    `write_rate` when each is large enough to be written around the page cache, else through it, made durable at
    the disk's probed write+fsync rate (llmc.planning.disk) and hashed from it."""
    if nbytes <= 0:
        return 0.0
    if _written_direct(nbytes, files):
        return nbytes / write_rate()
    return disk.write_seconds(nbytes) + nbytes / hash_rate()


def uncached_read_seconds(nbytes: float, files: int = 1) -> float:
    """Seconds to read `nbytes` in `files` files a stage wrote: those written around the page cache (large enough)
    are read from the disk at its probed rate (llmc.planning.disk); smaller ones are still in the page cache (not
    counted)."""
    return disk.read_seconds(nbytes) if nbytes > 0 and _written_direct(nbytes, files) else 0.0


def verify_seconds(nbytes: float, files: int = 1) -> float:
    """Seconds to check `nbytes` in `files` files a stage wrote against their recorded sha256 (Store.require_intact):
    large files are read around the page cache while the previous chunk is hashed (llmc.storage.direct_io.
    sha256_around_cache), so the slower of the two; small ones are copied out of the page cache, then hashed."""
    if nbytes <= 0:
        return 0.0
    read, hashed = mapped_read_seconds(nbytes, files), nbytes / hash_rate()
    return max(read, hashed) if _written_direct(nbytes, files) else read + hashed


def mapped_read_seconds(nbytes: float, files: int = 1, *, cached: bool = False) -> float:
    """Seconds to read `nbytes` in `files` files a stage wrote through a mapping, as an exporter reads the canonical
    form (safetensors' mmap): files written around the page cache (large enough) come from the disk unless `cached`
    (a reader since brought them into the page cache, and it kept them); the others, and cached ones, are copied out
    of the page cache at its probed rate."""
    if nbytes <= 0:
        return 0.0
    if _written_direct(nbytes, files) and not cached:
        return disk.read_seconds(nbytes)
    return nbytes / disk.cached_read_rate()


def read_seconds(nbytes: float) -> float:
    """Seconds to read `nbytes` of a source or stage file from the disk (not in the page cache), at the probed
    sequential read rate: a layer's weights, the weights outside the layers, an artifact to evaluate."""
    return disk.read_seconds(nbytes)


def source_read_seconds(nbytes: float, machine: Machine, converted_bytes: float = 0.0) -> float:
    """Seconds to read `nbytes` of the model's source on `machine`: its share the page cache holds from memory, the
    rest from the disk, into `converted_bytes` of another dtype in one pass where not 0
    (llmc.planning.disk.source_read_seconds)."""
    return disk.source_read_seconds(nbytes, machine.source_resident, converted_bytes)


def spill_seconds(nbytes: float) -> float:
    """Seconds to write `nbytes` of spilled activations and read them back (llmc.quant.activations' spill files),
    at the disk's probed rates."""
    return disk.write_seconds(nbytes) + disk.read_seconds(nbytes)


def _written_direct(nbytes: float, files: int) -> bool:
    """Whether `files` files of `nbytes` in all are each large enough for direct_io to write them."""
    return nbytes / max(files, 1) >= DIRECT_MIN_BYTES


def _probe_folder():
    """A temporary folder on the cache's filesystem (the rates file's), or the system's without a cache."""
    import tempfile

    where = probes.book().path
    try:
        if where is not None:
            where.parent.mkdir(parents=True, exist_ok=True)
            return tempfile.TemporaryDirectory(prefix=".llmc-io-probe-", dir=where.parent)
    except OSError:  # a cache that cannot be written yet: the plan says so elsewhere, the probe must not fail it
        pass
    return tempfile.TemporaryDirectory(prefix=".llmc-io-probe-")


def _write_timer():
    """A function timing one run of the store's write (atomic_save_safetensors + its sha256) and returning bytes/s.
    The 64 MB tensor and the folder are made on the first run and kept for the others (made anew each run, the
    random tensor alone took ~0.3 s of a ~1.2 s run here), and go after the last; a cached rate makes neither."""
    state: dict = {}

    def run_once() -> float:
        # lazy: the store imports filelock and the telemetry, which a plan with cached rates never needs
        from llmc.storage.store import atomic_save_safetensors, current_sha256

        if not state:
            folder = _probe_folder()
            state.update(folder=folder, path=os.path.join(folder.name, "probe.safetensors"),
                         tensors={"probe": torch.randint(0, 255, (IO_PROBE_BYTES,), dtype=torch.uint8)})

        def write() -> None:
            atomic_save_safetensors(state["path"], state["tensors"])
            current_sha256(state["path"])  # the store's record of it

        try:
            return probes.sustained_rate(IO_PROBE_BYTES, write)
        except BaseException:
            state.pop("folder").cleanup()
            state.clear()
            raise

    return run_once


def time_range(kind: str, fastest: float, slowest: float) -> tuple[float, float]:
    """What a stage predicted to take `fastest`..`slowest` seconds (at its probes' fastest and slowest runs) may
    take, given the cost model's measured error for its kind (TIME_ERROR): measured = predicted / (1 + error)."""
    under = min(lo for lo, _ in TIME_ERROR.values())
    over = max(hi for _, hi in TIME_ERROR.values())
    lo, hi = TIME_ERROR.get(kind, (under, over))
    return fastest / (1 + hi), slowest / (1 + lo)


def forward_efficiency(dtype_name: str, device: str) -> float:
    """Share of the probed rates (`forward_seconds`) a decoder layer's forward reaches: float32 less than bf16 on a
    CPU (its weights stream from memory at few tokens where the probe's stay in cache). Measured by
    benchmarks/forward_efficiency.py: docs/planner-constants.md#forward_efficiency (GPUs: not measured)."""
    if device != "cpu":
        return 0.6
    return 0.75 if dtype_name == "float32" else 1.0


def forward_seconds(gemm_flops: float, attention_flops: float, *, compute: str, device: str, width: int,
                    rows: int, efficiency: float | None = None) -> float:
    """Seconds of a forward's GEMMs (at the compute dtype's probed rate) and causal attention. On a CPU, attention
    runs at the float32 rate whatever the dtype: PyTorch's CPU attention kernel computes its blocks in float32
    (docs/planner-constants.md#forward_efficiency). `efficiency`: the share of those rates the forward reaches, where
    it was measured on a layer of the model's widths (llmc.quant.forward_probe); else `forward_efficiency`'s."""
    attention_dtype = "float32" if device == "cpu" else compute
    seconds = gemm_flops / matmul_rate(compute, device, width, rows)
    if attention_flops:
        seconds += attention_flops / matmul_rate(attention_dtype, device, width, rows)
    return seconds / (efficiency or forward_efficiency(compute, device))
