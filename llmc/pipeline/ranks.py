"""The torchrun coordination of a build, in one place (the collectives themselves are `llmc.distributed`).

Every rank runs the source and the calibration stage (rank 0 first: it writes them, the others find them in the
cache) and the quantize stages together (each rank calibrates its block of windows; rank 0 holds the stage's lock
and commits the folder once every rank is done). Rank 0 alone then exports, evaluates, runs the tasks, gates and
publishes; while it evaluates, the other ranks score the windows it hands them (`llmc.engines.split`) until it
releases them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import TypeVar

import torch

from llmc import distributed
from llmc.engines import engine_spec
from llmc.planning import probes
from llmc.errors import ResourceError
from llmc.telemetry.progress import log
from llmc.storage.store import Store

T = TypeVar("T")


class Share(Enum):
    """How a stage's work is shared by the ranks of a torchrun job."""

    MAIN_FIRST = "every rank, rank 0 first: it writes the output, the others find it in the cache"
    ALL = "every rank at once, each on its block of windows; rank 0 commits the output"
    MAIN = "rank 0 alone"
    HELPED = "rank 0, the other ranks scoring the windows it hands them"


def start(device: torch.device) -> None:
    """Join the torchrun job, when launched by one."""
    if distributed.launched():
        distributed.init(device)


def main_first(produce: Callable[[], T]) -> T:
    """`produce()` on rank 0 first (it writes the stage), then on the other ranks, which find it in the cache."""
    if distributed.is_main():
        out = produce()
        distributed.barrier()
        return out
    distributed.barrier()
    return produce()


def probed_once(plan: Callable[[], T]) -> T:
    """`plan()` (a plan that may probe this machine's rates) on rank 0 first: it measures the rates the cache lacks,
    each probe on its own (the stream probe's tiny `quantize_model` inside `distributed.alone`), and caches them as
    it goes; the other ranks wait, then read every rate from the cache (llmc.planning.probes) instead of probing
    while rank 0 does, or joining the probe's collectives with windows it does not split for them."""
    def on_this_rank() -> T:
        if not distributed.is_main():
            probes.reread()  # the rates rank 0 has just measured
        return plan()

    return main_first(on_this_rank)


def check_same_cache(found: bool, store: Store) -> None:
    """Every rank must see what rank 0 sees in the cache before a stage all of them run."""
    if distributed.active() and distributed.broadcast_object(found) != found:
        raise ResourceError(f"rank {distributed.rank()} and rank 0 see different contents in the cache {store.root}",
                            fix="under torchrun every rank needs the same cache folder: a filesystem shared by all "
                                "nodes (--cache-dir / $LLMC_CACHE)")


@contextlib.contextmanager
def producing_together(store: Store, stage: str, key: str) -> Iterator[Path]:
    """A resumable stage's work folder (`Store.produce`). Under torchrun rank 0 holds the stage's lock and the
    others work in the same folder; rank 0 commits it after every rank is done (the stream writes files on rank 0
    only)."""
    if not distributed.active():
        with store.produce(stage, key, resumable=True) as out:
            yield out
        return
    if distributed.is_main():
        with store.produce(stage, key, resumable=True) as out:
            distributed.broadcast_object(str(out))
            yield out
            distributed.barrier()
        distributed.barrier()  # committed: the others may look it up
        return
    out = Path(distributed.broadcast_object(None))
    yield out
    distributed.barrier()
    distributed.barrier()


def hand_over(helpers_score: bool) -> bool:
    """After the stages every rank runs: whether this rank goes on. Rank 0 goes on alone; with `helpers_score` (the
    build evaluates) the other ranks score when it asks until it releases them, and stop then."""
    if not distributed.active():
        return True
    distributed.barrier()
    if not helpers_score:
        distributed.destroy()
        return distributed.world_from_env().rank == 0
    from llmc.engines.split import follow_scoring

    distributed.open_commands()
    if distributed.is_main():
        return True
    follow_scoring()
    distributed.destroy()
    return False


def release() -> None:
    """Rank 0: the other ranks are no longer needed (they return from `hand_over`); idempotent."""
    distributed.release()


def log_scoring(runtimes: list[str]) -> None:
    """Under torchrun, once: which evaluation engines split the windows over the ranks and which run on rank 0."""
    if not distributed.active():
        return
    used = list(dict.fromkeys(e for r in runtimes for e in (engine_spec(r).baseline_engine, r)))
    splitting = [e for e in used if engine_spec(e).splits_over_ranks]
    alone = [e for e in used if e not in splitting]
    if splitting:
        log(f"eval: {', '.join(splitting)} scores the windows split over {distributed.size()} ranks")
    if alone:
        log(f"eval: {', '.join(alone)} runs on rank 0 alone (its own process); the other ranks wait")


def ranks_summing(sums_over_windows: bool) -> int | None:
    """The number of ranks when the result depends on how many added the windows' sums (their last bits), else
    None: it enters the quantize stage's key."""
    ranks = distributed.world_from_env().size
    return ranks if ranks > 1 and sums_over_windows else None


def is_main() -> bool:
    return distributed.is_main()


def run_stages(stages: Sequence, run: Callable[[object], None]) -> None:
    """`run(stage)` for each stage in order, as the ranks share them (`stage.share`): the stages every rank runs, then
    the hand-over to rank 0 (the other ranks return here, after scoring when rank 0 evaluates), then rank 0's, which
    releases the others after the last stage they help (or when one fails)."""
    together = [s for s in stages if s.share in (Share.MAIN_FIRST, Share.ALL)]
    alone = [s for s in stages if s not in together]
    for stage in together:
        if stage.share is Share.MAIN_FIRST:
            main_first(lambda: run(stage))
        else:
            run(stage)
    helped = [i for i, s in enumerate(alone) if s.share is Share.HELPED]
    if not hand_over(helpers_score=bool(helped)):
        return
    waiting = alone[:helped[-1] + 1] if helped else []  # the other ranks wait for commands until released
    try:
        for stage in waiting:
            run(stage)
    finally:
        release()
    for stage in alone[len(waiting):]:
        run(stage)
