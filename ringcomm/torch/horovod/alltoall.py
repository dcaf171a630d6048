"""Horovod's alltoall on torch tensors.

Each call is one named operation, negotiated like the collectives of
:mod:`ringcomm.torch.horovod.functions`. Results are new tensors; the inputs are left alone.

Every rank sends ``splits[d]`` rows to rank ``d`` and receives, in rank order, what each rank
sends it. The send counts of every rank are gathered first (the same step checks every rank's
``splits``), then the rows move in ``size - 1`` pairwise exchanges.

Errors are raised on every rank alike: dtype and trailing shape, which must be equal on every
rank, fail with HorovodInternalError when they differ; a scalar input raises ValueError when
the operation runs; bad ``splits`` on any rank raise ValueError on every rank, naming the ranks.

The gradient follows Horovod: the alltoall of the output gradients back along the received
splits (rows that were not sent get zeros).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ringcomm.comm.base import Communicator
from ringcomm.torch._all_to_all import move_bytes
from ringcomm.torch._engine import Handle
from ringcomm.torch._tensors import as_array, sync_device
from ringcomm.torch.horovod._basics import global_process_set
from ringcomm.torch.horovod._exchange_util import (
    allgather_ints,
    byte_view,
    check_tensor,
    op_label,
    row_elems,
    total_nbytes,
)
from ringcomm.torch.horovod._negotiate import enqueue, execute
from ringcomm.torch.horovod._ops import Op, describe

__all__ = ["alltoall", "alltoall_async"]


# What ``splits`` may be wrong with, by code; a rank that reports one fails the call everywhere.
_SPLIT_PROBLEMS = {
    1: "splits must be one-dimensional, got {detail} dimensions",
    2: "splits must be integers",
    3: "splits has {detail} entries; expected one per rank ({size})",
    4: "splits has a negative entry ({detail})",
    5: "the sum of splits ({detail}) is greater than the first dimension of the tensor ({dim0})",
    6: "splits not given, and the first dimension of the tensor ({dim0}) is not a multiple of "
       "the number of ranks ({size})",
}


def _read_splits(splits: Any) -> tuple[list[int] | None, int, int]:
    """``(counts, problem, detail)``: counts None for an equal split (no splits, or empty)."""
    if splits is None:
        return None, 0, 0
    try:
        t = splits if isinstance(splits, torch.Tensor) else torch.as_tensor(splits)
    except (TypeError, ValueError, RuntimeError):
        return None, 2, 0
    if t.dim() != 1:
        return None, 1, t.dim()
    if t.numel() == 0:
        return None, 0, 0
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        return None, 2, 0
    return [int(v) for v in t.tolist()], 0, 0


def _split_row(size: int, dim0: int, counts: list[int] | None, problem: int,
               detail: int) -> list[int]:
    """What this rank tells the others: ``[problem, dim0, detail, count to each rank...]``."""
    if not problem:
        if counts is None:
            if dim0 % size:
                problem = 6
            else:
                counts = [dim0 // size] * size
        elif len(counts) != size:
            problem, detail = 3, len(counts)
        elif min(counts) < 0:
            problem, detail = 4, min(counts)
        elif sum(counts) > dim0:
            problem, detail = 5, sum(counts)
    sends = counts if not problem and counts is not None else [0] * size
    return [problem, dim0, detail, *sends]


def _raise_bad_splits(label: str, table: np.ndarray) -> None:
    size = len(table)
    bad = [f"rank {r}: " + _SPLIT_PROBLEMS[int(code)].format(detail=int(detail), dim0=int(dim0),
                                                             size=size)
           for r, (code, dim0, detail) in enumerate(table[:, :3].tolist()) if code]
    if bad:
        raise ValueError(f"{label}: " + "; ".join(bad))


def _exchange(comm: Communicator, tensor: torch.Tensor, sends: np.ndarray) -> torch.Tensor:
    """Move rows: ``sends[s, d]`` rows from rank s to rank d, received in rank order."""
    width = row_elems(tensor) * tensor.element_size()
    out = torch.empty((int(sends[:, comm.rank].sum()), *tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    dst = as_array(byte_view(out))
    move_bytes(comm, as_array(byte_view(tensor)), dst, sends * width)
    sync_device(dst)
    return out


def _alltoall_op(tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Op:
    check_tensor(tensor)
    counts, problem, detail = _read_splits(splits)
    given = isinstance(splits, torch.Tensor) and not problem
    recv_dtype = splits.dtype if given else torch.int32
    recv_device = splits.device if given else torch.device("cpu")
    meta = describe(tensor, trailing=True)
    meta["dim"] = tensor.dim()
    label = op_label("alltoall", name)

    def run(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        if tensor.dim() == 0:
            raise ValueError(f"{label}: needs a tensor with at least one dimension, got a "
                             "scalar")
        row = _split_row(comm.size, tensor.shape[0], counts, problem, detail)
        table = allgather_ints(comm, row, tensor.device)
        _raise_bad_splits(label, table)
        sends = table[:, 3:]
        received = torch.tensor(sends[:, comm.rank].tolist(), dtype=recv_dtype,
                                device=recv_device)
        return _exchange(comm, tensor, sends), received
    return Op("alltoall", name, meta, run, nbytes=total_nbytes([tensor]), process_set=process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: Any) -> Any:
        out, received = execute(_alltoall_op(tensor, splits, name, process_set))
        ctx.received, ctx.rows, ctx.process_set = received, tensor.shape[0], process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        back, _ = execute(_alltoall_op(grad, ctx.received, None, ctx.process_set))
        missing = ctx.rows - back.shape[0]  # rows past the sum of splits were not sent
        if missing:
            back = torch.cat([back, back.new_zeros((missing, *back.shape[1:]))])
        return back, None, None, None


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start an alltoall of ``tensor`` (see :func:`alltoall`).

    Returns:
        A handle; ``synchronize`` returns ``(output, received_splits)``, with or without
        ``splits``.

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """
    return enqueue(_alltoall_op(tensor, splits, name, process_set))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send ``splits[d]`` rows of ``tensor`` to each rank d; return the rows received.

    Rows go out in order: the first ``splits[0]`` to rank 0, the next ``splits[1]`` to rank 1,
    and so on (rows past the sum of ``splits`` are not sent). The output holds what every rank
    sent this one, in rank order.

    Args:
        tensor: the rows to distribute; dtype and trailing shape equal on every rank, the first
            dimension free.
        splits: one row count per rank (a 1-D integer tensor or a list); None (or empty)
            splits dimension 0 equally.
        name: the operation's name (operations are matched across ranks by name).
        process_set: the process set to run on (every rank by default).

    Returns:
        The received rows (a new tensor) when ``splits`` is None; otherwise
        ``(output, received_splits)``, with the count received from each rank (the dtype and
        device of ``splits`` when it is a tensor, int32 otherwise). The output's gradient is
        the alltoall of its gradient back to where the rows came from.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: on every rank, when any rank's ``splits`` is invalid (not integers, not one
            per rank, negative, summing past dimension 0), when dimension 0 does not divide
            equally without ``splits``, or when ``tensor`` is a scalar.
        HorovodInternalError: dtype or trailing shape differ between ranks (on every rank).

    Example::

        rows, counts = hvd.alltoall(tokens, splits=tokens_per_rank)
    """
    check_tensor(tensor)
    return _Alltoall.apply(tensor, splits, name, process_set)

