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
    if comm.size == 1 or comp is None:
        # Nothing is lost (nothing travels, or it travels dense): the residual is spent.
        work = ops.empty((x.size,), np.float32)
        ops.compensate(x, residual, work)
        if comp is None:
            comm._allreduce_dense(work, work, op)
        ops.copy(out, work)
        if residual is not None:
            residual[...] = 0
            if comp is None and feedback is not None:
                feedback.reset(name)  # spent: later dense calls need not add zeros
        return
    # The algorithms add the residual to the input chunk by chunk, as they first read it, and
    # overwrite it there with what they did not send.
    seed = ring.mix_seed(comm._compressed_calls, comm.rank)
    _algorithm(comp)(comm, x, out, op, comp, residual, seed)
