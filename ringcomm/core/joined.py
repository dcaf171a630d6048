"""Telling a process that a launcher started from one that a process of the job started.

A process of a launched job that starts a program of its own (``subprocess.run`` of an
evaluation script, a helper that calls ``ringcomm.init()``) hands it the launcher's variables:
the child reads the rank and size of its parent and would join the job as that rank a second
time. Under torchrun it became a second rank 0 of torch.distributed's group and then waited in
MPI's start-up forever, spinning, after the job had ended; under horovodrun it ended the job or
hung in MPI's start-up; under MPICH's mpiexec its MPI start failed on the process manager's
connection (``PMI_FD``), which was its parent's and is closed in the child, with the MPI
library's own error stack.

A process that joined a torchrun or horovodrun job (the launchers whose jobs ringcomm
connects over a store) therefore sets :data:`JOINED` to its process id and the job's
variables; a process that finds it set by another process, for the same job, refuses to join
(:func:`refuse_inherited`). A launcher started inside a job (a torchrun of its own) gives its
processes variables of its own (another port, other ranks), so they may join theirs. Under
MPICH's mpiexec the process manager's connection tells: it is an open socket in every process
mpiexec starts, and not in one that such a process starts.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping

from ringcomm.core.launch import LaunchInfo, mpi_launched

__all__ = ["JOINED", "mark_joined", "refuse_inherited"]

#: Set in a process once it joined its torchrun or horovodrun job: "<process id> <job>".
JOINED = "RINGCOMM_JOINED"

#: The variables that name a job and the process's place in it, by launcher: equal in a
#: process that inherited them, different in a job of another launch (another port or server).
_JOB_VARIABLES: dict[str, tuple[str, ...]] = {
    "torchrun": ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE"),
    "horovodrun": ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
                   "HOROVOD_RANK", "HOROVOD_SIZE"),
}
#: What to remove from a process's environment to run it on its own, by launcher.
_TO_REMOVE = {"torchrun": "RANK, WORLD_SIZE and LOCAL_RANK",
              "horovodrun": "HOROVOD_RANK, HOROVOD_SIZE and HOROVOD_GLOO_RENDEZVOUS_ADDR",
              "mpich": "PMI_RANK, PMI_SIZE and PMI_FD"}


def _job(info: LaunchInfo, env: Mapping[str, str]) -> str | None:
    """The job this process's launcher variables name, or None for a launcher without
    variables of a job's own (an MPI launcher, torch.distributed's group, none)."""
    names = _JOB_VARIABLES.get(info.launcher)
    if names is None:
        return None
    return ",".join([info.launcher, *(f"{name}={env.get(name, '')}" for name in names)])


def mark_joined(info: LaunchInfo) -> None:
    """Record in this process's environment that it joined the job its launcher's variables
    name (for a torchrun or horovodrun job of several processes; nothing otherwise), so that
    a process it starts knows that it is not one of the job's."""
    job = _job(info, os.environ)
    if job is not None and info.size > 1:
        os.environ[JOINED] = f"{os.getpid()} {job}"


def refuse_inherited(info: LaunchInfo) -> None:
    """Raise where this process's launcher variables were inherited from a process of the job
    (see the module's docstring) instead of given by the launcher.

    Raises:
        RuntimeError: naming the variables, the process they came from where known, and how
            to run this process on its own.
    """
    job = _job(info, os.environ)
    if job is not None and info.size > 1:
        pid, _, joined_job = os.environ.get(JOINED, "").partition(" ")
        if pid and pid != str(os.getpid()) and joined_job == job:
            raise RuntimeError(
                f"{info.describe()}, inherited from process {pid}, which already joined the "
                f"job as rank {info.rank}: this process, started by it, is not one of the "
                f"job's. Remove {_TO_REMOVE[info.launcher]} from its environment to run it "
                "on its own")
    fd = _closed_pmi_fd()
    if fd is not None:
        raise RuntimeError(
            f"{info.describe()}, but PMI_FD={fd}, mpiexec's connection to this process, is "
            "not open here: this process was started by a process of the job (which handed "
            "it mpiexec's variables), not by mpiexec, and is not one of the job's. Remove "
            f"{_TO_REMOVE['mpich']} from its environment to run it on its own")


def _closed_pmi_fd() -> str | None:
    """``PMI_FD`` where an MPI launcher (MPICH's Hydra) set it for this process but it names
    no open socket here, before MPI started (MPI's start uses it); else None."""
    fd = os.environ.get("PMI_FD")
    if fd is None or "mpi4py.MPI" in sys.modules or not mpi_launched() or not fd.isdigit():
        return None
    try:
        return None if stat.S_ISSOCK(os.fstat(int(fd)).st_mode) else fd
    except OSError:
        return fd
