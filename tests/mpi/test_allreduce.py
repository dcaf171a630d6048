"""Dense allreduce and reduce-scatter over the ring, against float64 references."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import reference, same_on_all_ranks, tolerance

import ringcomm
from ringcomm.comm.agree import INLINE_BYTES

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]


def lengths(size: int, inline_bytes: int = INLINE_BYTES) -> list[int]:
    """Edge lengths: empty, one element, fewer than ranks, not divisible, the edges of the
    classic inline size and of the communicator's, large."""
    return sorted({0, 1, 2, max(size - 1, 1), size + 1, 1000, INLINE_BYTES // 4,
                   INLINE_BYTES // 4 + 1, inline_bytes // 4, inline_bytes // 4 + 1, 300_001})


def make(rng: np.random.Generator, n: int, dtype: str, op: str) -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        return rng.integers(-3 if op == "prod" else -1000, 4 if op == "prod" else 1000, n).astype(
            dtype)
    scale = 1.0 if op != "prod" else 0.5
    return (rng.uniform(0.5, 1.5, n) * scale * rng.choice([-1, 1], n)).astype(dtype)


def same_in_every_form(comm, x: np.ndarray, op: str, first: np.ndarray,
                       *outs: np.ndarray) -> None:
    """``allreduce`` of ``x`` into each of ``outs`` and in place gives ``first``'s bits."""
    for out in outs:
        assert comm.allreduce(x, out=out, op=op) is out
        np.testing.assert_array_equal(out, first)
    z = x.copy()
    assert comm.allreduce(z, out=z, op=op) is z
    np.testing.assert_array_equal(z, first)


def check(world, x: np.ndarray, y: np.ndarray, op: str) -> None:
    ref = reference(world, x, op)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.dtype.kind == "i":
        np.testing.assert_array_equal(y, ref.astype(x.dtype))
    else:
        tol = tolerance(x.dtype, world.Get_size(), op)
        scale = np.abs(reference(world, np.abs(x.astype(np.float64)), "sum"))
        if op == "prod":
            scale = np.abs(ref)
        if op == "avg":
            scale = scale / world.Get_size()
        np.testing.assert_array_less(np.abs(y.astype(np.float64) - ref), tol * scale + 1e-30)
    assert same_on_all_ranks(world, y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_matches_reference(comm, world, rng, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers (tested in test_errors)")
    for n in lengths(comm.size, comm.inline_bytes):
        x = make(rng, n, dtype, op)
        before = x.copy()
        y = comm.allreduce(x, op=op)
        np.testing.assert_array_equal(x, before)  # input untouched
        check(world, x, y, op)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "prod"])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5)])
def test_inline_repeats_give_their_first_result(comm, world, rng, dtype, op, shape):
    """A small call seen before runs from its prepared plan (its byte counts kept while the
    exchange travels, the rows reduced into a new array or ``out``): the bits of its first
    run, on every rank, into a new array, into ``out`` (contiguous or strided) and in place;
    the call's bytes still counted."""
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers (tested in test_errors)")
    x = make(rng, int(np.prod(shape)), dtype, op).reshape(shape)
    first = comm.allreduce(x, op=op)
    check(world, x.reshape(-1), first.reshape(-1), op)
    out = np.empty_like(x)
    strided = np.empty((*shape, 2), x.dtype)[..., 0]
    for _ in range(3):
        comm.stats.reset()
        again = comm.allreduce(x, op=op)
        assert again is not first and again.shape == shape and again.dtype == x.dtype
        np.testing.assert_array_equal(again, first)
        assert comm.stats.calls == 1
        assert comm.stats.bytes_sent == comm.stats.bytes_received == (
            (96 + x.nbytes) * (comm.size - 1))
        same_in_every_form(comm, x, op, first, out, strided)
    prepared = comm._allreduce.plans.get(x, op)
    assert type(prepared.repeat).__name__ == "InlinePlan"
    assert same_on_all_ranks(world, first)


@pytest.mark.parametrize("segment_bytes", [64, 4096, 1 << 20])
def test_segmentation_and_pipelining(comm, world, rng, segment_bytes):
    """Many segments per chunk (deep pipelining), few, and one, all give the same sums."""
    saved = comm.segment_bytes
    comm.segment_bytes = segment_bytes
    try:
        for n in (INLINE_BYTES, 10_007, 123_457):
            x = rng.standard_normal(n).astype(np.float32)
            check(world, x, comm.allreduce(x), "sum")
            h = rng.standard_normal(n).astype(np.float16)
            check(world, h, comm.allreduce(h, op="avg"), "avg")
    finally:
        comm.segment_bytes = saved


def test_in_place_and_out(comm, world, rng):
    x = rng.standard_normal(50_000).astype(np.float32)
    ref = comm.allreduce(x)
    out = np.empty_like(x)
    assert comm.allreduce(x, out=out) is out
    np.testing.assert_array_equal(out, ref)
    y = x.copy()
    assert comm.allreduce(y, out=y) is y
    np.testing.assert_array_equal(y, ref)


def test_shape_preserved_and_noncontiguous(comm, world, rng):
    base = rng.standard_normal((64, 70)).astype(np.float64)
    x = base[:, ::2]  # strided view
    assert not x.flags.c_contiguous
    y = comm.allreduce(x)
    assert y.shape == (64, 35)
    check(world, np.ascontiguousarray(x), y, "sum")
    out = np.zeros((35, 64)).T  # a non-contiguous output
    comm.allreduce(x, out=out)
    np.testing.assert_array_equal(out, y)
    small = rng.standard_normal((3, 4, 5)).astype(np.float32)
    assert comm.allreduce(small).shape == (3, 4, 5)
    scalar = np.array(2.5)
    assert comm.allreduce(scalar) == pytest.approx(2.5 * comm.size)


def test_float16_accumulates_in_float32(comm, world):
    """Many small float16 values: per-hop float16 rounding would lose them, float32 does not."""
    x = np.full(10_000, 1e-3, dtype=np.float16)
    y = comm.allreduce(x)
    exact = np.float64(np.float16(1e-3)) * comm.size
    assert np.all(np.abs(y.astype(np.float64) - exact) <= np.finfo(np.float16).eps * exact)


def test_reduce_scatter(comm, world, rng):
    for n in lengths(comm.size, comm.inline_bytes):
        x = rng.standard_normal(n)
        mine = comm.reduce_scatter(x)
        ref = reference(world, x, "sum")
        lo, hi = comm.rank * n // comm.size, (comm.rank + 1) * n // comm.size
        assert mine.shape == (hi - lo,)
        np.testing.assert_allclose(mine, ref[lo:hi], rtol=1e-12, atol=1e-12)
    x = rng.integers(0, 100, (6, 7)).astype(np.int64)
    mine = comm.reduce_scatter(x, op="max")
    ref = reference(world, x, "max").reshape(-1)
    lo, hi = comm.rank * 42 // comm.size, (comm.rank + 1) * 42 // comm.size
    np.testing.assert_array_equal(mine, ref[lo:hi])


def test_default_inline_size_where_every_rank_shares_a_node(world, rng):
    """Where every rank is on this node (as here) the MPI backend inlines up to 64 KiB among
    4 ranks (192 KiB shared among the others, at least the classic 4 KiB); a topology of
    several nodes keeps the classic size; an explicit size wins. Arrays at the edges of the
    larger slot match the reference on every rank, and a call just inside it moves its
    array in the exchange alone (n - 1 copies of it, no second collective)."""
    from ringcomm.backends.mpi import shared_inline_bytes

    assert [shared_inline_bytes(n) for n in (1, 2, 3, 4, 5, 8, 16, 64)] == [
        4096, 65536, 65536, 65536, 49152, 28032, 13056, 4096]
    size = world.Get_size()
    c = ringcomm.init("mpi", abort_on_exception=False)
    try:
        assert c.inline_bytes == shared_inline_bytes(size)
        for n in (c.inline_bytes // 4, c.inline_bytes // 4 + 1, 3000, 5000):
            x = make(rng, n, "float32", "sum")
            check(world, x, c.allreduce(x), "sum")
            c.stats.reset()
            check(world, x, c.allreduce(x), "sum")  # the prepared repeat
            if n * 4 <= c.inline_bytes:
                assert c.stats.bytes_sent == (96 + x.nbytes) * (size - 1)
    finally:
        c.close()
    for options, expected in (({"topology": 1}, INLINE_BYTES if size > 1 else 4096),
                              ({"topology": size}, shared_inline_bytes(size)),
                              ({"inline_bytes": 1024}, 1024)):
        c = ringcomm.init("mpi", abort_on_exception=False, **options)
        try:
            assert c.inline_bytes == expected, options
        finally:
            c.close()


@pytest.mark.parametrize("inline_bytes", [0, 64])
def test_inline_slot_size(world, rng, inline_bytes):
    """The agreement's inline slot is a per-communicator choice; results do not depend on it."""
    c = ringcomm.init("mpi", inline_bytes=inline_bytes, abort_on_exception=False)
    try:
        for n in (0, 1, 8, 9, 1000):
            x = rng.standard_normal(n)
            check(world, x, c.allreduce(x), "sum")
        c.stats.reset()
        c.allreduce(np.ones(1000, np.float32), compression=ringcomm.Int8())
        if c.size > 1:  # the header slot costs 80 + inline_bytes per peer, not 80 + 4096
            assert c.stats.bytes_sent < 2 * (c.size - 1) * 1000 + (c.size - 1) * (80 + 64) + 512
    finally:
        c.close()


def test_stats_count_wire_bytes(comm, world, rng):
    n = comm.size
    x = rng.standard_normal(1 << 16).astype(np.float32)
    comm.stats.reset()
    comm.allreduce(x)
    assert comm.stats.calls == 1
    if n == 1:
        assert comm.stats.bytes_sent == comm.stats.bytes_received == 0
        return
    # The ring moves 2(n-1)/n of the array; the agreement header exchange adds a fixed amount.
    ring_bytes = 2 * (n - 1) * (x.nbytes // n)
    assert ring_bytes <= comm.stats.bytes_sent <= ring_bytes + 2 * (n - 1) * 8192
    total_sent = world.allreduce(comm.stats.bytes_sent)
    total_received = world.allreduce(comm.stats.bytes_received)
    assert total_sent == total_received
    comm.stats.reset()
    assert (comm.stats.bytes_sent, comm.stats.bytes_received, comm.stats.calls) == (0, 0, 0)
