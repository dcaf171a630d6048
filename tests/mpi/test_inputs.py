"""Arrays users have: zero-size n-d, unaligned, non-native byte order, ndarray subclasses,
overlapping ``out``; NumPy scalars as options; error feedback on some ranks only. Each either
works, with the same result on every rank, or raises the same clear error on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import same_on_all_ranks

import ringcomm


def usable(comm) -> None:
    assert np.all(comm.allreduce(np.ones(10_000, dtype=np.float32)) == comm.size)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,), (2, 0, 4)])
def test_zero_size_arrays_are_a_no_op_with_the_right_shape(comm, shape):
    x = np.ones(shape, dtype=np.float32)
    for _ in range(2):  # the first call is checked in full, the repeat takes the prepared plan
        y = comm.allreduce(x)
        assert y.shape == shape and y.dtype == np.float32
    assert comm.allgather(np.ones((0, 5), np.float32)).shape == (0, 5)
    usable(comm)


@pytest.mark.parametrize("n", [10, 300_001])  # inline, and the ring
def test_unaligned_arrays_are_reduced(comm, world, n):
    buf = np.zeros(4 * n + 1, np.uint8)
    x = np.frombuffer(buf, np.float32, offset=1, count=n)
    assert not x.flags.aligned
    src = np.arange(n, dtype=np.float32) * (comm.rank + 1)
    buf[1:] = src.view(np.uint8)
    y = comm.allreduce(x)
    np.testing.assert_array_equal(y, np.arange(n, dtype=np.float32) * sum(range(1, comm.size + 1)))
    out_buf = np.zeros(4 * n + 1, np.uint8)
    out = np.ndarray((n,), np.float32, buffer=out_buf, offset=1)  # writeable and unaligned
    comm.allreduce(x, out=out)
    np.testing.assert_array_equal(out, y)
    assert same_on_all_ranks(world, y)


def test_non_native_byte_order_is_refused_clearly(comm):
    x = np.ones(100, dtype=">f4")
    with pytest.raises(ringcomm.InvalidTypeError, match=r"non-native byte order \(big-endian\)"
                                                        r".*newbyteorder\('='\)"):
        comm.allreduce(x)
    usable(comm)


def test_byte_order_on_one_rank_is_named(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    dt = ">f4" if comm.rank == 1 else "<f4"
    with pytest.raises(ringcomm.InvalidTypeError, match="allreduce failed on rank 1: dtype >f4"):
        comm.allreduce(np.ones(10, dtype=dt))
    # moving bytes takes any byte order, but both ends must agree on it
    with pytest.raises(ringcomm.DtypeMismatchError, match="float32 \\(big-endian\\) on rank 1"):
        comm.allgather(np.ones(4, dtype=dt))
    usable(comm)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_memmap_and_other_subclasses_work(comm, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"r{comm.rank}") / "x.dat"
    m = np.memmap(path, dtype=np.float32, mode="w+", shape=(1000,))
    m[:] = comm.rank + 1
    total = sum(range(1, comm.size + 1))
    assert np.all(comm.allreduce(m) == total)
    assert comm.allreduce(m, out=m) is m and np.all(m == total)
    mat = np.matrix(np.full((2, 3), comm.rank, np.float64))
    y = comm.allreduce(mat)
    assert y.shape == (2, 3) and np.all(np.asarray(y) == sum(range(comm.size)))
    b = np.memmap(path, dtype=np.float32, mode="r+", shape=(1000,))
    assert comm.broadcast(b, root=0) is b
    assert comm.allgather(m).shape == (1000 * comm.size,)


def test_overlapping_out_is_refused(comm):
    x = np.ones(2000, np.float32)
    with pytest.raises(ringcomm.InvalidArgumentError, match="out overlaps x without being x"):
        comm.allreduce(x[:1000], out=x[500:1500])
    # the same elements through another view are in place, and allowed
    y = np.ones(1000, np.float32)
    comm.allreduce(y, out=y.reshape(1000))
    assert np.all(y == comm.size)
    # a cached plan does not skip the check
    a = np.ones(1000, np.float32)
    comm.allreduce(a[:500], out=np.empty(500, np.float32))
    with pytest.raises(ValueError, match="overlaps"):
        comm.allreduce(a[:500], out=a[250:750])
    usable(comm)


def test_numpy_scalars_as_options():
    assert ringcomm.Int8(block_size=np.int64(256)) == ringcomm.Int8(block_size=256)
    assert ringcomm.TopK(np.float32(0.5)).ratio == 0.5
    with pytest.raises(ValueError, match="block_size"):
        ringcomm.Int8(block_size=np.float64(2.5))


def test_feedback_on_some_ranks_only_raises_everywhere(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    ef = ringcomm.ErrorFeedback() if comm.rank == 0 else None
    with pytest.raises(ringcomm.ArgumentMismatchError, match="feedback=True on rank 0"):
        comm.allreduce(np.ones(5000, np.float32), compression=ringcomm.Int8(), feedback=ef,
                       name="w")
    usable(comm)


def test_sendrecv_into_a_short_buffer_says_so(comm):
    """A message longer than the receive buffer: the receiver's error names the sizes and the
    peer (it was MPI's "See the MPI_ERROR field in MPI_Status")."""
    if comm.size < 2 or comm.backend != "mpi":
        pytest.skip("needs 2 MPI ranks")
    if comm.rank < 2:
        peer = 1 - comm.rank
        send = np.ones(100 if comm.rank == 0 else 10, np.float32)
        recv = np.zeros(10 if comm.rank == 1 else 100, np.float32)
        if comm.rank == 1:
            with pytest.raises(ringcomm.InvalidArgumentError,
                               match=r"sendrecv on rank 1: the message from rank 0 is longer "
                                     r"than the receive buffer \(40 bytes\)"):
                comm.sendrecv(send, peer, recv, peer)
        else:
            comm.sendrecv(send, peer, recv, peer)
            np.testing.assert_array_equal(recv[:10], 1)
    usable(comm)


@pytest.mark.parametrize("which", ["x", "out"])
def test_the_residual_itself_as_x_or_out_is_refused(comm, which):
    """The call overwrites the residual it adds: an input or result in its memory would be
    read after it was overwritten (or overwrite it), on every rank alike."""
    ef, c = ringcomm.ErrorFeedback(), ringcomm.Int8()
    x = np.random.default_rng(comm.rank).standard_normal(5000).astype(np.float32)
    comm.allreduce(x, compression=c, feedback=ef, name="w")
    res = ef.residual("w")
    held = res.copy()
    args = (res, None) if which == "x" else (x, res[:])
    with pytest.raises(ringcomm.InvalidArgumentError,
                       match=f"{which} shares memory with the residual kept under 'w'"):
        comm.allreduce(args[0], out=args[1], compression=c, feedback=ef, name="w")
    np.testing.assert_array_equal(ef.residual("w"), held)  # nothing ran
    with pytest.raises(ringcomm.InvalidArgumentError, match="shares memory with the residual"):
        comm.allreduce(res, compression="auto", feedback=ef, name="w")
    comm.allreduce(res.copy(), compression=c, feedback=ef, name="w")  # a copy is fine
    usable(comm)
