"""Reduction ops, dtype rules, wire statistics, errors: the vocabulary every layer shares.

This module is the bottom layer: it imports nothing from ringcomm, and every other module may
import it. Each concept has one table here (reduce ops with their NumPy, CUDA and NCCL names;
supported dtypes), which every layer reads instead of keeping its own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeAlias

import numpy as np

__all__ = [
    "DEFAULT_INLINE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "RING",
    "SUPPORTED_DTYPES",
    "USER",
    "ArgumentMismatchError",
    "Array",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommStats",
    "DtypeMismatchError",
    "Exchange",
    "InvalidArgumentError",
    "InvalidTypeError",
    "OpSpec",
    "ReduceOp",
    "Request",
    "Transport",
    "accumulation_dtype",
    "check_dtype",
    "check_movable",
    "check_op",
]

#: What collectives take and return: a NumPy array (host memory) or a CuPy array (a GPU's),
#: of a dtype in SUPPORTED_DTYPES. An alias, not a protocol: CuPy is imported only where a
#: device array is met, so neither type can appear in an annotation evaluated at import.
Array: TypeAlias = Any

#: Dense allreduces of up to this many bytes ride in the agreement message (see comm.agree).
DEFAULT_INLINE_BYTES = 4096

#: Seconds a collective may wait for its peers before it fails (``ringcomm.init(timeout=)``).
DEFAULT_TIMEOUT_S = 1800.0


class ReduceOp(str, enum.Enum):
    """Reduction applied elementwise across ranks."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    # Hash like the plain string, so that "sum" and ReduceOp.SUM find the same dict entry.
    __hash__ = str.__hash__

    @property
    def spec(self) -> OpSpec:
        """How every layer spells this op (NumPy/CuPy ufunc, CUDA functor, NCCL enum)."""
        return OP_TABLE[self]

    @classmethod
    def parse(cls, op: str | ReduceOp) -> ReduceOp:
        """Return the ReduceOp named by ``op`` ("sum", "avg", "min", "max", "prod").

        Raises:
            ValueError: ``op`` names no reduction.
        """
        try:
            return _OPS[op]
        except (KeyError, TypeError):
            pass
        if isinstance(op, str) and op.lower() in _OPS:
            return _OPS[op.lower()]
        names = ", ".join(repr(o.value) for o in cls)
        raise ValueError(f"unknown op {op!r}; expected one of {names}") from None


_OPS: dict[Any, ReduceOp] = {**{o.value: o for o in ReduceOp}, **{o: o for o in ReduceOp}}


class OpSpec(NamedTuple):
    """One reduce op as each layer names it."""

    code: int  #: its number in the cross-rank agreement header
    ufunc: str  #: the NumPy (and CuPy) ufunc that combines two contributions
    kernel: str  #: the functor of kernels/common.cuh that the CUDA reduce kernels take
    nccl: int  #: NCCL's ncclRedOp_t


#: The one table of reduce ops. AVG combines like SUM; the algorithms divide once at the end.
OP_TABLE: dict[ReduceOp, OpSpec] = {
    ReduceOp.SUM: OpSpec(0, "add", "rc::OpSum", 0),
    ReduceOp.AVG: OpSpec(1, "add", "rc::OpSum", 4),
    ReduceOp.MIN: OpSpec(2, "minimum", "rc::OpMin", 3),
    ReduceOp.MAX: OpSpec(3, "maximum", "rc::OpMax", 2),
    ReduceOp.PROD: OpSpec(4, "multiply", "rc::OpProd", 1),
}


def drops_nan_natively(op: ReduceOp, dtype: Any) -> bool:
    """Whether a library's own reduction may lose a NaN for ``op`` on ``dtype``: the min and max
    of floats (and bfloat16's bytes), which MPI computes as ``a > b ? a : b`` (keeping or
    dropping a NaN by which rank's operand comes first) and NCCL as ``fmaxf``/``fminf`` (which
    drop it). ringcomm's own reductions propagate a NaN, as NumPy's ``maximum`` does, so such
    calls take its ring."""
    return op in (ReduceOp.MIN, ReduceOp.MAX) and np.dtype(dtype).kind in "fcV"


# Order matters: the position is the dtype's code in the cross-rank consistency check.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")
)
# Dtypes already accepted, for a check that costs one dict lookup. bfloat16 (ml_dtypes on the
# host, CuPy/DLPack on the device) joins on first sight.
_ACCEPTED: dict[Any, np.dtype] = {dt: dt for dt in SUPPORTED_DTYPES}


def check_dtype(dtype: Any) -> np.dtype:
    """Return ``dtype`` as a NumPy dtype if ringcomm can reduce it.

    Raises:
        TypeError: complex, bool, object, string or any other dtype outside SUPPORTED_DTYPES.
    """
    dt = _ACCEPTED.get(dtype)
    if dt is not None:
        return dt
    dt = np.dtype(dtype)
    if dt in SUPPORTED_DTYPES or dt.name == "bfloat16":
        _ACCEPTED[dtype] = dt
        return dt
    names = ", ".join(d.name for d in SUPPORTED_DTYPES)
    raise TypeError(f"unsupported dtype {dt.name}; expected one of {names} or bfloat16")


def check_movable(dtype: Any) -> np.dtype:
    """Return ``dtype`` if collectives that only move bytes (broadcast, allgather) can carry it:
    any dtype but object (bool, int8, uint8, complex and bfloat16 included).

    Raises:
        TypeError: an object dtype (its elements are pointers, meaningless on another rank).
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"cannot send arrays of dtype {dt.name}: they hold Python objects")
    return dt


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype partial sums are kept in: float32 for 16-bit floats, the dtype itself otherwise."""
    return _FLOAT32 if dtype.itemsize == 2 and dtype.kind in "fV" else dtype


_FLOAT32 = np.dtype(np.float32)


def check_op(op: str | ReduceOp, dtype: np.dtype) -> ReduceOp:
    """Parse ``op`` and check it suits ``dtype``.

    Raises:
        ValueError: unknown op.
        TypeError: "avg" on an integer dtype (an integer mean would silently truncate).
    """
    rop = ReduceOp.parse(op)
    if rop is ReduceOp.AVG and dtype.kind in ("i", "u"):
        raise TypeError(
            f"op 'avg' needs a floating dtype, got {dtype.name}; use op='sum' and divide"
        )
    return rop


class CommStats:
    """What a communicator put on the wire since its creation or last ``reset()``.

    Bytes are counted where they are handed to the transport: every point-to-point message of
    ringcomm's own algorithms, and every agreement header. Collectives that are handed whole to
    the backend's library (allgather, allgatherv, broadcast) count the data each rank must
    receive and its own data once per peer that receives it, whatever algorithm the library
    picks. ``calls`` counts collective and point-to-point calls, not barriers.
    """

    __slots__ = ("bytes_received", "bytes_sent", "calls")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        self.bytes_sent = self.bytes_received = self.calls = 0

    def add(self, sent: int, received: int) -> None:
        """Count ``sent`` and ``received`` bytes."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def __repr__(self) -> str:
        return (
            f"CommStats(calls={self.calls}, bytes_sent={self.bytes_sent}, "
            f"bytes_received={self.bytes_received})"
        )


class Request(Protocol):
    """A posted point-to-point exchange; ``wait()`` returns once its buffers may be reused."""

    def wait(self) -> None: ...


#: Channels of ``Transport.isendrecv``: messages on one channel never match the other's.
RING, USER = 0, 1


class Exchange(Protocol):
    """Every rank's message to every rank, the per-call exchange of the agreement.

    ``recv`` holds one row per rank; ``send`` is this rank's message (``row_bytes`` long, and
    perhaps this rank's row of ``recv`` itself). Calling the exchange with ``nbytes`` sends the
    first ``nbytes`` of ``send`` to every rank and waits, within the transport's timeout, until
    every rank's message (or its first chunk, with the header: see ``rest``) is in the start
    of its row (collective). With ``sized``, ranks may
    send different lengths and each row past its rank's message keeps older bytes; without
    it, the whole of ``send`` travels whatever ``nbytes`` says (one fixed-size allgather).
    """

    send: np.ndarray
    recv: np.ndarray
    sized: bool
    #: Messages up to this many bytes travel whole (longer ones may go in chunks).
    whole_bytes: int

    def __call__(self, nbytes: int) -> None: ...

    def start(self, nbytes: int) -> Any:
        """Begin the exchange ``__call__`` makes; ``finish`` with what this returns completes
        it. What the caller does between the two (bookkeeping, allocating the result) runs
        while the messages travel. An exchange that cannot be split runs whole here."""

    def finish(self, started: Any) -> None:
        """Complete the exchange ``start`` began, within the transport's timeout: every
        rank's message, or, for a message sent in chunks, every rank's first chunk (which
        holds the header: see ``rest``)."""

    def rest(self, nbytes: int) -> None:
        """Once every rank's header is found equal to this rank's (so every message is
        ``nbytes`` long): receive what follows the first chunks; nothing where messages
        travel whole."""

    def drain(self, lengths: list[int]) -> None:
        """Once the headers are found to differ, with every rank's message length: receive
        what the longer messages still had on the way, so that none is left to match a
        later exchange; nothing where messages travel whole."""

    def moved(self, nbytes: int) -> int:
        """Bytes one call with ``nbytes`` sends (and receives) on this rank."""

    def fused_allreduce(self, nbytes: int, header: bytes, dtype: np.dtype, op: str) -> Any:
        """The exchange of a message of ``nbytes`` (``header``, then a 1-d array of
        ``dtype``) and the reduction by ``op`` of every rank's array, in rank order, as one
        compiled call, or None where the exchange has none for it. Its ``start(x, out)``,
        with the array and a 1-d result, returns 0 (reduced, with the bits of
        ``ufunc.reduce`` over the rows) or a code for ``finish(code, out)``, which returns 0,
        2 (a rank's header differs: nothing reduced; its ``reduce(out)`` reduces once the
        caller has found the difference allowed) or 4 (its requests were freed: nothing sent,
        the caller runs the call another way); its ``set_header`` changes the header."""


class Transport(Protocol):
    """What the algorithms (ring, compressed rings, agreement) need from a backend.

    A Transport connects ``size`` processes; every collective member must be called by all of
    them in the same order. Arrays are contiguous and 1-d; a backend takes the array kinds it
    can move (``check_arrays`` says which). Algorithms receive a Transport, never a
    Communicator; a backend is one module implementing this protocol.

    Attributes:
        backend: the backend's name ("mpi", "nccl", "gloo", "threads").
        rank: this process's rank, 0 <= rank < size.
        size: the number of processes.
        local_rank: this process's rank among the transport's ranks on its host.
        local_size: how many of the transport's ranks run on this host.
        operation: the collective in progress ("allreduce", ...), set by the Communicator
            before it calls the transport, for error messages (a timeout names it).
        stats: bytes on the wire; the algorithms add what they send and receive.
        world_ranks, world_size: each rank as the whole job numbers it, and the job's size
            (a sub-group's differ from its own), for error messages.

    Optional capabilities, with defaults in ``ringcomm.comm.transport.TransportBase``:
        timeout: seconds any wait for the other ranks may last.
        abort_on_timeout: end the job on a timeout, or raise CollectiveTimeoutError.
        failure: the error that aborted the transport (it then refuses every call), or None.
        device_id: the CUDA device of the transport's device work, or None.
        routes_arrays: whether ``transport_for`` may answer another transport.
        follows_nodes_on_device: whether the library's own collectives of device arrays
            already follow the node structure (NCCL).
        moves_device_arrays: whether device arrays travel as they are (NCCL, a CUDA-aware
            MPI), or are copied through host memory on the way (gloo, other MPIs).
        starts_native_allreduce: whether ``start_native_allreduce`` starts the library's
            own allreduce of host and device arrays as they are (gloo, which copies device
            arrays through pinned host memory itself).
        device_segments: the segments the ring cuts a chunk of device arrays into at most
            (None: the ring's default), the same on every rank of the backend.
        default_inline_bytes: the largest dense allreduce that rides in the agreement's
            exchange where the user sets none (the same on every rank).
    """

    backend: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    operation: str
    stats: CommStats
    world_ranks: tuple[int, ...]
    world_size: int
    timeout: float
    abort_on_timeout: bool
    routes_arrays: bool
    follows_nodes_on_device: bool
    moves_device_arrays: bool
    starts_native_allreduce: bool
    device_segments: int | None

    @property
    def failure(self) -> Exception | None:
        """The error that aborted the transport, or None (read-only)."""

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the transport fails (after which it refuses every call)."""

    def fail(self, error: Exception) -> None:
        """Mark the transport failed with ``error`` (a wait on it, or on a transport split
        from it, timed out): every later call is refused."""

    @property
    def default_inline_bytes(self) -> int:
        """The inline size where the user sets none (read-only)."""

    @property
    def device_id(self) -> int | None:
        """The CUDA device of the transport's device work, or None (read-only)."""

    def transport_for(self, x: Array) -> Transport:
        """The transport that moves arrays like ``x`` (NCCL: its host transport for host
        arrays); this one by default."""

    def device_scope(self) -> Any:
        """A context making the transport's CUDA device current (a no-op by default)."""

    def wait_gpu(self, what: str) -> None:
        """Wait, within the timeout, for the device work queued so far on the current
        stream (nothing to wait for by default)."""

    def isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int, *,
                  channel: int = RING) -> Request:
        """Post a send of ``send`` to ``dest`` and a receive into ``recv`` from ``source``.

        Either may be None. Messages between a pair of ranks on one channel are matched in
        posting order; the ring uses RING, a user's ``sendrecv`` USER.
        """

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Allgather equal-sized host byte buffers (``recv`` holds size * send.nbytes)."""

    def prepare_allgather(self, send: np.ndarray, recv: np.ndarray) -> Callable[[], None]:
        """``allgather_fixed(send, recv)`` prepared for repeated calls on the same buffers:
        each call of the result runs it (collective). Prepare it at the same point of the
        call sequence on every rank (a persistent collective's setup counts as one)."""

    def prepare_exchange(self, row_bytes: int) -> Exchange:
        """The agreement's exchange of messages of up to ``row_bytes`` (see :class:`Exchange`),
        made at the same point of the call sequence on every rank. By default a prepared
        fixed-size allgather (``sized`` False); MPI sends each rank's own length."""

    def allgatherv(self, x: Array, counts: list[int], out: Array) -> None:
        """Gather 1-d ``x`` from every rank into ``out``, rank r's part holding counts[r]."""

    def broadcast(self, x: Array, root: int) -> None:
        """Overwrite contiguous ``x`` with root's, in place."""

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank, in rank order."""

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""

    def scratch(self, key: str, like: Array, n: int, dtype: Any) -> Array:
        """A buffer of ``n`` elements on ``like``'s device, kept between calls under ``key``."""

    def check_arrays(self, *arrays: Array) -> None:
        """Raise TypeError/ValueError if this backend cannot move ``arrays`` (None skipped)."""

    def native_allreduce(self, x: Array, out: Array, op: ReduceOp) -> bool:
        """Allreduce with the library's own algorithm if it has one that suits; False if not
        (the ring runs instead)."""

    def prepare_native_allreduce(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                                 ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """The library's own allreduce of contiguous host arrays of ``dtype`` and ``nbytes``
        with ``op``, prepared for repeated calls: the result, called with ``(x, out)``
        (``out`` may be ``x``), does what ``native_allreduce(x, out, op)`` would do. None
        where ``native_allreduce`` would return False for such arrays. Plans are prepared
        before their call is agreed, on some ranks only: this sets up nothing collective
        (what needs a collective set-up is made at the result's first call)."""

    def takes_native_start(self, x: Array, op: ReduceOp) -> bool:
        """Whether ``start_native_allreduce`` would start an (agreed, dense, flat) allreduce
        of ``x`` with ``op``: decided from the call's dtype, size and op and settings every
        rank holds alike, before the call is agreed (a rank that decides otherwise passed
        another call, which the agreement then refuses on every rank)."""

    def finished_allreduce(self, x: Array) -> Any:
        """What ``start_native_allreduce`` returns, completed, for an allreduce of ``x`` that
        the caller ran in place (where ``takes_native_start`` said it would start)."""

    def start_native_allreduce(self, x: Array, op: ReduceOp) -> Any | None:
        """Start the library's own allreduce of ``x`` in place (an agreed, dense, flat call) on
        threads of the library's own, and return its pending result (gloo: a
        ``torch.futures.Future`` of the reduced tensor); None where it has none for ``x``
        (the caller runs the call itself). Decided from what the ranks agreed on alone."""

    def native_reduce_scatter(self, x: Array, op: ReduceOp) -> Array | None:
        """This rank's chunk of the library's own reduce-scatter, or None (the ring runs)."""

    def split(self, color: int, key: int) -> Transport:
        """A Transport over the ranks that pass the same ``color``, ordered by (key, rank).

        Collective over this transport. The new transport is independent of this one: its
        messages never match this one's.
        """

    def close(self) -> None:
        """Release the transport's resources."""


class CollectiveError(Exception):
    """A collective failed: refused its arguments on every rank alike (the communicator stays
    usable), or, for CollectiveTimeoutError, waited too long (it is then unusable).

    Raised as one of its subclasses, each also a ValueError or TypeError (whichever the
    problem is), so code that catches those keeps working. The fields say what happened
    without parsing the message.

    Attributes:
        kind: the collective ("allreduce", "broadcast", ...).
        ranks: the ranks whose arguments were invalid (InvalidArgumentError), or every rank
            (ArgumentMismatchError).
        differences: field name -> the value on each rank, in rank order, for every field
            that differs between ranks (empty for InvalidArgumentError).
        reason: the local error's message on the first failing rank (InvalidArgumentError).
    """

    def __init__(self, message: str, *, kind: str = "", ranks: tuple[int, ...] = (),
                 differences: dict[str, tuple[Any, ...]] | None = None,
                 reason: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = tuple(ranks)
        self.differences = dict(differences or {})
        self.reason = reason


class InvalidArgumentError(CollectiveError, ValueError):
    """An argument was invalid on some ranks (raised on every rank)."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument was of a type or dtype the collective cannot take, on some ranks."""


class ArgumentMismatchError(CollectiveError, ValueError):
    """Arguments differ between ranks, or the ranks called different collectives."""


class DtypeMismatchError(ArgumentMismatchError, TypeError):
    """The dtype differs between ranks."""


class CollectiveTimeoutError(CollectiveError, RuntimeError):
    """A collective waited longer than the timeout for its peers (dead, stopped or elsewhere).

    Unlike the other CollectiveErrors, this one leaves the communicator unusable: messages of
    the interrupted collective may still be in flight and would match a later call's, so close
    it and end the job. The MPI backend ends the job itself (``MPI_Abort``) unless it was built
    with ``abort_on_timeout=False``.

    Attributes:
        kind: the collective that timed out (the transport's ``operation``: "allreduce", ...).
        peer: the rank waited for where one is known (the sender of a receive, such as the
            ring's left neighbour), or None (a collective waits for every rank).
        elapsed: seconds waited before giving up.
        timeout: the timeout in seconds.
    """

    def __init__(self, message: str, *, kind: str = "", peer: int | None = None,
                 elapsed: float = 0.0, timeout: float = 0.0) -> None:
        super().__init__(message, kind=kind)
        self.peer = peer
        self.elapsed = float(elapsed)
        self.timeout = float(timeout)
