"""How the NCCL transport's ring exchanges are ordered with the caller's CUDA stream: events
reused from a pool, a posted exchange the caller's stream waits for, and one already enqueued
on that stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ENQUEUED", "EventPool", "Transfer"]


class Transfer:
    """A posted ring exchange; ``wait()`` makes the current stream (of the transport's GPU)
    wait for it.

    It holds the arrays until then: CuPy's pool could otherwise hand their memory to new work
    on the current stream while the transfer stream still reads or writes it. Its event goes
    back to the transport's pool once waited for (see ``EventPool``); a second ``wait()`` does
    nothing more.
    """

    __slots__ = ("_arrays", "_event", "_events", "_scope")

    def __init__(self, events: EventPool, scope: Callable[[], Any], event: Any,
                 arrays: tuple[Any, Any]) -> None:
        self._events, self._scope, self._event = events, scope, event
        self._arrays: tuple[Any, Any] | None = arrays

    def wait(self) -> None:
        event = self._event
        if event is None:
            return
        with self._scope():
            self._events.cuda.get_current_stream().wait_event(event)
        self._event = self._arrays = None
        self._events.give(event)


class EventPool:
    """CUDA events of the ring's exchanges, reused instead of made two per exchange.

    An event may be recorded again as soon as every ``wait_event`` on its last recording has
    been enqueued: cudaStreamWaitEvent waits for the recording current when it is called, not
    for a later one. So the "ready" event is recorded and waited for in one step (under a lock,
    so that no other thread records it in between), and a "done" event comes back with
    ``give`` only from ``Transfer.wait``, after its one wait was enqueued. At most ``keep`` idle
    events are kept; ``clear()`` drops them (close).
    """

    __slots__ = ("_idle", "_lock", "_ready", "cuda", "keep")

    def __init__(self, cuda: Any, keep: int = 8) -> None:
        self.cuda, self.keep = cuda, keep
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._ready: Any = None

    def order(self, before: Any, after: Any) -> None:
        """Make stream ``after`` wait for the work enqueued on stream ``before`` so far."""
        with self._lock:
            if self._ready is None:
                self._ready = self.cuda.Event(disable_timing=True)
            self._ready.record(before)
            after.wait_event(self._ready)

    def take(self) -> Any:
        """An event no pending wait refers to (made when none is idle)."""
        try:
            return self._idle.pop()
        except IndexError:
            return self.cuda.Event(disable_timing=True)

    def give(self, event: Any) -> None:
        """Return an event whose waits have all been enqueued."""
        if len(self._idle) < self.keep:
            self._idle.append(event)

    def clear(self) -> None:
        self._idle.clear()
        self._ready = None


class _Enqueued:
    """An exchange enqueued on the current stream: later work there already follows it."""

    __slots__ = ()

    def wait(self) -> None:
        pass


ENQUEUED = _Enqueued()
