"""The NCCL transport: one NCCL communicator on this process's GPU, and its host transport.

:class:`NCCLTransport` is documented in :mod:`ringcomm.backends.nccl` (the module users import),
with the communicator over it; this module holds the transport alone.

Why one module past 400 lines: NCCLTransport's methods share one NCCL communicator, its
streams and its failure state; the library binding, the set-up, the waits, the events and the
host transport each have a module of their own (``_nccl_*``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.backends import _nccl_host, _nccl_lib, _nccl_setup, _nccl_wait, cuda_device
from ringcomm.backends._nccl_events import ENQUEUED, EventPool, Transfer
from ringcomm.comm.transport import (
    TransportBase,
    adopt_ranks,
    agree_split,
    check_timeout,
    split_members,
)
from ringcomm.core.log import get_logger
from ringcomm.core.types import (
    RING,
    Array,
    CollectiveError,
    CollectiveTimeoutError,
    ReduceOp,
    Request,
    Transport,
    drops_nan_natively,
)

__all__ = ["NCCLTransport"]

_LOG = get_logger("nccl")

_INT32 = _nccl_lib.DTYPES["int32"]
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the pointers say where they live


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
    """The Transport over one NCCL communicator on this process's GPU.

    The GPU is the local rank (among this transport's ranks on the host) modulo the visible
    device count; it becomes the current CuPy device. CuPy arrays on that GPU travel over
    NCCL; host (NumPy) arrays over :attr:`host`, the host transport (see the module's
    docstring). The host collectives travel over the rendezvous: MPI where there is one, else
    NCCL (``allgather_fixed``) or the store.

    Args:
        mpi_comm: mpi4py communicator whose ranks form this one (``MPI.COMM_WORLD`` by
            default); it carries the unique id and the host collectives. Under torchrun
            without it, torch.distributed's store carries the unique id.
        device: CUDA device to use instead of the one the local rank picks.
        timeout: seconds a rank waits for the others: in a host-side exchange (the
            rendezvous, the per-call agreement over MPI or the store) and in every host wait
            for the GPU (``DEFAULT_TIMEOUT_S``, 30 minutes, when None).
        abort_on_timeout: when a wait times out or NCCL reports an asynchronous error, end
            the job (``MPI_Abort`` where MPI launched it, else this process exits with status
            1, and torchrun ends the others) after aborting the NCCL communicator (True), or
            raise the error on this rank only (False; the communicator then refuses every
            call).

    Raises:
        RuntimeError: CuPy, NCCL or a GPU is missing (naming what to install), two ranks
            would share one GPU, or NCCL failed to start (with NCCL's error text).
        ValueError: ``timeout`` is not a positive number.
    """

    backend = "nccl"
    routes_arrays = True  # host arrays go to the host transport
    follows_nodes_on_device = True  # NCCL's rings and trees know the nodes
    moves_device_arrays = True

    def __init__(self, mpi_comm: Any = None, *, device: int | None = None,
                 timeout: float | None = None, abort_on_timeout: bool = True) -> None:
        seconds = check_timeout(timeout)
        rdv = _nccl_setup.connect(mpi_comm, timeout)
        try:
            setup, uid = _checked_setup(rdv, device)
            # Arrays the application creates next belong on this GPU, as with
            # torch.cuda.set_device.
            setup.cupy.cuda.Device(setup.device).use()
            nccl = _nccl_wait.bounded_start(
                lambda: _nccl_lib.NCCLComm.create(setup.lib, rdv.size, uid, rdv.rank),
                lambda: setup.cupy.cuda.Device(setup.device), _making(rdv, seconds), "init",
                "ncclCommInitRank", bool(abort_on_timeout), rdv.kind)
            try:
                self._attach(rdv, setup.cupy, setup.lib, setup.device, nccl, seconds,
                             bool(abort_on_timeout))
            except BaseException:
                self._discard(setup.cupy, setup.device, nccl)
                raise
        except BaseException:
            rdv.close()
            raise

    def _discard(self, cupy: Any, device: int, nccl: _nccl_lib.NCCLComm) -> None:
        """Undo a half-made transport: no watchdog left counting it as open, NCCL freed."""
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.close()
        try:
            with cupy.cuda.Device(device):
                nccl.abort()
        except _nccl_lib.NCCLError as err:
            _LOG.error("ncclCommAbort of a communicator that failed to start: %s", err)

    def _attach(self, rdv: _nccl_setup.Rendezvous, cupy: Any, lib: _nccl_lib.NCCLLibrary,
                device: int, nccl: _nccl_lib.NCCLComm, timeout: float,
                abort_on_timeout: bool) -> None:
        """Become the transport over ``rdv`` and ``nccl`` on CUDA device ``device``."""
        self._host: Transport | None = None
        super().__init__(rdv.rank, rdv.size, local_rank=rdv.local_rank,
                         local_size=rdv.local_size)
        self._rdv, self._cupy, self._cuda, self._lib, self._nccl = rdv, cupy, cupy.cuda, lib, nccl
        self._device_id = device
        self.timeout, self.abort_on_timeout = timeout, abort_on_timeout
        self._open = True
        self._watch = _nccl_wait.Watchdog(self, nccl, device, rdv.kind)
        #: The cupy.cuda.Device of this transport (enter ``device_scope()`` rather than this
        #: object: CuPy's Device context is not safe across threads).
        self.device = cupy.cuda.Device(device)
        self._fixed: dict[int, tuple[Any, Any]] = {}
        self._events = EventPool(cupy.cuda)
        # The stream of the last call that took device scratch, and its identity (``scratch``).
        self._scratch_stream: tuple[Any, tuple[int, int]] | None = None
        with self.device_scope():
            self._p2p_stream = cupy.cuda.Stream(non_blocking=True)
            self._word = cupy.zeros(1, np.int32)
        self._host = _nccl_host.host_transport(self, rdv)

    # ------------------------------------------------------------------------ properties
    @property
    def nccl_version(self) -> str:
        """The NCCL library's version, as "2.21.5"."""
        return self._lib.version_string

    @property
    def device_id(self) -> int:
        """The CUDA device this transport runs on."""
        return self._device_id

    @property
    def host(self) -> Transport:
        """The transport of host (NumPy) arrays: MPI's, or NCCL staged through the GPU."""
        assert self._host is not None
        return self._host

    @property
    def failure(self) -> Exception | None:
        """The error that aborted the NCCL communicator, or that of the host transport (a
        timeout), or None while both are usable."""
        failure = self._watch.failure
        if failure is None and self._host is not None and self._host is not self:
            return self._host.failure
        return failure

    def on_failure(self, callback: Callable[[], None]) -> None:
        """As TransportBase's, for the host transport's failures too."""
        super().on_failure(callback)
        if self._host is not None and self._host is not self:
            self._host.on_failure(callback)

    @property
    def operation(self) -> str:
        """The collective in progress (set by the Communicator; the host transport's too)."""
        return self._operation

    @operation.setter
    def operation(self, value: str) -> None:
        self._operation = value
        host = self.__dict__.get("_host")
        if host is not None and host is not self:
            host.operation = value

    def device_scope(self) -> Any:
        """A context making this transport's GPU current (a fresh one per use)."""
        return self._cuda.Device(self._device_id)

    def transport_for(self, x: Array) -> Transport:
        """The transport that moves arrays like ``x``: this one for CuPy arrays, ``host``
        for host arrays.

        Raises:
            RuntimeError: the communicator was aborted after a failure.
        """
        self._check_usable()
        return self if _ops.is_device_array(x) else self.host

    # ------------------------------------------------------------------------ primitives
    def isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int, *,
                  channel: int = RING) -> Request:
        """Post an exchange over NCCL; host arrays (either side, any channel) are staged
        through device buffers, so that the peers of a ``sendrecv`` may pass different kinds
        of arrays."""
        self._check_usable()
        device = _ops.is_device_array
        if (send is not None and not device(send)) or (recv is not None and not device(recv)):
            return _nccl_host.staged_sendrecv(self, send, dest, recv, source, channel)
        return self.device_isendrecv(send, dest, recv, source, channel)

    def device_isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int,
                         channel: int) -> Request:
        """Post an exchange of CuPy arrays (either may be None) over NCCL."""
        if channel != RING:
            # One NCCL communicator serves both channels: NCCL matches a pair's messages in
            # the order they are issued, and a collective issues all of its messages before
            # it returns, so a user's message can never be taken for one of a collective's.
            with self.device_scope():
                self._nccl.sendrecv(_span(send), dest, _span(recv), source, self._stream())
            return ENQUEUED
        with self.device_scope():
            self._events.order(self._cuda.get_current_stream(), self._p2p_stream)
            self._nccl.sendrecv(_span(send), dest, _span(recv), source, self._p2p_stream.ptr)
            done = self._events.take()
            done.record(self._p2p_stream)
        return Transfer(self._events, self.device_scope, done, (send, recv))

    def scratch(self, key: str, like: Array, n: int, dtype: Any) -> Array:
        """A reusable buffer (see TransportBase.scratch), ordered after every earlier use.

        A scratch buffer outlives the call that used it, and that call's kernels may still be
        queued on another stream than this call's (CuPy's pool keeps fresh allocations apart
        per stream; scratch has no such guard): when the current stream is not the one of the
        last call that took device scratch, it first waits for the work enqueued on that one.
        """
        if _ops.is_device_array(like):
            with self.device_scope():
                current = self._cuda.get_current_stream()
                mine = cuda_device.stream_identity(current)
                last = self._scratch_stream
                if last is not None and last[1] != mine:
                    self._events.order(last[0], current)
                # Held, so that its handle is not reused by a new stream meanwhile.
                self._scratch_stream = (current, mine)
        return super().scratch(key, like, n, dtype)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._check_usable()
        if self._rdv.allgather_fixed(send, recv):
            return
        # No MPI (torchrun): through NCCL, staged in device buffers kept per size.
        with self.device_scope():
            bufs = self._fixed.get(send.nbytes)
            if bufs is None:
                bufs = self._fixed[send.nbytes] = (
                    self._cupy.empty(send.nbytes, np.uint8),
                    self._cupy.empty(recv.shape, np.uint8))
            dsend, drecv = bufs
            self.wait_gpu("allgather")  # the copy below would wait for the stream unbounded
            dsend.set(send.reshape(-1))
            stream = self._cuda.get_current_stream()
            self._nccl.allgather(dsend.data.ptr, drecv.data.ptr, send.nbytes, stream.ptr)
            self.wait_stream(stream, "allgather")
            drecv.get(out=recv)

    def allgatherv(self, x: Array, counts: list[int], out: Array) -> None:
        self._check_usable()
        item = x.itemsize
        with self.device_scope():
            stream = self._stream()
            if len(set(counts)) == 1:
                self._nccl.allgather(x.data.ptr, out.data.ptr, counts[0] * item, stream)
                return
            self._nccl.gatherv(x.data.ptr, out.data.ptr, [c * item for c in counts], stream)
            mine = counts[self.rank] * item
            if mine:
                at = out.data.ptr + sum(counts[: self.rank]) * item
                self._cuda.runtime.memcpyAsync(at, x.data.ptr, mine, _MEMCPY_DEFAULT, stream)

    def broadcast(self, x: Array, root: int) -> None:
        self._check_usable()
        with self.device_scope():
            self._nccl.broadcast(x.data.ptr, x.nbytes, root, self._stream())

    def allgather_object(self, obj: Any) -> list[Any]:
        self._check_usable()
        return self._rdv.allgather_object(obj)

    def barrier(self) -> None:
        """A one-word allreduce, then a (polled, bounded) wait for it: returns once every rank
        has issued it, and after this rank's earlier GPU work on the current stream."""
        self._check_usable()
        with self.device_scope():
            stream = self._cuda.get_current_stream()
            ptr = self._word.data.ptr
            self._nccl.reduce("ncclAllReduce", ptr, ptr, 1, _INT32, ReduceOp.SUM.spec.nccl,
                              stream.ptr)
            self.wait_stream(stream, "barrier")

    def check_arrays(self, *arrays: Array) -> None:
        """Raise unless every array (None skipped) is a NumPy array or a CuPy array on this
        transport's GPU.

        Raises:
            TypeError: an array is neither.
            ValueError: a CuPy array is on another GPU.
            RuntimeError: the communicator was aborted after a failure.
        """
        self._check_usable()
        for a in arrays:
            if a is None or type(a) is np.ndarray:
                continue
            if not _ops.is_device_array(a):
                kind = f"{type(a).__module__}.{type(a).__name__}"
                raise TypeError(f"the NCCL backend takes CuPy arrays (over NCCL) and NumPy "
                                f"arrays (over its host transport), got {kind}")
            if a.device.id != self._device_id:
                raise ValueError(f"array is on GPU {a.device.id}, but this communicator runs "
                                 f"on GPU {self._device_id}")

    def native_allreduce(self, x: Array, out: Array, op: ReduceOp) -> bool:
        """Enqueue ncclAllReduce of flat ``x`` into flat ``out`` (which may be ``x``) on the
        current stream; True, except for the min and max of floats, which the ring runs
        (NCCL's ``fmaxf``/``fminf`` drop a NaN, ringcomm's propagate it, as NumPy's do).

        16-bit floats are summed in their own precision (the ring sums them in float32).
        """
        if drops_nan_natively(op, x.dtype):
            return False
        if x.size:
            self._reduce("ncclAllReduce", x, out, x.size, op)
        self.count_native(x.nbytes)  # as NCCL's ring moves it
        return True

    def native_reduce_scatter(self, x: Array, op: ReduceOp) -> Array | None:
        """ncclReduceScatter when the length divides by the size; None otherwise (the ring
        runs, with the same chunks: rank r gets ``[r * L // size, (r + 1) * L // size)``), and
        for the min and max of floats (NCCL's drop a NaN)."""
        if x.size % self.size or drops_nan_natively(op, x.dtype):
            return None
        count = x.size // self.size
        with self.device_scope():
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
        (NCCL refuses mixed versions), so all take the same path. The new transport has the
        same GPU, timeout and ``abort_on_timeout``, and a host transport of its own.

        Raises:
            InvalidArgumentError, InvalidTypeError: invalid color or key on some rank (on
                every rank; see ``agree_split``).
            RuntimeError: NCCL failed (with NCCL's error text), or this communicator was
                aborted.
        """
        self._check_usable()
        everyone = agree_split(self, color, key)
        color, key = everyone[self.rank]
        rdv = self._rdv.split(color, key)
        try:
            if self._lib.can_split:
                try:
                    nccl = _nccl_wait.bounded_start(
                        lambda: self._nccl.split(color, key), self.device_scope, self,
                        "split", "ncclCommSplit", self.abort_on_timeout, self._rdv.kind)
                except CollectiveTimeoutError as err:
                    # ncclCommSplit still runs on this communicator, on its thread: leave it
                    # there, refusing every call (a peer of this communicator is gone).
                    self._watch.give_up(err)
                    raise
            else:
                nccl = self._fresh_comm(rdv, split_members(everyone, color))
            with self.device_scope():
                if (nccl.rank, nccl.size) != (rdv.rank, rdv.size):
                    nccl.destroy()
                    raise RuntimeError(
                        f"split: NCCL made this rank {nccl.rank} of {nccl.size}, the rendezvous "
                        f"{rdv.rank} of {rdv.size}")
            child = NCCLTransport.__new__(NCCLTransport)
            child._attach(rdv, self._cupy, self._lib, self._device_id, nccl, self.timeout,
                          self.abort_on_timeout)
        except BaseException:
            rdv.close()
            raise
        members = split_members(everyone, color)
        if child._host is not None:  # its timeouts name the job's ranks too
            adopt_ranks(child._host, self, members)
        return adopt_ranks(child, self, members)

    def close(self) -> None:
        """Wait (bounded) for this transport's GPU work, then free the NCCL communicator
        (after a failure: nothing to wait for, the abort freed it). Idempotent.

        Raises:
            NCCLAsyncError, CollectiveTimeoutError: the wait failed (``abort_on_timeout``
                False; the resources are released all the same).
        """
        if not self._open:
            return
        self._open = False
        try:
            if self._watch.failure is None:
                with self.device_scope():
                    self.wait_stream(self._p2p_stream, "close")
                    self.wait_stream(self._cuda.get_current_stream(), "close")
                    self._nccl.destroy()
        finally:
            self._watch.close()
            self._fixed.clear()
            self._events.clear()
            self._scratch_stream = None
            self.release_scratch()
            if self._host is not None and self._host is not getattr(self._rdv, "transport",
                                                                    None):
                self._host.close()
            self._rdv.close()

    # --------------------------------------------------------------------------- failures
    def wait_stream(self, stream: Any, what: str, peer: int | None = None) -> None:
        """Block until the work enqueued on ``stream`` so far is done, polling the stream and
        NCCL's asynchronous error (see :mod:`ringcomm.backends._nccl_wait`).

        Raises:
            NCCLAsyncError: NCCL reported that the communicator failed.
            CollectiveTimeoutError: the timeout passed first.
            (With ``abort_on_timeout`` the job ends instead; either way NCCL was aborted.)
        """
        self._watch.wait_stream(stream, what, peer)

    def wait_gpu(self, what: str) -> None:
        """Wait (bounded, as ``wait_stream``) for the work on the current stream of this
        transport's GPU: before a copy between host and device, which would wait for that
        stream without a bound (a dead peer's NCCL kernel may hold it forever)."""
        with self.device_scope():
            self.wait_stream(self._cuda.get_current_stream(), what)

    def upload(self, host: np.ndarray) -> Array:
        """A device copy of host array ``host`` on this transport's GPU, made after a bounded
        wait for the current stream (see ``wait_gpu``)."""
        with self.device_scope():
            self.wait_gpu("a copy to the GPU")
            return self._cupy.asarray(host)

    def abort(self, error: CollectiveError) -> None:
        """Abort the NCCL communicator (``ncclCommAbort``) because of ``error``; every later
        call raises RuntimeError naming it. Idempotent; never raises."""
        self._watch.abort(error)

    def _check_usable(self) -> None:
        self._watch.check()
        if not self._open:
            raise RuntimeError("nccl communicator is closed")

    # ---------------------------------------------------------------------------- helpers
    @property
    def cupy(self) -> Any:
        """The cupy module."""
        return self._cupy

    def _stream(self) -> int:
        return self._cuda.get_current_stream().ptr

    def _reduce(self, name: str, x: Array, out: Array, count: int, op: ReduceOp) -> None:
        """Enqueue ncclAllReduce or ncclReduceScatter of ``count`` elements per output."""
        self._check_usable()
        code = _nccl_lib.dtype_code(x.dtype)
        with self.device_scope():
            self._nccl.reduce(name, x.data.ptr, out.data.ptr, count, code, op.spec.nccl,
                              self._stream())

    def _fresh_comm(self, rdv: _nccl_setup.Rendezvous,
                    members: list[int]) -> _nccl_lib.NCCLComm:
        """A new NCCL communicator over ``rdv``'s ranks (``members``: this transport's ranks,
        in the new group's order), from a unique id of its rank 0 (shared with an allgather,
        so that a failure to make one reaches every rank)."""
        mine: bytes | str | None = None
        if rdv.rank == 0:
            try:
                mine = self._lib.unique_id()
            except _nccl_lib.NCCLError as err:
                mine = str(err)
        uid = rdv.allgather_object(mine)[0]
        if isinstance(uid, str):
            raise RuntimeError(f"split: rank 0 of the new group has no NCCL unique id: {uid}")
        group = _making(rdv, self.timeout, [self.world_ranks[r] for r in members],
                        self.world_size)  # the new group's ranks are the ones waited for
        return _nccl_wait.bounded_start(
            lambda: _nccl_lib.NCCLComm.create(self._lib, rdv.size, uid, rdv.rank),
            self.device_scope, group, "split", "ncclCommInitRank", self.abort_on_timeout,
            self._rdv.kind)


def _making(rdv: _nccl_setup.Rendezvous, timeout: float, world_ranks: Any = None,
            world_size: int | None = None) -> types.SimpleNamespace:
    """What names a communicator being made over ``rdv`` in its timeout's error (see
    ``timeout_error``): ``rdv``'s rank and size, and its ranks as the job numbers them
    (``rdv``'s own where it spans the job)."""
    return types.SimpleNamespace(
        rank=rdv.rank, size=rdv.size, operation=None, timeout=timeout,
        world_ranks=range(rdv.size) if world_ranks is None else world_ranks,
        world_size=rdv.size if world_size is None else world_size)


def _span(x: Array) -> tuple[int, int] | None:
    """(device pointer, bytes) of a CuPy array, or None."""
    if x is None:
        return None
    if not _ops.is_device_array(x):
        raise TypeError(f"the NCCL backend sends CuPy arrays, got {type(x).__name__}")
    return x.data.ptr, x.nbytes
