"""The MPI library in this process: importing it (MPICH told to yield its core when ranks
outnumber cores), whether MPI's world numbers the ranks as a job does, and ending the whole
job when one rank raises."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ringcomm.core import launch
from ringcomm.core.joined import refuse_inherited

__all__ = ["FORWARD_S", "abort", "cores", "import_mpi", "install_abort_hook", "mpi_world_is_job",
           "note_world_joined", "world_joined", "world_numbers_alike",
           "yield_when_oversubscribed"]

_JOINED: list[bool] = []  # set once MPI started over ringcomm's PMI server (mpi_join)


def note_world_joined() -> None:
    """Record that MPI's world is the job, started by ``ringcomm.backends.mpi_join``."""
    _JOINED.append(True)


def world_joined() -> bool:
    """Whether MPI started in this process over ringcomm's PMI server (torchrun's job)."""
    return bool(_JOINED)


def mpi_world_is_job() -> bool:
    """Whether MPI's world is this job's processes: an MPI launcher started them, or they
    joined one world over ringcomm's PMI server."""
    return launch.mpi_launched() or world_joined()


def machine_id() -> str:
    """What this process shares its cores with: the running kernel's boot id (the same for
    the containers and network namespaces of one host), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def yield_when_oversubscribed() -> None:
    """Let MPICH yield the CPU while it waits when there are more ranks than cores here.

    MPICH busy-polls by default; with more ranks than cores the spinning ranks take the cores
    from the ones with work to do (a 4-rank job on 2 cores ran 2x slower). Open MPI detects this
    itself. Only effective before MPI starts, and never overrides the user's setting.
    """
    if "mpi4py.MPI" in sys.modules:
        return
    if launch.detect().local_size > cores():
        os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def import_mpi() -> Any:
    """Import ``mpi4py.MPI`` or raise RuntimeError saying what to install, or that this
    process inherited an MPI launcher's variables from a process of the job
    (``ringcomm.core.joined``)."""
    if "mpi4py.MPI" not in sys.modules:
        refuse_inherited(launch.detect())
    yield_when_oversubscribed()
    try:
        with _inherited_launcher_variables_hidden():
            from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError(
            "the MPI backend needs mpi4py and an MPI library: pip install 'ringcomm[mpi]' "
            f"(mpi4py + the mpich wheel), or mpi4py built against your site MPI ({err})"
        ) from err
    return MPI


@contextlib.contextmanager
def _inherited_launcher_variables_hidden() -> Iterator[None]:
    """Within the block (MPI's start), no MPI launcher's variables where this process has
    them but no launcher started it (``launch.mpi_launched``): a torchrun worker under
    mpiexec inherits them from the agent, and MPICH's start on them failed with its own error
    stack ("PMIU_write error ... Bad file descriptor") where MPI starts as a world of one (a
    torchrun job of one process; a job of several joins over ringcomm's PMI server, which
    sets its own)."""
    hidden = {}
    # MPICH's own rank variables (not srun's or Open MPI's, nor the PMI_PORT and PMI_ID that
    # ringcomm's join sets after it removed them): a process manager MPICH would talk to.
    if ("mpi4py.MPI" not in sys.modules and "PMI_RANK" in os.environ
            and "PMI_SIZE" in os.environ and not launch.mpi_launched()):
        hidden = {name: os.environ.pop(name) for name in launch.MPI_LAUNCHER_VARIABLES
                  if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


#: Files this process made for others to open, until it removes them itself: abort()
#: removes them first, since MPI_Abort ends the process before any ``finally`` runs.
_REMOVED_AT_ABORT: set[str] = set()


@contextlib.contextmanager
def removed_at_abort(path: str | None) -> Iterator[None]:
    """Within the block, :func:`abort` removes the file at ``path`` (None: nothing) before it
    ends the job: for a name that other processes open before its maker unlinks it."""
    if path is None:
        yield
        return
    _REMOVED_AT_ABORT.add(path)
    try:
        yield
    finally:
        _REMOVED_AT_ABORT.discard(path)


def abort(comm: Any, code: int) -> None:
    """``MPI_Abort`` on ``comm``, then the end of this process where MPI started over
    ringcomm's PMI server: MPICH's MPI_Abort returns there, leaving the launcher to end the job
    (the server tells every other process to end; this one ends at once). Files of
    :func:`removed_at_abort` are removed first."""
    for path in list(_REMOVED_AT_ABORT):
        with contextlib.suppress(OSError):
            os.unlink(path)
    comm.Abort(code)
    if world_joined():
        os._exit(code)


def world_numbers_alike(rank: int, size: int, timeout: float, *, refuse_duplicates: bool = True,
                        from_variables: bool = False) -> bool:
    """Whether MPI.COMM_WORLD holds ``size`` processes and numbers this one ``rank``, as on
    every rank: a collective over MPI's world where its size is ``size`` (call it on every
    rank; one that waits ``timeout`` seconds at most for the others, then ends the job, as
    :func:`gather_names`), False without mpi4py, and False for a job of several processes that
    no MPI launcher started (MPI is not even started then) and that did not join over
    ringcomm's PMI server. For a job whose torch.distributed group is up: its ranks may be
    numbered otherwise than MPI's, and then MPI cannot stand in for it.

    With ``refuse_duplicates``, where an MPI launcher started fewer processes than ``size``
    (a part of the job, say one mpiexec per node), the ranks are gathered over MPI's world
    too (collective), to refuse the same rank given twice; False then. Where it started more
    processes than ``size`` and ``from_variables`` (``rank`` and ``size`` are torchrun's
    variables, not a torch.distributed group already up), refused on each rank without a
    collective: two of them would have one rank (with ``WORLD_SIZE=1`` each would run alone
    as a job of one), and processes of the MPI job that never call init (only some of its
    programs forming the torch.distributed job) would leave a collective waiting.

    Raises:
        RuntimeError: with ``refuse_duplicates``, two of MPI's processes give the same rank
            (or one no rank of the job), on every rank: torchrun's ``RANK`` and
            ``WORLD_SIZE`` left in the environment of an mpiexec job, which every process
            inherits alike. Started from them, torch.distributed would wait its whole timeout
            for ranks that never come. (Without it: False.) With ``from_variables`` too,
            on every rank: an MPI launcher started more processes than ``size``.
    """
    if size > 1 and not mpi_world_is_job():
        return False
    try:
        MPI = import_mpi()
    except RuntimeError:
        return False
    world = MPI.COMM_WORLD
    processes = world.Get_size()
    if refuse_duplicates and from_variables and processes > size and launch.mpi_launched():
        raise RuntimeError(_too_many_processes(rank, size, processes))
    part = refuse_duplicates and processes < size and launch.mpi_launched()
    if processes != size and not part:
        return False
    ranks = _gather_ranks(world, rank, timeout)
    if refuse_duplicates and (len(set(ranks)) < processes
                              or not all(0 <= r < size for r in ranks)):
        raise RuntimeError(_no_numbering(ranks, size))
    return ranks == list(range(size))


def _gather_ranks(world: Any, rank: int, timeout: float) -> list[int]:
    """Every MPI rank's ``rank``, in MPI's order (collective over ``world``, bounded)."""
    import numpy as np

    mine = np.array([rank], np.int64)
    ranks = np.empty(world.Get_size(), np.int64)
    wait_or_abort(world, world.Iallgather(mine, ranks), timeout,
                  lambda: _start_timeout(world, timeout, "init", "whether MPI numbers the "
                                         "processes as torch.distributed does"))
    return [int(r) for r in ranks]


#: What to do about torchrun's variables left in an MPI job's environment.
_STALE_TORCHRUN = (
    "They were left in the environment by an earlier launch, or by a torchrun that started this "
    "mpiexec (torchrun sets them in each process it starts, and every process of an mpiexec "
    "job inherits the same ones): unset RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT before mpiexec, or launch with torchrun alone")


def _no_numbering(ranks: list[int], size: int) -> str:
    """Why ``ranks`` (each MPI rank's, in MPI's order) number no ``size`` processes."""
    n = len(ranks)
    which = (f"do not number the {n} processes of this MPI job" if n == size else
             f"do not give the {n} processes of this MPI job {n} distinct ranks below "
             f"{size}")
    return (f"RANK and WORLD_SIZE={size} (torchrun's variables) {which}: MPI ranks 0 to "
            f"{n - 1} have RANK {ranks}. {_STALE_TORCHRUN}")


def _too_many_processes(rank: int, size: int, processes: int) -> str:
    """Why torchrun's ``rank`` and ``size`` cannot number an MPI job of ``processes`` > size."""
    return (f"RANK={rank} and WORLD_SIZE={size} (torchrun's variables) describe a job of "
            f"{size} process{'es' if size != 1 else ''}, but an MPI launcher started "
            f"{processes} processes in this one: some would share a rank"
            f"{' (each would run as a job of its own)' if size == 1 else ''}. "
            f"{_STALE_TORCHRUN}. Where only some of this MPI job's programs form the "
            "torch.distributed job, ask for ringcomm.init('gloo') there")


#: Seconds the abort hook leaves the launcher to forward the traceback before MPI_Abort.
FORWARD_S = 0.2

_NAME_BYTES = 32  # a backend's name as the ranks compare it (longer ones are cut)


def gather_names(comm: Any, name: str, timeout: float, what: str) -> list[str]:
    """Every rank's ``name`` over ``comm`` (MPI), in rank order: a collective that waits at
    most ``timeout`` seconds for the others, then ends the job (``MPI_Abort``, after saying
    why, naming ``what``: the collective, as init agrees on it), as every timed-out wait of
    the MPI backend does; the job cannot go on with a rank that never came."""
    import numpy as np

    send = np.zeros(_NAME_BYTES, np.uint8)
    mine = name.encode("utf-8", "replace")[:_NAME_BYTES]
    send[:len(mine)] = np.frombuffer(mine, np.uint8)
    size = comm.Get_size()
    recv = np.empty((size, _NAME_BYTES), np.uint8)
    wait_or_abort(comm, comm.Iallgather(send, recv), timeout,
                  lambda: _start_timeout(comm, timeout, what, "the backend agreement"))
    return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in recv]


def wait_or_abort(comm: Any, request: Any, timeout: float,
                  error: Callable[[], Exception]) -> None:
    """Wait for ``request`` (a collective over ``comm``) at most ``timeout`` seconds; past
    that, write ``error()`` and end the job (``MPI_Abort``, after a pause for the launcher to
    forward it), then raise it: the job cannot go on with a rank that never came."""
    from ringcomm.comm.transport import write_fatal

    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            failure = error()
            write_fatal(failure, "Ending the job (MPI_Abort).")
            time.sleep(FORWARD_S)  # for the launcher to forward it before the job ends
            abort(comm, 1)
            raise failure
        time.sleep(0.001)


def _start_timeout(comm: Any, timeout: float, what: str, waiting: str) -> Exception:
    """The CollectiveTimeoutError of a start-up exchange (``waiting``) of ``what`` over
    ``comm`` that waited ``timeout`` seconds."""
    from ringcomm.core.types import CollectiveTimeoutError

    return CollectiveTimeoutError(
        f"{what} timed out on rank {comm.Get_rank()} of {comm.Get_size()} after "
        f"{timeout:.1f} s waiting for the other ranks ({waiting}): a rank may have "
        "exited, stopped, asked for gloo, or be elsewhere. The timeout is "
        f"{timeout:g} s: change it with ringcomm.init(timeout=...) or RINGCOMM_TIMEOUT",
        kind=what, elapsed=timeout, timeout=timeout)


def install_abort_hook() -> None:
    """Make an uncaught exception on one rank end the whole job instead of hanging it.

    Without this, the failing rank waits in MPI_Finalize while the others wait for its messages.
    The hook prints the traceback, then calls ``MPI_Abort`` (as ``python -m mpi4py`` does),
    after a pause of ``FORWARD_S``: the launcher forwards each rank's output through a pipe,
    and an abort right after the write can end the job before the traceback has left it (a job
    under load ended once with an empty stderr).
    """
    previous = sys.excepthook
    if getattr(previous, "_ringcomm_abort", False):
        return

    def hook(etype: Any, value: Any, tb: Any) -> None:
        previous(etype, value, tb)
        # Only an MPI this process started: importing mpi4py.MPI here would start one (a
        # world of one process under torchrun's gloo, aborted at once).
        MPI = sys.modules.get("mpi4py.MPI")
        try:
            aborting = MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()
        except Exception:
            aborting = False
        if aborting:
            _write_captured_stderr()
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(FORWARD_S)
        if aborting and MPI is not None:
            with contextlib.suppress(Exception):
                abort(MPI.COMM_WORLD, 1)

    hook._ringcomm_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _write_captured_stderr() -> None:
    """Write to the process's own stderr what an excepthook wrapping this one has captured of
    the traceback: torch.distributed's (``init_process_group`` installs one over the hook it
    finds) sends stderr to a StringIO while it calls the hook it wraps, to print it with the
    rank after it returns, which the abort would prevent: the job ended with no traceback."""
    captured, real = sys.stderr, sys.__stderr__
    if isinstance(captured, io.StringIO) and real is not None:
        real.write(captured.getvalue())
        real.flush()
        captured.seek(0)
        captured.truncate()
