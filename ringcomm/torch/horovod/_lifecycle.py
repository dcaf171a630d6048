"""Starting and stopping the Horovod-style surface: ``hvd.init()`` and ``hvd.shutdown()``.

Above every module whose state they start (the communicator of
:mod:`ringcomm.torch.horovod._basics`, the engine, the negotiation's coordinator, process
sets, the timeline), so that those modules import only downwards.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ringcomm.comm.base import Communicator
from ringcomm.comm.settings import agree_at_start
from ringcomm.core.env import env, env_flag
from ringcomm.core.log import get_logger
from ringcomm.torch._engine import engine_for
from ringcomm.torch.horovod import timeline
from ringcomm.torch.horovod._basics import (
    STATE,
    STATE_LOCK,
    ProcessSet,
    registered_sets,
    unregister_set,
)
from ringcomm.torch.horovod._control import cache_capacity
from ringcomm.torch.horovod._fusion import fusion_threshold
from ringcomm.torch.horovod._negotiate import coordinator_for, env_float, forget
from ringcomm.torch.horovod.process_sets import add_process_set
from ringcomm.torch.horovod.unsupported import refusal
from ringcomm.torch.process_group import new_communicator

__all__ = ["init", "shutdown"]

_LOG = get_logger("torch.horovod")


def init(comm: Any = None, process_sets: Any = None, *, backend: str = "auto") -> None:
    """Start ringcomm for this process (``hvd.init()``); a second call does nothing.

    Under ``mpiexec`` the communicator spans MPI's processes; under ``torchrun`` it runs over a
    gloo group of torch.distributed (initialized from torchrun's environment if need be).

    But where torch.distributed's default group was destroyed and made again since the
    communicator was made (``destroy_process_group()`` and ``init_process_group()`` between
    two runs in one process), a second call shuts down and starts again over the new group,
    whose ranks may be numbered otherwise: ``rank()`` is then the new group's.

    Args:
        comm: an mpi4py communicator to run on, or a ringcomm Communicator; the whole job
            when None.
        process_sets: ProcessSets (or lists of ranks) to register, as with
            ``hvd.add_process_set``; "dynamic" (Horovod's flag) is accepted and does nothing:
            sets may always be added later.
        backend: "auto", "mpi" or "nccl", as for :func:`ringcomm.init`.

    Raises:
        NotImplementedError: ``comm`` is a list of ranks.

    Example::

        import ringcomm.torch as hvd
        hvd.init()
        print(hvd.rank(), hvd.size(), hvd.local_rank())
    """
    if isinstance(comm, (list, tuple)):
        raise refusal("init(comm=<list of ranks>): start the job with those ranks, or use "
                      "hvd.add_process_set for collectives among some of them")
    if _default_group_replaced():
        # Every rank destroyed the group and made a new one (both are collective), so every
        # rank starts again here: the old communicator's ranks may be numbered otherwise
        # than the new group's, or run over a gloo group torch.distributed let go.
        _LOG.info("hvd.init(): torch.distributed's default group is another than at the "
                  "first hvd.init(); shutting down and starting over the new one")
        shutdown()
    with STATE_LOCK:
        if STATE.comm is not None and not STATE.comm.closed:
            return
        # Read without raising: a bad value on one rank is raised on every rank once the
        # communicator is up (raised here alone, it would leave the others waiting for it).
        settings, problem = _horovod_settings()
        sets, settings["process_sets"], set_problem = _process_sets(process_sets)
        problem = problem or set_problem
        if isinstance(comm, Communicator):
            STATE.comm, STATE.owned = comm, False
        else:
            STATE.comm, STATE.owned = new_communicator(backend=backend, mpi_comm=comm), True
        try:
            _start(STATE.comm, settings, problem)
        except BaseException:
            if STATE.owned:
                STATE.comm.close()
            STATE.comm, STATE.engine = None, None  # not half started: init may run again
            raise
        STATE.torch_group = _default_group() if STATE.owned else None
    for ps in sets:
        add_process_set(ps)


def _default_group() -> Callable[[], Any] | None:
    """A weak reference to torch.distributed's default group; None where it is not up."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return weakref.ref(dist.group.WORLD)


def _default_group_replaced() -> bool:
    """Whether init made the running communicator while torch.distributed's default group
    was another one than the group up now (destroyed and made again since, as a script
    that calls ``destroy_process_group()`` between two runs in one process does). False
    where none is up now: the communicator stands (over MPI it still works; over a gloo
    group let go, its calls say so)."""
    held = STATE.torch_group
    if held is None or STATE.comm is None or STATE.comm.closed:
        return False
    now = _default_group()
    return now is not None and now() is not held()


def _process_sets(process_sets: Any) -> tuple[list[Any], Any, Exception | None]:
    """The sets ``init`` registers, their ranks (compared between ranks at start: a list
    that differs would leave the first set that differs waiting until the stall limit on
    the ranks that register it), and the error that makes them invalid, if any."""
    if process_sets is None or (isinstance(process_sets, str) and process_sets == "dynamic"):
        return [], (), None
    try:
        sets = list(process_sets)
        ranks = tuple(tuple(ps.ranks or ()) if isinstance(ps, ProcessSet) else
                      tuple(ProcessSet(ps).ranks or ()) for ps in sets)
    except (TypeError, ValueError) as err:
        return [], None, ValueError(f"init(process_sets=...): {err}")
    return sets, ranks, None


def _start(comm: Communicator, settings: dict[str, Any], problem: Exception | None) -> None:
    """Agree on the Horovod settings over the new communicator ``comm``, then start the
    engine, the negotiation and the timeline (collective)."""
    agree_at_start(comm.transport, settings, problem or timeline.env_problem(comm.rank))
    if settings["HOROVOD_HIERARCHICAL_ALLREDUCE"] is not None and STATE.owned:
        comm.algorithm = settings["HOROVOD_HIERARCHICAL_ALLREDUCE"]
    STATE.engine = engine_for(comm)
    coordinator_for(comm)  # collective: its control channel is split here
    timeline.start_from_env(comm.rank)  # HOROVOD_TIMELINE


def _horovod_settings() -> tuple[dict[str, Any], Exception | None]:
    """The Horovod variables that change what the ranks exchange, checked (None for a bad
    one), and the first error. The timing variables are checked too, not compared: their
    values may differ between ranks, but a bad one must fail every rank."""
    compared = (("HOROVOD_HIERARCHICAL_ALLREDUCE", _algorithm_from_env),
                ("HOROVOD_CACHE_CAPACITY", cache_capacity),
                ("HOROVOD_FUSION_THRESHOLD", lambda: fusion_threshold(None)))
    timing = tuple((name, functools.partial(env_float, name, 0.0)) for name in (
        "HOROVOD_CYCLE_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"))
    settings: dict[str, Any] = {}
    problem = None
    for name, read in compared + timing:
        try:
            settings[name] = read()
        except ValueError as err:
            settings[name], problem = None, problem or err
    for name, _ in timing:
        del settings[name]
    return settings, problem


def _algorithm_from_env() -> str | None:
    """The allreduce algorithm Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` asks for:
    "hierarchical" (within nodes, across them, within them again) for 1, "flat" for 0; None
    when unset (``ringcomm.init``'s choice stands: ``RINGCOMM_ALGORITHM``, or "auto").

    Raises:
        ValueError: the variable is not 0 or 1 (or true/false, ...).
    """
    if env("HOROVOD_HIERARCHICAL_ALLREDUCE") is None:
        return None
    return "hierarchical" if env_flag("HOROVOD_HIERARCHICAL_ALLREDUCE", False) else "flat"


def shutdown() -> None:
    """Shut down on every rank: operations still pending fail; release the communicator.

    As in Horovod, one rank's shutdown is the job's: every rank's background thread stops in
    the same negotiation cycle, and operations submitted afterwards raise RuntimeError.
    """
    if timeline.active() is not None:
        timeline.stop_timeline()
    for ps in registered_sets():
        sub = unregister_set(ps)
        if sub is not None:
            forget(sub)
            sub.close()
    with STATE_LOCK:
        if STATE.comm is not None:
            forget(STATE.comm)
        if STATE.engine is not None:
            STATE.engine.close()
        if STATE.comm is not None and STATE.owned:
            STATE.comm.close()
        STATE.comm, STATE.engine, STATE.owned = None, None, False
        STATE.torch_group = None
