"""Data-parallel calibration and evaluation on torch.distributed (torchrun's rendezvous; gloo on CPU, NCCL on GPU).

Every rank holds the decoder layer being calibrated and its own contiguous block of the calibration windows
(`shard_bounds`). What a layer needs from the calibration tokens is a maximum or a sum over them, so the
ranks combine their partial statistics:
  - ranges (activation, channel, key/value absmax) by max: exact, whatever the order (`reduce_maxima`);
  - Hessians, AWQ's input means, Gram matrices and search losses by sum, each rank's part gathered and added in
    float64 in rank order 0, 1, ..., N-1 (`sum_in_rank_order`), so the result does not depend on which rank
    finished first. It can still differ from one process's sum in the last bits: one process adds the windows
    one after another in float32, here each rank adds its block and the blocks are added in float64.
A layer's quantization is computed once per group of Linears sharing an input, groups spread over the ranks
(`spread`), and every result is broadcast. Only rank 0 writes the stage's files (`is_main`).

Without torchrun's environment (WORLD_SIZE unset or 1) every function here is the identity / a no-op, so the
single-process path runs exactly as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

import llmc.errors
from llmc.errors import EXIT_CODES, LlmcError, ResourceError
from llmc.storage.resource_errors import resource_error

# Gather big tensors (a 70B down_proj Hessian is 28672² fp32 = 3.3 GB) this many elements at a time, so a
# rank holds world x chunk extra floats, not world x the whole tensor.
GATHER_CHUNK_ELEMENTS = 1 << 24
# How long a rank waits in a collective for the others (a layer's GPTQ/AWQ on one rank can take minutes).
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


# Bytes this rank received from the others, by collective (payload only; benchmarks/distributed_scaling.py reads it).
TRAFFIC: dict[str, int] = {}


def _count(kind: str, nbytes: float) -> None:
    TRAFFIC[kind] = TRAFFIC.get(kind, 0) + int(nbytes)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int


def world_from_env(env: dict[str, str] | None = None) -> World:
    """Rank, world size and local rank as torchrun sets them (RANK, WORLD_SIZE, LOCAL_RANK); one process without."""
    env = os.environ if env is None else env
    return World(rank=int(env.get("RANK", 0)), size=int(env.get("WORLD_SIZE", 1)),
                 local_rank=int(env.get("LOCAL_RANK", 0)))


def launched() -> bool:
    """Whether this process was started by torchrun as one of several ranks."""
    return world_from_env().size > 1


def init(device: torch.device | str = "cpu") -> World:
    """Join the process group torchrun set up (NCCL when `device` is a GPU, gloo otherwise); idempotent."""
    w = world_from_env()
    if w.size > 1 and not dist.is_initialized() and not _CLOSED:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(w.local_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return w


_CLOSED = False  # once the group is closed this process goes on alone (a build's rank 0 after quantize)


def destroy() -> None:
    global _CLOSED, _commands
    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the commands' one included
        _CLOSED, _commands = True, None


_ALONE = False  # inside `alone()`: this process acts as a world of one


def active() -> bool:
    """True inside an initialized process group of more than one rank (and not inside `alone()`)."""
    return not _ALONE and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within this block this process is a world of one: every function here answers as without torchrun and
    enters no collective. For work one rank does on its own while the others wait at a barrier (the planner's
    stream probe, llmc.quant.stream_probe, times a tiny `quantize_model` of its own, not the job's)."""
    global _ALONE
    previous, _ALONE = _ALONE, True
    try:
        yield
    finally:
        _ALONE = previous


def rank() -> int:
    return dist.get_rank() if active() else 0


def size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Rank 0: the one process that writes files and logs."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def shard_bounds(items: int, unit: int = 1, rank_: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[lo, hi) of this rank's contiguous block of `items`, cut on multiples of `unit` (the calibration batch,
    so each batch is computed as one process computes it); earlier ranks take the extra units."""
    rank_, world = (rank() if rank_ is None else rank_), (size() if world is None else world)
    units = -(-items // unit)
    per, extra = divmod(units, world)
    lo = rank_ * per + min(rank_, extra)
    hi = lo + per + (1 if rank_ < extra else 0)
    return min(lo * unit, items), min(hi * unit, items)


def _same_device_tensor(t: torch.Tensor) -> torch.Tensor:
    """NCCL reduces tensors on this rank's GPU; gloo on the CPU."""
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    if dist.get_backend() == "gloo" and t.device.type != "cpu":
        return t.cpu()
    return t


def reduce_maxima(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The element-wise maximum over ranks of each tensor (one collective for all of them): exact."""
    if not active() or not tensors:
        return list(tensors)
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    flat = _same_device_tensor(flat)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    _count("max", flat.numel() * 4 * 2 * (size() - 1) / size())  # a ring all-reduce's share
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].reshape(t.shape).to(device=t.device, dtype=t.dtype))
        at += t.numel()
    return out


def sum_in_rank_order(t: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Σ over ranks r of `t` (times `weights[r]`, in float64), added in rank order (the same bits whichever rank was
    first), returned in float64 on `t`'s device. `t` travels in its own dtype, `GATHER_CHUNK_ELEMENTS` at a time to
    bound the memory it takes."""
    if not active():
        return t.double()
    flat = _same_device_tensor(t.detach().reshape(-1))
    out = torch.empty(flat.numel(), dtype=torch.float64, device=flat.device)
    world = size()
    for start in range(0, flat.numel(), GATHER_CHUNK_ELEMENTS):
        chunk = flat[start : start + GATHER_CHUNK_ELEMENTS].contiguous()
        parts = [torch.empty_like(chunk) for _ in range(world)]
        dist.all_gather(parts, chunk)
        _count("sum", (world - 1) * chunk.numel() * chunk.element_size())
        w = weights or [1.0] * world
        total = parts[0].double() * w[0]
        for r in range(1, world):
            total = total + parts[r].double() * w[r]
        out[start : start + chunk.numel()] = total
    return out.reshape(t.shape).to(t.device)


def sum_float(x: float) -> float:
    """A Python float summed over ranks, in rank order, in float64."""
    if not active():
        return x
    return float(sum_in_rank_order(torch.tensor([x], dtype=torch.float64)))


def combine_running_means(mean: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """Each rank's running mean over its `count` rows (GPTQ's H = 2/n Σ x xᵀ) → the mean over every rank's rows,
    computed as Σ_r mean_r·n_r / Σ_r n_r in float64, returned in `mean`'s dtype."""
    if not active():
        return mean, count
    counts = [int(c) for c in gather_objects(count)]
    summed = sum_in_rank_order(mean, weights=[float(c) for c in counts])  # means travel in float32
    return (summed / max(sum(counts), 1)).to(mean.dtype), sum(counts)


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable; tensors are sent from the CPU), in rank order."""
    if not active():
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, _to_cpu(obj))
    out = [_from_wire(o) for o in out]
    _count("gather", sum(_tensor_bytes(o) for r, o in enumerate(out) if r != rank()))
    return out


def broadcast_object(obj, src: int = 0):
    """`obj` as rank `src` holds it, on every rank."""
    if not active():
        return obj
    box = [_to_cpu(obj) if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    if rank() != src:
        _count("broadcast", _tensor_bytes(box[0]))
    return _from_wire(box[0])


def computed_once(compute: Callable[[], object], src: int = 0):
    """`compute()` run on rank `src` only, its result broadcast to every rank."""
    if not active():
        return compute()
    return broadcast_object(compute() if rank() == src else None, src=src)


def spread(groups: Sequence[Sequence[str]], sizes: dict[str, int], compute: Callable[[list[str]], dict]) -> dict:
    """`compute(names)` for each group of names, the groups spread over the ranks (largest first, each to the rank
    with the least work so far), every rank's results broadcast: the union of all results on every rank."""
    if not active():
        return compute([n for g in groups for n in g])
    load = [0] * size()
    mine: list[str] = []
    for g in sorted(groups, key=lambda g: (-sum(sizes[n] for n in g), g[0])):
        r = min(range(len(load)), key=lambda i: (load[i], i))
        load[r] += sum(sizes[n] for n in g)
        if r == rank():
            mine += list(g)
    results: dict = {}
    for part in gather_objects(compute(mine) if mine else {}):
        results.update(part)
    return results


def moved(obj, device: torch.device | str):
    """`obj` (tensors in dicts, lists, tuples and dataclasses such as QuantizedWeight) with its tensors on `device`."""
    return _mapped(obj, lambda t: t.to(device))


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


@dataclass(frozen=True)
class _Bytes:
    """A tensor of a dtype plain pickle cannot rebuild (float8, float4: torch 2.13's all_gather_object fails on
    them), travelling as its bytes."""

    data: torch.Tensor  # uint8 view
    dtype: torch.dtype


def _unpicklable(t: torch.Tensor) -> bool:
    return t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool)


def _mapped(obj, fn: Callable[[object], object]):
    """`obj` with `fn` applied to each tensor / _Bytes in dicts, lists, tuples and dataclasses."""
    if isinstance(obj, (torch.Tensor, _Bytes)):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _mapped(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_mapped(v, fn) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return replace(obj, **{f.name: _mapped(getattr(obj, f.name), fn) for f in fields(obj)})
    return obj


def _to_cpu(obj):
    """`obj`'s tensors on the CPU, those of a one-byte float dtype as their bytes (`_from_wire` restores them)."""
    def encode(t):
        t = t.cpu()
        return _Bytes(t.contiguous().view(torch.uint8), t.dtype) if _unpicklable(t) else t

    return _mapped(obj, encode)


def _from_wire(obj):
    return _mapped(obj, lambda t: t.data.view(t.dtype) if isinstance(t, _Bytes) else t)


def reduce_layer_stats(stats, device: torch.device | str = "cpu") -> None:
    """Combine the ranks' `llmc.quant.observe.LayerStats` of one layer in place: ranges by max (exact), Hessians as
    token-weighted means summed in rank order, or with `stats.exact` (Mixture-of-Experts layers) chained through the
    ranks in window order (`chain_hessians`: one process's bits), over the union of the ranks' Linears. AWQ's
    recorded module calls stay per rank (its search reduces its own losses, `llmc.quant.algorithms.awq`).
    `device`: where a rank that holds no tensor of a key receives it."""
    if not active():
        return
    if stats.exact:
        _align_range_keys(stats, device)
    ranges = [(store, name) for store in (stats.channel_absmax, stats.key_absmax, stats.value_absmax)
              for name in sorted(store)]
    maxima = reduce_maxima([store[name] for store, name in ranges])
    for (store, name), m in zip(ranges, maxima):
        store[name] = m
    for name in sorted(stats.input_absmax):  # the observer's scalar is the channel maxima's max
        stats.input_absmax[name] = stats.channel_absmax[name].amax() if name in stats.channel_absmax else \
            reduce_maxima([stats.input_absmax[name]])[0]
    if stats.exact:
        chain_hessians(stats, device)
        return
    for key in sorted(stats.hessians):
        stats.hessians[key], stats.hessian_tokens[key] = combine_running_means(stats.hessians[key],
                                                                              stats.hessian_tokens[key])


def _align_range_keys(stats, device: torch.device | str) -> None:
    """Give every rank an entry for each Linear / attention module any rank observed (an MoE expert some rank's
    windows never reached has none there): zeros, which the maximum over ranks leaves exact. A module no rank
    observed stays absent, as in one process."""
    stores = (stats.channel_absmax, stats.key_absmax, stats.value_absmax)
    shapes = gather_objects([{n: tuple(t.shape) for n, t in store.items()} for store in stores])
    for i, store in enumerate(stores):
        for part in shapes:
            for name, shape in part[i].items():
                if name not in store:
                    store[name] = torch.zeros(shape, dtype=torch.float32, device=device)
    for name in stats.channel_absmax:
        stats.input_absmax.setdefault(name, stats.channel_absmax[name].amax())


def chain_hessians(stats, device: torch.device | str) -> None:
    """Each Hessian as one process accumulates it (`accumulate_hessian`, float32, call after call in window order),
    bit for bit: rank 0 accumulated its calls as they came; each later rank, in rank order, receives the running
    Hessian, replays its deferred calls (`stats.deferred`, its block of windows in order) on it and passes it on.
    Every rank ends with the same tensor; one d x d tensor travels per contributing rank."""
    from llmc.quant.algorithms.gptq import accumulate_hessian  # lazy: llmc.quant sits above this module

    mine = ({k: (n, stats.hessians[k].shape[-1]) for k, n in stats.hessian_tokens.items()} if rank() == 0 else
            {k: (sum(x.reshape(-1, x.shape[-1]).shape[0] for x in xs), xs[0].shape[-1])
             for k, xs in stats.deferred.items()})
    parts = gather_objects((mine, dict(stats.hessian_of)))
    for _, of in parts:
        for name, key in of.items():
            if stats.hessian_of.setdefault(name, key) != key:
                raise RuntimeError(f"{name} shares {key}'s Hessian on one rank and {stats.hessian_of[name]}'s on "
                                   "another")
    keys = sorted({k for counts, _ in parts for k in counts})
    for key in keys:
        width = next(counts[key][1] for counts, _ in parts if key in counts)
        hessian, seen = stats.hessians.get(key) if rank() == 0 else None, 0
        for r, (counts, _) in enumerate(parts):
            rows = counts.get(key, (0, 0))[0]
            if not rows:
                continue
            if r == rank() and r > 0:
                for x in stats.deferred[key]:
                    hessian, _ = accumulate_hessian(hessian, seen, x)
                    seen += x.reshape(-1, x.shape[-1]).shape[0]
            else:
                seen += rows
            hessian = broadcast_tensor(hessian if r == rank() else None, (width, width), src=r, device=device)
        stats.hessians[key], stats.hessian_tokens[key] = hessian, seen
    stats.deferred.clear()


def broadcast_tensor(t: torch.Tensor | None, shape: tuple[int, ...], src: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank `src`'s float32 tensor `t` (of `shape`) on every rank: on `t`'s device at `src`, on `device` elsewhere.
    Travels on the backend's device (NCCL: this rank's GPU; gloo: the CPU)."""
    if not active():
        return t
    if rank() == src:
        dist.broadcast(_same_device_tensor(t.contiguous()), src=src)
        return t
    box = _same_device_tensor(torch.empty(shape, dtype=torch.float32, device=device))
    dist.broadcast(box, src=src)
    _count("broadcast", box.numel() * box.element_size())
    return box.to(device)


def sum_counts(counts: dict[str, torch.Tensor]) -> None:
    """Integer counts (the tokens routed to each expert, by MoE block) summed over ranks in place: exact in any
    order. Every rank holds the same keys and shapes."""
    if not active() or not counts:
        return
    names = sorted(counts)
    flat = _same_device_tensor(torch.cat([counts[n].reshape(-1).long() for n in names]))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    at = 0
    for n in names:
        t = counts[n]
        counts[n] = flat[at : at + t.numel()].reshape(t.shape).to(device=t.device, dtype=t.dtype)
        at += t.numel()


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (every rank gets the same answer)."""
    if not active():
        return bool(flag)
    return bool(reduce_maxima([torch.tensor(float(bool(flag)))])[0] > 0)


def mean_abs_rows(chunks: list[torch.Tensor]) -> torch.Tensor:
    """`mean_rows` of |x| over the rows of every chunk ([..., d] each), without stacking them: each chunk's rows summed
    in float64 and the sums added, so the float64 total matches the stacked one's to ~1e-16 and rounds to the same
    float32 mean, and the peak is one chunk in float64 (AWQ at 8B width: 0.9 GB, not the 30 GB of a float64 copy of
    every down-projection input)."""
    total, count = None, 0
    for chunk in chunks:
        rows = chunk.reshape(-1, chunk.shape[-1])
        part = rows.abs().double().sum(dim=0)
        total = part if total is None else total + part
        count += rows.shape[0]
    if not active():
        return (total / max(count, 1)).float()
    return (sum_in_rank_order(total) / max(sum_float(float(count)), 1.0)).float()


def mean_rows(rows: torch.Tensor) -> torch.Tensor:
    """The mean over every rank's rows of `rows` [n, d], accumulated in float64 (rank sums added in rank order),
    returned in float32. One process accumulates in float64 too: AWQ's search is chaotic in its input mean (a
    1e-7 relative change of it moved a candidate's loss by 0.4% on a tiny model), so a float32 sum, whose
    rounding depends on how the rows are split, would give a different search on 1 and on N processes; in
    float64 both round to the same float32 mean."""
    if not active():
        return (rows.double().sum(dim=0) / max(rows.shape[0], 1)).float()
    total = sum_float(float(rows.shape[0]))
    return (sum_in_rank_order(rows.double().sum(dim=0)) / max(total, 1.0)).float()


def evenly_spaced_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """The rows at `count` evenly spaced positions (linspace, as AWQ's clip search samples them) of every rank's
    `rows` [n, d] stacked in rank order; all of them when there are at most `count`. The same rows one process
    holding every window would pick; only they travel."""
    if not active():
        return rows if rows.shape[0] <= count else rows[torch.linspace(0, rows.shape[0] - 1, count).long()]
    counts = [int(c) for c in gather_objects(rows.shape[0])]
    total, offset = sum(counts), sum(counts[: rank()])
    picked = torch.arange(total) if total <= count else torch.linspace(0, total - 1, count).long()
    local = picked[(picked >= offset) & (picked < offset + rows.shape[0])] - offset
    parts = gather_objects(rows[local.to(rows.device)])
    return torch.cat([p.to(rows.device) for p in parts])


# --------------------------------------------------------------------------- rank 0 leads, the others follow
# After the shared calibration rank 0 alone runs the rest of a build (exports, evaluations, gates, publishing) and
# calls the other ranks in for the work they share (scoring windows in an engine that splits them: llmc.engines.split).
# They wait in `follow` for its commands, which travel in a gloo group of their own: that wait may outlast the
# collectives' timeout (rank 0 exporting a 70B checkpoint, or running vLLM alone), and a rank that dies ends the job
# through torchrun anyway.

FOLLOW_TIMEOUT = timedelta(days=2)
_commands: dist.ProcessGroup | None = None
_command_open = False  # rank 0: a command was sent and the other ranks may still be inside it


class RankError(RuntimeError):
    """Another rank failed in a way llmc does not report on purpose (an internal error there: exit 70 here too)."""


def open_commands() -> None:
    """Every rank, at the same point: create the group commands travel in (a collective)."""
    global _commands
    if active() and _commands is None:
        _commands = dist.new_group(backend="gloo", timeout=FOLLOW_TIMEOUT)


def _send(command) -> None:
    dist.broadcast_object_list([command], src=0, group=_commands)


@contextlib.contextmanager
def leading(command: dict):
    """Rank 0: the other ranks (in `follow`) run `command` while this block runs its own part of it. An exception
    that leaves the block before every rank agreed on it (`agree`) may leave them inside a collective: then
    `release` does not call them again; this rank's exit ends the job (torchrun stops the others)."""
    global _command_open
    if not active():
        yield
        return
    _send(command)
    _command_open = True
    try:
        yield
    except BaseException as e:
        if getattr(e, "ranks_agreed", False):
            _command_open = False
        raise
    _command_open = False


def follow(handle: Callable[[dict], None]) -> None:
    """The ranks other than 0: run each command rank 0 sends (`leading`) with `handle`, until `release`. A failure
    every rank raised together (`agree`) ends that command only: rank 0 decides what it means for the build, as one
    process would. Anything else ends this process, and torchrun the job."""
    if not active():
        return
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=_commands)
        if box[0] is None:
            return
        try:
            handle(box[0])
        except Exception as e:
            if not getattr(e, "ranks_agreed", False):
                raise


def release() -> None:
    """Rank 0: let the followers return and close the process group; this process goes on alone. Not while one may
    still be inside a command that failed here: this rank's exit then ends the job."""
    if not active() or _command_open:
        return
    if is_main() and _commands is not None:
        _send(None)
    destroy()


def agree(failure: BaseException | None) -> None:
    """Every rank learns whether any rank failed (one all-gather). If one did, every rank raises, so the ranks stay in
    step: the failing rank its own exception, the others the same llmc error naming that rank (RankError for an
    unexpected one). The raised exceptions are marked `ranks_agreed`."""
    if not active():
        if failure is not None:
            raise failure
        return
    failed = [(r, d) for r, d in enumerate(gather_objects(_describe(failure) if failure is not None else None))
              if d is not None]
    if not failed:
        return
    if failure is not None:
        failure.ranks_agreed = True
        raise failure
    error = _mirror(*failed[0])
    error.ranks_agreed = True
    raise error


def _describe(e: BaseException) -> tuple[str, str, str | None]:
    """(llmc error class name or '', message, fix) of a failure, picklable."""
    e = e if isinstance(e, LlmcError) else (resource_error(e) or e)
    if isinstance(e, LlmcError):
        return type(e).__name__, e.message, e.fix
    return "", f"{type(e).__name__}: {e}", None


def _mirror(rank_: int, description: tuple[str, str, str | None]) -> Exception:
    name, message, fix = description
    cls = getattr(llmc.errors, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, llmc.errors.LlmcError):
        try:
            return cls(f"rank {rank_}: {message}", fix=fix)
        except TypeError:  # a class with another constructor
            pass
    return RankError(f"rank {rank_} failed: {message}")


def launch_local(nproc: int, argv: list[str]) -> None:
    """Run `python -m llmc ARGV` as `nproc` ranks on this node through torchrun's launcher (`--standalone`
    rendezvous), as `torchrun --standalone --nproc-per-node N -m llmc ARGV` does. Returns when every rank exited 0.

    A rank that fails ends the job (torchrun stops the others) and `launch_failure` says how. Finished layers are
    kept: the rerun resumes at the layer that was running."""
    # lazy: torchrun's launcher (torch.distributed.elastic), only for --nproc
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:  # torchrun's own entry point, minus its error-file wrapper: the failures come back here
        run(get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "llmc", *argv]))
    except ChildFailedError as e:
        raise launch_failure(e.failures, set(EXIT_CODES.values())) from None


class RankFailed(Exception):
    """A rank of a `launch_local` job exited with one of llmc's exit codes (it printed its message itself)."""

    def __init__(self, rank_: int, exit_code: int) -> None:
        super().__init__(f"rank {rank_} exited with code {exit_code}")
        self.rank, self.exit_code = rank_, exit_code


class JobFailed(Exception):
    """A rank died in a way llmc did not report itself (a signal, an unknown exit code): exit 70."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.message, self.fix = message, fix


RESUME_FIX = ("finished stages and layers are kept: run the same command again and it resumes where it "
              "stopped (at the layer that was running, or the evaluation)")


def launch_failure(failures: dict, llmc_codes: set[int]) -> Exception:
    """The error a failed job reports, from torchrun's {rank: ProcessFailure}: RankFailed with the rank's own code when
    llmc reported it, ResourceError (exit 4) for a rank killed by SIGKILL (most often the out-of-memory killer),
    JobFailed otherwise. Which rank's: one killed by SIGKILL first (the others' failures follow from losing it: a
    collective's peer gone), else the lowest; ranks ended by SIGTERM only when nothing else failed (torchrun sends
    it to the survivors, and they may be listed too)."""
    def cause(r: int) -> tuple[bool, bool, int]:
        signal_ = failures[r].signal_name() if failures[r].exitcode < 0 else ""
        return signal_ == "SIGTERM", signal_ != "SIGKILL", r

    rank_ = min(failures, key=cause)
    failure = failures[rank_]
    if failure.exitcode > 0 and failure.exitcode in llmc_codes:
        return RankFailed(rank_, failure.exitcode)
    if failure.exitcode < 0:
        what = f"rank {rank_} (pid {failure.pid}) was killed by {failure.signal_name()}"
        if failure.signal_name() == "SIGKILL":
            return ResourceError(f"{what}, most often by the out-of-memory killer; the job stopped",
                                 fix=f"{RESUME_FIX}; for less memory per rank use fewer --nproc or "
                                     "calibration.spill_activations: always")
        return JobFailed(f"{what}; the job stopped", RESUME_FIX)
    return JobFailed(f"rank {rank_} (pid {failure.pid}) exited with code {failure.exitcode}; the job stopped",
                     f"see that rank's output above; {RESUME_FIX}")
