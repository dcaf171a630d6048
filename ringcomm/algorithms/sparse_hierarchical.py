"""Two-level top-k allreduce whose node-local phases move selected pairs, not float32.

The dense two-level allreduce (:mod:`ringcomm.algorithms.hierarchical`) reduces each node's
float32 array before anything is compressed: inside the node it moves the whole array twice,
where the flat sparse ring moves a few pairs. This one keeps every phase sparse:

1. node-local: each rank selects its share of k from every other local rank's shard of its
   input plus residual (``k_for`` of the shard, the shard's own ratio) and sends those pairs
   straight to the shard's owner, which adds them to its own shard (``L - 1`` direct
   exchanges, no re-selection on the way);
2. cross-node: the owners of shard ``l`` (one per node) run the sparse ring over it
   (:class:`ringcomm.algorithms.sparse.SparseRingCodec`), each adding its residual there;
3. node-local allgather: the cross-node ring's messages of every shard (the pairs that decode
   to the finished shard) travel to the node's other ranks, which decode the same bytes in the
   same order, so every rank of the job holds the same bits.

Each rank selects over ``(L - 1) / L`` of its array in phase 1 and over its whole shard, ``1 /
L`` of the array, in phase 2 (``C`` selections of ``1 / C`` of it, the last one the owner's
message): the whole array, as in the flat ring (``n`` selections of ``1 / n``), and each node's
link carries the pairs of ``L`` cross-node rings of ``1 / L`` of the array.

Error feedback: what phase 1 did not send of another rank's shard stays in this rank's
residual there; the owner's residual takes what the cross-node ring did not send of its
shard. Input plus residual summed over the job equals the result plus the new residuals, to
float32 rounding, as for every compressed allreduce. The residual is nonzero anywhere after a
call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import ring
from ringcomm.algorithms.compressed_ring import keep_chunk_rounding, mix_seed
from ringcomm.algorithms.sparse import SparseRingCodec, decode_message, message_offsets
from ringcomm.codecs.base import Compressor
from ringcomm.codecs.topk import TopK
from ringcomm.core import trace
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["allreduce", "applies", "applies_to_shape", "message_offsets"]


def applies(local: Transport, cross: Transport, length: int, comp: Compressor | None) -> bool:
    """Whether the two-level allreduce of ``length`` elements through ``comp`` runs here: a
    top-k ring compressor, several nodes, and node-local shards whose selected pairs are
    smaller than their float32 values (at higher ratios the dense two-level path loses
    nothing and moves no more)."""
    return applies_to_shape(local.size, cross.size, length, comp)


def applies_to_shape(local_size: int, nodes: int, length: int, comp: Compressor | None) -> bool:
    """``applies`` for nodes of ``local_size`` ranks, ``nodes`` of them (before the node-local
    and cross-node transports are made)."""
    if not isinstance(comp, TopK) or comp.allreduce_algorithm != "sparse-ring":
        return False
    if nodes < 2 or local_size < 2 or length < local_size * nodes:
        return False
    shortest = length // local_size
    return 8 * comp.k_for(shortest + 1) < 4 * shortest


def allreduce(local: Transport, cross: Transport, x: Array, out: Array, op: ReduceOp,
              comp: TopK, residual: Array | None = None, seed: int = 0) -> None:
    """Allreduce flat ``x`` plus ``residual`` into flat ``out`` (which may be ``x``) in two
    levels, every phase sparse (see the module's docstring).

    Arguments as :func:`ringcomm.algorithms.hierarchical.allreduce`, already checked, with
    ``applies(local, cross, x.size, comp)`` true on every rank.
    """
    ops = _ops.get(x)
    whole = local.size * cross.size
    bounds = ring.chunk_bounds(x.size, local.size)
    lo, hi = bounds[local.rank], bounds[local.rank + 1]
    with trace.span("LOCAL_REDUCE_SCATTER"):
        shard = _gather_shard(local, ops, x, comp, residual, bounds, seed)
    with trace.span("CROSS_ALLREDUCE"):
        layout = ring.RingLayout.build(hi - lo, cross.size, cross.rank, hi - lo)
        # Decoded straight into the result where it is float32 (the ring reads each chunk of
        # ``shard``, which may be ``out``'s, before it writes that chunk).
        reduced = out[lo:hi] if out.dtype == np.float32 else cross.scratch(
            "shier.reduced", x, hi - lo, np.float32)
        codec = SparseRingCodec(cross, shard, reduced, ReduceOp.SUM, comp,
                                None if residual is None else residual[lo:hi], seed, layout)
        ring.run(cross, layout, codec)
        if op is ReduceOp.AVG:
            ops.divide(reduced, whole, reduced)
        if out.dtype != np.float32:
            ops.copy(out[lo:hi], reduced)
            if residual is not None:
                keep_chunk_rounding(ops, cross, residual[lo:hi], reduced, out[lo:hi], op,
                                    whole)
    with trace.span("LOCAL_ALLGATHER"):
        _share_shards(local, cross, ops, x, out, op, comp, codec.store, bounds, whole)


def _gather_shard(local: Transport, ops: Any, x: Array, comp: TopK, residual: Array | None,
                  bounds: list[int], seed: int) -> Any:
    """Phase 1: send every other local rank the pairs selected from its shard of ``x`` plus
    ``residual``; return this rank's shard plus every pair received for it, what the
    cross-node ring reduces (with ``residual``'s shard, which the pairs were added to where
    there is one, else in a float32 copy of the shard)."""
    n, r = local.size, local.rank
    lo, hi = bounds[r], bounds[r + 1]
    if residual is None:
        target = local.scratch("shier.shard", x, hi - lo, np.float32)
        ops.compensate(x[lo:hi], None, target)
        shard = target
    else:
        target, shard = residual[lo:hi], x[lo:hi]
    k_own = comp.k_for(hi - lo)
    inbox = local.scratch("shier.inbox", x, 8 * k_own, np.uint8)
    sent = received = 0
    for step in range(1, n):
        dest, source = (r + step) % n, (r - step) % n
        payload = _select(local, ops, x, comp, residual, bounds, dest, mix_seed(seed, step))
        local.isendrecv(payload, dest, inbox, source).wait()
        ops.scatter_add(target, *TopK.unpack(inbox))  # in step order: the same sums each call
        sent += payload.nbytes
        received += inbox.nbytes
    local.stats.add(sent, received)
    return shard


def _select(local: Transport, ops: Any, x: Array, comp: TopK, residual: Array | None,
            bounds: list[int], j: int, seed: int) -> Any:
    """The pairs of shard ``j`` of ``x`` plus ``residual`` to send its owner; what they leave
    stays in ``residual``."""
    part = slice(bounds[j], bounds[j + 1])
    if residual is None:
        acc = local.scratch("shier.acc", x, part.stop - part.start, np.float32)
    else:
        acc = residual[part]
    ops.compensate(x[part], None if residual is None else acc, acc)
    idx, val = comp.select(acc, comp.k_for(acc.size), seed=seed)
    payload = local.scratch("shier.send", x, 8 * idx.size, np.uint8)
    TopK.pack(idx, val, payload)
    if residual is not None:
        ops.sparse_residual(acc, idx, acc)
    return payload


def _share_shards(local: Transport, cross: Transport, ops: Any, x: Array, out: Array,
                  op: ReduceOp, comp: TopK, store: Any, bounds: list[int], whole: int) -> None:
    """Phase 3: pass every shard's cross-node messages around the node and decode the other
    ranks' shards into ``out`` as their owners decoded their own."""
    n, r = local.size, local.rank
    offsets = [message_offsets(comp, bounds[j + 1] - bounds[j], cross.size) for j in range(n)]
    starts = np.cumsum([0, *(o[-1] for o in offsets)]).tolist()
    messages = local.scratch("shier.messages", x, starts[-1], np.uint8)
    ops.copy(messages[starts[r]: starts[r + 1]], store)
    ring.allgather_parts(local, messages, starts)
    for j in range(n):
        if j != r:
            _decode_shard(local, ops, messages[starts[j]: starts[j + 1]], offsets[j],
                          out[bounds[j]: bounds[j + 1]], op, whole, x)


def _decode_shard(local: Transport, ops: Any, messages: Any, offsets: list[int], out: Any,
                  op: ReduceOp, whole: int, like: Array) -> None:
    """Decode a shard's cross-node messages into ``out`` as :class:`SparseRingCodec` decodes
    its own (``decode_message``), "avg" divided by ``whole``."""
    chunks = ring.chunk_bounds(out.size, len(offsets) - 1)
    for c in range(len(offsets) - 1):
        dst = out[chunks[c]: chunks[c + 1]]
        msg = messages[offsets[c]: offsets[c + 1]]
        acc = dst if dst.dtype == np.float32 else local.scratch(
            "shier.decoded", like, dst.size, np.float32)
        decode_message(ops, msg, acc)
        if op is ReduceOp.AVG:
            ops.divide(acc, whole, acc)
        if acc is not dst:
            ops.copy(dst, acc)
