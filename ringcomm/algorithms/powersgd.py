"""PowerSGD: rank-r compression of gradient matrices, reduced by two dense rings.

For every matrix-shaped tensor of a call (a tensor of shape (n, d1, d2, ...) is the n x m
matrix with m = d1 * d2 * ...), on every rank:

    M   = input + this rank's error-feedback residual          (n x m, float32)
    P   = M Q                                                   (n x r), Q: m x r, the same on
                                                                every rank (see below)
    P   <- allreduce_sum(P), then orthonormalized               (Gram-Schmidt with epsilon)
    Q_i = M^T P                                                 this rank's share
    Q   = allreduce_sum(Q_i)
    result   = P Q^T                                            ("avg": P (Q / size)^T)
    residual = M - P Q_i^T                                      what this rank did not send

All tensors' P travel in one ring call (with the tensors that go dense: 1-D ones, and those
where r (n + m) floats would not save ``min_compression_rate`` times n m), all Q in a second.
``comm.allreduce`` reduces a 2-D (or higher) array as that one matrix; a flat buffer of several
tensors needs their shapes (``with_shapes``), which the DDP hook and DistributedOptimizer pass
for their buckets.

Host and device arrays. The same algorithm runs on NumPy and CuPy arrays, through the
operations of ``ringcomm.ops`` (``matmul``, ``outer_sum_parts``, ``subtract_outer_parts``,
``dense_runs``, ``mark_dense_parts``): on a GPU the projections are cuBLAS products, one per
tensor, and every other pass (the dense tensors into and out of the ring buffers, the marks of
the tensors that go dense, the residual and the result) is one kernel for all the call's
tensors. The
reduced P, a few floats per row, is orthonormalized on the host (one copy each way), so every
rank and every device runs the same elementwise NumPy code on it.

Conservation. P P^T is the same matrix on every rank, so the sum of the results is
sum_i P P^T M_i = sum_i (M_i - residual_i'). Hence, per call, with s = 1 for "sum" and s = size
for "avg":

    sum_i input_i = s * result + sum_i residual_i' - sum_i residual_i

to float32 rounding (the local products, the ring's float32 sums, the division of "avg"), and
summed over calls the old residuals telescope away. Tensors sent dense leave no residual.

Bit-identical results. Only the reduced P and Q enter the result, and every rank orthonormalizes
the same P with the same elementwise NumPy operations (no BLAS, whose summation order can follow
memory alignment) and forms P Q^T as a sum of outer products, each product and sum rounded on
its own (the same bits from NumPy and from the GPU kernel). Q may even differ between ranks
(a memory reset on one rank only): the results stay bit-identical, only the approximation is
worse.

Exactness. If the sum over ranks of M has rank at most r (r <= n, m) and the start Q is generic
(the seeded Gaussian one is, almost surely), P spans that sum's column space and the result
reproduces the sum to float32 rounding on the first call already; warm start keeps it so.
(Below rank r, the reduced P has columns that the others span; orthonormalize sets them to
zero rather than scaling their rounding up to norm 1.)

Non-finite values. A rank whose M of a tensor holds NaN or Inf puts a NaN into that tensor's
P, so the reduced P, the same bits on every rank, is not finite; every rank then sends that
tensor dense in the second ring call, so that NaN and Inf land exactly where the dense allreduce
would put them, and its residual is spent. So does a tensor whose M has an entry so large that
Q, the result or the residual could overflow (above FLT_MAX / (n size r) in magnitude:
``ops.numpy.dense_limit``), and one whose reduced P overflowed. The other tensors' results and
residuals are finite.

Where Q lives. A compressor is stateless; the Q of each tensor (for warm start) and the count
of calls are the state of a :class:`LowRankMemory`, keyed by the call's ``name``, which a
PowerSGD refers to (and shares with the copies ``with_shapes`` and ``bind`` make) but which
never travels. Create the compressor once and reuse it: a new one starts from a new memory.
Q starts from a Gaussian drawn from (``seed``, name, tensor index), the same on every rank;
without warm start a new one is drawn from the same numbers plus the call count each call.
A call without a name remembers nothing (every such call starts from the seeded Q).

The two ring calls and what runs around them are in :mod:`ringcomm.algorithms.powersgd_ring`;
this module holds the compressor, its memory and the numerics both share.

Dense warm-up. PowerSGD has no warm-up of its own: ``RingcommState(start_iter=...)`` reduces
DDP's buckets dense for the first iterations, and a direct caller passes ``compression=None``
for as long as it wants them dense.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ringcomm import ops as _ops
from ringcomm.codecs.base import Compressor
from ringcomm.core.types import Array

__all__ = ["LowRankMemory", "MemoryEntry", "Part", "PowerSGD", "orthonormalize", "start_q",
           "with_dropped_rows_drawn"]

_F32 = np.float32
_SHOWN_SHAPES = 8  # longer shape lists appear in repr as a count and a checksum


@dataclass(frozen=True)
class Part:
    """One tensor of a call: its place in the flat buffer, its matrix and its rank (0: dense)."""

    offset: int
    size: int
    rows: int
    cols: int
    rank: int

    @property
    def span(self) -> slice:
        return slice(self.offset, self.offset + self.size)


class MemoryEntry:
    """What a LowRankMemory keeps for one name: each tensor's last Q^T and the calls made."""

    __slots__ = ("calls", "qs")

    def __init__(self) -> None:
        self.calls = 0
        self.qs: dict[int, np.ndarray] = {}


class LowRankMemory:
    """The state of PowerSGD per call name: each tensor's last Q and the number of calls."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[str | None, MemoryEntry] = {}

    def entry(self, name: str | None) -> MemoryEntry:
        """The state kept under ``name`` (created empty)."""
        found = self._entries.get(name)
        if found is None:
            found = self._entries[name] = MemoryEntry()
        return found

    def calls(self, name: str | None) -> int:
        """How many calls ``name`` has made."""
        found = self._entries.get(name)
        return 0 if found is None else found.calls

    def reset(self, name: str | None = None) -> None:
        """Forget the state of ``name``, or of every name."""
        if name is None:
            self._entries.clear()
        else:
            self._entries.pop(name, None)

    def __len__(self) -> int:
        return len(self._entries)


def _matrix(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    return int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))


class PowerSGD(Compressor):
    """Rank-r PowerSGD compression with warm start (Vogels et al., 2019).

    Args:
        rank: the rank r of each matrix's approximation.
        warm_start: start each call's power iteration from the previous call's Q (of the same
            name and tensor) instead of a new random one.
        min_compression_rate: a tensor goes low-rank only where n m > this times r (n + m)
            (as PyTorch's PowerSGD decides).
        epsilon: added to each column's norm in Gram-Schmidt, so that a zero column stays zero.
        seed: seeds the start Q; every rank must pass the same (checked).
        shapes: the shapes of the tensors a flat buffer holds, in order; None: the array's own
            shape (a 1-D array then goes dense).
        memory: where Q and the call counts live; a new one when None.

    Raises:
        ValueError: rank < 1, min_compression_rate < 0, epsilon < 0, or a negative dimension.

    Example::

        psgd, ef = ringcomm.PowerSGD(rank=2), ringcomm.ErrorFeedback()
        avg = comm.allreduce(grad_matrix, op="avg", compression=psgd, feedback=ef, name="fc1")
        flat = comm.allreduce(bucket, op="avg", compression=psgd.with_shapes([(64, 32), (64,)]),
                              feedback=ef, name="bucket0")
    """


    shardable: ClassVar[bool] = False  # P and Q are per tensor: a shard has no matrices

    def __init__(self, rank: int = 1, *, warm_start: bool = True,
                 min_compression_rate: float = 2.0, epsilon: float = 1e-8, seed: int = 0,
                 shapes: Sequence[Sequence[int]] | None = None,
                 memory: LowRankMemory | None = None) -> None:
        if not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate!r}")
        if not epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.min_compression_rate = float(min_compression_rate)
        self.epsilon = float(epsilon)
        self.seed = int(seed)
        self.memory = LowRankMemory() if memory is None else memory
        self.name: str | None = None
        #: The ring's layouts of this compressor's calls (ringcomm.algorithms.powersgd_ring),
        #: by shapes, length, array kind and which tensors went dense; shared by the copies
        #: ``with_shapes`` and ``bind`` make, so that an unshaped compressor bound to each
        #: call's array keeps them too.
        self._layouts: dict[Any, Any] = {}
        self._set_shapes(shapes)

    def _set_shapes(self, shapes: Sequence[Sequence[int]] | None) -> None:
        self.shapes = None if shapes is None else tuple(tuple(int(d) for d in s) for s in shapes)
        if self.shapes is not None and any(d < 0 for s in self.shapes for d in s):
            raise ValueError(f"shapes must have dimensions >= 0, got {self.shapes}")
        self._parts: tuple[Part, ...] | None = None
        self._repr: str | None = None

    # ------------------------------------------------------------------ binding to a call
    def with_shapes(self, shapes: Sequence[Sequence[int]] | None) -> PowerSGD:
        """This compressor for a flat buffer holding tensors of ``shapes``, in order (sharing
        its memory)."""
        bound = copy.copy(self)
        bound._set_shapes(shapes)
        return bound

    def bind(self, x: Array, name: str | None) -> PowerSGD:
        """The compressor for one call on ``x`` under ``name``: ``x``'s own shape unless shapes
        were given, and the name that keys Q in the memory.

        Raises:
            ValueError: the shapes hold another number of elements than ``x``.
        """
        bound = self if self.shapes is not None else self.with_shapes([tuple(x.shape)])
        shapes = bound.shapes or ()  # set either way
        total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        if total != x.size:
            raise ValueError(f"PowerSGD shapes hold {total} elements but the array has "
                             f"{x.size}: {_shapes_text(shapes)}")
        if bound is self and name == self.name:
            return self
        bound = copy.copy(bound) if bound is self else bound
        bound.name = name
        return bound

    def parts(self, length: int) -> tuple[Part, ...]:
        """The tensors of a flat buffer of ``length`` elements (all of it one dense part when
        no shapes are known)."""
        if self.shapes is None:
            return (Part(0, length, length, 1, 0),)
        if self._parts is None:
            self._parts = tuple(self._plan())
        if sum(p.size for p in self._parts) != length:
            raise ValueError(f"PowerSGD shapes hold {sum(p.size for p in self._parts)} elements "
                             f"but the array has {length}")
        return self._parts

    def _plan(self) -> list[Part]:
        parts, offset = [], 0
        for shape in self.shapes or ():
            size = int(np.prod(shape, dtype=np.int64))
            matrix = _matrix(shape)
            rows, cols = matrix if matrix is not None else (size, 1)
            r = min(self.rank, rows, cols)
            low = matrix is not None and size > 0 and (
                size > self.min_compression_rate * r * (rows + cols))
            parts.append(Part(offset, size, rows, cols, r if low else 0))
            offset += size
        return parts

    # ------------------------------------------------------------------- the Compressor
    @property
    def allreduce_algorithm(self) -> str:
        return "powersgd"

    def wire_bytes(self, length: int, n: int) -> int:
        """Bytes of one ring step: P, the dense tensors and Q, a chunk of each ring."""
        floats = sum(p.rank * (p.rows + p.cols) if p.rank else p.size
                     for p in self.parts(length))
        return 4 * floats // n

    def hop_work(self, x: Array, own: Array) -> Callable[[], Any]:
        raise NotImplementedError("PowerSGD is no candidate of Auto: its cost depends on the "
                                  "tensors' shapes, which Auto does not know")

    def compress(self, x: Array) -> tuple[Any, tuple[Any, ...]]:
        """One rank's rank-r approximation of ``x`` alone: the payload holds P and Q (and the
        dense tensors), from the seeded start Q."""
        comp = self.bind(x, self.name)
        m = np.array(_ops.get(x).to_host(x), dtype=_F32).reshape(-1)
        pieces = []
        for i, p in enumerate(comp.parts(m.size)):
            mat = m[p.span].reshape(p.rows, p.cols)
            if not p.rank:
                pieces.append(mat.reshape(-1))
                continue
            pt = (_draw_q(comp, i, p, 0) @ mat.T).astype(_F32)
            orthonormalize(pt, comp.epsilon)
            pieces += [pt.reshape(-1), (pt @ mat).reshape(-1)]
        payload = np.concatenate(pieces) if pieces else np.empty(0, _F32)
        return payload.view(np.uint8), (x.shape, x.dtype, comp)

    def decompress(self, payload: Array, ctx: tuple[Any, ...]) -> Array:
        shape, dtype, comp = ctx
        values = payload.view(_F32)
        size = int(np.prod(shape, dtype=np.int64))
        out = np.empty(size, _F32)
        at = 0
        for p in comp.parts(size):
            if not p.rank:
                out[p.span] = values[at: at + p.size]
                at += p.size
                continue
            pt = values[at: at + p.rank * p.rows].reshape(p.rank, p.rows)
            at += pt.size
            qt = values[at: at + p.rank * p.cols].reshape(p.rank, p.cols)
            at += qt.size
            _ops.numpy_ops().outer_sum(pt, qt, out[p.span].reshape(p.rows, p.cols))
        return out.astype(dtype).reshape(shape)

    def __repr__(self) -> str:
        if self._repr is None:
            shapes = "" if self.shapes is None else f", shapes={_shapes_text(self.shapes)}"
            self._repr = (f"PowerSGD(rank={self.rank}, warm_start={self.warm_start}, "
                          f"min_compression_rate={self.min_compression_rate!r}, "
                          f"epsilon={self.epsilon!r}, seed={self.seed}{shapes})")
        return self._repr


#: orthonormalize's threshold for a column that the columns before it span: the norm of what is
#: left of it after their projections, relative to its own. Float32 rounding leaves about
#: 1e-7 of an exactly dependent column; a direction this small that is no rounding carries at
#: most 1e-8 of the column's energy, which the residual keeps.
DEPENDENT = 1e-4


def _shapes_text(shapes: tuple[tuple[int, ...], ...]) -> str:
    if len(shapes) <= _SHOWN_SHAPES:
        return repr(list(shapes))
    return f"<{len(shapes)} shapes, crc32 {zlib.crc32(repr(shapes).encode()):08x}>"


# ------------------------------------------------------------------------- the numerics
def orthonormalize(pt: np.ndarray, epsilon: float) -> None:
    """Make the rows of ``pt`` (r x n: P's columns) orthonormal in place, by modified
    Gram-Schmidt dividing each (scaled to largest magnitude 1) by its norm + ``epsilon``.
    A row that the rows before it span (what is left of it after their projections is at
    most ``DEPENDENT`` of its norm: rounding, which scaled to norm 1 would point anywhere) is
    set to zero, so that P P^T stays a projection where the sum's rank is below r.
    Elementwise NumPy and pairwise sums only, so equal inputs give equal bits at any memory
    alignment."""
    eps = _F32(epsilon)
    before = [_norm(pt[i]) for i in range(pt.shape[0])]
    for i in range(pt.shape[0]):
        col = pt[i]
        scale = np.max(np.abs(col)) if col.size else _F32(0)
        if 0 < scale < np.inf:
            col /= scale  # so that the squares below cannot overflow
        norm = _F32(math.sqrt(float(np.sum(col * col, dtype=_F32))))
        if float(scale) * float(norm) <= DEPENDENT * before[i]:
            col[...] = 0  # in the span of the rows before it (or zero)
            continue
        col /= norm + eps
        for j in range(i + 1, pt.shape[0]):
            pt[j] -= np.sum(col * pt[j], dtype=_F32) * col


def _norm(row: np.ndarray) -> float:
    """The Euclidean norm of ``row``, without overflow (NaN where it is not finite)."""
    scale = float(np.max(np.abs(row))) if row.size else 0.0
    if not 0 < scale < math.inf:
        return scale if scale == 0 else math.nan
    return scale * math.sqrt(float(np.sum(np.square(row / _F32(scale)), dtype=_F32)))


def _draw_q(comp: PowerSGD, index: int, part: Part, draw: int) -> np.ndarray:
    """A Gaussian start Q^T (r x m), the same on every rank for the same arguments."""
    key = zlib.crc32((comp.name or "").encode())
    rng = np.random.default_rng([comp.seed & 0xFFFFFFFF, key, index, draw])
    return rng.standard_normal((part.rank, part.cols), dtype=_F32)


def with_dropped_rows_drawn(comp: PowerSGD, entry: MemoryEntry, index: int, part: Part,
                            qt: np.ndarray) -> np.ndarray | None:
    """The reduced Q^T ``qt`` (r x m, host) of tensor ``index`` to start the next call from,
    its zero rows drawn afresh (the same on every rank); None where it has none.

    A row of Q^T is zero where orthonormalize dropped P's column (the sum had rank below r,
    or was zero): started from it, the next call's column is zero again, and warm start would
    never find a direction the later sums have, sending only the rest for good (a tensor
    first reduced all zeros was never sent again)."""
    zero = ~qt.any(axis=1)
    if not zero.any():
        return None
    fresh = qt.copy()
    fresh[zero] = _draw_q(comp, index, part, entry.calls + 1)[zero]
    return fresh


def start_q(comp: PowerSGD, entry: MemoryEntry, index: int, part: Part) -> np.ndarray:
    """The start Q^T of tensor ``index`` of a call: the one remembered (warm start), else a
    seeded draw (the same on every rank)."""
    if comp.warm_start:
        q = entry.qs.get(index)
        if q is not None and q.shape == (part.rank, part.cols):
            return q
        return _draw_q(comp, index, part, 0)
    return _draw_q(comp, index, part, entry.calls)
