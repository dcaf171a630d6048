"""Name-matched negotiation: ranks agree on which named operations to run, and in what order.

Horovod users submit collectives in any order on different ranks (gradient hooks fire in the
order backward reaches them, which dynamic graphs change from rank to rank) and from several
threads; operations are matched across ranks by name, never by position. Here, as in Horovod's
coordinator, every process runs *cycles*:

1. every rank sends the operations submitted since its last cycle (name, kind, the fields that
   must agree, size) to every other rank, over a control channel of its own (an allgather of
   small messages, apart from the data; operations every rank already ran under the same name
   and fields travel as a slot of a response cache, see :mod:`ringcomm.torch.horovod._control`);
2. every rank adds them to the same table of pending operations, so every rank decides the
   same: an operation submitted by every rank is *ready*; ready operations run in one order
   (the order they were first seen, the same on every rank), allreduces of one dtype, op and
   scaling fused into one buffer up to the fusion threshold;
3. the fields that must agree are compared first: one that differs fails that operation on
   every rank (naming the field and the ranks), and the others run.

A rank takes part in cycles while it or any rank has something pending, and rests otherwise,
so an idle job costs nothing; a rank with new work waits in the next cycle for the others to
submit theirs. An operation pending on some ranks only is reported (a warning after
HOROVOD_STALL_CHECK_TIME_SECONDS, 60 s) and failed on the ranks that submitted it after the
stall limit (rank 0's HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, by default the communicator's
timeout), with its name and the ranks that never submitted it: never a silent mismatch.

Who runs a cycle: one thread at a time per process (the *turn*). A thread that waits for one
of its operations (a synchronous call, ``synchronize``) runs the cycles itself while nobody
else does, so a synchronous call costs no hand-off between threads; otherwise a background
thread runs them, and without delay while operations pending on other ranks remain (one cycle
time apart where a cycle made no progress). An operation nobody waits for yet is negotiated
HOROVOD_CYCLE_TIME (1 ms) after the first of its burst, by whichever thread runs cycles, so
that a burst of asynchronous submissions travels in one cycle and an operation is in flight
for at least that long (a second submission of its name at once raises, as in Horovod); a
thread that waits (a synchronous call, ``synchronize``) takes its own thread's new operations
into the next cycle at once, never another thread's.
On a CUDA job the background thread always runs them: its streams are the default streams,
which the submitters' fences order (see :class:`~ringcomm.torch._engine.Handle`).

Unnamed operations get Horovod's automatic names: ``<kind>.noname.<k>`` for the k-th unnamed
operation of that kind from this thread (the thread's name is part of the name for threads
other than the main one), so that unnamed operations still match in submission order, per
thread. Two operations in flight under one name raise ValueError when the second is submitted.

Why one module past 400 lines: the Coordinator is one state machine (submission, the cycle,
whose turn it is, shutdown, stalls) whose states all touch the same table; the messages are in
:mod:`ringcomm.torch.horovod._control`, the table in :mod:`ringcomm.torch.horovod._table`,
the runs in :mod:`ringcomm.torch.horovod._runs`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import weakref
from typing import Any

import torch

from ringcomm.comm._mismatch import ranks_text
from ringcomm.comm.base import Communicator
from ringcomm.comm.callers import ThreadNames
from ringcomm.core.log import get_logger
from ringcomm.core.types import CollectiveTimeoutError
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import StalledOperationError
from ringcomm.torch.horovod import timeline as _timeline
from ringcomm.torch.horovod._basics import communicator_of
from ringcomm.torch.horovod._control import (
    ControlChannel,
    Message,
    Request,
    ResponseCache,
    cache_capacity,
)
from ringcomm.torch.horovod._fusion import fusion_threshold, reduce_fused
from ringcomm.torch.horovod._ops import Op
from ringcomm.torch.horovod._runs import run_group
from ringcomm.torch.horovod._table import Outcome, PendingTable

__all__ = ["Coordinator", "coordinator_for", "enqueue", "execute", "forget", "reduce_fused"]

_LOG = get_logger("torch.negotiate")

#: Milliseconds between cycles while operations wait for other ranks, and before the background
#: thread negotiates operations nobody waits for yet (HOROVOD_CYCLE_TIME).
DEFAULT_CYCLE_TIME_MS = 1.0
#: Seconds an operation may wait for other ranks before a warning names it.
DEFAULT_STALL_WARNING_S = 60.0
_SHUT_DOWN = "ringcomm.torch has been shut down"


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {raw!r}")
    return value


@dataclasses.dataclass(slots=True)
class _Mine:
    """An operation this rank submitted, until it has run."""

    op: Op
    handle: Handle
    request: Request  # what this rank tells the others about it
    waited: bool = False  # a thread waits for it: the next cycle takes it, due or not
    thread: int = 0  # the submitting thread's identity


class Coordinator:
    """Negotiates and runs the operations of one communicator (see the module's docstring).

    Args:
        comm: the communicator the data steps run on.
        control: the transport the negotiation runs on (a split of ``comm``'s, so that its
            messages never meet data traffic).
        stall_limit: seconds after which an operation pending on some ranks only fails.
        name: the background thread's name (the caller its data steps run as, on any thread).
    """

    def __init__(self, comm: Communicator, control: Any, *, stall_limit: float,
                 name: str = "ringcomm-coordinator") -> None:
        self.comm, self._control = comm, control
        self.rank, self.size = comm.rank, comm.size
        self._name = name
        self._cycle_time = env_float("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS) / 1000
        self._threshold = fusion_threshold(None)
        disabled = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "") not in ("", "0")
        warn = env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_WARNING_S)
        cache = ResponseCache(cache_capacity())
        self._channel = ControlChannel(control, self.size, cache)
        self._table = PendingTable(self.size, self.rank, cache, stall_limit=stall_limit,
                                   stall_warning=math.inf if disabled else warn)
        self._lock = threading.Lock()
        # Three conditions of one lock: the cycler sleeping for new work (woken by each
        # submission), waiting threads wanting their turn (woken when a turn ends), and the
        # background thread (woken only when it has something to do: a wake-up costs the
        # thread that runs cycles a switch of the interpreter lock).
        self._wake = threading.Condition(self._lock)
        self._turns = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._new: list[_Mine] = []
        self._due = math.inf  # when what is new and nobody waits for is negotiated
        self._mine: dict[str, _Mine] = {}
        self._counters: dict[tuple[str, str], int] = {}
        self._threads = ThreadNames()  # who submits unnamed operations under each name
        # Joins completed: unnamed operations are numbered afresh after each (see _run).
        self._joins = 0
        self._cycle = 0
        self._progressed = True
        self._sleeping = False  # the cycler waits for new work (see _take_new)
        self._stop = False
        self._over = False  # the last cycle has run (shut down, or failed)
        self._dead: Exception | None = None
        self._cycler: threading.Thread | None = None  # whose turn it is
        self._waiters = 0  # threads that run cycles for the handle they wait for
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------- submission
    def submit(self, op: Op, *, waited: bool = False) -> Handle:
        """Queue ``op`` for the next cycle; return its handle.

        Args:
            op: the operation.
            waited: the caller waits for it at once (a synchronous call): the background
                thread is not woken for it.

        Raises:
            ValueError: an operation with the same name is already in flight on this rank.
            RuntimeError: the coordinator has been shut down.
        """
        handle = Handle()
        handle.on_wait = self._await
        fusable = op.reduce is not None and op.reduce.ring is None
        with self._lock:
            if self._dead is not None or self._stop:
                raise RuntimeError(str(self._dead) if self._dead else _SHUT_DOWN)
            name, user_name = self._full_name(op)
            if op.name is None and op.kind not in ("barrier", "join"):
                self._refuse_twin(op)
            if name in self._mine:
                raise ValueError(
                    f"duplicate name: an operation named {user_name!r} ({op.kind}) is already "
                    "in flight on this rank; give concurrent operations distinct names")
            mine = self._mine[name] = _Mine(op, handle,
                                            (name, op.kind, user_name, op.meta, fusable),
                                            waited, threading.get_ident())
            if op.name is None:
                self._commit_name(op)
            tl = _timeline.active()
            if tl is not None:  # before a cycle can see the operation
                tl.negotiate_start(name, op.kind)
            if not waited and self._due == math.inf:
                # Once per burst: negotiated one cycle time from now, by the background
                # thread or a cycle already running, unless a thread that waits for it asks
                # first. Never at once: a second submission of the name right after this one
                # must find it in flight (Horovod's duplicate-name error), not already run.
                self._due = time.monotonic() + self._cycle_time
                self._idle.notify()
            self._new.append(mine)
            if waited:  # its thread waits for it next: taken now, with its thread's others
                self._hurry(handle)
            if self._thread is None:
                self._start()
        return handle

    def _full_name(self, op: Op) -> tuple[str, str]:
        if op.kind in ("barrier", "join"):
            return op.kind, op.kind
        if op.name is not None:
            return f"{op.kind}.{op.name}", str(op.name)
        thread = threading.current_thread().name
        k = self._counters.get((op.kind, thread), 0)
        where = "" if thread == "MainThread" else f"{thread}."
        joins = f"join{self._joins}." if self._joins else ""
        name = f"{op.kind}.noname.{where}{joins}{k}"
        return name, name

    def _refuse_twin(self, op: Op) -> None:
        """Fail ``op`` on every rank (an error in its request) where another live thread of
        this process bears the calling thread's name: an unnamed operation is named after its
        thread and counted per name, so two threads of one name shared the numbers, and which
        of them took each depended on a race on each rank: results were another thread's
        data (16 in 30 at 2 ranks), silently. The rule and its error are the Communicator's
        (``ringcomm.comm.callers.ThreadNames``)."""
        twin = self._threads.conflict(threading.current_thread().name)
        if twin is not None and "error" not in op.meta:
            op.meta["error"] = (f"{type(twin).__name__}: {twin}, or name the operation "
                                "(name=...)")

    def _commit_name(self, op: Op) -> None:
        """Count an accepted unnamed operation (a refused one does not shift the names)."""
        if op.kind in ("barrier", "join"):
            return
        key = (op.kind, threading.current_thread().name)
        self._counters[key] = self._counters.get(key, 0) + 1

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Shut down: one last cycle tells every rank; what is still pending fails.

        Every rank's coordinator stops in the cycle where any rank asked to, and operations
        submitted afterwards raise RuntimeError (Horovod's shutdown is the job's, too).
        """
        with self._lock:
            if not self._stop:
                self._stop = True
                if self._dead is None:
                    self._start()
                self._turns.notify_all()
                self._wake.notify_all()
                self._idle.notify()
            thread = self._thread
        me = threading.current_thread()
        if thread is not None and thread is not me and self._cycler is not me:
            thread.join()

    @property
    def closed(self) -> bool:
        """Whether the coordinator has stopped or been asked to."""
        return self._stop or self._dead is not None

    # ----------------------------------------------------------------------- turns
    def _await(self, handle: Handle) -> None:
        """Run cycles on this thread until ``handle`` is done, while nobody else runs them
        (``Handle.on_wait``); return early where this thread may not (the handle's own wait
        follows)."""
        me = threading.current_thread()
        if self._cycler is me:
            return  # an operation run by a cycle waits for another: as on the background thread
        if torch.cuda.is_initialized():
            with self._lock:  # the background thread runs it now (see the module docstring)
                if self._new:
                    self._due = -math.inf
                    self._hurry(handle)
                    self._idle.notify()
            return
        with self._lock:
            self._hurry(handle)
            self._waiters += 1
            try:
                while not (handle.done() or self._over):
                    if self._cycler is not None:
                        self._turns.wait()
                    elif self._new or self._table or self._stop:
                        self._turn(me)
                    else:
                        break  # nothing left to negotiate: the handle is being finished
            finally:
                self._waiters -= 1
                self._hand_over()  # what is left is the background thread's

    def _hurry(self, handle: Handle) -> None:
        """A thread waits for ``handle``: its operation, if not yet negotiated, and the
        other new operations of the thread that submitted it are taken by the next cycle,
        or by one that sleeps now (the lock is held; one cycle for a burst and the
        ``synchronize`` that follows it). Other threads' new operations keep their burst's
        time: a thread's wait must not take another's operation before that thread's next
        line (a second submission of its name). Whether the background thread runs that
        cycle is ``_due``'s to say (see _background_due): a thread that waits runs its
        cycles itself."""
        thread = next((m.thread for m in self._new if m.handle is handle), None)
        if thread is None:
            return
        for m in self._new:
            if m.thread == thread:
                m.waited = True
        if self._sleeping:
            self._wake.notify()

    def _loop(self) -> None:
        me = threading.current_thread()
        with self._lock:
            while self._background_due():
                self._turn(me)

    def _background_due(self) -> bool:
        """Wait until the background thread should run a cycle (True) or stop (False); the
        lock is held."""
        while not self._over:
            if self._cycler is None and self._waiters == 0:
                if self._stop or self._table:
                    return True
                if self._new and self._due < math.inf:  # else its submitter waits for it
                    left = self._due - time.monotonic()
                    if left <= 0:
                        return True
                    self._idle.wait(left)
                    continue
            self._idle.wait()
        return False

    def _turn(self, me: threading.Thread) -> None:
        """Run one cycle as ``me``: called and returning with the lock held, which the
        cycle's exchange and data steps do not hold."""
        self._cycler = me
        try:
            new, stop = self._take_new()
        except BaseException:  # interrupted while it slept: nothing was taken yet
            self._cycler = None
            self._turns.notify_all()
            raise
        self._lock.release()
        try:
            self._run_cycle(new, stop)
        except BaseException as err:  # KeyboardInterrupt in a waiting thread's cycle, say
            # Half a cycle leaves this rank's table unlike the others': fail every operation
            # from here on rather than match the next ones wrongly.
            self._die(_interrupted(err))
            raise
        finally:
            self._lock.acquire()
            self._cycler = None
            self._turns.notify_all()

    def _hand_over(self) -> None:
        """Wake the background thread where it has a cycle to run (the lock is held)."""
        if self._waiters == 0 and (self._over or self._stop or self._table
                                   or (self._new and self._due < math.inf)):
            self._idle.notify()

    # ----------------------------------------------------------------------- the cycles
    def _take_new(self) -> tuple[list[_Mine], bool]:
        """Take what this cycle negotiates (the lock is held): the operations a thread waits
        for, and those nobody waits for once their burst is due (see :meth:`submit`); the
        others stay new. The cycle runs at once where one is taken or the last cycle ran
        something; where the last ran nothing (operations wait for other ranks), one cycle
        time from now, or sooner where an operation becomes due or a thread waits."""
        idle_until = time.monotonic() + self._cycle_time
        while not self._stop:
            now = time.monotonic()
            if self._due <= now or any(m.waited for m in self._new):
                break
            if self._progressed:
                if self._table or not self._new:
                    break  # the next cycle at once, whether it takes anything new or not
                until = self._due
            else:
                if now >= idle_until:
                    break
                until = min(idle_until, self._due)
            self._sleeping = True
            try:
                self._wake.wait(until - now)
            finally:
                self._sleeping = False
        if self._due <= time.monotonic() or self._stop:
            new, self._new, self._due = self._new, [], math.inf
        else:
            new = [m for m in self._new if m.waited]
            self._new = [m for m in self._new if not m.waited]
            if not self._new:  # the burst's time goes with the last of it
                self._due = math.inf
        return new, self._stop

    def _run_cycle(self, new: list[_Mine], stop: bool) -> None:
        try:
            everyone = self._channel.exchange([m.request for m in new], stop)
        except CollectiveTimeoutError as err:
            self._die(self._stalled_alone(err))
            return
        except Exception as err:  # the control channel failed: nothing can be agreed
            self._die(RuntimeError(f"ringcomm.torch's negotiation failed: {err}"))
            return
        self._cycle += 1
        tl = _timeline.active()
        if tl is not None:
            tl.mark_cycle()
        outcomes = self._table.absorb(everyone, self._cycle)
        self._progressed = bool(outcomes)
        if outcomes:
            self._run(outcomes, tl)
        if any(msg[1] for msg in everyone):
            self._finish_shutdown(everyone)

    # ----------------------------------------------------------------------- execution
    def _run(self, outcomes: list[Outcome], tl: Any) -> None:
        with self._lock:
            pop = self._mine.pop
            for o in outcomes:
                o.mine = pop(o.entry.name, None)
        if tl is not None:
            for o in outcomes:
                if o.mine is not None:
                    tl.negotiate_end(o.entry.name)
                    tl.start(o.entry.name, "QUEUE")
        last_joined = self._table.last_joined
        if any(o.entry.kind == "join" and o.error is None for o in outcomes):
            # Every rank is here in the same cycle, before any join returns: a rank that
            # joined early counted none of the operations the others ran meanwhile, so the
            # unnamed ones are numbered afresh from here on every rank (else the next one
            # would pair with another operation of the same number on another rank).
            with self._lock:
                self._counters.clear()
                self._joins += 1
        try:
            for group in self._table.groups(outcomes, self._threshold):
                run_group(self.comm, self._name, group, tl, last_joined)
        except BaseException as err:  # between two groups (Ctrl-C): fail what did not run
            error = _interrupted(err)
            for o in outcomes:
                if o.mine is not None and not o.mine.handle.done():
                    o.mine.handle.finish(None, error)
            raise

    # ----------------------------------------------------------------------- endings
    def _finish_shutdown(self, everyone: list[Message]) -> None:
        asked = [r for r, msg in enumerate(everyone) if msg[1]]
        error = RuntimeError(f"{_SHUT_DOWN} (hvd.shutdown on {ranks_text(asked)}) before "
                             "every rank submitted this operation")
        with self._lock:
            self._stop = self._over = True
            pending, self._mine, self._new = list(self._mine.values()), {}, []
            self._table.clear()
            self._turns.notify_all()
            self._idle.notify()
        for m in pending:
            m.handle.finish(None, error)

    def _stalled_alone(self, err: CollectiveTimeoutError) -> StalledOperationError:
        with self._lock:
            names = sorted(m.request[2] for m in self._mine.values())
        return StalledOperationError(
            f"no other rank took part in ringcomm.torch's negotiation for {err.timeout:g} s "
            f"while rank {self.rank} waited to run {', '.join(map(repr, names)) or 'nothing'}; "
            "every rank must submit every operation (with the same name)")

    def _die(self, error: Exception) -> None:
        _LOG.error("%s", error)
        with self._lock:
            self._dead = error
            self._over = True
            pending, self._mine, self._new = list(self._mine.values()), {}, []
            self._turns.notify_all()
            self._idle.notify()
        for m in pending:
            m.handle.finish(None, error)


def _interrupted(err: BaseException) -> RuntimeError:
    return RuntimeError(f"ringcomm.torch's negotiation was interrupted ({err!r})")


# --------------------------------------------------------------------------- per communicator
_COORDINATORS: weakref.WeakKeyDictionary[Any, Coordinator] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def coordinator_for(comm: Communicator) -> Coordinator:
    """The coordinator of ``comm``, made on first use (collective: every rank makes it in
    the same call, since the control channel is split from ``comm``'s transport)."""
    coord = _COORDINATORS.get(comm)  # every submission asks: no lock once it exists
    if coord is not None:
        return coord
    with _LOCK:
        coord = _COORDINATORS.get(comm)
        if coord is None:
            coord = _COORDINATORS[comm] = _make(comm)
        return coord


def _make(comm: Communicator) -> Coordinator:
    transport = comm.transport
    control = transport.split(0, comm.rank)
    control.abort_on_timeout = False  # a stall is reported with the operations' names
    # Rank 0's limit on every rank, as Horovod's coordinator alone decides stalls: the table
    # must fail an operation on every rank alike, or a rank that kept it would pair it with
    # another rank's next operation of the same shape.
    own = env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0) or transport.timeout
    limit = control.allgather_object(own)[0]
    control.timeout = limit
    return Coordinator(comm, control, stall_limit=limit)


def forget(comm: Communicator) -> None:
    """Shut down ``comm``'s coordinator, if it has one (see Coordinator.close)."""
    with _LOCK:
        coord = _COORDINATORS.pop(comm, None)
    if coord is not None:
        coord.close()


def enqueue(op: Op, *, waited: bool = False) -> Handle:
    """Submit ``op`` to be matched by name across ranks; return its handle.

    Args:
        op: the operation.
        waited: the caller waits for the handle at once (see :meth:`Coordinator.submit`).

    Raises:
        ValueError: ``init()`` has not been called, an operation of the same name is in
            flight on this rank, or the process set is not registered or lacks this rank.
    """
    return coordinator_for(communicator_of(op.process_set)).submit(op, waited=waited)


def execute(op: Op) -> Any:
    """Submit ``op`` and wait for its result (see :func:`enqueue`)."""
    return enqueue(op, waited=True).wait()

