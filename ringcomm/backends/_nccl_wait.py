"""Bounded host waits for an NCCL communicator's GPU work: polled, never a blocking sync.

A host thread waiting in ``cudaStreamSynchronize`` cannot be interrupted: when a peer dies,
NCCL's kernels spin and the wait never returns (under torchrun no ``MPI_Abort`` rescues the
job). The NCCL backend therefore waits by recording a CUDA event and polling it
(``cudaEventQuery``), asking NCCL between polls whether the communicator has failed
(``ncclCommGetAsyncError``). On a failure, or once the communicator's timeout has passed, the
waiter aborts the communicator (``ncclCommAbort``: its kernels return, its peers are not waited
for) and raises :class:`NCCLAsyncError` or
:class:`~ringcomm.core.types.CollectiveTimeoutError` naming the collective, the peer where one
is known, and NCCL's own words.

Making a communicator (``ncclCommInitRank``, ``ncclCommSplit``) blocks until every rank has
joined, and there is nothing to abort yet: :func:`bounded_start` runs it on a thread of its own
and waits for it at most the timeout.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from ringcomm.backends._nccl_lib import IN_PROGRESS, NCCLError
from ringcomm.comm.transport import timeout_error, write_fatal
from ringcomm.core.log import get_logger
from ringcomm.core.types import CollectiveError, CollectiveTimeoutError

__all__ = ["NCCLAsyncError", "Stall", "Watchdog", "bounded_start", "end_job", "failure",
           "poll", "wait_for_stream"]

_LOG = get_logger("nccl")

# The first polls come quickly (a collective that is nearly done costs little more than a
# synchronize), then the pause doubles up to 1 ms: a long wait costs no core, and a failure
# or the timeout is seen within about a millisecond.
_FIRST_PAUSE_S = 20e-6
_MAX_PAUSE_S = 1e-3


class NCCLAsyncError(CollectiveError, RuntimeError):
    """NCCL reported that a communicator failed (``ncclCommGetAsyncError``) while this rank
    waited for its GPU work; the communicator was aborted and refuses further calls.

    Attributes:
        kind: the collective ("allreduce", "barrier", ...).
        peer: the rank waited for where one is known, else None.
        code: NCCL's ncclResult_t (2: system error, 3: internal error, 6: remote error, ...).
        nccl_error: NCCL's error string and last error.
    """

    def __init__(self, message: str, *, kind: str = "", peer: int | None = None,
                 code: int = 0, nccl_error: str = "") -> None:
        super().__init__(message, kind=kind)
        self.peer = peer
        self.code = int(code)
        self.nccl_error = nccl_error


class Stall(NamedTuple):
    """Why a polled wait gave up."""

    code: int  # the ncclResult_t NCCL reported; 0 when the timeout passed first
    elapsed: float  # seconds waited


def poll(done: Callable[[], bool], async_error: Callable[[], int], timeout: float, *,
         clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], Any] = time.sleep) -> Stall | None:
    """Poll ``done()`` until it is true (None) or NCCL reports an error or ``timeout`` passes.

    Args:
        done: whether the awaited work has completed (``event.done``: cudaEventQuery).
        async_error: the communicator's ``ncclCommGetAsyncError`` (0 or ``IN_PROGRESS`` while
            healthy).
        timeout: seconds to wait at most (``math.inf``: no limit; errors still end the wait).
        clock, sleep: time sources (tests pass their own).

    Returns:
        None when the work completed, else the Stall saying why the wait ended.
    """
    start = clock()
    pause = _FIRST_PAUSE_S
    while not done():
        code = async_error()
        if code not in (0, IN_PROGRESS):
            return Stall(code, clock() - start)
        elapsed = clock() - start
        if elapsed >= timeout:
            return None if done() else Stall(0, elapsed)
        sleep(min(pause, timeout - elapsed))
        pause = min(2 * pause, _MAX_PAUSE_S)
    return None


def failure(t: Any, stall: Stall, what: str, peer: int | None, timeout: float,
            describe: Callable[[int], str]) -> CollectiveError:
    """The error of a wait of NCCL transport ``t`` that ``stall`` ended.

    Args:
        t: the transport (its ``operation``, ``rank`` and ``size`` name the call).
        stall: what ended the wait.
        what: the step waited for ("barrier", "close", ...).
        peer: the rank waited for, where one is known.
        timeout: the communicator's timeout in seconds.
        describe: NCCL's words for a result code (``NCCLComm.describe``).
    """
    kind = t.operation or what
    aborted = "the NCCL communicator was aborted (ncclCommAbort) and refuses further calls"
    if stall.code:
        text = describe(stall.code)
        waited = "the other ranks" if peer is None else f"rank {peer}"
        step = "" if what == kind else f" ({what})"
        culprit = "a rank" if peer is None else f"rank {peer}"
        return NCCLAsyncError(
            f"{kind} failed on rank {t.rank} of {t.size} after {stall.elapsed:.1f} s waiting "
            f"for {waited}{step}: {text}. {culprit} may have exited, or the network failed; "
            f"{aborted}", kind=kind, peer=peer, code=stall.code, nccl_error=text)
    base = timeout_error(t, what, peer, stall.elapsed, timeout)
    return CollectiveTimeoutError(f"{base}. NCCL reported no error meanwhile; {aborted}",
                                  kind=base.kind, peer=peer, elapsed=stall.elapsed,
                                  timeout=timeout)


class Watchdog:
    """The failure state of one NCCL transport: its bounded waits, the abort, the refusal.

    Args:
        t: the transport (``operation``, ``rank``, ``size``, ``timeout``,
            ``abort_on_timeout`` and ``device_scope()`` are read from it).
        comm: its NCCLComm (``async_error``, ``describe``, ``abort``).
        device: its CUDA device.
        launcher: the rendezvous kind ("mpi", "store", "local"), for ending the job.
    """

    __slots__ = ("__weakref__", "_lock", "_t", "comm", "device", "failure", "held", "launcher")

    def __init__(self, t: Any, comm: Any, device: int, launcher: str) -> None:
        self._t, self.comm, self.device, self.launcher = t, comm, device, launcher
        #: The error that aborted the communicator, or None while it is usable.
        self.failure: CollectiveError | None = None
        #: Whether the communicator was left to an NCCL call that never returned (give_up)
        #: rather than aborted.
        self.held = False
        self._lock = threading.Lock()
        _LIVE.add(self)

    @property
    def timeout(self) -> float:
        return self._t.timeout

    def close(self) -> None:
        """Stop watching (the transport is closed)."""
        _LIVE.discard(self)

    def check(self) -> None:
        """Raise RuntimeError if the communicator was aborted."""
        failure = self.failure
        if failure is not None and self.held:
            raise RuntimeError(
                "the NCCL communicator is held by an NCCL call that never returned, and refuses "
                f"every call: close it and end the job ({type(failure).__name__}: {failure})")
        if failure is not None:
            raise RuntimeError(
                "the NCCL communicator was aborted after an earlier failure, and refuses "
                f"every call: close it and end the job (it failed with "
                f"{type(failure).__name__}: {failure})")

    def wait_stream(self, stream: Any, what: str, peer: int | None = None) -> None:
        """Block until the work enqueued on CuPy ``stream`` so far is done, polling the stream
        and NCCL's asynchronous error; abort and raise (or end the job) on an error or after
        the timeout."""
        event = stream.record()
        stall = poll(lambda: event.done, self.comm.async_error, self._t.timeout)
        if stall is not None:
            self.fail(stall, what, peer)

    def abort(self, error: CollectiveError) -> None:
        """``ncclCommAbort`` because of ``error``, once; every later call is refused. Never
        raises (NCCL refusing the abort is logged).

        The abort frees the communicator's device memory, which waits for the work already
        queued on the device: NCCL's own kernels return when aborted, but other work (a kernel
        of the application's that never ends) would hold the abort, and this thread, for ever.
        So the abort runs on a thread of its own and is waited for at most the timeout; then
        the caller goes on (raises, or ends the job) and the abort finishes when it can."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
        self._t.fail(error)  # what was prepared over it goes (the transport's callbacks)
        aborting = threading.Thread(target=self._abort_comm, args=(error,), daemon=True,
                                    name="ringcomm-nccl-abort")
        aborting.start()
        aborting.join(self._t.timeout)
        if aborting.is_alive():
            _LOG.error("ncclCommAbort has not returned %.3g s after %s: other work queued on "
                       "CUDA device %d holds it (it frees device memory); going on without "
                       "it", self._t.timeout, type(error).__name__, self.device)

    def give_up(self, error: CollectiveError) -> None:
        """Refuse every later call because of ``error``, without aborting: a thread is still
        inside an NCCL call on this communicator (a split that a peer never joined), and an
        abort or a destroy under that call would free what it uses. The communicator is left
        to it (``close`` frees nothing of NCCL's after a failure)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure, self.held = error, True
        self._t.fail(error)

    def _abort_comm(self, error: CollectiveError) -> None:
        try:
            with self._t.device_scope():  # it frees the communicator's device memory
                self.comm.abort()
        except NCCLError as err:
            _LOG.error("ncclCommAbort failed after %s: %s", error, err)

    def fail(self, stall: Stall, what: str, peer: int | None) -> NoReturn:
        """Abort because of ``stall``; then end the job (``abort_on_timeout``) or raise."""
        t = self._t
        error = failure(t, stall, what, peer, t.timeout, self.comm.describe)
        self.abort(error)
        _LOG.error("%s", error)
        if t.abort_on_timeout:
            write_fatal(error, "Ending the job.")
            end_job(self.launcher)
        raise error


# Every open transport's watchdog, for the bounded waits outside the transports.
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def wait_for_stream(stream: Any, device: int, what: str = "a wait for the GPU") -> None:
    """Block until the work enqueued on CuPy ``stream`` (of CUDA device ``device``) so far is
    done: polled where NCCL communicators are open on that device, so that a dead peer ends
    the wait with an error (as the transports' own waits do) instead of hanging the host.

    Args:
        stream: a ``cupy.cuda.Stream``.
        device: its CUDA device.
        what: the step, for the error message.

    Raises:
        NCCLAsyncError, CollectiveTimeoutError: an open communicator on ``device`` failed, or
            the wait outlasted the shortest timeout among them (every one of them is aborted
            then: which one holds the stream back cannot be told).
    """
    live = [w for w in list(_LIVE) if w.device == device and w.failure is None]
    if not live:
        stream.synchronize()
        return
    event = stream.record()
    failing: list[Watchdog] = []

    def async_error() -> int:
        for w in live:
            code = w.comm.async_error()
            if code not in (0, IN_PROGRESS):
                failing.append(w)
                return code
        return 0

    timeout = min(w.timeout for w in live)
    stall = poll(lambda: event.done, async_error, timeout)
    if stall is None:
        return
    if failing:
        failing[0].fail(stall, what, None)
    for w in live[1:]:
        w.abort(failure(w._t, stall, what, None, timeout, w.comm.describe))
    live[0].fail(stall, what, None)


def bounded_start(make: Callable[[], Any], scope: Callable[[], Any], t: Any, kind: str,
                  what: str, abort_on_timeout: bool, launcher: str) -> Any:
    """Make an NCCL communicator (``make``: ``ncclCommInitRank`` or ``ncclCommSplit``, which
    block until every rank of the new communicator has joined) within ``t.timeout``.

    A rank that died after the unique id was shared would hold the others in NCCL's bootstrap
    for ever, and no communicator exists yet to abort. So ``make`` runs on a thread of its own
    (under ``scope()``, which makes the transport's GPU current there: CUDA's current device
    is per thread) and is waited for at most the timeout. Then this rank ends the job
    (``abort_on_timeout``) or raises; a communicator that NCCL completes after that is
    aborted on that thread, and one that never completes leaves the thread blocked in NCCL.

    Args:
        make: the blocking creation; returns the new NCCLComm.
        scope: a context making the GPU current.
        t: what names the call in the error (``rank``, ``size``, ``world_ranks``,
            ``world_size``, ``operation``; ``timeout`` in seconds).
        kind, what: the call ("init", "split") and the NCCL step ("ncclCommInitRank").
            The bound covers the whole creation (NCCL's own setup too, well under a second on
            one node), as the timeout bounds the rendezvous' exchanges before it.
        abort_on_timeout: end the job at the timeout (True) or raise.
        launcher: the rendezvous kind, for ending the job.

    Raises:
        CollectiveTimeoutError: the timeout passed first (``abort_on_timeout=False``).
        NCCLError: NCCL refused (raised as ``make`` raised it).
    """
    lock, done = threading.Lock(), threading.Event()
    box: dict[str, Any] = {}  # "outcome": (made, NCCLComm or error); "given_up": the wait ended

    def run() -> None:
        try:
            with scope():
                outcome: tuple[bool, Any] = (True, make())
        except BaseException as err:
            outcome = (False, err)
        with lock:
            box["outcome"] = outcome
            late = box.get("given_up", False)
        done.set()
        made, result = outcome
        if late and not made:
            _LOG.warning("%s failed after the timeout: %s", what, result)
        elif late:
            _LOG.warning("%s completed after the timeout; its communicator is aborted", what)
            try:
                with scope():
                    result.abort()
            except NCCLError as err:
                _LOG.error("ncclCommAbort of a communicator made late: %s", err)

    start = time.monotonic()
    threading.Thread(target=run, daemon=True, name=f"ringcomm-nccl-{kind}").start()
    try:
        done.wait(min(t.timeout, threading.TIMEOUT_MAX))
    finally:  # also where the wait is interrupted: a communicator made later is then aborted
        with lock:
            outcome = box.get("outcome")
            box["given_up"] = outcome is None
    if outcome is not None:
        made, result = outcome
        if not made:
            raise result
        return result
    base = timeout_error(t, what, None, time.monotonic() - start, t.timeout, kind=kind)
    error = CollectiveTimeoutError(
        f"{base}. NCCL's communicator was not made: {what} still waits in NCCL",
        kind=kind, peer=None, elapsed=base.elapsed, timeout=t.timeout)
    _LOG.error("%s", error)
    if abort_on_timeout:
        write_fatal(error, "Ending the job.")
        end_job(launcher)
    raise error


def end_job(launcher: str) -> NoReturn:
    """End the whole job: ``MPI_Abort`` where MPI launched it; otherwise this process exits
    with status 1 (torchrun then ends the job's other processes)."""
    if launcher == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    os._exit(1)
