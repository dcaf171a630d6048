"""Dense host allreduces on the MPI backend: MPI's own allreduce up to a size limit, the ring
above it; every rank takes the same path and gets the same bits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from mpi4py import MPI
from test_allreduce import check, make, same_in_every_form

import ringcomm
from ringcomm.backends import mpi as mpi_backend
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.comm.agree import INLINE_BYTES

LIMIT = 64 << 10  # small, so both sides of it stay quick to test


@pytest.fixture(scope="module")
def comm():
    """ringcomm's MPI communicator with the classic inline size (4 KiB, the default across
    nodes): these tests are about the calls above it, which the default inlines where every
    rank shares one node."""
    c = ringcomm.init("mpi", abort_on_exception=False, inline_bytes=INLINE_BYTES)
    yield c
    c.close()


@pytest.fixture
def paths(comm) -> Iterator[list[bool]]:
    """Whether each ring allreduce of ``comm`` ran natively (True) or as the ring (False),
    the prepared repeats (NativePlan) included; plans made before are forgotten, as they
    carry the limit they were made under."""
    t = comm.transport
    seen: list[bool] = []
    native, prepare = t.native_allreduce, t.prepare_native_allreduce
    saved = t.native_allreduce_bytes

    def spy(x, out, op):
        seen.append(native(x, out, op))
        return seen[-1]

    def spy_prepare(dtype, nbytes, op):
        prepared = prepare(dtype, nbytes, op)
        if prepared is None:
            return None

        def run(x, out):
            prepared(x, out)
            seen.append(True)
        return run

    t.native_allreduce, t.prepare_native_allreduce = spy, spy_prepare
    t.native_allreduce_bytes = LIMIT
    comm._allreduce.plans.clear()
    try:
        yield seen
    finally:
        t.native_allreduce, t.prepare_native_allreduce = native, prepare
        t.native_allreduce_bytes = saved
        comm._allreduce.plans.clear()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_both_sides_of_the_limit(comm, world, rng, paths, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers")
    item = np.dtype(dtype).itemsize
    for nbytes in (8 << 10, LIMIT, LIMIT + item, 3 * LIMIT + 7 * item):
        x = make(rng, nbytes // item, dtype, op)
        paths.clear()
        y = comm.allreduce(x, op=op)
        check(world, x, y, op)
        native = (nbytes <= LIMIT and dtype != "float16"
                  and not (op in ("min", "max") and dtype.startswith("float")))
        assert paths == ([] if comm.size == 1 else [native]), (nbytes, paths)  # 1: a copy
        # In place: the same values, through MPI_IN_PLACE on the native side.
        z = x.copy()
        assert comm.allreduce(z, out=z, op=op) is z
        np.testing.assert_array_equal(z, y)


def test_native_results_are_identical_on_every_rank(comm, world, rng, paths):
    """Sums whose value depends on the order of additions (values of many magnitudes): every
    rank must still hold the same bits, over many sizes and repeats."""
    for n in (2049, 5000, 16_383):
        for _ in range(20):
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
            check(world, x, comm.allreduce(x), "sum")  # identical bits on every rank too
    assert all(paths)


@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
@pytest.mark.parametrize("shape", [(5000,), (50, 100)])
def test_repeats_take_the_prepared_native_path(comm, world, rng, paths, op, shape):
    """A medium call seen before runs MPI's allreduce straight from the prepared plan: the
    same bits as its first run, on every rank, into a new array, ``out`` or in place."""
    x = make(rng, int(np.prod(shape)), "float32", op).reshape(shape)
    first = comm.allreduce(x, op=op)
    check(world, x.reshape(-1), first.reshape(-1), op)
    out = np.empty_like(x)
    for _ in range(3):
        again = comm.allreduce(x, op=op)
        assert again is not first and again.shape == shape
        np.testing.assert_array_equal(again, first)
        same_in_every_form(comm, x, op, first, out)
    prepared = comm._allreduce.plans.get(x, op)
    if comm.size > 1:
        assert type(prepared.repeat).__name__ == "NativePlan"
        assert paths == [True] * 10
    # Arrays MPI cannot take as they are go the full way, with the same result.
    strided = np.repeat(x.reshape(-1), 2)[::2].reshape(shape)
    np.testing.assert_array_equal(comm.allreduce(strided, op=op), first)
    wide = np.empty((*shape[:-1], shape[-1] * 2), np.float32)[..., ::2]
    np.testing.assert_array_equal(comm.allreduce(x, out=wide, op=op), first)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("holder", ["first", "last"])
def test_min_max_keep_a_nan_at_every_size(comm, world, paths, dtype, op, holder):
    """A NaN on one rank makes that element of a min or max NaN on every rank, whatever the
    size's path (inlined, persistent or MPI_Iallreduce below the limit, the ring above) and
    whichever rank holds it: MPI's own MIN/MAX compute ``a > b ? a : b`` and kept a NaN of the
    last rank's but dropped one of rank 0's (float min/max take the ring instead)."""
    item = np.dtype(dtype).itemsize
    nan_rank = 0 if holder == "first" else comm.size - 1
    for n in (4, 2048 // item, 16 << 10 // item, LIMIT // item, 3 * LIMIT // item):
        x = np.full(n, 1.0 + comm.rank, dtype)
        x[n // 2] = -3.0
        if comm.rank == nan_rank:
            x[0] = x[-1] = np.nan
        for repeat in range(2):  # the first call, then its prepared repeat
            y = comm.allreduce(x, op=op)
            assert np.isnan(y[0]) and np.isnan(y[-1]), (n, repeat, y[:3])
            assert y[n // 2] == -3.0 and not np.isnan(y[1:-1]).any(), (n, repeat)
            assert y[1] == (1.0 if op == "min" else float(comm.size)), (n, repeat)
            check(world, x, y, op)  # NumPy's result, the same bits on every rank
    assert not any(paths), paths  # none took MPI's own MIN/MAX


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs a rank that does not ask")
@pytest.mark.parametrize("n", [16, 5000, 300_000])
def test_start_allreduce_exchanges_nothing(comm, world, rng, n):
    """MPI starts no allreduce on threads of its own: ``start_allreduce`` returns None having
    exchanged nothing, so rank 0 asking first and then running the allreduce makes the same
    collective as the other ranks' allreduce alone (it agreed on the call and returned,
    and both waited until the timeout)."""
    x = make(rng, n, "float32", "sum")
    if comm.rank == 0:
        assert comm.start_allreduce(x) is None
    check(world, x, comm.allreduce(x), "sum")


def test_prepared_native_repeat_still_checked(comm, rng, paths):
    """A rank that changes a prepared medium call's arguments is caught on every rank."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = rng.standard_normal(5000).astype(np.float32)
    for _ in range(3):
        comm.allreduce(x)
    op = "max" if comm.rank == 1 else "sum"
    with pytest.raises(ValueError, match="op differs between ranks"):
        comm.allreduce(x, op=op)
    y = rng.standard_normal(5001).astype(np.float32) if comm.rank == 1 else x
    with pytest.raises(ValueError, match="shape differs between ranks"):
        comm.allreduce(y)
    y = x.astype(np.float64) if comm.rank == 0 else x
    with pytest.raises(TypeError, match="dtype differs between ranks"):
        comm.allreduce(y)
    np.testing.assert_array_equal(comm.allreduce(x), comm.allreduce(x.copy()))


def test_limit_zero_always_takes_the_ring(comm, world, rng, paths):
    comm.transport.native_allreduce_bytes = 0
    x = rng.standard_normal(4096).astype(np.float32)
    check(world, x, comm.allreduce(x), "sum")
    assert paths == ([] if comm.size == 1 else [False])


def _communicator(monkeypatch, value: str | None) -> MPICommunicator:
    if value is None:
        monkeypatch.delenv(mpi_backend.NATIVE_BYTES_ENV, raising=False)
    else:
        monkeypatch.setenv(mpi_backend.NATIVE_BYTES_ENV, value)
    return MPICommunicator(MPI.COMM_WORLD, abort_on_timeout=False, timeout=60)


def test_limit_from_the_environment(monkeypatch, world):
    c = _communicator(monkeypatch, "1M")
    try:
        assert c.transport.native_allreduce_bytes == 1 << 20
    finally:
        c.close()
    c = _communicator(monkeypatch, None)
    try:
        # 1 MiB a peer where a shared segment runs it (every rank on one node), else 512 KiB.
        per_peer = (1 << 20) if c.transport._shared_pending else (512 << 10)
        assert c.transport.native_allreduce_bytes == (c.size - 1) * per_peer
    finally:
        c.close()


def test_limit_that_differs_between_ranks_fails_everywhere(monkeypatch, world):
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    value = "64K" if world.Get_rank() == 0 else "128K"
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match=r"RINGCOMM_MPI_ALLREDUCE_BYTES differs between ranks"):
        _communicator(monkeypatch, value)
    world.Barrier()


def test_limit_set_on_some_ranks_only_fails_everywhere(monkeypatch, world):
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    value = "64K" if world.Get_rank() == 0 else None
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match=r"RINGCOMM_MPI_ALLREDUCE_BYTES differs between ranks: 65536 on "
                       r"rank 0; unset on ranks? 1"):
        _communicator(monkeypatch, value)
    world.Barrier()


def test_invalid_limit_fails_everywhere(monkeypatch, world):
    value = "lots" if world.Get_rank() == world.Get_size() - 1 else "64K"
    with pytest.raises(ValueError, match=r"RINGCOMM_MPI_ALLREDUCE_BYTES must be a byte count"):
        _communicator(monkeypatch, value)
    world.Barrier()
