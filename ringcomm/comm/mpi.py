"""MPI backend (mpi4py): NumPy arrays, and CuPy arrays through CUDA-aware MPI or host staging."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm.base import Communicator

__all__ = ["MPICommunicator", "import_mpi", "install_abort_hook", "yield_when_oversubscribed"]

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


def _cuda_aware(MPI: Any) -> bool:
    """Whether the MPI library takes device pointers (as mpi4py's config reports it)."""
    try:
        from mpi4py import get_config

        return bool(get_config().get("cuda_aware", False))
    except Exception:
        return False


class _Pair:
    """A send and a receive posted together; ``wait()`` completes both."""

    __slots__ = ("_MPI", "_after", "_reqs")

    def __init__(self, MPI: Any, reqs: list[Any], after: Any = None) -> None:
        self._MPI, self._reqs, self._after = MPI, reqs, after

    def wait(self) -> None:
        self._MPI.Request.Waitall(self._reqs)
        if self._after is not None:
            self._after()


class MPICommunicator(Communicator):
    """Collectives over an MPI communicator; the allreduce is ringcomm's own pipelined ring.

    Args:
        mpi_comm: the MPI communicator to run on (``MPI.COMM_WORLD`` by default); it is
            duplicated, so ringcomm's messages never match the application's.
        consistency_check: check before each collective that every rank passed matching
            arguments (one small allgather; see README, "Consistency check").
        segment_bytes: ring segment size; the measured default when None.
    """

    backend = "mpi"

    def __init__(self, mpi_comm: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None) -> None:
        MPI = import_mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(base, MPI.Comm) or base == MPI.COMM_NULL:
            raise TypeError(f"mpi_comm must be an mpi4py intracommunicator, got {base!r}")
        self._MPI = MPI
        self._ring = base.Dup()
        self._p2p = base.Dup()
        self._ctl = base.Dup()
        local = base.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self.cuda_aware = _cuda_aware(MPI)
        super().__init__(base.Get_rank(), base.Get_size(), consistency_check=consistency_check,
                         segment_bytes=segment_bytes)

    # ------------------------------------------------------------------------ primitives
    def _isendrecv_on(self, comm: Any, tag: int, send: Any, dest: int, recv: Any,
                      source: int) -> _Pair:
        if type(send) is np.ndarray and type(recv) is np.ndarray:  # the common, host case
            return _Pair(self._MPI, [comm.Irecv(recv, source, tag), comm.Isend(send, dest, tag)])
        after = None
        if recv is not None and not self._direct(recv):
            host_recv = np.empty(recv.shape, recv.dtype)
            device_recv = recv

            def after() -> None:  # copy the staged message to the device once it has arrived
                device_recv.set(host_recv)

            recv = host_recv
        reqs = []
        if recv is not None:
            reqs.append(comm.Irecv(recv, source, tag))
        if send is not None:
            reqs.append(comm.Isend(self._host(send), dest, tag))
        return _Pair(self._MPI, reqs, after)

    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int) -> _Pair:
        return self._isendrecv_on(self._ring, _RING_TAG, send, dest, recv, source)

    def _user_isendrecv(self, send: Any, dest: int, recv: Any, source: int) -> _Pair:
        return self._isendrecv_on(self._p2p, _P2P_TAG, send, dest, recv, source)

    def _allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._ctl.Allgather(send, recv)

    def _allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64).tolist()
        if self._direct(x):
            self._ctl.Allgatherv(x, [out, (counts, displs)])
            return
        host_out = np.empty(out.shape, out.dtype)
        self._ctl.Allgatherv(self._host(x), [host_out, (counts, displs)])
        out.set(host_out)

    def _broadcast(self, x: Any, root: int) -> None:
        if self._direct(x):
            self._ctl.Bcast(x, root)
            return
        host = self._host(x)
        self._ctl.Bcast(host, root)
        x.set(host)

    def _allgather_object(self, obj: Any) -> list[Any]:
        return self._ctl.allgather(obj)

    def _barrier(self) -> None:
        self._ctl.Barrier()

    def _close(self) -> None:
        for comm in (self._ring, self._p2p, self._ctl):
            comm.Free()

    # --------------------------------------------------------------------------- staging
    def _direct(self, x: Any) -> bool:
        """Whether MPI may read/write ``x`` itself (host memory, or CUDA-aware MPI)."""
        return not _ops.is_device_array(x) or self.cuda_aware

    def _host(self, x: Any) -> Any:
        return x if self._direct(x) else x.get()


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
