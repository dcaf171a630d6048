"""Compressed allreduce: error-feedback bookkeeping, then the algorithm the compressor names.

Each compressor names the algorithm that reduces its payloads (``allreduce_algorithm``); this
module holds the one table of those names. A new algorithm is one module of its own plus its
line in ``ALGORITHMS``; a new compressor that reuses an algorithm touches neither.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import compressed_ring as ring
from ringcomm.algorithms import powersgd_ring, sparse
from ringcomm.algorithms import ring as dense_ring
from ringcomm.codecs.base import Compressor
from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.core.types import Array, ReduceOp, Transport, accumulation_dtype

__all__ = ["ALGORITHMS", "AllreduceAlgorithm", "algorithm_of", "allreduce"]


class AllreduceAlgorithm(Protocol):
    """Reduce flat ``x`` plus ``residual`` into flat ``out`` through ``comp`` over ``t``; the
    residual (None without error feedback) receives everything this rank did not send."""

    def __call__(self, t: Transport, x: Array, out: Array, op: ReduceOp, comp: Any,
                 residual: Array | None, seed: int, *, segment_bytes: int) -> None: ...


#: Compressed allreduce algorithms by the name a compressor gives in ``allreduce_algorithm``.
ALGORITHMS: dict[str, AllreduceAlgorithm] = {
    "ring": ring.allreduce,
    "sparse-ring": sparse.ring_allreduce,
    "sparse-allgather": sparse.allgather_allreduce,
    "powersgd": powersgd_ring.allreduce,
}


def algorithm_of(comp: Compressor) -> AllreduceAlgorithm:
    """The algorithm that ``comp`` names (``allreduce_algorithm``).

    Raises:
        ValueError: ``comp`` names none of ``ALGORITHMS``.
    """
    algorithm = ALGORITHMS.get(comp.allreduce_algorithm)
    if algorithm is None:
        raise ValueError(f"{comp!r} names allreduce algorithm {comp.allreduce_algorithm!r}; "
                         f"known: {', '.join(sorted(ALGORITHMS))}")
    return algorithm


def allreduce(t: Transport, x: Array, out: Array, op: ReduceOp, comp: Compressor | None,
              feedback: ErrorFeedback | None, name: str | None, seed: int, *,
              segment_bytes: int = dense_ring.DEFAULT_SEGMENT_BYTES) -> None:
    """Compressed allreduce of flat ``x`` into flat ``out`` (arguments already checked).

    The input plus this rank's residual is what gets compressed; the residual is then
    overwritten with everything this rank did not send. ``comp`` None (what "auto" may pick)
    sends input plus residual dense, spending the residual (a 16-bit float result's rounding
    then goes into it, as a compressor's does). ``seed`` keys the random numbers
    of stochastic rounding and sampling; it differs per call and rank.
    """
    ops = _ops.get(x)
    residual = None
    if feedback is not None:
        if name is None:
            raise ValueError("feedback needs name=... to key the residual of this tensor")
        residual = feedback.take(name, x)
    if comp is None:
        _dense(t, x, out, op, feedback, name, residual, segment_bytes)
        return
    if t.size == 1:
        # Nothing travels, so nothing is lost: the residual is spent.
        work = ops.empty((x.size,), np.float32)
        ops.compensate(x, residual, work)
        ops.copy(out, work)
        if residual is not None:
            residual[...] = 0
        return
    algorithm = algorithm_of(comp)  # checked before the agreement
    # The algorithms add the residual to the input chunk by chunk, as they first read it, and
    # overwrite it there with what they did not send.
    algorithm(t, x, out, op, comp, residual, seed, segment_bytes=segment_bytes)


def _dense(t: Transport, x: Array, out: Array, op: ReduceOp, feedback: ErrorFeedback | None,
           name: str | None, residual: Array | None, segment_bytes: int) -> None:
    """The dense choice of "auto": flat ``x`` plus the pending ``residual``, which is spent.

    16-bit floats are summed in float32 and rounded once, and what that rounding lost goes
    into the residual, each rank keeping its own chunk of the elements (counted once), as
    every compressor keeps its final rounding: the results plus the residuals still equal
    the inputs to float32 rounding. Other dtypes reduce in their own.
    """
    if feedback is None or residual is None:  # (feedback given: the residual taken)
        dense_ring.allreduce(t, x, out, op, segment_bytes=segment_bytes)
        return
    ops = _ops.get(x)
    wide = accumulation_dtype(np.dtype(x.dtype))
    work = ops.empty((x.size,), wide)
    ops.reduce(ReduceOp.SUM, x, residual, work)
    if wide == x.dtype:
        feedback.reset(name)  # spent: later dense calls need not add zeros
        dense_ring.allreduce(t, work, out, op, segment_bytes=segment_bytes)
        return
    dense_ring.allreduce(t, work, work, op, segment_bytes=segment_bytes)
    ops.copy(out, work)
    residual[...] = 0
    ring.keep_chunk_rounding(ops, t, residual, work, out, op, t.size)
