"""The PowerSGD allreduce: two dense rings (every tensor's P, then every Q) and the
low-rank products around them, on NumPy or CuPy arrays.

The compressor, its memory, and what the algorithm guarantees (conservation, bit-identical
results, non-finite values) are described in :mod:`ringcomm.algorithms.powersgd`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import ring
from ringcomm.algorithms.compressed_ring import keep_rounding
from ringcomm.algorithms.powersgd import (
    MemoryEntry,
    PowerSGD,
    orthonormalize,
    start_q,
    with_dropped_rows_drawn,
)
from ringcomm.core import trace
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["allreduce"]

_F32 = np.float32


class _Call:
    """One PowerSGD allreduce: the two ring calls and what happens around them, on the array
    kind of ``x`` (``ops``: NumPy's or the GPU's operations)."""

    def __init__(self, t: Transport, x: Array, comp: PowerSGD, residual: Array | None,
                 segment_bytes: int) -> None:
        self.t, self.comp, self.segment_bytes = t, comp, segment_bytes
        self.ops = ops = _ops.get(x)
        self.parts = comp.parts(x.size)
        self.low = [i for i, p in enumerate(self.parts) if p.rank]
        # M is built in the residual itself, which then receives what is not sent.
        self.m = residual if residual is not None else ops.empty(x.size, _F32)
        ops.compensate(x, residual, self.m)
        self.entry = comp.memory.entry(comp.name) if comp.name is not None else MemoryEntry()
        # Where each low-rank tensor's P sits in the first ring call's buffer, its Q in the
        # second's (filled by first() and second()).
        self.p_spans: dict[int, slice] = {}
        self.q_spans: dict[int, slice] = {}

    def _mat(self, i: int) -> Any:
        p = self.parts[i]
        return self.m[p.span].reshape(p.rows, p.cols)

    def _ring(self, buf: Array) -> None:
        with trace.span("POWERSGD_ALLREDUCE"):
            ring.allreduce(self.t, buf, buf, ReduceOp.SUM, segment_bytes=self.segment_bytes)

    def _start_q(self, i: int) -> Any:
        """The start Q^T of tensor ``i``, in this call's kind of array."""
        q = start_q(self.comp, self.entry, i, self.parts[i])
        kind = _ops.get(q)
        if kind is self.ops:
            return q
        moved = self.ops.empty(q.shape, _F32)  # a drawn (host) Q for a device call
        self.ops.copy_from_host(moved, kind.to_host(q))
        return moved

    def first(self) -> tuple[Any, dict[int, Any], dict[int, slice]]:
        """P of every low-rank tensor and the dense tensors, summed in one ring call."""
        sizes = [p.rank * p.rows if p.rank else p.size for p in self.parts]
        offsets = np.cumsum([0, *sizes]).tolist()
        buf = self.ops.empty(offsets[-1], _F32)
        pts, dense = {}, {}
        for i, p in enumerate(self.parts):
            s = slice(offsets[i], offsets[i + 1])
            if p.rank:
                self.p_spans[i] = s
                pts[i] = buf[s].reshape(p.rank, p.rows)
                mat = self._mat(i)
                self.ops.matmul(self._start_q(i), mat.T, pts[i])
                # A non-finite M marks the tensor for the dense fallback on every rank,
                # whatever the products made of its NaN/Inf (a finite sum that overflows
                # marks it too).
                self.ops.flag_nonfinite(mat, pts[i].reshape(-1))
            else:
                dense[i] = s
                buf[s] = self.m[p.span]
                self.m[p.span] = 0  # sent in full
        self._ring(buf)
        return buf, pts, dense

    def orthonormal(self, buf: Array) -> dict[int, bool]:
        """Orthonormalize every finite reduced P of the first call's ``buf`` in place, on the
        host (the same NumPy code on every rank and device); whether each P is finite."""
        host = self.ops.to_host(buf)  # ``buf`` itself for NumPy arrays
        views = {i: host[s].reshape(self.parts[i].rank, self.parts[i].rows)
                 for i, s in self.p_spans.items()}
        finite = {i: bool(np.isfinite(v).all()) for i, v in views.items()}
        for i, v in views.items():
            if finite[i]:
                orthonormalize(v, self.comp.epsilon)
        if host is not buf:
            self.ops.copy_from_host(buf, host)
        return finite

    def second(self, pts: dict[int, Any], finite: dict[int, bool]) -> tuple[
            Any, dict[int, Any], dict[int, Any]]:
        """Q of every tensor whose P is finite, and M of the others (dense), summed in one
        ring call; the residuals are written before the sum."""
        sizes = [self.parts[i].rank * self.parts[i].cols if finite[i] else self.parts[i].size
                 for i in self.low]
        offsets = np.cumsum([0, *sizes]).tolist()
        buf = self.ops.empty(offsets[-1], _F32)
        qts, dense = {}, {}
        for k, i in enumerate(self.low):
            s, p, mat = slice(offsets[k], offsets[k + 1]), self.parts[i], self._mat(i)
            if finite[i]:
                self.q_spans[i] = s
                qts[i] = buf[s].reshape(p.rank, p.cols)
                self.ops.matmul(pts[i], mat, qts[i])
                self.ops.subtract_outer(mat, pts[i], qts[i])  # this rank's share, before the sum
            else:
                dense[i] = buf[s]
                buf[s] = self.m[p.span]
                self.m[p.span] = 0
        self._ring(buf)
        return buf, qts, dense

    def result(self, acc: Array, op: ReduceOp, first: Any, dense1: dict[int, slice],
               pts: dict[int, Any], qts: dict[int, Any], dense2: dict[int, Any]) -> None:
        """The result in float32 ``acc`` (the same bits on every rank); for "avg" the dense
        tensors are divided, and the low-rank ones are P (Q / n)^T."""
        n = self.t.size
        for i, p in enumerate(self.parts):
            dense = first[dense1[i]] if i in dense1 else dense2.get(i)
            if dense is not None:
                if op is ReduceOp.AVG:
                    self.ops.divide(dense, n, acc[p.span])
                else:
                    acc[p.span] = dense
            elif p.size:
                qt = qts[i]
                if op is ReduceOp.AVG:
                    qt = self.ops.empty(qt.shape, _F32)
                    self.ops.divide(qts[i], n, qt)
                self.ops.outer_sum(pts[i], qt, acc[p.span].reshape(p.rows, p.cols))

    def remember(self, buf: Array, qts: dict[int, Any]) -> None:
        if self.comp.name is None:
            return  # without a name, nothing carries over to the next call
        if self.comp.warm_start and qts:
            host = self.ops.to_host(buf)  # one copy from the device for every tensor's check
            for i, qt in qts.items():
                kept = host[self.q_spans[i]].reshape(qt.shape)
                # An overflowed Q would send the tensor dense for good.
                if np.isfinite(kept).all():
                    fresh = with_dropped_rows_drawn(self.comp, self.entry, i, self.parts[i],
                                                    kept)
                    self.entry.qs[i] = qt.copy() if fresh is None else fresh
        self.entry.calls += 1


def allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, comp: PowerSGD,
              residual: Array | None, seed: int, *,
              segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES) -> None:
    """PowerSGD allreduce of flat ``x`` plus ``residual`` into flat ``out`` (see the module
    docstring); ``residual`` receives M - P Q_i^T of the low-rank tensors, 0 elsewhere.
    ``seed`` is unused: the start Q comes from the compressor's seed, the same on every rank."""
    with trace.span("COMPRESS"):
        call = _Call(t, x, comp, residual, segment_bytes)
    first, pts, dense1 = call.first()
    finite = call.orthonormal(first)
    second, qts, dense2 = call.second(pts, finite)
    # x is spent (M holds it), so the result may go straight into out, even where out is x.
    ops = call.ops
    acc = out if out.dtype == _F32 else ops.empty(x.size, _F32)
    with trace.span("DECOMPRESS"):
        call.result(acc, op, first, dense1, pts, qts, dense2)
    if acc is not out:
        ops.copy(out, acc)
        # Every rank holds the whole result; each keeps the rounding of its own chunk of it.
        lo, hi = ring.chunk_bounds(x.size, t.size)[t.rank: t.rank + 2]
        keep_rounding(ops, None if residual is None else residual[lo:hi], acc[lo:hi],
                      out[lo:hi], op, t.size)
    call.remember(second, qts)
