"""One MPI world for processes that no MPI launcher started (torchrun, ``accelerate launch``,
horovodrun without MPI): MPICH started in each of them against ringcomm's own PMI server.

Under mpiexec every process gets its place in MPI's world from the launcher. torchrun starts
the same processes without one, and MPI started alone is a world of one. :func:`join` gives
MPI what mpiexec would have: rank 0 answers MPICH's start-up questions
(:class:`~ringcomm.backends.pmi_server.PMIServer`), every process learns its address through
the launcher's rendezvous store (torch.distributed's, or horovodrun's HTTP one,
:mod:`ringcomm.backends.rendezvous_http`), and ``MPI_Init`` then makes one world of the job, with
shared memory between the processes of a node; each process's lifeline to the server ends it
where the job fails (an abort, a process gone), as mpiexec ends a failed job. ringcomm's MPI
backend, faster than gloo at every size, then runs under torchrun as under mpiexec.

It is all or nothing, and the same on every rank: each process first says whether it can
(mpi4py over MPICH, MPI not yet started in it, ``RINGCOMM_TORCHRUN_MPI`` not 0, and with it
unset or "auto" no GPU visible to PyTorch: the GPU path under torchrun is measured over gloo,
and 1 joins GPU jobs too), and unless every one can, none starts MPI and the caller keeps
gloo, told why.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
from typing import Any

from ringcomm.backends import pmi_server
from ringcomm.backends.mpi_process import (
    import_mpi,
    install_abort_hook,
    machine_id,
    note_world_joined,
    world_joined,
)
from ringcomm.backends.pmi_server import process_mapping
from ringcomm.backends.store_wait import missing_keys, ranks_of
from ringcomm.core.env import env, flag_value
from ringcomm.core.joined import refuse_inherited
from ringcomm.core.launch import MPI_LAUNCHER_VARIABLES, detect
from ringcomm.core.process_end import at_process_end, failed_status
from ringcomm.core.types import (
    ArgumentMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
)

__all__ = ["FLAG", "join"]

_LOG = logging.getLogger("ringcomm.init")

#: ``RINGCOMM_TORCHRUN_MPI``: 0 keeps torchrun's processes on gloo, 1 joins them into one MPI
#: world, auto (the default) joins them where PyTorch sees no GPU.
FLAG = "RINGCOMM_TORCHRUN_MPI"

_PREFIX = "ringcomm-mpi-join/"
_SERVER: list[subprocess.Popen[str]] = []  # rank 0's PMI server
_OUTCOME: list[str | Exception] = []  # why the job's processes could not join, once agreed
_LIFELINE: list[socket.socket] = []  # this process's lifeline to the server
_FINALIZED_ACK = threading.Event()  # the server counts this process as finished
_FINALIZED_ACK_S = 30.0

# Asked in a process of its own: an MPI that cannot start without its launcher (Open MPI's)
# ends the process that starts it, so this one never loads it before knowing which it is.
_PROBE = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
          "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])")


def join(store: Any, rank: int, size: int, timeout: float, *, always: bool = False,
         toward: str | None = None) -> str | None:
    """Start MPI in this process as rank ``rank`` of a world of ``size`` (collective: call it
    on every rank of the job with the same store).

    Args:
        store: the job's rendezvous store (``set``, ``get``, ``check`` and ``wait``, as
            torch.distributed's stores have them): torch.distributed's, or horovodrun's
            (``ringcomm.backends.rendezvous_http``).
        rank, size: this process's rank in the job, and the job's size.
        timeout: seconds MPI's start-up may wait for a process.
        always: start MPI whatever ``RINGCOMM_TORCHRUN_MPI`` says and whether a GPU is
            visible (for a launcher whose processes have no other way to talk: horovodrun's).
        toward: a host every process reaches (the store's), to find the address rank 0's
            PMI server listens on where the job spans several nodes; ``MASTER_ADDR`` when None.

    Returns:
        None once ``MPI.COMM_WORLD`` holds the job, numbered as ``rank``; otherwise why not
        (the same text on every rank), and MPI is not started in any process.

    Raises:
        InvalidArgumentError: ``RINGCOMM_TORCHRUN_MPI`` is not 0, 1 or auto on some rank (on
            every rank, naming it).
        ArgumentMismatchError: ``RINGCOMM_TORCHRUN_MPI`` differs between ranks (on every rank).
        CollectiveTimeoutError: a rank did not come within ``timeout`` (it exited, stopped, or
            is in another call); on the ranks that waited for it.
        RuntimeError: MPI started but its world is not the job's, or this process's
            launcher variables were inherited from a process of the job
            (``ringcomm.core.joined``).

    A later call gives the first call's answer (or error) again, without the store.
    """
    if world_joined():
        return None
    refuse_inherited(detect())  # a process that one of the job's started
    if _OUTCOME:  # agreed by every rank before: the same answer again, without the store
        if isinstance(_OUTCOME[0], BaseException):
            raise _OUTCOME[0]
        return _OUTCOME[0]
    try:
        cannot = _join(store, rank, size, timeout, always, toward)
    except Exception as err:
        _OUTCOME.append(err)
        raise
    if cannot is not None:
        _OUTCOME.append(cannot)
    return cannot


def _join(store: Any, rank: int, size: int, timeout: float, always: bool,
          toward: str | None) -> str | None:
    raw = "1" if always else env(FLAG) or "auto"
    status = {"flag": raw, "obstacle": _obstacle(_switch(raw)), "node": _node()}
    store.set(f"{_PREFIX}status/{rank}", json.dumps(status))
    _wait(store, [f"status/{r}" for r in range(size)], rank, size, timeout)
    everyone = [json.loads(_get(store, f"status/{r}")) for r in range(size)]
    _check_flags([s["flag"] for s in everyone])
    obstacles = [s["obstacle"] for s in everyone]
    if any(obstacles):
        return _listed(obstacles)
    nodes = [s["node"] for s in everyone]
    if rank == 0:
        store.set(f"{_PREFIX}address", _serve(nodes, timeout, toward))
    _wait(store, ["address"], rank, size, timeout)
    address = _get(store, "address")
    if not address:
        return "rank 0 could not start ringcomm's PMI server (its log says why)"
    _lifeline(address, rank, timeout)
    _start_mpi(address, rank, nodes)
    world = import_mpi().COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (rank, size):
        raise RuntimeError(f"MPI started over ringcomm's PMI server at {address} as rank "
                           f"{world.Get_rank()} of {world.Get_size()}; expected rank {rank} "
                           f"of {size}")
    note_world_joined()
    # A rank that fails must end, not wait in MPI_Finalize's barrier for ranks that wait for
    # it (torchrun would never see it fail): an uncaught exception aborts the job, as under
    # ringcomm.init(); a failed multiprocessing target ends unfinalized (_end_after_failed_target).
    install_abort_hook()
    at_process_end(_finalize_mpi, order=0)
    atexit.register(_end_after_failed_target)
    _LOG.info("MPI started over ringcomm's PMI server at %s: rank %d of %d, ranks on nodes %s",
              address, rank, size, process_mapping(nodes))
    return None


def _wait(store: Any, keys: list[str], rank: int, size: int, timeout: float) -> None:
    """Wait until the store holds every key (``status/<r>``: rank r came; ``address``: rank 0
    started the server) or raise CollectiveTimeoutError after ``timeout`` seconds, naming
    the ranks that did not come (the store's own timeout, which the group's need not be, and
    its message, which names a key, are not the user's)."""
    missing, elapsed = missing_keys(store, [_PREFIX + key for key in keys], timeout)
    if not missing:
        return
    ranks = ranks_of(missing) or [0]
    waited = "rank" if len(ranks) == 1 else "ranks"
    raise CollectiveTimeoutError(
        f"MPI's start-up timed out on rank {rank} of {size} after {elapsed:.1f} s waiting for "
        f"{waited} {', '.join(map(str, ranks))}: the first collective of a ringcomm group "
        f"starts MPI on every rank of the job, and {waited} {', '.join(map(str, ranks))} "
        f"did not come (exited, stopped, or in another call). The timeout is {timeout:g} s: "
        "the group's (init_process_group(timeout=...)) or ringcomm.init's",
        kind="MPI start-up", peer=ranks[0] if len(ranks) == 1 else None, elapsed=elapsed,
        timeout=timeout)


def _get(store: Any, key: str) -> str:
    value = store.get(_PREFIX + key)
    return value.decode() if isinstance(value, bytes) else str(value)


def _switch(raw: str) -> str | None:
    """``RINGCOMM_TORCHRUN_MPI``'s value: "on", "off" or "auto"; None for none of them."""
    if raw.strip().lower() == "auto":
        return "auto"
    value = flag_value(raw)
    return None if value is None else "on" if value else "off"


def _obstacle(switch: str | None) -> str:
    """Why this process cannot start MPI as part of the job; empty when it can."""
    if switch != "on" and switch != "auto":
        return f"{FLAG} is off" if switch == "off" else f"{FLAG} is not 0, 1 or auto"
    if switch == "auto" and _cuda_visible():
        return (f"a GPU is visible ({FLAG}=auto keeps GPU jobs on gloo, whose GPU path is "
                "the measured one; 1 joins them)")
    if "mpi4py.MPI" in sys.modules:
        return "mpi4py.MPI was imported before (MPI started as a world of its own)"
    if os.name != "posix":
        return "not on a POSIX system"
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                               timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"mpi4py's MPI could not be asked its version ({err})"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named 'mpi4py'" in probe.stderr:
            return "mpi4py is not installed"
        return f"mpi4py's MPI did not load ({last})"
    library = probe.stdout.strip()
    if not library.startswith("MPICH"):
        return f"mpi4py's MPI is {library or 'unknown'}, and only MPICH starts this way"
    return ""


def _cuda_visible() -> bool:
    """Whether PyTorch, where this process imported it, sees a CUDA device."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:  # a broken CUDA set-up: not a GPU job's path either
        return False


def _check_flags(flags: list[str]) -> None:
    """Raise the same error on every rank for a bad ``RINGCOMM_TORCHRUN_MPI`` on any rank, or
    values that differ between ranks."""
    bad = [f"rank {r} {raw!r}" for r, raw in enumerate(flags) if _switch(raw) is None]
    if bad:
        raise InvalidArgumentError(f"{FLAG} must be 0, 1 (or true/false, yes/no, on/off) or "
                                   f"auto, got {', '.join(bad)}")
    if len({_switch(raw) for raw in flags}) > 1:
        raise ArgumentMismatchError(
            f"{FLAG} differs between ranks: " + ", ".join(
                f"rank {r} {raw!r}" for r, raw in enumerate(flags)))


def _listed(obstacles: list[str]) -> str:
    """Each obstacle with the ranks it holds on, in rank order of first appearance."""
    ranks: dict[str, list[int]] = {}
    for r, why in enumerate(obstacles):
        if why:
            ranks.setdefault(why, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_span(rs)}: {why}"
                     for why, rs in ranks.items())


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _node() -> str:
    """What tells nodes apart: the host name, the running kernel, the file system of /dev/shm,
    where MPICH makes its shared-memory segments, and the network namespace (containers of
    one host with /dev/shm or a network of their own are nodes apart: they then talk over the
    network)."""
    try:
        shm = str(os.stat("/dev/shm").st_dev)
    except OSError:
        shm = ""
    try:  # processes of other network namespaces do not reach this one's loopback
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{socket.gethostname()}/{machine_id()}/{shm}/{net}"


def _serve(nodes: list[str], timeout: float, toward: str | None) -> str:
    """Start rank 0's PMI server, a process of its own listening where the other processes
    reach it, and return its address; empty where it did not start, or where it could listen
    only on this host's loopback while the job spans several nodes. It runs from its file
    (``-I``: the standard library alone, which is all it imports)."""
    try:
        spanned = len(set(nodes))
        host = "127.0.0.1" if spanned == 1 else _routable_address(toward)
        if host.startswith("127.") and spanned > 1:
            _LOG.warning("ringcomm's PMI server not started: the job spans %d nodes and this "
                         "host's address is %s (set %s to an address the other nodes reach)",
                         spanned, host, "MASTER_ADDR" if toward is None else "the launcher's "
                         "rendezvous address")
            return ""
        command = [sys.executable, "-I", pmi_server.__file__, "--size", str(len(nodes)),
                   "--mapping", process_mapping(nodes), "--host", host,
                   "--timeout", str(timeout), "--parent-id", "0"]
        server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  text=True)
        _SERVER.append(server)
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        if not address:
            _LOG.error("ringcomm's PMI server ended as it started (status %s)", server.wait())
        return address
    except Exception as err:  # every rank waits for the address: always publish one
        _LOG.error("ringcomm's PMI server did not start: %s", err)
        return ""


def _routable_address(toward: str | None = None) -> str:
    """This host's address on the route to the rendezvous store (``toward``, else
    ``MASTER_ADDR``), else its host name's address."""
    master = toward or os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((socket.gethostbyname(master), 9))  # no packet: a route lookup
                address = probe.getsockname()[0]
            if not address.startswith("127."):
                return str(address)
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _lifeline(address: str, rank: int, timeout: float) -> None:
    """Connect to the server a second time and end this process when it says so: where a
    process aborts (MPICH's MPI_Abort returns, leaving it to the launcher to end the job),
    ends before MPI_Finalize, or the server itself is gone, every process ends, as mpiexec
    ends every process of such a job."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    sock.sendall(f"cmd=lifeline pmiid={rank}\n".encode())
    _LIFELINE[:] = [sock]
    threading.Thread(target=_watch, args=(sock,), name="ringcomm-lifeline", daemon=True).start()


def _watch(sock: socket.socket) -> None:
    with sock, sock.makefile("rb") as lines:
        for raw in lines:
            fields = pmi_server.parse(raw)
            if fields.get("cmd") == "finalized_ack":
                _FINALIZED_ACK.set()
            if fields.get("cmd") == "bye":
                _FINALIZED_ACK.set()
                return
            if fields.get("cmd") == "die":
                code = int(fields.get("code", "1")) if fields.get("code", "").isdigit() else 1
                _end(code, urllib.parse.unquote(fields.get("msg", "")))
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_finalized():
        return
    _end(1, "the job's PMI server (a process of rank 0's) is gone")


def _finalize_mpi() -> None:
    """``MPI_Finalize`` where a process multiprocessing forked ends (see
    ringcomm.core.process_end), then the server told so on the lifeline: MPICH sends PMI's
    own ``finalize`` from its exit handler, which such a process never runs, and the server
    would count it gone before ``MPI_Finalize`` and end the job's other processes."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    mpi.Finalize()
    if _LIFELINE:
        _LIFELINE[0].sendall(b"cmd=finalized\n")
        if not _FINALIZED_ACK.wait(_FINALIZED_ACK_S):
            _LOG.warning("ringcomm's PMI server did not answer this process's end within "
                         "%g s", _FINALIZED_ACK_S)


def _end_after_failed_target() -> None:
    """End a process whose multiprocessing target failed at its exit, without
    ``MPI_Finalize``: spawn's children exit through ``atexit``, where mpi4py would finalize and
    wait for ranks that wait for this one. As a forked process ends (``os._exit``), so the
    server sees it gone and ends the others, this one first: the launcher (torch.multiprocessing)
    reports its error, not the others' ends."""
    status = failed_status()
    mpi = sys.modules.get("mpi4py.MPI")
    if status is not None and mpi is not None and mpi.Is_initialized() \
            and not mpi.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _end(code: int, why: str) -> None:
    os.write(2, f"ringcomm: {why}; ending this process (exit status {code}), as mpiexec "
                f"ends every process of such a job\n".encode())
    os._exit(code)


def _start_mpi(address: str, rank: int, nodes: list[str]) -> None:
    """``MPI_Init`` as PMI process ``rank`` of the server at ``address`` (the variables Hydra
    would set, for the start only)."""
    local = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    variables = {"PMI_PORT": address, "PMI_ID": str(rank), "MPIR_CVAR_PMI_VERSION": "1",
                 "MPI_LOCALNRANKS": str(len(local)), "MPI_LOCALRANKID": str(local.index(rank))}
    # An MPI launcher's own, inherited from a torchrun agent it started: MPICH would take
    # PMI_FD (a connection of the agent's) over PMI_PORT.
    inherited = [name for name in MPI_LAUNCHER_VARIABLES if name not in variables]
    saved = {name: os.environ.get(name) for name in [*variables, *inherited]}
    for name in inherited:
        os.environ.pop(name, None)
    os.environ.update(variables)
    try:
        import_mpi()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
