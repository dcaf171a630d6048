"""Cross-rank agreement on a collective's arguments, before any data moves.

Every collective starts with one fixed-size allgather of a small header per rank: what the call
is, the kind of array (host or device: on the NCCL backend they take different paths), the
dtype, shape, op, root, compression and name, and whether the arguments were valid on that
rank. If any rank's arguments were invalid or the headers disagree, every rank raises the same
error naming what differs, and the communicator stays usable. Arrays of up to
``comm.inline_bytes`` (``INLINE_BYTES`` by default) ride in the same message, so a small
allreduce is complete after this one exchange; that slot is sent with every collective.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.core.types import (
    DEFAULT_INLINE_BYTES,
    SUPPORTED_DTYPES,
    ArgumentMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
    ReduceOp,
    Transport,
    check_dtype,
    check_movable,
)

__all__ = ["INLINE_BYTES", "Agreement", "CallSpec", "InlinePlan", "ThreadNames", "caller",
           "calls_as", "rank_groups"]

INLINE_BYTES = DEFAULT_INLINE_BYTES
# Header words, in order.
KIND, ERROR, DTYPE, OP, ROOT, NDIM, DIM0, REST, EXTRA, SEGMENT, CALLER, ARRAY = range(12)
_WORDS = 12
# The ARRAY word: what kind of array a rank passed (a barrier passes none).
_HOST, _DEVICE = 1, 2
_ARRAY_NAMES = {0: "none", _HOST: "host (NumPy)", _DEVICE: "device (CuPy)"}
_HEADER_BYTES = 8 * _WORDS
_KINDS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "broadcast", "barrier",
          "configure")
# Fields a collective lets differ between ranks.
_MAY_DIFFER = {"allgatherv": (DIM0,)}


_HEADERS: dict[tuple[Any, ...], bytes] = {}


def _crc(value: object) -> int:
    return zlib.crc32(repr(value).encode())


class _Caller(threading.local):
    name: str | None = None  # set by calls_as; a class default, so reading it never raises


_CALLER = _Caller()


def caller() -> str:
    """Who makes the calls of this thread, as matched across ranks: the thread's name, or the
    name given by ``calls_as``.

    Calls from several threads are serialized on each rank, and each call's caller is part of
    its header: two threads whose calls pair up in a different order on another rank raise
    ArgumentMismatchError on every rank instead of mixing their data.
    """
    name = _CALLER.name
    return threading.current_thread().name if name is None else name


_MAX_OWNERS = 256  # remembered thread names before finished threads are dropped


class ThreadNames:
    """Which thread calls under each thread name on one communicator: one thread a name.

    Calls are matched across ranks by their caller's name, so two live threads of one name
    on one rank could pair with each other's calls on another rank and mix their data. Once
    a thread calls while another live thread of the process bears its name, every call of
    either is refused for as long as either lives (the error is raised on every rank, by the
    agreement): refusing only while both live would let whichever outlives the other pass
    afterwards, and the survivors of two ranks need not be the same logical thread. A thread
    of that name started after they have all ended calls again. Calls made under
    ``calls_as`` are exempt: its threads share one name by design and serialize their calls.

    The names looked at are those of every live thread of the process, whichever
    communicator they call on: two threads of one name on two communicators are refused too
    (the rule is "a name of its own among the process's live threads"), since a thread's
    first call cannot tell whether its twin will call here later.
    """

    __slots__ = ("_owners", "_twins")

    def __init__(self) -> None:
        # Thread objects, not idents (the ident of a finished thread is given to new ones);
        # finished ones are dropped as new names come (a pool of new threads each step must
        # not grow this without bound), and twins are held weakly.
        self._owners: dict[str, threading.Thread] = {}
        self._twins: dict[str, weakref.WeakSet[threading.Thread]] = {}

    def owns(self, name: str) -> bool:
        """Whether the calling thread may call as ``name`` without a look at the others (the
        cheap check of every call)."""
        return _CALLER.name is not None or self._owners.get(name) is threading.current_thread()

    def caller(self) -> tuple[str, ValueError | None]:
        """This thread's caller (as :func:`caller` says) and, where another live thread bears
        its name, the error to raise on every rank: the per-call path's one look."""
        name = _CALLER.name
        if name is not None:
            return name, None
        me = threading.current_thread()
        name = me.name
        if self._owners.get(name) is me:
            return name, None
        return name, self.conflict(name)

    def conflict(self, name: str) -> ValueError | None:
        """None where the calling thread may call as ``name`` (it is then remembered), or the
        error to raise on every rank."""
        if self.owns(name):
            return None
        me = threading.current_thread()
        live = {t for t in threading.enumerate() if t.name == name}
        twins = {t for t in self._twins.get(name, ()) if t.is_alive()}
        if me not in twins and len(live) <= 1:
            self._twins.pop(name, None)
            if len(self._owners) >= _MAX_OWNERS:
                self._owners = {n: t for n, t in self._owners.items() if t.is_alive()}
            self._owners[name] = me
            return None
        self._twins[name] = weakref.WeakSet(twins | live | {me})
        self._owners.pop(name, None)
        return ValueError(
            f"thread {name!r} made a collective call, but another thread of its process "
            "bears the same name and has been alive with it: calls are matched across ranks "
            "by thread name, so threads of one name could take each other's data. Give each "
            "thread that makes collective calls a name of its own, the same on every rank "
            "(threading.Thread(name=...))")


@contextmanager
def calls_as(name: str) -> Iterator[None]:
    """Make this thread's calls, within the block, as ``name`` (for a queue of collectives
    run by whichever thread is free: its calls keep one caller on every rank)."""
    before = _CALLER.name
    _CALLER.name = name
    try:
        yield
    finally:
        _CALLER.name = before


class CallSpec:
    """What one rank passed to a collective, as the agreement compares it."""

    __slots__ = ("algorithm", "array", "caller", "dtype", "error", "extra", "kind", "op", "root",
                 "shape")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.caller = caller()
        self.array = 0  # _HOST or _DEVICE once set_array has seen the array
        self.dtype: np.dtype | None = None
        self.shape: tuple[int, ...] = ()
        self.op: str = ""
        self.root = 0
        self.extra = ""
        self.algorithm = ""  # allreduce: "auto", "flat" or "hierarchical"
        self.error: Exception | None = None

    def set_array(self, x: Any, *, reduced: bool = True) -> np.dtype:
        """Record ``x``'s dtype and shape after checking it is a supported array: of a dtype
        ringcomm reduces, or, for collectives that only move bytes (``reduced=False``), of any
        dtype but object."""
        if type(x) is np.ndarray:
            self.array = _HOST
        elif _ops.is_device_array(x):
            self.array = _DEVICE
        else:
            raise TypeError(f"expected a NumPy or CuPy array, got {type(x).__name__}")
        if reduced and not x.dtype.isnative:
            raise TypeError(
                f"dtype {x.dtype.str} is in non-native byte order ({_endian(x.dtype)}); "
                "reductions need native numbers: pass x.astype(x.dtype.newbyteorder('='))")
        self.shape = x.shape
        self.dtype = check_dtype(x.dtype) if reduced else check_movable(x.dtype)
        return self.dtype

    def with_error(self, error: Exception) -> CallSpec:
        """A copy carrying ``error`` (a prepared call's own spec stays as it was)."""
        copy = CallSpec.__new__(CallSpec)
        for slot in CallSpec.__slots__:
            setattr(copy, slot, getattr(self, slot))
        copy.error = error
        return copy

    def set_op(self, op: ReduceOp) -> ReduceOp:
        self.op = op
        return op

    def header(self, segment_bytes: int) -> bytes:
        """The header words compared across ranks, as bytes (cached per distinct call).

        ``segment_bytes`` is the communicator's: ranks that cut the ring differently would
        exchange messages of different sizes.
        """
        key = (self.kind, self.error is None, self.dtype, self.shape, self.op, self.root,
               self.extra, self.algorithm, segment_bytes, self.caller, self.array)
        cached = _HEADERS.get(key)
        if cached is None:
            if len(_HEADERS) > 4096:
                _HEADERS.clear()
            cached = _HEADERS[key] = self._words(segment_bytes).tobytes()
        return cached

    def _words(self, segment_bytes: int) -> np.ndarray:
        h = np.zeros(_WORDS, dtype=np.int64)
        h[KIND] = _KINDS.index(self.kind)
        h[CALLER] = _crc(self.caller)
        h[ARRAY] = self.array
        if self.error is not None:
            h[ERROR] = 1
            return h
        dt = self.dtype
        h[DTYPE] = SUPPORTED_DTYPES.index(dt) if dt in SUPPORTED_DTYPES else 100 + _crc(dt)
        h[OP] = self.op.spec.code if self.op else -1
        h[ROOT] = self.root
        h[NDIM] = len(self.shape)
        h[DIM0] = self.shape[0] if self.shape else 1
        h[REST] = _crc(self.shape[1:])
        h[EXTRA] = _crc((self.extra, self.algorithm) if self.algorithm else self.extra)
        h[SEGMENT] = segment_bytes
        return h

    def describe(self) -> dict[str, Any]:
        """A picklable account of the call, exchanged only when the headers disagree."""
        if self.error is not None:
            kind = "TypeError" if isinstance(self.error, TypeError) else "ValueError"
            return {"error": (kind, str(self.error)), "caller": self.caller,
                    "array": _ARRAY_NAMES[self.array],
                    "setting": self.extra if self.kind == "configure" else ""}
        dt = self.dtype
        return {
            "caller": self.caller,
            "array": _ARRAY_NAMES[self.array],
            "dtype": None if dt is None else dt.name if dt.isnative else
            f"{dt.name} ({_endian(dt)})",
            "shape": self.shape,
            "op": str(self.op.value) if self.op else "",
            "root": self.root,
            "compression/name": "" if self.kind == "configure" else self.extra,
            "setting": self.extra if self.kind == "configure" else "",
            "algorithm": self.algorithm,
        }


class Agreement:
    """The per-call agreement of one communicator: its exchange buffers and its settings.

    Args:
        transport: what the headers travel over.
        check: compare the headers across ranks (the consistency check).
        inline_bytes: size of the inline slot sent with every header.
        segment_bytes: the ring segment size, part of every header.
    """

    __slots__ = ("_buffers", "check", "inline_bytes", "segment_bytes", "threads", "transport")

    def __init__(self, transport: Transport, *, check: bool, inline_bytes: int,
                 segment_bytes: int) -> None:
        self.transport = transport
        self.check = check
        self.inline_bytes = inline_bytes
        self.segment_bytes = segment_bytes
        self.threads = ThreadNames()
        self._buffers: dict[Any, Any] = {}

    def agree_setting(self, name: str, value: Any, error: Exception | None = None) -> None:
        """Agree that every rank changes setting ``name`` to ``value`` at this point: one
        checked exchange (checked also while the consistency check is off), so that a rank
        changing it alone, to another value, or to an invalid one (``error``) raises the same
        error on every rank instead of leaving the ranks to exchange messages that do not
        match. A rank changing it alone is caught only where the other ranks' calls meeting
        this exchange are checked too: with the consistency check off, their calls exchange
        no header to compare."""
        spec = CallSpec("configure")
        spec.extra, spec.error = f"{name}={value!r}", error
        check, self.check = self.check, True
        try:
            self._exchange(spec)
        finally:
            self.check = check

    def agree(self, spec: CallSpec) -> None:
        """Check the call matches on every rank, raising the same error on every rank if not.

        With the consistency check off nothing is exchanged, and an invalid argument raises
        on its own rank only.
        """
        if not self.check:
            if spec.error is not None:
                raise spec.error
            return
        self._exchange(spec)

    def headers(self, spec: CallSpec) -> np.ndarray:
        """Like ``agree``, returning every rank's header (size x words); the headers are
        exchanged even with the check off, since gathers need every rank's size."""
        if spec.error is not None and not self.check:
            raise spec.error
        recv = self._exchange(spec)
        return np.ascontiguousarray(recv[:, :_HEADER_BYTES]).view(np.int64)

    def allreduce_inline(self, spec: CallSpec, x: Any, out: Any | None, op: ReduceOp) -> Any:
        """Allreduce an array of at most ``inline_bytes`` within the agreement exchange.

        Every rank receives every rank's array and reduces them in rank order, so all ranks
        compute the same bits; latency is one allgather. The small-message path, kept lean.
        """
        t = self.transport
        if spec.error is not None and not self.check:
            raise spec.error
        if self.check:
            recv = self._exchange(spec, x)
            rows = self.inline_rows(recv, x.dtype, x.size)
        else:
            raw = np.empty((t.size, x.nbytes), np.uint8)  # bytes: MPI has no bfloat16
            t.allgather_fixed(np.asarray(_host_bytes(x)), raw)
            rows = raw.view(x.dtype)
            t.stats.add(x.nbytes * (t.size - 1), x.nbytes * (t.size - 1))
        if out is None:
            out = _ops.get(x).empty(x.shape, x.dtype)
        if x.size:
            _reduce_rows(rows, out, op)
        return out

    def exchange_buffers(self) -> tuple[np.ndarray, np.ndarray, memoryview]:
        """The host buffers of the exchange (reused by every call): send, receive, and a
        memoryview of send for cheap byte copies."""
        bufs = self._buffers.get("exchange")
        if bufs is None:
            nbytes = _HEADER_BYTES + self.inline_bytes
            send = np.zeros(nbytes, np.uint8)
            bufs = self._buffers["exchange"] = (
                send, np.empty((self.transport.size, nbytes), np.uint8), memoryview(send))
        return bufs

    def inline_rows(self, recv: np.ndarray, dtype: np.dtype, size: int) -> np.ndarray:
        """The (ranks x ``size``) ``dtype`` view of the inlined arrays in ``recv`` (cached)."""
        key = ("rows", dtype, size)
        rows = self._buffers.get(key)
        if rows is None:
            skip = _HEADER_BYTES // dtype.itemsize
            rows = self._buffers[key] = recv.view(dtype)[:, skip: skip + size]
        return rows

    def release(self) -> None:
        """Drop the exchange buffers."""
        self._buffers.clear()

    def _exchange(self, spec: CallSpec, inline: Any | None = None) -> np.ndarray:
        """One fixed-size allgather of every rank's header (and inlined array); with the check
        on, raise on every rank if the headers disagree."""
        t = self.transport
        if self.check and spec.error is None:
            twins = self.threads.conflict(spec.caller)
            if twins is not None:
                spec = spec.with_error(twins)
        send, recv, view = self.exchange_buffers()
        header = spec.header(self.segment_bytes)
        view[:_HEADER_BYTES] = header
        if inline is not None:
            view[_HEADER_BYTES:_HEADER_BYTES + inline.nbytes] = _host_bytes(inline)
        t.allgather_fixed(send, recv)
        stats, volume = t.stats, send.nbytes * (t.size - 1)
        stats.bytes_sent += volume
        stats.bytes_received += volume
        if self.check and (spec.error is not None
                           or recv[:, :_HEADER_BYTES].tobytes() != header * t.size):
            self.verify(spec, np.ascontiguousarray(recv[:, :_HEADER_BYTES]).view(np.int64))
        return recv

    def verify(self, spec: CallSpec, headers: np.ndarray) -> None:
        """Raise the error every rank raises if ``headers`` (every rank's) disagree."""
        differ = (headers != headers[0]).any(axis=0)
        for field in _MAY_DIFFER.get(spec.kind, ()):
            differ[field] = False
        if not differ.any() and not headers[:, ERROR].any():
            return
        # Headers disagree: every rank takes the slow path, so descriptions can be exchanged.
        mine = {**spec.describe(), "kind": spec.kind, "segment_bytes": self.segment_bytes}
        raise _build_error(self.transport.allgather_object(mine))


def _endian(dt: np.dtype) -> str:
    return "big-endian" if dt.byteorder == ">" else "little-endian"


def _host_bytes(x: Any) -> memoryview:
    if type(x) is not np.ndarray or not x.flags.c_contiguous:
        xp = _ops.get(x)
        x = xp.to_host(xp.ascontiguous(x))
    # 1-d bytes: memoryview cannot cast an n-d view with a zero in its shape (shape (0, 5)),
    # nor bfloat16 (ml_dtypes), which has no buffer format of its own.
    return memoryview(x.reshape(-1).view(np.uint8))


class InlinePlan:
    """A small host allreduce seen before, prepared for its repeats (every training step).

    Holds the call's header and views of the exchange buffers (where the array goes, every
    rank's received header and inlined row), so a repeat costs one copy in, one allgather, a
    comparison per rank and one reduction. A repeat with other arguments on another rank
    still fails the header comparison and raises the full error.
    """

    __slots__ = ("agreement", "allgather", "buffers", "data", "dtype", "header",
                 "heads", "nbytes", "op", "pair", "rows", "shape", "spec", "stats", "threads",
                 "ufunc", "volume")

    def __init__(self, agreement: Agreement, spec: CallSpec, x: np.ndarray,
                 op: ReduceOp) -> None:
        self.agreement, self.spec, self.op = agreement, spec, op
        self.threads = agreement.threads
        t = agreement.transport
        self.allgather, self.stats = t.allgather_fixed, t.stats
        self.shape, self.dtype, self.nbytes = x.shape, x.dtype, x.nbytes
        self.header = spec.header(agreement.segment_bytes)
        self.buffers = agreement.exchange_buffers()
        self.rows = agreement.inline_rows(self.buffers[1], x.dtype, x.size)
        self.volume = self.buffers[0].nbytes * (t.size - 1)
        # Views made once, as each costs a few hundred ns on a path of a few microseconds:
        # where x's bytes go, each rank's received header, and the two rows of a 2-rank job.
        _, recv, view = self.buffers
        self.data = view[_HEADER_BYTES:_HEADER_BYTES + self.nbytes]
        received = memoryview(recv).cast("B")
        self.heads = [received[r * recv.shape[1]: r * recv.shape[1] + _HEADER_BYTES]
                      for r in range(t.size)]
        self.pair = tuple(self.rows) if t.size == 2 and self._direct(x.dtype, op) else None
        self.ufunc = _UFUNCS[op]

    @staticmethod
    def _direct(dtype: np.dtype, op: ReduceOp) -> bool:
        """Whether two rows reduce with one ufunc call into the result (see _reduce_rows)."""
        return dtype.itemsize != 2 and op is not ReduceOp.AVG

    @staticmethod
    def applies(agreement: Agreement, x: Any) -> bool:
        """Whether a plan can serve ``x``: checked, host, contiguous, small, bufferable."""
        return (agreement.check and type(x) is np.ndarray and x.flags.c_contiguous
                and x.nbytes <= agreement.inline_bytes and x.dtype.kind != "V")

    def fits(self, out: Any) -> bool:
        return (type(out) is np.ndarray and out.shape == self.shape and out.dtype == self.dtype
                and out.flags.writeable)

    def run(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        name, twins = self.threads.caller()
        if name != self.spec.caller:  # another thread repeats the call: its own header
            self.spec.caller = name
            self.header = self.spec.header(self.agreement.segment_bytes)
        if twins is not None:  # raised on every rank
            self.agreement._exchange(self.spec.with_error(twins))
        send, recv, view = self.buffers
        view[:_HEADER_BYTES] = self.header
        if self.nbytes:
            self.data[:] = memoryview(x).cast("B")
        self.allgather(send, recv)
        stats = self.stats
        stats.bytes_sent += self.volume
        stats.bytes_received += self.volume
        header = self.header
        for head in self.heads:
            if head != header:
                self.agreement.verify(self.spec, np.ascontiguousarray(
                    recv[:, :_HEADER_BYTES]).view(np.int64))
                break
        result = np.empty(self.shape, self.dtype) if out is None else out
        if self.nbytes:
            pair = self.pair
            if pair is not None and result.flags.c_contiguous:
                self.ufunc(pair[0], pair[1], out=result.reshape(-1))
            else:
                _reduce_rows(self.rows, result, self.op)
        return result


def _reduce_rows(rows: np.ndarray, result: Any, op: ReduceOp) -> None:
    ufunc = _UFUNCS[op]
    if rows.dtype.itemsize != 2 and type(result) is np.ndarray and result.flags.c_contiguous:
        acc = result.reshape(-1)
        if rows.shape[0] == 2:
            first, second = rows
            ufunc(first, second, out=acc)
        else:
            ufunc.reduce(rows, axis=0, out=acc)
        if op == "avg":
            np.divide(acc, rows.shape[0], out=acc)
        return
    # 16-bit floats accumulate in float32 and round once; device or strided results are
    # written from a host buffer.
    acc = ufunc.reduce(rows, axis=0, dtype=np.float32 if rows.dtype.itemsize == 2 else None)
    if op == "avg":
        np.divide(acc, rows.shape[0], out=acc)
    _ops.get(result).copy_from_host(result, acc.reshape(result.shape))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def rank_groups(values: list[Any]) -> str:
    """'v1 on ranks 0, 2; v2 on rank 1'."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    # An empty value (a call without compression) is shown as "none", never as a blank.
    return "; ".join(f"{v if v != '' else 'none'!s} on {_ranks(rs)}"
                     for v, rs in groups.items())


def _build_error(descriptions: list[dict[str, Any]]) -> Exception:
    """The one error every rank raises, built from every rank's description of its call."""
    everyone = tuple(range(len(descriptions)))
    kinds = [d["kind"] for d in descriptions]
    called = "/".join(dict.fromkeys(kinds))
    callers = [d["caller"] for d in descriptions]
    if len(set(callers)) > 1:
        return ArgumentMismatchError(
            f"{called}: the calls that met come from different threads:"
            f" {rank_groups([repr(c) for c in callers])}. Calls from several threads are "
            "matched by thread name: make each collective from the same-named thread on every "
            "rank",
            kind=called, ranks=everyone, differences={"caller": tuple(callers)})
    if len(set(kinds)) > 1:
        calls = [f"a change of {d['setting']}" if d["kind"] == "configure" else d["kind"]
                 for d in descriptions]
        return ArgumentMismatchError(
            f"collective calls differ between ranks: {rank_groups(calls)}", kind=called,
            ranks=everyone, differences={"kind": tuple(kinds)})
    kind = kinds[0]
    errors: dict[tuple[str, str], list[int]] = {}
    for r, d in enumerate(descriptions):
        if "error" in d:
            errors.setdefault(d["error"], []).append(r)
    if errors:
        (etype, msg), ranks = next(iter(errors.items()))
        cls = InvalidTypeError if etype == "TypeError" else InvalidArgumentError
        return cls(f"{kind} failed on {_ranks(ranks)}: {msg}", kind=kind, ranks=tuple(ranks),
                   reason=msg)
    parts, differences = [], {}
    for field in ("array", "dtype", "shape", "op", "root", "compression/name", "setting",
                  "algorithm", "segment_bytes"):
        if kind == "allgatherv" and field == "shape":
            values = [d["shape"][1:] for d in descriptions]
            field = "shape after the first dimension"
        else:
            values = [d[field] for d in descriptions]
        if len(set(values)) <= 1:
            continue
        differences[field] = tuple(values)
        parts.append(f"{field} differs between ranks: {rank_groups(values)}")
    hint = " (use allgatherv when the first dimension differs)" if kind == "allgather" else ""
    if "array" in differences:
        hint += (" (every rank must pass the same kind of array, host or device: on the NCCL "
                 "backend they travel different paths)")
    cls = DtypeMismatchError if "dtype" in differences else ArgumentMismatchError
    message = f"{kind}: " + "; ".join(parts or ["arguments differ between ranks"]) + hint
    return cls(message, kind=kind, ranks=everyone, differences=differences)


# Looked up once: this is the small-message path, where every attribute access shows.
_UFUNCS = {op: getattr(np, op.spec.ufunc) for op in ReduceOp}
