"""Process-wide state of the Horovod-style surface: the communicator, rank and size, process
sets, reduction ops. Starting and stopping it (``hvd.init``, ``hvd.shutdown``) is
:mod:`ringcomm.torch.horovod._lifecycle`, which sits above the modules that read this state."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.torch._engine import Engine
from ringcomm.torch.horovod.unsupported import refusal

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
    "communicator_of",
    "context",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "register_set",
    "registered_sets",
    "root_in_set",
    "size",
    "unregister_set",
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
    __slots__ = ("comm", "engine", "next_set", "owned", "sets", "torch_group")

    def __init__(self) -> None:
        self.comm: Communicator | None = None
        self.engine: Engine | None = None
        self.owned = False
        self.sets: dict[int, tuple[ProcessSet, Communicator | None]] = {}
        self.next_set = 0
        #: torch.distributed's default group when init made ``comm`` (a weak reference),
        #: None where init was given its communicator or torch.distributed was not up.
        self.torch_group: Callable[[], Any] | None = None


#: The process's Horovod-style state (started and ended by :mod:`._lifecycle`).
STATE = _State()
#: Held while the state changes (init, shutdown, process sets).
STATE_LOCK = threading.Lock()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` not since)."""
    return STATE.comm is not None


def context() -> tuple[Communicator, Engine]:
    """The communicator and its engine.

    Raises:
        ValueError: ``init()`` has not been called (Horovod's error).
    """
    comm, engine = STATE.comm, STATE.engine
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
    return comm.local_rank, comm.local_size


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
    """A set of ranks that run collectives among themselves (Horovod's process set).

    Made from a list of global ranks, then registered on every rank with
    ``hvd.add_process_set`` (or ``hvd.init(process_sets=[...])``); pass it as
    ``process_set=`` to any collective or to DistributedOptimizer. Roots (``root_rank``) stay
    global ranks.

    Args:
        ranks_or_comm: the global ranks of the set (any order; kept sorted).

    Raises:
        ValueError: not a list of integers.
        NotImplementedError: an mpi4py communicator (give its ranks instead).

    Example::

        evens = hvd.add_process_set(range(0, hvd.size(), 2))
        if evens.included():
            total = hvd.allreduce(t, op=hvd.Sum, process_set=evens)
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Any) -> None:
        if hasattr(ranks_or_comm, "Get_rank"):
            raise refusal("process sets from an MPI communicator: give the list of its global "
                          "ranks instead")
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks, "
                             f"got {type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks_or_comm!r}")
        ranks.sort()
        self.ranks = ranks

    @classmethod
    def _global(cls) -> ProcessSet:
        ps = object.__new__(cls)
        ps.process_set_id = 0
        return ps

    def size(self) -> int | None:
        """Number of processes in the set (None if it is not registered)."""
        if self.process_set_id == 0:
            return size()
        return None if self.process_set_id is None else len(self.ranks or ())

    def rank(self) -> int | None:
        """This process's rank within the set (None if not registered or not a member)."""
        if self.process_set_id == 0:
            return rank()
        if self.process_set_id is None or not self.included():
            return None
        return (self.ranks or []).index(rank())

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None if it has no ranks yet)."""
        if self.process_set_id == 0:
            return True
        return None if self.ranks is None else rank() in self.ranks

    def __repr__(self) -> str:
        if self.process_set_id == 0:
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet._global()


def register_set(ps: ProcessSet, comm: Communicator | None) -> None:
    """Record a registered process set and its communicator (None on non-members)."""
    with STATE_LOCK:
        STATE.next_set += 1
        ps.process_set_id = STATE.next_set
        STATE.sets[ps.process_set_id] = (ps, comm)


def unregister_set(ps: ProcessSet) -> Communicator | None:
    """Forget a process set; return its communicator (None on non-members)."""
    with STATE_LOCK:
        comm = None
        if ps.process_set_id is not None:
            _, comm = STATE.sets.pop(ps.process_set_id, (ps, None))
        ps.process_set_id = None
        return comm


def registered_sets() -> list[ProcessSet]:
    """The process sets registered now (not the global one)."""
    return [ps for ps, _ in STATE.sets.values()]


def communicator_of(process_set: Any) -> Communicator:
    """The communicator a collective on ``process_set`` runs on.

    Raises:
        ValueError: not a registered process set, or this rank is not in it.
    """
    comm = communicator()
    if process_set is None or process_set is global_process_set:
        return comm
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    entry = STATE.sets.get(process_set.process_set_id)  # type: ignore[arg-type]
    if entry is None or entry[0] is not process_set:
        raise ValueError(f"{process_set} is not registered: use hvd.add_process_set first")
    if entry[1] is None:
        raise ValueError(f"rank {comm.rank} is not in {process_set}")
    return entry[1]


def check_process_set(process_set: Any) -> None:
    """Check that collectives on ``process_set`` can run here (see communicator_of)."""
    communicator_of(process_set)


def root_in_set(process_set: Any, root: int) -> int:
    """The rank within ``process_set`` of the global rank ``root``.

    Raises:
        ValueError: ``root`` is not in the set.
    """
    if process_set is None or process_set is global_process_set:
        return root
    ranks = process_set.ranks or []
    if root not in ranks:
        raise ValueError(f"root_rank {root} is not in {process_set}")
    return ranks.index(root)


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
