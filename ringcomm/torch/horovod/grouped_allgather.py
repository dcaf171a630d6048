"""Horovod's grouped_allgather on torch tensors: ``allgather`` of each tensor of a list, in
one gather of bytes.

Each call is one named operation, negotiated like the collectives of
:mod:`ringcomm.torch.horovod.functions`; the tensors of a call run together or not at all.
Results are new tensors; the inputs are left alone.

Errors are raised on every rank alike: the list, a dtype or a trailing shape that differ
between ranks, or a scalar tensor (as for allgather), fail with HorovodInternalError.

The gradient follows Horovod: per tensor, this rank's rows of the average of the output
gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ringcomm.comm.base import Communicator
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import HorovodInternalError, collective_error
from ringcomm.torch._tensors import as_array, sync_device
from ringcomm.torch.horovod._basics import Average, global_process_set
from ringcomm.torch.horovod._exchange_util import (
    allgather_ints,
    byte_view,
    check_tensors,
    describe_each,
    op_label,
    row_elems,
    total_nbytes,
)
from ringcomm.torch.horovod._negotiate import enqueue, execute
from ringcomm.torch.horovod._ops import Op
from ringcomm.torch.horovod.functions import grouped_allreduce

__all__ = ["grouped_allgather", "grouped_allgather_async"]


def _check_gather(label: str, tensors: list[torch.Tensor]) -> None:
    scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
    if scalars:
        raise HorovodInternalError(f"{label}: needs tensors with at least one dimension; "
                                   f"tensor {scalars[0]} is a scalar")
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"{label}: the tensors must be on one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")


def _gather_all(comm: Communicator,
                tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's rows of each tensor, and this rank's first row in each result: one
    allgather of the row counts, one of every rank's bytes."""
    if not tensors:
        return [], []
    size, k = comm.size, len(tensors)
    rows = allgather_ints(comm, [t.shape[0] for t in tensors], tensors[0].device)
    widths = np.array([row_elems(t) * t.element_size() for t in tensors], dtype=np.int64)
    nbytes = rows * widths  # [s, i]: bytes of tensor i from rank s
    mine = torch.cat([byte_view(t) for t in tensors])
    try:
        everyone = comm.allgatherv(as_array(mine))
    except (ValueError, TypeError) as err:
        raise collective_error(comm, err, "allgatherv", None) from err
    sync_device(everyone)
    starts = np.concatenate([[0], np.cumsum(nbytes.reshape(-1))])  # rank-major, as gathered
    outs = []
    for i, t in enumerate(tensors):
        out = torch.empty((int(rows[:, i].sum()), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dst, at = as_array(byte_view(out)), 0
        for s in range(size):
            n, start = nbytes[s, i], starts[s * k + i]
            dst[at: at + n] = everyone[start: start + n]
            at += n
        sync_device(dst)
        outs.append(out)
    return outs, [int(rows[: comm.rank, i].sum()) for i in range(k)]


def _gather_op(tensors: list[torch.Tensor], name: str | None, process_set: Any, *,
               offsets: bool) -> Op:
    meta = describe_each(tensors, trailing=True)
    label = op_label("grouped_allgather", name)

    def run(comm: Communicator) -> Any:
        _check_gather(label, tensors)
        outs, firsts = _gather_all(comm, tensors)
        return (outs, firsts) if offsets else outs
    return Op("grouped_allgather", name, meta, run, nbytes=total_nbytes(tensors),
              process_set=process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs, firsts = execute(_gather_op(list(tensors), name, process_set, offsets=True))
        ctx.firsts, ctx.process_set = firsts, process_set
        ctx.rows = [t.shape[0] for t in tensors]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        averaged = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        return (None, None, *(g.narrow(0, first, rows) for g, first, rows
                              in zip(averaged, ctx.firsts, ctx.rows, strict=True)))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start gathering each tensor of a list from every rank, as one operation;
    ``synchronize`` returns the list of results (see :func:`grouped_allgather`).

    Raises:
        TypeError: ``tensors`` is not a list of tensors.
    """
    return enqueue(_gather_op(check_tensors(tensors), name, process_set, offsets=False))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Concatenate each tensor of a list from every rank along dimension 0, as one operation.

    Each result is what ``allgather`` of that tensor returns: every rank's rows in rank order
    (the first dimension may differ between ranks, the others and the dtype may not).

    Returns:
        A list of new tensors; each one's gradient hands this rank its own rows of the average
        of the output gradients (Horovod's rule).

    Raises:
        TypeError: ``tensors`` is not a list of tensors.
        HorovodInternalError: the list, a dtype or a trailing shape differ between ranks, or a
            tensor is a scalar (on every rank).

    Example::

        preds, labels = hvd.grouped_allgather([local_preds, local_labels])
    """
    tensors = check_tensors(tensors)
    if not tensors:
        return execute(_gather_op([], name, process_set, offsets=False))
    return list(_GroupedAllgather.apply(name, process_set, *tensors))
