"""Horovod's reducescatter, alltoall and grouped allgather on torch tensors.

Each call is one named operation, negotiated like the collectives of
:mod:`ringcomm.torch.functions`; a grouped call is a single operation, so its tensors run
together or not at all. Results are new tensors; the inputs are left alone.

- ``reducescatter``: the sum (or average) over ranks of a tensor of one shape, split along
  dimension 0 as Horovod splits it: every rank gets ``rows // size`` rows and the first
  ``rows % size`` ranks one more. It runs as the communicator's reduce-scatter (one per dtype in
  a group), on a buffer where each rank's rows fill one equal chunk, padded where rows do not
  divide evenly.
- ``alltoall``: every rank sends ``splits[d]`` rows to rank ``d`` and receives, in rank order,
  what each rank sends it. The send counts of every rank are gathered first (the same step
  checks every rank's ``splits``), then the rows move in ``size - 1`` pairwise exchanges.
- ``grouped_allgather``: ``allgather`` of each tensor of a list, in one gather of bytes.

Errors are raised on every rank alike: fields that must be equal on every rank (dtype, shape,
op, scaling) fail with HorovodInternalError when they differ; an argument that every rank gives
alike and that cannot run raises when the operation runs (ValueError for a scalar input to
reducescatter or alltoall, HorovodInternalError for a scalar in grouped_allgather, as for
allgather, and for an op other than Sum or Average); bad ``splits`` on any rank raise ValueError
on every rank, naming the ranks.

Gradients follow Horovod: reducescatter's is the allgather of the output gradients, times the
size for hvd.Sum and times the scale factors; alltoall's is the alltoall of the output gradients
back along the received splits (rows that were not sent get zeros); grouped_allgather's is, per
tensor, this rank's rows of the average of the output gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ringcomm.comm.base import Communicator
from ringcomm.torch._basics import Average, ReduceOp, communicator_of, global_process_set
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import HorovodInternalError, collective_error
from ringcomm.torch._negotiate import enqueue, execute
from ringcomm.torch._ops import Op, describe
from ringcomm.torch._reduce import scale_
from ringcomm.torch._tensors import Operand, as_array, from_array, sync_device
from ringcomm.torch.compression import Compression, as_compression
from ringcomm.torch.functions import allgather, grouped_allreduce

__all__ = [
    "alltoall",
    "alltoall_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]


# ----------------------------------------------------------------------------- arguments
def _check_tensor(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _check_tensors(tensors: Any) -> list[torch.Tensor]:
    given = type(tensors).__name__
    if not isinstance(tensors, torch.Tensor):
        tensors = list(tensors)
        if all(isinstance(t, torch.Tensor) for t in tensors):
            return tensors
    raise TypeError(f"expected a list of torch.Tensor, got {given}")


def _describe_each(tensors: list[torch.Tensor], *, trailing: bool) -> dict[str, Any]:
    """The ``meta`` of a list: its length, and each tensor's fields named by position."""
    meta: dict[str, Any] = {"tensors": len(tensors),
                            "devices in the list": len({t.device for t in tensors})}
    for i, t in enumerate(tensors):
        fields = describe(t, trailing=trailing)
        if trailing:
            fields["dim"] = t.dim()
        meta.update({f"{field} of tensor {i}": value for field, value in fields.items()})
    return meta


def _label(kind: str, name: str | None) -> str:
    return kind if name is None else f"{kind} {name!r}"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _row_elems(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    if t.numel() == 0:  # empty tensors may have strides a dtype view refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _allgather_ints(comm: Communicator, values: list[int], device: torch.device) -> np.ndarray:
    """Every rank's ``values`` (as many on every rank) as a (size, len(values)) int64 array."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    try:
        everyone = comm.allgather(as_array(mine))
    except (ValueError, TypeError) as err:
        raise collective_error(comm, err, "allgather", None) from err
    sync_device(everyone)
    return from_array(everyone).cpu().numpy().reshape(comm.size, len(values))


# ----------------------------------------------------------------------------- reducescatter
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
        width, flat = _row_elems(t), t.detach().reshape(-1)
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
    quotas = [_rows_for(t.shape[0], size, 0) * _row_elems(t) for t in tensors]
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
        part = from_array(mine[start: start + rows * _row_elems(t)].reshape(rows, *t.shape[1:]))
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
    meta = _describe_each(tensors, trailing=False) if grouped else describe(tensors[0])
    meta.update(op=_op_name(op), prescale=_factor(pre), postscale=_factor(post))
    label = _label(kind, name)

    def run(comm: Communicator) -> Any:
        _check_scatter(label, meta, tensors)
        outs = _reduce_scatter(comm, tensors, meta)
        return outs if grouped else outs[0]
    return Op(kind, name, meta, run, nbytes=_nbytes(tensors), process_set=process_set)


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
        A handle for :func:`~ringcomm.torch.functions.synchronize`, which returns this rank's
        rows of the result (see :func:`reducescatter`).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: an operation of the same name is still in flight.
    """
    tensors = [_check_tensor(tensor)]
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
    _check_tensor(tensor)
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
    return enqueue(_scatter_op(_check_tensors(tensors), name, op, prescale_factor,
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
    tensors = _check_tensors(tensors)
    comp = as_compression(compression)
    packed = [comp.compress(t) for t in tensors]
    if not tensors:
        return execute(_scatter_op([], name, op, prescale_factor, postscale_factor,
                                   process_set, grouped=True))
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                       postscale_factor, *(c for c, _ in packed))
    return [comp.decompress(out, ctx) for out, (_, ctx) in zip(outs, packed, strict=True)]


# ----------------------------------------------------------------------------- alltoall
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
    """Move rows: ``sends[s, d]`` rows from rank s to rank d, in ``size - 1`` pairwise steps
    (rank + k and rank - k at step k), received in rank order."""
    size, rank = comm.size, comm.rank
    width = _row_elems(tensor) * tensor.element_size()
    sent = np.concatenate([[0], np.cumsum(sends[rank])]) * width
    got = np.concatenate([[0], np.cumsum(sends[:, rank])]) * width
    out = torch.empty((int(sends[:, rank].sum()), *tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    src, dst = as_array(_byte_view(tensor)), as_array(_byte_view(out))
    dst[got[rank]: got[rank + 1]] = src[sent[rank]: sent[rank + 1]]
    for k in range(1, size):
        to, frm = (rank + k) % size, (rank - k) % size
        comm.sendrecv(src[sent[to]: sent[to + 1]], to, dst[got[frm]: got[frm + 1]], frm)
    sync_device(dst)
    return out


def _alltoall_op(tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Op:
    _check_tensor(tensor)
    counts, problem, detail = _read_splits(splits)
    given = isinstance(splits, torch.Tensor) and not problem
    recv_dtype = splits.dtype if given else torch.int32
    recv_device = splits.device if given else torch.device("cpu")
    meta = describe(tensor, trailing=True)
    meta["dim"] = tensor.dim()
    label = _label("alltoall", name)

    def run(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        if tensor.dim() == 0:
            raise ValueError(f"{label}: needs a tensor with at least one dimension, got a "
                             "scalar")
        row = _split_row(comm.size, tensor.shape[0], counts, problem, detail)
        table = _allgather_ints(comm, row, tensor.device)
        _raise_bad_splits(label, table)
        sends = table[:, 3:]
        received = torch.tensor(sends[:, comm.rank].tolist(), dtype=recv_dtype,
                                device=recv_device)
        return _exchange(comm, tensor, sends), received
    return Op("alltoall", name, meta, run, nbytes=_nbytes([tensor]), process_set=process_set)


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
    _check_tensor(tensor)
    return _Alltoall.apply(tensor, splits, name, process_set)


# ----------------------------------------------------------------------- grouped allgather
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
    rows = _allgather_ints(comm, [t.shape[0] for t in tensors], tensors[0].device)
    widths = np.array([_row_elems(t) * t.element_size() for t in tensors], dtype=np.int64)
    nbytes = rows * widths  # [s, i]: bytes of tensor i from rank s
    mine = torch.cat([_byte_view(t) for t in tensors])
    try:
        everyone = comm.allgatherv(as_array(mine))
    except (ValueError, TypeError) as err:
        raise collective_error(comm, err, "allgatherv", None) from err
    sync_device(everyone)
    starts = np.concatenate([[0], np.cumsum(nbytes.reshape(-1))])  # rank-major, as gathered
    outs = []
    for i, t in enumerate(tensors):
        out = torch.empty((int(rows[:, i].sum()), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dst, at = as_array(_byte_view(out)), 0
        for s in range(size):
            n, start = nbytes[s, i], starts[s * k + i]
            dst[at: at + n] = everyone[start: start + n]
            at += n
        sync_device(dst)
        outs.append(out)
    return outs, [int(rows[: comm.rank, i].sum()) for i in range(k)]


def _gather_op(tensors: list[torch.Tensor], name: str | None, process_set: Any, *,
               offsets: bool) -> Op:
    meta = _describe_each(tensors, trailing=True)
    label = _label("grouped_allgather", name)

    def run(comm: Communicator) -> Any:
        _check_gather(label, tensors)
        outs, firsts = _gather_all(comm, tensors)
        return (outs, firsts) if offsets else outs
    return Op("grouped_allgather", name, meta, run, nbytes=_nbytes(tensors),
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
    return enqueue(_gather_op(_check_tensors(tensors), name, process_set, offsets=False))


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
    tensors = _check_tensors(tensors)
    if not tensors:
        return execute(_gather_op([], name, process_set, offsets=False))
    return list(_GroupedAllgather.apply(name, process_set, *tensors))
