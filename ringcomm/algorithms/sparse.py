"""Top-k allreduce: the sparse ring, and the allgather of (index, value) pairs."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import ring
from ringcomm.algorithms.compressed_ring import keep_rounding, mix_seed
from ringcomm.codecs.topk import TopK
from ringcomm.core import trace
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["SparseRingCodec", "allgather_allreduce", "decode_message", "message_offsets",
           "ring_allreduce"]


def decode_message(ops: Any, msg: Any, acc: Array) -> None:
    """Write the chunk that sparse-ring message ``msg`` carries into float32 ``acc``: its
    values where it travelled dense, else zeros and its pairs."""
    if msg.size == 4 * acc.size:
        ops.copy(acc, msg.view(np.float32))
    else:
        acc[...] = 0
        ops.scatter_add(acc, *TopK.unpack(msg))


def message_offsets(comp: TopK, length: int, n: int) -> list[int]:
    """Byte offsets of the sparse ring's ``n`` chunk messages of a ``length``-element array
    (``n + 1`` of them; the last is their total): each chunk's ``TopK.message_nbytes``."""
    chunks = ring.chunk_bounds(length, n)
    sizes = [comp.message_nbytes(chunks[c + 1] - chunks[c]) for c in range(n)]
    return np.cumsum([0, *sizes]).tolist()


class SparseRingCodec:
    """Ring codec for top-k: one message per chunk, re-sparsified at every hop.

    Chunk c keeps k_c = ceil(ratio * len(c)) entries at every hop, so message sizes are known to
    both ends. Where k_c pairs (8 bytes each) would not be smaller than the chunk's float32
    values, the chunk travels dense and loses nothing (SparCML's switch).
    """

    def __init__(self, t: Transport, x: Array, out: Array, op: ReduceOp, comp: TopK,
                 residual: Array | None, seed: int, layout: ring.RingLayout) -> None:
        self.x, self.out, self.op, self.comp = x, out, op, comp
        self.residual, self.seed, self.layout = residual, seed, layout
        self.ops = _ops.get(x)
        n = layout.n
        self.k = [comp.k_for(layout.chunk_len(c)) for c in range(n)]
        self.offsets = message_offsets(comp, layout.length, n)
        sizes = [self.offsets[c + 1] - self.offsets[c] for c in range(n)]
        self.dense = [sizes[c] == 4 * layout.chunk_len(c) for c in range(n)]
        self.store = self.ops.empty((self.offsets[-1],), np.uint8)
        widest = max(sizes)
        self.staged = ring.staging(t, "sring.send", x, widest, np.uint8)
        self.inbox = ring.staging(t, "sring.recv", x, widest, np.uint8)
        widest_chunk = max(layout.chunk_len(c) for c in range(n))
        self.acc = t.scratch("sring.acc", x, widest_chunk, np.float32)

    def _nbytes(self, c: int) -> int:
        return self.offsets[c + 1] - self.offsets[c]

    def _encode(self, acc: Array, c: int, msg: Any, error: Any | None) -> Any:
        """Select chunk c's share of k from ``acc`` into ``msg``; the rest goes to ``error``."""
        if self.dense[c]:
            self.ops.copy(msg.view(np.float32), acc)
            if error is not None:
                error[...] = 0
            return msg
        seed = mix_seed(self.seed, (self.layout.rank - c) % self.layout.n)
        idx, val = self.comp.select(acc, self.k[c], seed=seed)
        TopK.pack(idx, val, msg)
        if error is not None:
            self.ops.sparse_residual(acc, idx, error)
        return msg

    def _decode_add(self, msg: Any, c: int, acc: Array) -> None:
        if self.dense[c]:
            self.ops.reduce(ReduceOp.SUM, acc, msg.view(np.float32), acc)
        else:
            self.ops.scatter_add(acc, *TopK.unpack(msg))

    def _error(self, c: int) -> Any | None:
        return None if self.residual is None else self.residual[self.layout.chunk(c)]

    def _own(self, c: int) -> tuple[Any, Any | None]:
        """Chunk c of input plus residual, accumulated in the residual itself when there is one
        (what the selection leaves there is the new residual), else in scratch."""
        error = self._error(c)
        acc = self.acc[: self.layout.chunk_len(c)] if error is None else error
        self.ops.compensate(self.x[self.layout.chunk(c)], error, acc)
        return acc, error

    def rs_first(self, c: int, j: int, slot: int) -> Any:
        msg = self.staged[slot][: self._nbytes(c)]
        acc, error = self._own(c)
        return self._encode(acc, c, msg, error)

    def rs_recv(self, c: int, j: int, slot: int) -> Any:
        return self.inbox[slot][: self._nbytes(c)]

    def rs_reduce(self, buf: Array, c: int, j: int, final: bool) -> Any:
        acc, error = self._own(c)
        self._decode_add(buf, c, acc)
        msg = self._encode(acc, c, self._slot(c), error)
        if final:
            self._write(msg, c, own=True)
        return msg

    def ag_recv(self, c: int, j: int) -> Any:
        return self._slot(c)

    def ag_done(self, buf: Array, c: int, j: int) -> Any:
        self._write(buf, c)
        return buf

    def _slot(self, c: int) -> Any:
        return self.store[self.offsets[c]: self.offsets[c + 1]]

    def _write(self, msg: Any, c: int, own: bool = False) -> None:
        """Decode an owner's message into the result (every rank decodes the same bytes)."""
        out = self.out[self.layout.chunk(c)]
        acc = out if out.dtype == np.float32 else self.acc[: self.layout.chunk_len(c)]
        decode_message(self.ops, msg, acc)
        if self.op is ReduceOp.AVG:
            self.ops.divide(acc, self.layout.n, acc)
        if acc is not out:
            self.ops.copy(out, acc)
            if own:
                keep_rounding(self.ops, self._error(c), acc, out, self.op, self.layout.n)


def ring_allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, comp: TopK,
                   residual: Array | None, seed: int, *, segment_bytes: int = 0) -> None:
    """Sparse-ring allreduce of flat ``x`` plus ``residual`` into ``out``.

    Each chunk travels as one message (its k pairs are selected over the whole chunk), so
    ``segment_bytes`` does not apply.
    """
    layout = ring.RingLayout.build(x.size, t.size, t.rank, max(x.size, 1))
    ring.run(t, layout, SparseRingCodec(t, x, out, op, comp, residual, seed, layout))


def allgather_allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, comp: TopK,
                        residual: Array | None, seed: int, *, segment_bytes: int = 0) -> None:
    """Gather every rank's k pairs and add them, rank by rank, on every rank (one message:
    ``segment_bytes`` does not apply)."""
    ops = _ops.get(x)
    k = comp.k_for(x.size)
    with trace.span("COMPRESS"):
        work = residual if residual is not None else ops.empty((x.size,), np.float32)
        ops.compensate(x, residual, work)
        idx, val = comp.select(work, k, seed=seed)
        if residual is not None:
            ops.sparse_residual(work, idx, residual)
        payload = TopK.pack(idx, val, ops.empty((8 * k,), np.uint8))
    gathered = ops.empty((t.size * 8 * k,), np.uint8)
    t.allgatherv(payload, [8 * k] * t.size, gathered)
    t.stats.add(payload.nbytes * (t.size - 1), payload.nbytes * (t.size - 1))
    with trace.span("DECOMPRESS"):
        acc = ops.zeros((x.size,), np.float32)
        for r in range(t.size):  # rank order: the same float32 sums on every rank
            ops.scatter_add(acc, *TopK.unpack(gathered[r * 8 * k: (r + 1) * 8 * k]))
        if op is ReduceOp.AVG:
            ops.divide(acc, t.size, acc)
        ops.copy(out, acc)
        # Every rank holds the whole result; each keeps the rounding of its own chunk of it.
        lo, hi = ring.chunk_bounds(x.size, t.size)[t.rank: t.rank + 2]
        keep_rounding(ops, None if residual is None else residual[lo:hi], acc[lo:hi],
                      out[lo:hi], op, t.size)
