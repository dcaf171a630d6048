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


@pytest.mark.parametrize("lengths", [
    (8190, 8096), (8097, 8096), (8097, 24_000), (16_192, 16_193), (48_576, 48_577),
    (16_000, 96), (60_000, 8097), (40_000, 40_008)])
def test_chunked_messages_of_other_lengths_leave_nothing_behind(comm, world, lengths):
    """Messages past the eager size go in chunks (2 to 4; longer ones whole). A rank whose
    message has another length than the others' (another number of chunks, or one chunk or
    whole against chunks) meets them: the headers differ, every rank raises, the chunks
    still on the way are received, and the exchanges after it hold the right bytes (a
    chunk left behind would land in a later exchange's row)."""
    from ringcomm.backends.mpi_exchange import EAGER_BYTES, chunks

    assert chunks(EAGER_BYTES) == (1, EAGER_BYTES) and chunks(EAGER_BYTES + 1)[0] == 2
    assert chunks(6 * EAGER_BYTES)[0] == 6 and chunks(6 * EAGER_BYTES + 1)[0] == 1
    assert chunks(2 * EAGER_BYTES, peers=3)[0] == 2 and chunks(2 * EAGER_BYTES + 1, peers=3)[0] == 1
    assert chunks(EAGER_BYTES + 1, peers=6)[0] == 1
    t = comm.transport
    ex = t.prepare_exchange(64 * 1024)
    odd = t.rank == t.size - 1
    for step in range(3):
        mine = lengths[0] if odd else lengths[1]
        header = np.frombuffer(b"%08d" % mine * 12, np.uint8)  # differs with the length
        ex.send[:96] = header
        ex.send[96:mine] = (step + 7 * t.rank) % 251
        ex(mine)
        everyone = world.allgather(mine)
        same = len(set(everyone)) == 1
        if same:
            ex.rest(mine)
        else:
            ex.drain(everyone)
        for r in range(t.size):
            if r != t.rank:
                assert bytes(ex.recv[r, :96]) == b"%08d" % everyone[r] * 12
                if same:
                    assert (ex.recv[r, 96:everyone[r]] == (step + 7 * r) % 251).all()
        # The exchange still pairs the ranks' next messages, chunked or not.
        for follow in (5000, 20_000, 100, 40_000):
            ex.send[:follow] = (step + t.rank + follow) % 251
            ex(follow)
            ex.rest(follow)
            for r in range(t.size):
                if r != t.rank:
                    assert (ex.recv[r, :follow] == (step + r + follow) % 251).all(), (r, follow)
    world.Barrier()


def test_more_lengths_than_kept_free_the_oldest_and_still_pair(comm, world):
    """Past _SIZES_KEPT message lengths (chunked ones among them) the oldest length's requests
    are freed; the lengths after, and an evicted one met again, still carry the right bytes,
    and ``free`` releases what is left."""
    from ringcomm.backends import mpi_exchange

    t = comm.transport
    ex = t.prepare_exchange(64 * 1024)
    lengths = [100 + 509 * i for i in range(mpi_exchange._SIZES_KEPT + 6)] + [100, 20_000]
    for step, n in enumerate(lengths):
        ex.send[:n] = (step + 3 * t.rank) % 251
        ex(n)
        ex.rest(n)
        assert len(ex._requests) <= mpi_exchange._SIZES_KEPT
        for r in range(t.size):
            if r != t.rank:
                assert (ex.recv[r, :n] == (step + 3 * r) % 251).all(), (step, r, n)
    ex.free()
    assert ex._requests == {}
    world.Barrier()


def test_inlined_calls_of_other_sizes_raise_everywhere_then_reduce(comm):
    """Allreduces inlined in chunks (8-32 KiB over MPI where every rank shares a node) of
    another size on one rank, or against a header-only call (a barrier, an 8-byte call, a
    call MPI's allreduce takes): the same error on every rank, checked and prepared, and the
    sums after it right."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n, odd = comm.size, comm.rank == comm.size - 1
    arrays = [np.arange(k, dtype=np.float32) for k in (2, 2049, 4000, 7000, 15_000)]
    arrays = [x for x in arrays if x.nbytes <= comm.inline_bytes] + [
        np.arange(comm.inline_bytes // 4 + 10, dtype=np.float32)]
    for _ in range(3):  # the checked call, then its prepared repeats
        for x in arrays:
            np.testing.assert_array_equal(comm.allreduce(x), x * n)
        for i, mine in enumerate(arrays):
            theirs = arrays[(i + 1) % len(arrays)]
            with pytest.raises(ArgumentMismatchError):
                comm.allreduce(mine if odd else theirs)
        with pytest.raises(ArgumentMismatchError):
            comm.barrier() if odd else comm.allreduce(arrays[2])
    for x in arrays:
        np.testing.assert_array_equal(comm.allreduce(x * (comm.rank + 1)),
                                      x * (n * (n + 1) // 2))


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
