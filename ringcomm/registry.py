"""The backends ``ringcomm.init`` can start: one registry entry each, and the policy of "auto".

An entry names the backend, says what its communicator spans (for messages) and builds the
Communicator with every option at once. A new backend is its module (a Transport and a
Communicator subclass, under ``ringcomm/backends/``) plus one :func:`register` call here; the
choice of ``backend="auto"`` is :func:`choose_auto`.
"""

from __future__ import annotations

import datetime
import importlib.util
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.comm.settings import Settings
from ringcomm.core.joined import mark_joined, refuse_inherited
from ringcomm.core.launch import TORCHRUN_WORKER, LaunchInfo, mpi_launched
from ringcomm.core.restarts import agent_store_shared, attempt_prefix
from ringcomm.core.types import DEFAULT_TIMEOUT_S

__all__ = ["REGISTRY", "Backend", "choose_auto", "communicator_options",
           "join_mpi_over_horovodrun", "join_mpi_over_torch", "mpi_world_text", "register"]

#: What builds a backend's Communicator: (mpi_comm, settings, launch, startup error).
Builder = Callable[[Any, Settings, LaunchInfo, Exception | None], Communicator]


@dataclass(frozen=True)
class Backend:
    """One backend ``init`` can start.

    Attributes:
        name: what ``init(backend=...)`` and ``comm.backend`` call it.
        spans: what its communicator spans, as messages name it ("MPI.COMM_WORLD").
        build: makes the Communicator, with every option (collective; it agrees on them).
    """

    name: str
    spans: str
    build: Builder


#: Every backend by name, in the order ``init``'s messages list them.
REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Add ``backend`` to the registry (replacing one of the same name)."""
    REGISTRY[backend.name] = backend


def communicator_options(settings: Settings, startup_error: Exception | None
                         ) -> dict[str, Any]:
    """The Communicator's own options, from ``settings`` (``ringcomm.comm.settings.read``'s)."""
    return {"consistency_check": settings.consistency_check,
            "segment_bytes": settings.segment_bytes, "inline_bytes": settings.inline_bytes,
            "algorithm": settings.algorithm, "topology": settings.topology,
            "startup_error": startup_error}


def _build_mpi(mpi_comm: Any, settings: Settings, info: LaunchInfo,
               startup_error: Exception | None) -> Communicator:
    renumbered = None
    if info.over_torch and mpi_comm is None and info.size > 1:
        from ringcomm.backends.mpi_process import mpi_world_is_job

        if not mpi_world_is_job():
            _require_torch(info, _mpi_world_size())
            why = join_mpi_over_torch(info, settings.timeout)
            if why is not None:
                raise RuntimeError(
                    f"{info.describe()} but MPI cannot start over its processes ({why}): "
                    f"launch with mpiexec -n {info.size}, or use backend='auto' or 'gloo' "
                    "under torchrun")
        else:
            mpi_comm = renumbered = _numbered_as_torch(info, settings.timeout)
    from ringcomm.backends.mpi import MPICommunicator

    try:
        return MPICommunicator(mpi_comm, timeout=settings.timeout,
                               **communicator_options(settings, startup_error))
    finally:
        if renumbered is not None:
            renumbered.Free()  # the communicator runs on duplicates of it


def _numbered_as_torch(info: LaunchInfo, timeout: float) -> Any:
    """MPI's world numbered as torch.distributed's default group numbers its processes, where
    they differ (a group initialized with ranks of its own choosing under mpiexec), else None
    (collective over MPI's world): ringcomm's rank r is torch's rank r, so that a broadcast from
    root 0 sends what torch calls rank 0's data."""
    from ringcomm.backends.mpi_process import import_mpi, world_numbers_alike

    # Processes that all give one rank (torchrun's variables left in an mpiexec job's
    # environment, inherited alike) keep MPI's order: Split orders equal keys by MPI rank.
    if _mpi_world_size() != info.size or world_numbers_alike(info.rank, info.size, timeout,
                                                             refuse_duplicates=False):
        return None
    return import_mpi().COMM_WORLD.Split(0, info.rank)


def _build_nccl(mpi_comm: Any, settings: Settings, info: LaunchInfo,
                startup_error: Exception | None) -> Communicator:
    from ringcomm.backends.nccl import NCCLCommunicator

    return NCCLCommunicator(mpi_comm=mpi_comm, timeout=settings.timeout,
                            **communicator_options(settings, startup_error))


def _build_gloo(mpi_comm: Any, settings: Settings, info: LaunchInfo,
                startup_error: Exception | None) -> Communicator:
    _start_torch_distributed(info, settings.timeout)
    from ringcomm.backends.gloo import TorchDistCommunicator

    return TorchDistCommunicator(timeout=settings.timeout,
                                 **communicator_options(settings, startup_error))


register(Backend("mpi", "MPI.COMM_WORLD", _build_mpi))
register(Backend("nccl", "the NCCL communicator", _build_nccl))
register(Backend("gloo", "torch.distributed's default group", _build_gloo))


def agree_backend(backend: str, mpi_comm: Any, info: LaunchInfo, timeout: float) -> None:
    """Agree on the ``backend`` asked for: a collective before any backend's own, so that
    ranks asking for different ones (whose start-ups make different collectives) raise the
    same error instead of reading each other's messages, or waiting in a start-up for a rank
    that is in another. Over MPI where every backend but gloo would start MPI first (an MPI
    launch, or ``mpi_comm`` given); under torchrun, or with torch.distributed's default group
    up without an MPI launch, over that group's store (:func:`_names_over_torch`).

    Raises:
        ArgumentMismatchError: the ranks asked for different backends (on every rank).
        CollectiveTimeoutError: a rank never came within ``timeout`` (over MPI the job ends
            first, ``MPI_Abort``, as at every timeout of the MPI backend).

    Over MPI, a rank that asks for gloo takes no part (its processes may form a
    torch.distributed group of some of MPI's ranks, without MPI): one that asks for gloo where
    the others ask for another backend leaves them in MPI's start-up (a documented limit).
    An unknown backend, the same on every rank, is agreed on (``init`` then raises ValueError
    on every rank).
    """
    from ringcomm.backends.mpi_process import gather_names, import_mpi, mpi_world_is_job

    # torchrun's variables in an MPI launch (left in the environment) are agreed on over MPI
    # below, with the launcher each rank read: where only some ranks have them, the ranks'
    # start-ups part (one numbers MPI's ranks by RANK, another gathers the backend's name).
    # (Not with torch.distributed's group up: whether its ranks read torchrun's variables as
    # describing it may differ between them; they all return below, as they always did.)
    stale = (mpi_comm is None and info.launcher == "torchrun" and mpi_launched()
             and not _torch_group_up())
    if mpi_comm is None and info.over_torch and not stale:
        if mpi_world_is_job():  # an MPI launch (or an earlier join): as it always was
            return
        names = _names_over_torch(backend, info, timeout)
    else:
        gloo_apart = backend == "gloo" and info.launcher != "horovodrun"  # MPI is the job's
        if gloo_apart or (mpi_comm is None and not mpi_world_is_job()):
            return
        try:
            comm = mpi_comm if mpi_comm is not None else import_mpi().COMM_WORLD
        except RuntimeError:  # no mpi4py: the backend says so as it starts
            return
        if comm.Get_size() == 1:
            return
        which = info.launcher if mpi_comm is None else "mpi_comm"
        both = [name.partition("|") for name in gather_names(comm, f"{which}|{backend}",
                                                               timeout, "init")]
        _refuse_launchers_differing([launcher for launcher, _, _ in both])
        names = [name for _, _, name in both]
    if len(set(names)) > 1:
        from ringcomm.comm._mismatch import rank_groups
        from ringcomm.core.types import ArgumentMismatchError

        raise ArgumentMismatchError(
            f"init: backend differs between ranks: {rank_groups(names)}. Every rank must ask "
            "for the same backend", kind="init", ranks=tuple(range(len(names))),
            differences={"backend": tuple(names)})


def _torch_group_up() -> bool:
    """Whether torch.distributed's default group is initialized (PyTorch not imported: no)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except (AttributeError, RuntimeError):
        return False


def _refuse_launchers_differing(launchers: list[str]) -> None:
    """Raise where the ranks of an MPI job read different launchers' variables (``launchers``,
    by MPI rank): some ranks have variables the others lack, and their start-ups would part."""
    if len(set(launchers)) < 2:
        return
    from ringcomm.comm._mismatch import rank_groups
    from ringcomm.core.types import ArgumentMismatchError

    raise ArgumentMismatchError(
        f"init: the ranks of this MPI job read different launchers' variables: "
        f"{rank_groups(launchers)}. Some processes have variables the others lack (RANK and "
        "WORLD_SIZE, HOROVOD_RANK and HOROVOD_SIZE, OMPI_COMM_WORLD_*, ... left in their "
        "environment, or set for some ranks alone): unset them, or give every rank the same",
        kind="init", ranks=tuple(range(len(launchers))), differences={"launcher": tuple(launchers)})


def _names_over_torch(backend: str, info: LaunchInfo, timeout: float) -> list[str]:
    """The backend every rank asked for, under torchrun or with torch.distributed's default
    group up, where MPI's world is not the job (under an MPI launch nothing is compared).

    With the group up, over its store. Under torchrun's agent (its store serves every worker)
    with the group not up, over the agent's store before any backend starts: a rank asking for
    "nccl" (whose rendezvous takes the store alone) and one asking for another backend (which
    starts the group) would each wait for the other in a start-up. Elsewhere (a torchrun-style
    environment without the agent, whose rank 0 hosts the store) every backend starts the
    group first (gloo, from the environment) and compares over its store, but "nccl", which is
    not compared there. A list of one where nothing is compared.
    """
    try:
        import torch.distributed as dist
    except ImportError:  # the backend says so as it starts
        return [backend]
    if info.size == 1:
        return [backend]
    if not dist.is_initialized() and info.launcher == "torchrun" and agent_store_shared():
        store = _agent_store(info, timeout)
    elif backend == "nccl" and not dist.is_initialized():
        return [backend]
    else:
        _start_torch_distributed(info, timeout)
        default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        if default_store is None:
            return [backend]
        store = default_store()
    from ringcomm.backends.store_wait import allgather

    # Every rank of the job calls init in the same order, so each call's key space is the
    # same on every rank (and used once: a later init, after close, takes the next).
    everyone = allgather(store, f"ringcomm/backend{next(_AGREEMENTS)}/", info.rank, info.size,
                         str(backend).encode(), timeout, "init's agreement on the backend")
    return [name.decode() for name in everyone]


def _agent_store(info: LaunchInfo, timeout: float) -> Any:
    """A client of torchrun's agent store, under this attempt's prefix where the store holds an
    earlier attempt's keys (``ringcomm.core.restarts``)."""
    import torch.distributed as dist

    agents = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           info.size, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout))
    prefix = attempt_prefix()
    return dist.PrefixStore(prefix, agents) if prefix else agents


#: How many agreements on the backend this process made over torch.distributed's store.
_AGREEMENTS = itertools.count()


def _mpi_world_size() -> int | None:
    """How many processes MPI.COMM_WORLD has (1 where MPI did not launch this one and it did not
    join torchrun's processes: then MPI is not started, see ``launch.mpi_launched``), or None
    without mpi4py."""
    from ringcomm.backends.mpi_process import import_mpi, mpi_world_is_job

    if not mpi_world_is_job():
        return None if importlib.util.find_spec("mpi4py") is None else 1
    try:
        return int(import_mpi().COMM_WORLD.Get_size())
    except RuntimeError:
        return None


def mpi_world_text(world: int | None) -> str:
    """``world`` (MPI.COMM_WORLD's size, None without mpi4py) as messages say it."""
    return ("mpi4py is not installed" if world is None
            else f"MPI.COMM_WORLD has {world} process{'es' if world != 1 else ''}")


def _require_torch(info: LaunchInfo, world: int | None) -> None:
    """Raise if PyTorch, which connects torchrun's processes, is missing."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"{info.describe()} but {mpi_world_text(world)}; ringcomm connects torchrun's "
            "processes over torch.distributed (gloo, or NCCL over its store), and PyTorch is "
            f"not installed: pip install 'ringcomm[torch]', or launch with mpiexec -n "
            f"{info.size} ({err})") from err


def choose_auto(mpi_comm: Any, info: LaunchInfo, timeout: float = DEFAULT_TIMEOUT_S
                ) -> tuple[str, str]:
    """The backend "auto" picks, and why; the same answer on every rank (a collective when
    the job has several processes).

    Under torchrun, or with torch.distributed's default group already initialized (and no
    MPI world numbering the same processes alike), over that group's store (started from
    torchrun's environment, gloo, where it is not up): NCCL where every rank can run it, else MPI
    where every rank can join one MPI world over torch.distributed's store
    (:func:`join_mpi_over_torch`), else gloo over torch.distributed. Otherwise NCCL where
    every rank can run it, else MPI. ``timeout``: how long MPI's start may wait for a rank.
    """
    from ringcomm.backends import nccl

    if info.over_torch and mpi_comm is None:
        from ringcomm.backends.mpi_process import world_numbers_alike

        world = _mpi_world_size()
        # Collective over MPI's world where it holds the job, or part of it (see there).
        if not world_numbers_alike(info.rank, info.size, timeout,
                                   from_variables=info.launcher == "torchrun"):
            _require_torch(info, world)
            # Every question below goes over torch.distributed's store: one store, the default
            # group's. Where rank 0 hosts it (no torchrun agent: torch.multiprocessing.spawn
            # with MASTER_ADDR and MASTER_PORT, Lightning's launcher), a store of ringcomm's
            # own and then the group's, one after the other on MASTER_PORT, let a rank reach
            # the first as rank 0 closed it (a connection reset, in 3 of 5 runs at 3 ranks).
            _start_torch_distributed(info, timeout)
            why = (f"{info.describe()}, which is no MPI job ({mpi_world_text(world)}"
                   f"{'' if world != info.size else ', numbering them otherwise'})")
            if nccl.usable_everywhere(None, timeout):
                return "nccl", f"{why}; every rank has a GPU of its own and NCCL"
            cannot = join_mpi_over_torch(info, timeout)
            if cannot is None:
                return "mpi", (f"{info.describe()}: not every rank has a GPU of its own and "
                               "NCCL, and its processes joined one MPI world over "
                               "ringcomm's PMI server")
            return "gloo", (f"{why}; not every rank has a GPU of its own and NCCL, and MPI "
                            f"cannot join them: {cannot}")
    if mpi_comm is not None or info.size > 1:
        if nccl.usable_everywhere(mpi_comm, timeout):
            return "nccl", "every rank has a GPU of its own and NCCL"
        return "mpi", "not every rank has a GPU of its own and NCCL"
    if nccl.usable():
        return "nccl", "one process, with a GPU and NCCL"
    return "mpi", "one process, without a GPU or NCCL"


def _start_torch_distributed(info: LaunchInfo, timeout: float) -> None:
    """Initialize torch.distributed's default group from torchrun's environment, if need be.

    Raises:
        RuntimeError: PyTorch is missing, or torch.distributed is not initialized and cannot
            be from the environment.
    """
    try:
        import torch.distributed as dist
    except ImportError as err:
        raise RuntimeError("backend 'gloo' runs over torch.distributed, which needs PyTorch: "
                           f"pip install 'ringcomm[torch]' ({err})") from err
    if dist.is_initialized():
        return
    if info.launcher != "torchrun":
        raise RuntimeError(
            "backend 'gloo' runs over torch.distributed, which is not initialized, and this "
            "process has no torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; "
            f"found {info.describe()}): launch with torchrun, or call "
            "torch.distributed.init_process_group() first (under mpiexec or horovodrun: "
            "ringcomm.torch.process_group.init_process_group_from_mpi())")
    where = ", ".join(f"{k}={os.environ.get(k)!r}" for k in ("MASTER_ADDR", "MASTER_PORT"))
    after = min(SLOW_START_S, timeout / 2)
    # A warning, not a log record (silent unless asked): nothing else says why it waits.
    waiting = threading.Timer(after, warnings.warn, (
        f"{info.describe()}: torch.distributed has waited {after:.0f} s for the job's other "
        f"processes at {where} (up to the timeout, {timeout:.0f} s){_stale_hint()}",
        RuntimeWarning))
    waiting.daemon = True
    waiting.start()
    try:
        _init_default_group(info, datetime.timedelta(seconds=timeout))
    except (ValueError, RuntimeError) as err:
        raise RuntimeError(f"{info.describe()}, but torch.distributed could not start from "
                           f"torchrun's environment ({where}){_stale_hint()}: {err}") from err
    finally:
        waiting.cancel()


#: Seconds torch.distributed's start from torchrun's environment waits before a warning says
#: so (half the timeout where that is shorter).
SLOW_START_S = 60.0


def _stale_hint() -> str:
    """Where no torchrun agent started this process: that its variables may be stale."""
    if os.environ.get(TORCHRUN_WORKER):
        return ""
    return ("; no torchrun agent started this process (no TORCHELASTIC_RUN_ID), so RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT may be left in its environment by an "
            "earlier launch")


def _init_default_group(info: LaunchInfo, timeout: datetime.timedelta) -> None:
    """torch.distributed's default group (gloo) from torchrun's environment; in a restarted
    job whose store still holds the earlier attempt's keys, under a prefix of this attempt's
    own (``ringcomm.core.restarts``: the store is then the torchrun agent's)."""
    import torch.distributed as dist

    if not attempt_prefix():
        dist.init_process_group("gloo", timeout=timeout)
        return
    dist.init_process_group("gloo", store=_agent_store(info, timeout.total_seconds()),
                            rank=info.rank, world_size=info.size, timeout=timeout)


def join_mpi_over_torch(info: LaunchInfo, timeout: float) -> str | None:
    """Start MPI in every process of a torchrun job (or of torch.distributed's default group)
    as one world, over torch.distributed's store (``ringcomm.backends.mpi_join``); collective.

    Returns:
        None once MPI's world is the job's processes, numbered as torch.distributed numbers
        them; else why not, the same on every rank (MPI is then started nowhere).
    """
    _start_torch_distributed(info, timeout)
    import torch.distributed as dist

    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None:
        return "this PyTorch gives no access to torch.distributed's store"
    from ringcomm.backends.mpi_join import join

    return join(default_store(), dist.get_rank(), dist.get_world_size(), timeout)


def join_mpi_over_horovodrun(info: LaunchInfo, timeout: float) -> None:
    """Start MPI in every process that horovodrun's own launcher started (no MPI: its "Gloo"
    mode) as one world, numbered as horovodrun numbers them, over horovodrun's rendezvous
    server (``ringcomm.backends.mpi_join``); collective. Every backend then starts as under
    mpiexec. Nothing is done in a process not started so, in one of a job of one, or where
    MPI's world already is the job.

    Raises:
        RuntimeError: horovodrun's elastic mode (not supported), or MPI cannot start over
            the job's processes (the same reason on every rank: no mpi4py over MPICH, ...).
        CollectiveTimeoutError: a process did not come within ``timeout`` seconds.
        ConnectionError: the rendezvous server does not answer.
    """
    from ringcomm.backends.mpi_process import world_joined
    from ringcomm.core.launch import horovodrun_rendezvous, mpi_launcher_variables

    where = horovodrun_rendezvous()
    if info.launcher != "horovodrun" or where is None or info.size == 1 or world_joined():
        return
    refuse_inherited(info)  # a process that one of the job's started (core/joined.py)
    if os.environ.get("HOROVOD_ELASTIC", "") not in ("", "0"):
        raise RuntimeError(
            f"{info.describe()} in elastic mode (HOROVOD_ELASTIC=1: --min-np, --max-np or a "
            "host discovery script), which ringcomm does not support: its jobs keep the ranks "
            "they start with (hvd.elastic is refused). Run horovodrun with a fixed -np, or "
            "launch with mpiexec or torchrun")
    from ringcomm.backends.mpi_join import join
    from ringcomm.backends.rendezvous_http import RendezvousStore

    host, port = where
    try:
        why = join(RendezvousStore(host, port), info.rank, info.size, timeout, always=True,
                   toward=host)
    except ConnectionError as err:
        also = mpi_launcher_variables()
        if also is None:
            raise
        raise ConnectionError(
            f"{err}. This process also has an MPI launcher's variables ({also}): horovodrun's "
            "(HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_GLOO_RENDEZVOUS_ADDR and _PORT) may have been "
            "left in the environment by an earlier launch, which every process of an mpiexec "
            "job inherits alike; unset them before mpiexec, or launch with horovodrun") from err
    if why is None:
        mark_joined(info)
        return
    raise RuntimeError(
        f"{info.describe()}: ringcomm runs horovodrun's processes as one MPI world, "
        f"started over horovodrun's rendezvous server at {host}:{port}, and MPI cannot "
        f"start over them ({why}): install mpi4py over MPICH (pip install mpich mpi4py), "
        f"or launch with mpiexec -n {info.size} or torchrun")
