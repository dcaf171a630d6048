"""In-process backend: ``n`` ranks as threads of one process, for unit tests of the algorithms.

A :class:`ThreadWorld` holds what the ranks share: one FIFO mailbox per (channel, source,
destination) and a rendezvous for the collectives. Sends copy their bytes when posted (MPI's
buffered semantics: the sender may reuse its buffer after ``wait()``); a receive completes in
``wait()`` once a message arrived and was copied into the receive buffer. Every wait has a
timeout, and a timeout (a :class:`~ringcomm.core.types.CollectiveTimeoutError`, as on the
MPI backend) or a failing rank aborts the world, so a bug ends in an error naming the
operation and the peer, never in a hang. :func:`run_ranks` runs a function on every rank.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.comm.callers import calls_as
from ringcomm.comm.transport import TransportBase, WholeExchange, adopt_ranks, check_split
from ringcomm.core.types import RING, USER, Array, CollectiveTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "ThreadTransport", "ThreadWorld", "WorldAbortedError", "run_ranks"]

#: Seconds any wait lasts before raising CollectiveTimeoutError.
# Shorter than ringcomm's default (DEFAULT_TIMEOUT_S): these worlds run tests, where a hung
# rank should fail its test within a minute.
DEFAULT_TIMEOUT = 60.0
_CHANNELS = {RING: "ring", USER: "user"}
_EXCHANGES = {RING: "ring exchange", USER: "sendrecv"}  # a timeout's kind outside a collective
_EMPTY = object()  # a rendezvous slot no rank has filled yet
_WAKE = object()  # put in every mailbox by abort(), to wake a blocked receiver


class WorldAbortedError(RuntimeError):
    """A wait was interrupted because another rank of the world failed or timed out."""


def _flat_bytes(a: np.ndarray, label: str) -> np.ndarray:
    """The bytes of contiguous ``a``, as a 1-d uint8 view (writing it writes ``a``)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{label} must be contiguous")
    return a.reshape(-1).view(np.uint8)


def _check_rank(r: Any, size: int, label: str = "peer") -> int:
    if not 0 <= int(r) < size:
        raise ValueError(f"{label} must be a rank in [0, {size}), got {r}")
    return int(r)


class ThreadWorld:
    """The mailboxes and the collective rendezvous shared by ``size`` thread ranks.

    Args:
        size: the number of ranks (>= 1).
        timeout: seconds every wait (receive, collective) lasts before raising
            CollectiveTimeoutError.

    Raises:
        ValueError: ``size`` < 1 or ``timeout`` <= 0.
    """

    def __init__(self, size: int, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if int(size) < 1 or not timeout > 0:
            raise ValueError(f"size must be >= 1 and timeout > 0, got {size} and {timeout}")
        self.size, self.timeout = int(size), float(timeout)
        self._boxes: dict[tuple[int, int, int], queue.SimpleQueue[Any]] = {}
        self._cv = threading.Condition()
        self._generation = 0
        self._slots: list[Any] = [_EMPTY] * self.size
        self._result: Any = None
        self._children: list[ThreadWorld] = []
        self._aborted: str | None = None

    def abort(self, reason: str) -> None:
        """Make every wait in this world and its sub-worlds raise WorldAbortedError."""
        with self._cv:
            if self._aborted is not None:
                return
            self._aborted = reason
            self._cv.notify_all()
            children = list(self._children)
        for box in list(self._boxes.values()):
            box.put(_WAKE)
        for child in children:
            child.abort(reason)

    def _mailbox(self, channel: int, source: int, dest: int) -> queue.SimpleQueue[Any]:
        key = (channel, source, dest)
        box = self._boxes.get(key)
        if box is None:  # setdefault is atomic: racing creators get one queue
            box = self._boxes.setdefault(key, queue.SimpleQueue())
        return box

    def _check_alive(self, rank: int, what: str) -> None:
        if self._aborted is not None:
            raise WorldAbortedError(f"rank {rank}: {what} interrupted: {self._aborted}")

    def _timed_out(self, message: str, kind: str, peer: int | None,
                   elapsed: float) -> CollectiveTimeoutError:
        self.abort(message)  # the world's state is no longer consistent
        return CollectiveTimeoutError(message, kind=kind, peer=peer, elapsed=elapsed,
                                      timeout=self.timeout)

    def exchange(self, rank: int, what: str, value: Any,
                 combine: Callable[[list[Any]], Any] = list, *, operation: str = "") -> Any:
        """Deposit ``value`` and return ``combine`` of every rank's values, in rank order.

        The last rank to arrive runs ``combine`` once for everyone; a TypeError or ValueError
        it raises is raised on every rank.

        Args:
            rank: the calling rank.
            what: the transport's collective ("barrier", "allgather_fixed", ...).
            value: this rank's contribution.
            combine: turns every rank's values into the result.
            operation: the collective in progress ("allreduce", ...; the transport's
                ``operation``), for a timeout's message and ``kind``; ``what`` when empty.

        Raises:
            CollectiveTimeoutError: some ranks did not arrive in time (named; ``peer`` is the
                missing rank when only one is); the world is aborted.
            RuntimeError: the ranks called different collectives (named per rank).
            WorldAbortedError: another rank failed meanwhile.
        """
        start = time.monotonic()
        with self._cv:
            self._check_alive(rank, what)
            generation = self._generation
            self._slots[rank] = (what, value)
            if all(s is not _EMPTY for s in self._slots):
                self._result = _combine(self._slots, combine)
                self._slots = [_EMPTY] * self.size
                self._generation += 1
                self._cv.notify_all()
            elif not self._cv.wait_for(lambda: self._generation != generation
                                       or self._aborted is not None, self.timeout):
                missing = [r for r, s in enumerate(self._slots) if s is _EMPTY]
                kind = operation or what
                step = what if kind == what else f"{kind}: {what}"
                raise self._timed_out(f"rank {rank}: {step} timed out after {self.timeout:g} s "
                                      f"waiting for ranks {missing}", kind,
                                      missing[0] if len(missing) == 1 else None,
                                      time.monotonic() - start)
            if self._generation == generation:
                self._check_alive(rank, what)
            result = self._result
        if isinstance(result, Exception):
            raise type(result)(str(result))  # a fresh one per rank: tracebacks are per thread
        return result


def _combine(slots: list[Any], combine: Callable[[list[Any]], Any]) -> Any:
    whats = [s[0] for s in slots]
    if len(set(whats)) > 1:
        calls = ", ".join(f"rank {r}: {w}" for r, w in enumerate(whats))
        return RuntimeError(f"ranks called different collectives ({calls})")
    try:
        return combine([s[1] for s in slots])
    except (TypeError, ValueError) as err:
        return err


class _Exchange:
    """A posted send (already in the mailbox) and receive (completed by ``wait``)."""

    __slots__ = ("_box", "_kind", "_rank", "_recv", "_source", "_t", "_what", "_world")

    def __init__(self, t: ThreadTransport, recv: np.ndarray | None, source: int,
                 channel: int) -> None:
        self._t, self._world, self._rank, self._recv = t, t.world, t.rank, recv
        self._source, self._kind = source, _EXCHANGES.get(channel, "sendrecv")
        self._box = None if recv is None else t.world._mailbox(channel, source, t.rank)
        self._what = f"receive from rank {source} on the {_CHANNELS.get(channel, channel)} channel"

    def wait(self) -> None:
        """Return once the receive buffer holds the message (at once for a pure send)."""
        if self._box is None or self._recv is None:  # a pure send (no box without a recv)
            return
        box, self._box, world = self._box, None, self._world
        world._check_alive(self._rank, self._what)
        start = time.monotonic()
        try:
            msg = box.get(timeout=world.timeout)
        except queue.Empty:
            kind = self._t.operation or self._kind
            step = self._what if not self._t.operation else f"{kind}: {self._what}"
            raise world._timed_out(f"rank {self._rank}: {step} timed out after "
                                   f"{world.timeout:g} s", kind, self._source,
                                   time.monotonic() - start) from None
        if msg is _WAKE:
            world._check_alive(self._rank, self._what)
        dst = _flat_bytes(self._recv, "recv")
        if dst.size != msg.size:
            raise ValueError(f"rank {self._rank}: {self._what}: the message has {msg.size} "
                             f"bytes but the receive buffer {dst.size}")
        dst[...] = msg


class _SizedExchange(WholeExchange):
    """Each rank's first ``nbytes`` of ``send`` into the start of its row of every rank's
    ``recv``; the rest of a row keeps what was there (see core.types.Exchange)."""

    sized = True

    def __init__(self, t: ThreadTransport, row_bytes: int) -> None:
        self._t = t
        self.recv = np.zeros((t.size, row_bytes), np.uint8)
        self.send = self.recv[t.rank]
        self.whole_bytes = row_bytes

    def __call__(self, nbytes: int) -> None:
        if not 0 < nbytes <= self.send.nbytes:
            raise ValueError(f"an exchange sends 1 to {self.send.nbytes} bytes, got {nbytes}")
        parts = self._t._exchange("agreement exchange", self.send[:nbytes].copy())
        for row, part in zip(self.recv, parts, strict=True):
            row[:part.size] = part

    def moved(self, nbytes: int) -> int:
        return nbytes * (self._t.size - 1)


class ThreadTransport(TransportBase):
    """The Transport of one rank of a :class:`ThreadWorld` (NumPy arrays only).

    Args:
        world: the world shared by the ranks.
        rank: this rank, 0 <= rank < world.size.

    Raises:
        ValueError: ``rank`` outside the world.
    """

    backend = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__(_check_rank(rank, world.size, "rank"), world.size)
        self.world = world

    @property
    def timeout(self) -> float:
        """The world's: every wait of its ranks lasts at most this long."""
        return self.world.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.world.timeout = value

    def isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int, *,
                  channel: int = RING) -> _Exchange:
        """Post a send of ``send`` to ``dest`` (copied now) and a receive into ``recv``
        (completed by ``wait()``); a TypeError for arrays other than NumPy's."""
        self.check_arrays(send, recv)
        if send is not None:
            box = self.world._mailbox(channel, self.rank, _check_rank(dest, self.size))
            box.put(_flat_bytes(send, "send").copy())
        return _Exchange(self, recv, _check_rank(source, self.size), channel)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Allgather equal-sized byte buffers: ``recv`` holds every rank's ``send`` in order."""
        parts = self._exchange("allgather_fixed", _flat_bytes(send, "send").copy())
        out, sizes = _flat_bytes(recv, "recv"), [p.size for p in parts]
        if sum(sizes) != out.size or len(set(sizes)) > 1:
            raise ValueError(f"allgather_fixed: ranks sent {sizes} bytes into a receive "
                             f"buffer of {out.size}")
        out[...] = np.concatenate(parts)

    def prepare_exchange(self, row_bytes: int) -> _SizedExchange:
        """The agreement's exchange with each rank's own length, as MPI's (``sized``)."""
        return _SizedExchange(self, row_bytes)

    def allgatherv(self, x: Array, counts: list[int], out: Array) -> None:
        """Gather 1-d ``x`` from every rank into ``out``, rank r's part holding counts[r]."""
        self.check_arrays(x, out)
        parts = self._exchange("allgatherv", _flat_bytes(x, "x").copy())
        expected = [int(c) * x.itemsize for c in counts]
        dst = _flat_bytes(out, "out")
        if [p.size for p in parts] != expected or dst.size != sum(expected):
            raise ValueError(f"allgatherv: ranks sent {[p.size for p in parts]} bytes, counts "
                             f"say {expected}, out holds {dst.size}")
        dst[...] = np.concatenate(parts)

    def broadcast(self, x: Array, root: int) -> None:
        """Overwrite contiguous ``x`` with root's, in place."""
        self.check_arrays(x)
        root = _check_rank(root, self.size, "root")
        mine = _flat_bytes(x, "x").copy() if self.rank == root else None
        data, dst = self._exchange("broadcast", mine, lambda v: v[root]), _flat_bytes(x, "x")
        if data is None or data.size != dst.size:
            raise ValueError(f"broadcast: root {root} sent "
                             f"{None if data is None else data.size} bytes, x holds {dst.size}")
        dst[...] = data

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank (each rank gets its own copies)."""
        return [pickle.loads(b) for b in self._exchange("allgather_object", pickle.dumps(obj))]

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""
        self._exchange("barrier", None)

    def split(self, color: int, key: int) -> ThreadTransport:
        """A transport over the ranks with the same ``color``, ordered by (key, rank), in a
        sub-world of its own, so its messages never match this world's (collective).

        Raises:
            TypeError, ValueError: as ``check_split``, on every rank if on any, naming it.
        """
        try:
            mine: Any = check_split(color, key)
        except (TypeError, ValueError) as err:
            mine = err
        members, world = self._exchange("split", mine, self._make_groups)[mine[0]]
        return adopt_ranks(ThreadTransport(world, members.index(self.rank)), self, members)

    def _make_groups(self, values: list[Any]) -> dict[int, tuple[list[int], ThreadWorld]]:
        for r, v in enumerate(values):
            if isinstance(v, Exception):
                raise type(v)(f"split failed on rank {r}: {v}")
        groups = {}
        for color in sorted({c for c, _ in values}):
            members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(values)
                                            if c == color)]
            groups[color] = (members, ThreadWorld(len(members), timeout=self.world.timeout))
            # Runs under the parent's lock (see exchange): the parent's abort reaches it.
            self.world._children.append(groups[color][1])
        return groups

    def check_arrays(self, *arrays: Array) -> None:
        """Raise TypeError unless every array (None skipped) is a NumPy array."""
        for a in arrays:
            if a is not None and not isinstance(a, np.ndarray):
                raise TypeError(f"the threads backend takes NumPy arrays, got "
                                f"{type(a).__module__}.{type(a).__name__}")

    def close(self) -> None:
        """Drop the scratch buffers."""
        self.release_scratch()

    def _exchange(self, what: str, value: Any,
                  combine: Callable[[list[Any]], Any] = list) -> Any:
        return self.world.exchange(self.rank, what, value, combine, operation=self.operation)


def run_ranks(n: int, fn: Callable[[ThreadTransport], Any], *,
              timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(transport)`` on ``n`` thread ranks of a new world; return their results.

    Args:
        n: the number of ranks.
        fn: what every rank runs, given its transport.
        timeout: seconds every wait inside the run may last; the run as a whole gets 2 s
            more, so that a wait's own error, naming its peer, comes first.

    Returns:
        ``fn``'s results, in rank order.

    Raises:
        Exception: the first exception raised on any rank, other than an aborted wait (a
            note names the rank); the other ranks' waits are aborted then.
        TimeoutError: some ranks were still running at the end of the run's time.
    """
    world = ThreadWorld(n, timeout=timeout)
    results: list[Any] = [None] * n
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def main(rank: int) -> None:
        try:
            with calls_as("MainThread"):  # each rank's thread is that rank's main thread
                results[rank] = fn(ThreadTransport(world, rank))
        except BaseException as exc:
            with lock:
                failures.append((rank, exc))
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=main, args=(r,), name=f"ringcomm-rank-{r}", daemon=True)
               for r in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout + 2.0
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, th in enumerate(threads) if th.is_alive()]
    with lock:
        # An aborted wait is the consequence of another rank's error: report the cause.
        causes = [f for f in failures if not isinstance(f[1], WorldAbortedError)]
        first = (causes or failures)[0] if failures else None
    if stuck:  # wake the stuck ranks, so their errors say what each was waiting for
        world.abort(f"run_ranks timed out after {timeout:g} s")
        for th in threads:
            th.join(5.0)
    if first is not None:
        rank, exc = first
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"raised on rank {rank} of {n}")
        raise exc
    if stuck:
        waits = "; ".join(str(exc) for _, exc in failures)
        raise TimeoutError(f"run_ranks: ranks {stuck} of {n} still running after "
                           f"{timeout:g} s" + (f" ({waits})" if waits else ""))
    return results
