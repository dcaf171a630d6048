"""Compressed ring allreduce for dense payloads (casts, int8).

Reduce-scatter: the first hop encodes this rank's chunk; every later hop decodes the partial it
received, adds its own contribution in float32 and encodes again (one fused ``hop``); the owner
encodes the reduced chunk once more and decodes its own bytes as its result. Allgather: the
owner's payload travels unchanged and every rank decodes the same bytes, so results are
bit-identical. Every encoding's error goes to the residual of the rank that made it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import ring
from ringcomm.codecs.base import DenseCompressor
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["CompressedCodec", "add_rounding", "allreduce", "keep_chunk_rounding", "keep_rounding",
           "mix_seed"]


def mix_seed(*values: int) -> int:
    """A 32-bit seed mixed from integers (call, rank, hop), the same on CPU and GPU."""
    h = 0x811C9DC5
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
        h ^= h >> 13
    return h


class CompressedCodec:
    """Ring codec whose messages are a DenseCompressor's payloads.

    Every buffer is the transport's scratch, kept between calls (the payloads of the whole array
    too): a training loop reduces the same sizes every step, and a fresh array would cost an
    allocation, and on the host the page faults of its first touch, every call. Each is written
    in a call before that call reads it.
    """

    def __init__(self, t: Transport, x: Array, out: Array, op: ReduceOp,
                 comp: DenseCompressor, residual: Array | None, seed: int,
                 layout: ring.RingLayout) -> None:
        self.x, self.out, self.op, self.comp = x, out, op, comp
        self.residual, self.seed, self.layout = residual, seed, layout
        self.ops = _ops.get(x)
        n = layout.n
        sizes = [comp.nbytes(layout.seg_len(c, j)) for c in range(n) for j in range(layout.nseg)]
        self.offsets = np.cumsum([0, *sizes]).tolist()
        self.store = t.scratch("cring.store", x, self.offsets[-1], np.uint8)
        widest = comp.nbytes(layout.max_seg)
        self.staged = ring.staging(t, "cring.send", x, widest, np.uint8)
        self.inbox = ring.staging(t, "cring.recv", x, widest, np.uint8)
        # Without a residual, a float32 input is its own compensated value: read in place.
        self.own = None if residual is None and x.dtype == np.float32 else t.scratch(
            "cring.own", x, layout.max_seg, np.float32)
        self.decoded = None if out.dtype == np.float32 else t.scratch(
            "cring.decoded", x, layout.max_seg, np.float32)

    def _slot(self, c: int, j: int) -> Any:
        i = c * self.layout.nseg + j
        return self.store[self.offsets[i]: self.offsets[i + 1]]

    def _seed(self, c: int) -> int:
        # The call's seed already differs per call and rank; the hop tells the chunks apart.
        return mix_seed(self.seed, (self.layout.rank - c) % self.layout.n)

    def _error(self, s: slice) -> Any | None:
        return None if self.residual is None else self.residual[s]

    def _own(self, s: slice) -> Any:
        """This rank's input plus residual on ``s``, in float32 (its residual is then free to
        receive this hop's error); the input itself when it is float32 without a residual
        (encode and hop only read it)."""
        if self.own is None:
            return self.x[s]
        own = self.own[: s.stop - s.start]
        self.ops.compensate(self.x[s], self._error(s), own)
        return own

    def rs_first(self, c: int, j: int, slot: int) -> Any:
        s = self.layout.seg(c, j)
        msg = self.staged[slot][: self.comp.nbytes(s.stop - s.start)]
        self.comp.encode(self._own(s), msg, seed=self._seed(c), base=s.start,
                         error=self._error(s))
        return msg

    def rs_recv(self, c: int, j: int, slot: int) -> Any:
        s = self.layout.seg(c, j)
        return self.inbox[slot][: self.comp.nbytes(s.stop - s.start)]

    def rs_reduce(self, buf: Array, c: int, j: int, final: bool) -> Any:
        s = self.layout.seg(c, j)
        msg = self._slot(c, j)
        self.comp.hop(buf, self._own(s), msg, seed=self._seed(c), base=s.start,
                      error=self._error(s))
        if final:
            self._write(msg, s, own=True)
        return msg

    def ag_recv(self, c: int, j: int) -> Any:
        return self._slot(c, j)

    def ag_done(self, buf: Array, c: int, j: int) -> Any:
        self._write(buf, self.layout.seg(c, j))
        return buf

    def _write(self, msg: Any, s: slice, own: bool = False) -> None:
        """Decode an owner's payload into the result (every rank decodes the same bytes)."""
        out = self.out[s]
        target = out if self.decoded is None else self.decoded[: s.stop - s.start]
        self.comp.decode(msg, target)
        avg = self.op is ReduceOp.AVG
        if avg and not own and out.dtype.itemsize == 2:
            # The float32 quotient rounded into 16 bits in one pass, as the two below do it.
            self.ops.divide(target, self.layout.n, out)
            return
        if avg:
            self.ops.divide(target, self.layout.n, target)
        if target is not out:
            self.ops.copy(out, target)
            if own:
                keep_rounding(self.ops, self._error(s), target, out, self.op, self.layout.n)


def keep_rounding(ops: Any, residual: Array | None, exact: Any, out: Array, op: ReduceOp,
                  n: int) -> None:
    """Add to ``residual`` what rounding float32 ``exact`` into ``out`` lost (16-bit outputs;
    in the residual's units: times n for "avg"). Only a chunk's owner calls this, once."""
    if residual is None or out.dtype.itemsize >= 4:
        return
    add_rounding(ops, residual, exact, out.astype(np.float32), op, n)


def add_rounding(ops: Any, residual: Array, exact: Any, rounded: Any, op: ReduceOp,
                 n: int) -> None:
    """Add to ``residual`` float32 ``exact`` less ``rounded`` (what rounding it lost, as float32
    values; times n for "avg"), 0 where either is not finite (the result carries those)."""
    with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf: zeroed just below
        lost = exact - rounded
        if op is ReduceOp.AVG:
            lost *= n
    ops.zero_nonfinite(lost)  # NaN/Inf are in the result already
    residual += lost


def allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, comp: DenseCompressor,
              residual: Array | None, seed: int, *,
              segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES) -> None:
    """Ring-allreduce flat ``x`` plus ``residual`` into ``out`` through ``comp``; the residual
    receives every error this rank makes."""
    seg = ring.segment_elems(x, t.size, segment_bytes, 4, t.device_segments)
    layout = ring.RingLayout.build(x.size, t.size, t.rank, seg, comp.align)
    ring.run(t, layout, CompressedCodec(t, x, out, op, comp, residual, seed, layout))


def keep_chunk_rounding(ops: Any, t: Transport, residual: Array, exact: Any, out: Array,
                        op: ReduceOp, n: int) -> None:
    """:func:`keep_rounding` of this rank's chunk (``ring.chunk_bounds`` over ``t``) of a
    shard that every rank of ``t`` holds alike: each keeps one chunk of the rounding, so it
    is counted once. ``residual``, ``exact`` and ``out`` are the shard's; ``n`` divides "avg"."""
    a, b = ring.chunk_bounds(exact.size, t.size)[t.rank: t.rank + 2]
    keep_rounding(ops, residual[a:b], exact[a:b], out[a:b], op, n)
