"""Starting the NCCL backend: what each process checks, and how the ranks find each other.

Each process checks on its own that it has CuPy, NCCL and a GPU (:func:`local_setup`); the
ranks then meet over a host-side rendezvous and share those results before NCCL starts
(:func:`startup_exchange`, :func:`check_distinct_devices`).

The rendezvous is picked by how the job was launched: MPI (mpiexec/mpirun/srun with mpi4py,
or an explicit ``mpi_comm``), the store of torch.distributed (torchrun: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; a process group already initialised lends
its store), or nothing at all for a lone process. It carries the startup exchange, the NCCL
unique id, and small objects on error paths. A rendezvous splits like an MPI communicator, for
the NCCL transport's ``split``.
"""

from __future__ import annotations

import itertools
import pickle
import socket
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import numpy as np

from ringcomm.backends import _nccl_lib
from ringcomm.backends.store_wait import allgather, wait_for
from ringcomm.comm.transport import check_timeout
from ringcomm.core import launch
from ringcomm.ops import _cuda_stack

__all__ = [
    "LocalSetup",
    "Rendezvous",
    "check_distinct_devices",
    "connect",
    "device_count",
    "device_identity",
    "every_rank_can_start",
    "import_cupy",
    "local_setup",
    "startup_exchange",
]

_GENERATION = itertools.count()


class Rendezvous(Protocol):
    """A host-side channel over the communicator's ranks."""

    kind: str
    rank: int
    size: int
    local_rank: int
    local_size: int

    def allgather_object(self, obj: Any) -> list[Any]: ...

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes: ...

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> bool: ...

    def split(self, color: int, key: int) -> Rendezvous:
        """The rendezvous of the ranks passing ``color``, ordered by (key, rank); collective."""

    def close(self) -> None: ...


class _MPIRendezvous:
    """Over an MPI transport (duplicates of an mpi4py communicator, every wait bounded by the
    timeout); also serves the per-call agreement."""

    kind = "mpi"

    def __init__(self, base: Any, timeout: float | None = None) -> None:
        from ringcomm.backends.mpi import MPITransport

        self._init(MPITransport(base, timeout=timeout))

    def _init(self, transport: Any) -> None:
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        # Among this communicator's ranks on this host: right for subcommunicators and for
        # launchers launch.py does not know.
        self.local_rank, self.local_size = transport.local_rank, transport.local_size

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.transport.allgather_object(obj)

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        return self.transport.allgather_object(data if self.rank == root else None)[root]

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> bool:
        self.transport.allgather_fixed(send, recv)
        return True

    def split(self, color: int, key: int) -> _MPIRendezvous:
        sub = _MPIRendezvous.__new__(_MPIRendezvous)
        sub._init(self.transport.split(color, key))
        return sub

    def close(self) -> None:
        self.transport.close()


class _StoreRendezvous:
    """Over torch.distributed's key-value store (TCPStore at MASTER_ADDR:MASTER_PORT).

    Args:
        store: a store whose keys no other rendezvous uses (a PrefixStore).
        rank, size, local_rank, local_size: this rank's place in the rendezvous.
        timeout: how long a rank waits for the others' keys, in seconds (the store's own
            timeout is the process group's where torch.distributed made it, not the user's).
    """

    kind = "store"

    def __init__(self, store: Any, rank: int, size: int, local_rank: int,
                 local_size: int, timeout: float) -> None:
        self.store = store
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.timeout = timeout
        self._calls = itertools.count()

    @classmethod
    def launched(cls, info: launch.LaunchInfo, timeout: float) -> _StoreRendezvous:
        """The rendezvous of a torchrun job, over the store its environment names; a rank
        waits ``timeout`` seconds for the others there (a rank that died before reaching the
        rendezvous turns into this timeout instead of a hang)."""
        try:
            import torch.distributed as dist
        except ImportError as err:
            raise RuntimeError(
                "under torchrun the NCCL backend exchanges its unique id over "
                f"torch.distributed's store, which needs PyTorch ({err})") from err
        if dist.is_initialized():
            if dist.get_world_size() != info.size:
                # The store would wait for ranks that are not in this group: fail instead.
                raise RuntimeError(
                    f"torch.distributed's default group has {dist.get_world_size()} processes "
                    f"but the launch says {info.describe()}; initialize the process group "
                    "from the same launch as ringcomm")
            store = dist.distributed_c10d._get_default_store()
        else:
            try:
                store, _, _ = next(dist.rendezvous(
                    "env://", timeout=timedelta(seconds=timeout)))
            except (ValueError, RuntimeError) as err:
                raise RuntimeError(
                    "torchrun-style launch (RANK, WORLD_SIZE set) but torch.distributed's "
                    f"store could not be reached at MASTER_ADDR:MASTER_PORT: {err}") from err
        # Every communicator of this process gets its own key space; all ranks create their
        # communicators in the same order, so the generations agree.
        prefixed = dist.PrefixStore(f"ringcomm/nccl{next(_GENERATION)}/", store)
        return cls(prefixed, info.rank, info.size, info.local_rank, info.local_size, timeout)

    def allgather_object(self, obj: Any) -> list[Any]:
        everyone = allgather(self.store, f"ag{next(self._calls)}/", self.rank, self.size,
                             pickle.dumps(obj), self.timeout)
        return [pickle.loads(value) for value in everyone]

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        key = f"bc{next(self._calls)}"
        if self.rank == root:
            assert data is not None
            self.store.set(key, data)
            return data
        self._wait([key], f"rank {root}'s broadcast", root)
        return bytes(self.store.get(key))

    def _wait(self, keys: list[str], what: str, peer: int | None = None) -> None:
        wait_for(self.store, keys, self.rank, self.size, self.timeout, what, peer)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> bool:
        return False  # a store round trip per collective is too slow; NCCL does this one

    def split(self, color: int, key: int) -> _StoreRendezvous:
        import torch.distributed as dist

        # The key space is numbered like any other call, so every rank names the same one.
        space = f"sp{next(self._calls)}/{color}/"
        everyone = self.allgather_object((color, key, socket.gethostname()))
        members = sorted((k, r) for r, (c, k, _) in enumerate(everyone) if c == color)
        ranks = [r for _, r in members]
        hosts = [everyone[r][2] for r in ranks]
        rank = ranks.index(self.rank)
        here = [i for i, host in enumerate(hosts) if host == hosts[rank]]
        return _StoreRendezvous(dist.PrefixStore(space, self.store), rank, len(ranks),
                                here.index(rank), len(here), self.timeout)

    def close(self) -> None:
        self.store = None


class _LocalRendezvous:
    """A lone process: nothing to exchange."""

    kind = "local"
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        assert data is not None
        return data

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> bool:
        recv.reshape(-1)[:] = send.reshape(-1)
        return True

    def split(self, color: int, key: int) -> _LocalRendezvous:
        return _LocalRendezvous()

    def close(self) -> None:
        pass


def connect(mpi_comm: Any = None, timeout: float | None = None) -> Rendezvous:
    """Open the rendezvous that suits how this process was started.

    Args:
        mpi_comm: an mpi4py communicator to use; when None, MPI.COMM_WORLD for MPI launchers
            and a lone process, the torch.distributed store under torchrun.
        timeout: seconds a rank waits for the others in any exchange (the default of
            ``ringcomm.init`` when None); over MPI, a wait that passes it ends the job.

    Raises:
        RuntimeError: the launcher's channel is unavailable (mpi4py or PyTorch missing, the
            store unreachable); the message says what to install. Or torchrun's ``RANK`` and
            ``WORLD_SIZE`` in an mpiexec job give two processes one rank (on every rank).
        TypeError: ``mpi_comm`` is not an mpi4py communicator.
    """
    if mpi_comm is not None:
        return _MPIRendezvous(mpi_comm, timeout)
    from ringcomm.backends.mpi_process import world_numbers_alike

    info = launch.detect()
    if info.launcher == "torchrun" and launch.mpi_launched():
        # torchrun's variables in an MPI job that no torchrun agent started: refused where
        # they number no process (left in its environment, the same in every process), whose
        # store would wait the whole timeout for a rank that never comes; collective over
        # MPI's world where it holds the job's processes or part of them, else nothing.
        world_numbers_alike(info.rank, info.size, check_timeout(timeout), from_variables=True)
    # A torch.distributed group that MPI's world numbers alike meets over MPI, as any mpiexec
    # job does (collective over MPI's world).
    if info.launcher == "torchrun" or (info.launcher == "torch.distributed" and not
                                       world_numbers_alike(info.rank, info.size,
                                                           check_timeout(timeout))):
        return _StoreRendezvous.launched(info, check_timeout(timeout))
    try:
        from mpi4py import MPI
    except ImportError as err:
        if info.size == 1:
            return _LocalRendezvous()
        raise RuntimeError(
            f"this job was started by {info.launcher} with {info.size} processes; the NCCL "
            "backend exchanges its unique id over MPI there, which needs mpi4py: "
            f"pip install 'ringcomm[mpi]' (or launch with torchrun) ({err})") from err
    return _MPIRendezvous(MPI.COMM_WORLD, timeout)


def startup_exchange(rdv: Rendezvous, problem: str | None,
                     identity: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Share every rank's startup problem and GPU identity; raise on every rank if any failed.

    Doing this before NCCL starts turns a rank that cannot run (no GPU, no NCCL) into the same
    error everywhere, instead of peers waiting for it in ncclCommInitRank.

    Returns:
        Every rank's identity, in rank order.

    Raises:
        RuntimeError: some rank reported a problem (this rank's own message when it has one).
    """
    everyone = rdv.allgather_object((problem, identity))
    failed = [(r, p) for r, (p, _) in enumerate(everyone) if p is not None]
    if problem is not None:
        raise RuntimeError(problem)
    if failed:
        r, p = failed[0]
        more = f" (and {len(failed) - 1} other ranks)" if len(failed) > 1 else ""
        raise RuntimeError(f"the NCCL backend cannot start on rank {r}{more}: {p}")
    return [ident for _, ident in everyone]


def device_identity(device: int, count: int) -> dict[str, Any]:
    """Host name, CUDA device number, PCI bus id and UUID of ``device``, for the duplicate check."""
    from cupy.cuda import runtime

    uuid = ""
    try:
        raw = runtime.getDeviceProperties(device).get("uuid", b"")
        uuid = raw.hex() if isinstance(raw, bytes) else str(raw)
    except Exception:  # older CuPy without the field: the bus id still identifies the GPU
        uuid = ""
    return {"host": socket.gethostname(), "device": device, "count": count,
            "bus": runtime.deviceGetPCIBusId(device), "uuid": uuid}


def check_distinct_devices(identities: list[dict[str, Any]]) -> None:
    """Raise if two ranks would drive the same GPU (NCCL refuses one communicator on that).

    A GPU is its UUID where known, else its host and PCI bus id.

    Raises:
        RuntimeError: naming the ranks, the host and the GPU, and what to do instead.
    """
    groups: dict[Any, list[int]] = {}
    for r, ident in enumerate(identities):
        key = ident.get("uuid") or (ident["host"], ident["bus"])
        groups.setdefault(key, []).append(r)
    shared = [ranks for ranks in groups.values() if len(ranks) > 1]
    if not shared:
        return
    ranks = shared[0]
    first = identities[ranks[0]]
    raise RuntimeError(
        f"ranks {', '.join(map(str, ranks))} would share GPU {first['bus']} (CUDA device "
        f"{first['device']} of {first['count']}) on host {first['host']}; the NCCL backend "
        "needs one GPU per rank. Start at most as many ranks per host as it has GPUs, or "
        "use ringcomm.init(backend='mpi'), which runs any number of ranks per GPU")


# ------------------------------------------------------------------------ per-process checks
def import_cupy() -> Any:
    """Import CuPy or raise RuntimeError saying what to install."""
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            f"the NCCL backend needs CuPy and NCCL: {_cuda_stack.install_hint()} ({err})") from err
    return cupy


def device_count(cupy: Any) -> tuple[int, str]:
    """How many CUDA devices this process sees, and why none when it sees none; never raises."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as err:  # no driver, or a driver too old for the runtime
        return 0, str(err)
    return count, "" if count else "CUDA reports no device"


class LocalSetup(NamedTuple):
    """What one process brings to the NCCL communicator."""

    cupy: Any
    lib: _nccl_lib.NCCLLibrary
    device: int
    identity: dict[str, Any]
    uid: bytes | None


def local_setup(local_rank: int, device: int | None, make_uid: bool) -> LocalSetup:
    """Load CuPy and NCCL, pick this process's GPU, and make the unique id on rank 0.

    Args:
        local_rank: this rank's position on its host; the GPU is local_rank % device count.
        device: a CUDA device to use instead.
        make_uid: whether to create the NCCL unique id (rank 0).

    Raises:
        RuntimeError: CuPy, NCCL or a GPU is missing, or ``device`` does not exist; the
            message says what to install or do.
    """
    if not _cuda_stack.driver_loads():  # no GPU is visible: known without importing CuPy
        count, reason = 0, "CUDA's driver library, libcuda.so.1, does not load"
    else:
        cupy = import_cupy()
        lib = _nccl_lib.load()
        count, reason = device_count(cupy)
    if not count:
        raise RuntimeError(
            f"the NCCL backend needs a CUDA GPU, and this process sees none ({reason}); run on "
            f"a machine with an NVIDIA GPU and driver, with {_cuda_stack.install_hint()}, or use "
            "ringcomm.init(backend='mpi')")
    dev = local_rank % count if device is None else int(device)
    if not 0 <= dev < count:
        raise RuntimeError(f"CUDA device {dev} does not exist; this process sees {count}")
    return LocalSetup(cupy, lib, dev, device_identity(dev, count),
                      lib.unique_id() if make_uid else None)


def every_rank_can_start(mpi_comm: Any = None, timeout: float | None = None) -> bool:
    """Whether every rank has CuPy, NCCL and a GPU of its own; the same answer on every rank.

    Collective over the ranks ``connect(mpi_comm, timeout)`` finds. Never raises for a missing
    GPU, library or rendezvous, or a shared GPU: those make the answer False; a rank that does
    not come within ``timeout`` raises its CollectiveTimeoutError.
    """
    try:
        rdv = connect(mpi_comm, timeout)
    except RuntimeError:
        return False
    try:
        identity = None
        try:
            identity = local_setup(rdv.local_rank, None, False).identity
        except Exception:  # anything that keeps this rank from NCCL means "no", not an error
            identity = None
        everyone = rdv.allgather_object(identity)
    finally:
        rdv.close()
    if any(ident is None for ident in everyone):
        return False
    try:
        check_distinct_devices(everyone)
    except RuntimeError:
        return False
    return True
