"""Spans for a timeline: a hook that costs one global read when nothing listens.

The algorithms mark their phases with ``with trace.span("RING_REDUCE_SCATTER"): ...``. While no
tracer is set, :func:`span` returns one shared context manager that does nothing; while one is
set (:func:`set_tracer`), entering a span calls ``tracer.begin(label)`` and leaving it calls
``tracer.end(label)``, both on the thread that runs the span, so a tracer may tell threads apart.

Spans mark phases, never single messages: the ring runs them once or twice per call.

This module is in the bottom layer: it imports only the standard library.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Tracer", "get_tracer", "set_tracer", "span"]


class Tracer(Protocol):
    """What receives the spans: ``begin`` and ``end`` of a label, on the span's thread."""

    def begin(self, label: str) -> None:
        """A span labelled ``label`` starts on the calling thread."""

    def end(self, label: str) -> None:
        """The innermost span labelled ``label`` of the calling thread ends."""


class _Off:
    """The span while no tracer is set: enters and leaves without doing anything."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        return None


class _Span:
    """A span reported to the tracer that was set when it was made."""

    __slots__ = ("_label", "_tracer")

    def __init__(self, tracer: Tracer, label: str) -> None:
        self._tracer, self._label = tracer, label

    def __enter__(self) -> None:
        self._tracer.begin(self._label)

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self._tracer.end(self._label)


_OFF = _Off()
_tracer: Tracer | None = None


def set_tracer(tracer: Tracer | None) -> None:
    """Send the spans to ``tracer`` from now on (None: stop tracing).

    Args:
        tracer: an object with ``begin(label)`` and ``end(label)``, or None.

    Example::

        class Printer:
            def begin(self, label): print("begin", label)
            def end(self, label): print("end", label)

        trace.set_tracer(Printer())
        try:
            comm.allreduce(x)  # begin RING_REDUCE_SCATTER ... end RING_ALLGATHER
        finally:
            trace.set_tracer(None)
    """
    global _tracer
    _tracer = tracer


def get_tracer() -> Tracer | None:
    """The tracer the spans go to, or None."""
    return _tracer


def span(label: str) -> Any:
    """A context manager that reports ``label``'s begin and end to the tracer, if one is set.

    Args:
        label: what the span shows, e.g. ``"RING_ALLGATHER"``.

    Returns:
        A context manager; the one shared do-nothing manager when no tracer is set.

    Example::

        with trace.span("COMPRESS"):
            payload = encode(x)
    """
    tracer = _tracer
    if tracer is None:
        return _OFF
    return _Span(tracer, label)
