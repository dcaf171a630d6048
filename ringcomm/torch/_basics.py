"""Process-wide state of the Horovod-style surface: init, rank and size, reduction ops."""

from __future__ import annotations

import enum
import functools
import threading
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.comm.env import env, env_flag
from ringcomm.comm.settings import agree_at_start
from ringcomm.torch._engine import Engine, engine_for
from ringcomm.torch.unsupported import refusal

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
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "register_set",
    "registered_sets",
    "root_in_set",
    "shutdown",
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
    __slots__ = ("comm", "engine", "next_set", "owned", "sets")

    def __init__(self) -> None:
        self.comm: Communicator | None = None
        self.engine: Engine | None = None
        self.owned = False
        self.sets: dict[int, tuple[ProcessSet, Communicator | None]] = {}
        self.next_set = 0


_STATE = _State()
_LOCK = threading.Lock()


def init(comm: Any = None, process_sets: Any = None, *, backend: str = "auto") -> None:
    """Start ringcomm for this process (``hvd.init()``); a second call does nothing.

    Under ``mpiexec`` the communicator spans MPI's processes; under ``torchrun`` it runs over a
    gloo group of torch.distributed (initialized from torchrun's environment if need be).

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
    with _LOCK:
        if _STATE.comm is not None and not _STATE.comm.closed:
            return
        # Read without raising: a bad value on one rank is raised on every rank once the
        # communicator is up (raised here alone, it would leave the others waiting for it).
        settings, problem = _horovod_settings()
        if isinstance(comm, Communicator):
            _STATE.comm, _STATE.owned = comm, False
        else:
            from ringcomm.torch.process_group import new_communicator

            _STATE.comm, _STATE.owned = new_communicator(backend=backend, mpi_comm=comm), True
        try:
            _start(settings, problem)
        except BaseException:
            if _STATE.owned:
                _STATE.comm.close()
            _STATE.comm, _STATE.engine = None, None  # not half started: init may run again
            raise
    if process_sets is not None and process_sets != "dynamic":
        from ringcomm.torch.process_sets import add_process_set

        for ps in process_sets:
            add_process_set(ps)


def _start(settings: dict[str, Any], problem: Exception | None) -> None:
    """Agree on the Horovod settings over the new communicator, then start the engine, the
    negotiation and the timeline (collective)."""
    agree_at_start(_STATE.comm.transport, settings, problem)
    if settings["HOROVOD_HIERARCHICAL_ALLREDUCE"] is not None and _STATE.owned:
        _STATE.comm.algorithm = settings["HOROVOD_HIERARCHICAL_ALLREDUCE"]
    _STATE.engine = engine_for(_STATE.comm)
    from ringcomm.torch._negotiate import coordinator_for

    coordinator_for(_STATE.comm)  # collective: its control channel is split here
    from ringcomm.torch.timeline import start_from_env

    start_from_env(_STATE.comm.rank)  # HOROVOD_TIMELINE


def _horovod_settings() -> tuple[dict[str, Any], Exception | None]:
    """The Horovod variables that change what the ranks exchange, checked (None for a bad
    one), and the first error. The timing variables are checked too, not compared: their
    values may differ between ranks, but a bad one must fail every rank."""
    from ringcomm.torch._control import cache_capacity
    from ringcomm.torch._fusion import fusion_threshold
    from ringcomm.torch._negotiate import env_float

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
    from ringcomm.torch import timeline
    from ringcomm.torch._negotiate import forget

    if timeline.active() is not None:
        timeline.stop_timeline()
    for ps in registered_sets():
        sub = unregister_set(ps)
        if sub is not None:
            forget(sub)
            sub.close()
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
    with _LOCK:
        _STATE.next_set += 1
        ps.process_set_id = _STATE.next_set
        _STATE.sets[ps.process_set_id] = (ps, comm)


def unregister_set(ps: ProcessSet) -> Communicator | None:
    """Forget a process set; return its communicator (None on non-members)."""
    with _LOCK:
        _, comm = _STATE.sets.pop(ps.process_set_id, (None, None))
        ps.process_set_id = None
        return comm


def registered_sets() -> list[ProcessSet]:
    """The process sets registered now (not the global one)."""
    return [ps for ps, _ in _STATE.sets.values()]


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
    entry = _STATE.sets.get(process_set.process_set_id)  # type: ignore[arg-type]
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
