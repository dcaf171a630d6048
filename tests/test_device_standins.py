"""Stand-ins for CuPy and an NCCL communicator, for testing the NCCL backend without a GPU.

What they keep of the real ones is what the backend's logic depends on:

- ``FakeGPU``: which device each thread has current (a new thread starts on device 0, as with
  CUDA), and whether the GPU is *stuck* (work never completes: a peer died under a spinning
  NCCL kernel). While stuck, events are never done, and a blocking ``synchronize`` or a copy
  between host and device (which CUDA orders after the stream's work) raises instead of
  hanging the test, so an unbounded wait is a test failure.
- ``FakeCupy``: ``cuda.Device`` contexts (per thread), streams and events over the FakeGPU,
  and device arrays that are NumPy arrays in host memory with a device number (``.device.id``,
  ``.data.ptr``, ``.get()``), whose type's module starts with "cupy" as ringcomm looks at.
- ``FakeNCCLComm``: the ``NCCLComm`` calls the transport makes; each records the device that
  was current and refuses another than its own. Over an mpi4py communicator the data calls
  really move the bytes (MPI standing in for NCCL), so several ranks can run; on one rank they
  copy. ``async_error`` returns scripted codes; ``abort`` and ``destroy`` are recorded.

``standin_transport`` builds an NCCLTransport on them (``_attach``, as ``split`` does). The
tests of this file check the stand-ins themselves behave as described.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ringcomm.backends import _nccl_lib
from ringcomm.backends.nccl import NCCLTransport
from ringcomm.core.types import ReduceOp

__all__ = ["FakeCupy", "FakeGPU", "FakeNCCLComm", "on_new_thread", "standin_transport"]


class FakeGPU:
    """What the stand-ins share: the devices, each thread's current one, and whether the GPU
    completes its work."""

    def __init__(self, count: int = 4) -> None:
        self.count = count
        self.stuck = False
        self.blocking_syncs = 0
        self._local = threading.local()

    def current(self) -> int:
        return getattr(self._local, "device", 0)

    def set_current(self, device: int) -> None:
        if not 0 <= device < self.count:
            raise RuntimeError(f"invalid device ordinal {device}")
        self._local.device = device

    def streams(self) -> list[Any]:
        """This thread's stack of streams made current with ``with stream:``."""
        stack = getattr(self._local, "streams", None)
        if stack is None:
            stack = self._local.streams = []
        return stack


class FakeEvent:
    """A CUDA event: remembers the stream of its last recording and how many it had (a stream's
    wait captures the recording current when it is made, as cudaStreamWaitEvent does)."""

    def __init__(self, gpu: FakeGPU, disable_timing: bool = True) -> None:
        self._gpu = gpu
        self.device = gpu.current()
        self.stream: Any = None
        self.recordings = 0

    def record(self, stream: Any = None) -> None:
        self.device = stream.device if stream is not None else self._gpu.current()
        self.stream = stream
        self.recordings += 1

    @property
    def done(self) -> bool:
        return not self._gpu.stuck

    def synchronize(self) -> None:
        if self._gpu.stuck:
            raise AssertionError("a blocking event synchronize on a stuck GPU would hang")


class FakeStream:
    _next = 100

    def __init__(self, gpu: FakeGPU, non_blocking: bool = False, *, ptr: int | None = None,
                 device: int | None = None) -> None:
        self._gpu = gpu
        self.device = gpu.current() if device is None else device
        if ptr is None:
            FakeStream._next += 1
            ptr = FakeStream._next
        self.ptr = ptr
        self.waited: list[FakeEvent] = []
        # (event, the recording waited for, the stream it was recorded on), in call order
        self.waits: list[tuple[FakeEvent, int, Any]] = []

    def record(self, event: FakeEvent | None = None) -> FakeEvent:
        event = FakeEvent(self._gpu) if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)
        self.waits.append((event, event.recordings, event.stream))

    def __enter__(self) -> FakeStream:
        """Current on this thread (for its device) inside the block, as ``with stream:``."""
        self._gpu.streams().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._gpu.streams().pop()

    @property
    def done(self) -> bool:
        return not self._gpu.stuck

    def synchronize(self) -> None:
        if self._gpu.stuck:
            raise AssertionError("a blocking stream synchronize on a stuck GPU would hang")
        self._gpu.blocking_syncs += 1


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeDeviceRef:
    """``array.device``: the device number, and a context like cupy.cuda.Device's."""

    def __init__(self, gpu: FakeGPU, device: int) -> None:
        self._gpu, self.id = gpu, int(device)
        self._stack: list[int] = []  # per object, as CuPy's: not safe to share across threads

    def __enter__(self) -> FakeDeviceRef:
        self._stack.append(self._gpu.current())
        self._gpu.set_current(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        self._gpu.set_current(self._stack.pop())

    def use(self) -> None:
        self._gpu.set_current(self.id)


def _copy_waits(gpu: FakeGPU | None) -> None:
    """A copy between pageable host memory and the device waits for the stream (CUDA
    synchronizes it): on a stuck GPU it would hang."""
    if gpu is not None and gpu.stuck:
        raise AssertionError("a copy between host and device on a stuck GPU would hang")


class FakeArray(np.ndarray):
    """A NumPy array standing for a CuPy array on device ``device_id``."""

    device_id = 0
    gpu: FakeGPU | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self.device_id = getattr(obj, "device_id", 0)
        self.gpu = getattr(obj, "gpu", None)

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        return _Pointer(self.__array_interface__["data"][0])

    @property
    def device(self) -> FakeDeviceRef:  # type: ignore[override]
        assert self.gpu is not None
        return FakeDeviceRef(self.gpu, self.device_id)

    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:
        _copy_waits(self.gpu)
        host = np.array(self, copy=True).view(np.ndarray)
        if out is None:
            return host
        assert out.shape == host.shape and out.dtype == host.dtype, (out.shape, host.shape)
        out[...] = host
        return out

    def set(self, arr: np.ndarray) -> None:
        _copy_waits(self.gpu)
        np.copyto(self.view(np.ndarray), arr.reshape(self.shape))


FakeArray.__module__ = "cupy.standin"  # what ringcomm.ops.is_device_array looks at


class _Runtime:
    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3

    def __init__(self, gpu: FakeGPU) -> None:
        self._gpu = gpu

    def getDeviceCount(self) -> int:
        return self._gpu.count

    def getDevice(self) -> int:
        return self._gpu.current()

    def getDeviceProperties(self, device: int) -> dict[str, Any]:
        assert 0 <= device < self._gpu.count, device
        return {"multiProcessorCount": 1}

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)


class _Cuda:
    def __init__(self, gpu: FakeGPU) -> None:
        self._gpu = gpu
        self.runtime = _Runtime(gpu)
        self._default: dict[tuple[int, int], FakeStream] = {}
        self.events_made = 0

    def Device(self, device: int | None = None) -> FakeDeviceRef:
        return FakeDeviceRef(self._gpu, self._gpu.current() if device is None else device)

    def Stream(self, non_blocking: bool = False) -> FakeStream:
        return FakeStream(self._gpu, non_blocking)

    def Event(self, disable_timing: bool = False) -> FakeEvent:
        self.events_made += 1
        return FakeEvent(self._gpu, disable_timing)

    def get_current_stream(self, device: int | None = None) -> FakeStream:
        """The current stream of the current device: the innermost ``with stream:`` of this
        thread on that device, else its null stream (ptr 0), one per thread."""
        d = self._gpu.current() if device is None else device
        for stream in reversed(self._gpu.streams()):
            if stream.device == d:
                return stream
        key = (threading.get_ident(), d)
        stream = self._default.get(key)
        if stream is None:
            stream = self._default[key] = FakeStream(self._gpu, ptr=0, device=d)
        return stream

    def alloc_pinned_memory(self, nbytes: int) -> bytearray:
        return bytearray(nbytes)


class FakeCupy:
    """The few CuPy functions the NCCL backend calls, over a FakeGPU."""

    ndarray = FakeArray

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.cuda = _Cuda(gpu)

    def _on_device(self, a: np.ndarray) -> FakeArray:
        out = a.view(FakeArray)
        out.device_id, out.gpu = self.gpu.current(), self.gpu
        return out

    def empty(self, shape: Any, dtype: Any = np.float64) -> FakeArray:
        return self._on_device(np.empty(shape, dtype))

    def zeros(self, shape: Any, dtype: Any = np.float64) -> FakeArray:
        return self._on_device(np.zeros(shape, dtype))

    def asarray(self, x: Any, dtype: Any = None) -> FakeArray:
        if type(x) is np.ndarray:
            _copy_waits(self.gpu)
        return self._on_device(np.array(x, dtype=dtype, copy=True))

    def ascontiguousarray(self, x: Any, dtype: Any = None) -> FakeArray:
        return self._on_device(np.ascontiguousarray(x, dtype=dtype))

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return bool(np.may_share_memory(a, b))


# ----------------------------------------------------------------------- NCCL communicator
_NUMPY_OF = {code: name for name, code in _nccl_lib.DTYPES.items()}
_OP_OF = {op.spec.nccl: op for op in ReduceOp}


def _view(ptr: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """The host memory at ``ptr`` as an array (stand-in device memory is host memory)."""
    if nbytes == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(raw, np.uint8).view(dtype)


class FakeNCCLComm:
    """An NCCLComm stand-in on CUDA device ``device``.

    Args:
        gpu: the FakeGPU.
        device: the device every call must find current.
        mpi: an mpi4py communicator moving the data between ranks (None: one rank).
    """

    def __init__(self, gpu: FakeGPU, device: int, mpi: Any = None) -> None:
        self.gpu, self.device, self.mpi = gpu, device, mpi
        self.rank = 0 if mpi is None else mpi.Get_rank()
        self.size = 1 if mpi is None else mpi.Get_size()
        self.calls: list[tuple[str, int]] = []  # (call, device current at the call)
        self.errors: list[int] = []  # what async_error returns next, one per call; then 0
        self.aborted = self.destroyed = False
        self.polls = 0

    def _call(self, name: str) -> None:
        current = self.gpu.current()
        self.calls.append((name, current))
        if self.aborted:
            raise AssertionError(f"{name} on an aborted NCCL communicator")
        if current != self.device:
            raise AssertionError(f"{name} with device {current} current, the communicator's "
                                 f"is {self.device}")

    # ----------------------------------------------------------------- what NCCLComm offers
    def reduce(self, name: str, send: int, recv: int, count: int, dtype: int, op: int,
               stream: int) -> None:
        self._call(name)
        dt = np.dtype(_NUMPY_OF[dtype])
        rop = _OP_OF[op]
        if name == "ncclAllReduce":
            x = _view(send, count * dt.itemsize, dt).copy()
            out = _view(recv, count * dt.itemsize, dt)
            if self.mpi is None:
                out[...] = x
                return
            parts = np.stack(self.mpi.allgather(x)).astype(np.float64 if dt.kind == "f"
                                                          else dt)
            out[...] = _reduce(parts, rop).astype(dt)
        else:  # ncclReduceScatter: count per rank
            x = _view(send, count * self.size * dt.itemsize, dt).copy()
            out = _view(recv, count * dt.itemsize, dt)
            parts = np.stack([x] if self.mpi is None else self.mpi.allgather(x))
            whole = _reduce(parts.astype(np.float64 if dt.kind == "f" else dt), rop)
            out[...] = whole[self.rank * count:(self.rank + 1) * count].astype(dt)

    def allgather(self, send: int, recv: int, nbytes: int, stream: int) -> None:
        self._call("ncclAllGather")
        mine = _view(send, nbytes).copy()
        parts = [mine] if self.mpi is None else self.mpi.allgather(mine)
        _view(recv, nbytes * self.size)[...] = np.concatenate(parts)

    def broadcast(self, buf: int, nbytes: int, root: int, stream: int) -> None:
        self._call("ncclBroadcast")
        data = _view(buf, nbytes)
        if self.mpi is not None:
            data[...] = self.mpi.bcast(data.copy(), root=root)

    def sendrecv(self, send: tuple[int, int] | None, dest: int,
                 recv: tuple[int, int] | None, source: int, stream: int) -> None:
        self._call("sendrecv")
        payload = None if send is None else _view(*send).copy()
        if self.mpi is None:
            got = payload
        else:
            reqs = [] if payload is None else [self.mpi.isend(payload, dest, tag=5)]
            got = self.mpi.recv(source=source, tag=5) if recv is not None else None
            for r in reqs:
                r.wait()
        if recv is not None:
            assert got is not None and got.size == recv[1], "message and buffer sizes differ"
            _view(*recv)[...] = got

    def gatherv(self, send: int, recv: int, nbytes: list[int], stream: int) -> None:
        self._call("gatherv")
        mine = _view(send, nbytes[self.rank]).copy()
        parts = [mine] if self.mpi is None else self.mpi.allgather(mine)
        at = 0
        for p, part in enumerate(parts):
            if p != self.rank:
                _view(recv + at, part.size)[...] = part
            at += nbytes[p]

    def async_error(self) -> int:
        self.polls += 1
        return self.errors.pop(0) if self.errors else 0

    def describe(self, code: int) -> str:
        return f"NCCL error {code}: remote process exited or there was a network error"

    def abort(self) -> None:
        self.calls.append(("abort", self.gpu.current()))
        self.aborted = True

    def destroy(self) -> None:
        self._call("destroy")
        self.destroyed = True


def _reduce(parts: np.ndarray, op: ReduceOp) -> np.ndarray:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        total = parts.sum(axis=0)
        return total / parts.shape[0] if op == ReduceOp.AVG else total
    return {ReduceOp.MIN: np.min, ReduceOp.MAX: np.max, ReduceOp.PROD: np.prod}[op](parts, axis=0)


class _FakeLib:
    version_string = "2.99.9"
    can_split = False


def on_new_thread(fn: Callable[[], Any], timeout: float = 60) -> Any:
    """Run ``fn`` on a new thread (current device 0, as any new thread and as ringcomm.torch's
    workers); return its result or raise its error. A call still running at ``timeout`` fails."""
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:
            box["error"] = err

    th = threading.Thread(target=main)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), "the call hung"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def standin_transport(gpu: FakeGPU, rdv: Any, *, device: int = 0, timeout: float = 5.0,
                      abort_on_timeout: bool = False, mpi: Any = None) -> NCCLTransport:
    """An NCCLTransport over rendezvous ``rdv`` on stand-ins of CuPy and NCCL."""
    t = NCCLTransport.__new__(NCCLTransport)
    t._attach(rdv, FakeCupy(gpu), _FakeLib(), device, FakeNCCLComm(gpu, device, mpi),
              timeout, abort_on_timeout)
    return t


# ------------------------------------------------------------------ the stand-ins' own tests
@pytest.fixture
def gpu() -> Iterator[FakeGPU]:
    yield FakeGPU()


def test_device_contexts_are_per_thread_and_restore(gpu):
    cupy = FakeCupy(gpu)
    seen = []
    with cupy.cuda.Device(2):
        assert gpu.current() == 2
        worker = threading.Thread(target=lambda: seen.append(gpu.current()))
        worker.start()
        worker.join()
        assert cupy.empty(3, np.float32).device.id == 2
    assert gpu.current() == 0 and seen == [0]  # a new thread starts on device 0


def test_a_stuck_gpu_never_completes_and_refuses_blocking_waits(gpu):
    cupy = FakeCupy(gpu)
    stream = cupy.cuda.get_current_stream()
    assert stream.record().done
    stream.synchronize()
    x = cupy.asarray(np.ones(3))
    gpu.stuck = True
    event = stream.record()
    assert not event.done and not stream.done
    for blocking in (stream.synchronize, x.get, lambda: cupy.asarray(np.ones(3))):
        with pytest.raises(AssertionError, match="would hang"):
            blocking()


def test_the_comm_refuses_another_device_and_copies_on_one_rank(gpu):
    cupy = FakeCupy(gpu)
    comm = FakeNCCLComm(gpu, device=1)
    with cupy.cuda.Device(1):
        x = cupy.asarray(np.arange(6, dtype=np.float32))
        y = cupy.empty(6, np.float32)
        comm.reduce("ncclAllReduce", x.data.ptr, y.data.ptr, 6, _nccl_lib.DTYPES["float32"],
                    ReduceOp.SUM.spec.nccl, 0)
    np.testing.assert_array_equal(y.get(), np.arange(6))
    with pytest.raises(AssertionError, match="device 0 current"):
        comm.broadcast(x.data.ptr, x.nbytes, 0, 0)
