"""The layer loop's disk work off its critical path (issue 31): each layer's durable writes run on one background
thread while the next layer computes (`LayerWriter`), and the next layer's weights are read while this one computes
(`Prefetcher`).

Bounds (what the quantize stage's plan counts, llmc.pipeline.quantize.quantize_cost): the writer holds the jobs of
one layer at most (its quantized tensors, and the next layer's inputs, which that layer reads anyway), so a layer's
codes are the only extra bytes; the prefetcher reads one layer ahead, one layer of weights in the checkpoint's dtype.

Crash safety is the writer's order: one thread runs the jobs in the order they were handed over, so a layer's file and
the next layer's inputs are durable before the job that moves progress.json runs; a kill -9 at any moment leaves
progress at a layer whose saved inputs are complete. A job's error (a full disk: the ResourceError of
llmc.storage.store's writers) is raised again in the loop's thread at its next hand-over or at `close`, and no later
job runs, so progress never passes a layer whose write failed.

Only host tensors may be handed over: the loop copies to the host with a blocking `.to("cpu")` (on a GPU that
returns once the copy is complete, so the writer never reads memory a kernel is still producing); `on_host` says
so where the tensors are handed over.

`overlap=False` runs every job in the caller's thread as it is handed over, and reads every layer when it is asked
for: the loop as it was, for measuring the overlap against (benchmarks/write_overlap.py) and under torchrun, where a
job's barriers are collectives that must not interleave with the loop thread's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

WRITER_THREAD = "llmc-layer-writer"


def on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`, checked to live on the host (what a background write may read)."""
    elsewhere = [n for n, t in tensors.items() if t.device.type != "cpu"]
    if elsewhere:
        raise RuntimeError(f"{len(elsewhere)} tensor(s) handed to the layer writer are not on the host "
                           f"({', '.join(elsewhere[:3])} on {tensors[elsewhere[0]].device}): copy them with "
                           ".to('cpu') first")
    return tensors


class LayerWriter:
    """Runs each layer's durable writes in order on one thread, at most one layer's jobs behind the caller."""

    def __init__(self, overlap: bool = True) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=WRITER_THREAD) if overlap else None
        self._pending: list[tuple[int, Future]] = []  # (layer, job) handed over and not yet seen finished
        self._failed = False  # set on the writer's thread by a failing job, before the next job starts there

    def submit(self, layer: int, job: Callable[[], None]) -> None:
        """Run `job` after every job handed over before it; first wait until no earlier layer's job is left (the
        bound), raising here the error of any job that failed."""
        if self._pool is None:
            job()
            return
        self._wait(lambda pending_layer: pending_layer < layer)
        self._pending.append((layer, self._pool.submit(self._run, job)))

    def close(self) -> None:
        """Wait for every job (raising the first error) and stop the thread."""
        if self._pool is not None:
            try:
                self._wait(lambda _: True)
            finally:
                self._pool.shutdown(wait=True)

    def _run(self, job: Callable[[], None]) -> None:
        if self._failed:  # an earlier write failed: nothing after it may run (progress would pass it)
            return
        try:
            job()
        except BaseException:
            self._failed = True
            raise

    def _wait(self, which: Callable[[int], bool]) -> None:
        while self._pending and which(self._pending[0][0]):
            _, job = self._pending.pop(0)
            error = job.exception()
            if error is not None:
                self._pending.clear()  # the jobs after it return without running
                raise error


class Prefetcher:
    """`take(i)`: layer i's weights; reading layer i+1's (the next of `order`) starts as it returns, on one thread."""

    def __init__(self, read: Callable[[int], dict[str, torch.Tensor]], order: Iterable[int], overlap: bool = True
                 ) -> None:
        self._read, self._order = read, list(order)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmc-weight-reader") if overlap else None
        self._ahead: tuple[int, Future] | None = None

    def take(self, index: int) -> dict[str, torch.Tensor]:
        if self._ahead is not None and self._ahead[0] == index:
            weights = self._ahead[1].result()
        else:
            weights = self._read(index)
        self._ahead = None
        position = self._order.index(index) if index in self._order else -1
        if self._pool is not None and 0 <= position < len(self._order) - 1:
            following = self._order[position + 1]
            self._ahead = (following, self._pool.submit(self._read, following))
        return weights

    def close(self) -> None:
        if self._pool is not None:
            self._ahead = None
            self._pool.shutdown(wait=True, cancel_futures=True)
