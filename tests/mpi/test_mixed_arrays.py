"""One NCCL communicator, both kinds of arrays: CuPy arrays over NCCL, NumPy arrays over the
host transport, the array kind agreed on by every rank.

Without a GPU the NCCL communicator runs on the stand-ins of tests/test_device_standins.py:
its rendezvous and host transport are real (MPI), its NCCL calls are made by a stand-in that
moves the bytes over MPI and refuses a call made with another device current than its own
(rank r on device r). What is tested is real: which path each kind takes, the results against
the MPI backend's, the agreement on the array kind, and the host transport of a job without
MPI (NumPy arrays staged through device buffers), here with MPI carrying the stand-in's bytes.

With GPUs (marker ``gpu``): the real NCCL communicator, one rank per GPU, on NumPy arrays.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import same_on_all_ranks
from test_device_standins import FakeCupy, FakeGPU, on_new_thread, standin_transport

import ringcomm
from ringcomm.backends import _nccl_host, _nccl_setup, cuda_device, nccl
from ringcomm.comm.base import Communicator
from ringcomm.ops import _cuda_runtime

GPU_TIMEOUT = 300


@pytest.fixture(scope="module")
def standin(world):
    """An NCCL communicator on stand-ins over every rank (rank r on stand-in device r), with
    the stand-in CuPy installed as ringcomm's; and a transport-level view of it."""
    with _standin_comm(world, FakeGPU(count=max(4, world.Get_size())), timeout=60) as comm:
        yield comm


@contextlib.contextmanager
def _standin_comm(world: Any, gpu: FakeGPU, timeout: float,
                  staged: bool = False) -> Iterator[Communicator]:
    """A Communicator over a stand-in NCCL transport on every rank of ``world`` (rank r on
    stand-in device r; host arrays over a duplicate of ``world``, or staged through the
    stand-in NCCL when ``staged``), with the stand-in CuPy installed as ringcomm's while it is
    open."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cuda_runtime, "_cupy", FakeCupy(gpu))
        data = world.Dup()
        rdv = _nccl_setup.connect(world, timeout=60)
        t = standin_transport(gpu, rdv, device=world.Get_rank(), timeout=timeout, mpi=data)
        if staged:
            t._host = _nccl_host.StagedHost(t)
        comm = Communicator(t)
        try:
            yield comm
        finally:
            comm.close()
            data.Free()


def _device(comm: Communicator, x: np.ndarray) -> Any:
    """``x`` as a stand-in device array on the communicator's device."""
    cupy = comm.transport.cupy
    with cupy.cuda.Device(comm.transport.device_id):
        return cupy.asarray(x)


def _ints(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Small integers: every sum is exact in every dtype, whatever the order of additions."""
    return rng.integers(-8, 9, n).astype(dtype)


def _data_calls(comm: Communicator) -> list[str]:
    return [name for name, _ in comm.transport._nccl.calls if name not in ("abort", "destroy")]


# ------------------------------------------------------------------------ host arrays
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_host_arrays_take_the_mpi_path_and_match_the_mpi_backend(standin, rng, dtype):
    """NumPy arrays on the NCCL communicator: over MPI (no NCCL call at all), with the very
    bits of the MPI backend with the same settings (the NCCL backend's inline size is the
    classic one: its agreement is a fixed-size allgather), from a worker thread too."""
    with ringcomm.init("mpi", abort_on_exception=False,
                       inline_bytes=standin.inline_bytes) as comm:
        _match_the_mpi_backend(standin, comm, rng, dtype)


def _match_the_mpi_backend(standin, comm, rng, dtype):
    assert standin.transport.host is standin.transport._rdv.transport
    before = len(_data_calls(standin))
    sent = standin.stats.bytes_sent
    for n in (3, 1000, 300_001):  # inline, ring, several segments
        x = rng.standard_normal(n).astype(dtype) if dtype[0] == "f" else _ints(rng, n, dtype)
        for op in ("sum", "max"):
            want = comm.allreduce(x, op=op)
            np.testing.assert_array_equal(standin.allreduce(x, op=op), want)
            got = on_new_thread(lambda x=x, op=op: standin.allreduce(x, op=op))
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(standin.reduce_scatter(x), comm.reduce_scatter(x))
    rows = rng.standard_normal((standin.rank + 2, 3)).astype(dtype)
    np.testing.assert_array_equal(standin.allgatherv(rows), comm.allgatherv(rows))
    np.testing.assert_array_equal(standin.allgather(rows[:2]), comm.allgather(rows[:2]))
    b = rng.standard_normal(5000).astype(dtype)
    np.testing.assert_array_equal(standin.broadcast(b.copy(), root=standin.size - 1),
                                  comm.broadcast(b.copy(), root=standin.size - 1))
    g = rng.standard_normal(50_000).astype(np.float32)
    calls = comm._allreduce.compressed_calls
    want = comm.allreduce(g, compression=ringcomm.Int8())
    standin._allreduce.compressed_calls = calls
    np.testing.assert_array_equal(standin.allreduce(g, compression=ringcomm.Int8()), want)
    assert len(_data_calls(standin)) == before  # nothing went through NCCL
    assert standin.stats.bytes_sent > sent or standin.size == 1  # and the wire was counted


def test_host_and_device_peers_of_a_sendrecv(standin, rng):
    """Point to point is not agreed on: the two peers may pass different kinds of arrays
    (both sides go through NCCL, host arrays staged)."""
    n, r = standin.size, standin.rank
    right, left = (r + 1) % n, (r - 1) % n
    mine = np.arange(100, dtype=np.int64) + r
    send = mine if r % 2 else _device(standin, mine)
    recv = _device(standin, np.zeros(100, np.int64)) if r % 2 == 0 else np.zeros(100, np.int64)
    got = standin.sendrecv(send, right, recv, left)
    host = got if type(got) is np.ndarray else got.get()
    np.testing.assert_array_equal(host, np.arange(100) + left)


# ---------------------------------------------------------------------- device arrays
def test_device_arrays_take_the_nccl_path_on_the_ranks_device(standin, world, rng):
    """CuPy arrays: NCCL's own collectives, every call with the rank's device current, also
    from a worker thread whose current device is 0 (a max of ints: NCCL's float max drops a
    NaN, so ringcomm's ring runs those). The length divides by the size: NCCL's
    reduce-scatter takes equal parts (uneven ones run ringcomm's ring, with CUDA kernels
    this stand-in does not run)."""
    n = standin.size
    x = _ints(rng, n << 14, "float32")
    everyone = np.stack(world.allgather(x))
    before = len(_data_calls(standin))

    def calls() -> list[Any]:
        dx = _device(standin, x)
        rows = _device(standin, x[:12].reshape(4, 3))
        return [standin.allreduce(dx), standin.allreduce(_device(standin, x.astype(np.int32)),
                                                         op="max"),
                standin.reduce_scatter(dx), standin.allgather(rows),
                standin.broadcast(dx.copy(), root=0)]

    total, big, part, gathered, bcast = on_new_thread(calls)
    for y in (total, big, part, gathered, bcast):
        assert y.device.id == standin.transport.device_id
    np.testing.assert_array_equal(total.get(), everyone.sum(0))
    np.testing.assert_array_equal(big.get(), everyone.max(0).astype(np.int32))
    r, size = standin.rank, x.size
    np.testing.assert_array_equal(part.get(), everyone.sum(0)[r * size // n:(r + 1) * size // n])
    np.testing.assert_array_equal(gathered.get(), everyone[:, :12].reshape(-1, 3))
    np.testing.assert_array_equal(bcast.get(), everyone[0])
    assert same_on_all_ranks(world, total.get())
    assert len(_data_calls(standin)) > before


# -------------------------------------------------------------------------- agreement
_CALLS: dict[str, Callable[[Communicator, Any], Any]] = {
    "allreduce-inline": lambda c, x: c.allreduce(x[:16]),
    "allreduce": lambda c, x: c.allreduce(x),
    "allreduce-int8": lambda c, x: c.allreduce(x, compression=ringcomm.Int8()),
    "reduce_scatter": lambda c, x: c.reduce_scatter(x),
    "allgather": lambda c, x: c.allgather(x),
    "allgatherv": lambda c, x: c.allgatherv(x),
    "broadcast": lambda c, x: c.broadcast(x),
}


@pytest.mark.parametrize("call", list(_CALLS))
def test_a_host_array_against_a_device_array_fails_alike_everywhere(standin, world, call):
    """Rank 0 passes a NumPy array, the others a CuPy array: the same ArgumentMismatchError on
    every rank, naming the array kinds, before any data moves; the communicator goes on."""
    if standin.size < 2:
        pytest.skip("needs two ranks")
    x = np.ones(4096, np.float32)
    arg = x if standin.rank == 0 else _device(standin, x)
    with pytest.raises(ringcomm.ArgumentMismatchError) as info:
        _CALLS[call](standin, arg)
    message = str(info.value)
    assert "array differs between ranks: host (NumPy) on rank 0; device (CuPy) on rank" \
        in message
    assert info.value.differences["array"][0] == "host (NumPy)"
    assert world.allgather(message) == [message] * standin.size
    np.testing.assert_array_equal(standin.allreduce(x), x * standin.size)  # still usable


def test_the_mpi_backend_agrees_on_the_array_kind_too(comm, world):
    """The same rule on the MPI backend: one kind of array per call on every rank."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    x = np.ones(64, np.float32)
    gpu = FakeGPU()
    t = comm.transport
    try:
        with pytest.MonkeyPatch.context() as patch:
            fake = FakeCupy(gpu)
            patch.setattr(_cuda_runtime, "_cupy", fake)
            with fake.cuda.Device(comm.local_rank % gpu.count):  # the rank's own device
                arg = x if comm.rank == 0 else fake.asarray(x)
            with pytest.raises(ringcomm.ArgumentMismatchError,
                               match="array differs between ranks"):
                comm.allreduce(arg)
    finally:  # forget the stand-in's staging and device selection
        t._device_stage = None
        t.device_choice = cuda_device.DeviceChoice(t.local_rank)


# ----------------------------------------------------------- host transport without MPI
@pytest.fixture
def staged(standin):
    """The stand-in communicator with the host transport of a job without MPI: host arrays
    staged through device buffers and moved by (stand-in) NCCL."""
    t = standin.transport
    saved = t._host
    t._host = _nccl_host.StagedHost(t)
    yield standin
    t._host.close()
    t._host = saved


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_staged_host_arrays_match_the_mpi_backend(staged, comm, rng, dtype):
    """Without MPI, NumPy arrays go through NCCL: allreduce and reduce-scatter as NCCL's own
    on a device copy (the ring on staged exchanges for bfloat16, which CuPy lacks), gathers
    and broadcasts through device buffers; the results are the MPI backend's."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt: Any = ml_dtypes.bfloat16
    else:
        dt = np.dtype(dtype)
    before = len(_data_calls(staged))
    for n in (5, 4096, 70_001):
        x = _ints(rng, n, "int64").astype(dt)
        np.testing.assert_array_equal(staged.allreduce(x), comm.allreduce(x))
        np.testing.assert_array_equal(staged.reduce_scatter(x), comm.reduce_scatter(x))
    rows = _ints(rng, 3 * (staged.rank + 1), "int64").astype(dt).reshape(-1, 3)
    np.testing.assert_array_equal(staged.allgatherv(rows), comm.allgatherv(rows))
    b = _ints(rng, 1000, "int64").astype(dt)
    np.testing.assert_array_equal(staged.broadcast(b.copy(), root=staged.size - 1),
                                  comm.broadcast(b.copy(), root=staged.size - 1))
    assert len(_data_calls(staged)) > before or staged.size == 1


def test_staged_waits_are_bounded(world):
    """A staged receive waits for the GPU the NCCL way: on a stuck GPU it ends at the timeout
    with ncclCommAbort, not in a blocking synchronize (a communicator of its own: it is left
    aborted)."""
    gpu = FakeGPU(count=max(4, world.Get_size()))
    with _standin_comm(world, gpu, timeout=0.2, staged=True) as comm:
        t = comm.transport
        try:
            r = comm.rank
            np.testing.assert_array_equal(comm.sendrecv(np.ones(4), r, np.zeros(4), r), 1.0)
            gpu.stuck = True
            # Agreed over MPI, then the copy to the device: it waits, bounded, for the stream
            # (at one rank an allreduce moves nothing: a sendrecv to itself is staged).
            if comm.size == 1:
                with pytest.raises(ringcomm.CollectiveTimeoutError, match=r"timed out"):
                    comm.sendrecv(np.ones(100_000), r, np.zeros(100_000), r)
            else:
                with pytest.raises(ringcomm.CollectiveTimeoutError,
                                   match=r"allreduce timed out"):
                    comm.allreduce(np.ones(100_000))
            assert t._nccl.aborted
            with pytest.raises(RuntimeError, match="aborted after an earlier failure"):
                comm.allreduce(np.ones(4))
        finally:
            gpu.stuck = False
    world.Barrier()


# ------------------------------------------------------------------------------ with GPUs
@pytest.fixture(scope="module")
def hosts(world) -> list[tuple[str, int]]:
    try:
        count = _nccl_setup.device_count(_nccl_setup.import_cupy())[0]
    except RuntimeError:
        count = 0
    return world.allgather((socket.gethostname(), count))


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
def test_real_nccl_communicator_takes_numpy_arrays(world, comm, hosts, rng):
    """Every rank its own one-rank NCCL communicator (one GPU suffices): NumPy arrays work and
    give the MPI backend's results; CuPy arrays still go over NCCL."""
    if not all(count for _, count in hosts):
        pytest.skip("needs a GPU visible to every rank")
    import cupy

    mpi_self = ringcomm.backends.mpi.MPICommunicator(MPI.COMM_SELF)
    gpu = nccl.NCCLCommunicator(mpi_comm=MPI.COMM_SELF, device=0)
    try:
        x = rng.standard_normal(100_003).astype(np.float32)
        for op in ("sum", "avg", "max"):
            np.testing.assert_array_equal(gpu.allreduce(x, op=op), mpi_self.allreduce(x, op=op))
        np.testing.assert_array_equal(gpu.allreduce(x[:5]), x[:5])
        np.testing.assert_array_equal(gpu.reduce_scatter(x), x)
        np.testing.assert_array_equal(gpu.allgatherv(x), x)
        np.testing.assert_array_equal(gpu.broadcast(x.copy()), x)
        recv = np.empty_like(x)
        np.testing.assert_array_equal(gpu.sendrecv(x, 0, recv, 0), x)
        y = gpu.allreduce(cupy.asarray(x))
        assert isinstance(y, cupy.ndarray)
        np.testing.assert_array_equal(y.get(), x)
        gpu.barrier()
    finally:
        gpu.close()
        mpi_self.close()


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
def test_real_nccl_mixed_kinds_fail_alike(world, hosts):
    """With a GPU per rank: a NumPy array on rank 0 against CuPy arrays elsewhere raises the
    same error on every rank, and the communicator goes on."""
    n = world.Get_size()
    per_host: dict[str, int] = {}
    for host, _ in hosts:
        per_host[host] = per_host.get(host, 0) + 1
    if n < 2 or any(count < per_host[host] for host, count in hosts):
        pytest.skip("needs two ranks, each with a GPU of its own")
    import cupy

    comm = nccl.NCCLCommunicator(mpi_comm=world)
    try:
        x = np.ones(4096, np.float32)
        arg = x if comm.rank == 0 else cupy.asarray(x)
        with pytest.raises(ringcomm.ArgumentMismatchError, match="array differs") as info:
            comm.allreduce(arg)
        assert world.allgather(str(info.value)) == [str(info.value)] * n
        np.testing.assert_array_equal(comm.allreduce(x), x * n)
    finally:
        comm.close()
