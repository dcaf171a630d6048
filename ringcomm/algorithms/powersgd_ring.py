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
    Part,
    PowerSGD,
    orthonormalize,
    start_q,
    with_dropped_rows_drawn,
)
from ringcomm.core import trace
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["allreduce"]

_F32 = np.float32
#: Layouts a compressor keeps (its copies' included) before it starts afresh.
_KEPT_LAYOUTS = 64


def _table(ops: Any, rows: list[tuple[int, ...]], fields: int) -> Any:
    """``rows`` as an int64 (k, fields) array of the call's kind (the one-launch ops' tables)."""
    host = np.asarray(rows, dtype=np.int64).reshape(-1, fields)
    if ops is _ops.numpy_ops():
        return host
    table = ops.empty(host.shape, np.int64)
    ops.copy_from_host(table, host)
    return table


class _Runs:
    """Dense tensors moving between the flat buffer and a ring buffer: their runs (adjacent
    tensors merged) both ways, as tables of the call's kind."""

    def __init__(self, ops: Any, spans: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []  # [offset in the flat buffer, offset in the ring's, length]
        at = 0
        for offset, size in spans:
            if size == 0:
                continue
            if merged and merged[-1][0] + merged[-1][2] == offset:
                merged[-1][2] += size
            else:
                merged.append([offset, at, size])
            at += size
        self.size = at
        self.longest = max((m[2] for m in merged), default=0)
        self.out = _table(ops, [tuple(m) for m in merged], 3)  # flat -> ring buffer
        self.back = _table(ops, [(m[1], m[0], m[2]) for m in merged], 3)  # ring buffer -> flat


def _packed(start: int, sizes: dict[int, int]) -> tuple[dict[int, int], int]:
    """Where each tensor's ``sizes`` elements start when they follow one another from
    ``start``, in order, and where the last ends."""
    at, offsets = start, {}
    for i, size in sizes.items():
        offsets[i] = at
        at += size
    return offsets, at


class _Layout:
    """Where a call's tensors go in its two ring buffers, for one set of finite P.

    First buffer: the dense tensors, then each low-rank tensor's P^T. Second buffer: the
    low-rank tensors whose reduced P is not finite (sent dense), then each other's Q^T.
    """

    def __init__(self, ops: Any, parts: tuple[Part, ...], finite: tuple[bool, ...]) -> None:
        low = [i for i, p in enumerate(parts) if p.rank]
        self.dense1 = _Runs(ops, [(p.offset, p.size) for p in parts if not p.rank])
        self.p_at, self.size1 = _packed(self.dense1.size,
                                        {i: parts[i].rank * parts[i].rows for i in low})
        self.marks = _table(ops, [self._row(parts[i], self.p_at[i], 0) for i in low], 6)
        self.longest = max((parts[i].size for i in low), default=0)
        kept = [i for i, ok in zip(low, finite, strict=True) if ok]
        self.dense2 = _Runs(ops, [(parts[i].offset, parts[i].size)
                                  for i, ok in zip(low, finite, strict=True) if not ok])
        self.q_at, self.size2 = _packed(self.dense2.size,
                                        {i: parts[i].rank * parts[i].cols for i in kept})
        self.products = _table(ops, [self._row(parts[i], self.p_at[i], self.q_at[i])
                                     for i in kept], 6)
        self.longest_kept = max((parts[i].size for i in kept), default=0)

    @staticmethod
    def _row(p: Part, p_at: int, q_at: int) -> tuple[int, ...]:
        return (p.offset, p.rows, p.cols, p.rank, p_at, q_at)


def _device_key(x: Array) -> Any:
    """Which device's tables a call on ``x`` takes (None: the host's)."""
    return getattr(getattr(x, "device", None), "id", None)


class _Call:
    """One PowerSGD allreduce: the two ring calls and what happens around them, on the array
    kind of ``x`` (``ops``: NumPy's or the GPU's operations). Every pass over the tensors that
    is not a product of its own (the dense tensors in and out, the marks of tensors that go
    dense, the residual, the result) is one operation for all of them (one launch on a GPU)."""

    def __init__(self, t: Transport, x: Array, comp: PowerSGD, residual: Array | None,
                 segment_bytes: int) -> None:
        self.t, self.comp, self.segment_bytes = t, comp, segment_bytes
        self.ops = ops = _ops.get(x)
        self.parts = comp.parts(x.size)
        self.low = [i for i, p in enumerate(self.parts) if p.rank]
        self._key = (comp.shapes, x.size, ops.__name__, _device_key(x))
        # M is built in the residual itself, which then receives what is not sent.
        self.m = residual if residual is not None else ops.empty(x.size, _F32)
        ops.compensate(x, residual, self.m)
        self.entry = comp.memory.entry(comp.name) if comp.name is not None else MemoryEntry()
        self.layout = self._layout((True,) * len(self.low))

    def _layout(self, finite: tuple[bool, ...]) -> _Layout:
        key = (*self._key, finite)
        kept = self.comp._layouts
        found = kept.get(key)
        if found is None:
            if len(kept) >= _KEPT_LAYOUTS:  # a compressor called on ever new shapes
                kept.clear()
            found = kept[key] = _Layout(self.ops, self.parts, finite)
        return found

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

    def _pt(self, buf: Array, i: int) -> Any:
        p, at = self.parts[i], self.layout.p_at[i]
        return buf[at: at + p.rank * p.rows].reshape(p.rank, p.rows)

    def first(self) -> Array:
        """The dense tensors and P of every low-rank tensor, summed in one ring call."""
        lay, ops = self.layout, self.ops
        buf = ops.empty(lay.size1, _F32)
        ops.dense_runs(buf, self.m, lay.dense1.out, lay.dense1.longest, take=True)  # sent in full
        for i in self.low:
            ops.matmul(self._start_q(i), self._mat(i).T, self._pt(buf, i))
        # A non-finite M, or one so large that Q, the result or the residual could overflow,
        # marks the tensor for the dense fallback on every rank, whatever the products made of
        # it (a P that overflows in the sum goes dense too).
        ops.mark_dense_parts(self.m, buf, lay.marks, lay.longest, self.t.size)
        self._ring(buf)
        return buf

    def orthonormal(self, buf: Array) -> tuple[bool, ...]:
        """Orthonormalize every finite reduced P of the first call's ``buf`` in place, on the
        host (the same NumPy code on every rank and device); whether each P is finite."""
        start = self.layout.dense1.size
        host = self.ops.to_host(buf[start:])  # ``buf`` itself for NumPy arrays
        finite = []
        for i in self.low:
            p, at = self.parts[i], self.layout.p_at[i] - start
            v = host[at: at + p.rank * p.rows].reshape(p.rank, p.rows)
            finite.append(bool(np.isfinite(v).all()))
            if finite[-1]:
                orthonormalize(v, self.comp.epsilon)
        if host is not buf and self.low:
            self.ops.copy_from_host(buf[start:], host)
        return tuple(finite)

    def second(self, first: Array, finite: tuple[bool, ...]) -> Array:
        """Q of every tensor whose P is finite, and M of the others (dense), summed in one
        ring call; the residuals are written before the sum."""
        if not all(finite):
            self.layout = self._layout(finite)
        lay, ops = self.layout, self.ops
        buf = ops.empty(lay.size2, _F32)
        ops.dense_runs(buf, self.m, lay.dense2.out, lay.dense2.longest, take=True)
        for i, at in lay.q_at.items():
            p = self.parts[i]
            ops.matmul(self._pt(first, i), self._mat(i),
                       buf[at: at + p.rank * p.cols].reshape(p.rank, p.cols))
        # this rank's share, before the sum
        ops.subtract_outer_parts(self.m, first, buf, lay.products, lay.longest_kept)
        self._ring(buf)
        return buf

    def result(self, acc: Array, op: ReduceOp, first: Array, second: Array) -> None:
        """The result in float32 ``acc`` (the same bits on every rank); for "avg" the dense
        tensors are divided, and the low-rank ones are P (Q / n)^T."""
        lay, ops = self.layout, self.ops
        n = self.t.size if op is ReduceOp.AVG else 0
        ops.dense_runs(acc, first, lay.dense1.back, lay.dense1.longest, divisor=n)
        ops.dense_runs(acc, second, lay.dense2.back, lay.dense2.longest, divisor=n)
        q = second
        if n and lay.q_at:
            q = ops.empty(second.size, _F32)
            ops.divide(second, n, q)
        ops.outer_sum_parts(acc, first, q, lay.products, lay.longest_kept)

    def remember(self, buf: Array) -> None:
        if self.comp.name is None:
            return  # without a name, nothing carries over to the next call
        if self.comp.warm_start and self.layout.q_at:
            host = self.ops.to_host(buf)  # one copy from the device for every tensor's check
            kept = self.ops.empty(buf.size, _F32)  # one copy for every tensor's next start
            self.ops.copy(kept, buf)
            for i, at in self.layout.q_at.items():
                p = self.parts[i]
                span = slice(at, at + p.rank * p.cols)
                # An overflowed Q would send the tensor dense for good.
                if np.isfinite(host[span]).all():
                    fresh = with_dropped_rows_drawn(self.comp, self.entry, i, p,
                                                    host[span].reshape(p.rank, p.cols))
                    self.entry.qs[i] = (kept[span].reshape(p.rank, p.cols) if fresh is None
                                        else fresh)
        self.entry.calls += 1


def allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, comp: PowerSGD,
              residual: Array | None, seed: int, *,
              segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES) -> None:
    """PowerSGD allreduce of flat ``x`` plus ``residual`` into flat ``out`` (see the module
    docstring); ``residual`` receives M - P Q_i^T of the low-rank tensors, 0 elsewhere.
    ``seed`` is unused: the start Q comes from the compressor's seed, the same on every rank."""
    with trace.span("COMPRESS"):
        call = _Call(t, x, comp, residual, segment_bytes)
    first = call.first()
    finite = call.orthonormal(first)
    second = call.second(first, finite)
    # x is spent (M holds it), so the result may go straight into out, even where out is x.
    ops = call.ops
    acc = out if out.dtype == _F32 else ops.empty(x.size, _F32)
    with trace.span("DECOMPRESS"):
        call.result(acc, op, first, second)
    if acc is not out:
        ops.copy(out, acc)
        # Every rank holds the whole result; each keeps the rounding of its own chunk of it.
        lo, hi = ring.chunk_bounds(x.size, t.size)[t.rank: t.rank + 2]
        keep_rounding(ops, None if residual is None else residual[lo:hi], acc[lo:hi],
                      out[lo:hi], op, t.size)
    call.remember(second)
