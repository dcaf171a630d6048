"""The device is explicit: device work runs on the communicator's CUDA device, whatever thread
calls, and background work is ordered after the submitting thread's stream.

A new thread starts with CUDA device 0 current; on a node with several GPUs a rank on device
N whose collectives ran from a worker thread would launch kernels, allocate scratch and wait on
streams of device 0. Without a GPU these tests run on the stand-ins of
tests/test_device_standins.py, whose NCCL communicator refuses any call made with another
device current, and whose arrays remember the device they were allocated on:

- the NCCL transport, through the Communicator, from a thread whose current device is 0;
- the MPI backend's device selection (``local_rank % device_count``, with a debug log), its
  refusal of arrays on another device, and its device work from a worker thread;
- ringcomm.torch's engine running its tasks under the communicator's device, and the stream
  fence that orders them after the submitting thread's stream (stand-ins of torch.cuda).

With a GPU (marker ``gpu``): backward-like work on a side stream read by the background
thread (the fence's purpose, with the real torch, CuPy and DLPack), and, with two GPUs, a
worker thread reducing arrays of device 1.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import numpy as np
import pytest
from test_device_standins import FakeCupy, FakeGPU, on_new_thread, standin_transport

import ringcomm
from ringcomm.backends import _nccl_setup, cuda_device
from ringcomm.comm.base import Communicator
from ringcomm.ops import _cuda_runtime

DEVICE = 2  # the stand-in transports' GPU


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in GPU of 4 devices, its CuPy installed as ringcomm's (for ringcomm.ops.cuda)."""
    gpu = FakeGPU(count=4)
    monkeypatch.setattr(_cuda_runtime, "_cupy", FakeCupy(gpu))
    return gpu


# ---------------------------------------------------------------------------- NCCL backend
def test_nccl_collectives_from_a_worker_thread_run_on_the_transports_device(gpu):
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=DEVICE)
    comm = Communicator(t, consistency_check=True)
    cupy = t.cupy
    with cupy.cuda.Device(DEVICE):
        x = cupy.asarray(np.arange(3000, dtype=np.float32))
        rows = cupy.asarray(np.ones((5, 3), np.float64))
        recv = cupy.empty(3000, np.float32)

    def calls() -> list[Any]:
        before = gpu.current()
        out = [comm.allreduce(x[:10]),  # inline: the result is allocated here
               comm.allreduce(x, op="max"), comm.reduce_scatter(x), comm.allgather(rows),
               comm.allgatherv(rows), comm.broadcast(x.copy()),
               comm.sendrecv(x, 0, recv, 0)]
        t.isendrecv(x, 0, recv, 0).wait()  # the ring's channel: the stream wait too
        comm.consistency_check = False
        comm.barrier()  # the transport's own: NCCL, then a wait
        assert gpu.current() == before  # the thread's device is left as it was
        return out

    results = on_new_thread(calls)
    assert [r.device.id for r in results] == [DEVICE] * len(results)
    np.testing.assert_array_equal(results[0].get(), np.arange(10))
    np.testing.assert_array_equal(results[-1].get(), np.arange(3000))
    fake = t._nccl
    assert fake.calls and {device for _, device in fake.calls} == {DEVICE}
    on_new_thread(comm.close)
    assert fake.destroyed


def test_nccl_transport_refuses_arrays_of_another_gpu(gpu):
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=DEVICE)
    comm = Communicator(t)
    x = t.cupy.zeros(8, np.float32)  # device 0
    with pytest.raises(ValueError, match="array is on GPU 0, but this communicator runs on GPU 2"):
        comm.allreduce(x)
    comm.close()


# ----------------------------------------------------------------------------- MPI backend
@pytest.fixture
def mpi_comm(gpu):
    """An MPI communicator of one process that sees 4 stand-in GPUs, as local rank 5 of its
    host (so it must pick device 5 % 4 = 1)."""
    MPI = pytest.importorskip("mpi4py.MPI")
    from ringcomm.backends.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF)
    comm.transport.device_choice = cuda_device.DeviceChoice(local_rank=5)
    yield comm
    comm.close()


def test_mpi_selects_local_rank_modulo_device_count_with_a_debug_log(gpu, mpi_comm, caplog):
    assert mpi_comm.cuda_device is None  # host arrays select nothing
    mpi_comm.allreduce(np.ones(4, np.float32))
    assert mpi_comm.cuda_device is None
    cupy = _cuda_runtime._cupy
    with cupy.cuda.Device(1):
        x = cupy.asarray(np.arange(20_000, dtype=np.float32))
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        y = on_new_thread(lambda: mpi_comm.allreduce(x))
    assert mpi_comm.cuda_device == 1
    assert "device arrays run on CUDA device 1 (local rank 5 on this host modulo 4 visible " \
           "devices)" in caplog.text
    assert y.device.id == 1  # the result was allocated on the rank's device, not device 0
    np.testing.assert_array_equal(y.get(), np.arange(20_000))
    sub = mpi_comm.transport.split(0, 0)
    try:
        assert sub.device_id == 1  # one device per process, in every sub-communicator
    finally:
        sub.close()


def test_mpi_refuses_device_arrays_of_another_device_naming_both(gpu, mpi_comm):
    x = _cuda_runtime._cupy.zeros(8, np.float32)  # device 0; the rank's is 1
    with pytest.raises(ringcomm.InvalidArgumentError,
                       match=r"CUDA device 0, but rank 0 runs its device work on device 1 "
                             r"\(local rank 5 .*\).*pass device=0 to MPICommunicator"):
        mpi_comm.allreduce(x)
    mpi_comm.allreduce(np.ones(3))  # still usable


def test_mpi_device_can_be_asked_for(gpu):
    MPI = pytest.importorskip("mpi4py.MPI")
    from ringcomm.backends.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF, device=3)
    try:
        with _cuda_runtime._cupy.cuda.Device(3):
            x = _cuda_runtime._cupy.asarray(np.ones(4, np.float32))
        comm.allreduce(x)
        assert comm.cuda_device == 3
    finally:
        comm.close()
    with pytest.raises(ValueError, match="device must be a CUDA device number >= 0"):
        MPICommunicator(MPI.COMM_SELF, device=-1)
    choice = cuda_device.DeviceChoice(0, device=7)
    with pytest.raises(ValueError, match="CUDA device 7 does not exist; this process sees 4"):
        choice.select(0)


# ------------------------------------------------------------------------- ringcomm.torch
class _TorchStream:
    def __init__(self, name: str, device: int) -> None:
        self.name, self.device = name, device
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TorchStream) and other.name == self.name

    __hash__ = object.__hash__


class _TorchEvent:
    def __init__(self) -> None:
        self.recorded_on: _TorchStream | None = None

    def record(self, stream: _TorchStream) -> None:
        self.recorded_on = stream


class _TorchCuda:
    """The torch.cuda calls of the engine and the fence, over a FakeGPU: per-thread current
    device and stream, the default stream of each device."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.default = {d: _TorchStream("default", d) for d in range(gpu.count)}
        self.local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def current_stream(self, device: Any = None) -> _TorchStream:
        d = self.gpu.current() if device is None else int(getattr(device, "index", device))
        return getattr(self.local, "stream", None) or self.default[d]

    def default_stream(self, device: Any = None) -> _TorchStream:
        return self.default[self.gpu.current() if device is None else int(device)]

    def device(self, index: int) -> Any:
        return FakeCupy(self.gpu).cuda.Device(index)


@pytest.fixture
def torch_cuda(gpu, monkeypatch):
    torch = pytest.importorskip("torch")
    fake = _TorchCuda(gpu)
    for name in ("is_initialized", "current_stream", "default_stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Event", _TorchEvent)
    monkeypatch.setitem(sys.modules, "cupy", _cuda_runtime._cupy)
    return fake


def test_engine_tasks_run_under_the_communicators_device(gpu, torch_cuda):
    from ringcomm.torch._engine import Engine, engine_for

    engine = Engine(device=lambda: 3)
    try:
        assert engine.submit(gpu.current).wait() == 3
        assert engine.run(gpu.current) == 0  # inline, on the caller's thread: left alone
    finally:
        engine.close()
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=DEVICE)
    comm = Communicator(t)
    engine = engine_for(comm)
    try:
        assert engine.submit(gpu.current).wait() == DEVICE
    finally:
        engine.close()
        comm.close()


def test_a_handle_orders_the_background_thread_after_the_submitters_stream(gpu, torch_cuda):
    """Made on a thread whose current stream is a side stream, a Handle records an event there
    and makes the default stream (the background threads') wait for it; the engine's worker
    waits for it too before the task. On the default stream nothing is recorded."""
    import torch

    from ringcomm.torch._engine import Engine, Handle

    with FakeCupy(gpu).cuda.Device(1):
        assert Handle().fence is None  # the default stream: already in order
        side = torch_cuda.local.stream = _TorchStream("side", 1)
        try:
            handle = Handle()
            assert Handle(torch.device("cpu")).fence is None  # host tensors: nothing to order
        finally:
            torch_cuda.local.stream = None
    fence = handle.fence
    assert fence is not None and fence.event.recorded_on is side
    assert torch_cuda.default[1].waited == [fence.event]
    engine = Engine(device=lambda: 1)
    try:
        engine.submit(lambda: None, handle).wait()
    finally:
        engine.close()
    assert torch_cuda.default[1].waited == [fence.event, fence.event]  # and the worker's wait


# ------------------------------------------------------------------------------ with a GPU
def _cuda_torch() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    return torch


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_background_read_waits_for_a_side_stream():
    """Work on a side stream (a long sleep, then the write), then a task on the engine's
    thread that reads the tensor through DLPack and CuPy: it must see the write."""
    torch = _cuda_torch()
    from ringcomm.torch._engine import Engine, Handle
    from ringcomm.torch._tensors import as_array

    engine = Engine(device=lambda: torch.cuda.current_device())
    try:
        t = torch.zeros(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e8))  # ~0.1 s at 2 GHz
            t.fill_(1.0)
            handle = Handle(t.device)
        total = engine.submit(lambda: float(as_array(t).sum()), handle).wait()
        assert total == t.numel()
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_allreduce_async_reads_after_a_side_stream():
    """The same through ringcomm.torch's coordinator (hvd.allreduce_async) on a one-rank MPI
    communicator."""
    torch = _cuda_torch()
    MPI = pytest.importorskip("mpi4py.MPI")
    import ringcomm.torch as hvd
    from ringcomm.backends.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF)
    hvd.init(comm)
    try:
        t = torch.zeros(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e8))
            t.fill_(1.0)
            handle = hvd.allreduce_async(t, op=hvd.Sum, name="side")
        out = hvd.synchronize(handle)
        assert float(out.sum()) == t.numel()
    finally:
        hvd.shutdown()
        comm.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_worker_thread_reduces_arrays_of_device_one():
    """Two GPUs: an MPI communicator on device 1 (asked for), called from a new thread whose
    current device is 0: the result is on device 1, and the thread's device is left alone."""
    cupy = pytest.importorskip("cupy")
    MPI = pytest.importorskip("mpi4py.MPI")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count < 2:
        pytest.skip("needs two GPUs")
    from ringcomm.backends.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF, device=1)
    try:
        with cupy.cuda.Device(1):
            x = cupy.arange(1 << 20, dtype=cupy.float32)

        def work() -> tuple[int, int]:
            y = comm.allreduce(x, compression=ringcomm.Int8())
            return y.device.id, cupy.cuda.runtime.getDevice()

        assert on_new_thread(work) == (1, 0)
    finally:
        comm.close()
