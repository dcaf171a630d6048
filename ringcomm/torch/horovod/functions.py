"""Horovod's collectives on torch tensors: allreduce, allgather, broadcast, barrier, join.

Every call becomes a named operation that ranks match by name (see
ringcomm.torch.horovod._negotiate): named operations may be submitted in any order on different
ranks and from several threads. Asynchronous calls return a handle for :func:`poll` and
:func:`synchronize`. The out-of-place forms are differentiable and their gradients are
Horovod's: the gradient of an allreduce is the allreduce (same op) of the output gradients,
allgather's hands each rank the average of the output gradients over its own rows, and
broadcast's hands the average to the root and zeros to every other rank.

Why one module past 400 lines: this is Horovod's collective surface (``hvd.allreduce`` and its
async, in-place and grouped forms, allgather, broadcast, barrier, join), kept together as
Horovod keeps it in ``mpi_ops``; each function is a thin operation handed to the coordinator
(:mod:`ringcomm.torch.horovod._negotiate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from ringcomm.core.log import get_logger
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import collective_error
from ringcomm.torch._tensors import Operand
from ringcomm.torch.compression import Compression, RingCompressor, as_compression
from ringcomm.torch.horovod._basics import (
    Average,
    ReduceOp,
    Sum,
    communicator_of,
    global_process_set,
    root_in_set,
)
from ringcomm.torch.horovod._negotiate import enqueue, execute, reduce_fused
from ringcomm.torch.horovod._ops import (
    JOINED_RUNS,
    Op,
    ReduceSpec,
    describe,
    ring_spec,
)
from ringcomm.torch.horovod._reduce import parse_op
from ringcomm.torch.horovod._runs import joined_reduce

__all__ = [
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "join",
    "poll",
    "sparse_allreduce_async",
    "synchronize",
]

_LOG = get_logger("torch.horovod")
_WARNED: list[Any] = []  # compressors whose unnamed calls were said to keep no error feedback


# ----------------------------------------------------------------------------- the operations
def _output_like(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor for the result of a collective of ``tensor``; ``tensor``
    itself where it is not strided (sparse): its operation is refused on every rank and
    writes nothing (``describe``)."""
    if tensor.layout != torch.strided:
        return tensor
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _reduce_op(tensor: torch.Tensor, out: torch.Tensor | None, name: str | None, op: ReduceOp,
               pre: float, post: float, ring: Any, process_set: Any,
               feedback: bool = False) -> Op:
    meta = describe(tensor)
    meta.update(op=op.name, prescale=float(pre), postscale=float(post),
                compression=None if ring is None else type(ring).__name__)
    dst = _output_like(tensor) if out is None else out
    spec = ReduceSpec(tensor, dst, op, pre, post, ring,
                      f"allreduce.{name}" if feedback and ring is not None and name else None)
    if ring is not None:
        # What a rank that has joined runs for it: a compressor keeping no state rebuilt from
        # the meta; one that keeps state, the one this name ran with (JOINED_RUNS).
        meta.update(ring=ring_spec(ring), feedback=spec.feedback_name)
        if meta["ring"] is None and name is not None:
            meta["owner"] = "allreduce"
            JOINED_RUNS["allreduce", name] = functools.partial(joined_reduce, ring,
                                                               spec.feedback_name)
    return Op("allreduce", name, meta, reduce=spec,
              nbytes=tensor.numel() * tensor.element_size(), process_set=process_set)


def _checked(op: Any, average: bool | None, pre: Any, post: Any) -> ReduceOp:
    """The ReduceOp of Horovod's ``op``/``average``, with the scales checked.

    Raises:
        ValueError, TypeError: an unknown op, both ``op`` and ``average``, or a scale that is
            no number.
    """
    rop = parse_op(op, average)
    float(pre), float(post)
    return rop


def _refused(tensor: torch.Tensor, name: str | None, process_set: Any,
             err: Exception) -> Op:
    """An allreduce whose arguments this rank refused (``err``), negotiated as any other so
    that it fails on every rank (``HorovodArgumentError``, a ValueError) and runs nowhere:
    raised here alone, it left the other ranks' operation pending, to pair with this rank's
    next one of the same name (an unnamed one's included), every result one step off."""
    return _carrying(err, _reduce_op(tensor, None, name, ReduceOp.SUM, 1.0, 1.0, None,
                                     process_set))


def _carrying(err: Exception, op: Op) -> Op:
    """``op`` with ``err`` in its request: the negotiation fails it on every rank."""
    op.meta["error"] = f"{type(err).__name__}: {err}"
    return op


def _gather_op(tensor: torch.Tensor, name: str | None, process_set: Any) -> Op:
    meta = describe(tensor, trailing=True)
    meta["dim"] = tensor.dim()
    return Op("allgather", name, meta, _gather_run(tensor),
              nbytes=tensor.numel() * tensor.element_size(), process_set=process_set)


def _gather_run(tensor: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """The data step of an allgather of ``tensor``."""
    def run(comm: Any) -> torch.Tensor:
        x = Operand(tensor)
        # A 0-d tensor goes as it is, so that the communicator refuses it on every rank.
        array = x.array.reshape(()) if tensor.dim() == 0 else x.array
        try:
            gathered = comm.allgatherv(array)
        except (ValueError, TypeError) as err:
            raise collective_error(comm, err, "allgatherv", tensor) from err
        return x.result(gathered)
    return run


def _broadcast_op(tensor: torch.Tensor, out: torch.Tensor | None, root: int, name: str | None,
                  process_set: Any) -> Op:
    meta = describe(tensor)
    meta["root"] = root
    local_root = root_in_set(process_set, root) if 0 <= root else root

    def run(comm: Any) -> torch.Tensor:
        dst = tensor if out is None else out
        if dst is not tensor:
            with torch.no_grad():
                dst.copy_(tensor)
        x = Operand(dst)
        try:
            comm.broadcast(x.array, local_root)
        except (ValueError, TypeError) as err:
            raise collective_error(comm, err, "broadcast", tensor) from err
        x.write_back()
        return dst
    return Op("broadcast", name, meta, run, nbytes=tensor.numel() * tensor.element_size(),
              process_set=process_set)


def _ring(compression: Any) -> Any:
    return compression.ring if isinstance(compression, RingCompressor) else None


# ----------------------------------------------------------------------------- handles
def poll(handle: Handle) -> bool:
    """Return whether an asynchronous operation has finished (``synchronize`` won't block)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its output tensor.

    Raises:
        HorovodInternalError: the operation failed (on every rank).
    """
    return handle.wait()


# ----------------------------------------------------------------------------- allreduce
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start averaging (or summing, ...) ``tensor`` over all ranks; the input is not modified.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank).
        average: deprecated; use ``op``.
        name: the operation's name: operations are matched across ranks by name, so ranks
            may submit named operations in different orders. Unnamed ones are matched in
            submission order (per thread).
        op: hvd.Average (default), hvd.Sum, hvd.Min, hvd.Max or hvd.Product.
        prescale_factor: multiply the input by this before reducing.
        postscale_factor: multiply the result by this (Average divides by size on top).
        process_set: the process set to run on (every rank by default).

    Returns:
        A handle for :func:`poll` and :func:`synchronize`.

    Raises:
        ValueError: both ``op`` and ``average``, an unknown op, or an operation of the same
            name still in flight.
        TypeError: ``tensor`` is not a tensor.
        NotImplementedError: hvd.Adasum, or a process set other than the global one.

    Example::

        h = hvd.allreduce_async(t, name="loss")
        ...
        avg = hvd.synchronize(h)
    """
    try:
        rop = _checked(op, average, prescale_factor, postscale_factor)
    except (ValueError, TypeError) as err:
        return enqueue(_refused(tensor, name, process_set, err))
    return enqueue(_reduce_op(tensor, None, name, rop, prescale_factor, postscale_factor, None,
                              process_set))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """Start an in-place allreduce of ``tensor`` (see :func:`allreduce_async`)."""
    try:
        rop = _checked(op, average, prescale_factor, postscale_factor)
    except (ValueError, TypeError) as err:
        return enqueue(_refused(tensor, name, process_set, err))
    return enqueue(_reduce_op(tensor, tensor, name, rop, prescale_factor, postscale_factor,
                              None, process_set))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Average (or sum, ...) ``tensor`` over all ranks in place and return it.

    Example::

        hvd.allreduce_(metric, op=hvd.Sum)
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, ring: Any, process_set: Any, feedback: bool) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return execute(_reduce_op(tensor, None, name, op, pre, post, ring, process_set,
                                  feedback))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set = ctx.args
        out = allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post,
                        process_set=process_set)
        return out, None, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return the average (or sum, ...) of ``tensor`` over all ranks; differentiable.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank); not modified.
        average: deprecated; use ``op``.
        name: the operation's name (see :func:`allreduce_async`).
        compression: ``hvd.Compression.<name>``, a ringcomm compressor, or a Horovod-style
            compressor; applies to floating tensors reduced with Average or Sum.
        op: hvd.Average (default), hvd.Sum, hvd.Min, hvd.Max or hvd.Product.
        prescale_factor: multiply the input by this before reducing (integers: in float64,
            truncated; float16: in float32).
        postscale_factor: multiply the result by this, with the same rules.
        process_set: the process set to run on (every rank by default).

    Returns:
        A new tensor; its gradient is the allreduce (same op) of the output's gradient.

    Raises:
        HorovodInternalError: shape or dtype differ between ranks (on every rank).
        TypeError: ``tensor`` is not a tensor.

    Example::

        import ringcomm.torch as hvd
        hvd.init()
        mean_loss = hvd.allreduce(loss.detach(), name="loss")
    """
    _check_tensor(tensor)
    try:
        rop = _checked(op, average, prescale_factor, postscale_factor)
    except (ValueError, TypeError) as err:
        execute(_refused(tensor, name, process_set, err))  # raises, on every rank
        raise AssertionError("an operation with refused arguments ran") from err
    comp = as_compression(compression)
    if isinstance(comp, RingCompressor) or comp is Compression.none:
        feedback = isinstance(comp, RingCompressor) and comp.error_feedback
        if feedback and name is None:
            _unnamed_feedback(_ring(comp))
        return _Allreduce.apply(tensor, name, rop, prescale_factor, postscale_factor,
                                _ring(comp), process_set, feedback)
    compressed, ctx = comp.compress(tensor)
    out = _Allreduce.apply(compressed, name, rop, prescale_factor, postscale_factor, None,
                           process_set, False)
    return comp.decompress(out, ctx)


def _unnamed_feedback(ring: Any) -> None:
    """Say once per compressor that an unnamed call keeps no error feedback."""
    if ring not in _WARNED:
        _WARNED.append(ring)
        _LOG.warning("hvd.allreduce with compression=%r and no name keeps no error feedback: "
                     "what compression does not send is lost; give the call a name (the same "
                     "at every step) to keep it", ring)


def _check_tensor(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")


# ----------------------------------------------------------------------- grouped allreduce
def _check_tensors(tensors: Any) -> None:
    if isinstance(tensors, torch.Tensor) or not all(
            isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"expected a list of torch.Tensor, got {type(tensors).__name__}")


def _grouped_op(tensors: Sequence[torch.Tensor], in_place: bool, name: str | None,
                op: ReduceOp, pre: float, post: float, process_set: Any) -> Op:
    _check_tensors(tensors)
    ops = [_reduce_op(t, t if in_place else None, None, op, pre, post, None, process_set)
           for t in tensors]
    specs = cast("list[ReduceSpec]", [o.reduce for o in ops])  # _reduce_op's always has one
    meta = {"tensors": tuple((str(t.dtype), t.device.type, tuple(t.shape)) for t in tensors),
            "op": op.name, "prescale": float(pre), "postscale": float(post)}
    refused = [o.meta["error"] for o in ops if "error" in o.meta]  # a sparse tensor's
    if refused:
        meta["error"] = refused[0]
    return Op("grouped_allreduce", name, meta, lambda comm: reduce_fused(comm, specs),
              nbytes=sum(t.numel() * t.element_size() for t in tensors),
              process_set=process_set)


def _refused_group(tensors: Sequence[torch.Tensor], name: str | None, process_set: Any,
                   err: Exception) -> Op:
    """A grouped allreduce whose arguments this rank refused (see :func:`_refused`)."""
    return _carrying(err, _grouped_op(tensors, False, name, ReduceOp.SUM, 1.0, 1.0,
                                      process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> Handle:
    """Start allreducing a list of tensors as one operation (negotiated and fused together);
    ``synchronize`` returns the list of results."""
    try:
        rop = _checked(op, average, prescale_factor, postscale_factor)
    except (ValueError, TypeError) as err:
        return enqueue(_refused_group(tensors, name, process_set, err))
    return enqueue(_grouped_op(tensors, False, name, rop, prescale_factor, postscale_factor,
                               process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """Start allreducing a list of tensors in place, as one operation."""
    try:
        rop = _checked(op, average, prescale_factor, postscale_factor)
    except (ValueError, TypeError) as err:
        return enqueue(_refused_group(tensors, name, process_set, err))
    return enqueue(_grouped_op(tensors, True, name, rop, prescale_factor, postscale_factor,
                               process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors in place, as one operation; return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, process_set)
        return tuple(execute(_grouped_op(tensors, False, name, op, pre, post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set = ctx.args
        out = grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post,
                                process_set=process_set)
        return (None, None, None, None, None, *out)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Return the allreduce of each tensor of a list, as one operation; differentiable.

    The tensors are negotiated together and reduced in one fused buffer per dtype.
    Compression other than none applies tensor by tensor (see :func:`allreduce`).

    Example::

        means = hvd.grouped_allreduce([loss, accuracy], name="metrics")
    """
    comp = as_compression(compression)
    if comp is not Compression.none:  # each allreduce negotiates a refused argument itself
        return [allreduce(t, average, None if name is None else f"{name}.{i}", comp, op,
                          prescale_factor, postscale_factor, process_set)
                for i, t in enumerate(tensors)]
    _check_tensors(tensors)
    try:
        rop = _checked(op, average, prescale_factor, postscale_factor)
    except (ValueError, TypeError) as err:
        execute(_refused_group(tensors, name, process_set, err))  # raises, on every rank
        raise AssertionError("an operation with refused arguments ran") from err
    return list(_GroupedAllreduce.apply(name, rop, prescale_factor, postscale_factor,
                                        process_set, *tensors))


# ----------------------------------------------------------------------------- allgather
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start concatenating ``tensor`` from every rank along dimension 0 (sizes may differ)."""
    return enqueue(_gather_op(tensor, name, process_set))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: Any) -> torch.Tensor:
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return execute(_gather_op(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        dims = execute(_gather_op(torch.tensor([ctx.dim], dtype=torch.int64), None,
                                  ctx.process_set))
        offset = int(dims[: communicator_of(ctx.process_set).rank].sum())
        return reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dimension 0, in rank order; differentiable.

    The first dimension may differ between ranks; the others, and the dtype, may not.

    Returns:
        A new tensor; its gradient hands each rank the average of the output gradients over
        the rows it contributed (Horovod's rule).

    Raises:
        HorovodInternalError: trailing shape or dtype differ between ranks (on every rank).

    Example::

        preds = hvd.allgather(local_preds)       # every rank's rows, rank 0's first
    """
    _check_tensor(tensor)
    return _Allgather.apply(tensor, name, process_set)


# ----------------------------------------------------------------------------- broadcast
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start broadcasting root's ``tensor`` into a new tensor on every rank."""
    _check_tensor(tensor)
    out = _output_like(tensor)
    return enqueue(_broadcast_op(tensor, out, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start overwriting ``tensor`` with root's, in place."""
    return enqueue(_broadcast_op(tensor, None, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place; return it.

    Example::

        hvd.broadcast_(model.weight.data, root_rank=0)
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None,
                process_set: Any) -> torch.Tensor:
        ctx.root, ctx.process_set = root, process_set
        out = _output_like(tensor)
        return execute(_broadcast_op(tensor, out, root, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if communicator_of(ctx.process_set).rank != root_in_set(ctx.process_set, ctx.root):
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every rank (the input is not modified); differentiable.

    Returns:
        A new tensor; its gradient reaches the root only (the average of the output
        gradients), zeros elsewhere.

    Raises:
        HorovodInternalError: shape, dtype or root differ between ranks (on every rank).
        TypeError: ``tensor`` is not a tensor.

    Example::

        w0 = hvd.broadcast(w, root_rank=0)
    """
    _check_tensor(tensor)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ------------------------------------------------------------------- sparse allreduce
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                           process_set: Any = global_process_set) -> Any:
    """Start reducing a sparse COO tensor: every rank's indices and values, gathered.

    The result is a sparse tensor holding every rank's entries (duplicates not summed until
    it is coalesced), values divided by the size for Average: its dense form is the
    allreduce of the dense tensors.

    Returns:
        A callable: calling it waits and returns the sparse result (Horovod's handle).

    Example::

        handle = hvd.sparse_allreduce_async(emb.weight.grad, name="emb", op=hvd.Average)
        grad = handle()
    """
    if not (isinstance(tensor, torch.Tensor) and tensor.is_sparse):
        raise TypeError(f"expected a sparse COO tensor, got {type(tensor).__name__}"
                        + (f" with layout {tensor.layout}" if isinstance(tensor, torch.Tensor)
                           else ""))
    try:
        rop = parse_op(op, None)
        if rop not in (Average, Sum):
            raise ValueError(f"sparse allreduce supports hvd.Average and hvd.Sum, got "
                             f"{rop.name}")
    except ValueError as err:  # failed on every rank, as an allreduce's refused op is
        refused = enqueue(_carrying(err, Op("sparse_allreduce", name, {}, lambda comm: None,
                                            nbytes=0, process_set=process_set)))
        return lambda: synchronize(refused)
    t = tensor
    indices = t._indices().transpose(0, 1).contiguous()
    values = t._values().contiguous()
    meta = {"dtype": str(t.dtype), "size": tuple(t.shape), "sparse dims": t.sparse_dim(),
            "op": rop.name}

    def run(comm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _gather_run(indices)(comm), _gather_run(values)(comm)

    handle = enqueue(Op("sparse_allreduce", name, meta, run,
                        nbytes=indices.numel() * 8 + values.numel() * values.element_size(),
                        process_set=process_set))

    def result() -> torch.Tensor:
        all_indices, all_values = synchronize(handle)
        if rop is Average:
            all_values = all_values / communicator_of(process_set).size
        # Every rank's indices came from a valid tensor of this (agreed) shape.
        return torch.sparse_coo_tensor(all_indices.transpose(0, 1), all_values, t.shape,
                                       check_invariants=False)
    return result


# ----------------------------------------------------------------------- barrier and join
def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank has reached the barrier.

    Operations submitted before it on this rank are not waited for (synchronize them).
    """
    execute(Op("barrier", None, {}, lambda comm: comm.barrier(), process_set=process_set))


def join(device: int = -1, process_set: Any = global_process_set) -> int:
    """Wait until every rank has called join; meanwhile take part in others' allreduces.

    For uneven inputs: a rank that runs out of data calls ``join()``; until every rank has,
    the allreduces the others submit run with zeros from the joined ranks (Average still
    divides by the whole job's size). Other collectives submitted while a rank has joined
    fail on the ranks that submitted them.

    Args:
        device: accepted for compatibility (Horovod's GPU for the zeros); unused.
        process_set: the process set to run on (every rank by default).

    Returns:
        The rank that joined last (the same on every rank).

    Example::

        for batch in my_shard:            # shards of different lengths
            ...
            opt.step()
        last = hvd.join()
    """
    return int(execute(Op("join", None, {}, process_set=process_set)))
