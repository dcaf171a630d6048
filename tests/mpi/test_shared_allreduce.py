"""Medium dense allreduces through the shared segment of ranks on one node
(ringcomm/backends/mpi_shared.py): the exact bits of a rank-order reduction on every rank, no
call's data in another's, and every rank on one path where a rank cannot map the segment."""

from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import fresh_mpi_communicator, gather_inputs, same_on_all_ranks
from test_allreduce import check, make

import ringcomm
from ringcomm.backends import mpi as mpi_backend
from ringcomm.backends import mpi_shared
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.comm.agree import INLINE_BYTES
from ringcomm.core.types import CollectiveTimeoutError

MIN = mpi_backend._SHARED_MIN_BYTES
_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
           "max": np.maximum}


def rank_order(world: MPI.Comm, x: np.ndarray, op: str) -> np.ndarray:
    """Every rank's ``x`` reduced in rank order in ``x``'s dtype (divided by the size for
    avg): the bits the segment's owners compute."""
    xs = gather_inputs(world, x)
    acc = xs[0].copy()
    for row in xs[1:]:
        _UFUNCS[op](acc, row, out=acc)
    if op == "avg":
        np.divide(acc, len(xs), out=acc)
    return acc


@pytest.fixture(scope="module")
def comm():
    """A communicator whose calls above 4 KiB are not inlined, so that 16-64 KiB calls take
    the native path too, and whose native limit (the segment's slot) is 256 KiB at every
    size, so that the calls around the slot stay quick."""
    saved = os.environ.get(mpi_backend.NATIVE_BYTES_ENV)
    os.environ[mpi_backend.NATIVE_BYTES_ENV] = "256K"
    try:
        c = ringcomm.init("mpi", abort_on_exception=False, inline_bytes=INLINE_BYTES)
    finally:
        if saved is None:
            del os.environ[mpi_backend.NATIVE_BYTES_ENV]
        else:
            os.environ[mpi_backend.NATIVE_BYTES_ENV] = saved
    yield c
    c.close()


@pytest.fixture
def shared(comm):
    """Whether ``comm``'s transport has a segment: every test's calls run on one node."""
    if comm.size == 1:
        pytest.skip("one rank copies")
    # A medium call makes it (every rank at the same call).
    comm.allreduce(np.ones(MIN // 4, np.float32))
    segment = comm.transport._shared
    assert segment, "every rank of the test job shares one node"
    return segment


def _sizes(slot: int, item: int) -> list[int]:
    return [MIN - item, MIN, MIN + 7 * item, 100_003 * item // 4 * 4, slot - item, slot,
            slot + item]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_rank_order_bits_at_every_boundary(comm, world, rng, shared, dtype, op):
    """Below the segment's least size, at it, odd counts, its largest and past it (MPI's own
    then): a rank-order reduction's bits wherever the segment runs, the same on every rank."""
    if op == "avg" and dtype.startswith("int"):
        pytest.skip("avg is refused for integers")
    if op in ("min", "max") and dtype.startswith("float"):
        pytest.skip("float mins and maxes take the ring")
    item = np.dtype(dtype).itemsize
    for nbytes in _sizes(shared.slot, item):
        x = make(rng, nbytes // item, dtype, op)
        y = comm.allreduce(x, op=op)
        assert same_on_all_ranks(world, y)
        if MIN <= nbytes <= shared.slot or dtype.startswith("int"):
            np.testing.assert_array_equal(y, rank_order(world, x, op), err_msg=str(nbytes))
        z = x.copy()
        assert comm.allreduce(z, out=z, op=op) is z
        np.testing.assert_array_equal(z, y)


@pytest.mark.parametrize("shape", [(20_000,), (100, 201), (3, 50, 70)])
def test_prepared_repeats_out_and_in_place(comm, world, rng, shared, shape):
    """The prepared repeat (NativePlan) of a medium call: new arrays, ``out`` and in place,
    n-dimensional, the first call's bits each time."""
    x = make(rng, int(np.prod(shape)), "float32", "sum").reshape(shape)
    first = comm.allreduce(x)
    np.testing.assert_array_equal(first, rank_order(world, x, "sum"))
    out = np.empty_like(x)
    for _ in range(5):
        np.testing.assert_array_equal(comm.allreduce(x), first)
        assert comm.allreduce(x, out=out) is out
        np.testing.assert_array_equal(out, first)
        z = x.copy()
        comm.allreduce(z, out=z)
        np.testing.assert_array_equal(z, first)
    assert type(comm._allreduce.plans.get(x, "sum").repeat).__name__ == "NativePlan"


def test_back_to_back_calls_never_see_each_others_data(comm, world, rng, shared):
    """Calls of two sizes in turn, with new values each time and one rank late now and then
    (a rank that writes its next slot early must not change what a slow rank still reads):
    every result is its own call's."""
    item = 4
    sizes = (MIN // item + 5, shared.slot // item)
    late = rng.random(300) < 0.1
    for i in range(300):
        n = sizes[i % 2]
        x = np.full(n, float(i * world.Get_size() + world.Get_rank()), np.float32)
        x[::97] += np.float32(0.5)
        if late[i]:
            time.sleep(0.001)
        y = comm.allreduce(x)
        expect = rank_order(world, x, "sum") if i % 50 == 0 else None
        ranks = world.Get_size()
        # Every element, every call: sums of small integers and halves are exact.
        exact = np.full(n, i * ranks * ranks + ranks * (ranks - 1) // 2, np.float32)
        exact[::97] += np.float32(0.5 * ranks)
        np.testing.assert_array_equal(y, exact, err_msg=f"call {i}")
        if expect is not None:
            np.testing.assert_array_equal(y, expect)


def test_the_segment_file_is_gone_once_made(comm, world, shared):
    """Rank 0 unlinks the file once every rank has mapped it: nothing of it outlives the
    job's processes."""
    pid = world.bcast(os.getpid(), root=0)
    assert glob.glob(f"/dev/shm/ringcomm-{pid}-*") == []



@pytest.mark.parametrize("who", ["rank 0 makes none", "the last rank cannot map it"])
def test_a_rank_without_the_segment_keeps_every_rank_on_mpi(monkeypatch, world, rng, who):
    """Where rank 0 cannot make the segment or another rank cannot map it, no rank uses it:
    MPI's allreduce everywhere, the same bits on every rank."""
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    rank, last = world.Get_rank(), world.Get_size() - 1
    if who.startswith("rank 0") and rank == 0:
        monkeypatch.setattr(mpi_shared, "_DIR", "/nonexistent-ringcomm-test")
    if who.startswith("the last") and rank == last:
        monkeypatch.setattr(mpi_shared, "_attach", lambda *a: (None, "refused by the test"))
    c = fresh_mpi_communicator(monkeypatch)
    try:
        x = make(rng, 50_000, "float64", "sum")
        y = c.allreduce(x)
        assert c.transport._shared is None
        check(world, x, y, "sum")  # within rounding of the exact sum, the same on every rank
    finally:
        c.close()


@pytest.mark.parametrize("free", ["room for 64 KiB slots", "too little"])
def test_the_segment_takes_a_quarter_of_what_is_free_at_most(monkeypatch, world, rng, free):
    """Rank 0 sizes the slots to a quarter of /dev/shm's free space; every rank takes its
    size (calls above it take MPI's allreduce), and where not even 64 KiB slots fit, no rank
    makes a segment."""
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    n = world.Get_size()
    room = mpi_shared._FREE_SHARE * (n + 1) * (64 << 10)
    if world.Get_rank() == 0:  # only rank 0 looks: the others must follow its answer
        monkeypatch.setattr(mpi_shared, "_free_bytes",
                            lambda: room + 4095 if free.startswith("room") else room - 4096)
    c = fresh_mpi_communicator(monkeypatch)
    try:
        for count in (12_000, 16_384, 16_385, 40_000):  # float32: 48, 64, 64 KiB + 4, 160 KiB
            x = make(rng, count, "float32", "sum")
            y = c.allreduce(x)
            if free.startswith("room") and count <= 16_384:
                np.testing.assert_array_equal(y, rank_order(world, x, "sum"))
            else:
                check(world, x, y, "sum")
        slot = c.transport._shared.slot if c.transport._shared else 0
        assert world.allgather(slot) == [64 << 10 if free.startswith("room") else 0] * n
    finally:
        c.close()


def test_free_bytes_are_those_of_dev_shm():
    vfs = os.statvfs("/dev/shm")
    assert abs(mpi_shared._free_bytes() - vfs.f_bavail * vfs.f_frsize) < 64 << 20


def test_switched_off_by_the_environment(monkeypatch, world, rng):
    c = fresh_mpi_communicator(monkeypatch, **{mpi_backend.SHARED_ENV: "0"})
    try:
        c.allreduce(make(rng, 50_000, "float32", "sum"))
        assert c.transport._shared is None
    finally:
        c.close()


def test_a_native_limit_of_zero_makes_no_segment(monkeypatch, world, rng):
    """RINGCOMM_MPI_ALLREDUCE_BYTES=0 asks for the ring always: no segment, for allreduces
    and reduce-scatters alike."""
    c = fresh_mpi_communicator(monkeypatch, **{mpi_backend.NATIVE_BYTES_ENV: "0"})
    try:
        x = make(rng, 50_000, "int64", "sum")
        np.testing.assert_array_equal(c.allreduce(x), gather_inputs(world, x).sum(axis=0))
        c.reduce_scatter(x)
        assert c.transport._shared is None and not c.transport._shared_pending
    finally:
        c.close()


def test_switch_that_differs_between_ranks_fails_everywhere(monkeypatch, world):
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    value = "0" if world.Get_rank() == 0 else "1"
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match=r"RINGCOMM_MPI_SHARED_ALLREDUCE differs between ranks") as err:
        fresh_mpi_communicator(monkeypatch, **{mpi_backend.SHARED_ENV: value})
    # Only the switch: the native limit's default follows from it, and nobody set the limit.
    assert mpi_backend.NATIVE_BYTES_ENV not in str(err.value)
    world.Barrier()


def test_a_rank_that_never_comes_times_out_in_the_barrier(world, rng):
    """Rank 0 enters a segment allreduce that no other rank enters (past the agreement: the
    transport's own call): it raises CollectiveTimeoutError within the timeout, naming the
    collective, instead of waiting for good."""
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    c = MPICommunicator(MPI.COMM_WORLD, abort_on_timeout=False, timeout=1.0,
                        inline_bytes=INLINE_BYTES)
    x = np.ones(MIN // 4, np.float32)
    c.allreduce(x)  # makes the segment on every rank
    assert c.transport._shared
    if world.Get_rank() == 0:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="allreduce"):
            c.transport.native_allreduce(x, np.empty_like(x), ringcomm.ReduceOp.SUM)
        assert time.monotonic() - started < 20
    world.Barrier()
    c.close()


def rank_order_chunk(world: MPI.Comm, x: np.ndarray, op: str) -> np.ndarray:
    """This rank's chunk, ``[r * L // n, (r + 1) * L // n)``, of ``rank_order``."""
    n, r = world.Get_size(), world.Get_rank()
    return rank_order(world, x, op)[r * x.size // n:(r + 1) * x.size // n]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_reduce_scatter_rank_order_bits(comm, world, rng, shared, dtype, op):
    """A reduce-scatter of a medium flat array through the segment: this rank's chunk of a
    rank-order reduction, exactly, into a new array or ``out``; below the segment's least
    size and past its slot the ring runs (then within rounding)."""
    if op == "avg" and dtype.startswith("int"):
        pytest.skip("avg is refused for integers")
    item = np.dtype(dtype).itemsize
    n, r = world.Get_size(), world.Get_rank()
    for nbytes in _sizes(shared.slot, item):
        x = make(rng, nbytes // item, dtype, op)
        if op in ("min", "max") and dtype.startswith("float"):
            x[::1001] = np.nan  # kept, as the ring keeps it
        y = comm.reduce_scatter(x, op=op)
        out = np.empty((r + 1) * x.size // n - r * x.size // n, x.dtype)
        assert comm.reduce_scatter(x, op=op, out=out) is out  # every call made before asserts
        expect = rank_order_chunk(world, x, op)
        assert y.shape == expect.shape and y.dtype == x.dtype
        np.testing.assert_array_equal(out, y)
        if MIN <= nbytes <= shared.slot or dtype.startswith("int") or op in ("min", "max"):
            np.testing.assert_array_equal(y, expect, err_msg=str(nbytes))
        else:  # the ring's order of additions: within rounding of the magnitudes summed
            scale = rank_order_chunk(world, np.abs(x), "sum" if op != "prod" else "prod")
            tol = 8 * n * np.finfo(x.dtype).eps
            assert np.all(np.abs(y - expect) <= tol * np.abs(scale)), nbytes


def test_reduce_scatters_and_allreduces_in_turn(comm, world, rng, shared):
    """Reduce-scatters and allreduces of the segment, back to back, the chunks shaped
    (4, -1): every call gets its own call's values, and the chunks of every rank make the
    allreduce."""
    n, r = world.Get_size(), world.Get_rank()
    for i in range(60):
        x = make(rng, MIN // 4 * (1 + i % 7) + i, "float32", "sum")
        full = comm.allreduce(x)
        part = comm.reduce_scatter(x.reshape(-1))
        np.testing.assert_array_equal(part, full[r * x.size // n:(r + 1) * x.size // n])
        np.testing.assert_array_equal(full, rank_order(world, x, "sum"))
