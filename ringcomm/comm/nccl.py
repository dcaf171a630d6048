"""NCCL backend: collectives on CuPy arrays, one NCCL communicator per process on its local GPU.

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
waiting for the GPU. The ring's ``isendrecv`` runs on a stream of its own, after the work
already on the current stream; the request's ``wait()`` makes the current stream wait for the
transfer (the host does not block), so the ring's reductions overlap the next transfer.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm import _nccl_lib, _nccl_setup
from ringcomm.comm.base import Communicator, ReduceOp

__all__ = ["NCCLCommunicator", "usable", "usable_everywhere"]

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


class NCCLCommunicator(Communicator):
    """Collectives over NCCL on CuPy arrays; dense allreduce is NCCL's own.

    Each process drives one GPU: local rank (among this communicator's ranks on the host)
    modulo the visible device count, made the current CuPy device. Collectives run on the
    current stream. reduce_scatter is NCCL's where the length divides evenly by the size, the
    ring otherwise; compressed allreduce runs the ring over ``isendrecv`` with the GPU kernels.
    16-bit floats are summed by NCCL in their own precision (the ring sums them in float32).

    Args:
        mpi_comm: mpi4py communicator whose ranks form this one (``MPI.COMM_WORLD`` by
            default); it carries the unique id and the per-call agreement. Under torchrun
            without it, torch.distributed's store carries the unique id, and the agreement
            is a small NCCL allgather that waits for the current stream once per call.
        consistency_check: check before each collective that every rank passed matching
            arguments (one small host-side allgather).
        segment_bytes: ring segment size for the ring paths; the measured default when None.
        device: CUDA device to use instead of the one the local rank picks.

    Raises:
        RuntimeError: CuPy, NCCL or a GPU is missing (naming what to install), two ranks
            would share one GPU, or NCCL failed to start (with NCCL's error text).
    """

    backend = "nccl"
    _shared: ClassVar[list[tuple[Any, NCCLCommunicator]]] = []

    def __init__(self, mpi_comm: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None,
                 device: int | None = None) -> None:
        rdv = _nccl_setup.connect(mpi_comm)
        self._rdv = rdv
        try:
            super().__init__(rdv.rank, rdv.size, consistency_check=consistency_check,
                             segment_bytes=segment_bytes, inline_bytes=inline_bytes)
            self._start(device)
        except BaseException:
            rdv.close()
            raise

    def _start(self, device: int | None) -> None:
        """Check every rank can start, then create the NCCL communicator."""
        problem, setup = None, None
        try:
            setup = _nccl_setup.local_setup(self._rdv.local_rank, device, self._rank == 0)
        except RuntimeError as err:
            problem = str(err)
        identities = _nccl_setup.startup_exchange(
            self._rdv, problem, setup.identity if setup else None)
        _nccl_setup.check_distinct_devices(identities)
        assert setup is not None
        uid = self._rdv.bcast_bytes(setup.uid, 0)
        cupy = setup.cupy
        self._cupy, self._lib, self._cuda = cupy, setup.lib, cupy.cuda
        self._device_id = setup.device
        self._device = cupy.cuda.Device(setup.device)
        # Arrays the application creates next belong on this GPU, as with torch.cuda.set_device.
        self._device.use()
        with self._device:
            self._nccl = _nccl_lib.NCCLComm(setup.lib, self._size, uid, self._rank)
            self._p2p_stream = cupy.cuda.Stream(non_blocking=True)
            self._word = cupy.zeros(1, np.int32)
            self._fixed: dict[int, tuple[Any, Any]] = {}

    @classmethod
    def shared(cls, world: Any) -> NCCLCommunicator:
        """The communicator over mpi4py communicator ``world``, created on first use.

        Every rank of ``world`` must make the first call together (it creates an NCCL
        communicator); later calls return the same object until it is closed.
        """
        for w, comm in cls._shared:
            if w is world and not comm.closed:
                return comm
        comm = cls(mpi_comm=world)
        cls._shared.append((world, comm))
        return comm

    # ----------------------------------------------------------------------------- properties
    @property
    def device(self) -> Any:
        """The cupy.cuda.Device this communicator runs on."""
        return self._device

    @property
    def local_rank(self) -> int:
        """This rank's position among the communicator's ranks on its host."""
        return self._rdv.local_rank

    @property
    def local_size(self) -> int:
        """How many of the communicator's ranks run on this host."""
        return self._rdv.local_size

    @property
    def nccl_version(self) -> str:
        """The NCCL library's version, as "2.21.5"."""
        return self._lib.version_string

    # ---------------------------------------------------------------------------- hooks
    def _check_arrays(self, *arrays: Any) -> None:
        err = self._foreign(*arrays)
        if err is not None:
            raise err

    def _reduce_scatter_dense(self, x: Any, op: ReduceOp) -> Any:
        """ncclReduceScatter when the length divides by the size, the ring otherwise (same
        chunks: rank r gets ``[r * L // size, (r + 1) * L // size)``)."""
        if x.size % self._size:
            return super()._reduce_scatter_dense(x, op)
        count = x.size // self._size
        with self._device:
            out = self._cupy.empty((count,), x.dtype)
            if count:
                self._reduce("ncclReduceScatter", x, out, count, op)
            moved = count * x.itemsize * (self._size - 1)
            self.stats.add(moved, moved)
        return out

    def native_allreduce(self, x: Any, y: Any, op: str | ReduceOp = "sum") -> Any:
        """Run NCCL's own allreduce of ``x`` into ``y`` on the current stream; returns ``y``.

        No agreement, no staging: the benchmark's baseline. ``x`` and ``y`` are contiguous
        CuPy arrays of one size and dtype on this communicator's GPU (``y`` may be ``x``).

        Raises:
            TypeError: not CuPy arrays, or dtypes differ.
            ValueError: sizes differ, an array is not contiguous, or an unknown op.
        """
        self._ensure_open()
        err = self._foreign(x, y)
        if err is not None:
            raise err
        if x.dtype != y.dtype:
            raise TypeError(f"y has dtype {y.dtype}, expected {x.dtype}")
        if x.size != y.size or not (x.flags.c_contiguous and y.flags.c_contiguous):
            raise ValueError(f"expected contiguous x and y of one size, got sizes {x.size} "
                             f"and {y.size}")
        if x.size:
            self._reduce("ncclAllReduce", x, y, x.size, ReduceOp.parse(op))
        return y

    # ------------------------------------------------------------------------ primitives
    def _allreduce_dense(self, x: Any, out: Any, op: ReduceOp) -> None:
        self._reduce("ncclAllReduce", x, out, x.size, op)
        # Counted as NCCL's ring moves it: 2 (n - 1) / n of the array each way.
        moved = 2 * (self._size - 1) * x.nbytes // self._size
        self.stats.add(moved, moved)

    def isendrecv(self, send: Any | None, dest: int, recv: Any | None,
                  source: int) -> _Transfer:
        cuda = self._cuda
        with self._device:
            ready = cuda.Event(disable_timing=True)
            ready.record(cuda.get_current_stream())
            self._p2p_stream.wait_event(ready)
            self._nccl.sendrecv(_span(send), dest, _span(recv), source, self._p2p_stream.ptr)
            done = cuda.Event(disable_timing=True)
            done.record(self._p2p_stream)
        return _Transfer(cuda, done, (send, recv))

    def _user_isendrecv(self, send: Any, dest: int, recv: Any, source: int) -> _Enqueued:
        # One NCCL communicator serves both: NCCL matches a pair's messages in the order they
        # are issued, and a collective issues all of its messages before it returns, so a
        # user's message can never be taken for one of a collective's.
        with self._device:
            self._nccl.sendrecv(_span(send), dest, _span(recv), source, self._stream())
        return _ENQUEUED

    def _allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        if self._rdv.allgather_fixed(send, recv):
            return
        # No MPI (torchrun): through NCCL, staged in device buffers kept per size.
        with self._device:
            bufs = self._fixed.get(send.nbytes)
            if bufs is None:
                bufs = self._fixed[send.nbytes] = (
                    self._cupy.empty(send.nbytes, np.uint8),
                    self._cupy.empty(recv.shape, np.uint8))
            dsend, drecv = bufs
            dsend.set(send.reshape(-1))
            self._nccl.allgather(dsend.data.ptr, drecv.data.ptr, send.nbytes, self._stream())
            drecv.get(out=recv)

    def _allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        item = x.itemsize
        with self._device:
            stream = self._stream()
            if len(set(counts)) == 1:
                self._nccl.allgather(x.data.ptr, out.data.ptr, counts[0] * item, stream)
                return
            self._nccl.gatherv(x.data.ptr, out.data.ptr, [c * item for c in counts], stream)
            mine = counts[self._rank] * item
            if mine:
                at = out.data.ptr + sum(counts[: self._rank]) * item
                self._cuda.runtime.memcpyAsync(at, x.data.ptr, mine, _MEMCPY_DEFAULT, stream)

    def _broadcast(self, x: Any, root: int) -> None:
        with self._device:
            self._nccl.broadcast(x.data.ptr, x.nbytes, root, self._stream())

    def _allgather_object(self, obj: Any) -> list[Any]:
        return self._rdv.allgather_object(obj)

    def _barrier(self) -> None:
        # A one-word allreduce, then wait for it: returns once every rank has issued it, and
        # after this rank's earlier GPU work on the current stream.
        with self._device:
            stream = self._cuda.get_current_stream()
            ptr = self._word.data.ptr
            self._nccl.reduce("ncclAllReduce", ptr, ptr, 1, _INT32, _nccl_lib.OPS["sum"],
                              stream.ptr)
            stream.synchronize()

    def _close(self) -> None:
        type(self)._shared[:] = [(w, c) for w, c in self._shared if c is not self]
        try:
            with self._device:
                self._p2p_stream.synchronize()
                self._cuda.get_current_stream().synchronize()
                self._nccl.destroy()
        finally:
            self._fixed.clear()
            self._rdv.close()

    # ---------------------------------------------------------------------------- helpers
    def _stream(self) -> int:
        return self._cuda.get_current_stream().ptr

    def _reduce(self, name: str, x: Any, out: Any, count: int, op: ReduceOp) -> None:
        """Enqueue ncclAllReduce or ncclReduceScatter of ``count`` elements per output."""
        code = _nccl_lib.DTYPES.get(x.dtype.name)
        if code is None:
            raise TypeError(f"NCCL cannot reduce dtype {x.dtype.name}")
        with self._device:
            self._nccl.reduce(name, x.data.ptr, out.data.ptr, count, code,
                              _nccl_lib.OPS[op.value], self._stream())

    def _foreign(self, *arrays: Any) -> Exception | None:
        """Why NCCL cannot take these arrays (not CuPy, or on another GPU), or None."""
        for a in arrays:
            if a is None:
                continue
            if not _ops.is_device_array(a):
                kind = f"{type(a).__module__}.{type(a).__name__}"
                return TypeError(
                    f"the NCCL backend takes CuPy arrays, got {kind}; move the data to the GPU "
                    "with cupy.asarray(x), or use ringcomm.init(backend='mpi') for NumPy arrays")
            if a.device.id != self._device_id:
                return ValueError(f"array is on GPU {a.device.id}, but this communicator runs "
                                  f"on GPU {self._device_id}")
        return None


def _span(x: Any) -> tuple[int, int] | None:
    """(device pointer, bytes) of a CuPy array, or None."""
    if x is None:
        return None
    if not _ops.is_device_array(x):
        raise TypeError(f"the NCCL backend sends CuPy arrays, got {type(x).__name__}")
    return x.data.ptr, x.nbytes
