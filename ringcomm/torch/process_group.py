"""torch.distributed set-up for jobs launched by mpiexec or torchrun, and the matching communicator.

DDP needs a torch.distributed process group even when ringcomm carries its gradients (it
broadcasts the initial parameters and agrees on its bucket layout through it). Under
``mpiexec`` nobody sets torch's rendezvous variables, so :func:`init_process_group_from_mpi`
takes rank and size from MPI and lets rank 0 pick a free TCP port that MPI hands to the others.
Under ``torchrun`` the environment is already there (:func:`init_process_group_from_env`).

Example (``mpiexec -n 4 python train.py``)::

    from ringcomm.torch.process_group import init_process_group_from_mpi
    init_process_group_from_mpi()                   # gloo, rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(net)
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist

from ringcomm.backends.gloo_held import pause_at_exit
from ringcomm.comm.base import Communicator
from ringcomm.core.types import DEFAULT_TIMEOUT_S

__all__ = ["init_process_group", "init_process_group_from_env", "init_process_group_from_mpi",
           "launched_by_torchrun", "mpi_store", "new_communicator"]

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def _master_addr(comm: Any, given: str | None) -> str:
    """Where rank 0's store listens, as the other ranks reach it."""
    if given:
        return given
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    from ringcomm.backends.mpi_process import import_mpi

    MPI = import_mpi()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = local.Get_size() == comm.Get_size()
    local.Free()
    # One host: loopback. Several: rank 0's host name, as rank 0 resolves it.
    return "127.0.0.1" if one_host else comm.bcast(socket.gethostname(), root=0)


def init_process_group_from_mpi(backend: str = "gloo", mpi_comm: Any = None, *,
                                master_addr: str | None = None,
                                timeout: datetime.timedelta | None = None,
                                abort_on_exception: bool = True) -> None:
    """Set up torch.distributed's default process group over the processes of an MPI job.

    Rank and world size come from ``mpi_comm``; rank 0 starts the rendezvous store on a free
    TCP port (chosen by the system) and broadcasts the port over MPI. This is how DDP gets its
    process group under ``mpiexec``.

    Args:
        backend: torch.distributed backend ("gloo", or "nccl" on GPUs).
        mpi_comm: the mpi4py communicator whose processes form the group; MPI.COMM_WORLD when
            None.
        master_addr: address of rank 0's host; $MASTER_ADDR, else 127.0.0.1 when every rank
            is on one host, else rank 0's host name.
        timeout: timeout of the store and of the group's collectives (30 minutes by default).
        abort_on_exception: make an uncaught exception on any rank abort the whole job, as
            ``ringcomm.init`` does (from here on, this set-up included: a rank whose gloo
            cannot start, say on an interface it lacks, ends the job at once instead of leaving
            the others waiting for it until ``timeout``).

    Raises:
        RuntimeError: torch.distributed is already initialized, or rank 0 could not start its
            store (raised on every rank).

    Example::

        init_process_group_from_mpi(backend="gloo")
        assert dist.get_rank() == MPI.COMM_WORLD.Get_rank()
    """
    from ringcomm.backends.mpi_process import import_mpi

    MPI = import_mpi()
    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized")
    rank, size = comm.Get_rank(), comm.Get_size()
    if abort_on_exception and size > 1:
        from ringcomm.backends.mpi_process import install_abort_hook

        install_abort_hook()
    timeout = _DEFAULT_TIMEOUT if timeout is None else timeout
    store = mpi_store(comm, master_addr, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    pause_at_exit()  # gloo's threads finish with PyTorch's tensors before the interpreter ends


def mpi_store(comm: Any, master_addr: str | None, timeout: datetime.timedelta,
              port: int = 0) -> Any:
    """The rendezvous store of the processes of MPI communicator ``comm``: rank 0's TCPStore
    on ``port`` (0: a free one the system picks, which the store already holds: no race),
    its port handed to the others over MPI, which connect to it (collective over ``comm``).

    Raises:
        RuntimeError: rank 0 could not start the store (on every rank).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    addr = _master_addr(comm, master_addr)
    store, error = None, None
    if rank == 0:
        try:
            store = dist.TCPStore(addr, port, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            port = store.port
        except Exception as err:  # handed to every rank below, so that none waits forever
            error = f"{type(err).__name__}: {err}"
    port, error = comm.bcast((port, error), root=0)
    if error is not None:
        raise RuntimeError(f"rank 0 could not start the rendezvous store on {addr}: {error}")
    if rank != 0:
        store = dist.TCPStore(addr, port, size, is_master=False, timeout=timeout)
    return store


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (its RANK/WORLD_SIZE are set)."""
    from ringcomm import launch_info

    return launch_info(os.environ).launcher == "torchrun"  # the variables, not a group


def init_process_group_from_env(backend: str = "gloo") -> None:
    """Set up the default process group from torchrun's environment (``env://``)."""
    dist.init_process_group(backend)


def init_process_group(backend: str = "gloo", mpi_comm: Any = None) -> None:
    """Set up the default process group however this job was launched; do nothing if it is.

    torchrun's environment when present, MPI's otherwise (see the functions above).

    Example::

        init_process_group()      # same script under torchrun or mpiexec
    """
    if dist.is_initialized():
        return
    if launched_by_torchrun():
        init_process_group_from_env(backend)
    else:
        init_process_group_from_mpi(backend, mpi_comm)


def new_communicator(backend: str = "auto", mpi_comm: Any = None) -> Communicator:
    """A ringcomm communicator over this job's processes, however it was launched.

    ``ringcomm.init(backend, mpi_comm=mpi_comm)``: under torchrun it runs over a gloo group of
    torch.distributed (initialized from torchrun's environment if need be), and it never
    returns a communicator smaller than the job.
    """
    from ringcomm import init

    return init(backend, mpi_comm=mpi_comm)
