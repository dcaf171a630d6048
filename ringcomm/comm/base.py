"""The Communicator interface, and the argument checks every backend shares.

Reduction ops, dtype rules and wire statistics live in :mod:`ringcomm.comm.types` and are
re-exported here.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm import agree
from ringcomm.comm.types import (
    SUPPORTED_DTYPES,
    CommStats,
    ReduceOp,
    Request,
    accumulation_dtype,
    check_dtype,
    check_movable,
    check_op,
)

if TYPE_CHECKING:
    from ringcomm.compress.base import Compressor
    from ringcomm.compress.feedback import ErrorFeedback

__all__ = [
    "SUPPORTED_DTYPES",
    "CommStats",
    "Communicator",
    "ReduceOp",
    "Request",
    "accumulation_dtype",
    "check_dtype",
    "check_movable",
    "check_op",
]


def _check_writeable(x: Any, label: str) -> None:
    flags = getattr(x, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        raise ValueError(f"{label} is read-only; the result is written into it")


def _flat(x: Any) -> Any:
    """A contiguous 1-d view of ``x`` (a copy only when ``x`` is not contiguous)."""
    return _ops.get(x).ascontiguous(x).reshape(-1)


class Communicator(abc.ABC):
    """Collectives over a fixed group of processes, the same on every backend.

    Arrays are NumPy arrays on the MPI backend and CuPy arrays on the NCCL backend (the MPI
    backend also takes CuPy arrays). Every collective must be called by all ranks in the same
    order with matching arguments; with the consistency check on (the default), arguments that
    differ between ranks raise the same error on every rank instead of hanging.
    """

    backend: str = ""

    def __init__(self, rank: int, size: int, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None) -> None:
        from ringcomm import ring

        self._rank = int(rank)
        self._size = int(size)
        self._closed = False
        self.consistency_check = bool(consistency_check)
        self._small: dict[tuple[Any, ...], agree.InlinePlan] = {}
        self.segment_bytes = int(segment_bytes or ring.DEFAULT_SEGMENT_BYTES)
        self._inline_bytes = agree.INLINE_BYTES if inline_bytes is None else int(inline_bytes)
        if self._inline_bytes < 0 or self._inline_bytes % 8:
            raise ValueError(f"inline_bytes must be a multiple of 8 >= 0, got {inline_bytes}")
        self.stats = CommStats()
        self._compressed_calls = 0
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self._plans: dict[tuple[Any, ...], tuple[agree.CallSpec, ReduceOp]] = {}
        self._auto_figures: dict[str, Any] = {}  # link and compressor figures of "auto"
        self._default_auto: Any = None

    # ----------------------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < size."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of processes in the communicator."""
        return self._size

    @property
    def segment_bytes(self) -> int:
        """Ring segment size in bytes; every rank must use the same (checked each call)."""
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: int) -> None:
        if int(value) < 64:
            raise ValueError(f"segment_bytes must be >= 64, got {value}")
        self._segment_bytes = int(value)
        self._small.clear()  # prepared small calls carry the old value in their headers

    @property
    def inline_bytes(self) -> int:
        """Dense arrays up to this size ride in the agreement message (fixed at creation)."""
        return self._inline_bytes

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank {self._rank} of {self._size}"
        return f"<{type(self).__name__} backend={self.backend!r} {state}>"

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ backend primitives
    @abc.abstractmethod
    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int) -> Request:
        """Post a send of ``send`` to ``dest`` and a receive into ``recv`` from ``source``.

        Either side may be None. Messages between a pair of ranks are matched in posting order.
        This is the only primitive the ring uses.
        """

    @abc.abstractmethod
    def _user_isendrecv(self, send: Any, dest: int, recv: Any, source: int) -> Request:
        """Like ``isendrecv``, on a channel apart from the collectives' (for ``sendrecv``)."""

    @abc.abstractmethod
    def _allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Allgather equal-sized host byte buffers (``recv`` holds size * send.nbytes)."""

    @abc.abstractmethod
    def _allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        """Gather ``x`` (1-d) from every rank into ``out``, rank r's part holding counts[r]."""

    @abc.abstractmethod
    def _broadcast(self, x: Any, root: int) -> None:
        """Broadcast contiguous ``x`` from ``root`` in place."""

    @abc.abstractmethod
    def _allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank (used on error paths only)."""

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    def _check_arrays(self, *arrays: Any) -> None:
        """Raise TypeError/ValueError if this backend cannot take ``arrays`` (None skipped).

        Called inside every collective's argument check, so the error reaches every rank.
        """
        return None  # the MPI backend takes NumPy and CuPy arrays alike

    def _reduce_scatter_dense(self, x: Any, op: ReduceOp) -> Any:
        """This rank's chunk of the reduction of flat contiguous ``x``; backends may override."""
        from ringcomm import ring

        return ring.reduce_scatter(self, x, op)

    def _allreduce_dense(self, x: Any, out: Any, op: ReduceOp) -> None:
        """Reduce flat contiguous ``x`` into flat contiguous ``out``; backends may override."""
        from ringcomm import ring

        ring.allreduce(self, x, out, op)

    # ------------------------------------------------------------------------ collectives
    def allreduce(self, x: Any, out: Any | None = None, *, op: str | ReduceOp = "sum",
                  compression: Compressor | None = None, feedback: ErrorFeedback | None = None,
                  name: str | None = None) -> Any:
        """Reduce ``x`` elementwise over all ranks; every rank gets the bit-identical result.

        Args:
            x: array of a supported dtype, any shape, contiguous or not; left untouched unless
                it is also ``out``.
            out: where to write the result (same shape and dtype as ``x``); ``out=x`` reduces in
                place. A new array is returned when omitted.
            op: "sum", "avg", "min", "max" or "prod"; compressed calls take "sum" or "avg".
            compression: a compressor (``FP16()``, ``BF16()``, ``Int8()``, ``TopK()``) for what
                the ring sends; None sends the dtype as it is; "auto" (or an ``Auto``) picks
                per call the fastest of the allowed choices for this link and size.
            feedback: an ErrorFeedback that keeps, under ``name``, what compression did not
                send and adds it to the next call.
            name: the tensor's name; required with ``feedback``, and checked to match across
                ranks.

        Returns:
            The reduced array (``out`` when given), with the shape of ``x``.

        Raises:
            TypeError: unsupported dtype, or an op the dtype does not support.
            ValueError: unknown op, ``out`` of another shape, or arguments that differ between
                ranks (raised on every rank).
            RuntimeError: the communicator is closed.
        """
        if compression is None and feedback is None and type(x) is np.ndarray:
            small = self._small_plan(x, out, op)
            if small is not None:
                self.stats.calls += 1
                return small.run(x, out)
        self._ensure_open()
        if compression is not None:
            if isinstance(compression, str) and compression == "auto":
                compression = self._auto()
            compression, feedback = self._resolve_auto(compression, x, op, feedback, name)
        dense = compression is None and feedback is None
        spec, rop = self._dense_plan(x, out, op) if dense else (None, None)
        if spec is None:
            spec = agree.CallSpec("allreduce")
            try:
                rop = self._check_allreduce(spec, x, out, op, compression, feedback, name)
            except (TypeError, ValueError) as err:
                spec.error, rop = err, ReduceOp.SUM
            else:
                if dense:
                    if len(self._plans) > 4096:  # bounded: shapes can be many
                        self._plans.clear()
                        self._small.clear()
                    self._plans[(type(x), x.dtype, x.shape, op)] = (spec, rop)
                    if agree.InlinePlan.applies(self, x):
                        self._small[(x.dtype, x.shape, op)] = agree.InlinePlan(self, spec, x, rop)
        self.stats.calls += 1
        if dense and spec.error is None and x.nbytes <= self.inline_bytes:
            return agree.allreduce_inline(self, spec, x, out, rop)
        agree.agree(self, spec)
        xp = _ops.get(x)
        result = out if out is not None else xp.empty(x.shape, x.dtype)
        if x.size == 0:
            return result
        direct = result.flags.c_contiguous
        flat_out = result.reshape(-1) if direct else xp.empty((x.size,), x.dtype)
        if dense:
            self._allreduce_dense(_flat(x), flat_out, rop)
        else:
            from ringcomm.compress import algorithms
            from ringcomm.compress.auto import Auto

            if isinstance(compression, Auto):
                compression = compression.resolve(self, x)
            self._compressed_calls += 1
            algorithms.allreduce(self, _flat(x), flat_out, rop, compression, feedback, name)
        if not direct:
            result[...] = flat_out.reshape(x.shape)
        return result

    def reduce_scatter(self, x: Any, *, op: str | ReduceOp = "sum") -> Any:
        """Reduce ``x`` over all ranks and return this rank's chunk of the flattened result.

        Rank r gets elements ``[r * L // size, (r + 1) * L // size)`` of the L reduced elements.
        """
        self._ensure_open()
        spec = agree.CallSpec("reduce_scatter")
        try:
            self._check_arrays(x)
            dt = spec.set_array(x)
            rop = spec.set_op(check_op(op, dt))
        except (TypeError, ValueError) as err:
            spec.error, rop = err, ReduceOp.SUM
        agree.agree(self, spec)
        self.stats.calls += 1
        return self._reduce_scatter_dense(_flat(x), rop)

    def allgather(self, x: Any) -> Any:
        """Concatenate ``x`` from every rank along the first axis, in rank order.

        Any dtype but object: allgather and broadcast only move bytes.

        Every rank must pass the same shape; use ``allgatherv`` when the first dimension differs.
        """
        return self._gather("allgather", x)

    def allgatherv(self, x: Any) -> Any:
        """Concatenate ``x`` from every rank along the first axis; first dimensions may differ."""
        return self._gather("allgatherv", x)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Overwrite ``x`` on every rank with root's ``x``, in place; returns ``x``."""
        self._ensure_open()
        spec = agree.CallSpec("broadcast")
        try:
            self._check_arrays(x)
            spec.set_array(x, reduced=False)
            _check_writeable(x, "x")
            spec.root = self._check_rank(root, "root")
        except (TypeError, ValueError) as err:
            spec.error = err
        agree.agree(self, spec)
        self.stats.calls += 1
        if x.size == 0:
            return x
        if x.flags.c_contiguous:
            self._broadcast(x.reshape(-1), root)
        else:
            flat = _flat(x)
            self._broadcast(flat, root)
            x[...] = flat.reshape(x.shape)
        nbytes = x.nbytes
        self.stats.add(nbytes * (self._size - 1) if self._rank == root else 0,
                       0 if self._rank == root else nbytes)
        return x

    def sendrecv(self, send: Any, dest: int, recv: Any, source: int) -> Any:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``; returns ``recv``.

        A point-to-point call: only the two peers take part, and sizes are not checked across
        ranks (a receive buffer smaller than the message is an error of the backend). It never
        matches a message of a collective in progress.
        """
        self._ensure_open()
        self._check_rank(dest, "dest")
        self._check_rank(source, "source")
        self._check_arrays(send, recv)
        for label, arr in (("send", send), ("recv", recv)):
            if not hasattr(arr, "flags") or not arr.flags.c_contiguous:
                raise ValueError(f"{label} must be a contiguous array, got {type(arr).__name__}")
        self._user_isendrecv(send, dest, recv, source).wait()
        self.stats.calls += 1
        self.stats.add(send.nbytes, recv.nbytes)
        return recv

    def barrier(self) -> None:
        """Block until every rank has called ``barrier()``.

        With the consistency check on, the agreement exchange is the barrier, so a rank in
        another collective meanwhile raises the same error everywhere instead of hanging.
        """
        self._ensure_open()
        if self.consistency_check:
            agree.agree(self, agree.CallSpec("barrier"))
        else:
            self._barrier()

    def close(self) -> None:
        """Release the communicator's resources; later calls raise RuntimeError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._buffers.clear()
            self._small.clear()
            self._plans.clear()
            self._close()

    # ----------------------------------------------------------------------------- helpers
    def scratch(self, key: str, like: Any, n: int, dtype: Any) -> Any:
        """A reusable buffer of ``n`` elements on ``like``'s device, kept between calls.

        Collectives reuse their staging buffers instead of allocating (and page-faulting) new
        ones every call. Two live buffers need two keys.
        """
        xp = _ops.get(like)
        device = getattr(getattr(like, "device", None), "id", None)  # CuPy arrays: the GPU
        k = (key, xp.__name__, device, np.dtype(dtype).str)
        buf = self._buffers.get(k)
        if buf is None or buf.size < n:
            buf = self._buffers[k] = xp.empty((max(n, 1),), dtype)
        return buf[:n]

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")

    def _check_rank(self, r: int, label: str) -> int:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self._size:
            raise ValueError(f"{label} must be a rank in [0, {self._size}), got {r!r}")
        return int(r)

    def _resolve_auto(self, compression: Any, x: Any, op: Any, feedback: Any,
                      name: Any) -> tuple[Any, Any]:
        """Replace an Auto whose figures are known by its choice for ``x``, before the agreement
        (every rank chooses alike from the same figures, and a choice that differs because the
        arguments differ is caught there). A dense choice needs no feedback unless a residual
        is pending, which the compressed path then sends in full."""
        from ringcomm.compress.auto import Auto

        if not isinstance(compression, Auto):
            return compression, feedback
        try:
            # Any argument error must take the checked path, which raises it on every rank.
            from ringcomm.compress.base import check_compressed_call

            check_compressed_call(compression, x, ReduceOp.parse(op), feedback, name)
            check_dtype(x.dtype)
            if not compression.ready(self, x):
                return compression, feedback  # first call: agree first, then measure together
            choice = compression.resolve(self, x)
        except (AttributeError, TypeError, ValueError):
            return compression, feedback
        if choice is None and feedback is not None and name is not None and (
                feedback.residual(name) is not None):
            return compression, feedback  # resolves to dense after the agreement
        return choice, (None if choice is None else feedback)

    def _auto(self) -> Any:
        if self._default_auto is None:
            from ringcomm.compress.auto import Auto

            self._default_auto = Auto()
        return self._default_auto

    def _small_plan(self, x: np.ndarray, out: Any, op: Any) -> agree.InlinePlan | None:
        """The prepared plan of a small host allreduce seen before, if this call can use it."""
        try:
            plan = self._small.get((x.dtype, x.shape, op))
        except TypeError:  # an unhashable op: the full check will say so
            return None
        if (plan is None or self._closed or not x.flags.c_contiguous
                or (out is not None and not plan.fits(out))):
            return None
        return plan

    def _dense_plan(self, x: Any, out: Any, op: Any) -> tuple[Any, Any]:
        """The checked spec of an uncompressed allreduce seen before, or (None, None).

        Repeated calls (the same tensor every training step) skip re-validating their
        arguments; anything not seen before, and every error, takes the full check.
        """
        if type(x) is not np.ndarray:  # device arrays: their device is checked every call
            return None, None
        try:
            plan = self._plans.get((type(x), x.dtype, x.shape, op))
        except (AttributeError, TypeError):  # not an array, or an unhashable op
            return None, None
        if plan is None or (out is not None and (
                type(out) is not type(x) or out.shape != x.shape or out.dtype != x.dtype
                or not out.flags.writeable)):
            return None, None
        return plan

    def _check_allreduce(self, spec: agree.CallSpec, x: Any, out: Any, op: Any,
                         compression: Any, feedback: Any, name: Any) -> ReduceOp:
        self._check_arrays(x, out)
        dt = spec.set_array(x)
        rop = spec.set_op(check_op(op, dt))
        if out is not None:
            if type(out) is not type(x):
                raise TypeError(f"out is a {type(out).__name__}, expected a {type(x).__name__}")
            if out.shape != x.shape:
                raise ValueError(f"out has shape {out.shape}, expected {x.shape}")
            if out.dtype != x.dtype:
                raise TypeError(f"out has dtype {out.dtype}, expected {x.dtype}")
            _check_writeable(out, "out")
        if compression is not None:
            from ringcomm.compress.base import check_compressed_call

            check_compressed_call(compression, x, rop, feedback, name)
            spec.extra = f"{compression!r}|{name}"
        elif feedback is not None:
            raise ValueError("feedback needs a lossy compression; got compression=None")
        return rop

    def _inline_rows(self, recv: np.ndarray, dtype: np.dtype, size: int,
                     offset: int) -> np.ndarray:
        """The (size x ``size``) ``dtype`` view of the inlined arrays in ``recv`` (cached)."""
        key = ("rows", dtype, size)
        rows = self._buffers.get(key)
        if rows is None:
            skip = offset // dtype.itemsize
            rows = self._buffers[key] = recv.view(dtype)[:, skip: skip + size]
        return rows

    def _exchange_buffers(self, nbytes: int) -> tuple[np.ndarray, np.ndarray, memoryview]:
        """The host buffers of the agreement exchange (reused by every call): send, receive,
        and a memoryview of send for cheap byte copies."""
        bufs = self._buffers.get(("agree", nbytes))
        if bufs is None:
            self._agree_inline_bytes()
            send = np.zeros(nbytes, np.uint8)
            bufs = self._buffers[("agree", nbytes)] = (
                send, np.empty((self._size, nbytes), np.uint8), memoryview(send))
        return bufs

    def _agree_inline_bytes(self) -> None:
        """Check once, before the first agreement, that every rank's slot has one size (else
        the fixed-size exchanges would not match)."""
        sizes = self._allgather_object(self._inline_bytes)
        if len(set(sizes)) > 1:
            shown = agree._groups(sizes)
            raise ValueError(f"inline_bytes differs between ranks: {shown}; pass the same "
                             "inline_bytes (or RINGCOMM_INLINE_BYTES) to every rank")

    def _gather(self, kind: str, x: Any) -> Any:
        self._ensure_open()
        spec = agree.CallSpec(kind)
        try:
            self._check_arrays(x)
            spec.set_array(x, reduced=False)
            if x.ndim == 0:
                raise ValueError(f"{kind} needs an array with at least one dimension, got a scalar")
        except (TypeError, ValueError) as err:
            spec.error = err
        headers = agree.headers(self, spec)
        self.stats.calls += 1
        firsts = [int(h) for h in headers[:, agree.DIM0]]
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        counts = [d * row for d in firsts]
        out = _ops.get(x).empty((sum(firsts), *x.shape[1:]), x.dtype)
        if out.size:
            self._allgatherv(_flat(x), counts, out.reshape(-1))
        own = x.nbytes
        self.stats.add(own * (self._size - 1), out.nbytes - own)
        return out
