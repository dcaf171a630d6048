"""allgather, allgatherv, broadcast, sendrecv, barrier."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import gather_inputs, same_on_all_ranks


@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (3, 4), (1000, 3)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
def test_allgather(comm, world, rng, shape, dtype):
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    y = comm.allgather(x)
    assert y.shape == (shape[0] * comm.size, *shape[1:])
    np.testing.assert_array_equal(y, np.concatenate(world.allgather(x)))


def test_allgatherv_sizes_differ(comm, world, rng):
    rows = (comm.rank * 3 + 1) % 5  # 0 rows on some ranks
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    y = comm.allgatherv(x)
    parts = world.allgather(x)
    assert y.shape == (sum(p.shape[0] for p in parts), 4)
    np.testing.assert_array_equal(y, np.concatenate(parts))
    assert same_on_all_ranks(world, y)


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast(comm, world, rng, root):
    root = root % comm.size
    x = rng.standard_normal((17, 3))
    expected = world.bcast(x if comm.rank == root else None, root=root)
    assert comm.broadcast(x, root=root) is x
    np.testing.assert_array_equal(x, expected)
    strided = np.zeros((10, 10))[:, ::3]
    if comm.rank == root:
        strided[...] = 7
    comm.broadcast(strided, root=root)
    assert np.all(strided == 7)


def test_sendrecv_ring_shift(comm, world):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    send = np.full(1000, comm.rank, dtype=np.int32)
    recv = np.empty_like(send)
    assert comm.sendrecv(send, right, recv, left) is recv
    assert np.all(recv == left)


@pytest.mark.parametrize("elems", [4, 1 << 18, 1 << 21])
@pytest.mark.parametrize("overlap", ["same array", "shifted views"])
def test_sendrecv_in_place(comm, elems, overlap):
    """A shift whose send and receive share memory gets the left rank's values, at every size
    (before, from 1 MiB the receive overwrote what was still being sent: wrong values)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    base = np.arange(elems + 8, dtype=np.float32) + 1000 * comm.rank
    send, recv = (base, base) if overlap == "same array" else (base[:elems], base[8:])
    mine = send.copy()
    comm.sendrecv(send, right, recv, left)
    expected = mine - 1000 * comm.rank + 1000 * left
    np.testing.assert_array_equal(recv, expected)


def test_sendrecv_does_not_cross_collectives(comm, world, rng):
    """A user's point-to-point messages never match a collective's (separate channels)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = rng.standard_normal(100_000)
    y = comm.allreduce(x)
    recv = np.empty(3)
    comm.sendrecv(np.full(3, float(comm.rank)), right, recv, left)
    assert np.all(recv == left)
    np.testing.assert_allclose(y, gather_inputs(world, x).sum(axis=0), rtol=1e-12, atol=1e-12)


def test_barrier(comm):
    comm.barrier()


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "uint16", "complex128", "bfloat16"])
def test_byte_moving_collectives_take_any_dtype(comm, world, rng, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    x = (rng.standard_normal((comm.rank + 2, 3)) * 50).astype(dtype)
    np.testing.assert_array_equal(comm.allgatherv(x), np.concatenate(world.allgather(x)))
    y = x[:2].copy()
    expected = world.bcast(y if comm.rank == 0 else None, root=0)
    np.testing.assert_array_equal(comm.broadcast(y, root=0), expected)
    if x.dtype.name == "bfloat16":  # reduced too, in float32, rounded once
        for n in (6, 5000):
            z = rng.standard_normal(n).astype(dtype)
            exact = np.sum(world.allgather(z.astype(np.float64)), axis=0)
            np.testing.assert_allclose(comm.allreduce(z).astype(np.float64), exact,
                                       rtol=2 ** -7, atol=1e-6)
        return
    with pytest.raises(TypeError, match="unsupported dtype"):
        comm.allreduce(x)  # reductions still need a dtype ringcomm can add


def test_object_arrays_refused(comm):
    with pytest.raises(TypeError, match="cannot send arrays of dtype object"):
        comm.broadcast(np.array([{"a": 1}, None], dtype=object))


def test_small_dtypes_that_differ_are_caught(comm):
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")
    with pytest.raises(TypeError, match="dtype differs between ranks: int8 on rank 0"):
        comm.allgather(np.ones(3, np.int8 if comm.rank == 0 else np.uint8))


def test_small_bfloat16_allreduce_without_the_check(world, rng):
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    import ringcomm

    c = ringcomm.init("mpi", consistency_check=False, abort_on_exception=False)
    try:
        z = rng.standard_normal(6).astype(bf16)
        exact = np.sum(world.allgather(z.astype(np.float64)), axis=0)
        np.testing.assert_allclose(c.allreduce(z).astype(np.float64), exact, rtol=2 ** -7)
    finally:
        c.close()


def test_prepared_allgather_repeats_on_its_buffers(world):
    """The transport's prepared allgather (what the fixed-size exchange of other transports
    runs) gathers what the buffers hold at each call, between other collectives on the same
    communicator."""
    import ringcomm

    c = ringcomm.init("mpi", abort_on_exception=False)
    try:
        t = c.transport
        send = np.zeros(24, np.uint8)
        recv = np.empty((c.size, 24), np.uint8)
        gather = t.prepare_allgather(send, recv)
        for step in range(5):
            send[:] = 10 * step + c.rank
            gather()
            expected = np.repeat((10 * step + np.arange(c.size)).astype(np.uint8)[:, None], 24, 1)
            np.testing.assert_array_equal(recv, expected)
            # Other collectives between the prepared one's calls keep their own matching.
            np.testing.assert_array_equal(c.allreduce(np.full(3, step + 1.0)),
                                          np.full(3, (step + 1.0) * c.size))
        assert world.allgather(type(gather).__name__) == [type(gather).__name__] * c.size
    finally:
        c.close()


@pytest.mark.parametrize("dtype", ["float32", "complex128", "S3", ">i4", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_small_allgathers_ride_in_the_exchange(comm, world, rng, dtype, layout):
    """An allgather of at most inline_bytes travels with its header (one exchange): the same
    result as every rank's array concatenated, for any dtype (odd item sizes and byte orders
    included) and layout, and one call on the stats."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    base = (rng.standard_normal((6, 4)) * 50)
    x = base.astype(dtype) if np.dtype(dtype).kind != "S" else base.astype(int).astype(dtype)
    if layout == "strided":
        x = x[::2, 1:3]
    assert x.nbytes <= comm.inline_bytes
    calls = comm.stats.calls
    y = comm.allgather(x)
    assert comm.stats.calls == calls + 1
    assert y.dtype == x.dtype and y.flags.c_contiguous
    np.testing.assert_array_equal(y, np.concatenate(world.allgather(np.ascontiguousarray(x))))
    assert same_on_all_ranks(world, y)


def test_small_allgather_results_are_their_own(comm, world):
    """Each call's result is an array of its own: the next calls (which reuse the exchange's
    buffers) leave it alone, at every size (at one rank, a result was once a view of the
    exchange's buffer, and the next call overwrote it)."""
    first = comm.allgather(np.full(4, comm.rank, np.float32))
    kept = first.copy()
    second = comm.allgather(np.full(4, comm.rank + 100, np.float32))
    comm.allreduce(np.ones(3, np.float32))
    np.testing.assert_array_equal(first, kept)
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(second, np.repeat(np.arange(comm.size) + 100.0, 4))


@pytest.mark.parametrize("case", ["one rank above the inline size", "one rank in error",
                                  "one rank's dtype"])
def test_small_allgathers_that_differ_raise_everywhere(comm, world, case):
    """One rank's allgather does not ride in the exchange (its array is larger, or invalid) or
    differs in dtype: every rank raises the same error, and the next calls are in step."""
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")
    last = comm.rank == comm.size - 1
    x = np.arange(8, dtype=np.float32)
    if case == "one rank above the inline size" and last:
        x = np.arange(comm.inline_bytes // 4 + 8, dtype=np.float32)
    elif case == "one rank in error" and last:
        x = np.float32(1.0)  # a scalar: refused
    elif case == "one rank's dtype" and last:
        x = x.astype(np.int32)
    with pytest.raises(ValueError) as caught:
        comm.allgather(x)
    messages = world.allgather((type(caught.value).__name__, str(caught.value)))
    assert all(m == messages[0] for m in messages), messages
    assert f"rank {comm.size - 1}" in messages[0][1], messages
    np.testing.assert_array_equal(comm.allgather(np.full(2, comm.rank, np.int64)),
                                  np.repeat(np.arange(comm.size), 2))
    big = np.full(comm.inline_bytes // 8 + 5, comm.rank, np.int64)
    np.testing.assert_array_equal(comm.allgather(big), np.repeat(np.arange(comm.size), big.size))
