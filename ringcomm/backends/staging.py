"""Device (CuPy) arrays over MPI: handed to a CUDA-aware MPI as they are, otherwise staged
through page-locked host buffers that are reused between calls (:class:`PinnedCopies`, which
the gloo transport stages its messages with too).

Which device: :class:`~ringcomm.backends.cuda_device.DeviceChoice` selects one per process,
with the first device array (``local_rank % device_count``, or the device asked for), and the
transport runs its device work with it current.

Ordering with the GPU: kernels run asynchronously on the current CuPy stream, and MPI knows
nothing of it. The host waits for that stream (one synchronize per call, none where nothing
needs it) exactly where MPI is about to touch memory that queued GPU work writes or reads:

- a staged send: MPI reads the pinned copy, which the queued download fills;
- any device buffer handed to a CUDA-aware MPI: MPI reads a send, or writes a receive that a
  queued kernel may still read.

A staged receive needs no wait: MPI writes a pinned buffer that no queued copy uses (the pool
lends a buffer only once its last copy's event has completed), and its copy to the device is
queued on the stream after the receive completes, so the reduction that follows it is ordered
after the copy without the host waiting: with the ring's window of two exchanges, that copy and
that reduction overlap the next segment's transfer. A pure receive (a staged broadcast on a
rank other than the root, an allgather of host data into a device array) does not wait at all.

Bounded time: every wait for the peers goes through the ``wait`` the transport passes in
(``MPITransport.wait_all``: polled until its deadline). Staged collectives use MPI's
nonblocking forms; a CUDA-aware MPI gets its blocking collective (CUDA-aware Open MPI takes
device buffers in blocking collectives only), after a bounded barrier that makes sure every
rank has arrived. Waits for the GPU itself (stream synchronization) are local and unbounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.core.log import get_logger
from ringcomm.core.types import Array

__all__ = ["DeviceStaging", "PinnedCopies", "cuda_aware"]

_ENV = "RINGCOMM_MPI_CUDA_AWARE"
_MIN_PINNED = 1 << 16
_KEEP = 8  # idle pinned buffers kept per communicator
_NO_DEVICE = contextlib.nullcontext()
_LOG = get_logger("mpi")


def cuda_aware(MPI: Any) -> bool:
    """Whether the MPI library takes device pointers.

    ``RINGCOMM_MPI_CUDA_AWARE=0|1`` decides when set; otherwise the library is asked through
    ``MPIX_Query_cuda_support`` (Open MPI, MPICH >= 4.1), which reports both the build and the
    runtime setting. False when it cannot tell.

    Args:
        MPI: the ``mpi4py.MPI`` module (initialized).

    Returns:
        True when device buffers may be passed to MPI directly.
    """
    raw = os.environ.get(_ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return _mpix_query_cuda_support()


def _mpix_query_cuda_support() -> bool:
    """Call MPIX_Query_cuda_support() in the MPI library mpi4py has loaded (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "libmpi" in line and ".so" in line})
    except OSError:
        return False
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        return bool(query())
    return False


class _PinnedPool:
    """Page-locked host buffers, lent one per staged transfer and kept for the next calls.

    A buffer comes back with the CUDA event of the copy still reading or writing it; it is
    lent again only once that event has completed.
    """

    __slots__ = ("_cupy", "_idle")

    def __init__(self, cupy: Any) -> None:
        self._cupy = cupy
        self._idle: list[tuple[np.ndarray, Any]] = []

    def take(self, nbytes: int) -> np.ndarray:
        best = -1
        for i, (buf, event) in enumerate(self._idle):
            if buf.nbytes >= nbytes and (event is None or event.done) and (
                    best < 0 or buf.nbytes < self._idle[best][0].nbytes):
                best = i
        if best >= 0:
            return self._idle.pop(best)[0]
        # Powers of two: the ring's segment sizes map onto a few buffers.
        size = 1 << (max(nbytes, _MIN_PINNED) - 1).bit_length()
        return np.frombuffer(self._cupy.cuda.alloc_pinned_memory(size), np.uint8, size)

    def give(self, buf: np.ndarray, event: Any = None) -> None:
        self._idle.append((buf, event))
        if len(self._idle) > _KEEP:
            done = [i for i, (_, e) in enumerate(self._idle) if e is None or e.done]
            if done:
                self._idle.pop(min(done, key=lambda i: self._idle[i][0].nbytes))


class _Staged:
    """A posted exchange with device buffers; ``wait()`` completes it, queues the copies of
    staged receives to the device and returns a staged send's pinned buffer to the pool."""

    __slots__ = ("_downloads", "_peer", "_reqs", "_staging", "_uploads")

    def __init__(self, staging: DeviceStaging, reqs: list[Any], peer: int,
                 uploads: list[tuple[np.ndarray, Any]], downloads: list[np.ndarray]) -> None:
        self._staging, self._reqs, self._peer = staging, reqs, peer
        self._uploads, self._downloads = uploads, downloads

    def wait(self) -> None:
        staging = self._staging
        # Not in a finally: after a timeout MPI may still read the buffers, which must not
        # go back to the pool (the timed-out requests keep them alive).
        staging.wait(self._reqs, self._peer, "device exchange")
        for host in self._downloads:
            staging.release(host)
        for host, device in self._uploads:
            staging.upload(host, device)


def _unbounded_wait(MPI: Any) -> Callable[[list[Any], int | None, str], None]:
    """A ``wait`` that blocks in ``MPI_Waitall`` for as long as it takes."""

    def wait(reqs: list[Any], peer: int | None, what: str) -> None:
        MPI.Request.Waitall(reqs)

    return wait


def _counts(message: Any, counts: list[int], displs: list[int]) -> list[Any]:
    """A vector receive buffer of ``message`` (see DeviceStaging.message)."""
    if isinstance(message, list):
        return [message[0], (counts, displs), message[1]]
    return [message, (counts, displs)]


class PinnedCopies:
    """Copies between device (CuPy) arrays and page-locked host buffers lent from a pool and
    kept between calls: a transport that moves host bytes only stages device arrays with it
    (MPI without CUDA support, gloo). A download is queued on the current stream (synchronize
    before reading the buffer); an upload is queued too, and its buffer goes back to the pool
    with the copy's event, so it is lent again only once the copy has read it.

    Raises:
        RuntimeError: CuPy or a GPU is missing.
    """

    def __init__(self) -> None:
        from ringcomm.ops import _cuda_runtime

        self._cupy = _cuda_runtime.cp()
        self._pool = _PinnedPool(self._cupy)

    @property
    def cuda(self) -> Any:
        """CuPy's ``cupy.cuda`` (streams, events, devices)."""
        return self._cupy.cuda

    def synchronize(self) -> None:
        """Wait for the current stream (the downloads queued on it)."""
        self._cupy.cuda.get_current_stream().synchronize()

    def take(self, nbytes: int) -> np.ndarray:
        """A pinned buffer of at least ``nbytes`` that no queued copy uses (to receive into)."""
        return self._pool.take(nbytes)

    def download(self, x: Array) -> np.ndarray:
        """A pinned host buffer with device array ``x`` copied in (queued on the current
        stream: synchronize before reading it)."""
        host = self._pool.take(x.nbytes)
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(host.ctypes.data, x.data.ptr, x.nbytes, runtime.memcpyDeviceToHost,
                            self._cupy.cuda.get_current_stream().ptr)
        return host

    def upload(self, host: np.ndarray, x: Array) -> None:
        """Queue the copy of pinned ``host`` into device array ``x``; the buffer goes back to
        the pool with the copy's event, so it is not reused before the copy has read it."""
        stream = self._cupy.cuda.get_current_stream()
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(x.data.ptr, host.ctypes.data, x.nbytes, runtime.memcpyHostToDevice,
                            stream.ptr)
        self._pool.give(host, stream.record())

    def release(self, host: np.ndarray) -> None:
        """Return a pinned buffer no copy is using any more."""
        self._pool.give(host)


class DeviceStaging(PinnedCopies):
    """How one communicator moves CuPy arrays through MPI.

    Args:
        MPI: the ``mpi4py.MPI`` module.
        direct: pass device buffers to MPI as they are (CUDA-aware MPI).
        wait: ``wait(requests, peer, what)`` completes MPI requests (``peer`` the rank waited
            for, or None; ``what`` names the step), raising or ending the job when they take
            too long; ``MPI.Request.Waitall`` (unbounded) when None.

    Raises:
        RuntimeError: CuPy or a GPU is missing.
    """

    def __init__(self, MPI: Any, direct: bool, *,
                 wait: Callable[[list[Any], int | None, str], None] | None = None) -> None:
        super().__init__()
        self.MPI = MPI
        self.direct = direct
        self.wait = wait if wait is not None else _unbounded_wait(MPI)

    # ------------------------------------------------------------------------ pieces
    def _sync_before(self, staged_sends: bool, *arrays: Array) -> None:
        """Wait for the current stream where MPI is about to read what it produces: a staged
        send's download, or (CUDA-aware MPI) any of ``arrays`` on the device, which MPI reads
        or writes while queued kernels may still use it. Not for staged receives (see the
        module's docstring)."""
        device = _ops.is_device_array
        if staged_sends or (self.direct and any(device(a) for a in arrays)):
            self.synchronize()

    def message(self, buf: Array, like: Array) -> tuple[Any, int]:
        """The MPI buffer of ``like``'s data, and the factor from elements to its items.

        ``buf`` is ``like`` itself (a host array, or a device array for CUDA-aware MPI) or the
        pinned buffer that stages it. Dtypes MPI knows travel typed (so a host peer's message
        matches); others (bfloat16) as bytes.
        """
        if buf is like and not _ops.is_device_array(like):
            return like, 1
        if like.dtype.kind in "biufc":
            return (like if buf is like else buf[: like.nbytes].view(like.dtype)), 1
        if buf is like:
            address = self.MPI.buffer.fromaddress(like.data.ptr, like.nbytes)
            return [address, self.MPI.BYTE], like.itemsize
        return [buf[: like.nbytes], self.MPI.BYTE], like.itemsize

    def _stage(self, x: Array, incoming: bool) -> Array:
        """What MPI reads (or, ``incoming``, writes) for array x: x itself, or a pinned buffer
        (holding a queued download of x unless incoming)."""
        if self.direct or not _ops.is_device_array(x):
            return x
        return self._pool.take(x.nbytes) if incoming else self.download(x)

    # -------------------------------------------------------------------- operations
    def isendrecv(self, comm: Any, tag: int, send: Array | None, dest: int, recv: Array | None,
                  source: int) -> _Staged:
        """Post a receive and a send, either on the device or on the host (or None)."""
        uploads: list[tuple[np.ndarray, Any]] = []
        downloads: list[np.ndarray] = []
        reqs = []
        rbuf = sbuf = None
        if recv is not None:
            rbuf = self._stage(recv, True)
            if rbuf is not recv:
                uploads.append((rbuf, recv))
        if send is not None:
            sbuf = self._stage(send, False)
            if sbuf is not send:
                downloads.append(sbuf)
        self._sync_before(bool(downloads), send, recv)
        if recv is not None:
            reqs.append(comm.Irecv(self.message(rbuf, recv)[0], source, tag))
        if send is not None:
            reqs.append(comm.Isend(self.message(sbuf, send)[0], dest, tag))
        return _Staged(self, reqs, source if recv is not None else dest, uploads, downloads)

    def allgatherv(self, comm: Any, x: Array, counts: list[int], displs: list[int],
                   out: Array) -> None:
        """Allgatherv of ``x`` into ``out`` (counts and displs in elements), either or both on
        the device."""
        send_buf, recv_buf = self._stage(x, False), self._stage(out, True)
        self._sync_before(send_buf is not x, x, out)
        send, scale = self.message(send_buf, x)
        recv = self.message(recv_buf, out)[0]
        vector = _counts(recv, [c * scale for c in counts], [d * scale for d in displs])
        self._collective(comm, "allgatherv", comm.Allgatherv, comm.Iallgatherv, x, out, send,
                         vector)
        if send_buf is not x:  # not after a timeout: MPI may still read it (see _Staged)
            self.release(send_buf)
        if recv_buf is not out:
            self.upload(recv_buf, out)

    def broadcast(self, comm: Any, x: Array, root: int) -> None:
        """Broadcast device array ``x`` from ``root`` in place."""
        mine = comm.Get_rank() == root
        buf = self._stage(x, not mine)
        self._sync_before(mine and buf is not x, x)
        self._collective(comm, "broadcast", comm.Bcast, comm.Ibcast, x, None,
                         self.message(buf, x)[0], root)
        if buf is not x and mine:  # not after a timeout: MPI may still read it (see _Staged)
            self.release(buf)
        if buf is not x and not mine:
            self.upload(buf, x)

    def _collective(self, comm: Any, what: str, blocking: Callable[..., Any],
                    nonblocking: Callable[..., Any], x: Array, out: Array, *args: Any) -> None:
        """Run a collective on MPI buffers ``args`` within the timeout: its nonblocking form
        on host buffers; on device buffers (CUDA-aware MPI), the blocking form after a
        bounded barrier, since nonblocking collectives may not take device pointers."""
        device = _ops.is_device_array
        if self.direct and (device(x) or device(out)):
            self.wait([comm.Ibarrier()], None, what)
            blocking(*args)
        else:
            self.wait([nonblocking(*args)], None, what)
