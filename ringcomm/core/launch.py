"""Rank, size and local rank of this process, read from what the launcher put in the environment.

Launchers covered: MPICH's Hydra and Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``),
Open MPI's mpirun (``OMPI_COMM_WORLD_*``), MVAPICH (``MV2_COMM_WORLD_*``), PMIx-based launchers
(``PMIX_RANK``), Slurm's srun (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``),
torchrun / ``python -m torch.distributed.run`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...),
Horovod's ``horovodrun`` without MPI (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ... and its rendezvous
server, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``: ``ringcomm.init`` starts MPI over it), and
PyTorch Lightning's own launcher (``WORLD_SIZE``, ``LOCAL_RANK`` and ``NODE_RANK`` without ``RANK``:
the global rank is known only once Lightning has initialized torch.distributed). The environment
is read before any communicator exists, so that a process can pick its GPU before NCCL or CUDA
start, and so that ``ringcomm.init`` can check that its communicator spans the job.

Where torch.distributed's default group is already initialized (by Lightning, Accelerate, or
the script itself), that group is the job: its rank and size win over every variable
(torchrun's are kept where they describe the same group).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["HOROVODRUN_RENDEZVOUS", "MPI_LAUNCHER_VARIABLES", "TORCHRUN_WORKER", "LaunchInfo",
           "detect", "horovodrun_rendezvous", "mpi_launched", "mpi_launcher_variables",
           "process_manager_connected"]

#: Set by torchrun's agent in each worker it starts (and by nothing else).
TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"
#: Set by horovodrun's own launcher (its "Gloo" mode: no MPI) in each process it starts: the
#: address and port of its rendezvous server, an HTTP key-value store.
HOROVODRUN_RENDEZVOUS = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")
#: What MPI launchers set in a process for its MPI library (process-manager connections),
#: which a process started by torchrun under one inherits from the agent.
MPI_LAUNCHER_VARIABLES = ("PMI_FD", "PMI_RANK", "PMI_SIZE", "PMI_PORT", "PMI_ID",
                          "PMI_SUBVERSION", "PMI_VERSION", "PMI_HOSTNAME")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher described it.

    Attributes:
        rank: global rank, 0 <= rank < size.
        size: number of processes in the job.
        local_rank: rank among the processes on this host.
        local_size: number of processes on this host.
        launcher: which launcher's variables were found: "torchrun", "openmpi", "mpich",
            "mvapich", "pmix", "slurm", "horovodrun" (horovodrun without MPI: its
            processes are no MPI job until ``ringcomm.init`` starts one over its rendezvous
            server), "lightning" (Lightning's launcher: no ``RANK``, so
            ``rank`` is a guess, see ``rank_known``), "torch.distributed" (a default group
            already initialized, whatever started the processes), or "none" for a process
            started on its own.
        size_variable: the environment variable ``size`` was read from ("WORLD_SIZE",
            "PMI_SIZE", ...); empty for "none" and "torch.distributed". Not compared by ``==``.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str
    size_variable: str = field(default="", compare=False)

    @property
    def rank_known(self) -> bool:
        """Whether ``rank`` is the process's global rank (Lightning's launcher sets none)."""
        return self.launcher != "lightning"

    @property
    def over_torch(self) -> bool:
        """Whether torch.distributed connects the processes: torchrun's environment (its
        store), or a default group already initialized."""
        return self.launcher in ("torchrun", "torch.distributed")

    def describe(self) -> str:
        """Say what the launcher's variables say, as in ``"WORLD_SIZE=2 (torchrun)"``."""
        if self.launcher == "none":
            return "no launcher variables (a process started on its own, size 1)"
        if self.launcher == "torch.distributed":
            return (f"torch.distributed's default group has {self.size} "
                    f"process{'es' if self.size != 1 else ''}")
        if self.launcher == "lightning":
            return (f"{self.size_variable}={self.size} without RANK (PyTorch Lightning's "
                    "launcher)")
        return f"{self.size_variable}={self.size} ({self.launcher})"

    def mpi_hint(self) -> str:
        """How to make MPI's world the job this MPI launcher started, where each process came
        up as an MPI world of its own (mpi4py's MPI is not the launcher's, or srun's PMI
        plugin does not reach it)."""
        if self.launcher == "slurm":
            return ("srun's PMI does not reach mpi4py's MPI library: pick the matching plugin "
                    "(srun --mpi=pmi2 for the mpich wheel, or --mpi=pmix; srun --mpi=list shows "
                    "them), or start the ranks with that MPI's mpiexec inside the allocation")
        return ("each process is an MPI world of its own, so mpi4py's MPI library is not the "
                "one whose launcher started the job: launch with the mpiexec of mpi4py's MPI "
                "(.venv/bin/mpiexec for the mpich wheel), or install mpi4py against the "
                "launcher's MPI")


# (launcher, rank, size, local rank, local size); the first launcher whose rank and size
# variables are both set wins. torchrun and horovodrun come first: they may themselves run
# inside an mpirun or srun allocation, and then their own variables describe the processes that
# talk to each other.
_SCHEMES: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    (
        "mvapich",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)

# _SCHEMES with MPICH's Hydra right after torchrun's and horovodrun's (``_from_launcher``).
_HYDRA_SCHEMES = (*_SCHEMES[:2], *(s for s in _SCHEMES[2:] if s[0] == "mpich"),
                  *(s for s in _SCHEMES[2:] if s[0] != "mpich"))

# Set by srun for each task of a job step, and not in the batch script itself: there
# SLURM_PROCID is 0 and SLURM_NTASKS counts the tasks that srun *would* start.
_SLURM_STEP = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} should be an integer, got {raw!r}") from None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE reads like "4(x2),3": the first group is this node's count only when
    # all nodes are alike, so use it only in its simple forms.
    raw = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
           or env.get("SLURM_TASKS_PER_NODE", ""))
    head = raw.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() and "," not in raw else None


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, size and local rank from the launcher's environment variables.

    Args:
        env: the environment to read; ``os.environ`` when omitted.

    Returns:
        A LaunchInfo. A process started without a launcher is rank 0 of 1, and so is a Slurm
        batch script itself (``SLURM_PROCID`` without srun's ``SLURM_STEP_*`` variables).
        With ``env`` omitted and torch.distributed's default group initialized, the group's
        rank and size (launcher "torch.distributed", unless torchrun's variables give the same
        rank and size).

    Raises:
        ValueError: a launcher variable is not an integer, or the values contradict each other
            (rank outside [0, size), local rank outside [0, local size)).
    """
    group = _torch_group(env)
    hydra = env is None and process_manager_connected()
    env = os.environ if env is None else env
    found = _from_launcher(env, hydra)
    if group is None:
        return found
    rank, size = group
    if found.launcher == "torchrun" and (found.rank, found.size) == group:
        # torchrun's variables describe the group they initialized. (No other launcher's are
        # kept even where they agree: whether they do may differ between ranks, and every
        # rank must take the same path in init.)
        return found
    if found.size == size:  # the launcher started this group: its local variables hold
        local_rank, local_size = found.local_rank, found.local_size
    else:
        local_rank, local_size = rank, size  # no variables of this group: one host assumed
    return _checked(LaunchInfo(rank, size, local_rank, local_size, "torch.distributed"), "rank")


def mpi_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher (MPICH's or Open MPI's mpiexec, MVAPICH, a PMIx launcher, srun)
    started this process: its rank and size variables are set, whatever torchrun's say,
    unless torchrun's agent started it (``TORCHELASTIC_RUN_ID``, which the agent gives its
    workers alone, and no connection of mpiexec's open here: ``process_manager_connected``,
    for this process's own environment only) or horovodrun's own launcher did (its
    rendezvous variables): torchrun run by mpiexec or srun hands its workers the launcher's
    variables, which describe the agent, and an MPI started on them fails (MPICH: "PMIU_write
    error ... Bad file descriptor").

    Without one, MPI's world is this process alone, and asking MPI costs more than the answer:
    an MPI whose lone start needs a launcher's daemon (Open MPI's) ends the process instead.
    """
    own = env is None
    env = os.environ if env is None else env
    if (env.get(TORCHRUN_WORKER) and "RANK" in env and "WORLD_SIZE" in env
            and not (own and process_manager_connected())):
        return False
    if horovodrun_rendezvous(env) is not None:
        return False
    return mpi_launcher_variables(env) is not None


def process_manager_connected() -> bool:
    """Whether this process holds the connection MPICH's mpiexec gives each process it
    starts (``PMI_FD``: one end of a Unix socket pair, open in that process alone), before
    MPI started: mpiexec started this process, whatever else its environment holds (an
    mpiexec run by a torchrun worker hands its processes torchrun's variables, which describe
    that worker, not them). A process that torchrun started under mpiexec inherits the
    variable, not the connection; its number may name a socket of the process's own, whose
    other end is no ancestor of it (MPI's start under mpiexec keeps it open: the answer is the
    same after it)."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit() or not hasattr(socket, "SO_PEERCRED"):
        return False
    try:
        with socket.socket(fileno=os.dup(int(fd))) as sock:
            if sock.family != socket.AF_UNIX:
                return False
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    return struct.unpack("3i", creds)[0] in _ancestors()


def _ancestors(levels: int = 8) -> set[int]:
    """This process's parent, its parent, ... (``levels`` at most; Linux's /proc): the
    process at the other end of mpiexec's connection (its proxy) is one of them, and not
    that of a socket pair this process made itself, whose number a stale ``PMI_FD`` may
    name."""
    found, pid = set(), os.getppid()
    for _ in range(levels):
        if pid <= 1:
            break
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def mpi_launcher_variables(env: Mapping[str, str] | None = None) -> str | None:
    """The rank and size variables of an MPI launcher (mpiexec, srun, ...) in ``env``, as
    ``"PMI_RANK=0, PMI_SIZE=2"``, whatever torchrun's or horovodrun's say; None without
    them."""
    env = os.environ if env is None else env
    for launcher, rank_var, size_var, *_ in _SCHEMES[2:]:
        if launcher == "slurm" and not any(env.get(name) for name in _SLURM_STEP):
            continue
        if rank_var in env and size_var in env:
            return f"{rank_var}={env[rank_var]}, {size_var}={env[size_var]}"
    return None


def horovodrun_rendezvous(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Where the rendezvous server of the horovodrun that started this process listens
    (address, port), or None where horovodrun's own launcher did not start it (no
    ``HOROVOD_RANK``, ``HOROVOD_SIZE`` and rendezvous variables; ``horovodrun --mpi`` starts
    processes through mpirun, an MPI launch).

    Raises:
        ValueError: the port is not an integer.
    """
    env = os.environ if env is None else env
    if not all(env.get(name) for name in (*HOROVODRUN_RENDEZVOUS, "HOROVOD_RANK",
                                           "HOROVOD_SIZE")):
        return None
    return env[HOROVODRUN_RENDEZVOUS[0]], _int(env, HOROVODRUN_RENDEZVOUS[1])


def _torch_group(env: Mapping[str, str] | None) -> tuple[int, int] | None:
    """(rank, size) of torch.distributed's default group when it is initialized; None
    otherwise, and when ``env`` is given (a description of another process) or PyTorch has
    not been imported (it is never imported here)."""
    if env is not None:
        return None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except (AttributeError, RuntimeError, ValueError):
        return None


def _from_launcher(env: Mapping[str, str], hydra: bool = False) -> LaunchInfo:
    """What the launcher's variables in ``env`` say; with ``hydra`` (MPICH's mpiexec started
    this process: ``process_manager_connected``), its variables before other MPI launchers'
    (Open MPI's ``OMPI_COMM_WORLD_*`` left in the environment describe no process here)."""
    for launcher, rank_var, size_var, lrank_var, lsize_var in (
            _HYDRA_SCHEMES if hydra else _SCHEMES):
        if launcher == "slurm":
            if not any(env.get(name) for name in _SLURM_STEP):
                continue  # the batch script, not a task that srun started
            if "SLURM_STEP_NUM_TASKS" in env:
                size_var = "SLURM_STEP_NUM_TASKS"  # this step's tasks, not the allocation's
        if rank_var not in env or size_var not in env:
            continue
        rank, size = _int(env, rank_var), _int(env, size_var)
        local_rank = _int(env, lrank_var) if lrank_var and lrank_var in env else None
        local_size: int | None
        if lsize_var and lsize_var in env:
            local_size = _int(env, lsize_var)
        elif launcher == "slurm":
            local_size = _slurm_local_size(env)
        else:
            local_size = None
        if local_rank is None:
            # Without a local rank, assume one host: that is what a bare launch usually is.
            local_rank, local_size = rank, size
        if local_size is None:
            local_size = max(local_rank + 1, 1)
        info = LaunchInfo(rank, size, local_rank, local_size, launcher, size_var)
        return _checked(info, rank_var)
    if "WORLD_SIZE" in env and "LOCAL_RANK" in env and "RANK" not in env:
        return _lightning(env)
    return LaunchInfo(0, 1, 0, 1, "none")


def _lightning(env: Mapping[str, str]) -> LaunchInfo:
    """PyTorch Lightning's launcher: WORLD_SIZE, LOCAL_RANK and NODE_RANK, but no RANK.

    Lightning numbers the processes ``NODE_RANK * devices + LOCAL_RANK`` and tells nobody
    ``devices``; on node 0 that is LOCAL_RANK, elsewhere it is unknown. ``rank`` is that guess
    (``rank_known`` is False): ``ringcomm.init`` uses the launch only once Lightning has
    initialized torch.distributed, whose rank is the real one.
    """
    size, local_rank = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
    node = _int(env, "NODE_RANK") if "NODE_RANK" in env else 0
    if "LOCAL_WORLD_SIZE" in env:
        local_size = _int(env, "LOCAL_WORLD_SIZE")
    else:
        local_size = size if node == 0 else max(local_rank + 1, 1)
    rank = min(node * local_size + local_rank, max(size - 1, 0))
    return _checked(LaunchInfo(rank, size, local_rank, local_size, "lightning", "WORLD_SIZE"),
                    "LOCAL_RANK")


def _checked(info: LaunchInfo, rank_var: str) -> LaunchInfo:
    if info.size < 1 or not 0 <= info.rank < info.size:
        raise ValueError(
            f"{info.launcher} environment gives rank {info.rank} ({rank_var}) of size {info.size}; "
            "expected 0 <= rank < size"
        )
    if info.local_size < 1 or not 0 <= info.local_rank < info.local_size:
        raise ValueError(
            f"{info.launcher} environment gives local rank {info.local_rank} of local size "
            f"{info.local_size}; expected 0 <= local rank < local size"
        )
    return info
