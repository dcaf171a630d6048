"""Host (NumPy) arrays on the NCCL backend, staged through device buffers and moved by NCCL.

An NCCL communicator takes both kinds of arrays. Where MPI launched the job, host arrays
travel over the MPI transport of the rendezvous; without MPI (torchrun, a lone process) they
travel over NCCL itself: copied to device buffers, moved (or reduced) by NCCL, copied back.
:class:`StagedHost` is that host transport. :func:`staged_sendrecv` also serves the NCCL
transport's own point-to-point exchanges, so that the two peers of a ``sendrecv`` may pass
different kinds of arrays (both sides always go through NCCL).

Every host wait for the GPU here is the NCCL transport's polled, bounded ``wait_stream``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm.transport import TransportBase
from ringcomm.core.types import RING, Array, ReduceOp, Request, drops_nan_natively

__all__ = ["StagedHost", "host_transport", "staged_sendrecv"]


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of contiguous host array ``a`` as a 1-d uint8 view (writing it writes ``a``)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class _Staged:
    """A posted exchange with host arrays on either side; ``wait()`` completes the NCCL
    exchange, then copies a staged receive back to the host."""

    __slots__ = ("_device_recv", "_inner", "_keep", "_recv", "_source", "_t")

    def __init__(self, t: Any, inner: Request, recv: np.ndarray | None, device_recv: Any,
                 source: int, keep: tuple[Any, Any]) -> None:
        self._t, self._inner, self._recv, self._device_recv = t, inner, recv, device_recv
        self._source = source
        self._keep: tuple[Any, Any] | None = keep

    def wait(self) -> None:
        t = self._t
        self._inner.wait()
        if self._recv is not None:
            with t.device_scope():
                t.wait_stream(t.cupy.cuda.get_current_stream(), "staged receive",
                              self._source)
                self._device_recv.get(out=_bytes(self._recv))
            self._recv = None
        self._keep = None


def staged_sendrecv(t: Any, send: Array | None, dest: int, recv: Array | None, source: int,
                    channel: int) -> _Staged:
    """Post an exchange over NCCL transport ``t`` where ``send`` or ``recv`` (or both) are
    host arrays: a host send is copied to a device buffer first, a host receive lands in one
    and is copied back by ``wait()``."""
    device = _ops.is_device_array
    with t.device_scope():
        cupy = t.cupy
        dsend = send if send is None or device(send) else t.upload(_bytes(send))
        host_recv = recv is not None and not device(recv)
        drecv = cupy.empty(recv.nbytes, np.uint8) if host_recv and recv is not None else recv
        inner = t.device_isendrecv(dsend, dest, drecv, source, channel)
    return _Staged(t, inner, recv if host_recv else None, drecv, source, (dsend, drecv))


class StagedHost(TransportBase):
    """The host transport of an NCCL transport without MPI: NumPy arrays through NCCL.

    Dense allreduces and even reduce-scatters are NCCL's own on a device copy of the array;
    the ring's exchanges and the gathers go through device buffers. Shares the NCCL
    transport's ranks, stats and failure state.

    Args:
        t: the NCCLTransport whose communicator carries the data.
    """

    backend = "nccl"

    def __init__(self, t: Any) -> None:
        super().__init__(t.rank, t.size, local_rank=t.local_rank, local_size=t.local_size)
        self._t = t
        self.stats = t.stats

    def isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int, *,
                  channel: int = RING) -> Request:
        return self._t.isendrecv(send, dest, recv, source, channel=channel)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._t.allgather_fixed(send, recv)

    def allgatherv(self, x: Array, counts: list[int], out: Array) -> None:
        t, item = self._t, x.itemsize
        with t.device_scope():
            dout = t.cupy.empty(out.nbytes, np.uint8)
            t.allgatherv(t.upload(_bytes(x)), [c * item for c in counts], dout)
            self._download(dout, out, "allgatherv")

    def broadcast(self, x: Array, root: int) -> None:
        t = self._t
        with t.device_scope():
            dx = t.upload(_bytes(x))
            t.broadcast(dx, root)
            self._download(dx, x, "broadcast")

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._t.allgather_object(obj)

    def barrier(self) -> None:
        self._t.barrier()

    def native_allreduce(self, x: Array, out: Array, op: ReduceOp) -> bool:
        """ncclAllReduce of a device copy of ``x``, copied back into ``out``; True, except for
        dtypes CuPy has no arrays of (bfloat16: the ring runs, on staged exchanges) and the
        min and max of floats (NCCL's drop a NaN)."""
        if x.dtype.kind == "V" or drops_nan_natively(op, x.dtype):
            return False
        t = self._t
        with t.device_scope():
            dx = t.upload(x)
            t.native_allreduce(dx, dx, op)
            self._download(dx.view(np.uint8), out, "allreduce")
        return True

    def native_reduce_scatter(self, x: Array, op: ReduceOp) -> Array | None:
        """ncclReduceScatter of a device copy of ``x`` where the length divides by the size
        (and CuPy has arrays of the dtype, and NCCL's op keeps a NaN); None otherwise (the
        ring runs)."""
        t = self._t
        if x.size % self.size or x.dtype.kind == "V" or drops_nan_natively(op, x.dtype):
            return None
        with t.device_scope():
            part = t.native_reduce_scatter(t.upload(x), op)
            out = np.empty(part.shape, x.dtype)
            self._download(part.view(np.uint8), out, "reduce_scatter")
        return out

    def check_arrays(self, *arrays: Array) -> None:
        """Raise TypeError unless every array (None skipped) is a NumPy array."""
        for a in arrays:
            if a is not None and type(a) is not np.ndarray:
                raise TypeError(f"the NCCL backend's host transport takes NumPy arrays, got "
                                f"{type(a).__module__}.{type(a).__name__}")

    def split(self, color: int, key: int) -> Any:
        """Refused: split the NCCL transport, whose child gets a host transport of its own."""
        raise NotImplementedError("split the NCCL transport, not its host transport")

    def close(self) -> None:
        """Drop the scratch buffers (the NCCL transport owns the rest)."""
        self.release_scratch()

    def _download(self, device: Any, host: np.ndarray, what: str) -> None:
        """Wait (bounded) for the NCCL work on the current stream, then copy the bytes of
        device array ``device`` into contiguous host array ``host``."""
        t = self._t
        t.wait_stream(t.cupy.cuda.get_current_stream(), what)
        if host.size:
            device.get(out=_bytes(host))


def host_transport(t: Any, rdv: Any) -> Any:
    """The host transport of NCCL transport ``t``: the MPI transport of an MPI rendezvous
    (sharing ``t``'s stats and ``abort_on_timeout``; its timeout is already ``t``'s), else
    host arrays staged through NCCL."""
    mpi = getattr(rdv, "transport", None) if rdv.kind == "mpi" else None
    if mpi is None:
        return StagedHost(t)
    mpi.stats = t.stats
    mpi.abort_on_timeout = t.abort_on_timeout
    return mpi
