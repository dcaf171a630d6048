"""Horovod's reducescatter and grouped_reducescatter on torch tensors.

Each call is one named operation, negotiated like the collectives of
:mod:`ringcomm.torch.horovod.functions`; a grouped call is a single operation, so its tensors run
together or not at all. Results are new tensors; the inputs are left alone.

The result is the sum (or average) over ranks of a tensor of one shape, split along dimension
0 as Horovod splits it: every rank gets ``rows // size`` rows and the first ``rows % size``
ranks one more. It runs as the communicator's reduce-scatter (one per dtype in a group), on a
buffer where each rank's rows fill one equal chunk, padded where rows do not divide evenly.

Errors are raised on every rank alike: fields that must be equal on every rank (dtype, shape,
op, scaling) fail with HorovodInternalError when they differ; an argument that every rank gives
alike and that cannot run raises when the operation runs (ValueError for a scalar input,
HorovodInternalError for an op other than Sum or Average).

The gradient follows Horovod: the allgather of the output gradients, times the size for
hvd.Sum and times the scale factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringcomm.comm.base import Communicator
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import HorovodInternalError, collective_error
from ringcomm.torch._tensors import Operand, from_array, sync_device
from ringcomm.torch.compression import Compression, as_compression
from ringcomm.torch.horovod._basics import Average, ReduceOp, communicator_of, global_process_set
from ringcomm.torch.horovod._exchange_util import (
    check_tensor,
    check_tensors,
    describe_each,
    op_label,
    row_elems,
    total_nbytes,
)
from ringcomm.torch.horovod._negotiate import enqueue, execute
from ringcomm.torch.horovod._ops import Op, describe
from ringcomm.torch.horovod._reduce import scale_
from ringcomm.torch.horovod.functions import allgather
from ringcomm.torch.horovod.grouped_allgather import _gather_op

__all__ = [
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]


def _op_name(op: Any) -> str:
    """The op's ReduceOp name, or its repr when it is none (refused when the operation runs)."""
    try:
        return ReduceOp(Average if op is None else op).name
    except (ValueError, TypeError):
        return repr(op)


def _factor(value: Any) -> float | str:
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def _check_scatter(label: str, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    """Raise what the agreed arguments rule out (the same on every rank, since they agreed)."""
    op = meta["op"]
    if op not in ReduceOp.__members__:
        raise ValueError(f"{label}: unknown op {op}; expected hvd.Sum or hvd.Average")
    if op not in ("AVERAGE", "SUM"):
        raise HorovodInternalError(
            f"{label}: only hvd.Sum and hvd.Average are supported, got hvd.{op.title()}")
    for field in ("prescale", "postscale"):
        if isinstance(meta[field], str):
            raise TypeError(f"{label}: {field}_factor must be a number, got {meta[field]}")
    scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
    if scalars:
        where = "" if len(tensors) == 1 else f" (tensor {scalars[0]})"
        raise ValueError(f"{label}: scalar inputs are not supported{where}")


def _rows_for(rows: int, size: int, rank: int) -> int:
    """Horovod's share of ``rows`` for ``rank``: the first ``rows % size`` ranks get one more."""
    return rows // size + (rank < rows % size)


def _wire_op(op: str, floating: bool, post: float, size: int) -> tuple[str, float]:
    """The communicator's op, and the factor still to apply to its result (Horovod's rules:
    an integer average is the sum scaled by 1/size in float64, truncated)."""
    if op == "AVERAGE":
        return ("avg", 1.0) if floating and post == 1.0 else ("sum", post / size)
    return "sum", post


def _pack(tensors: list[torch.Tensor], size: int, quotas: list[int]) -> torch.Tensor:
    """Lay tensors of one dtype and device out as ``size`` equal chunks: chunk r holds rank r's
    rows of each tensor in turn, each padded with zeros to that tensor's largest share."""
    buf = torch.empty((size, sum(quotas)), dtype=tensors[0].dtype, device=tensors[0].device)
    start = 0
    for t, quota in zip(tensors, quotas, strict=True):
        base, extra = divmod(t.shape[0], size)
        width, flat = row_elems(t), t.detach().reshape(-1)
        narrow = base * width  # what each rank from ``extra`` on gets; the first ones one row more
        if extra:
            buf[:extra, start: start + quota] = flat[: extra * quota].reshape(extra, quota)
            buf[extra:, start + narrow: start + quota] = 0  # the padding: a row of zeros
        buf[extra:, start: start + narrow] = flat[extra * quota:].reshape(size - extra, narrow)
        start += quota
    return buf.reshape(-1)


def _scatter_group(comm: Communicator, tensors: list[torch.Tensor], wire_op: str,
                   pre: float) -> list[torch.Tensor]:
    """Reduce-scatter tensors of one dtype and device in one collective; this rank's rows."""
    size, rank = comm.size, comm.rank
    quotas = [_rows_for(t.shape[0], size, 0) * row_elems(t) for t in tensors]
    if len(tensors) == 1 and tensors[0].shape[0] % size == 0 and pre == 1.0:
        buf = tensors[0].detach().reshape(-1)  # rank r's rows already are the r-th chunk
    else:
        buf = scale_(_pack(tensors, size, quotas), pre)
    x = Operand(buf)
    mine = x.array.reshape(-1)
    if buf.numel():
        mine = comm.reduce_scatter(x.array, op=wire_op)
        sync_device(mine)
    outs, start = [], 0
    for t, quota in zip(tensors, quotas, strict=True):
        rows = _rows_for(t.shape[0], size, rank)
        # Sliced as arrays, so that each output is a tensor of its own, not a view.
        part = from_array(mine[start: start + rows * row_elems(t)].reshape(rows, *t.shape[1:]))
        outs.append(part.to(t.dtype) if x.widened else part)
        start += quota
    return outs


def _reduce_scatter(comm: Communicator, tensors: list[torch.Tensor],
                    meta: dict[str, Any]) -> list[torch.Tensor]:
    """This rank's rows of each reduced tensor: one collective per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    outs: list[torch.Tensor] = list(tensors)
    for (dtype, _), idx in groups.items():
        wire_op, after = _wire_op(meta["op"], dtype.is_floating_point, meta["postscale"],
                                  comm.size)
        try:
            parts = _scatter_group(comm, [tensors[i] for i in idx], wire_op, meta["prescale"])
        except (ValueError, TypeError) as err:
            raise collective_error(comm, err, "reduce_scatter", None) from err
        for i, part in zip(idx, parts, strict=True):
            outs[i] = scale_(part, after)
    return outs


def _scatter_op(tensors: list[torch.Tensor], name: str | None, op: Any, pre: Any, post: Any,
                process_set: Any, *, grouped: bool) -> Op:
    kind = "grouped_reducescatter" if grouped else "reducescatter"
    meta = describe_each(tensors, trailing=False) if grouped else describe(tensors[0])
    meta.update(op=_op_name(op), prescale=_factor(pre), postscale=_factor(post))
    label = op_label(kind, name)

    def run(comm: Communicator) -> Any:
        _check_scatter(label, meta, tensors)
        outs = _reduce_scatter(comm, tensors, meta)
        return outs if grouped else outs[0]
    return Op(kind, name, meta, run, nbytes=total_nbytes(tensors), process_set=process_set)


def _scaled_grads(grads: Sequence[torch.Tensor], op: Any, process_set: Any, pre: float,
                  post: float) -> list[torch.Tensor]:
    """Horovod's reducescatter gradient before its allgather: times the size for hvd.Sum,
    then times each scale factor."""
    size = communicator_of(process_set).size if _op_name(op) == "SUM" else 1
    out = list(grads)
    for factor in (size, pre, post):
        if factor != 1:
            out = [g * factor for g in out]
    return out


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any, process_set: Any,
                pre: float, post: float) -> torch.Tensor:
        ctx.args = (op, process_set, pre, post)
        return execute(_scatter_op([tensor], name, op, pre, post, process_set, grouped=False))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, pre, post = ctx.args
        scaled = _scaled_grads([grad], op, process_set, pre, post)[0]
        return allgather(scaled, process_set=process_set), None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, process_set: Any, pre: float, post: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, process_set, pre, post)
        return tuple(execute(_scatter_op(list(tensors), name, op, pre, post, process_set,
                                         grouped=True)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, pre, post = ctx.args
        scaled = _scaled_grads(grads, op, process_set, pre, post)
        return (None, None, None, None, None,
                *execute(_gather_op(scaled, None, process_set, offsets=False)))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over all ranks and scattering the result along dimension 0.

    Returns:
        A handle for :func:`~ringcomm.torch.horovod.functions.synchronize`, which returns this
        rank's rows of the result (see :func:`reducescatter`).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: an operation of the same name is still in flight.
    """
    tensors = [check_tensor(tensor)]
    return enqueue(_scatter_op(tensors, name, op, prescale_factor, postscale_factor,
                               process_set, grouped=False))


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: Any = Average,
                  process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's rows of the result.

    Dimension 0 is split as Horovod splits it: with ``rows`` rows over ``size`` ranks, rank r
    gets ``rows // size`` rows, plus one for the first ``rows % size`` ranks (zero rows when
    there are fewer rows than ranks), in rank order.

    Args:
        tensor: the tensor to reduce, of the same shape and dtype on every rank.
        name: the operation's name (operations are matched across ranks by name).
        compression: applied around the operation as Horovod does (``Compression.fp16``
            reduces in float16); ringcomm's ring compressors pass the tensor unchanged.
        op: hvd.Average (default) or hvd.Sum.
        process_set: the process set to run on (every rank by default).
        prescale_factor: multiply the input by this first (integers in float64, truncated).
        postscale_factor: multiply the result by this (Average divides by the size on top).

    Returns:
        A new tensor of the input's dtype and trailing shape. Its gradient is the allgather of
        the output gradients, times the size for hvd.Sum, times both scale factors.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``tensor`` is a scalar (on every rank).
        HorovodInternalError: shape, dtype, op or scale factors differ between ranks, or an op
            other than Sum and Average (on every rank).

    Example::

        shard = hvd.reducescatter(grad, op=hvd.Sum)   # this rank's rows of the summed grad
    """
    check_tensor(tensor)
    comp = as_compression(compression)
    compressed, ctx = comp.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return comp.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start reduce-scattering a list of tensors as one operation; ``synchronize`` returns the
    list of this rank's rows of each (see :func:`reducescatter`).

    Raises:
        TypeError: ``tensors`` is not a list of tensors.
    """
    return enqueue(_scatter_op(check_tensors(tensors), name, op, prescale_factor,
                               postscale_factor, process_set, grouped=True))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter each tensor of a list, as one operation; differentiable.

    The tensors are negotiated together and reduced in one collective per dtype; each result
    is as :func:`reducescatter`'s, and so is each gradient.

    Raises:
        TypeError: ``tensors`` is not a list of tensors.
        ValueError: a tensor is a scalar (on every rank).
        HorovodInternalError: the list, a shape, a dtype, the op or the scale factors differ
            between ranks (on every rank).

    Example::

        w_shard, b_shard = hvd.grouped_reducescatter([w.grad, b.grad], name="grads")
    """
    tensors = check_tensors(tensors)
    comp = as_compression(compression)
    packed = [comp.compress(t) for t in tensors]
    if not tensors:
        return execute(_scatter_op([], name, op, prescale_factor, postscale_factor,
                                   process_set, grouped=True))
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                       postscale_factor, *(c for c, _ in packed))
    return [comp.decompress(out, ctx) for out, (_, ctx) in zip(outs, packed, strict=True)]

