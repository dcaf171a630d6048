"""Reduce-scatters that finish within the agreement exchange (up to ``inline_bytes``) or run
MPI's own reduce-scatter (above it, up to the native limit, where the shared segment does not
take them): this rank's chunk of a rank-order reduction, calls that differ between ranks
refused on every rank, and every rank on one path."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import fresh_mpi_communicator, gather_inputs
from test_allreduce import check, make

import ringcomm
from ringcomm.algorithms import ring
from ringcomm.backends import mpi as mpi_backend
from ringcomm.comm.agree import INLINE_BYTES
from ringcomm.core.types import ReduceOp

_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
           "max": np.maximum}


def chunk_of(world: MPI.Comm, x: np.ndarray, op: str) -> np.ndarray:
    """This rank's chunk of every rank's ``x`` reduced in rank order (16-bit floats in
    float32, rounded once; divided by the size for avg): the bits of the inline path."""
    rows = gather_inputs(world, x).reshape(world.Get_size(), -1)
    n, r, length = world.Get_size(), world.Get_rank(), rows.shape[1]
    rows = rows[:, r * length // n:(r + 1) * length // n]
    wide = np.float32 if x.dtype.itemsize == 2 else None
    acc = _UFUNCS[op].reduce(rows, axis=0, dtype=wide)
    if op == "avg":
        acc = acc / n if wide else np.divide(acc, n, out=acc)
    return acc.astype(x.dtype)


def _not_the_ring(*args, **kwargs):
    raise AssertionError("a reduce-scatter of at most inline_bytes ran the ring")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_inline_chunks_are_a_rank_order_reduction(monkeypatch, comm, world, rng, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers")
    monkeypatch.setattr(ring, "reduce_scatter", _not_the_ring)
    item = np.dtype(dtype).itemsize
    n = comm.size
    for length in sorted({0, 1, n - 1, n + 1, 1001, comm.inline_bytes // item}):
        x = make(rng, length, dtype, op)
        before = x.copy()
        mine = comm.reduce_scatter(x, op=op)
        np.testing.assert_array_equal(x, before)
        np.testing.assert_array_equal(mine, chunk_of(world, x, op))
        out = np.full(mine.size, 7, dtype)
        assert comm.reduce_scatter(x, op=op, out=out) is out
        np.testing.assert_array_equal(out, mine)


def test_inline_takes_n_d_and_strided_arrays(monkeypatch, comm, world, rng):
    monkeypatch.setattr(ring, "reduce_scatter", _not_the_ring)
    x = make(rng, 6 * 35, "float32", "sum").reshape(6, 35)
    np.testing.assert_array_equal(comm.reduce_scatter(x), chunk_of(world, x, "sum"))
    strided = make(rng, 2 * 500, "float64", "sum")[::2]
    np.testing.assert_array_equal(comm.reduce_scatter(strided),
                                  chunk_of(world, strided, "sum"))


def test_inline_bfloat16_rounds_once(comm, world, rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = make(rng, 999, "float32", "sum").astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(comm.reduce_scatter(x).view(np.uint16),
                                  chunk_of(world, x, "sum").view(np.uint16))


def test_inline_out_inside_its_input(comm, world, rng):
    """``out`` may be a view of ``x`` (FSDP reduces into its own shard): the exchange has
    ``x``'s bytes before anything is written."""
    x = make(rng, 100 * comm.size, "float32", "sum")
    ref = chunk_of(world, x, "sum")
    r = comm.rank
    out = x[r * 100:(r + 1) * 100]
    assert comm.reduce_scatter(x, out=out) is out
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("other", ["allgather", "a longer reduce_scatter", "max"])
def test_a_call_that_differs_on_one_rank_fails_on_every_rank(comm, world, rng, other):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = make(rng, 64, "float32", "sum")
    odd = comm.rank == comm.size - 1
    with pytest.raises(ringcomm.ArgumentMismatchError):
        if odd and other == "allgather":
            comm.allgather(x)
        elif odd and other == "max":
            comm.reduce_scatter(x, op="max")
        elif odd:
            comm.reduce_scatter(make(rng, 64 + comm.inline_bytes, "float32", "sum"))
        else:
            comm.reduce_scatter(x)
    # Every rank goes on together.
    x = make(rng, 10, "int64", "sum")
    np.testing.assert_array_equal(comm.reduce_scatter(x), chunk_of(world, x, "sum"))



@pytest.mark.parametrize("segment", ["on", "off"])
def test_mpi_reduce_scatter_above_the_inline_size(monkeypatch, world, rng, segment):
    """Above the inline size MPI's reduce-scatter runs what the segment does not take (all
    of it with the segment off; below the segment's least size with it on), up to the native
    limit; the ring above. Integers exact, floats within rounding, chunks of the ring's
    bounds."""
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    c = fresh_mpi_communicator(monkeypatch,
                               **{mpi_backend.SHARED_ENV: "1" if segment == "on" else "0"})
    t = c.transport
    n, r = c.size, c.rank
    try:
        limit = t.native_allreduce_bytes
        for nbytes in (INLINE_BYTES + 8, 12 << 10, mpi_backend._SHARED_MIN_BYTES + 8,
                       limit - 8, limit + 8):
            for dtype, op in (("int64", "sum"), ("float32", "avg"), ("float64", "min"),
                              ("int32", "prod")):
                length = nbytes // np.dtype(dtype).itemsize
                x = make(rng, length, dtype, op)
                mine = c.reduce_scatter(x, op=op)
                whole = np.empty(length, dtype)
                lo, hi = r * length // n, (r + 1) * length // n
                whole[lo:hi] = mine
                ref = gather_inputs(world, whole)  # every rank's chunk, in place
                full = np.concatenate([ref[q][q * length // n:(q + 1) * length // n]
                                       for q in range(n)])
                check(world, x, full, op)
                key = (np.dtype(dtype), x.nbytes, ReduceOp(op))
                native = key in t._reduce_scatters
                assert native == (x.nbytes <= limit and not (dtype == "float64"
                                                            and op == "min"
                                                            and not _segment_takes(t, x))), \
                    (nbytes, dtype, op)
        assert (t._shared is not None) == (segment == "on")
    finally:
        c.close()


def _segment_takes(t, x: np.ndarray) -> bool:
    """Whether the shared segment takes ``x``'s reduce-scatter (MPI's own min and max of
    floats are not taken: they may drop a NaN)."""
    return (t._shared is not None and mpi_backend._SHARED_MIN_BYTES <= x.nbytes
            <= t._shared.slot)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_ring_into_out_has_the_bits_of_a_new_result(monkeypatch, world, rng, dtype, op):
    """The ring's reduce-scatter writes the chunk straight into a given ``out`` (16-bit
    floats rounded from float32 there), in many pipelined segments: the same bits as into a
    new array, with ``out`` apart from ``x`` or inside it, and its scratch reused by calls of
    other sizes."""
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers")
    # The ring always.
    c = fresh_mpi_communicator(monkeypatch, **{mpi_backend.NATIVE_BYTES_ENV: "0"})
    n, r = c.size, c.rank
    try:
        c.segment_bytes = 4096
        for length in (100_003, 3 * n * 1000, 40_001):
            x = make(rng, length, dtype, op)
            before = x.copy()
            new = c.reduce_scatter(x, op=op)
            np.testing.assert_array_equal(x, before)
            out = np.empty_like(new)
            assert c.reduce_scatter(x, op=op, out=out) is out
            np.testing.assert_array_equal(out, new)
            lo, hi = r * length // n, (r + 1) * length // n
            inside = x.copy()
            c.reduce_scatter(inside, op=op, out=inside[lo:hi])  # its own chunk, in place
            np.testing.assert_array_equal(inside[lo:hi], new)
            if n > 1:  # another rank's chunk of x, read by the ring before it is written
                other = x.copy()
                q = (r + 1) % n
                start = q * length // n
                c.reduce_scatter(other, op=op, out=other[start:start + hi - lo])
                np.testing.assert_array_equal(other[start:start + hi - lo], new)
    finally:
        c.close()


def test_repeats_run_prepared_each_with_its_own_data(comm, world, rng):
    """From its second call a small reduce-scatter runs prepared (``ScatterPlan``): every
    repeat's chunk is its own data's, into a new array, a given ``out`` or ``x`` itself."""
    if comm.size == 1:
        pytest.skip("one rank copies")
    x = make(rng, 999, "float32", "sum")
    comm.reduce_scatter(x)
    assert comm._plans.scatter(x, "sum") is not None
    n, r = comm.size, comm.rank
    lo, hi = r * 999 // n, (r + 1) * 999 // n
    out = np.empty(hi - lo, np.float32)
    for i in range(60):
        x = make(rng, 999, "float32", "sum")
        want = chunk_of(world, x, "sum")
        if i % 3 == 0:
            got = comm.reduce_scatter(x)
        elif i % 3 == 1:
            got = comm.reduce_scatter(x, out=out)
            assert got is out
        else:
            got = comm.reduce_scatter(x, out=x[lo:hi])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("other", ["max", "a longer reduce_scatter", "allgather",
                                   "a strided out"])
def test_a_repeat_that_differs_on_one_rank_fails_on_every_rank(comm, world, rng, other):
    """Ranks repeating a prepared reduce-scatter meet a rank whose call differs (it takes
    the full path, or another call): the same error everywhere, then every rank goes on."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = make(rng, 300, "float64", "sum")
    for _ in range(3):
        comm.reduce_scatter(x)
    odd = comm.rank == comm.size - 1
    expected = ValueError if other == "a strided out" else ringcomm.ArgumentMismatchError
    with pytest.raises(expected):
        if odd and other == "max":
            comm.reduce_scatter(x, op="max")
        elif odd and other == "allgather":
            comm.allgather(x)
        elif odd and other == "a strided out":
            length = (comm.rank + 1) * 300 // comm.size - comm.rank * 300 // comm.size
            comm.reduce_scatter(x, out=np.empty(2 * length)[::2])
        elif odd:
            comm.reduce_scatter(make(rng, 301, "float64", "sum"))
        else:
            comm.reduce_scatter(x)
    np.testing.assert_array_equal(comm.reduce_scatter(x), chunk_of(world, x, "sum"))


def test_a_prepared_repeat_after_close_raises(monkeypatch, world, rng):
    c = fresh_mpi_communicator(monkeypatch)
    x = make(rng, 100, "int64", "sum")
    c.reduce_scatter(x)
    c.reduce_scatter(x)
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.reduce_scatter(x)
