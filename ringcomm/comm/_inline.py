"""Small allreduces and allgathers that finish within the agreement exchange.

A dense array of at most ``comm.inline_bytes`` rides in the same exchange as the call's header
(:mod:`ringcomm.comm.agree`): every rank receives every rank's array and reduces them in rank
order, so all ranks compute the same bits, in one exchange. An :class:`InlinePlan` prepares a
repeated call (every training step) so that it costs a copy in, the exchange and a reduction.
A host allgather (equal shapes on every rank) of at most ``inline_bytes`` rides the same way
(:func:`allgather_inline`), the consistency check on: one exchange instead of the header's and
then the data's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm._prepared import PreparedCall
from ringcomm.comm.agree import HEADER_BYTES, Agreement, CallSpec, host_bytes
from ringcomm.core.types import Array, ReduceOp

__all__ = ["InlinePlan", "allgather_inline", "allreduce_inline"]


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


class InlinePlan(PreparedCall):
    """A small host allreduce seen before, prepared for its repeats (every training step).

    Holds the call's header and views of the exchange buffers (where the array goes, every
    rank's received header and inlined row), so a repeat costs one copy in, one exchange, a
    comparison per rank and one reduction. A repeat with other arguments on another rank
    still fails the header comparison and raises the full error.
    """

    __slots__ = ("dtype", "nbytes", "op", "pair", "pair_new", "rows", "shape", "ufunc")

    def __init__(self, agreement: Agreement, spec: CallSpec, x: np.ndarray,
                 op: ReduceOp) -> None:
        super().__init__(agreement, spec, x)
        self.op = op
        t = agreement.transport
        self.shape, self.dtype, self.nbytes = x.shape, x.dtype, x.nbytes
        self.rows = agreement.inline_rows(self.buffers.recv, x.dtype, x.size)
        # The two rows of a 2-rank job, reduced with one ufunc call.
        self.pair = tuple(self.rows) if t.size == 2 and self._direct(x.dtype, op) else None
        # ... straight into a new result, where it needs no reshaping.
        self.pair_new = self.pair if x.ndim == 1 else None
        self.ufunc = _UFUNCS[op]

    @staticmethod
    def _direct(dtype: np.dtype, op: ReduceOp) -> bool:
        """Whether two rows reduce with one ufunc call into the result (see _reduce_rows)."""
        return dtype.itemsize != 2 and op is not ReduceOp.AVG

    @staticmethod
    def applies(agreement: Agreement, x: Array) -> bool:
        """Whether a plan can serve ``x``: checked, host, contiguous, small, bufferable."""
        return (agreement.check and type(x) is np.ndarray and x.flags.c_contiguous
                and x.nbytes <= agreement.inline_bytes and x.dtype.kind != "V")

    @staticmethod
    def accepts(x: np.ndarray, out: np.ndarray | None) -> bool:
        """Whether this call's array can be copied into the exchange as it is."""
        return x.flags.c_contiguous

    def run(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
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


def _reduce_rows(rows: np.ndarray, result: Array, op: ReduceOp) -> None:
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


# Looked up once: this is the small-message path, where every attribute access shows.
_UFUNCS = {op: getattr(np, op.spec.ufunc) for op in ReduceOp}
