"""The MPI transport's per-call exchange (each rank sends its own length, point to point) and
its persistent allreduces of repeated medium calls, under mpiexec."""

from __future__ import annotations

import numpy as np
import pytest
from test_allreduce import check

import ringcomm
from ringcomm.backends import mpi as mpi_backend
from ringcomm.comm.agree import INLINE_BYTES
from ringcomm.core.types import ArgumentMismatchError


def test_rows_hold_each_ranks_own_length(comm, world):
    """Each rank sends its own length; row r holds rank r's bytes, between other collectives
    of the same transport, whatever the order in which the ranks get there."""
    t = comm.transport
    ex = t.prepare_exchange(4096)
    assert ex.sized
    n = comm.size
    for step in range(6):
        mine = 1 + (97 * (t.rank + step)) % 4096  # a different length on every rank
        ex.send[:mine] = (step + t.rank) % 251
        if step % 2:
            world.Barrier()
        ex(mine)
        lengths = world.allgather(mine)
        for r in range(n):
            if r != t.rank:
                assert (ex.recv[r, :lengths[r]] == (step + r) % 251).all(), (step, r)
        np.testing.assert_array_equal(comm.allreduce(np.full(3, 1.0)), np.full(3, float(n)))
    with pytest.raises(ValueError, match="sends 1 to 4096 bytes, got 0"):
        ex(0)


def test_lengths_that_differ_raise_everywhere_and_then_reduce(comm):
    """A rank whose call rides in the exchange (8 bytes) meets ranks whose call does not
    (32 KiB, MPI's allreduce after the headers), or a barrier, or a longer inlined call: the
    same error on every rank, on the checked path and on the prepared one, and the sums after
    it are right."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n, odd = comm.size, comm.rank == comm.size - 1
    tiny, small = np.arange(2, dtype=np.float32), np.arange(1000, dtype=np.float32)
    big = np.arange(8192, dtype=np.float32)
    for _ in range(3):  # the checked call, then its prepared repeats
        for x in (tiny, small, big):
            np.testing.assert_array_equal(comm.allreduce(x), x * n)
        for mine, theirs in ((big, tiny), (small, tiny), (tiny, big), (tiny, None)):
            x = mine if odd else theirs
            with pytest.raises(ArgumentMismatchError):
                comm.barrier() if x is None else comm.allreduce(x)
    np.testing.assert_array_equal(comm.allreduce(tiny * (comm.rank + 1)),
                                  tiny * (n * (n + 1) // 2))
    np.testing.assert_array_equal(comm.allreduce(big), big * n)


def test_persistent_allreduce_gives_the_first_calls_bits(comm, world, rng):
    """Repeats run a persistent allreduce (copied in and out of its own buffer), the first
    call MPI_Iallreduce straight on the arrays: for sums whose value depends on the order of
    additions (many magnitudes), the same bits, on every rank, in every form of the call."""
    for length in (1025, 3000, 8192):
        x = (rng.standard_normal(length) * 10.0 ** rng.integers(-8, 8, length)).astype(
            np.float32)
        for op in ("sum", "avg"):
            first = comm.allreduce(x, op=op)
            check(world, x, first, op)
            for _ in range(3):
                np.testing.assert_array_equal(comm.allreduce(x, op=op).view(np.uint32),
                                              first.view(np.uint32))
                z = x.reshape(-1, 1).copy()  # a 2-d array of its own shape: a plan of its own
                assert comm.allreduce(z, out=z, op=op) is z
                np.testing.assert_array_equal(z.reshape(-1).view(np.uint32),
                                              first.view(np.uint32))


def test_persistent_allreduces_are_bounded(world, rng):
    """Past the transport's limit of persistent requests, new plans take MPI_Iallreduce:
    every size stays right, and the persistent ones are freed at close."""
    c = ringcomm.init("mpi", abort_on_exception=False, inline_bytes=INLINE_BYTES)
    try:
        t = c.transport
        lengths = [1100 + i for i in range(mpi_backend._PERSISTENT_KEPT + 8)]
        for _ in range(2):
            for length in lengths:
                x = rng.standard_normal(length).astype(np.float32)
                check(world, x, c.allreduce(x), "sum")
                check(world, x, c.allreduce(x), "sum")  # the prepared repeat
        if c.size > 1:
            assert len(t._allreduces) == mpi_backend._PERSISTENT_KEPT
    finally:
        c.close()
    assert t._persistent == [] and t._allreduces == {} and t._exchanges == []


@pytest.mark.parametrize("where", ["x", "out"])
def test_ranks_on_different_paths_for_one_call(comm, world, rng, where):
    """One rank's arrays are strided (the general path every time), the others' contiguous
    (their repeats prepared): MPI matches a persistent allreduce only with persistent ones,
    so both paths must run the same one. Then collectives of other kinds on the same
    communicator (a mismatch error's exchange of descriptions, a barrier) still match."""
    for _ in range(4):
        base = rng.standard_normal(2 * 3000).astype(np.float32)
        x = base[::2] if where == "x" and comm.rank == 0 else base[::2].copy()
        out = (np.empty(2 * 3000, np.float32)[::2] if where == "out" and comm.rank == 0
               else np.empty(3000, np.float32))
        assert comm.allreduce(x, out=out) is out
        check(world, x, out, "sum")
        check(world, x, comm.allreduce(x, op="avg"), "avg")
    if comm.size > 1:
        with pytest.raises(ArgumentMismatchError):
            comm.allreduce(np.ones(3 + comm.rank, np.float32))
    comm.barrier()
    np.testing.assert_array_equal(comm.allreduce(np.ones(3000, np.float32)),
                                  np.full(3000, float(comm.size), np.float32))
