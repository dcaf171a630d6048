"""Cross-rank agreement on a collective's arguments, before any data moves.

Every collective starts with one exchange of a small header per rank: what the call is, the
kind of array (host or device: on the NCCL backend they take different paths), the dtype,
shape, op, root, compression and name, and whether the arguments were valid on that rank. If
any rank's arguments were invalid or the headers disagree, every rank raises the same error
naming what differs, and the communicator stays usable. Arrays of up to ``comm.inline_bytes``
ride in the same message, so a small allreduce is complete after this one exchange
(:mod:`ringcomm.comm._inline`). The exchange is the transport's
(:class:`~ringcomm.core.types.Exchange`): over MPI each rank sends its own length (a header
alone is 96 bytes); elsewhere it is a fixed-size allgather whose slot travels with every
collective.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm._mismatch import build_error
from ringcomm.comm.callers import ThreadNames, caller
from ringcomm.core.digest import fingerprint
from ringcomm.core.types import (
    DEFAULT_INLINE_BYTES,
    SUPPORTED_DTYPES,
    Array,
    Exchange,
    ReduceOp,
    Transport,
    check_dtype,
    check_movable,
)

__all__ = ["HEADER_BYTES", "INLINE_BYTES", "Agreement", "CallSpec", "ExchangeBuffers", "host_bytes"]

INLINE_BYTES = DEFAULT_INLINE_BYTES
# Header words, in order.
KIND, ERROR, DTYPE, OP, ROOT, NDIM, DIM0, REST, EXTRA, SEGMENT, CALLER, ARRAY = range(12)
_WORDS = 12
# The ARRAY word: what kind of array a rank passed (a barrier passes none).
_HOST, _DEVICE = 1, 2
_ARRAY_NAMES = {0: "none", _HOST: "host (NumPy)", _DEVICE: "device (CuPy)"}
HEADER_BYTES = 8 * _WORDS
KINDS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "broadcast", "barrier",
          "configure", "checkpoint")
# Kinds whose spec carries a text of its own (a setting, a point of the program) in ``extra``.
_LABELLED = ("configure", "checkpoint")
# Fields a collective lets differ between ranks.
_MAY_DIFFER = {"allgatherv": (DIM0,)}


_HEADERS: dict[tuple[Any, ...], bytes] = {}


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
        self.op: ReduceOp | Literal[""] = ""
        self.root = 0
        self.extra = ""
        self.algorithm = ""  # allreduce: "auto", "flat" or "hierarchical"
        self.error: Exception | None = None

    def set_array(self, x: Array, *, reduced: bool = True) -> np.dtype:
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
        h[KIND] = KINDS.index(self.kind)
        h[CALLER] = fingerprint(self.caller)
        h[ARRAY] = self.array
        if self.error is not None:
            h[ERROR] = 1
            return h
        dt = self.dtype
        h[DTYPE] = SUPPORTED_DTYPES.index(dt) if dt in SUPPORTED_DTYPES else 100 + fingerprint(dt)
        h[OP] = self.op.spec.code if self.op else -1
        h[ROOT] = self.root
        h[NDIM] = len(self.shape)
        h[DIM0] = self.shape[0] if self.shape else 1
        h[REST] = fingerprint(self.shape[1:])
        h[EXTRA] = fingerprint((self.extra, self.algorithm) if self.algorithm else self.extra)
        h[SEGMENT] = segment_bytes
        return h

    def describe(self) -> dict[str, Any]:
        """A picklable account of the call, exchanged only when the headers disagree."""
        if self.error is not None:
            kind = "TypeError" if isinstance(self.error, TypeError) else "ValueError"
            return {"error": (kind, str(self.error)), "caller": self.caller,
                    "array": _ARRAY_NAMES[self.array],
                    "setting": self.extra if self.kind in _LABELLED else ""}
        dt = self.dtype
        return {
            "caller": self.caller,
            "array": _ARRAY_NAMES[self.array],
            "dtype": None if dt is None else dt.name if dt.isnative else
            f"{dt.name} ({_endian(dt)})",
            "shape": self.shape,
            "op": str(self.op.value) if self.op else "",
            "root": self.root,
            "compression/name": "" if self.kind in _LABELLED else self.extra,
            "setting": self.extra if self.kind in _LABELLED else "",
            "algorithm": self.algorithm,
        }


class ExchangeBuffers(NamedTuple):
    """The exchange's host buffers and the transport's exchange of them."""

    send: np.ndarray  #: this rank's header and inlined array
    recv: np.ndarray  #: every rank's, one row each
    view: memoryview  #: of ``send``, for cheap byte copies
    exchange: Exchange  #: called with the length of this rank's message


class Agreement:
    """The per-call agreement of one communicator: its exchange buffers and its settings.

    Args:
        transport: what the headers travel over.
        check: compare the headers across ranks (the consistency check).
        inline_bytes: the largest array that rides with the header.
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
        self._checked(spec)

    def checkpoint(self, label: str, error: Exception | None = None) -> None:
        """Agree that every rank is at the point of the program ``label`` names: one checked
        exchange (also while the consistency check is off), which raises the same error on
        every rank where another rank is at another point or in a collective, or where a
        rank has ``error``."""
        spec = CallSpec("checkpoint")
        spec.extra, spec.error = label, error
        self._checked(spec)

    def _checked(self, spec: CallSpec) -> None:
        check, self.check = self.check, True
        try:
            self.exchange(spec)
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
        self.exchange(spec)

    def headers(self, spec: CallSpec) -> np.ndarray:
        """Like ``agree``, returning every rank's header (size x words); the headers are
        exchanged even with the check off, since gathers need every rank's size."""
        if spec.error is not None and not self.check:
            raise spec.error
        recv = self.exchange(spec)
        return np.ascontiguousarray(recv[:, :HEADER_BYTES]).view(np.int64)

    def exchange_buffers(self) -> ExchangeBuffers:
        """The host buffers of the exchange, reused by every call, with the transport's
        exchange of them (made by the first exchange, at the same call on every rank)."""
        bufs = self._buffers.get("exchange")
        if bufs is None:
            exchange = self.transport.prepare_exchange(HEADER_BYTES + self.inline_bytes)
            bufs = self._buffers["exchange"] = ExchangeBuffers(
                exchange.send, exchange.recv, exchange.send.data, exchange)
        return bufs

    def inline_rows(self, recv: np.ndarray, dtype: np.dtype, size: int) -> np.ndarray:
        """The (ranks x ``size``) ``dtype`` view of the inlined arrays in ``recv`` (cached)."""
        key = ("rows", dtype, size)
        rows = self._buffers.get(key)
        if rows is None:
            skip = HEADER_BYTES // dtype.itemsize
            rows = self._buffers[key] = recv.view(dtype)[:, skip: skip + size]
        return rows

    def release(self) -> None:
        """Drop the exchange buffers."""
        self._buffers.clear()

    def exchange(self, spec: CallSpec, inline: Any | None = None) -> np.ndarray:
        """One exchange of every rank's header (and inlined array); with the check on, raise
        on every rank if the headers disagree."""
        t = self.transport
        if self.check and spec.error is None:
            twins = self.threads.conflict(spec.caller)
            if twins is not None:
                spec = spec.with_error(twins)
        _, recv, view, exchange = self.exchange_buffers()
        header = spec.header(self.segment_bytes)
        view[:HEADER_BYTES] = header
        nbytes = HEADER_BYTES
        if inline is not None:
            nbytes += inline.nbytes
            view[HEADER_BYTES:nbytes] = host_bytes(inline)
        exchange(nbytes)
        stats, volume = t.stats, exchange.moved(nbytes)
        stats.bytes_sent += volume
        stats.bytes_received += volume
        if self.check and (spec.error is not None
                           or recv[:, :HEADER_BYTES].tobytes() != header * t.size):
            self.verify(spec, np.ascontiguousarray(recv[:, :HEADER_BYTES]).view(np.int64),
                        nbytes)
        exchange.rest(nbytes)  # every header equals this one: every message is as long
        return recv

    def verify(self, spec: CallSpec, headers: np.ndarray, message: int = HEADER_BYTES) -> None:
        """Raise the error every rank raises if ``headers`` (every rank's) disagree;
        ``message``: the length of this rank's message in the exchange that brought them."""
        differ = (headers != headers[0]).any(axis=0)
        for field in _MAY_DIFFER.get(spec.kind, ()):
            differ[field] = False
        if not differ.any() and not headers[:, ERROR].any():
            return
        # Headers disagree: every rank takes the slow path, so descriptions can be exchanged,
        # with the length of each rank's message (what of it is still on the way is received).
        mine = {**spec.describe(), "kind": spec.kind, "segment_bytes": self.segment_bytes,
                "message": message}
        everyone = self.transport.allgather_object(mine)
        self.exchange_buffers().exchange.drain([d["message"] for d in everyone])
        raise build_error(everyone)


def _endian(dt: np.dtype) -> str:
    return "big-endian" if dt.byteorder == ">" else "little-endian"


def host_bytes(x: Array) -> memoryview:
    if type(x) is not np.ndarray or not x.flags.c_contiguous:
        xp = _ops.get(x)
        x = xp.to_host(xp.ascontiguous(x))
    # 1-d bytes: memoryview cannot cast an n-d view with a zero in its shape (shape (0, 5)),
    # nor bfloat16 (ml_dtypes), which has no buffer format of its own.
    return memoryview(x.reshape(-1).view(np.uint8))


