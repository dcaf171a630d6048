"""The ring schedule: reduce-scatter then allgather, chunked and pipelined over ``isendrecv``.

The flat array is cut into ``n`` chunks, one per rank, and every chunk into the same number of
segments. In reduce-scatter step ``s`` rank ``r`` sends chunk ``r - s - 1`` to its right neighbour
and receives chunk ``r - s - 2`` from its left one, adding its own contribution; after ``n - 1``
steps it holds chunk ``r`` fully reduced. The allgather then passes the owners' bytes around the
ring unchanged, so every rank ends with the same bits. Each exchange moves one segment; the
receive of the next segment is posted before the current one is reduced, so that transfer and
reduction overlap and the reduction reads a segment that is still in cache.

What travels and how a received segment is combined is a *codec*'s business (dense arrays here;
compressed payloads in :mod:`ringcomm.algorithms.compressed_ring`); this module only schedules.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from ringcomm import ops as _ops
from ringcomm.core import trace
from ringcomm.core.types import Array, ReduceOp, Transport, accumulation_dtype

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEVICE_SEGMENTS",
    "DEVICE_SEGMENT_BYTES",
    "WINDOW",
    "RingCodec",
    "RingLayout",
    "allgather_parts",
    "allreduce",
    "chunk_bounds",
    "reduce_scatter",
    "run",
    "schedule",
    "segment_elems",
    "staging",
]

# Measured on the 2-core benchmark machine (bench/results/segment_sweep_n*.md): 2 MiB segments
# were best or within 3% of the best from 16 to 256 MiB at 2 ranks (1 MiB: 7% slower, 256 KiB:
# 30-40% slower: per-message costs dominate), and within 9% at 4 ranks.
DEFAULT_SEGMENT_BYTES = 2 << 20
# Exchanges in flight: the one being reduced and the next one, already posted.
WINDOW = 2
# On a GPU each segment of each step costs the host a kernel launch or more (tens of
# microseconds of Python and CuPy) for a few microseconds of the GPU's work: a chunk of device
# arrays is cut into at most DEVICE_SEGMENTS segments, each up to DEVICE_SEGMENT_BYTES (the
# ring's device scratch is WINDOW of them), never smaller than segment_bytes. The array kind is
# part of every call's agreement, so every rank lays the ring out alike. 0 segments: the host's
# rule on the GPU too (bench/kernels_perf.py compares both). A backend may set its own count
# (``device_segments`` of its transport, the same on every rank): gloo stages every message
# through host memory, one synchronization each, and takes 1.
DEVICE_SEGMENTS = 4
DEVICE_SEGMENT_BYTES = 16 << 20


def segment_elems(x: Array, n: int, segment_bytes: int, itemsize: int,
                  segments: int | None = None) -> int:
    """Elements per ring segment of flat ``x`` over ``n`` ranks, whose messages carry
    ``itemsize`` bytes per element before any encoding; a device array's chunk is cut into
    at most ``segments`` (``DEVICE_SEGMENTS`` when None)."""
    seg = max(1, segment_bytes // itemsize)
    cut = DEVICE_SEGMENTS if segments is None else segments
    if cut and _ops.is_device_array(x):
        chunk = -(-x.size // n)
        cap = max(seg, DEVICE_SEGMENT_BYTES // itemsize)
        seg = max(seg, min(cap, -(-chunk // cut)))
    return seg


def chunk_bounds(length: int, parts: int, align: int = 1) -> list[int]:
    """Split ``length`` elements into ``parts`` near-equal runs of whole ``align``-blocks.

    Returns ``parts + 1`` offsets; run ``i`` is ``[b[i], b[i + 1])``. Runs differ by at most one
    block, the last block may be partial, and runs are empty when there are fewer blocks than
    parts.
    """
    blocks = -(-length // align)
    return [min(length, (i * blocks // parts) * align) for i in range(parts + 1)]


@dataclass(frozen=True)
class RingLayout:
    """Chunk and segment boundaries of a flat array of ``length`` elements over ``n`` ranks.

    Every chunk has ``nseg`` segments, so the two ends of every exchange agree on its size.
    """

    length: int
    n: int
    rank: int
    nseg: int
    chunks: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    max_seg: int  # elements in the largest segment

    @classmethod
    @functools.lru_cache(maxsize=256)
    def build(cls, length: int, n: int, rank: int, seg_elems: int, align: int = 1) -> RingLayout:
        """Lay out ``length`` elements in ``n`` chunks of segments of about ``seg_elems``.

        Layouts are immutable and cached: a training loop reduces the same sizes every step.
        """
        chunks = chunk_bounds(length, n, align)
        widest = max(chunks[c + 1] - chunks[c] for c in range(n))
        nseg = max(1, math.ceil(widest / max(seg_elems, align)))
        segments = []
        for c in range(n):
            inner = chunk_bounds(chunks[c + 1] - chunks[c], nseg, align)
            segments.append(tuple(chunks[c] + b for b in inner))
        widest_seg = max(s[j + 1] - s[j] for s in segments for j in range(nseg))
        return cls(length, n, rank, nseg, tuple(chunks), tuple(segments), widest_seg)

    def chunk(self, c: int) -> slice:
        """Element range of chunk ``c``."""
        return slice(self.chunks[c], self.chunks[c + 1])

    def seg(self, c: int, j: int) -> slice:
        """Element range of segment ``j`` of chunk ``c``."""
        s = self.segments[c]
        return slice(s[j], s[j + 1])

    def seg_len(self, c: int, j: int) -> int:
        """Elements in segment ``j`` of chunk ``c``."""
        s = self.segments[c]
        return s[j + 1] - s[j]

    def chunk_len(self, c: int) -> int:
        """Elements in chunk ``c``."""
        return self.chunks[c + 1] - self.chunks[c]



class RingCodec(Protocol):
    """How a ring turns local data into messages and received messages into results.

    The scheduler calls these in ring order; (c, j) is segment j of chunk c. ``slot`` is the
    exchange's position in the window, for codecs that stage their messages.
    """

    def rs_first(self, c: int, j: int, slot: int) -> Any:
        """The message carrying this rank's own data of (c, j), sent in the first step."""

    def rs_recv(self, c: int, j: int, slot: int) -> Any:
        """A buffer to receive a partial reduction of (c, j) into."""

    def rs_reduce(self, buf: Array, c: int, j: int, final: bool) -> Any:
        """Add this rank's contribution to the received partial; return the next message.

        When ``final`` the chunk is this rank's own: finish it (average, write the result) and
        return the message the allgather sends.
        """

    def ag_recv(self, c: int, j: int) -> Any:
        """A buffer to receive the owner's message of (c, j) into."""

    def ag_done(self, buf: Array, c: int, j: int) -> Any:
        """Write the result of (c, j) from the received message; return the message to forward."""


def schedule(steps: int, nseg: int) -> list[tuple[int, int]]:
    """The order of the (step, segment) exchanges: by anti-diagonal (step + segment).

    Exchange (t, j) needs (t - 1, j) done, which lies on the previous diagonal, so exchanges of
    one diagonal are independent and the next can be posted while one is reduced. The order
    also brings every segment through its later steps (the allgather too) soon after its
    first, while its data is still in cache.
    """
    order = []
    for d in range(steps + nseg - 1):
        for t in range(min(d, steps - 1), max(-1, d - nseg), -1):
            order.append((t, d - t))
    return order


class _Unit(NamedTuple):
    """One exchange of the schedule, with everything the loop needs precomputed."""

    segment: int
    send_chunk: int
    recv_chunk: int
    dep: int  # position of the exchange whose result this one sends; -1: own data
    allgather: bool
    final: bool  # the reduce-scatter step that completes this rank's own chunk


@functools.lru_cache(maxsize=256)
def _units(n: int, rank: int, nseg: int, allgather: bool) -> tuple[_Unit, ...]:
    steps = (n - 1) * (2 if allgather else 1)
    order = schedule(steps, nseg)
    position = {unit: p for p, unit in enumerate(order)}
    units = []
    for t, j in order:
        ag = t >= n - 1
        sends = (rank - t + n - 1) if ag else (rank - t - 1)
        dep = position[(t - 1, j)] if t else -1
        units.append(_Unit(j, sends % n, (sends - 1) % n, dep, ag, t == n - 2))
    return tuple(units)


def run(t: Transport, layout: RingLayout, codec: RingCodec, *,
        allgather: bool = True) -> None:
    """Run the reduce-scatter (and the allgather, unless told not to) of ``layout``.

    Step t < n - 1 is reduce-scatter step t, later steps are allgather steps. Every rank
    walks the same schedule, so the k-th message a rank sends to its right neighbour is the
    k-th that neighbour receives from its left. The two phases are traced as spans (see
    :func:`_plan` for where one ends).
    """
    n, r = layout.n, layout.rank
    right, left = (r + 1) % n, (r - 1) % n
    units, phases = _plan(n, r, layout.nseg, allgather)
    total = len(units)
    produced: list[Any] = [None] * total
    pending: list[Any] = [None] * total
    isendrecv = t.isendrecv
    sent = received = 0
    posted = 0
    for label, first, part in phases:
        with trace.span(label):
            for p, unit in enumerate(part, first):
                # Post what can go ahead: up to WINDOW exchanges whose messages are ready.
                while posted < total and posted < p + WINDOW and units[posted].dep < p:
                    u, slot = units[posted], posted % WINDOW
                    if u.dep >= 0:
                        send = produced[u.dep]
                        produced[u.dep] = None
                    else:
                        send = codec.rs_first(u.send_chunk, u.segment, slot)
                    if u.allgather:
                        recv = codec.ag_recv(u.recv_chunk, u.segment)
                    else:
                        recv = codec.rs_recv(u.recv_chunk, u.segment, slot)
                    pending[posted] = (isendrecv(send, right, recv, left), recv)
                    sent += send.nbytes
                    received += recv.nbytes
                    posted += 1
                request, buf = pending[p]
                pending[p] = None
                request.wait()
                if unit.allgather:
                    produced[p] = codec.ag_done(buf, unit.recv_chunk, unit.segment)
                else:
                    produced[p] = codec.rs_reduce(buf, unit.recv_chunk, unit.segment,
                                                  unit.final)
    t.stats.add(sent, received)


@functools.lru_cache(maxsize=256)
def _plan(n: int, rank: int, nseg: int, allgather: bool) -> tuple[
        tuple[_Unit, ...], tuple[tuple[str, int, tuple[_Unit, ...]], ...]]:
    """The exchanges of the schedule, and its traced phases: (label, position of the first
    exchange, the exchanges).

    The reduce-scatter span ends with the last reduction; the allgather span holds the
    exchanges after it. With one segment per chunk the two are exactly the ring's phases; with
    several, the pipeline already runs the allgather of early segments while later ones are
    reduced, and those exchanges count in the reduce-scatter span.
    """
    units = _units(n, rank, nseg, allgather)
    split = 1 + max((p for p, u in enumerate(units) if not u.allgather), default=-1)
    phases = [("RING_REDUCE_SCATTER", 0, units[:split])]
    if split < len(units):
        phases.append(("RING_ALLGATHER", split, units[split:]))
    return units, tuple(phases)


def staging(t: Transport, key: str, like: Array, n: int, dtype: Any) -> list[Any]:
    """WINDOW reusable buffers of ``n`` elements, one per exchange in flight."""
    return [t.scratch(k, like, n, dtype) for k in _slot_keys(key)]


@functools.lru_cache(maxsize=64)
def _slot_keys(key: str) -> tuple[str, ...]:
    return tuple(f"{key}{i}" for i in range(WINDOW))


class _SameDtype:
    """Dense codec: partial sums in the output array itself; no staging copies."""

    def __init__(self, t: Transport, x: Array, y: Any, op: ReduceOp,
                 layout: RingLayout, own: Any = None) -> None:
        self.x, self.y, self.op, self.layout = x, y, op, layout
        self.ops = _ops.get(x)
        self.tmp = staging(t, "ring.recv", x, layout.max_seg, self.wire_dtype(x))
        #: Where this rank's own chunk's result goes where not into ``y`` (a reduce-scatter
        #: into the caller's ``out``), and where that chunk starts in ``x``.
        self.own, self.own_start = own, layout.chunks[layout.rank]

    def result(self, s: slice, final: bool) -> Any:
        """Where the reduction of elements ``s`` goes: ``own`` for the final one where
        given, else ``y``."""
        if final and self.own is not None:
            return self.own[s.start - self.own_start: s.stop - self.own_start]
        return self.y[s]

    @staticmethod
    def wire_dtype(x: Array) -> Any:
        """The dtype of the reduce-scatter's messages."""
        return x.dtype

    def rs_first(self, c: int, j: int, slot: int) -> Any:
        return self.x[self.layout.seg(c, j)]

    def rs_recv(self, c: int, j: int, slot: int) -> Any:
        s = self.layout.seg(c, j)
        return self.tmp[slot][: s.stop - s.start]

    def rs_reduce(self, buf: Array, c: int, j: int, final: bool) -> Any:
        s = self.layout.seg(c, j)
        out = self.result(s, final)
        self.ops.reduce(self.op, buf, self.x[s], out)
        if final and self.op is ReduceOp.AVG:
            self.ops.divide(out, self.layout.n, out)
        return out

    def ag_recv(self, c: int, j: int) -> Any:
        return self.y[self.layout.seg(c, j)]

    def ag_done(self, buf: Array, c: int, j: int) -> Any:
        return buf


class _Widened(_SameDtype):
    """Dense codec for 16-bit floats: partial sums travel in float32, rounded once by the owner."""

    def __init__(self, t: Transport, x: Array, y: Any, op: ReduceOp,
                 layout: RingLayout, own: Any = None) -> None:
        super().__init__(t, x, y, op, layout, own)
        acc = self.wire_dtype(x)
        widest = max(layout.chunk_len(c) for c in range(layout.n))
        self.staged = staging(t, "ring.send", x, layout.max_seg, acc)
        # Partials of step s are sent in step s + 1 while step s + 1 makes its own: two chunks.
        self.partials = [self.ops.empty((widest,), acc) for _ in range(2)]

    @staticmethod
    def wire_dtype(x: Array) -> Any:
        return accumulation_dtype(np.dtype(x.dtype))

    def rs_first(self, c: int, j: int, slot: int) -> Any:
        s = self.layout.seg(c, j)
        out = self.staged[slot][: s.stop - s.start]
        self.ops.copy(out, self.x[s])
        return out

    def rs_reduce(self, buf: Array, c: int, j: int, final: bool) -> Any:
        s = self.layout.seg(c, j)
        if final:
            self.ops.reduce(self.op, buf, self.x[s], buf)
            result = self.result(s, final)
            if self.op is ReduceOp.AVG:
                self.ops.divide(buf, self.layout.n, result)
            else:
                self.ops.copy(result, buf)
            return result
        step = (self.layout.rank - c - 2) % self.layout.n
        lo = s.start - self.layout.chunks[c]
        out = self.partials[step % 2][lo: lo + s.stop - s.start]
        self.ops.reduce(self.op, buf, self.x[s], out)
        return out


def _codec(t: Transport, x: Array, y: Any, op: ReduceOp, layout: RingLayout,
           own: Any = None) -> RingCodec:
    widen = accumulation_dtype(np.dtype(x.dtype)) != x.dtype
    return (_Widened if widen else _SameDtype)(t, x, y, op, layout, own)


def _layout(t: Transport, x: Array, segment_bytes: int) -> RingLayout:
    seg = segment_elems(x, t.size, segment_bytes, x.dtype.itemsize, t.device_segments)
    return RingLayout.build(x.size, t.size, t.rank, seg)


def allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
    """Allreduce flat contiguous ``x`` into flat contiguous ``out`` (which may be ``x``).

    The transport's own allreduce runs where it has one (NCCL); ringcomm's ring otherwise.
    """
    if t.size == 1:
        if out is not x:  # any op of one contribution is that contribution
            _ops.get(x).copy(out, x)
        return
    if t.native_allreduce(x, out, op):
        return
    layout = _layout(t, x, segment_bytes)
    run(t, layout, _codec(t, x, out, op, layout))


def reduce_scatter(t: Transport, x: Array, op: ReduceOp, *,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES, work: Any | None = None,
                   out: Any | None = None) -> Any:
    """Reduce flat ``x`` and return this rank's chunk, ``[r * L // n, (r + 1) * L // n)``:
    the transport's own reduce-scatter where it has one, the ring otherwise.

    The chunk is written into ``out`` (flat, of the chunk's length, apart from ``work``)
    where given (straight from the last reduction where it is a host array apart from
    ``x``), else into a new array. ``work``, a flat
    array of ``x``'s length and dtype (``x`` itself allowed), takes the ring's partial sums;
    where the ring runs, the chunk returned without ``out`` is then a view of it (the rest
    of ``work`` is left undefined). Without ``work`` they go into the transport's scratch,
    kept between calls: an array of ``x``'s size made anew each call costs its page faults
    every time (at 64 MiB, 2 ranks, half the call).
    """
    if t.size == 1:
        return x.copy() if out is None else _copied(out, x)
    native = t.native_reduce_scatter(x, op)
    if native is not None:
        return native if out is None else _copied(out, native)
    layout = _layout(t, x, segment_bytes)
    y = t.scratch("reduce_scatter", x, x.size, x.dtype) if work is None else work
    # Straight into out where it is a host array apart from x (x's elements are read until
    # the last step; an out inside x takes the chunk once the ring is done).
    own = out if (out is not None and type(out) is np.ndarray
                  and not np.may_share_memory(out, x)) else None
    run(t, layout, _codec(t, x, y, op, layout, own), allgather=False)
    if own is not None:
        return own
    chunk = y[layout.chunk(t.rank)]
    if out is not None:
        return _copied(out, chunk)
    return chunk.copy() if work is None else chunk


def _copied(out: Any, chunk: Any) -> Any:
    _ops.get(out).copy(out, chunk)
    return out


def allgather_parts(t: Transport, buf: Array, bounds: list[int]) -> None:
    """Pass every rank's part ``[bounds[r], bounds[r + 1])`` of flat ``buf`` around the ring of
    ``t`` unchanged, so every rank ends with every owner's bytes (``t.size - 1`` steps)."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    sent = received = 0
    for step in range(n - 1):
        mine, theirs = (r - step) % n, (r - step - 1) % n
        send = buf[bounds[mine]: bounds[mine + 1]]
        recv = buf[bounds[theirs]: bounds[theirs + 1]]
        t.isendrecv(send, right, recv, left).wait()
        sent += send.nbytes
        received += recv.nbytes
    t.stats.add(sent, received)
