"""Running what a negotiation cycle decided: one group of operations at a time.

A group is one operation, or allreduces fused into one collective (see
:meth:`ringcomm.torch.horovod._table.PendingTable.groups`). It runs on whichever thread runs the
cycle (see :mod:`ringcomm.torch.horovod._negotiate`), in the same surroundings on every thread:
as the coordinator's caller for the communicator's cross-rank checks, with the communicator's
CUDA device current, outside inference mode; its outcome goes to the handles of the operations
this rank submitted, and to the timeline.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ringcomm.comm.base import Communicator
from ringcomm.comm.callers import calls_as
from ringcomm.torch._errors import HorovodInternalError
from ringcomm.torch._tensors import device_scope
from ringcomm.torch.horovod._basics import ReduceOp
from ringcomm.torch.horovod._fusion import reduce_fused
from ringcomm.torch.horovod._ops import JOINED_RUNS, ReduceSpec, ring_from_spec
from ringcomm.torch.horovod._table import Outcome, meta_dtype

__all__ = ["joined_reduce", "run_group", "zeros_spec"]

_NO_CONTEXT = contextlib.nullcontext()


def run_group(comm: Communicator, caller: str, group: list[Outcome], tl: Any,
              last_joined: int) -> None:
    """Run ``group`` (or fail it with its decided error) and finish its handles.

    Args:
        comm: the communicator the data steps run on.
        caller: the name the data steps run as (the same on every rank and thread).
        group: decided outcomes, their ``mine`` set (None where this rank joined).
        tl: the active timeline, or None.
        last_joined: the rank that joined last, for a join's result.
    """
    error: BaseException | None = group[0].error  # a failed entry is never fused
    result: list[Any] = [None] * len(group)
    names = [] if tl is None else [o.entry.name for o in group if o.mine is not None]
    if tl is not None:
        args = {"fused": len(group)} if len(group) > 1 else None
        for n in names:
            tl.end(n)  # QUEUE
            tl.start(n, group[0].entry.kind.upper(), args)
    if error is None:
        try:
            with calls_as(caller), _surroundings(comm):
                if tl is None:
                    result = _execute(comm, group, last_joined)
                else:
                    with tl.executing(names):
                        result = _execute(comm, group, last_joined)
        except BaseException as err:  # handed to whoever waits on the handles
            error = err
    if tl is not None:
        for n in names:
            tl.end(n)
    for o, value in zip(group, result, strict=True):
        if o.mine is not None:
            o.mine.handle.finish(value, error)


def _execute(comm: Communicator, group: list[Outcome], last_joined: int) -> list[Any]:
    if len(group) == 1:
        entry, m = group[0].entry, group[0].mine
        if entry.kind == "join":
            return [last_joined]
        meta = next(iter(entry.metas.values()))
        if entry.kind == "grouped_allreduce" and m is None:
            _joined_group(comm, meta)
            return [None]
        if entry.kind != "allreduce" and m is None:
            raise HorovodInternalError(f"{entry.kind} {entry.user_name!r} reached a joined rank")
        if m is not None and m.op.run is not None:
            return [m.op.run(comm)]
        if m is None and meta.get("ring") is not None:  # compressed; no state to take part with
            joined_reduce(ring_from_spec(meta["ring"]), meta["feedback"], comm, meta)
            return [None]
        owner = meta.get("owner") if m is None else None
        joined = JOINED_RUNS.get((owner, entry.user_name)) if owner is not None else None
        if joined is not None:
            joined(comm, meta)
            return [None]
    return reduce_fused(comm, [_spec(o) for o in group])


def joined_reduce(ring: Any, feedback_name: str | None, comm: Communicator,
                  meta: dict[str, Any]) -> None:
    """A joined rank's part in a compressed allreduce the others describe by ``meta``: zeros
    through the same compression and error feedback (its residual goes out with them)."""
    reduce_fused(comm, [zeros_spec(meta, ring, feedback_name)])


def _joined_group(comm: Communicator, meta: dict[str, Any]) -> None:
    """A joined rank's part in a grouped allreduce: zeros for each collective the others'
    :func:`reduce_fused` makes of it (one per dtype and device, in the order they first come;
    flat where it fuses several tensors)."""
    groups: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    for dtype, device, shape in meta["tensors"]:
        groups.setdefault((dtype, device), []).append(tuple(shape))
    for (dtype, _), shapes in groups.items():
        shape = shapes[0] if len(shapes) == 1 else (sum(math.prod(s) for s in shapes),)
        reduce_fused(comm, [zeros_spec(dict(meta, dtype=dtype, shape=shape))])


def _spec(o: Outcome) -> ReduceSpec:
    if o.mine is not None and o.mine.op.reduce is not None:
        return o.mine.op.reduce
    return zeros_spec(next(iter(o.entry.metas.values())))  # this rank joined


def zeros_spec(meta: dict[str, Any], ring: Any = None,
               feedback_name: str | None = None) -> ReduceSpec:
    """A joined rank's part in the allreduce the others describe by ``meta``: zeros of the
    agreed dtype and shape, with its op and scaling (and, for a compressed one, the same
    compression and error feedback)."""
    zeros = torch.zeros(meta["shape"], dtype=meta_dtype(meta["dtype"]))
    return ReduceSpec(zeros, zeros, ReduceOp[meta["op"]], meta.get("prescale", 1.0),
                      meta.get("postscale", 1.0), ring, feedback_name)


def _surroundings(comm: Communicator) -> Any:
    """The communicator's CUDA device current, as on the engine's thread (the submitters'
    streams were fenced into the default stream by their Handles); and outside inference
    mode, as on a new thread: a waiting thread in inference mode runs other threads'
    operations too, whose results must not be inference tensors."""
    device, inference = comm.cuda_device, torch.is_inference_mode_enabled()
    if device is None and not inference:
        return _NO_CONTEXT  # a host job's usual case
    stack = contextlib.ExitStack()
    stack.enter_context(device_scope(device))
    if inference:
        stack.enter_context(torch.inference_mode(False))
    return stack
