"""Allreduce of a tensor with Horovod's semantics: ops, pre/postscaling, integer averages.

Horovod averages by summing and then scaling by postscale_factor / size, and it scales in
float64 for integer tensors (truncating toward zero) and in float32 for float16 tensors. The
same rules are kept here, so that scripts relying on them get the same numbers; floating
averages without extra scaling use the communicator's own "avg" (one division by the rank
count, by the owner of each chunk), which compressed allreduces need.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.comm.base import Communicator
from ringcomm.torch._errors import collective_error
from ringcomm.torch._residuals import keep_write_back_rounding
from ringcomm.torch._tensors import Operand, host_view
from ringcomm.torch.horovod._basics import ReduceOp
from ringcomm.torch.horovod.unsupported import refusal

__all__ = ["allreduce_tensor", "feedback_of", "parse_op", "scale_"]

# The residuals of named compressed allreduces (hvd.allreduce with hvd.Compression.int8, topk,
# powersgd), one ErrorFeedback per communicator (a process set's), gone with it.
_FEEDBACK: weakref.WeakKeyDictionary[Communicator, ErrorFeedback] = weakref.WeakKeyDictionary()


def feedback_of(comm: Communicator) -> ErrorFeedback:
    """The error feedback of the named compressed allreduces run on ``comm``."""
    feedback = _FEEDBACK.get(comm)
    if feedback is None:
        feedback = _FEEDBACK[comm] = ErrorFeedback()
    return feedback

_RING_OPS = {ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
             ReduceOp.PRODUCT: "prod"}


def parse_op(op: Any, average: bool | None) -> ReduceOp:
    """Resolve Horovod's ``op``/``average`` pair (``average`` is deprecated) to a ReduceOp.

    Raises:
        ValueError: both given, or an unknown op.
        NotImplementedError: ``op=Adasum``.
    """
    if type(op) is ReduceOp and average is None and op is not ReduceOp.ADASUM:
        return op  # the common call (hvd.Sum, ...): spares the enum lookup below
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed "
                          "in a future version", DeprecationWarning, stacklevel=3)
        op = ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    try:
        op = ReduceOp(op)
    except ValueError:
        names = ", ".join(f"hvd.{o.name.title()}" for o in ReduceOp if o is not ReduceOp.ADASUM)
        raise ValueError(f"unknown op {op!r}; expected one of {names}") from None
    if op is ReduceOp.ADASUM:
        raise refusal(
            "Adasum is not supported: ringcomm reduces with sum/average (use hvd.Average)")
    return op


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``t`` by ``factor`` in place as Horovod does.

    Integers are scaled in float64 and truncated toward zero; 16-bit floats are scaled in
    float32 and rounded once; float32/float64 are scaled in their own precision.
    """
    if factor == 1.0:
        return t
    with torch.no_grad():
        if t.is_floating_point() and t.element_size() >= 4:
            t.mul_(factor)
        elif t.is_floating_point():
            t.copy_(t.float().mul_(factor))
        elif t.dtype == torch.bool:
            t.copy_(t.double().mul_(factor) != 0)
        else:
            t.copy_(t.double().mul_(factor))
    return t


def _ring_op(op: ReduceOp, floating: bool, postscale: float, size: int) -> tuple[str, float]:
    """The communicator's op, and the factor still to apply to its result."""
    if op is ReduceOp.AVERAGE:
        if floating and postscale == 1.0:
            return "avg", 1.0
        return "sum", postscale / size
    return _RING_OPS[op], postscale


# Host tensors of these dtypes reach the communicator as ``host_view(tensor)`` (what Operand
# does for them, without its staging and device checks: a few microseconds of an allreduce of
# a few kilobytes).
_HOST_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int32, torch.int64))


def _reduce_host(comm: Communicator, src: torch.Tensor, dst: torch.Tensor, op: str) -> None:
    x = host_view(src.detach())
    try:
        comm.allreduce(x, out=x if dst is src else host_view(dst.detach()), op=op)
    except (ValueError, TypeError) as err:
        raise collective_error(comm, err, "allreduce", src) from err


def allreduce_tensor(comm: Communicator, src: torch.Tensor, dst: torch.Tensor, *,
                     op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
                     postscale: float = 1.0, compression: Any = None,
                     feedback: ErrorFeedback | None = None, name: str | None = None
                     ) -> torch.Tensor:
    """Reduce ``src`` over all ranks into ``dst`` (which may be ``src``); return ``dst``.

    Args:
        comm: the communicator.
        src: this rank's contribution; left untouched unless it is ``dst``.
        dst: receives the result; same shape and dtype as ``src``.
        op: Horovod's reduction op (Adasum excluded).
        prescale: factor applied to ``src`` before the reduction.
        postscale: factor applied to the result (Average divides by the size on top).
        compression: a ringcomm compressor for what the ring sends, or None. Used for floating
            tensors reduced with sum/average; other calls go uncompressed.
        feedback: error feedback for the compressed call, keyed by ``name``.
        name: the tensor's name (same on every rank); needed with ``feedback``.

    Raises:
        HorovodInternalError: the communicator refused the call (arguments differing between
            ranks, an unsupported dtype); raised on every rank.
    """
    if prescale != 1.0:
        if dst is not src:
            with torch.no_grad():
                dst.copy_(src)
            src = dst
        scale_(dst, prescale)
    floating = src.is_floating_point()
    ring_op, after = _ring_op(op, floating, postscale, comm.size)
    lossy = compression is not None and floating and ring_op in ("sum", "avg")
    if not lossy and src.dtype in _HOST_DTYPES and src.device.type == "cpu" == dst.device.type:
        _reduce_host(comm, src, dst, ring_op)
        return scale_(dst, after)
    x = Operand(src)
    out = x if dst is src else Operand(dst, copy_in=False)
    try:
        comm.allreduce(x.array, out=out.array, op=ring_op,
                       compression=compression if lossy else None,
                       feedback=feedback if lossy else None,
                       name=name if lossy and feedback is not None else None)
    except (ValueError, TypeError) as err:
        raise collective_error(comm, err, "allreduce", src) from err
    out.write_back()
    if lossy:
        keep_write_back_rounding(feedback, name, out, ring_op, comm.rank, comm.size)
    return scale_(dst, after)
