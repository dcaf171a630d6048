"""The backends ``ringcomm.init`` can start: one registry entry each, and the policy of "auto".

An entry names the backend, says what its communicator spans (for messages) and builds the
Communicator with every option at once. A new backend is its module (a Transport and a
Communicator subclass, under ``ringcomm/backends/``) plus one :func:`register` call here; the
choice of ``backend="auto"`` is :func:`choose_auto`.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.comm.settings import Settings
from ringcomm.core import launch
from ringcomm.core.launch import LaunchInfo

__all__ = ["REGISTRY", "Backend", "choose_auto", "communicator_options", "mpi_world_text",
           "register"]

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
    from ringcomm.backends.mpi import MPICommunicator

    return MPICommunicator(mpi_comm, timeout=settings.timeout,
                           **communicator_options(settings, startup_error))


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


def _mpi_world_size() -> int | None:
    """How many processes MPI.COMM_WORLD has (1 where MPI did not launch this one: then MPI is
    not started, see ``launch.mpi_launched``), or None without mpi4py."""
    if not launch.mpi_launched():
        return None if importlib.util.find_spec("mpi4py") is None else 1
    try:
        from ringcomm.backends.mpi_process import import_mpi

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


def choose_auto(mpi_comm: Any, info: LaunchInfo) -> tuple[str, str]:
    """The backend "auto" picks, and why; the same answer on every rank (a collective when
    the job has several processes).

    Under torchrun, or with torch.distributed's default group already initialized (and no
    MPI world numbering the same processes alike): NCCL where every rank can run it, else
    gloo over torch.distributed. Otherwise NCCL where every rank can run it, else MPI.
    """
    from ringcomm.backends import nccl

    if info.over_torch and mpi_comm is None:
        from ringcomm.backends.mpi_process import world_numbers_alike

        world = _mpi_world_size()
        if world != info.size or not world_numbers_alike(info.rank, info.size):
            _require_torch(info, world)
            why = (f"{info.describe()}, which is no MPI job ({mpi_world_text(world)}"
                   f"{'' if world != info.size else ', numbering them otherwise'})")
            if nccl.usable_everywhere(None):
                return "nccl", f"{why}; every rank has a GPU of its own and NCCL"
            return "gloo", f"{why}; not every rank has a GPU of its own and NCCL"
    if mpi_comm is not None or info.size > 1:
        if nccl.usable_everywhere(mpi_comm):
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
            "torch.distributed.init_process_group() first (under mpiexec: "
            "ringcomm.torch.process_group.init_process_group_from_mpi())")
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    except (ValueError, RuntimeError) as err:
        where = ", ".join(f"{k}={os.environ.get(k)!r}" for k in ("MASTER_ADDR", "MASTER_PORT"))
        raise RuntimeError(f"{info.describe()}, but torch.distributed could not start from "
                           f"torchrun's environment ({where}): {err}") from err
