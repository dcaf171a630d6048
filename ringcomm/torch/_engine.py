"""One background thread per communicator that runs its collectives in submission order.

A Communicator runs one call at a time, and every rank must issue its collectives in the same
order. Asynchronous operations (Horovod's ``*_async``, gradient hooks that overlap backward) are
queued here and run one at a time, in the order they were submitted, on a single worker thread.
A synchronous call runs on the caller's thread when nothing is queued (no hand-off latency) and
otherwise waits its turn behind the queue. Either way the communicator sees one caller (see
:func:`ringcomm.comm.callers.calls_as`), the same on every rank: the engine's name, or the
one each submission names (each DDP hook state its own, so that two models' buckets that pair
in different orders on different ranks raise instead of mixing their data).

On the worker thread every task runs with the communicator's CUDA device current (not device
0, where a new thread starts), after the stream of the thread that submitted it: a
:class:`Handle` records, where it is made (on the submitting thread), a
:class:`~ringcomm.torch._tensors.StreamFence` that the worker waits for before the task.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.comm.callers import calls_as
from ringcomm.torch._tensors import StreamFence, device_scope

__all__ = ["Engine", "Handle", "engine_for"]


_HANDLES = threading.Lock()  # guards the lazy creation of a Handle's event


class Handle:
    """The pending result of a queued operation.

    Made on the thread that submits the operation, it records that thread's current CUDA
    stream (a :class:`~ringcomm.torch._tensors.StreamFence`, where it is not the default
    stream), so that the thread running the operation reads the data only after the work
    already queued on it.

    Args:
        device: the CUDA device of the operation's tensors (the current one when None).
    """

    __slots__ = ("_done", "_error", "_event", "_result", "callback", "fence", "on_wait")

    def __init__(self, device: Any = None) -> None:
        self._done = False
        # Made only when a thread has to block: most handles are done before anyone waits,
        # or done by the waiting thread itself (see ``on_wait``).
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        #: Called on the thread that finishes the handle, once it is done (set before
        #: submitting).
        self.callback: Callable[[Handle], None] | None = None
        #: Called by ``wait()`` on the waiting thread before it blocks: it may do the work
        #: itself (negotiation cycles) and return once the handle is done, or return at once.
        self.on_wait: Callable[[Handle], None] | None = None
        #: What the submitting thread's stream had queued (None: nothing to order after).
        self.fence: StreamFence | None = StreamFence.capture(device)

    def done(self) -> bool:
        """Whether the operation has finished (successfully or not); never blocks."""
        return self._done

    def wait(self) -> Any:
        """Block until the operation has finished; return its result or raise its error."""
        if not self._done:
            if self.on_wait is not None:
                self.on_wait(self)
            if not self._done:
                self._blocker().wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _blocker(self) -> threading.Event:
        # The event is stored before ``_done`` is read, and finish writes ``_done`` before
        # reading the event: one of the two sees the other, so the event is always set. The
        # lock keeps two waiters from making two events.
        with _HANDLES:
            if self._event is None:
                self._event = threading.Event()
                if self._done:
                    self._event.set()
            return self._event

    def finish(self, result: Any, error: BaseException | None) -> None:
        """Complete the operation with ``result`` or ``error`` (by whoever runs it: the
        coordinator or the engine), waking its waiters and calling its callback."""
        self._result, self._error = result, error
        self._done = True
        event = self._event
        if event is not None:
            event.set()
        if self.callback is not None:
            self.callback(self)


class Engine:
    """Runs the collectives of one communicator, queued ones on a single worker thread.

    Args:
        name: thread name, for stack dumps.
        device: returns the CUDA device the worker's tasks run under (the communicator's;
            None: leave the thread's current device as it is).
    """

    def __init__(self, name: str = "ringcomm-engine",
                 device: Callable[[], int | None] | None = None) -> None:
        self._name = name
        self._device = device
        self._queue: collections.deque[tuple[Callable[[], Any], Handle, str]] = \
            collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._callers = 0

    def new_caller(self, prefix: str) -> str:
        """A caller name of its own for a new submitter's collectives: ``prefix-k`` for the
        k-th asked for on this engine (so on its communicator)."""
        with self._cv:
            k, self._callers = self._callers, self._callers + 1
        return f"{prefix}-{k}"

    def submit(self, fn: Callable[[], Any], handle: Handle | None = None,
               caller: str | None = None) -> Handle:
        """Queue ``fn`` to run after everything submitted before it, its collectives made as
        ``caller`` (the engine's name by default); return its handle."""
        handle = Handle() if handle is None else handle
        with self._cv:
            if self._closed:
                raise RuntimeError("ringcomm.torch has been shut down")
            self._queue.append((fn, handle, caller or self._name))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return handle

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def run(self, fn: Callable[[], Any], caller: str | None = None) -> Any:
        """Run ``fn`` after everything queued, its collectives made as ``caller`` (the
        engine's name by default), and return its result (synchronous call)."""
        if threading.current_thread() is self._thread:
            return fn()  # an operation that runs another: it is already its turn
        with self._cv:
            inline = not self._queue and not self._busy and not self._closed
            if inline:
                self._busy = True
        if not inline:
            return self.submit(fn, caller=caller).wait()
        try:
            with calls_as(caller or self._name):
                return fn()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def execute(self, fn: Callable[[], Any], *, overlap: bool,
                handle: Handle | None = None, caller: str | None = None) -> Handle:
        """Run ``fn`` in the background (``overlap``) or right here, its collectives made as
        ``caller`` (the engine's name by default); return its handle.

        Either way an error is kept in the handle, raised by ``wait()``, not here.
        """
        if overlap:
            return self.submit(fn, handle, caller)
        handle = Handle() if handle is None else handle
        try:
            result, error = self.run(fn, caller), None
        except Exception as err:
            result, error = None, err
        handle.finish(result, error)
        return handle

    def close(self) -> None:
        """Finish what is queued, then stop the worker thread. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._queue and not self._busy) or
                                  (self._closed and not self._queue))
                if not self._queue:
                    return
                fn, handle, caller = self._queue.popleft()
                self._busy = True
            try:
                with calls_as(caller), device_scope(self._device_of()):
                    if handle.fence is not None:
                        handle.fence.wait()
                    result, error = fn(), None
            except BaseException as err:  # handed to whoever waits on the handle
                result, error = None, err
            with self._cv:
                self._busy = False
                self._cv.notify_all()
            handle.finish(result, error)

    def _device_of(self) -> int | None:
        return None if self._device is None else self._device()


_ENGINES: weakref.WeakKeyDictionary[Any, Engine] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _device_of(comm: Communicator) -> Callable[[], int | None]:
    """The communicator's CUDA device, asked each time (the MPI backend selects its device
    with the first device array); a weak reference, so the engine does not keep it alive."""
    ref = weakref.ref(comm)

    def device() -> int | None:
        c = ref()
        return None if c is None else c.cuda_device

    return device


def engine_for(comm: Communicator) -> Engine:
    """The engine of ``comm`` (one per communicator, shared by every adapter that uses it);
    its worker runs every task with the communicator's CUDA device current."""
    with _LOCK:
        engine = _ENGINES.get(comm)
        if engine is None or engine.closed:
            engine = _ENGINES[comm] = Engine(device=_device_of(comm))
        return engine
