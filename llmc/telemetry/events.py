"""Pipeline events: the points where a build's work becomes durable, for whoever observes them.

Event names are stable (tests and listeners match them):
    file:<name>          a file llmc wrote is complete under its final name <name>: everything written through
                         llmc.storage.store's atomic writers (stage outputs, layer files, artifact files, reports,
                         manifests, registry files), the GGUF file, and each batch of spilled activations
    calibrate:written    the calibration windows are written (before the stage is marked complete)
    quantize:layer:<i>   layer i and the progress that records it are committed
    search:layer:<i>     quantization.search measured layer i's units on the calibration windows (a calibration
                         forward of its own; a build whose measurement is cached emits none)
    export:written       an artifact's files are written (before the stage is marked complete)
    eval:written         an evaluation's scores and metrics are written (likewise)
    publish:done         the registry entry is in place (or was already)
Nothing in llmc listens by default; the crash tests subscribe a listener that kills the process at one of them
(or at the n-th event of a build, anywhere), and a progress or telemetry sink could subscribe the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Listener = Callable[[str], None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> Listener:
    _listeners.append(listener)
    return listener


def unsubscribe(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(event: str) -> None:
    for listener in list(_listeners):
        listener(event)


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """No listener hears what happens inside: work that is not the build's (the planner's probe of the stream
    writes and commits a tiny model's layers) must not look like the build's own events."""
    saved = _listeners[:]
    _listeners.clear()
    try:
        yield
    finally:
        _listeners[:] = saved
