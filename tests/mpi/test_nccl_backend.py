"""NCCL backend under mpiexec: startup errors on every rank, and the collectives on GPUs.

Without a GPU (CI) the startup checks run for real over MPI: a rank that cannot start, or two
ranks on one GPU, raise the same clear error on every rank. (The communicator's own logic on
stand-ins of CuPy and NCCL: tests/test_nccl_failure.py, tests/test_device_scope.py and
tests/mpi/test_mixed_arrays.py.) With GPUs (marker ``gpu``):

- every rank builds a one-rank NCCL communicator and runs every collective against the MPI
  backend's results on the same data;
- two ranks on one GPU get the clear error, not NCCL's;
- ``test_multi_gpu[n]`` runs the collectives over n ranks with a GPU each, skipping where the
  job has too few ranks or GPUs;
- ``split`` of the transport, with ``ncclCommSplit`` and with its fallback (a fresh unique id
  per group), on one rank and over n ranks.

Whether to skip is decided from what every rank reports, so that all ranks take the same path.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import gather_inputs, same_on_all_ranks

from ringcomm.backends import _nccl_lib, _nccl_setup, nccl
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.backends.nccl import NCCLCommunicator
from ringcomm.comm.base import Communicator
from ringcomm.core.types import RING, ReduceOp

GPU_TIMEOUT = 300  # the first calls compile CuPy kernels


def _gpus_here() -> int:
    try:
        return _nccl_setup.device_count(_nccl_setup.import_cupy())[0]
    except RuntimeError:
        return 0


@pytest.fixture(scope="module")
def hosts(world) -> list[tuple[str, int]]:
    """(host name, visible GPU count) of every rank, the same list on every rank."""
    return world.allgather((socket.gethostname(), _gpus_here()))


def _fits(hosts: list[tuple[str, int]], ranks: range) -> bool:
    """Whether ``ranks`` can each have a GPU of their own."""
    per_host: dict[str, int] = {}
    for r in ranks:
        per_host[hosts[r][0]] = per_host.get(hosts[r][0], 0) + 1
    return all(hosts[r][1] >= per_host[hosts[r][0]] for r in ranks)


# ------------------------------------------------------------------------------- without GPU
def test_without_gpu_every_rank_raises_the_clear_error(world, hosts):
    if any(count for _, count in hosts):
        pytest.skip("GPUs are visible; this checks the behaviour without them")
    # (without CuPy installed, the error asks for it first)
    with pytest.raises(RuntimeError, match=r"needs (a CUDA GPU|CuPy and NCCL).*"
                                           r"pip install 'ringcomm\[cuda12\]'"):
        NCCLCommunicator(mpi_comm=world)


def test_a_rank_that_cannot_start_stops_every_rank(world, monkeypatch):
    """Rank 0 has no GPU, the others pretend to have one: all raise, none waits for rank 0."""
    rank = world.Get_rank()
    if rank:
        ident = {"host": "h", "bus": f"0000:{rank:02x}:00.0", "uuid": f"u{rank}", "device": 0,
                 "count": 1}
        monkeypatch.setattr(_nccl_setup, "local_setup", lambda *a: _nccl_setup.LocalSetup(
            None, None, 0, ident, None))
    else:
        def fail(*args: object) -> None:
            raise RuntimeError("the NCCL backend needs a CUDA GPU (pretend)")

        monkeypatch.setattr(_nccl_setup, "local_setup", fail)
    expected = "needs a CUDA GPU" if rank == 0 else "cannot start on rank 0: the NCCL backend"
    with pytest.raises(RuntimeError, match=expected):
        NCCLCommunicator(mpi_comm=world)


def test_shared_gpu_is_refused_before_nccl_starts(world, monkeypatch):
    """Every rank reports the same GPU: the duplicate check stops all of them."""
    if world.Get_size() < 2:
        pytest.skip("needs two ranks")
    ident = {"host": "h", "bus": "0000:3b:00.0", "uuid": "same", "device": 0, "count": 1}
    monkeypatch.setattr(_nccl_setup, "local_setup", lambda *a: _nccl_setup.LocalSetup(
        None, None, 0, ident, None))
    with pytest.raises(RuntimeError, match=r"ranks 0, 1.* would share GPU 0000:3b:00.0 .*one GPU "
                                           r"per rank.*backend='mpi'"):
        NCCLCommunicator(mpi_comm=world)


def test_usable_everywhere_agrees(world, hosts, monkeypatch):
    """The same answer on every rank; False as soon as one rank has no GPU of its own."""
    answer = nccl.usable_everywhere(world)
    assert world.allgather(answer) == [answer] * world.Get_size()
    if not all(count for _, count in hosts):
        assert answer is False
    ident = {"host": "h", "bus": "0000:3b:00.0", "uuid": "same", "device": 0, "count": 1}
    monkeypatch.setattr(_nccl_setup, "local_setup", lambda *a: _nccl_setup.LocalSetup(
        None, None, 0, dict(ident, uuid=f"u{world.Get_rank()}"), None))
    assert nccl.usable_everywhere(world) is True  # every rank has a GPU of its own
    monkeypatch.setattr(_nccl_setup, "local_setup", lambda *a: _nccl_setup.LocalSetup(
        None, None, 0, ident, None))
    assert nccl.usable_everywhere(world) is (world.Get_size() == 1)  # all on one GPU


def test_mpi_rendezvous(world):
    rdv = _nccl_setup.connect(world)
    try:
        assert (rdv.kind, rdv.rank, rdv.size) == ("mpi", world.Get_rank(), world.Get_size())
        assert 0 <= rdv.local_rank < rdv.local_size <= rdv.size
        assert rdv.allgather_object(rdv.rank * 10) == [r * 10 for r in range(rdv.size)]
        data = b"x" * 128 if rdv.rank == 0 else None
        assert rdv.bcast_bytes(data, 0) == b"x" * 128
        send = np.full(8, rdv.rank, np.uint8)
        recv = np.empty((rdv.size, 8), np.uint8)
        assert rdv.allgather_fixed(send, recv)
        assert (recv == np.arange(rdv.size, dtype=np.uint8)[:, None]).all()
    finally:
        rdv.close()


def test_mpi_rendezvous_splits_like_mpi(world):
    """Split by rank parity with descending keys: ranks ordered by (key, rank), and the parent
    goes on."""
    rdv = _nccl_setup.connect(world)
    n, r = rdv.size, rdv.rank
    sub = rdv.split(r % 2, -r)
    try:
        members = [q for q in reversed(range(n)) if q % 2 == r % 2]
        assert (sub.kind, sub.rank, sub.size) == ("mpi", members.index(r), len(members))
        assert 0 <= sub.local_rank < sub.local_size <= sub.size
        assert sub.allgather_object(r) == members
        assert sub.bcast_bytes(b"id%d" % r if sub.rank == 0 else None, 0) == b"id%d" % members[0]
        assert rdv.allgather_object(sub.rank) == [
            [q for q in reversed(range(n)) if q % 2 == p % 2].index(p) for p in range(n)]
    finally:
        sub.close()
        rdv.close()


# ---------------------------------------------------------------------------------- with GPU
@pytest.fixture(scope="module")
def self_pair(world, hosts):
    """A one-rank NCCL communicator and a one-rank MPI communicator on every rank."""
    if not all(count for _, count in hosts):
        pytest.skip("needs a GPU visible to every rank")
    nccl = NCCLCommunicator(mpi_comm=MPI.COMM_SELF, device=0)
    mpi = MPICommunicator(MPI.COMM_SELF)
    yield nccl, mpi
    nccl.close()
    mpi.close()


def _data(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, op: str) -> np.ndarray:
    if op == "prod":
        return rng.choice(np.array([-2, -1, 1, 2]), shape).astype(dtype)
    return rng.integers(-8, 9, shape).astype(dtype)  # sums are exact in every dtype


_DTYPES = ["float16", "float32", "float64", "int32", "int64"]
_OPS = ["sum", "avg", "min", "max", "prod"]


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3000, 7), (257, 4, 3)])
def test_world_size_one_matches_mpi(self_pair, rng, dtype, shape):
    import cupy

    nccl, mpi = self_pair
    x = rng.standard_normal(shape).astype(dtype) if dtype[0] == "f" else \
        _data(rng, shape, dtype, "sum")
    dx = cupy.asarray(x)
    for op in _OPS:
        if op == "avg" and dtype.startswith("int"):
            continue
        np.testing.assert_array_equal(nccl.allreduce(dx, op=op).get(), mpi.allreduce(x, op=op))
        np.testing.assert_array_equal(nccl.reduce_scatter(dx, op=op).get(),
                                      mpi.reduce_scatter(x, op=op))
    out = cupy.empty_like(dx)
    assert nccl.allreduce(dx, out=out) is out
    strided = cupy.asarray(np.ascontiguousarray(x.reshape(-1)[::-1]))[::2]
    np.testing.assert_array_equal(nccl.allreduce(strided).get(), mpi.allreduce(strided.get()))
    np.testing.assert_array_equal(nccl.allgather(dx).get(), mpi.allgather(x))
    np.testing.assert_array_equal(nccl.allgatherv(dx).get(), mpi.allgatherv(x))
    np.testing.assert_array_equal(nccl.broadcast(dx.copy()).get(), mpi.broadcast(x.copy()))
    recv = cupy.empty_like(dx)
    np.testing.assert_array_equal(nccl.sendrecv(dx, 0, recv, 0).get(), x)
    nccl.barrier()


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
def test_world_size_one_compressed_and_native(self_pair, rng):
    import cupy

    import ringcomm

    nccl, mpi = self_pair
    x = rng.standard_normal(5000).astype(np.float32)
    dx = cupy.asarray(x)
    for comp in (ringcomm.FP16(), ringcomm.Int8()):
        y = nccl.allreduce(dx, compression=comp, feedback=ringcomm.ErrorFeedback(), name="g")
        ref = mpi.allreduce(x, compression=comp, feedback=ringcomm.ErrorFeedback(), name="g")
        np.testing.assert_array_equal(y.get(), ref)
    y = cupy.empty_like(dx)
    assert nccl.transport.native_allreduce(dx, y, ReduceOp.SUM) is True
    np.testing.assert_array_equal(y.get(), x)
    # NCCL's fmaxf drops a NaN: float max is the ring's (which keeps it), integer max NCCL's.
    assert nccl.transport.native_allreduce(dx, y, ReduceOp.MAX) is False
    held = x.copy()
    held[7] = np.nan
    np.testing.assert_array_equal(nccl.allreduce(cupy.asarray(held), op=ReduceOp.MAX).get(),
                                  held)
    di = cupy.asarray(np.arange(50, dtype=np.int32))
    yi = cupy.empty_like(di)
    assert nccl.transport.native_allreduce(di, yi, ReduceOp.MAX) is True
    np.testing.assert_array_equal(yi.get(), np.arange(50, dtype=np.int32))
    part = nccl.transport.native_reduce_scatter(dx[:4999], ReduceOp.SUM)  # any length divides by 1
    np.testing.assert_array_equal(part.get(), x[:4999])
    # The ring's channel: the current stream waits for the transfer, no host wait needed.
    recv = cupy.empty_like(dx)
    nccl.transport.isendrecv(dx, 0, recv, 0, channel=RING).wait()
    np.testing.assert_array_equal((recv * 2).get(), x * 2)


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
def test_benchmark_baseline_is_nccl_allreduce(self_pair, rng):
    """ringcomm.perf.nccl_baseline: NCCL's allreduce on a transport of its own, made once."""
    import cupy

    from ringcomm.perf import nccl_baseline

    x = rng.standard_normal(5000).astype(np.float32)
    dx, y = cupy.asarray(x), cupy.empty(5000, np.float32)
    try:
        assert nccl_baseline.allreduce_fn(MPI.COMM_SELF, dx, "sum", out=y)() is True
        np.testing.assert_array_equal(y.get(), x)
        # NCCL's float min and max (fmaxf/fminf) drop a NaN: ringcomm's ring runs them.
        assert nccl_baseline.allreduce_fn(MPI.COMM_SELF, dx, "max", out=y)() is False
        ints = cupy.arange(10, dtype=np.int32)
        assert nccl_baseline.allreduce_fn(MPI.COMM_SELF, ints, "max")() is True
        assert nccl_baseline.transport(MPI.COMM_SELF) is nccl_baseline.transport(MPI.COMM_SELF)
    finally:
        nccl_baseline.close_all()  # no NCCL communicator outlives the test


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
def test_numpy_arrays_take_the_host_transport(self_pair, rng):
    """NumPy arrays are reduced over the host transport (MPI here), with the MPI backend's
    results; other objects are refused with a message naming both kinds taken."""
    nccl, mpi = self_pair
    assert nccl.transport.host is nccl.transport._rdv.transport
    x = rng.standard_normal(10_000).astype(np.float32)
    np.testing.assert_array_equal(nccl.allreduce(x, op="max"), mpi.allreduce(x, op="max"))
    np.testing.assert_array_equal(nccl.allgatherv(x), mpi.allgatherv(x))
    np.testing.assert_array_equal(nccl.broadcast(x.copy()), x)
    np.testing.assert_array_equal(nccl.reduce_scatter(x), x)
    np.testing.assert_array_equal(nccl.sendrecv(x, 0, np.empty_like(x), 0), x)
    with pytest.raises(TypeError, match=r"takes CuPy arrays \(over NCCL\) and NumPy arrays"):
        nccl.transport.check_arrays(None, [1.0, 2.0])
    nccl.barrier()  # still usable


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
def test_two_ranks_on_one_gpu_get_the_clear_error(world, hosts):
    if world.Get_size() < 2 or hosts[0][0] != hosts[1][0] or not hosts[0][1]:
        pytest.skip("needs ranks 0 and 1 on one host with a GPU")
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED)
    if pair == MPI.COMM_NULL:
        return
    try:
        with pytest.raises(RuntimeError, match=r"ranks 0, 1 would share GPU .*one GPU per rank"
                                               r".*backend='mpi'"):
            NCCLCommunicator(mpi_comm=pair, device=0)
    finally:
        pair.Free()


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
@pytest.mark.parametrize("ngpus", [2, 4, 8])
def test_multi_gpu(world, hosts, rng, ngpus):
    if world.Get_size() < ngpus or not _fits(hosts, range(ngpus)):
        pytest.skip(f"needs {ngpus} ranks with a GPU each")
    sub = world.Split(0 if world.Get_rank() < ngpus else MPI.UNDEFINED)
    if sub == MPI.COMM_NULL:
        return
    try:
        comm = NCCLCommunicator(mpi_comm=sub)
        try:
            _check_collectives(comm, sub, rng)
        finally:
            comm.close()
    finally:
        sub.Free()


def _split_path(world: MPI.Comm, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make NCCLTransport.split take ``ncclCommSplit`` (native) or its fallback, or skip on
    every rank alike where NCCL has no ncclCommSplit."""
    try:
        can = _nccl_lib.load().can_split
    except RuntimeError:
        can = False
    if native and not all(world.allgather(can)):
        pytest.skip("this NCCL has no ncclCommSplit (NCCL < 2.18)")
    if not native and can:
        monkeypatch.setattr(_nccl_lib.load(), "can_split", False)


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
@pytest.mark.parametrize("native", [True, False], ids=["ncclCommSplit", "fresh-id"])
def test_world_size_one_split(world, self_pair, rng, monkeypatch, native):
    import cupy

    _split_path(world, native, monkeypatch)
    parent, mpi = self_pair
    sub = Communicator(parent.transport.split(0, 0))
    try:
        assert (sub.backend, sub.rank, sub.size) == ("nccl", 0, 1)
        assert sub.transport.device.id == parent.device.id
        x = rng.standard_normal(1000).astype(np.float32)
        dx, y = cupy.asarray(x), cupy.empty(1000, np.float32)
        assert sub.transport.native_allreduce(dx, y, ReduceOp.SUM) is True
        np.testing.assert_array_equal(y.get(), x)
        np.testing.assert_array_equal(sub.allreduce(dx, op="max").get(), mpi.allreduce(x, op="max"))
        np.testing.assert_array_equal(sub.allgatherv(dx).get(), mpi.allgatherv(x))
        np.testing.assert_array_equal(sub.broadcast(dx.copy()).get(), x)
        sub.barrier()
    finally:
        sub.close()
    parent.barrier()  # the parent goes on


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT)
@pytest.mark.parametrize("native", [True, False], ids=["ncclCommSplit", "fresh-id"])
@pytest.mark.parametrize("ngpus", [2, 4, 8])
def test_multi_gpu_split(world, hosts, rng, monkeypatch, ngpus, native):
    """Split n GPUs by rank parity with descending keys; every collective over each half
    against MPI's split of the same ranks."""
    if world.Get_size() < ngpus or not _fits(hosts, range(ngpus)):
        pytest.skip(f"needs {ngpus} ranks with a GPU each")
    _split_path(world, native, monkeypatch)
    sub = world.Split(0 if world.Get_rank() < ngpus else MPI.UNDEFINED)
    if sub == MPI.COMM_NULL:
        return
    r = sub.Get_rank()
    ref = sub.Split(r % 2, -r)
    try:
        parent = NCCLCommunicator(mpi_comm=sub)
        try:
            half = Communicator(parent.transport.split(r % 2, -r))
            try:
                assert (half.rank, half.size) == (ref.Get_rank(), ref.Get_size())
                _check_collectives(half, ref, rng)
            finally:
                half.close()
            parent.barrier()
        finally:
            parent.close()
    finally:
        ref.Free()
        sub.Free()


def _check_collectives(comm: Communicator, sub: MPI.Comm, rng: np.random.Generator) -> None:
    """Every collective over ``comm`` against NumPy on every rank's inputs; exact, since the
    inputs are small integers."""
    import cupy

    n, r = comm.size, comm.rank
    for dtype in _DTYPES:
        for op in _OPS:
            if op == "avg" and dtype.startswith("int"):
                continue
            for length in (3, 1000, 1 << 16, 1 << 16 | 5):  # inline, NCCL, and uneven sizes
                x = _data(rng, (length,), dtype, op)
                xs = gather_inputs(sub, x).astype(np.float64)
                ref = {"sum": xs.sum(0), "avg": xs.sum(0) / n, "min": xs.min(0),
                       "max": xs.max(0), "prod": xs.prod(0)}[op].astype(dtype)
                y = comm.allreduce(cupy.asarray(x), op=op).get()
                np.testing.assert_array_equal(y, ref)
                assert same_on_all_ranks(sub, y)
                part = comm.reduce_scatter(cupy.asarray(x), op=op).get()
                np.testing.assert_array_equal(part, ref[r * length // n:(r + 1) * length // n])
    x = rng.standard_normal((r + 1, 3)).astype(np.float32)
    np.testing.assert_array_equal(comm.allgatherv(cupy.asarray(x)).get(),
                                  np.concatenate(sub.allgather(x)))
    x = rng.standard_normal((4, 3))
    np.testing.assert_array_equal(comm.allgather(cupy.asarray(x)).get(),
                                  np.concatenate(sub.allgather(x)))
    root = n - 1
    x = cupy.asarray(rng.standard_normal(1000))
    expected = sub.bcast(x.get() if r == root else None, root=root)
    np.testing.assert_array_equal(comm.broadcast(x, root=root).get(), expected)
    right, left = (r + 1) % n, (r - 1) % n
    recv = cupy.empty(100, np.int32)
    comm.sendrecv(cupy.full(100, r, np.int32), right, recv, left)
    assert (recv.get() == left).all()
    comm.barrier()
