"""``init_process_group`` under mpiexec, mpirun and srun: torch's ``env://`` rendezvous from MPI.

torch.distributed's default rendezvous (``env://``) reads ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, which torchrun sets and MPI launchers do not: under
``mpiexec`` a plain ``dist.init_process_group("ringcomm")`` raised "environment variable RANK
expected, but not set" before any backend ran. Importing ``ringcomm.torch`` (PyTorch does it at
its start, through ringcomm's entry point) wraps that rendezvous: where ``RANK`` is not set, no
rank was passed, and an MPI launcher started the process (its rank and size variables, as
:func:`ringcomm.core.launch.mpi_launched` reads them), rank and size come from MPI's world and
rank 0's store listens on ``MASTER_PORT`` or a port the system picks, handed to the others
over MPI (:func:`ringcomm.torch.process_group.mpi_store`). MPI's world must be the launcher's
job (never a group of one in a larger job), and a ``world_size`` passed (or ``WORLD_SIZE``)
must be its size: else every rank raises, as where ``RANK`` is set on some ranks of the launch
only (every rank agrees over MPI which rendezvous to make). Everywhere else torch's own
rendezvous runs, unchanged.

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
from ringcomm.core.launch import detect, mpi_launched
from ringcomm.registry import mpi_world_text

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
    """Whether this ``env://`` rendezvous is MPI's to make (see the module's docstring): the
    same answer on every rank of an MPI launch (a collective over MPI's world there), which
    ranks that differ (``RANK`` set on some only) get as the same error, where each taking its
    own path would leave the others waiting forever.

    Raises:
        ValueError: a rank is given on some ranks of the launch and not on others.
    """
    own = "RANK" in os.environ or "rank" in _query(url)
    if not mpi_launched():
        return False
    from ringcomm.backends.mpi_process import import_mpi

    try:
        world = import_mpi().COMM_WORLD
    except RuntimeError:  # no mpi4py: no rendezvous over MPI either
        return False
    given = world.allgather(own)
    if all(given):
        return False
    if not any(given):
        return True
    raise ValueError(
        f"init_process_group: a rank is set (RANK, or rank=) on MPI ranks "
        f"{_ranks(given, True)} but not on {_ranks(given, False)}: set it on every rank, or "
        f"on none under an MPI launcher (ringcomm then takes rank and size from MPI)")


def _ranks(given: list[bool], value: bool) -> str:
    return ", ".join(str(r) for r, g in enumerate(given) if g == value)


def _rendezvous(url: str, timeout: datetime.timedelta | None) -> tuple[Any, int, int]:
    """(store, rank, size) of MPI's world, checked against the launcher and ``url``."""
    from ringcomm.backends.mpi_process import import_mpi
    from ringcomm.torch.process_group import _DEFAULT_TIMEOUT, mpi_store

    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    launched = detect(os.environ)
    if size != launched.size:
        raise RuntimeError(
            f"init_process_group: {launched.describe()}, but {mpi_world_text(size)}: mpi4py's "
            f"MPI is not the launcher's (launch with the mpiexec of the MPI mpi4py was built "
            f"with), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself")
    query = _query(url)
    asked = query.get("world_size", os.environ.get("WORLD_SIZE", "-1"))
    where = "world_size" if "world_size" in query else "WORLD_SIZE"
    problem = None if asked.strip() in ("-1", str(size)) else f"{where}={asked}"
    problems = comm.allgather(problem)
    if any(problems):
        said = "; ".join(f"{p} on rank {r}" for r, p in enumerate(problems) if p)
        raise ValueError(f"init_process_group: {said}, but the job (MPI's world, "
                         f"{launched.describe()}) has {size} processes")
    port = int(os.environ.get("MASTER_PORT") or 0)
    store = mpi_store(comm, None, _DEFAULT_TIMEOUT if timeout is None else timeout, port)
    pause_at_exit()  # a gloo group's threads let go of PyTorch's tensors before the exit
    return store, rank, size
