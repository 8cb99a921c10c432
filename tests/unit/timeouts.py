"""A time limit for one case of a property-based test."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def alarm(seconds: int, what: str = "llmc plan") -> Iterator[None]:
    """A case that blocks (a FIFO opened for reading) fails the test instead of hanging the suite."""

    def fire(*_):
        raise TimeoutError(f"{what} did not finish in {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
