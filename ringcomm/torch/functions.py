"""Horovod's collectives on torch tensors: allreduce, allgather, broadcast; sync and async.

Asynchronous calls return a handle for :func:`poll` and :func:`synchronize`; they run in
submission order on one background thread, so every rank must submit the same operations in
the same order (Horovod matches them by name instead; name them anyway, for the error
messages). The out-of-place forms are differentiable and their gradients are Horovod's: the
gradient of an allreduce is the allreduce (same op) of the output gradients, allgather's hands
each rank the average of the output gradients over its own rows, and broadcast's hands the
average to the root and zeros to every other rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringcomm.torch._basics import (
    Average,
    ReduceOp,
    check_process_set,
    context,
    global_process_set,
    rank,
)
from ringcomm.torch._engine import Handle
from ringcomm.torch._errors import collective_error
from ringcomm.torch._reduce import allreduce_tensor, parse_op
from ringcomm.torch._tensors import Operand
from ringcomm.torch.compression import Compression, RingCompressor, as_compression

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
    "poll",
    "synchronize",
]


# ----------------------------------------------------------------------------- the operations
def _reduce_task(tensor: torch.Tensor, out: torch.Tensor | None, op: ReduceOp, pre: float,
                 post: float, ring: Any) -> Any:
    comm, _ = context()
    dst = torch.empty_like(tensor, memory_format=torch.contiguous_format) if out is None else out
    return lambda: allreduce_tensor(comm, tensor, dst, op=op, prescale=pre, postscale=post,
                                    compression=ring)


def _gather_task(tensor: torch.Tensor) -> Any:
    comm, _ = context()

    def run() -> torch.Tensor:
        x = Operand(tensor)
        # A 0-d tensor goes as it is, so that the communicator refuses it on every rank.
        array = x.array.reshape(()) if tensor.dim() == 0 else x.array
        try:
            gathered = comm.allgatherv(array)
        except (ValueError, TypeError) as err:
            raise collective_error(comm, err, "allgatherv", tensor) from err
        return x.result(gathered)
    return run


def _broadcast_task(tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> Any:
    comm, _ = context()

    def run() -> torch.Tensor:
        dst = tensor if out is None else out
        if dst is not tensor:
            with torch.no_grad():
                dst.copy_(tensor)
        x = Operand(dst)
        try:
            comm.broadcast(x.array, root)
        except (ValueError, TypeError) as err:
            raise collective_error(comm, err, "broadcast", tensor) from err
        x.write_back()
        return dst
    return run


def _submit(task: Any) -> Handle:
    return context()[1].submit(task)


def _run(task: Any) -> Any:
    return context()[1].run(task)


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
        name: a name for the operation (Horovod's key; used in messages here).
        op: hvd.Average (default), hvd.Sum, hvd.Min, hvd.Max or hvd.Product.
        prescale_factor: multiply the input by this before reducing.
        postscale_factor: multiply the result by this (Average divides by size on top).
        process_set: the global process set only.

    Returns:
        A handle for :func:`poll` and :func:`synchronize`.

    Raises:
        ValueError: both ``op`` and ``average``, or an unknown op.
        NotImplementedError: hvd.Adasum, or a process set other than the global one.

    Example::

        h = hvd.allreduce_async(t, name="loss")
        ...
        avg = hvd.synchronize(h)
    """
    rop = parse_op(op, average)
    check_process_set(process_set)
    return _submit(_reduce_task(tensor, None, rop, prescale_factor, postscale_factor, None))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """Start an in-place allreduce of ``tensor`` (see :func:`allreduce_async`)."""
    rop = parse_op(op, average)
    check_process_set(process_set)
    return _submit(_reduce_task(tensor, tensor, rop, prescale_factor, postscale_factor, None))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Average (or sum, ...) ``tensor`` over all ranks in place and return it.

    Example::

        hvd.allreduce_(metric, op=hvd.Sum)
    """
    rop = parse_op(op, average)
    check_process_set(process_set)
    return _run(_reduce_task(tensor, tensor, rop, prescale_factor, postscale_factor, None))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Any, op: ReduceOp, pre: float,
                post: float, ring: Any) -> torch.Tensor:
        ctx.args = (average, op, pre, post)
        return _run(_reduce_task(tensor, None, op, pre, post, ring))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _, op, pre, post = ctx.args
        out = allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post)
        return out, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return the average (or sum, ...) of ``tensor`` over all ranks; differentiable.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank); not modified.
        average: deprecated; use ``op``.
        name: a name for the operation.
        compression: ``hvd.Compression.<name>``, a ringcomm compressor, or a Horovod-style
            compressor; applies to floating tensors reduced with Average or Sum.
        op: hvd.Average (default), hvd.Sum, hvd.Min, hvd.Max or hvd.Product.
        prescale_factor: multiply the input by this before reducing (integers: in float64,
            truncated; float16: in float32).
        postscale_factor: multiply the result by this, with the same rules.
        process_set: the global process set only.

    Returns:
        A new tensor; its gradient is the allreduce (same op) of the output's gradient.

    Raises:
        HorovodInternalError: shape or dtype differ between ranks (on every rank).

    Example::

        import ringcomm.torch as hvd
        hvd.init()
        mean_loss = hvd.allreduce(loss.detach(), name="loss")
    """
    rop = parse_op(op, average)
    check_process_set(process_set)
    comp = as_compression(compression)
    if isinstance(comp, RingCompressor) or comp is Compression.none:
        return _Allreduce.apply(tensor, average, rop, prescale_factor, postscale_factor,
                                _ring(comp))
    compressed, ctx = comp.compress(tensor)
    out = _Allreduce.apply(compressed, average, rop, prescale_factor, postscale_factor, None)
    return comp.decompress(out, ctx)


# ----------------------------------------------------------------------- grouped allreduce
def _grouped_task(tensors: Sequence[torch.Tensor], in_place: bool, op: ReduceOp, pre: float,
                  post: float) -> Any:
    tasks = [_reduce_task(t, t if in_place else None, op, pre, post, None) for t in tensors]
    return lambda: [task() for task in tasks]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> Handle:
    """Start allreduces of a list of tensors; ``synchronize`` returns the list of results."""
    rop = parse_op(op, average)
    check_process_set(process_set)
    return _submit(_grouped_task(tensors, False, rop, prescale_factor, postscale_factor))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """Start in-place allreduces of a list of tensors."""
    rop = parse_op(op, average)
    check_process_set(process_set)
    return _submit(_grouped_task(tensors, True, rop, prescale_factor, postscale_factor))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors in place; return them."""
    rop = parse_op(op, average)
    check_process_set(process_set)
    return _run(_grouped_task(tensors, True, rop, prescale_factor, postscale_factor))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Return the allreduce of each tensor of a list (see :func:`allreduce`); differentiable."""
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor,
                      process_set) for t in tensors]


# ----------------------------------------------------------------------------- allgather
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start concatenating ``tensor`` from every rank along dimension 0 (sizes may differ)."""
    check_process_set(process_set)
    return _submit(_gather_task(tensor))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        return _run(_gather_task(tensor))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=Average)
        dims = _run(_gather_task(torch.tensor([ctx.dim], dtype=torch.int64)))
        offset = int(dims[: rank()].sum())
        return (reduced.narrow(0, offset, ctx.dim),)


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
    check_process_set(process_set)
    return _Allgather.apply(tensor)


# ----------------------------------------------------------------------------- broadcast
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start broadcasting root's ``tensor`` into a new tensor on every rank."""
    check_process_set(process_set)
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit(_broadcast_task(tensor, out, root_rank))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start overwriting ``tensor`` with root's, in place."""
    check_process_set(process_set)
    return _submit(_broadcast_task(tensor, None, root_rank))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place; return it.

    Example::

        hvd.broadcast_(model.weight.data, root_rank=0)
    """
    check_process_set(process_set)
    return _run(_broadcast_task(tensor, None, root_rank))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int) -> torch.Tensor:
        ctx.root = root
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return _run(_broadcast_task(tensor, out, root))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=Average)
        if rank() != ctx.root:
            reduced = torch.zeros_like(reduced)
        return reduced, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every rank (the input is not modified); differentiable.

    Returns:
        A new tensor; its gradient reaches the root only (the average of the output
        gradients), zeros elsewhere.

    Raises:
        HorovodInternalError: shape, dtype or root differ between ranks (on every rank).

    Example::

        w0 = hvd.broadcast(w, root_rank=0)
    """
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank)


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank has reached the barrier (after its queued operations)."""
    check_process_set(process_set)
    comm, engine = context()
    engine.run(comm.barrier)
