"""Make ranks that started differently identical: parameters, optimizer state, any object."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ringcomm.comm._mismatch import ranks_text
from ringcomm.torch import _objects
from ringcomm.torch._errors import HorovodInternalError
from ringcomm.torch.horovod._basics import (
    Min,
    check_process_set,
    global_process_set,
    rank,
    root_in_set,
)
from ringcomm.torch.horovod._negotiate import execute
from ringcomm.torch.horovod._ops import Op
from ringcomm.torch.horovod.functions import allreduce, broadcast_async_, synchronize
from ringcomm.torch.horovod.optimizer import base_step

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]

_LISTED = 5  # names a message lists at most


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: Any = global_process_set) -> None:
    """Overwrite tensors on every rank with root's, in place.

    Args:
        params: ``model.state_dict()`` (a dict, broadcast in sorted key order), or a list or
            iterable of tensors or of (name, tensor) pairs such as ``model.named_parameters()``.
        root_rank: the rank whose values everyone gets.
        process_set: the process set to run on (every rank by default).

    Raises:
        ValueError: ``params`` is neither a dict nor an iterable.
        HorovodInternalError: the names (or, unnamed, the number) of the tensors, their shapes
            or dtypes differ between ranks (on every rank).

    Example::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    check_process_set(process_set)
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    _check_same_names([name for name, _ in items], process_set)
    _broadcast_items(items, root_rank, process_set)


def _broadcast_items(items: list[tuple[Any, torch.Tensor]], root_rank: int,
                     process_set: Any) -> None:
    """Broadcast each (name, tensor) in place, the names already the same on every rank."""
    handles = [broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                name, process_set) for name, p in items]
    for handle in handles:
        synchronize(handle)


def _check_same_names(names: list[Any], process_set: Any) -> None:
    """Raise on every rank where the ranks' tensors differ in names or number (one allgather
    of the names): a name some ranks alone have was a broadcast the others never submitted,
    waited for until the stall limit."""
    # Named tensors pair by name, in any order; unnamed ones by position.
    mine = sorted(str(n) for n in names if n is not None)
    unnamed = sum(n is None for n in names)
    everyone = allgather_object((unnamed, mine), process_set=process_set)
    if all(other == everyone[0] for other in everyone[1:]):
        return
    seen: dict[str, list[int]] = {}
    for r, (_, listed) in enumerate(everyone):
        for n in listed:
            seen.setdefault(n, []).append(r)
    apart = [(n, rs) for n, rs in seen.items() if len(rs) < len(everyone)]
    shown = [f"{n!r} on {ranks_text(rs)} only" for n, rs in apart[:_LISTED]]
    if len(apart) > _LISTED:
        shown.append(f"and {len(apart) - _LISTED} more")
    if len({u for u, _ in everyone}) > 1:
        shown.append("unnamed tensors: " + ", ".join(f"{u} on rank {r}"
                                                    for r, (u, _) in enumerate(everyone)))
    raise HorovodInternalError("broadcast_parameters: the tensors differ between ranks: "
                               + "; ".join(shown) + "; every rank must pass the same tensors")


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Return root's ``obj`` (pickled, with cloudpickle where installed) on every rank.

    Example::

        epoch = hvd.broadcast_object(epoch, root_rank=0)
    """
    local_root = root_in_set(process_set, root_rank)
    return execute(Op("broadcast_object", name, {"root": root_rank},
                      lambda comm: _objects.broadcast_object(comm, obj, local_root),
                      process_set=process_set))


def allgather_object(obj: Any, name: str | None = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order.

    Example::

        counts = hvd.allgather_object(len(local_dataset))
    """
    return execute(Op("allgather_object", name, {},
                      lambda comm: _objects.allgather_objects(comm, obj),
                      process_set=process_set))


# ------------------------------------------------------------------------ optimizer state
class _TensorSlot:
    """Where root's state held a tensor: what the receivers allocate for it."""

    __slots__ = ("dtype", "on_param_device", "shape")

    def __init__(self, t: torch.Tensor, param: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype
        self.on_param_device = t.device == param.device


class _SparseValue:
    """Where root's state held a sparse tensor (SGD's momentum on a sparse embedding's
    gradients): the tensor itself, on the host, which travels with the skeleton as it is (its
    indices and values in root's order, coalesced or not), since a broadcast moves dense
    tensors only."""

    __slots__ = ("on_param_device", "tensor")

    def __init__(self, t: torch.Tensor, param: torch.Tensor) -> None:
        self.tensor = t.detach().cpu()
        self.on_param_device = t.device == param.device


def _skeleton(value: Any, param: torch.Tensor, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every dense tensor replaced by a _TensorSlot (the tensors go to
    ``tensors``) and every sparse one by a _SparseValue holding it."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            return _SparseValue(value, param)
        tensors.append(value)
        return _TensorSlot(value, param)
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, param, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _skeleton(v, param, tensors) for k, v in value.items()}
    return value


def _flatten(value: Any, out: list[torch.Tensor]) -> None:
    """This rank's dense state tensors of ``value``, in the order _skeleton meets them."""
    if isinstance(value, torch.Tensor):
        if value.layout == torch.strided:
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _flatten(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flatten(v, out)


def _fill(skeleton: Any, param: torch.Tensor, own: list[torch.Tensor],
          received: list[torch.Tensor]) -> Any:
    """Rebuild a state value from root's skeleton, reusing this rank's tensors where they fit."""
    if isinstance(skeleton, _SparseValue):
        device = param.device if skeleton.on_param_device else torch.device("cpu")
        return skeleton.tensor.to(device)
    if isinstance(skeleton, _TensorSlot):
        mine = own.pop(0) if own else None
        device = param.device if skeleton.on_param_device else torch.device("cpu")
        if (mine is None or tuple(mine.shape) != skeleton.shape or mine.dtype != skeleton.dtype
                or mine.device != device):
            mine = torch.empty(skeleton.shape, dtype=skeleton.dtype, device=device)
        received.append(mine)
        return mine
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, param, own, received) for v in skeleton)
    if isinstance(skeleton, dict):
        return {k: _fill(v, param, own, received) for k, v in skeleton.items()}
    return skeleton


def _root_view(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[Any, ...]:
    tensors: list[torch.Tensor] = []
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    states = {i: _skeleton(dict(optimizer.state[p]), p, tensors)
              for i, p in enumerate(params) if optimizer.state.get(p)}
    shapes = [tuple(p.shape) for p in params]
    return options, states, shapes, [len(g["params"]) for g in optimizer.param_groups]


def _initialize_state(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Create the state of an optimizer that has none yet, as Horovod does: zero gradients
    for the parameters that require one, then one step of the optimizer itself (not the
    DistributedOptimizer's, which would reduce). Sparse zeros for SparseAdam, and for SGD on
    the parameters of ``model``'s sparse embeddings. The parameters are restored afterwards:
    a step on zero gradients still moves them (weight decay), by as much as each rank's
    options say, which would leave the ranks' models different."""
    if optimizer.state or isinstance(optimizer, torch.optim.LBFGS):  # LBFGS needs a closure
        return
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        base_step(optimizer)
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: Any = global_process_set) -> None:
    """Give every rank root's optimizer state and options (learning rate, betas, ...).

    An optimizer without state yet gets it first, as in Horovod: zero gradients for the
    parameters that require one and one step of the optimizer (LBFGS, which steps with a
    closure, is left as it is). Works for every optimizer in torch.optim: afterwards every rank
    holds exactly root's state and root's param-group options with their types (floats stay
    floats, tuples tuples, None None). Dense tensors travel by broadcast, in place where this
    rank's own state already has them; sparse ones (SGD's momentum on a sparse embedding) as
    they are, with the options.

    Args:
        optimizer: a torch.optim optimizer, or a DistributedOptimizer.
        root_rank: the rank whose state everyone gets.
        model: the model, whose sparse embeddings get sparse zero gradients (SGD).
        process_set: the process set to run on (every rank by default).

    Raises:
        ValueError: the optimizers' parameter groups or shapes differ from root's (on every
            rank).

    Example::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    check_process_set(process_set)
    _initialize_state(optimizer, model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = _root_view(optimizer, params)
    options, states, shapes, groups = broadcast_object(mine, root_rank,
                                                       process_set=process_set)
    fits = [tuple(p.shape) for p in params] == shapes and mine[3] == groups
    ok = allreduce(torch.tensor([int(fits)]), op=Min, process_set=process_set)
    me = rank()
    if not ok[0]:
        here = "" if fits else (f"; rank {me} has {mine[3]} with shapes "
                                f"{[tuple(p.shape) for p in params]}")
        raise ValueError(f"optimizer parameters differ between ranks: rank {root_rank} has "
                         f"{groups} parameters per group with shapes {shapes}{here}")
    received: list[torch.Tensor] = []
    new_state = {}
    for i, skeleton in states.items():
        own: list[torch.Tensor] = []
        _flatten(dict(optimizer.state.get(params[i], {})), own)
        new_state[params[i]] = _fill(skeleton, params[i], own, received)
    # As many tensors on every rank: root's state, which every rank was checked to fit.
    _broadcast_items([(None, t) for t in received], root_rank, process_set)
    if me != root_rank:
        optimizer.state.clear()
        optimizer.state.update(new_state)
        for group, opts in zip(optimizer.param_groups, options, strict=True):
            group.update(opts)
