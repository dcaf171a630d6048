"""NCCL backend: collectives on CuPy arrays, one NCCL communicator per process on its local GPU.

:class:`NCCLTransport` implements the Transport over one NCCL communicator;
:class:`NCCLCommunicator` is the Communicator over it.

NCCL is called through ctypes over the ``libnccl.so.2`` of the nvidia-nccl-cu12 wheel (see
:mod:`ringcomm.comm._nccl_lib`), not through ``cupy.cuda.nccl``: whether CuPy finds the wheel's
library depends on the library preloading of the CuPy release (ringcomm accepts CuPy 13 and
14), while a library loaded by path works with any CuPy and with NCCL's cu13 wheel; and CuPy's
wrapper does not expose ``ncclGetLastError``, whose text every NCCL error here carries.

Rendezvous (:mod:`ringcomm.comm._nccl_setup`): the unique id travels over MPI in
mpiexec-launched jobs and over torch.distributed's store under torchrun. Before NCCL starts,
the ranks exchange their problems (no GPU, no NCCL) and GPU identities, so that a rank that
cannot start, or two ranks on one GPU, give a clear error on every rank instead of a hang or
NCCL's own message.

Streams: every collective is enqueued on the caller's current CuPy stream and returns without
waiting for the GPU. The ring's exchanges (channel RING) run on a stream of their own, after
the work already on the current stream; the request's ``wait()`` makes the current stream wait
for the transfer (the host does not block), so the ring's reductions overlap the next transfer.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm import _nccl_lib, _nccl_setup
from ringcomm.comm.base import Communicator
from ringcomm.comm.transport import TransportBase, agree_split
from ringcomm.comm.types import RING, ReduceOp, Request

__all__ = ["NCCLCommunicator", "NCCLTransport", "usable", "usable_everywhere"]

_INT32 = _nccl_lib.DTYPES["int32"]
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the pointers say where they live


_usable: list[bool] = []


def usable() -> bool:
    """Whether this process sees a CUDA GPU and can load NCCL; never raises, cached.

    NCCL is loaded first (a dlopen, no GPU needed); the device count is asked last, and a
    failing CUDA driver only makes the answer False.
    """
    if not _usable:
        # An empty CUDA_VISIBLE_DEVICES (or -1) hides every GPU; unset shows them all.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ok = visible is None or visible.strip() not in ("", "-1")
        if ok:
            try:
                _nccl_lib.load()
                ok = _nccl_setup.device_count(_nccl_setup.import_cupy())[0] > 0
            except Exception:
                ok = False
        _usable.append(ok)
    return _usable[0]


def usable_everywhere(mpi_comm: Any = None) -> bool:
    """Whether NCCL can run on every rank: each has NCCL and a GPU of its own. Collective.

    What ``backend="auto"`` needs in a job of several processes: the ranks must all choose
    alike, and NCCL refuses two ranks on one GPU (more ranks than GPUs on a host).

    Args:
        mpi_comm: as for NCCLCommunicator; every rank of it must call.
    """
    return _nccl_setup.every_rank_can_start(mpi_comm)


class _Transfer:
    """A posted ring exchange; ``wait()`` makes the current stream wait for it.

    It holds the arrays until then: CuPy's pool could otherwise hand their memory to new work
    on the current stream while the transfer stream still reads or writes it.
    """

    __slots__ = ("_arrays", "_cuda", "_event")

    def __init__(self, cuda: Any, event: Any, arrays: tuple[Any, Any]) -> None:
        self._cuda, self._event, self._arrays = cuda, event, arrays

    def wait(self) -> None:
        self._cuda.get_current_stream().wait_event(self._event)
        self._arrays = None


class _Enqueued:
    """An exchange enqueued on the current stream: later work there already follows it."""

    __slots__ = ()

    def wait(self) -> None:
        pass


_ENQUEUED = _Enqueued()


def _checked_setup(rdv: _nccl_setup.Rendezvous,
                   device: int | None) -> tuple[_nccl_setup.LocalSetup, bytes]:
    """Check every rank can start (raising the same error everywhere if one cannot), and
    return this rank's setup with rank 0's unique id."""
    problem, setup = None, None
    try:
        setup = _nccl_setup.local_setup(rdv.local_rank, device, rdv.rank == 0)
    except RuntimeError as err:
        problem = str(err)
    identities = _nccl_setup.startup_exchange(rdv, problem, setup.identity if setup else None)
    _nccl_setup.check_distinct_devices(identities)
    assert setup is not None
    return setup, rdv.bcast_bytes(setup.uid, 0)


class NCCLTransport(TransportBase):
    """The Transport over one NCCL communicator on this process's GPU (CuPy arrays only).

    The GPU is the local rank (among this transport's ranks on the host) modulo the visible
    device count; it becomes the current CuPy device. The host collectives travel over the
    rendezvous: MPI where there is one, else NCCL (``allgather_fixed``) or the store.

    Args:
        mpi_comm: mpi4py communicator whose ranks form this one (``MPI.COMM_WORLD`` by
            default); it carries the unique id and the host collectives. Under torchrun
            without it, torch.distributed's store carries the unique id.
        device: CUDA device to use instead of the one the local rank picks.
        timeout: seconds a rank waits for the others in a host-side exchange (the rendezvous
            and the per-call agreement over MPI or the store); 30 minutes when None.

    Raises:
        RuntimeError: CuPy, NCCL or a GPU is missing (naming what to install), two ranks
            would share one GPU, or NCCL failed to start (with NCCL's error text).
    """

    backend = "nccl"

    def __init__(self, mpi_comm: Any = None, *, device: int | None = None,
                 timeout: float | None = None) -> None:
        rdv = _nccl_setup.connect(mpi_comm, timeout)
        try:
            setup, uid = _checked_setup(rdv, device)
            gpu = setup.cupy.cuda.Device(setup.device)
            # Arrays the application creates next belong on this GPU, as with
            # torch.cuda.set_device.
            gpu.use()
            with gpu:
                nccl = _nccl_lib.NCCLComm.create(setup.lib, rdv.size, uid, rdv.rank)
            self._attach(rdv, setup.cupy, setup.lib, setup.device, nccl)
        except BaseException:
            rdv.close()
            raise

    def _attach(self, rdv: _nccl_setup.Rendezvous, cupy: Any, lib: _nccl_lib.NCCLLibrary,
                device: int, nccl: _nccl_lib.NCCLComm) -> None:
        """Become the transport over ``rdv`` and ``nccl`` on CUDA device ``device``."""
        super().__init__(rdv.rank, rdv.size, local_rank=rdv.local_rank,
                         local_size=rdv.local_size)
        self._rdv, self._cupy, self._cuda, self._lib, self._nccl = rdv, cupy, cupy.cuda, lib, nccl
        self._device_id = device
        self._open = True
        self.device = cupy.cuda.Device(device)
        self._fixed: dict[int, tuple[Any, Any]] = {}
        with self.device:
            self._p2p_stream = cupy.cuda.Stream(non_blocking=True)
            self._word = cupy.zeros(1, np.int32)

    @property
    def nccl_version(self) -> str:
        """The NCCL library's version, as "2.21.5"."""
        return self._lib.version_string

    # ------------------------------------------------------------------------ primitives
    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int, *,
                  channel: int = RING) -> Request:
        if channel != RING:
            # One NCCL communicator serves both channels: NCCL matches a pair's messages in
            # the order they are issued, and a collective issues all of its messages before
            # it returns, so a user's message can never be taken for one of a collective's.
            with self.device:
                self._nccl.sendrecv(_span(send), dest, _span(recv), source, self._stream())
            return _ENQUEUED
        cuda = self._cuda
        with self.device:
            ready = cuda.Event(disable_timing=True)
            ready.record(cuda.get_current_stream())
            self._p2p_stream.wait_event(ready)
            self._nccl.sendrecv(_span(send), dest, _span(recv), source, self._p2p_stream.ptr)
            done = cuda.Event(disable_timing=True)
            done.record(self._p2p_stream)
        return _Transfer(cuda, done, (send, recv))

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        if self._rdv.allgather_fixed(send, recv):
            return
        # No MPI (torchrun): through NCCL, staged in device buffers kept per size.
        with self.device:
            bufs = self._fixed.get(send.nbytes)
            if bufs is None:
                bufs = self._fixed[send.nbytes] = (
                    self._cupy.empty(send.nbytes, np.uint8),
                    self._cupy.empty(recv.shape, np.uint8))
            dsend, drecv = bufs
            dsend.set(send.reshape(-1))
            self._nccl.allgather(dsend.data.ptr, drecv.data.ptr, send.nbytes, self._stream())
            drecv.get(out=recv)

    def allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        item = x.itemsize
        with self.device:
            stream = self._stream()
            if len(set(counts)) == 1:
                self._nccl.allgather(x.data.ptr, out.data.ptr, counts[0] * item, stream)
                return
            self._nccl.gatherv(x.data.ptr, out.data.ptr, [c * item for c in counts], stream)
            mine = counts[self.rank] * item
            if mine:
                at = out.data.ptr + sum(counts[: self.rank]) * item
                self._cuda.runtime.memcpyAsync(at, x.data.ptr, mine, _MEMCPY_DEFAULT, stream)

    def broadcast(self, x: Any, root: int) -> None:
        with self.device:
            self._nccl.broadcast(x.data.ptr, x.nbytes, root, self._stream())

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._rdv.allgather_object(obj)

    def barrier(self) -> None:
        # A one-word allreduce, then wait for it: returns once every rank has issued it, and
        # after this rank's earlier GPU work on the current stream.
        with self.device:
            stream = self._cuda.get_current_stream()
            ptr = self._word.data.ptr
            self._nccl.reduce("ncclAllReduce", ptr, ptr, 1, _INT32, ReduceOp.SUM.spec.nccl,
                              stream.ptr)
            stream.synchronize()

    def check_arrays(self, *arrays: Any) -> None:
        """Raise unless every array (None skipped) is a CuPy array on this transport's GPU.

        Raises:
            TypeError: an array is not a CuPy array.
            ValueError: an array is on another GPU.
        """
        for a in arrays:
            if a is None:
                continue
            if not _ops.is_device_array(a):
                kind = f"{type(a).__module__}.{type(a).__name__}"
                raise TypeError(
                    f"the NCCL backend takes CuPy arrays, got {kind}; move the data to the GPU "
                    "with cupy.asarray(x), or use ringcomm.init(backend='mpi') for NumPy arrays")
            if a.device.id != self._device_id:
                raise ValueError(f"array is on GPU {a.device.id}, but this communicator runs "
                                 f"on GPU {self._device_id}")

    def native_allreduce(self, x: Any, out: Any, op: ReduceOp) -> bool:
        """Enqueue ncclAllReduce of flat ``x`` into flat ``out`` (which may be ``x``) on the
        current stream; True, since NCCL reduces every dtype and op ringcomm takes.

        16-bit floats are summed in their own precision (the ring sums them in float32).
        """
        if x.size:
            self._reduce("ncclAllReduce", x, out, x.size, op)
        # Counted as NCCL's ring moves it: 2 (n - 1) / n of the array each way.
        moved = 2 * (self.size - 1) * x.nbytes // self.size
        self.stats.add(moved, moved)
        return True

    def native_reduce_scatter(self, x: Any, op: ReduceOp) -> Any | None:
        """ncclReduceScatter when the length divides by the size; None otherwise (the ring
        runs, with the same chunks: rank r gets ``[r * L // size, (r + 1) * L // size)``)."""
        if x.size % self.size:
            return None
        count = x.size // self.size
        with self.device:
            out = self._cupy.empty((count,), x.dtype)
        if count:
            self._reduce("ncclReduceScatter", x, out, count, op)
        moved = count * x.itemsize * (self.size - 1)
        self.stats.add(moved, moved)
        return out

    def split(self, color: int, key: int) -> NCCLTransport:
        """A transport over the ranks passing ``color``, ordered by (key, rank); collective.

        The rendezvous splits first (MPI_Comm_split, or the store's key space). The NCCL
        communicator is ``ncclCommSplit``'s where the library has it (NCCL >= 2.18); with an
        older NCCL, rank 0 of each new group makes a fresh unique id, shared over the group's
        rendezvous, and the group starts a communicator with it. Every rank runs the same NCCL
        (NCCL refuses mixed versions), so all take the same path.

        Raises:
            InvalidArgumentError, InvalidTypeError: invalid color or key on some rank (on
                every rank; see ``agree_split``).
            RuntimeError: NCCL failed (with NCCL's error text).
        """
        color, key = agree_split(self, color, key)[self.rank]
        rdv = self._rdv.split(color, key)
        try:
            with self.device:
                nccl = (self._nccl.split(color, key) if self._lib.can_split
                        else self._fresh_comm(rdv))
                if (nccl.rank, nccl.size) != (rdv.rank, rdv.size):
                    nccl.destroy()
                    raise RuntimeError(
                        f"split: NCCL made this rank {nccl.rank} of {nccl.size}, the rendezvous "
                        f"{rdv.rank} of {rdv.size}")
            child = NCCLTransport.__new__(NCCLTransport)
            child._attach(rdv, self._cupy, self._lib, self._device_id, nccl)
        except BaseException:
            rdv.close()
            raise
        return child

    def close(self) -> None:
        """Wait for this transport's GPU work, then free the NCCL communicator. Idempotent."""
        if not self._open:
            return
        self._open = False
        try:
            with self.device:
                self._p2p_stream.synchronize()
                self._cuda.get_current_stream().synchronize()
                self._nccl.destroy()
        finally:
            self._fixed.clear()
            self.release_scratch()
            self._rdv.close()

    # ---------------------------------------------------------------------------- helpers
    def _stream(self) -> int:
        return self._cuda.get_current_stream().ptr

    def _reduce(self, name: str, x: Any, out: Any, count: int, op: ReduceOp) -> None:
        """Enqueue ncclAllReduce or ncclReduceScatter of ``count`` elements per output."""
        code = _nccl_lib.dtype_code(x.dtype)
        with self.device:
            self._nccl.reduce(name, x.data.ptr, out.data.ptr, count, code, op.spec.nccl,
                              self._stream())

    def _fresh_comm(self, rdv: _nccl_setup.Rendezvous) -> _nccl_lib.NCCLComm:
        """A new NCCL communicator over ``rdv``'s ranks, from a unique id of its rank 0
        (shared with an allgather, so that a failure to make one reaches every rank)."""
        mine: bytes | str | None = None
        if rdv.rank == 0:
            try:
                mine = self._lib.unique_id()
            except _nccl_lib.NCCLError as err:
                mine = str(err)
        uid = rdv.allgather_object(mine)[0]
        if isinstance(uid, str):
            raise RuntimeError(f"split: rank 0 of the new group has no NCCL unique id: {uid}")
        return _nccl_lib.NCCLComm.create(self._lib, rdv.size, uid, rdv.rank)


class NCCLCommunicator(Communicator):
    """Collectives over NCCL on CuPy arrays, one GPU per process (see NCCLTransport).

    Dense allreduce is NCCL's own, reduce_scatter too where the length divides evenly by the
    size (the ring otherwise); compressed allreduce runs the ring with the GPU kernels. 16-bit
    floats are summed by NCCL in their own precision (the ring sums them in float32).

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
        timeout: as for :func:`ringcomm.init` (host-side exchanges; see NCCLTransport).

    Raises:
        RuntimeError: CuPy, NCCL or a GPU is missing (naming what to install), two ranks
            would share one GPU, or NCCL failed to start (with NCCL's error text).
        ValueError: a bad ``inline_bytes``.
    """

    def __init__(self, mpi_comm: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None,
                 device: int | None = None, timeout: float | None = None) -> None:
        super().__init__(NCCLTransport(mpi_comm, device=device, timeout=timeout),
                         consistency_check=consistency_check, segment_bytes=segment_bytes,
                         inline_bytes=inline_bytes)

    @property
    def device(self) -> Any:
        """The cupy.cuda.Device this communicator runs on."""
        return self.transport.device

    @property
    def nccl_version(self) -> str:
        """The NCCL library's version, as "2.21.5"."""
        return self.transport.nccl_version


def _span(x: Any) -> tuple[int, int] | None:
    """(device pointer, bytes) of a CuPy array, or None."""
    if x is None:
        return None
    if not _ops.is_device_array(x):
        raise TypeError(f"the NCCL backend sends CuPy arrays, got {type(x).__name__}")
    return x.data.ptr, x.nbytes
