"""NCCL backend: one NCCL communicator per process on its local GPU for CuPy arrays, and a host
transport for NumPy arrays.

:class:`NCCLTransport` (in :mod:`ringcomm.backends._nccl_transport`) implements the Transport over
one NCCL communicator; :class:`NCCLCommunicator` is the Communicator over it.

NCCL is called through ctypes over the ``libnccl.so.2`` of the nvidia-nccl-cu12 wheel (see
:mod:`ringcomm.backends._nccl_lib`), not through ``cupy.cuda.nccl``: whether CuPy finds the wheel's
library depends on the library preloading of the CuPy release (ringcomm accepts CuPy 13 and
14), while a library loaded by path works with any CuPy and with NCCL's cu13 wheel; and CuPy's
wrapper does not expose ``ncclGetLastError``, whose text every NCCL error here carries.

Rendezvous (:mod:`ringcomm.backends._nccl_setup`): the unique id travels over MPI in
mpiexec-launched jobs and over torch.distributed's store under torchrun. Before NCCL starts,
the ranks exchange their problems (no GPU, no NCCL) and GPU identities, so that a rank that
cannot start, or two ranks on one GPU, give a clear error on every rank instead of a hang or
NCCL's own message.

Both kinds of arrays, as PyTorch's ``cpu:gloo,cuda:nccl``: CuPy arrays go over NCCL, NumPy
arrays over the communicator's host transport, which is the MPI transport of the rendezvous in
MPI-launched jobs, and otherwise (torchrun, a lone process) NCCL itself, host arrays staged
through device buffers (:mod:`ringcomm.backends._nccl_host`). The per-call agreement covers the
array kind, so every rank takes the same path.

Streams: every collective is enqueued on the caller's current CuPy stream and returns without
waiting for the GPU. The ring's exchanges (channel RING) run on a stream of their own, after
the work already on the current stream; the request's ``wait()`` makes the current stream wait
for the transfer (the host does not block), so the ring's reductions overlap the next transfer.

Device: all of the transport's work runs with its GPU current (a fresh ``cupy.cuda.Device``
context each time: a shared one is not safe across threads), whichever thread calls it.

Failures: where the host waits for the GPU (``barrier``, ``close``, the agreement without MPI,
copies between host and device, and ringcomm.torch's results), it polls instead of
blocking (:mod:`ringcomm.backends._nccl_wait`): an asynchronous NCCL error, or the communicator's
timeout, aborts the NCCL communicator (``ncclCommAbort``) and raises an error naming the
collective; the communicator then refuses every call.
"""

from __future__ import annotations

import os
from typing import Any, cast

from ringcomm.backends import _nccl_lib, _nccl_setup
from ringcomm.backends._nccl_transport import NCCLTransport
from ringcomm.backends._nccl_wait import NCCLAsyncError, wait_for_stream
from ringcomm.comm.base import Communicator
from ringcomm.ops import _cuda_stack

__all__ = ["NCCLAsyncError", "NCCLCommunicator", "NCCLTransport", "usable",
           "usable_everywhere", "wait_for_stream"]


_usable: list[bool] = []


def usable() -> bool:
    """Whether this process sees a CUDA GPU and can load NCCL; never raises, cached.

    Without CUDA's driver library no GPU is visible (CuPy is then not imported); else NCCL is
    loaded (a dlopen, no GPU needed); the device count is asked last, and a failing CUDA driver
    only makes the answer False.
    """
    if not _usable:
        # An empty CUDA_VISIBLE_DEVICES (or -1) hides every GPU; unset shows them all.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ok = (visible is None or visible.strip() not in ("", "-1")) \
            and _cuda_stack.driver_loads()
        if ok:
            try:
                _nccl_lib.load()
                ok = _nccl_setup.device_count(_nccl_setup.import_cupy())[0] > 0
            except Exception:
                ok = False
        _usable.append(ok)
    return _usable[0]


def usable_everywhere(mpi_comm: Any = None, timeout: float | None = None) -> bool:
    """Whether NCCL can run on every rank: each has NCCL and a GPU of its own. Collective.

    What ``backend="auto"`` needs in a job of several processes: the ranks must all choose
    alike, and NCCL refuses two ranks on one GPU (more ranks than GPUs on a host).

    Args:
        mpi_comm: as for NCCLCommunicator; every rank of it must call.
        timeout: how long the ranks' exchange may wait for a rank (seconds; the default
            timeout when None).

    Raises:
        CollectiveTimeoutError: a rank did not come within ``timeout``.
    """
    return _nccl_setup.every_rank_can_start(mpi_comm, timeout)


class NCCLCommunicator(Communicator):
    """Collectives over NCCL on CuPy arrays, one GPU per process, and over the host transport
    on NumPy arrays (see NCCLTransport).

    Dense allreduce of CuPy arrays is NCCL's own, reduce_scatter too where the length divides
    evenly by the size (the ring otherwise); compressed allreduce runs the ring with the GPU
    kernels. 16-bit floats are summed by NCCL in their own precision (the ring sums them in
    float32). NumPy arrays take the path they take on the MPI backend where MPI launched the
    job, and NCCL through device buffers otherwise. Every rank of a call must pass the same
    kind of array (checked with the other arguments).

    Args:
        mpi_comm: mpi4py communicator whose ranks form this one (``MPI.COMM_WORLD`` by
            default); it carries the unique id and the per-call agreement. Under torchrun
            without it, torch.distributed's store carries the unique id, and the agreement
            is a small NCCL allgather that waits for the current stream once per call.
        consistency_check: check before each collective that every rank passed matching
            arguments (one small host-side allgather).
        segment_bytes: ring segment size for the ring paths; the measured default when None.
        inline_bytes: see ``ringcomm.init``.
        device: CUDA device to use instead of the one the local rank picks.
        timeout: as for :func:`ringcomm.init`: host-side exchanges and every host wait for
            the GPU (see NCCLTransport).
        abort_on_timeout: end the job when a wait times out or NCCL reports an asynchronous
            error (True), or raise the error (False); either way the NCCL communicator is
            aborted first, and refuses every later call.
        options: the Communicator's own (``algorithm``, ``topology``, ``startup_error``).

    Raises:
        RuntimeError: CuPy, NCCL or a GPU is missing (naming what to install), two ranks
            would share one GPU, or NCCL failed to start (with NCCL's error text).
        ValueError: a bad ``inline_bytes`` or ``timeout``.
    """

    def __init__(self, mpi_comm: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None,
                 device: int | None = None, timeout: float | None = None,
                 abort_on_timeout: bool = True, **options: Any) -> None:
        super().__init__(NCCLTransport(mpi_comm, device=device, timeout=timeout,
                                       abort_on_timeout=abort_on_timeout),
                         consistency_check=consistency_check, segment_bytes=segment_bytes,
                         inline_bytes=inline_bytes, **options)

    @property
    def device(self) -> Any:
        """The cupy.cuda.Device this communicator runs on."""
        return cast(NCCLTransport, self.transport).device

    @property
    def nccl_version(self) -> str:
        """The NCCL library's version, as "2.21.5"."""
        return cast(NCCLTransport, self.transport).nccl_version

