"""Compressed allreduce: error-feedback bookkeeping, then the algorithm the compressor allows."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm.base import Communicator, ReduceOp
from ringcomm.compress import ring, sparse
from ringcomm.compress.base import Compressor, Wire
from ringcomm.compress.feedback import ErrorFeedback

__all__ = ["allreduce"]


def _algorithm(comp: Compressor) -> Any:
    if comp.wire is Wire.SPARSE:
        return sparse.ring_allreduce if comp.algorithm == "ring" else sparse.allgather_allreduce
    return ring.allreduce


def allreduce(comm: Communicator, x: Any, out: Any, op: ReduceOp, comp: Compressor | None,
              feedback: ErrorFeedback | None, name: str | None) -> None:
    """Compressed allreduce of flat ``x`` into flat ``out`` (arguments already checked).

    The input plus this rank's residual is what gets compressed; the residual is then
    overwritten with everything this rank did not send. ``comp`` None (what "auto" may pick)
    sends input plus residual dense, spending the residual.
    """
    ops = _ops.get(x)
    residual = feedback.take(name, x) if feedback is not None else None
    if comp is None:
        # Dense ("auto" may choose it): the input plus the pending residual, in the input's
        # own dtype, and the residual is spent.
        work = x
        if residual is not None:
            work = ops.empty((x.size,), x.dtype)
            ops.reduce(ReduceOp.SUM, x, residual, work)
            feedback.reset(name)  # later dense calls need not add zeros
        comm._allreduce_dense(work, out, op)
        return
    if comm.size == 1:
        # Nothing travels, so nothing is lost: the residual is spent.
        work = ops.empty((x.size,), np.float32)
        ops.compensate(x, residual, work)
        ops.copy(out, work)
        if residual is not None:
            residual[...] = 0
        return
    # The algorithms add the residual to the input chunk by chunk, as they first read it, and
    # overwrite it there with what they did not send.
    seed = ring.mix_seed(comm._compressed_calls, comm.rank)
    _algorithm(comp)(comm, x, out, op, comp, residual, seed)
