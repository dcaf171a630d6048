"""ringcomm's DDP hook on a model that a framework wrapped in DDP (Hugging Face Accelerate, ...).

Accelerate takes ``DistributedDataParallelKwargs(comm_hook=...)`` but registers only its own
``DDPCommunicationHookType`` values (fp16, bf16, PowerSGD): a callable such as
:func:`~ringcomm.torch.ringcomm_hook` passed there is silently ignored, and DDP averages the
gradients itself. :func:`register_ddp_hook` registers the hook on the model that
``accelerator.prepare(model)`` returned, after checking that it is a DDP model and that the
communicator spans the same processes as the model's process group. It needs no Accelerate (any
``DistributedDataParallel`` will do); the Lightning and Fabric strategies
(:mod:`ringcomm.torch.lightning`, :mod:`ringcomm.torch.fabric`) and the Trainer's callback
(:mod:`ringcomm.torch.hf_trainer`) call it too.

Example (``accelerate launch --multi_gpu --num_processes 2 train.py``, CPU or GPU)::

    import ringcomm
    from accelerate import Accelerator
    from ringcomm.torch import register_ddp_hook

    accelerator = Accelerator()
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = register_ddp_hook(model, compression=ringcomm.Int8())
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ringcomm.comm.base import Communicator
from ringcomm.core.types import ArgumentMismatchError
from ringcomm.torch.hooks import RingcommState, ringcomm_hook

__all__ = ["register_ddp_hook"]


# The communicator of the states register_ddp_hook makes, and the default group it spans.
_SHARED: list[tuple[Any, Communicator]] = []
_SHARED_LOCK = threading.Lock()


def _communicator() -> Communicator:
    """The communicator over torch.distributed's default group, which is up (DDP needs it),
    that every state register_ddp_hook makes shares: made at the first, again only where the
    default group is another (destroyed and initialized again) or the communicator closed.

    ``ringcomm.init()`` spans an initialized torch.distributed group whatever launched the job
    (torchrun, Accelerate, Lightning's launcher, which sets no RANK): NCCL where every rank has
    a GPU of its own and NCCL, else gloo. Shared, as DDP's models share the default group:
    a model hooked after another (a run of trials in one process, each ``Trainer.fit``) costs
    no new group (over gloo, 5 file descriptors and its threads, kept to exit), and two models
    whose buckets meet in different orders on different ranks raise ArgumentMismatchError at
    once on every rank instead of waiting on each other's communicator to the timeout.
    """
    import ringcomm

    group = dist.group.WORLD
    with _SHARED_LOCK:
        if _SHARED and _SHARED[0][0] is group and not _SHARED[0][1].closed:
            return _SHARED[0][1]
        comm = ringcomm.init()
        _SHARED[:] = [(group, comm)]
        return comm


def _new_state(state_kwargs: dict[str, Any]) -> RingcommState:
    """A RingcommState from ``state_kwargs``, on the shared communicator unless they name
    one."""
    if "comm" in state_kwargs:
        return RingcommState(**state_kwargs)
    return RingcommState(comm=_communicator(), **state_kwargs)


def _ddp_model(model: Any) -> DistributedDataParallel:
    """``model``, or the DistributedDataParallel that ``torch.compile`` wrapped in it (its
    ``_orig_mod``: the hook goes on the DDP model the compiled one runs); TypeError unless it
    is either."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, DistributedDataParallel) and isinstance(model, torch.nn.Module):
        return inner
    if not isinstance(model, DistributedDataParallel):
        kind = type(model).__module__
        if kind.startswith(("lightning.fabric", "lightning_fabric")):
            raise TypeError(
                "register_ddp_hook expects a torch.nn.parallel.DistributedDataParallel, got "
                f"Lightning Fabric's {type(model).__qualname__} (what fabric.setup returns, "
                "with the DDP model inside): pass strategy=ringcomm.torch.fabric."
                "RingcommDDPStrategy(state_kwargs=...) to Fabric instead, which registers the "
                "hook as Fabric wraps the model")
        raise TypeError(
            "register_ddp_hook expects a torch.nn.parallel.DistributedDataParallel (what "
            "accelerator.prepare(model) returns when the job has several processes), got "
            f"{type(model).__module__}.{type(model).__qualname__}; a job of one process has "
            "no DDP model and no gradients to average")
    return model


def _check_state(state: RingcommState, model: DistributedDataParallel) -> None:
    """Raise unless ``state`` is a RingcommState whose open communicator has the size of the
    model's process group."""
    if not isinstance(state, RingcommState):
        raise TypeError(f"state must be a ringcomm.torch.RingcommState, got "
                        f"{type(state).__qualname__}")
    if state.comm.closed:
        raise RuntimeError(f"the state's communicator is closed: {state.comm!r}")
    given = state._model() if state._model is not None else None
    if given is not None and given is not model:
        raise ValueError(
            "this RingcommState already runs the hook of another DDP model: give each model a "
            "state of its own (a state counts its model's iterations and keeps the "
            "compressor's state by bucket index), e.g. register_ddp_hook(model, "
            "**state_kwargs) for each")
    expected = model.process_group.size()
    if state.comm.size != expected:
        raise ValueError(
            f"the state's communicator has {state.comm.size} process(es) but the DDP model's "
            f"process group has {expected}: make the communicator after torch.distributed is "
            "initialized and over the same processes (pass state keyword arguments and let "
            "register_ddp_hook make it, or RingcommState(comm=ringcomm.init()))")
    _check_members(state.comm, model)


def _check_members(comm: Communicator, model: DistributedDataParallel) -> None:
    """Raise the same ValueError on every rank of ``comm`` unless its processes are those of
    the model's process group, whose size it has: a communicator of as many processes but
    others (another sub-group's, say a replica group where the shard group was meant) would
    average each rank's gradients with the wrong peers, without an error.

    Every rank of ``comm`` names the job's ranks of its model's group in one checkpoint: where
    they all name the same ranks, those are ``comm``'s (each rank is in its own model's group,
    and the sizes are equal)."""
    if comm.size == 1:
        return
    ranks = ", ".join(map(str, sorted(dist.get_process_group_ranks(model.process_group))))
    try:
        comm.checkpoint(f"register_ddp_hook, a DDP model over ranks {ranks}")
    except ArgumentMismatchError as err:
        raise ValueError(
            "the state's communicator spans other processes than the DDP model's process "
            "group, so the hook would average each rank's gradients with the wrong ranks. The "
            "job's ranks of each one's model group, by the communicator's rank: "
            f"{err}. Give each model a communicator over its own group's processes (on the "
            "\"ringcomm\" backend, the group's communicator), and register the hook on every "
            "rank at once") from err


def register_ddp_hook(model: DistributedDataParallel, state: RingcommState | None = None,
                      **state_kwargs: Any) -> RingcommState:
    """Register :func:`~ringcomm.torch.ringcomm_hook` on a DDP model; return its state.

    Call it once per DDP model, on every rank, after torch.distributed is initialized and
    before the first backward (DDP takes one communication hook per model).

    Args:
        model: the ``DistributedDataParallel`` model, as ``accelerator.prepare(model)``
            returns it (not the unwrapped module), or ``torch.compile`` of it.
        state: the hook's state; made here when None, from ``state_kwargs`` (the arguments of
            :class:`~ringcomm.torch.RingcommState`), on a communicator over
            torch.distributed's default group unless ``comm`` is among them: the same one
            for every state made here while that group lasts (as DDP's models share the
            group), so models hooked one after another open no new connections, and two
            whose backward passes run in different orders on different ranks raise
            ArgumentMismatchError at once on every rank.
        **state_kwargs: ``compression``, ``start_iter``, ``min_compress_bytes``, ... for the
            state made here.

    Returns:
        The state the hook runs with (``state.stats`` counts its calls and bytes,
        ``state.comm.stats`` those of every state on its communicator).

    Raises:
        TypeError: ``model`` is not a DistributedDataParallel (nor a compiled one),
            ``state`` is not a RingcommState, or both ``state`` and ``state_kwargs`` are
            given.
        ValueError: the communicator's size differs from ``model.process_group.size()`` (a
            communicator made before torch.distributed was up, say), its processes are not
            the group's (the same error on every rank of the communicator), or a bad state
            argument.
        RuntimeError: the state's communicator is closed, or DDP already has a hook.

    Example::

        model = accelerator.prepare(net)
        state = register_ddp_hook(model, compression=ringcomm.Int8(), start_iter=10)
        ...
        print(state.stats)
    """
    model = _ddp_model(model)
    if state is not None and state_kwargs:
        raise TypeError("register_ddp_hook takes a state or state keyword arguments, not both; "
                        f"got a state and {sorted(state_kwargs)}")
    if state is None:
        state = _new_state(state_kwargs)
    _check_state(state, model)
    model.register_comm_hook(state, ringcomm_hook)
    state._model = weakref.ref(model)
    return state


def check_strategy_state(strategy: str, state: Any, state_kwargs: Any) -> None:
    """Check a framework adapter's ``state`` and ``state_kwargs`` arguments (Lightning's and
    Fabric's ``RingcommDDPStrategy``, the Trainer's ``register_trainer_hook``).

    Raises:
        TypeError: both are given, or ``state`` is not a RingcommState.
    """
    if state is not None and state_kwargs:
        raise TypeError(f"{strategy} takes state or state_kwargs, not both")
    if state is not None and not isinstance(state, RingcommState):
        raise TypeError(f"state must be a ringcomm.torch.RingcommState, got "
                        f"{type(state).__qualname__}")


def hook_strategy_model(model: DistributedDataParallel, state: RingcommState | None,
                        state_kwargs: dict[str, Any], scaler: Any) -> RingcommState:
    """:func:`register_ddp_hook` on a model a framework has just wrapped in DDP:
    with ``state``, else with a state made from ``state_kwargs``, whose ``grad_scaler`` is
    the precision plugin's loss ``scaler`` (``precision="16-mixed"``) unless they name one."""
    if state is not None:
        return register_ddp_hook(model, state)
    kwargs = dict(state_kwargs)
    if scaler is not None:  # the residuals follow its loss scale
        kwargs.setdefault("grad_scaler", scaler)
    return register_ddp_hook(model, **kwargs)
