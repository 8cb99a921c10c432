"""Pipeline events: the points where a build's work becomes durable, for whoever observes them.

The build emits `quantize:layer:<i>` after layer i and its progress are committed, `export:written` once an
artifact's files are written (before the stage is marked complete) and `eval:written` likewise for an evaluation.
Nothing in llmc listens by default; the crash tests subscribe a listener that kills the process at one of them,
and a progress or telemetry sink could subscribe the same way.
"""

from __future__ import annotations

from collections.abc import Callable

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
