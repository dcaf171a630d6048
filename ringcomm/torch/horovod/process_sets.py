"""Horovod's process sets: collectives among a subset of the ranks.

``hvd.add_process_set(ranks)`` is collective over the whole job: every rank calls it with the
same ranks (a difference fails it on every rank, naming the ranks each gave). The members get a
communicator of their own, split from the job's transport, with its own negotiation; the other
ranks keep only the set's description. ``process_set=`` then selects it in any collective.

Example (``mpiexec -n 4``)::

    evens = hvd.add_process_set([0, 2])
    odds = hvd.add_process_set([1, 3])
    mine = evens if hvd.rank() % 2 == 0 else odds
    total = hvd.allreduce(t, op=hvd.Sum, process_set=mine)
    hvd.remove_process_set(odds)
    hvd.remove_process_set(evens)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.torch.horovod._basics import (
    ProcessSet,
    global_process_set,
    register_set,
    registered_sets,
    size,
    unregister_set,
)
from ringcomm.torch.horovod._negotiate import coordinator_for, execute, forget
from ringcomm.torch.horovod._ops import Op

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


def _split(comm: Communicator, ranks: list[int]) -> Communicator | None:
    """The members' communicator over ``ranks`` (None on the other ranks); collective."""
    member = comm.rank in ranks
    sub = comm.transport.split(0 if member else 1, comm.rank)
    if not member:
        sub.close()
        return None
    sub_comm = Communicator(sub)
    coordinator_for(sub_comm)  # collective among the members, who all run this step now
    return sub_comm


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a process set on every rank (collective: every rank calls it alike).

    Args:
        process_set: a ProcessSet, or the global ranks of one.

    Returns:
        The registered ProcessSet (``process_set_id`` set).

    Raises:
        ValueError: ranks out of range, repeated, or empty, or a set of the same ranks
            already registered (on every rank).
        HorovodInternalError: the ranks differ between the ranks of the job (on every rank).

    Example::

        evens = hvd.add_process_set(range(0, hvd.size(), 2))
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    ranks = list(ps.ranks or [])
    problem = _problem(ranks)
    # Negotiated like any collective: ranks that differ fail it on every rank, and the
    # problem found (the same everywhere: same ranks, same registered sets) splits nothing.
    sub = execute(Op("add_process_set", None, {"ranks": tuple(ranks)},
                     lambda c: None if problem else _split(c, ranks)))
    if problem:
        raise ValueError(problem)
    register_set(ps, sub)
    return ps


def _problem(ranks: list[int]) -> str | None:
    n = size()
    if not ranks:
        return "a process set needs at least one rank"
    if len(set(ranks)) != len(ranks):
        return f"process set ranks must be distinct, got {ranks}"
    if ranks[0] < 0 or ranks[-1] >= n:
        return f"process set ranks must be in [0, {n}), got {ranks}"
    if any(other.ranks == ranks for other in registered_sets()):
        return f"Attempted to add a duplicate process set: ranks {ranks}"
    return None


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (collective); return whether it was registered.

    Its pending operations fail; the ProcessSet object can no longer be used.

    Example::

        hvd.remove_process_set(evens)
    """
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    meta = {"ranks": tuple(process_set.ranks or ())}

    def run(_: Any) -> None:
        sub = unregister_set(process_set)
        if sub is not None:
            forget(sub)  # the members' last negotiation cycle, together
            sub.close()

    execute(Op("remove_process_set", None, meta, run))
    return True
