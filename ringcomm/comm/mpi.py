"""MPI backend (mpi4py): NumPy arrays, and CuPy arrays through CUDA-aware MPI or host staging.

:class:`MPITransport` implements the Transport over three duplicates of an MPI communicator
(the ring's messages, users' point-to-point messages, and the host collectives), so that none
of ringcomm's messages can match another's or the application's. :class:`MPICommunicator` is
the Communicator over it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm import staging
from ringcomm.comm.base import Communicator
from ringcomm.comm.transport import TransportBase, check_split
from ringcomm.comm.types import RING

__all__ = [
    "MPICommunicator",
    "MPITransport",
    "import_mpi",
    "install_abort_hook",
    "yield_when_oversubscribed",
]

_RING_TAG = 7
_P2P_TAG = 11


def yield_when_oversubscribed() -> None:
    """Let MPICH yield the CPU while it waits when there are more ranks than cores here.

    MPICH busy-polls by default; with more ranks than cores the spinning ranks take the cores
    from the ones with work to do (a 4-rank job on 2 cores ran 2x slower). Open MPI detects this
    itself. Only effective before MPI starts, and never overrides the user's setting.
    """
    if "mpi4py.MPI" in sys.modules:
        return
    from ringcomm.comm.launch import detect

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if detect().local_size > cores:
        os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def import_mpi() -> Any:
    """Import ``mpi4py.MPI`` or raise RuntimeError saying what to install."""
    yield_when_oversubscribed()
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError(
            "the MPI backend needs mpi4py and an MPI library: pip install 'ringcomm[mpi]' "
            f"(mpi4py + the mpich wheel), or mpi4py built against your site MPI ({err})"
        ) from err
    return MPI


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """``a`` itself, or its bytes where MPI has no type for it (bfloat16 from ml_dtypes)."""
    return a.view(np.uint8) if a.dtype.kind == "V" else a


class _Pair:
    """A send and a receive posted together; ``wait()`` completes both."""

    __slots__ = ("_MPI", "_reqs")

    def __init__(self, MPI: Any, reqs: list[Any]) -> None:
        self._MPI, self._reqs = MPI, reqs

    def wait(self) -> None:
        self._MPI.Request.Waitall(self._reqs)


class MPITransport(TransportBase):
    """The Transport over an mpi4py intracommunicator.

    Args:
        mpi_comm: the MPI communicator to run on (``MPI.COMM_WORLD`` by default); it is
            duplicated, so ringcomm's messages never match the application's.

    Raises:
        RuntimeError: mpi4py is missing (saying what to install).
        TypeError: ``mpi_comm`` is not an mpi4py intracommunicator.
    """

    backend = "mpi"

    def __init__(self, mpi_comm: Any = None) -> None:
        MPI = import_mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(base, MPI.Comm) or base == MPI.COMM_NULL:
            raise TypeError(f"mpi_comm must be an mpi4py intracommunicator, got {base!r}")
        self._MPI = MPI
        self._ring, self._p2p, self._ctl = base.Dup(), base.Dup(), base.Dup()
        local = base.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self.cuda_aware = staging.cuda_aware(MPI)
        self._device_stage: staging.DeviceStaging | None = None
        super().__init__(base.Get_rank(), base.Get_size(), local_rank=local_rank,
                         local_size=local_size)

    # ------------------------------------------------------------------------ primitives
    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int, *,
                  channel: int = RING) -> Any:
        comm, tag = (self._ring, _RING_TAG) if channel == RING else (self._p2p, _P2P_TAG)
        if (type(send) is np.ndarray and type(recv) is np.ndarray
                and "V" not in (send.dtype.kind, recv.dtype.kind)):  # the common, host case
            return _Pair(self._MPI, [comm.Irecv(recv, source, tag), comm.Isend(send, dest, tag)])
        if _ops.is_device_array(send) or _ops.is_device_array(recv):
            return self._device_staging().isendrecv(comm, tag, send, dest, recv, source)
        reqs = []
        if recv is not None:
            reqs.append(comm.Irecv(_as_bytes(recv), source, tag))
        if send is not None:
            reqs.append(comm.Isend(_as_bytes(send), dest, tag))
        return _Pair(self._MPI, reqs)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._ctl.Allgather(send, recv)

    def allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64).tolist()
        if not (_ops.is_device_array(x) or _ops.is_device_array(out)):
            # As bytes: MPI has no type for bfloat16 and the like, and nothing is reduced.
            item = x.itemsize
            self._ctl.Allgatherv(x.view(np.uint8), [out.view(np.uint8), (
                [c * item for c in counts], [d * item for d in displs])])
            return
        self._device_staging().allgatherv(self._ctl, x, counts, displs, out)

    def broadcast(self, x: Any, root: int) -> None:
        if not _ops.is_device_array(x):
            self._ctl.Bcast(x.view(np.uint8), root)
            return
        self._device_staging().broadcast(self._ctl, x, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._ctl.allgather(obj)

    def barrier(self) -> None:
        self._ctl.Barrier()

    def split(self, color: int, key: int) -> MPITransport:
        """``MPI_Comm_split`` of this transport's ranks (collective)."""
        color, key = check_split(color, key)
        sub = self._ctl.Split(color, key)
        try:
            return MPITransport(sub)
        finally:
            sub.Free()

    def close(self) -> None:
        self.release_scratch()
        for comm in (self._ring, self._p2p, self._ctl):
            comm.Free()

    # --------------------------------------------------------------------------- staging
    def _device_staging(self) -> staging.DeviceStaging:
        """How device arrays travel (created with the first one: it needs CuPy)."""
        if self._device_stage is None:
            self._device_stage = staging.DeviceStaging(self._MPI, self.cuda_aware)
        return self._device_stage


class MPICommunicator(Communicator):
    """The Communicator over MPI; the allreduce is ringcomm's own pipelined ring.

    Args:
        mpi_comm: the MPI communicator to run on (``MPI.COMM_WORLD`` by default); it is
            duplicated, so ringcomm's messages never match the application's.
        consistency_check: check before each collective that every rank passed matching
            arguments (one small allgather; see README, "Consistency check").
        segment_bytes: ring segment size; the measured default when None.
        inline_bytes: see ``ringcomm.init``.
    """

    def __init__(self, mpi_comm: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None) -> None:
        super().__init__(MPITransport(mpi_comm), consistency_check=consistency_check,
                         segment_bytes=segment_bytes, inline_bytes=inline_bytes)

    @property
    def cuda_aware(self) -> bool:
        """Whether device arrays go to MPI directly (else staged through host memory)."""
        return self.transport.cuda_aware


def install_abort_hook() -> None:
    """Make an uncaught exception on one rank end the whole job instead of hanging it.

    Without this, the failing rank waits in MPI_Finalize while the others wait for its messages.
    The hook prints the traceback, then calls ``MPI_Abort`` (as ``python -m mpi4py`` does).
    """
    previous = sys.excepthook
    if getattr(previous, "_ringcomm_abort", False):
        return

    def hook(etype: Any, value: Any, tb: Any) -> None:
        previous(etype, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        try:
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized():
                MPI.COMM_WORLD.Abort(1)
        except Exception:
            pass

    hook._ringcomm_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook
