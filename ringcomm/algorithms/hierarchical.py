"""Two-level allreduce: within each node, then across nodes, then within each node again.

A job of ``C`` nodes with ``L`` ranks each is two sets of groups: ``local`` (the ``L`` ranks of
one node, fast links) and ``cross`` (the ``C`` ranks with the same local rank, one per node,
over the network). The allreduce of a flat array runs in three phases:

1. node-local reduce-scatter: the dense ring of :mod:`ringcomm.algorithms.ring` over
   ``local``; local rank ``l`` ends with shard ``l`` (chunk ``l`` of
   ``ring.chunk_bounds(length, L)``) reduced over its node, losslessly (16-bit floats and
   compressed calls accumulate in float32);
2. cross-node allreduce of that shard, by all ``L`` local ranks at once, each over its own
   ``cross`` group: the dense ring, or the compressed algorithm the compressor names
   (``ringcomm.algorithms.compressed.ALGORITHMS``). Only this phase is lossy, so an int8 payload is
   re-quantized ``C - 1`` times instead of ``C L - 1`` times, and each node's network link
   carries ``1 / L`` of every local rank's shard traffic;
3. node-local allgather: the owners' bytes of the finished shards travel around ``local``
   unchanged, so every rank of the job holds the same bits (the ``cross`` groups already agree
   bit for bit on every shard).

Top-k (its sparse ring) on several nodes runs :mod:`ringcomm.algorithms.sparse_hierarchical`
instead, whose node-local phases move selected pairs rather than float32.

"avg" divides by the whole job's size, ``C L``, once, in float32 or the dtype. Error feedback:
the input plus this rank's residual is what gets reduced; afterwards the residual holds what
this rank's part of the cross-node phase did not send (zero outside its shard), so the sum of
the results and of every rank's residual equals the sum of the inputs, to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import ring, sparse_hierarchical
from ringcomm.algorithms.compressed import algorithm_of
from ringcomm.algorithms.compressed_ring import keep_chunk_rounding
from ringcomm.codecs.base import Compressor
from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.codecs.topk import TopK
from ringcomm.core import trace
from ringcomm.core.types import Array, ReduceOp, Transport, accumulation_dtype

__all__ = ["allreduce", "allreduce_with_feedback", "check_compressor",
           "shard_bounds"]

def check_compressor(comp: Compressor | None) -> None:
    """Raise ValueError unless the cross-node phase can reduce shards through ``comp``.

    Raises:
        ValueError: ``comp`` names an allreduce that does not work on shards of an array.
    """
    if comp is not None and not comp.shardable:
        raise ValueError(
            f"the hierarchical allreduce reduces node shards of the array, which {comp!r} "
            f"(allreduce {comp.allreduce_algorithm!r}) cannot compress: it takes compressors "
            "that treat every element alike (casts, Int8, TopK); use algorithm='flat' with "
            "this one")


def shard_bounds(length: int, local_size: int) -> list[int]:
    """The node-local shards of ``length`` elements: ``local_size + 1`` offsets, shard ``l``
    being ``[b[l], b[l + 1])`` (``ring.chunk_bounds``, the local reduce-scatter's chunks)."""
    return ring.chunk_bounds(length, local_size)


def allreduce(local: Transport, cross: Transport, x: Array, out: Array, op: ReduceOp,
              comp: Compressor | None = None, residual: Array | None = None, seed: int = 0, *,
              segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES,
              residual_within: tuple[int, int] | None = None) -> None:
    """Allreduce flat contiguous ``x`` into flat contiguous ``out`` (which may be ``x``) in two
    levels: within ``local``, across ``cross``, within ``local`` again.

    Every rank of the job calls this with its node's ``local`` transport and its ``cross``
    transport (the ranks of every node sharing its local rank, one per node, in the same node
    order in every group). Arguments are taken as checked: the same length, dtype, op and
    compressor on every rank, ``op`` "sum" or "avg" when compressed.

    Args:
        local: the ranks of this node; every node has the same number.
        cross: one rank per node, those with this rank's local rank.
        x: this rank's input, a flat array of a supported dtype (floating when compressed).
        out: the result, flat, of ``x``'s length and dtype; bit-identical on every rank.
        op: the reduction; "avg" divides by ``local.size * cross.size``.
        comp: the compressor of the cross-node phase, or None (dense everywhere).
        residual: this rank's float32 error-feedback residual of ``x``'s length, or None. It is
            added to the input, then overwritten with what the cross-node phase did not send
            and what rounding a 16-bit result lost.
        seed: keys the random numbers of the compressor (stochastic rounding, sampling); it
            should differ per call and per rank.
        segment_bytes: the rings' segment size.
        residual_within: ``[lo, hi)`` outside which ``residual`` is zero, where known (None:
            anywhere). Within this rank's shard, as the previous call of this algorithm left
            it, the residual is not added to the input before the node-local phase: only this
            rank's shard of it is nonzero, and the cross-node phase adds that to the shard
            itself (one pass over the shard instead of three over the whole array).

    Raises:
        ValueError: ``comp`` cannot reduce shards (``check_compressor``), on every rank before
            anything is sent.
    """
    check_compressor(comp)
    if x.size == 0:
        return
    if isinstance(comp, TopK) and sparse_hierarchical.applies(local, cross, x.size, comp):
        sparse_hierarchical.allreduce(local, cross, x, out, op, comp, residual, seed)
        return
    ops = _ops.get(x)
    whole = local.size * cross.size
    combine = ReduceOp.SUM if op is ReduceOp.AVG else op  # divided once, by the whole job
    bounds = shard_bounds(x.size, local.size)
    lo, hi = bounds[local.rank], bounds[local.rank + 1]
    with trace.span("LOCAL_REDUCE_SCATTER"):
        if _shard_residual(residual, residual_within, lo, hi, comp, cross, x):
            work = x  # the cross-node phase adds the shard's residual
        else:
            work = _compensated(local, ops, x, comp, residual)
        # Partial sums go into an array of this call's (the widened input, or the result,
        # which the later phases overwrite), never into the caller's input.
        shard = ring.reduce_scatter(local, work, combine, segment_bytes=segment_bytes,
                                    work=out if work is x else work)
    if hi > lo:  # every rank of a cross group has the same shard length: they skip together
        with trace.span("CROSS_ALLREDUCE"):
            shard = _cross(cross, shard, combine, comp, _part(residual, lo, hi), seed,
                           segment_bytes)
        if op is ReduceOp.AVG:
            ops.divide(shard, whole, shard)
        ops.copy(out[lo:hi], shard)  # onto itself where the ring reduced into out already
        if residual is not None:  # a 16-bit result's rounding (dense too: spent input)
            keep_chunk_rounding(ops, cross, residual[lo:hi], shard, out[lo:hi], op, whole)
    with trace.span("LOCAL_ALLGATHER"):
        ring.allgather_parts(local, out, bounds)


def allreduce_with_feedback(local: Transport, cross: Transport, x: Array, out: Array, op: ReduceOp,
                            comp: Compressor | None, feedback: ErrorFeedback | None,
                            name: str | None, seed: int, *,
                            segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES) -> None:
    """:func:`allreduce` with the residual kept by ``feedback`` under ``name`` (created as zeros
    on first use); ``comp`` None sends input plus residual dense, spending the residual (a
    16-bit float result's rounding then goes into it, this rank's chunk of its shard)."""
    if feedback is None:
        allreduce(local, cross, x, out, op, comp, None, seed, segment_bytes=segment_bytes)
        return
    if name is None:
        raise ValueError("feedback needs name=... to key the residual of this tensor")
    within = feedback.within(name)  # before ``take``, which forgets it
    residual = feedback.take(name, x)
    allreduce(local, cross, x, out, op, comp, residual, seed, segment_bytes=segment_bytes,
              residual_within=within)
    if comp is None and accumulation_dtype(np.dtype(x.dtype)) == x.dtype:
        feedback.reset(name)  # spent: later dense calls need not add zeros
        return
    if comp is not None and sparse_hierarchical.applies(local, cross, x.size, comp):
        return  # its residual is nonzero anywhere
    # What this call left: zero outside this rank's shard (the node-local phase spent the
    # rest, the cross-node phase wrote only the shard).
    bounds = shard_bounds(x.size, local.size)
    feedback.declare_within(name, bounds[local.rank], bounds[local.rank + 1])


def _compensated(local: Transport, ops: Any, x: Array, comp: Compressor | None,
                 residual: Array | None) -> Any:
    """What the node-local phase reduces: ``x`` plus ``residual`` (then zeroed: it is spent),
    in float32 for compressed calls and 16-bit floats (lossless partial sums), else in
    ``x``'s dtype; ``x`` itself when nothing is to be added or widened. A scratch buffer of
    ``local``, kept between calls: a fresh array would cost its page faults every call."""
    dtype = np.dtype(np.float32) if comp is not None else accumulation_dtype(np.dtype(x.dtype))
    if residual is None and dtype == x.dtype:
        return x
    work = local.scratch("hier.work", x, x.size, dtype)
    if residual is None:
        ops.copy(work, x)
    else:
        ops.reduce(ReduceOp.SUM, x, residual, work)
        residual[...] = 0
    return work


def _shard_residual(residual: Array | None, within: tuple[int, int] | None, lo: int, hi: int,
                    comp: Compressor | None, cross: Transport, x: Array) -> bool:
    """Whether the cross-node phase can add ``residual`` itself: it is nonzero within this
    rank's shard ``[lo, hi)`` only, the call is compressed across several nodes (whose
    algorithm adds its residual to the shard), and ``x`` is float32 (nothing to widen)."""
    return (residual is not None and within is not None and comp is not None
            and cross.size > 1 and x.dtype == np.float32
            and (within[0] == within[1] or lo <= within[0] <= within[1] <= hi))


def _part(residual: Array | None, lo: int, hi: int) -> Any | None:
    return None if residual is None else residual[lo:hi]


def _cross(cross: Transport, shard: Any, op: ReduceOp, comp: Compressor | None,
           residual: Array | None, seed: int, segment_bytes: int) -> Any:
    """Allreduce this rank's node-reduced ``shard`` over ``cross`` (in place when dense; a new
    float32 scratch buffer of ``cross`` when compressed); ``residual`` receives what it did
    not send."""
    if comp is None or cross.size == 1:  # nothing lossy travels: the residual stays zero
        ring.allreduce(cross, shard, shard, op, segment_bytes=segment_bytes)
        return shard
    reduced = cross.scratch("hier.reduced", shard, shard.size, np.float32)
    algorithm = algorithm_of(comp)
    algorithm(cross, shard, reduced, op, comp, residual, seed, segment_bytes=segment_bytes)
    return reduced
