"""Small allreduces and allgathers that finish within the agreement exchange.

A dense array of at most ``comm.inline_bytes`` rides in the same exchange as the call's header
(:mod:`ringcomm.comm.agree`): every rank receives every rank's array and reduces them in rank
order, so all ranks compute the same bits, in one exchange. An :class:`InlinePlan` prepares a
repeated call (every training step) so that it costs a copy in, the exchange and a reduction;
from its ``FUSE_AFTER``-th repeat, where the transport's exchange offers it
(``Exchange.fused_allreduce``: MPI's), those run as one compiled call, the checks of the
caller's thread staying here. A host allgather (equal shapes on every rank) or reduce-scatter
of at most ``inline_bytes`` rides the same way (:func:`allgather_inline`,
:func:`reduce_scatter_inline`), the consistency check on: one exchange instead of the
header's and then the data's.
"""

from __future__ import annotations

from threading import current_thread
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms.ring import chunk_bounds
from ringcomm.comm import callers
from ringcomm.comm._prepared import PreparedCall, fitting_out
from ringcomm.comm.agree import HEADER_BYTES, Agreement, CallSpec, host_bytes
from ringcomm.core.log import get_logger
from ringcomm.core.types import Array, ReduceOp

__all__ = ["FUSE_AFTER", "InlinePlan", "ScatterPlan", "allgather_inline", "allreduce_inline",
           "reduce_scatter_inline"]

_LOG = get_logger("comm")


def allreduce_inline(agreement: Agreement, spec: CallSpec, x: Array, out: Array | None,
                     op: ReduceOp) -> Any:
    """Allreduce an array of at most ``inline_bytes`` within the agreement exchange.

    Every rank receives every rank's array and reduces them in rank order, so all ranks
    compute the same bits; latency is one exchange. The small-message path, kept lean.
    """
    t = agreement.transport
    if spec.error is not None and not agreement.check:
        raise spec.error
    if agreement.check:
        recv = agreement.exchange(spec, x)
        rows = agreement.inline_rows(recv, x.dtype, x.size)
    else:
        raw = np.empty((t.size, x.nbytes), np.uint8)  # bytes: MPI has no bfloat16
        t.allgather_fixed(np.asarray(host_bytes(x)), raw)
        rows = raw.view(x.dtype)
        t.stats.add(x.nbytes * (t.size - 1), x.nbytes * (t.size - 1))
    if out is None:
        out = _ops.get(x).empty(x.shape, x.dtype)
    if x.size:
        _reduce_rows(rows, out, op)
    return out


def allgather_inline(agreement: Agreement, spec: CallSpec, x: np.ndarray) -> np.ndarray:
    """Allgather a host array of at most ``inline_bytes`` within the agreement exchange (the
    consistency check on): the headers are compared as for any call, and equal headers mean
    every rank's array has ``x``'s shape and dtype, so each row of the exchange holds one
    rank's bytes. Any dtype: the rows are copied as bytes, in rank order."""
    recv = agreement.exchange(spec, x)
    nbytes = x.nbytes
    # A copy always (at one rank the slice is contiguous, and would be the exchange's buffer,
    # which the next call overwrites).
    flat = recv[:, HEADER_BYTES: HEADER_BYTES + nbytes].copy().reshape(-1)
    return flat.view(x.dtype).reshape((recv.shape[0] * x.shape[0], *x.shape[1:]))


def reduce_scatter_inline(agreement: Agreement, spec: CallSpec, x: Array, out: Array | None,
                          op: ReduceOp) -> Array:
    """This rank's chunk, ``[r * L // n, (r + 1) * L // n)``, of a reduce-scatter of a flat
    array of at most ``inline_bytes`` within the agreement exchange (the consistency check
    on): equal headers mean every rank's row holds an array of ``x``'s length and dtype, and
    each rank reduces its own chunk of the rows in rank order (on the host, as the inline
    allreduce), into ``out`` where given (C-contiguous, that many elements, ``x``'s kind)."""
    recv = agreement.exchange(spec, x)
    lo, hi = _own_chunk(agreement, x.size)
    if out is None:
        out = _ops.get(x).empty((hi - lo,), x.dtype)
    if hi > lo:
        _reduce_rows(agreement.inline_rows(recv, x.dtype, x.size)[:, lo:hi], out, op)
    return out


def _own_chunk(agreement: Agreement, length: int) -> tuple[int, int]:
    """This rank's chunk of ``length`` elements: the ring's (``chunk_bounds``)."""
    t = agreement.transport
    lo, hi = chunk_bounds(length, t.size)[t.rank:t.rank + 2]
    return lo, hi


class ScatterPlan(PreparedCall):
    """A small host reduce-scatter seen before, prepared for its repeats (a training step's
    FSDP reduce-scatters): the call's header and views of the exchange buffers held, so a
    repeat costs one copy in, one exchange, a comparison per rank and the reduction of this
    rank's chunk. A repeat with other arguments on another rank still fails the header
    comparison and raises the full error on every rank."""

    __slots__ = ("length", "op", "part")

    def __init__(self, agreement: Agreement, spec: CallSpec, x: np.ndarray,
                 op: ReduceOp) -> None:
        super().__init__(agreement, spec, x)
        lo, hi = _own_chunk(agreement, x.size)
        self.length, self.op = hi - lo, op
        #: Every rank's row of this rank's chunk, in the received buffer.
        self.part = agreement.inline_rows(self.buffers.recv, x.dtype, x.size)[:, lo:hi]

    def run(self, x: np.ndarray, out: Any) -> np.ndarray | None:
        """Run a repeat of a call of ``x``'s dtype and shape: the chunk (in ``out`` where
        given), or None (nothing done) where ``x`` is not contiguous or ``out`` cannot take
        the chunk as it is (the full path runs the call and says why)."""
        if not x.flags.c_contiguous or not (out is None or self._fits(out)):
            return None
        self.exchange(x)  # x's bytes are in the exchange buffer: out may lie inside x
        result = np.empty(self.length, self.part.dtype) if out is None else out
        if self.length:
            _reduce_rows(self.part, result, self.op)
        return result

    def _fits(self, out: Any) -> bool:
        if type(out) is not np.ndarray or out.size != self.length or not (
                out.dtype is self.part.dtype or out.dtype == self.part.dtype):
            return False
        flags = out.flags
        return flags.c_contiguous and flags.writeable


class InlinePlan(PreparedCall):
    """A small host allreduce seen before, prepared for its repeats (every training step).

    Holds the call's header and views of the exchange buffers (where the array goes, every
    rank's received header and inlined row), so a repeat costs one copy in, one exchange, a
    comparison per rank and one reduction. A repeat with other arguments on another rank
    still fails the header comparison and raises the full error.
    """

    __slots__ = ("dtype", "flat", "fused", "fused_caller", "fused_start", "nbytes", "op", "pair",
                 "pair_new", "rows", "runs", "shape", "ufunc")

    def __init__(self, agreement: Agreement, spec: CallSpec, x: np.ndarray,
                 op: ReduceOp) -> None:
        super().__init__(agreement, spec, x)
        self.op = op
        t = agreement.transport
        self.shape, self.dtype, self.nbytes = x.shape, x.dtype, x.nbytes
        self.flat = x.ndim == 1  # the call's arrays go to the compiled call as they are
        self.rows = agreement.inline_rows(self.buffers.recv, x.dtype, x.size)
        # The two rows of a 2-rank job, reduced with one ufunc call.
        self.pair = tuple(self.rows) if t.size == 2 and self._direct(x.dtype, op) else None
        # ... straight into a new result, where it needs no reshaping.
        self.pair_new = self.pair if self.flat else None
        self.ufunc = _UFUNCS[op]
        #: The exchange's compiled call for this plan (see ``_fuse``), once it has one, and
        #: its first part.
        self.fused: Any = None
        self.fused_start: Any = None
        #: The caller whose header the compiled call sends (None: none yet, or not known).
        self.fused_caller: str | None = None
        self.runs = 0

    @staticmethod
    def _direct(dtype: np.dtype, op: ReduceOp) -> bool:
        """Whether two rows reduce with one ufunc call into the result (see _reduce_rows)."""
        return dtype.itemsize != 2 and op is not ReduceOp.AVG

    @staticmethod
    def applies(agreement: Agreement, x: Array) -> bool:
        """Whether a plan can serve ``x``: checked, host, contiguous, small, bufferable."""
        return (agreement.check and type(x) is np.ndarray and x.flags.c_contiguous
                and x.nbytes <= agreement.inline_bytes and x.dtype.kind != "V")

    def run(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        """Run a repeat: the result, or None (nothing done) where ``x`` or ``out`` cannot
        take part as they are (the full path runs the call: see ``fitting_out``)."""
        flags = x.flags
        if not flags.c_contiguous or not (out is None or fitting_out(x, flags, out)):
            return None
        fused = self.fused
        if fused is None:
            self.runs += 1
            if self.runs == FUSE_AFTER:
                self._fuse()
            return self._run(x, out)
        # The compiled call (``_fuse``): the caller's checks here, the header, the exchange,
        # the comparison and the reduction there. Inline: this is the path of every repeat.
        # The caller as ``ThreadNames.caller`` finds it, where it is the one whose header the
        # compiled call holds (no thread within ``calls_as``, this thread's name, no twin).
        name, me = self.fused_caller, current_thread()
        if callers.WITHIN or me.name != name or self.threads.owners.get(name) is not me:
            return self._run_fused_caller(fused, x, out)
        result = np.empty(self.shape, self.dtype) if out is None else out
        stats, volume = self.stats, self.volume
        stats.bytes_sent += volume
        stats.bytes_received += volume
        if self.flat:
            code = self.fused_start(x, result)
        else:
            code = self.fused_start(x.reshape(-1), result.reshape(-1))
        if code:
            return self._fused_failed(fused, code, x, out, result)
        return result

    def _run(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        self.exchange(x)
        if out is None and self.pair_new is not None:
            first, second = self.pair_new
            return self.ufunc(first, second)
        result = np.empty(self.shape, self.dtype) if out is None else out
        if self.nbytes:
            pair = self.pair
            if pair is not None and result.flags.c_contiguous:
                self.ufunc(pair[0], pair[1], out=result if result.ndim == 1 else result.reshape(-1))
            else:
                _reduce_rows(self.rows, result, self.op)
        return result

    def _fuse(self) -> None:
        """Ask the exchange for this call as one compiled call (``Exchange.fused_allreduce``);
        where it has none, or it fails to build (then for no call of the process: said once
        in the log), the Python path stays."""
        global _fuse_failed
        if not self.nbytes or _fuse_failed:
            return
        try:
            self.fused = self.send.fused_allreduce(self.message, self.header, self.dtype,
                                                   self.op.value)
            self.fused_start = None if self.fused is None else self.fused.start
            self.fused_caller = self.spec.caller
        except Exception as err:  # the Python path gives the same bits
            _fuse_failed = True
            _LOG.warning("small allreduces run without their compiled call in this process "
                         "(%s: %s)", type(err).__name__, err)

    def _run_fused_caller(self, fused: Any, x: np.ndarray,
                          out: np.ndarray | None) -> np.ndarray:
        """A repeat the compiled call cannot take as it is: the Python path runs it (another
        caller, whose header the compiled call sends from then on; a call within
        ``calls_as``; or the error of a thread whose name another live thread bears)."""
        # Until that call has passed the compiled call holds no known header: a call that
        # raised must not leave it another caller's, which a later call would send.
        self.fused_caller = None
        result = self._run(x, out)
        fused.set_header(self.header)
        self.fused_caller = self.spec.caller
        return result

    def _fused_failed(self, fused: Any, code: int, x: np.ndarray, out: np.ndarray | None,
                      result: np.ndarray) -> np.ndarray:
        """After the compiled call's first part returned ``code``: the rest of the exchange
        still on the way (the compiled call completes it), another rank's header differed
        (the error on every rank, or a difference the call allows, then the reduction), or
        its requests were freed (nothing was sent: the Python path runs the call, and
        compiles it again after as many repeats)."""
        flat = result if result.ndim == 1 else result.reshape(-1)
        code = fused.finish(code, flat)
        if not code:
            return result
        if code != DIFFER:
            self.stats.bytes_sent -= self.volume
            self.stats.bytes_received -= self.volume
            self.fused = self.fused_start = None
            self.runs = 0
            return self._run(x, out)
        self.agreement.verify(self.spec, np.ascontiguousarray(
            self.buffers.recv[:, :HEADER_BYTES]).view(np.int64), self.message)
        fused.reduce(flat)
        return result


#: Repeats of a plan before its exchange and reduction are asked for as one compiled call
#: (``InlinePlan._fuse``): a training loop's, not a script's few calls, which would pay for
#: loading the compiled code without gaining from it.
FUSE_AFTER = 64
#: What a compiled call returns where a rank's header differs from this rank's.
DIFFER = 2
_fuse_failed = False  # a compiled call failed to build: none is asked for again


def _reduce_rows(rows: np.ndarray, result: Array, op: ReduceOp) -> None:
    ufunc = _UFUNCS[op]
    if rows.dtype.itemsize != 2 and type(result) is np.ndarray and result.flags.c_contiguous:
        acc = result.reshape(-1)
        if rows.shape[0] == 2:
            first, second = rows
            ufunc(first, second, out=acc)
        else:
            ufunc.reduce(rows, axis=0, out=acc, **_start(ufunc, rows))
        if op == "avg":
            np.divide(acc, rows.shape[0], out=acc)
        return
    # 16-bit floats accumulate in float32 and round once; device or strided results are
    # written from a host buffer.
    acc = ufunc.reduce(rows, axis=0, dtype=np.float32 if rows.dtype.itemsize == 2 else None,
                       **_start(ufunc, rows))
    if op == "avg":
        np.divide(acc, rows.shape[0], out=acc)
    _ops.get(result).copy_from_host(result, acc.reshape(result.shape))


def _start(ufunc: np.ufunc, rows: np.ndarray) -> dict[str, float]:
    """``ufunc.reduce``'s start for ``rows``: float sums start from -0.0, IEEE's identity of
    addition (-0.0 + x is x, bit for bit); NumPy's, +0.0, turns a sum of -0.0 into +0.0,
    where two rows' single addition, the ring, the shared segment and the compiled call keep
    -0.0."""
    return _FLOAT_SUM_START if ufunc is np.add and rows.dtype.kind not in "iu" else _NO_START


# Looked up once: this is the small-message path, where every attribute access shows.
_UFUNCS = {op: getattr(np, op.spec.ufunc) for op in ReduceOp}
_FLOAT_SUM_START: dict[str, float] = {"initial": -0.0}
_NO_START: dict[str, float] = {}
