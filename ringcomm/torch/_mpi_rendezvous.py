"""``init_process_group`` under mpiexec, mpirun, srun and horovodrun: torch's ``env://``
rendezvous from MPI.

torch.distributed's default rendezvous (``env://``) reads ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, which torchrun sets and MPI launchers do not: under
``mpiexec`` a plain ``dist.init_process_group("ringcomm")`` raised "environment variable RANK
expected, but not set" before any backend ran (under horovodrun, whose processes first become
one MPI world over its rendezvous server, too). Importing ``ringcomm.torch`` (PyTorch does it at
its start, through ringcomm's entry point) wraps that rendezvous: where ``RANK`` is not set, no
rank was passed, and an MPI launcher started the process (its rank and size variables, as
:func:`ringcomm.core.launch.mpi_launched` reads them), rank and size come from MPI's world and
rank 0's store listens on ``MASTER_PORT`` or a port the system picks, handed to the others
over MPI (:func:`ringcomm.torch.process_group.mpi_store`). MPI's world must be the launcher's
job (never a group of one in a larger job), and a ``world_size`` passed (or ``WORLD_SIZE``)
must be its size: else every rank raises. Everywhere else torch's own rendezvous runs,
unchanged. Not caught: ``RANK`` set on some ranks of a launch only. Those make torch's own
rendezvous and the others MPI's, where MPICH's ``MPI_Init`` waits for every process of the
launch; agreeing over MPI would start MPI in the ranks that set ``RANK``, which a job whose
ranks set it and never use MPI would not expect.

The wrapper replaces the entry of torch's handler table (``rendezvous._rendezvous_handlers``,
which ``register_rendezvous_handler`` does not let a scheme be registered twice in); where a
PyTorch has no such table, nothing is wrapped and ``init_process_group_from_mpi`` remains.
"""

from __future__ import annotations

import datetime
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

from ringcomm.backends.gloo_held import pause_at_exit
from ringcomm.backends.mpi_process import wait_or_abort
from ringcomm.core.launch import detect, horovodrun_rendezvous, mpi_launched
from ringcomm.registry import join_mpi_over_horovodrun, mpi_world_text

__all__ = ["install"]

_WRAPPED = "_ringcomm_mpi"  # marks the wrapper on the handler, so it wraps once


def install() -> bool:
    """Wrap torch's ``env://`` rendezvous (once); whether it is wrapped."""
    # The module (torch.distributed's attribute of that name is its function rendezvous).
    module = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(module, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or handlers.get("env") is None:
        return False
    original = handlers["env"]
    if getattr(original, _WRAPPED, False):
        return True
    handlers["env"] = _wrapping(original)
    return True


def _wrapping(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def handler(url: str, **kwargs: Any) -> Iterator[Any]:
        if not _from_mpi(url):
            yield from original(url, **kwargs)
            return
        yield _rendezvous(url, kwargs.get("timeout"))
        raise RuntimeError("MPI's rendezvous of a job is made once")

    setattr(handler, _WRAPPED, True)
    handler.__doc__ = original.__doc__
    return handler


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}


def _from_mpi(url: str) -> bool:
    """Whether this ``env://`` rendezvous is MPI's to make (see the module's docstring): an
    MPI launch, or horovodrun's processes (MPI started over its rendezvous server first)."""
    if "RANK" in os.environ or "rank" in _query(url):
        return False
    return mpi_launched() or horovodrun_rendezvous() is not None


def _agreed_sizes(comm: Any, query: dict[str, str],
                  timeout: datetime.timedelta) -> list[tuple[int, str]]:
    """Every rank's world size as asked (``world_size=``, else ``WORLD_SIZE``; -1 for none)
    and where it was said, gathered over MPI's world within ``timeout``: where a rank of the
    launch never comes (it took torch's own rendezvous, under an MPI whose start does not wait
    for every process as MPICH's does), the others end the job (``MPI_Abort``, saying why)
    instead of waiting for it forever."""
    import numpy as np

    where = "world_size" if "world_size" in query else "WORLD_SIZE"
    raw = query.get("world_size", os.environ.get("WORLD_SIZE", "-1")).strip()
    value = int(raw) if raw.lstrip("-").isdigit() else -2  # -2: not a number
    send = np.array([value, where == "world_size"], dtype=np.int64)
    recv = np.empty((comm.Get_size(), 2), dtype=np.int64)
    seconds = timeout.total_seconds()
    # The job cannot go on (nor this process finalize MPI with a rank that never came): ended
    # as ringcomm's timeouts end an MPI job.
    wait_or_abort(comm, comm.Iallgather(send, recv), seconds, lambda: RuntimeError(
        f"init_process_group: MPI rank {comm.Get_rank()} of {comm.Get_size()} waited "
        f"{seconds:g} s for the others in the rendezvous over MPI: not every rank of the "
        "launch came. A rank where RANK is set (or a rank is passed) makes torch's own "
        "rendezvous instead: set it on every rank, or on none"))
    return [(int(v), "world_size" if w else "WORLD_SIZE") for v, w in recv]


def _rendezvous(url: str, timeout: datetime.timedelta | None) -> tuple[Any, int, int]:
    """(store, rank, size) of MPI's world, checked against the launcher and ``url``."""
    from ringcomm.backends.mpi_process import import_mpi
    from ringcomm.torch.process_group import _DEFAULT_TIMEOUT, mpi_store

    wait = _DEFAULT_TIMEOUT if timeout is None else timeout
    launched = detect(os.environ)
    join_mpi_over_horovodrun(launched, wait.total_seconds())  # horovodrun's processes only
    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != launched.size:
        raise RuntimeError(
            f"init_process_group: {launched.describe()}, but {mpi_world_text(size)}: "
            f"{launched.mpi_hint()}; or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
            "yourself")
    query = _query(url)
    asked = _agreed_sizes(comm, query, wait)
    said = "; ".join(f"{where}={value} on rank {r}" for r, (value, where) in enumerate(asked)
                     if value not in (-1, size))
    if said:
        raise ValueError(f"init_process_group: {said}, but the job (MPI's world, "
                         f"{launched.describe()}) has {size} processes")
    port = int(os.environ.get("MASTER_PORT") or 0)
    store = mpi_store(comm, None, wait, port)
    pause_at_exit()  # a gloo group's threads let go of PyTorch's tensors before the exit
    return store, rank, size
