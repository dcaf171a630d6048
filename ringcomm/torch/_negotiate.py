"""Name-matched negotiation: ranks agree on which named operations to run, and in what order.

Horovod users submit collectives in any order on different ranks (gradient hooks fire in the
order backward reaches them, which dynamic graphs change from rank to rank) and from several
threads; operations are matched across ranks by name, never by position. Here, as in Horovod's
coordinator, a background thread per process runs *cycles*:

1. every rank sends the operations submitted since its last cycle (name, kind, the fields that
   must agree, size) to every other rank, over a control channel of its own (an allgather of
   small messages, apart from the data);
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
stall limit (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, by default the communicator's timeout), with
its name and the ranks that never submitted it: never a silent mismatch.

Unnamed operations get Horovod's automatic names: ``<kind>.noname.<k>`` for the k-th unnamed
operation of that kind from this thread (the thread's name is part of the name for threads
other than the main one), so that unnamed operations still match in submission order, per
thread. Two operations in flight under one name raise ValueError when the second is submitted.
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

from ringcomm.comm.agree import calls_as
from ringcomm.comm.base import Communicator
from ringcomm.comm.log import get_logger
from ringcomm.comm.types import CollectiveTimeoutError
from ringcomm.torch import timeline as _timeline
from ringcomm.torch._basics import ReduceOp, communicator_of
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import HorovodInternalError, StalledOperationError, differs
from ringcomm.torch._fusion import fusion_threshold
from ringcomm.torch._ops import Op, ReduceSpec
from ringcomm.torch._reduce import allreduce_tensor
from ringcomm.torch._tensors import device_scope

__all__ = ["Coordinator", "coordinator_for", "enqueue", "execute", "forget", "reduce_fused"]

_LOG = get_logger("torch.negotiate")

#: Seconds between cycles while operations wait for other ranks (HOROVOD_CYCLE_TIME, in ms).
DEFAULT_CYCLE_TIME_MS = 1.0
#: Seconds an operation may wait for other ranks before a warning names it.
DEFAULT_STALL_WARNING_S = 60.0
_SHUT_DOWN = "ringcomm.torch has been shut down"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {raw!r}")
    return value


@dataclasses.dataclass
class _Mine:
    """An operation this rank submitted, until it has run."""

    op: Op
    handle: Handle
    user_name: str


@dataclasses.dataclass
class _Entry:
    """A pending operation as every rank knows it (the same on every rank)."""

    name: str
    kind: str
    user_name: str
    metas: dict[int, dict[str, Any]]
    fusable: dict[int, bool]
    arrival: tuple[int, int, int]  # (cycle, rank, position): the agreed order
    first_seen: float  # rank 0's clock when it first appeared
    warned: bool = False


@dataclasses.dataclass
class _Outcome:
    """What a cycle decided for one entry: run it, or fail it with ``error``."""

    entry: _Entry
    error: Exception | None = None


class Coordinator:
    """Negotiates and runs the operations of one communicator (see the module's docstring).

    Args:
        comm: the communicator the data steps run on.
        control: the transport the negotiation runs on (a split of ``comm``'s, so that its
            messages never meet data traffic).
        stall_limit: seconds after which an operation pending on some ranks only fails.
        name: the coordinator thread's name (the caller its data steps run as).
    """

    def __init__(self, comm: Communicator, control: Any, *, stall_limit: float,
                 name: str = "ringcomm-coordinator") -> None:
        self.comm, self._control = comm, control
        self.rank, self.size = comm.rank, comm.size
        self._name = name
        self._cycle_time = _env_float("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS) / 1000
        self._threshold = fusion_threshold(None)
        disabled = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "") not in ("", "0")
        warn = _env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_WARNING_S)
        self._stall_warning = math.inf if disabled else warn
        self._stall_limit = stall_limit
        self._cv = threading.Condition()
        self._new: list[tuple[str, _Mine]] = []
        self._mine: dict[str, _Mine] = {}
        self._counters: dict[tuple[str, str], int] = {}
        self._table: dict[str, _Entry] = {}
        self._cycle = 0
        self._progressed = True
        self._stop = False
        self._dead: Exception | None = None
        self._last_joined = -1
        self._joined_cycle: dict[int, int] = {}
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------- submission
    def submit(self, op: Op) -> Handle:
        """Queue ``op`` for the next cycle; return its handle.

        Raises:
            ValueError: an operation with the same name is already in flight on this rank.
            RuntimeError: the coordinator has been shut down.
        """
        handle = Handle()
        with self._cv:
            if self._dead is not None or self._stop:
                raise RuntimeError(str(self._dead) if self._dead else _SHUT_DOWN)
            name, user_name = self._full_name(op)
            if name in self._mine:
                raise ValueError(
                    f"duplicate name: an operation named {user_name!r} ({op.kind}) is already "
                    "in flight on this rank; give concurrent operations distinct names")
            mine = _Mine(op, handle, user_name)
            self._mine[name] = mine
            self._commit_name(op)
            tl = _timeline.active()
            if tl is not None:  # before the cycle thread can see the operation
                tl.negotiate_start(name, op.kind)
            self._new.append((name, mine))
            self._start()
            self._cv.notify_all()
        return handle

    def _full_name(self, op: Op) -> tuple[str, str]:
        if op.kind in ("barrier", "join"):
            return op.kind, op.kind
        if op.name is not None:
            return f"{op.kind}.{op.name}", str(op.name)
        thread = threading.current_thread().name
        k = self._counters.get((op.kind, thread), 0)
        where = "" if thread == "MainThread" else f"{thread}."
        name = f"{op.kind}.noname.{where}{k}"
        return name, name

    def _commit_name(self, op: Op) -> None:
        """Count an accepted unnamed operation (a refused one does not shift the names)."""
        if op.kind in ("barrier", "join") or op.name is not None:
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
        with self._cv:
            if self._stop:
                thread = self._thread
            else:
                self._stop = True
                if self._dead is None:
                    self._start()
                thread = self._thread
                self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def closed(self) -> bool:
        """Whether the coordinator has stopped or been asked to."""
        return self._stop or self._dead is not None

    # ----------------------------------------------------------------------- the cycles
    def _loop(self) -> None:
        while True:
            new, stop = self._next_cycle()
            message = ([(n, m.op.kind, m.user_name, m.op.meta, self._fusable(m.op))
                        for n, m in new], stop, time.monotonic())
            try:
                everyone = self._control.allgather_object(message)
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
            outcomes = self._absorb(everyone)
            self._progressed = bool(outcomes)
            self._run(outcomes)
            if any(msg[1] for msg in everyone):
                self._finish_shutdown(everyone)
                return

    def _next_cycle(self) -> tuple[list[tuple[str, _Mine]], bool]:
        """Wait until this rank must take part in a cycle; take what was submitted."""
        with self._cv:
            while not (self._new or self._table or self._stop):
                self._cv.wait()
            if not self._new and not self._progressed and not self._stop:
                # Operations wait for other ranks: one cycle time, unless new work comes.
                self._cv.wait(self._cycle_time)
            new, self._new = self._new, []
            return new, self._stop

    @staticmethod
    def _fusable(op: Op) -> bool:
        return op.reduce is not None and op.reduce.ring is None

    def _absorb(self, everyone: list[Any]) -> list[_Outcome]:
        """Add every rank's new operations to the table; return what is decided now."""
        now0 = everyone[0][2]
        for r, (requests, _, _) in enumerate(everyone):
            for pos, (name, kind, user_name, meta, fusable) in enumerate(requests):
                entry = self._table.get(name)
                if entry is None:
                    entry = self._table[name] = _Entry(name, kind, user_name, {}, {},
                                                       (self._cycle, r, pos), now0)
                entry.metas[r] = meta
                entry.fusable[r] = fusable
                if kind == "join":
                    self._joined_cycle[r] = self._cycle
        joined = set(self._table["join"].metas) if "join" in self._table else set()
        outcomes = []
        for entry in sorted(self._table.values(), key=lambda e: e.arrival):
            outcome = self._decide(entry, joined, now0)
            if outcome is not None:
                outcomes.append(outcome)
                del self._table[entry.name]
        return outcomes

    def _decide(self, entry: _Entry, joined: set[int], now0: float) -> _Outcome | None:
        have = set(entry.metas)
        if len(have) == self.size:
            if entry.kind == "join":
                last = self._joined_cycle
                self._last_joined = max(last, key=lambda r: (last[r], r))
                self._joined_cycle.clear()
            return _Outcome(entry, self._mismatch(entry))
        if entry.kind != "join" and joined and len(have | joined) == self.size:
            if entry.kind == "allreduce":
                return _Outcome(entry, self._mismatch(entry))
            return _Outcome(entry, HorovodInternalError(
                f"{entry.kind} {entry.user_name!r}: {_ranks(sorted(joined))} joined "
                "(hvd.join) before submitting it; only allreduce runs with joined ranks"))
        waited = now0 - entry.first_seen
        missing = sorted(set(range(self.size)) - have - joined)
        if waited > self._stall_limit:
            return _Outcome(entry, StalledOperationError(
                f"{entry.kind} {entry.user_name!r} was submitted by {_ranks(sorted(have))} "
                f"but not by {_ranks(missing)} within {self._stall_limit:g} s; every rank "
                "must submit every operation (with the same name)"))
        if waited > self._stall_warning and not entry.warned:
            entry.warned = True
            if self.rank == 0:
                _LOG.warning("%s %r has waited %.0f s for %s (submitted by %s); an operation "
                             "submitted by some ranks only stalls the job", entry.kind,
                             entry.user_name, waited, _ranks(missing), _ranks(sorted(have)))
        return None

    def _mismatch(self, entry: _Entry) -> Exception | None:
        metas = list(entry.metas.values())
        if all(m == metas[0] for m in metas[1:]):
            return None
        ranks = sorted(entry.metas)
        fields = sorted({f for m in metas for f in m}, key=str)
        parts = [d for f in fields
                 if (d := differs(f, [entry.metas[r].get(f) for r in ranks], ranks))]
        return HorovodInternalError(f"{entry.kind} {entry.user_name!r}: " + "; ".join(parts))

    # ----------------------------------------------------------------------- execution
    def _run(self, outcomes: list[_Outcome]) -> None:
        tl = _timeline.active()
        with self._cv:
            mine = {o.entry.name: self._mine.pop(o.entry.name, None) for o in outcomes}
        if tl is not None:
            for o in outcomes:
                if mine[o.entry.name] is not None:
                    tl.negotiate_end(o.entry.name)
                    tl.start(o.entry.name, "QUEUE")
        for group in self._groups(outcomes):
            self._run_group(group, mine, tl)

    def _groups(self, outcomes: list[_Outcome]) -> list[list[_Outcome]]:
        """Cut the decided entries into what runs together (the same on every rank)."""
        groups: list[list[_Outcome]] = []
        open_groups: dict[tuple[Any, ...], tuple[list[_Outcome], int]] = {}
        for o in outcomes:
            key = self._fuse_key(o)
            if key is None:
                groups.append([o])
                continue
            nbytes = _nbytes(next(iter(o.entry.metas.values())))
            group, total = open_groups.get(key, (None, 0))
            if group is not None and total + nbytes <= self._threshold:
                group.append(o)
                open_groups[key] = (group, total + nbytes)
            else:
                group = [o]
                groups.append(group)
                open_groups[key] = (group, nbytes)
        return groups

    @staticmethod
    def _fuse_key(o: _Outcome) -> tuple[Any, ...] | None:
        if o.error is not None or o.entry.kind != "allreduce" or not all(o.entry.fusable.values()):
            return None
        meta = next(iter(o.entry.metas.values()))
        return tuple((k, v) for k, v in sorted(meta.items()) if k != "shape")

    def _run_group(self, group: list[_Outcome], mine: dict[str, _Mine | None],
                   tl: Any) -> None:
        error = group[0].error  # a failed entry is never fused
        result: list[Any] = [None] * len(group)
        names = [o.entry.name for o in group if mine[o.entry.name] is not None]
        if tl is not None:
            args = {"fused": len(group)} if len(group) > 1 else None
            for n in names:
                tl.end(n)  # QUEUE
                tl.start(n, group[0].entry.kind.upper(), args)
        if error is None:
            try:
                # The communicator's device current on this thread, as on the engine's; the
                # submitters' streams were fenced into the default stream by their Handles.
                with calls_as(self._name), device_scope(self.comm.cuda_device):
                    if tl is None:
                        result = self._execute(group, mine)
                    else:
                        with tl.executing(names):
                            result = self._execute(group, mine)
            except BaseException as err:  # handed to whoever waits on the handles
                error = err
        if tl is not None:
            for n in names:
                tl.end(n)
        for o, value in zip(group, result, strict=True):
            m = mine[o.entry.name]
            if m is not None:
                m.handle._finish(value, error)

    def _execute(self, group: list[_Outcome], mine: dict[str, _Mine | None]) -> list[Any]:
        comm = self.comm
        if len(group) == 1:
            entry, m = group[0].entry, mine[group[0].entry.name]
            if entry.kind == "join":
                return [self._last_joined]
            if entry.kind != "allreduce" and m is None:
                raise HorovodInternalError(f"{entry.kind} {entry.user_name!r} reached a "
                                           "joined rank")
            if m is not None and m.op.run is not None:
                return [m.op.run(comm)]
        return reduce_fused(comm, [self._spec(o, mine[o.entry.name]) for o in group])

    @staticmethod
    def _spec(o: _Outcome, m: _Mine | None) -> ReduceSpec:
        if m is not None and m.op.reduce is not None:
            return m.op.reduce
        # This rank joined: it contributes zeros of the agreed dtype and shape.
        meta = next(iter(o.entry.metas.values()))
        zeros = torch.zeros(meta["shape"], dtype=_dtype(meta["dtype"]))
        return ReduceSpec(zeros, zeros, ReduceOp[meta["op"]], meta.get("prescale", 1.0),
                          meta.get("postscale", 1.0))

    # ----------------------------------------------------------------------- endings
    def _finish_shutdown(self, everyone: list[Any]) -> None:
        asked = [r for r, msg in enumerate(everyone) if msg[1]]
        error = RuntimeError(f"{_SHUT_DOWN} (hvd.shutdown on {_ranks(asked)}) before every "
                             "rank submitted this operation")
        with self._cv:
            self._stop = True
            pending, self._mine, self._new = list(self._mine.values()), {}, []
            self._table.clear()
        for m in pending:
            m.handle._finish(None, error)

    def _stalled_alone(self, err: CollectiveTimeoutError) -> StalledOperationError:
        with self._cv:
            names = sorted(m.user_name for m in self._mine.values())
        return StalledOperationError(
            f"no other rank took part in ringcomm.torch's negotiation for {err.timeout:g} s "
            f"while rank {self.rank} waited to run {', '.join(map(repr, names)) or 'nothing'}; "
            "every rank must submit every operation (with the same name)")

    def _die(self, error: Exception) -> None:
        _LOG.error("%s", error)
        with self._cv:
            self._dead = error
            pending, self._mine, self._new = list(self._mine.values()), {}, []
        for m in pending:
            m.handle._finish(None, error)


def reduce_fused(comm: Communicator, specs: list[ReduceSpec]) -> list[torch.Tensor]:
    """Run the allreduces ``specs``: one collective per dtype, device, op and scaling, through
    a flat buffer where there are several; return their outputs (written in place)."""
    groups: dict[tuple[Any, ...], list[ReduceSpec]] = {}
    for s in specs:
        key = (s.tensor.dtype, s.tensor.device, s.op, s.prescale, s.postscale, id(s.ring))
        groups.setdefault(key, []).append(s)
    for group in groups.values():
        first = group[0]
        if len(group) == 1:
            allreduce_tensor(comm, first.tensor, first.out, op=first.op, prescale=first.prescale,
                             postscale=first.postscale, compression=first.ring)
            continue
        flat = torch.cat([s.tensor.reshape(-1) for s in group])
        allreduce_tensor(comm, flat, flat, op=first.op, prescale=first.prescale,
                         postscale=first.postscale, compression=first.ring)
        off = 0
        for s in group:
            n = s.out.numel()
            with torch.no_grad():
                s.out.copy_(flat[off: off + n].view(s.out.shape))
            off += n
    return [s.out for s in specs]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _nbytes(meta: dict[str, Any]) -> int:
    shape = meta.get("shape", ())
    return math.prod(shape) * _dtype(meta["dtype"]).itemsize if "dtype" in meta else 0


# --------------------------------------------------------------------------- per communicator
_COORDINATORS: weakref.WeakKeyDictionary[Any, Coordinator] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def coordinator_for(comm: Communicator) -> Coordinator:
    """The coordinator of ``comm``, made on first use (collective: every rank makes it in
    the same call, since the control channel is split from ``comm``'s transport)."""
    with _LOCK:
        coord = _COORDINATORS.get(comm)
        if coord is None:
            coord = _COORDINATORS[comm] = _make(comm)
        return coord


def _make(comm: Communicator) -> Coordinator:
    transport = comm.transport
    control = transport.split(0, comm.rank)
    if hasattr(control, "abort_on_timeout"):
        control.abort_on_timeout = False  # a stall is reported with the operations' names
    default = float(getattr(transport, "timeout", 1800.0))
    limit = _env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0) or default
    if hasattr(control, "timeout"):
        control.timeout = limit
    return Coordinator(comm, control, stall_limit=limit)


def forget(comm: Communicator) -> None:
    """Shut down ``comm``'s coordinator, if it has one (see Coordinator.close)."""
    with _LOCK:
        coord = _COORDINATORS.pop(comm, None)
    if coord is not None:
        coord.close()


def enqueue(op: Op) -> Handle:
    """Submit ``op`` to be matched by name across ranks; return its handle.

    Raises:
        ValueError: ``init()`` has not been called, an operation of the same name is in
            flight on this rank, or the process set is not registered or lacks this rank.
    """
    return coordinator_for(communicator_of(op.process_set)).submit(op)


def execute(op: Op) -> Any:
    """Submit ``op`` and wait for its result (see :func:`enqueue`)."""
    return enqueue(op).wait()

