"""NCCL's own allreduce, the NCCL baseline of ringcomm-perf: no agreement, no checks.

The baseline runs on an NCCLTransport of its own over the benchmark's MPI communicator, so it
times ``ncclAllReduce`` on the same library, GPU and buffers as ringcomm's NCCL backend,
without the per-call argument agreement that ``comm.allreduce`` adds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ringcomm.backends.nccl import NCCLTransport
from ringcomm.core.types import ReduceOp

__all__ = ["allreduce_fn", "close_all", "transport"]

_transports: list[tuple[Any, NCCLTransport]] = []


def transport(world: Any) -> NCCLTransport:
    """Return the NCCL transport over mpi4py communicator ``world``, created on first use.

    Every rank of ``world`` must make the first call together (it starts an NCCL
    communicator); later calls return the same transport, which lives as long as the process.

    Raises:
        RuntimeError: NCCL cannot start (as for ``ringcomm.init(backend="nccl")``).
    """
    for w, t in _transports:
        if w is world:
            return t
    t = NCCLTransport(world)
    _transports.append((world, t))
    return t


def close_all() -> None:
    """Close every transport made so far (collective over each one's communicator)."""
    while _transports:
        _transports.pop()[1].close()


def allreduce_fn(world: Any, x: Any, op: str, out: Any = None) -> Callable[[], bool]:
    """Return a call that enqueues NCCL's allreduce of CuPy array ``x`` into ``out`` on the
    current stream (the caller synchronizes).

    Args:
        world: the mpi4py communicator of the benchmark; collective on first use.
        x: a contiguous CuPy array on the transport's GPU; left untouched unless it is ``out``.
        op: "sum", "avg", "min", "max" or "prod".
        out: where the result goes (contiguous, x's size and dtype); a copy of ``x`` when None.

    Raises:
        ValueError: unknown op.
    """
    t = transport(world)
    rop = ReduceOp.parse(op)
    flat = x.reshape(-1)
    y = flat.copy() if out is None else out.reshape(-1)
    return lambda: t.native_allreduce(flat, y, rop)
