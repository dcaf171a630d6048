"""Process-wide state of the Horovod-style surface: init, rank and size, reduction ops."""

from __future__ import annotations

import enum
import threading
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.torch._engine import Engine, engine_for
from ringcomm.torch.unsupported import NO_PROCESS_SETS, refusal

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "check_process_set",
    "communicator",
    "context",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (``hvd.Average``, ``hvd.Sum``, ...), equal to Horovod's values."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT

_NOT_INITIALIZED = "ringcomm.torch has not been initialized; use hvd.init()"


class _State:
    __slots__ = ("comm", "engine", "owned")

    def __init__(self) -> None:
        self.comm: Communicator | None = None
        self.engine: Engine | None = None
        self.owned = False


_STATE = _State()
_LOCK = threading.Lock()


def init(comm: Any = None, process_sets: Any = None, *, backend: str = "auto") -> None:
    """Start ringcomm for this process (``hvd.init()``); a second call does nothing.

    Under ``mpiexec`` the communicator spans MPI's processes; under ``torchrun`` it runs over a
    gloo group of torch.distributed (initialized from torchrun's environment if need be).

    Args:
        comm: an mpi4py communicator to run on, or a ringcomm Communicator; the whole job
            when None.
        process_sets: not supported (raises when given).
        backend: "auto", "mpi" or "nccl", as for :func:`ringcomm.init`.

    Raises:
        NotImplementedError: ``process_sets`` given, or ``comm`` is a list of ranks.

    Example::

        import ringcomm.torch as hvd
        hvd.init()
        print(hvd.rank(), hvd.size(), hvd.local_rank())
    """
    if process_sets is not None or isinstance(comm, (list, tuple)):
        raise refusal(NO_PROCESS_SETS)
    with _LOCK:
        if _STATE.comm is not None and not _STATE.comm.closed:
            return
        if isinstance(comm, Communicator):
            _STATE.comm, _STATE.owned = comm, False
        else:
            from ringcomm.torch.process_group import new_communicator

            _STATE.comm, _STATE.owned = new_communicator(backend=backend, mpi_comm=comm), True
        _STATE.engine = engine_for(_STATE.comm)
        from ringcomm.torch._negotiate import coordinator_for

        coordinator_for(_STATE.comm)  # collective: its control channel is split here


def shutdown() -> None:
    """Shut down on every rank: operations still pending fail; release the communicator.

    As in Horovod, one rank's shutdown is the job's: every rank's background thread stops in
    the same negotiation cycle, and operations submitted afterwards raise RuntimeError.
    """
    from ringcomm.torch._negotiate import forget

    with _LOCK:
        if _STATE.comm is not None:
            forget(_STATE.comm)
        if _STATE.engine is not None:
            _STATE.engine.close()
        if _STATE.comm is not None and _STATE.owned:
            _STATE.comm.close()
        _STATE.comm, _STATE.engine, _STATE.owned = None, None, False


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` not since)."""
    return _STATE.comm is not None


def context() -> tuple[Communicator, Engine]:
    """The communicator and its engine.

    Raises:
        ValueError: ``init()`` has not been called (Horovod's error).
    """
    comm, engine = _STATE.comm, _STATE.engine
    if comm is None or engine is None:
        raise ValueError(_NOT_INITIALIZED)
    return comm, engine


def communicator() -> Communicator:
    """The communicator ``init()`` set up.

    Raises:
        ValueError: ``init()`` has not been called.
    """
    return context()[0]


def size() -> int:
    """Number of processes in the job."""
    return communicator().size


def rank() -> int:
    """This process's rank, 0 <= rank < size()."""
    return communicator().rank


def _local() -> tuple[int, int]:
    comm = communicator()
    if hasattr(comm, "local_rank") and hasattr(comm, "local_size"):
        return int(comm.local_rank), int(comm.local_size)
    from ringcomm import launch_info

    info = launch_info()
    return info.local_rank, info.local_size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _local()[0]


def local_size() -> int:
    """Number of processes on this host."""
    return _local()[1]


def cross_size() -> int:
    """Number of hosts (assuming the same number of processes on each)."""
    return max(1, size() // local_size())


def cross_rank() -> int:
    """Index of this process's host (assuming the same number of processes on each)."""
    return rank() // local_size()


class ProcessSet:
    """Horovod's process set. Only the global set (every rank) exists here.

    Raises:
        NotImplementedError: when constructed; use ``hvd.global_process_set``.
    """

    process_set_id = 0

    def __init__(self, ranks_or_comm: Any = None) -> None:
        raise refusal(NO_PROCESS_SETS)

    @classmethod
    def _global(cls) -> ProcessSet:
        return object.__new__(cls)

    def size(self) -> int:
        """Number of processes in the set (the whole job)."""
        return size()

    def rank(self) -> int:
        """This process's rank in the set."""
        return rank()

    def included(self) -> bool:
        """Whether this process belongs to the set (always)."""
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet._global()


def check_process_set(process_set: Any) -> None:
    """Accept the global process set (or None) only.

    Raises:
        NotImplementedError: any other process set.
    """
    if process_set is not None and process_set is not global_process_set:
        raise refusal(NO_PROCESS_SETS)


# --------------------------------------------------------------- what this build can do
def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (what the background thread relies on)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    """Whether mpi4py is importable."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """Whether the communicator runs over MPI."""
    return communicator().backend == "mpi"


def gloo_built() -> bool:
    """Whether torch.distributed has gloo (the torchrun path and DDP's group use it)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Whether the communicator runs over a gloo group (jobs started by torchrun)."""
    return communicator().backend == "gloo"


def nccl_built() -> bool:
    """Whether this process can use the NCCL backend."""
    from ringcomm import nccl_available

    return nccl_available()


def cuda_built() -> bool:
    """Whether torch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def rocm_built() -> bool:
    """False: ringcomm has no ROCm path."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes (assumed, as cross_rank does)."""
    return size() % local_size() == 0
