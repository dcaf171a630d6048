"""Bad input: the same clear error on every rank, never a hang, and the communicator survives."""

from __future__ import annotations

import numpy as np
import pytest

import ringcomm


def usable(comm) -> None:
    """The communicator still works after an error."""
    y = comm.allreduce(np.ones(10_000, dtype=np.float32))
    assert np.all(y == comm.size)


def needs_two(comm) -> None:
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")


def test_lengths_differ(comm):
    needs_two(comm)
    n = 1000 + (comm.rank == 1) * 24
    with pytest.raises(ValueError, match=r"shape differs between ranks: \(1000,\) on rank"):
        comm.allreduce(np.ones(n, dtype=np.float32))
    big = 102_400 if comm.rank == 1 else 100_000
    with pytest.raises(ValueError, match=r"\(100000,\) on rank.*\(102400,\) on rank 1"):
        comm.allreduce(np.ones(big, dtype=np.float32))
    usable(comm)


def test_dtypes_differ(comm):
    needs_two(comm)
    dtype = np.float64 if comm.rank == 1 else np.float32
    with pytest.raises(TypeError, match=r"dtype differs between ranks: float32 on rank.*float64 "
                                        r"on rank 1"):
        comm.allreduce(np.ones(100_000, dtype=dtype))
    usable(comm)


def test_errors_carry_their_fields(comm):
    """Typed errors: what differs, on which ranks, without parsing the message."""
    needs_two(comm)
    n = 1000 + (comm.rank == 1) * 24
    with pytest.raises(ringcomm.ArgumentMismatchError) as mismatch:
        comm.allreduce(np.ones(n, dtype=np.float32))
    err = mismatch.value
    assert err.kind == "allreduce" and err.ranks == tuple(range(comm.size))
    assert err.differences == {"shape": tuple((1000 + (r == 1) * 24,) for r in range(comm.size))}
    dtype = np.float64 if comm.rank == 1 else np.float32
    with pytest.raises(ringcomm.DtypeMismatchError) as mismatch:
        comm.allreduce(np.ones(10, dtype=dtype))
    assert isinstance(mismatch.value, TypeError) and "dtype" in mismatch.value.differences
    op = "median" if comm.rank == comm.size - 1 else "sum"
    with pytest.raises(ringcomm.InvalidArgumentError) as invalid:
        comm.allreduce(np.ones(10, dtype=np.float32), op=op)
    err = invalid.value
    assert err.kind == "allreduce" and err.ranks == (comm.size - 1,) and err.differences == {}
    assert err.reason.startswith("unknown op 'median'")
    with pytest.raises(ringcomm.InvalidTypeError):
        comm.allreduce(np.ones(10, dtype=np.complex64))
    usable(comm)


def test_ops_differ(comm):
    needs_two(comm)
    op = "max" if comm.rank == 1 else "sum"
    with pytest.raises(ValueError, match="op differs between ranks"):
        comm.allreduce(np.ones(10, dtype=np.float32), op=op)
    usable(comm)


def test_invalid_op_on_one_rank(comm):
    op = "median" if comm.rank == comm.size - 1 else "sum"
    with pytest.raises(ValueError, match=f"allreduce failed on rank {comm.size - 1}: unknown op "
                                         "'median'"):
        comm.allreduce(np.ones(10, dtype=np.float32), op=op)
    usable(comm)


@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, object, np.int8, np.uint32])
def test_unsupported_dtype(comm, dtype):
    x = np.ones(8, dtype=dtype)
    with pytest.raises(TypeError, match="unsupported dtype"):
        comm.allreduce(x)
    usable(comm)


def test_unsupported_dtype_on_one_rank_only(comm):
    x = np.ones(8, dtype=np.complex128 if comm.rank == 0 else np.float64)
    with pytest.raises(TypeError, match="failed on rank 0: unsupported dtype complex128"):
        comm.allreduce(x)
    usable(comm)


def test_avg_of_integers_refused(comm):
    with pytest.raises(TypeError, match="'avg' needs a floating dtype, got int32"):
        comm.allreduce(np.ones(8, dtype=np.int32), op="avg")
    usable(comm)


def test_not_an_array(comm):
    with pytest.raises(TypeError, match="expected a NumPy or CuPy array, got list"):
        comm.allreduce([1.0, 2.0])
    usable(comm)


def test_out_mismatch(comm):
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match=r"out has shape \(9,\), expected \(8,\)"):
        comm.allreduce(x, out=np.empty(9, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        comm.allreduce(x, out=np.empty(8, np.float64))
    usable(comm)


def test_broadcast_root_differs(comm):
    needs_two(comm)
    with pytest.raises(ValueError, match="root differs between ranks"):
        comm.broadcast(np.ones(4), root=comm.rank % 2)
    with pytest.raises(ValueError, match=r"root must be a rank in \[0, "):
        comm.broadcast(np.ones(4), root=comm.size)
    usable(comm)


# Trailing dimensions whose reprs have equal CRC32s: a header that compared them through
# CRC32 let these calls meet (wrong values, results that differ between ranks, a hang).
_SAME_CRC32 = [((4, 38, 50), (597, 12, 1)), ((85, 679), (14874, 4))]


@pytest.mark.parametrize("pair", _SAME_CRC32, ids=["inline", "segment"])
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "allgather"])
def test_shapes_with_equal_crc32s_differ(comm, pair, kind):
    needs_two(comm)
    x = np.ones((1, *pair[comm.rank % 2]), np.float32)
    with pytest.raises(ringcomm.ArgumentMismatchError, match="shape differs between ranks"):
        getattr(comm, kind)(x)
    usable(comm)


def test_allgather_shapes_differ(comm):
    needs_two(comm)
    with pytest.raises(ValueError, match="use allgatherv"):
        comm.allgather(np.ones(3 + comm.rank))
    assert comm.allgatherv(np.ones(3 + comm.rank)).shape == (sum(3 + r for r in range(comm.size)),)


def test_allgatherv_trailing_shapes_differ(comm):
    needs_two(comm)
    with pytest.raises(ValueError, match="shape after the first dimension differs"):
        comm.allgatherv(np.ones((2, 3 + comm.rank)))
    usable(comm)


def test_closed_communicator():
    c = ringcomm.init("mpi", abort_on_exception=False)
    c.close()
    c.close()  # idempotent
    assert c.closed
    for call in (lambda: c.allreduce(np.ones(3)), lambda: c.broadcast(np.ones(3)),
                 lambda: c.allgather(np.ones(3)), c.barrier):
        with pytest.raises(RuntimeError, match="communicator is closed"):
            call()
    with pytest.raises(RuntimeError, match="communicator is closed"):
        c.segment_bytes = 1 << 20


def test_consistency_check_can_be_switched_off(comm):
    c = ringcomm.init("mpi", consistency_check=False, abort_on_exception=False)
    try:
        assert not c.consistency_check
        x = np.arange(5000, dtype=np.float64)
        np.testing.assert_array_equal(c.allreduce(x), x * c.size)
        np.testing.assert_array_equal(c.allreduce(x[:7]), x[:7] * c.size)
        # Without the check, an invalid argument raises on its own rank only: here every rank
        # passes the same invalid op, so every rank raises and nothing waits.
        with pytest.raises(ValueError, match="unknown op"):
            c.allreduce(x, op="bogus")
    finally:
        c.close()


def test_an_unchecked_mismatch_that_mpi_catches_says_so_and_fails_the_communicator(world):
    """With the consistency check off, a rank whose segments are larger sends ring messages its
    neighbour's receives cannot hold: MPI's bare "See the MPI_ERROR field" becomes an error
    naming the step, the peer and the check to turn on, and the communicator refuses every
    later call (the failed exchange's messages would match them); the other rank times out."""
    from ringcomm.backends.mpi import MPICommunicator
    if world.Get_size() != 2:
        pytest.skip("two ranks: one receives too much, the other waits")
    c = MPICommunicator(world, consistency_check=False, abort_on_timeout=False, timeout=2)
    c.segment_bytes = 4096 if c.rank == 0 else 65536
    x = np.ones(300_000, np.float32)
    try:
        if c.rank == 0:
            with pytest.raises(RuntimeError) as err:
                c.allreduce(x)
            message = str(err.value)
            assert message.startswith("allreduce failed on rank 0 of 2 in the ring exchange "
                                      "with rank 1: MPI reports an error")
            assert "RINGCOMM_CONSISTENCY_CHECK=1" in message
            with pytest.raises(RuntimeError, match="aborted after an earlier failure"):
                c.allreduce(np.ones(4, np.float32))
        else:
            with pytest.raises(ringcomm.CollectiveTimeoutError):
                c.allreduce(x)
        world.Barrier()
    finally:
        c.close()


def test_repeated_small_call_still_checked(comm):
    """A small allreduce seen before takes a prepared path; a rank that changes its arguments
    is still caught on every rank."""
    x = np.arange(16, dtype=np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(comm.allreduce(x), x * comm.size)
    if comm.size > 1:
        op = "max" if comm.rank == 1 else "sum"
        with pytest.raises(ValueError, match="op differs between ranks"):
            comm.allreduce(x, op=op)
        y = np.arange(17, dtype=np.float32) if comm.rank == 1 else x
        with pytest.raises(ValueError, match=r"shape differs between ranks"):
            comm.allreduce(y)
    out = np.empty_like(x)
    assert comm.allreduce(x, out=out) is out
    np.testing.assert_array_equal(out, x * comm.size)


def test_residual_that_does_not_fit_raises_everywhere(comm):
    ef = ringcomm.ErrorFeedback()
    if comm.rank == 0:
        ef.take("w", np.zeros(7, np.float32))  # a stale residual on one rank only
    with pytest.raises(ValueError, match="residual 'w' holds 7 elements but the tensor has 5000"):
        comm.allreduce(np.ones(5000, np.float32), compression=ringcomm.Int8(), feedback=ef,
                       name="w")
    usable(comm)


@pytest.mark.parametrize("n", [16, 5000])
def test_read_only_output_raises_everywhere(comm, n):
    x = np.ones(n, np.float32)
    writable = np.empty_like(x)
    for _ in range(2):  # also once the call is prepared
        comm.allreduce(x, out=writable)
    frozen = np.ones(n, np.float32)
    frozen.flags.writeable = comm.rank != comm.size - 1
    with pytest.raises(ValueError, match="out is read-only"):
        comm.allreduce(x, out=frozen)
    with pytest.raises(ValueError, match="x is read-only"):
        comm.broadcast(frozen, root=0)
    usable(comm)


def test_segment_bytes_must_match(comm):
    needs_two(comm)
    saved = comm.segment_bytes
    comm.segment_bytes = 4096 if comm.rank == 0 else saved
    try:
        with pytest.raises(ValueError, match="segment_bytes differs between ranks: 4096 on rank 0"):
            comm.allreduce(np.ones(100_000, np.float32))
    finally:
        comm.segment_bytes = saved
    usable(comm)
    with pytest.raises(AttributeError):
        comm.inline_bytes = 64


def test_inline_bytes_must_match():
    """Refused when the communicator starts, on every rank, naming each rank's value."""
    info = ringcomm.launch_info()
    inline = 4096 if info.rank else 1024
    if info.size == 1:
        ringcomm.init("mpi", inline_bytes=inline, abort_on_exception=False).close()
        return
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match="inline_bytes differs between ranks: 1024 on rank 0; 4096 on rank"
                       ) as err:
        ringcomm.init("mpi", inline_bytes=inline, abort_on_exception=False)
    assert err.value.kind == "init" and "inline_bytes" in err.value.differences


def test_different_collectives_raise_the_same_error(comm):
    needs_two(comm)
    with pytest.raises(ValueError, match="collective calls differ between ranks: allreduce on "):
        if comm.rank == 0:
            comm.allreduce(np.ones(10))
        else:
            comm.broadcast(np.ones(10))
    with pytest.raises(ValueError, match="collective calls differ between ranks"):
        if comm.rank == 0:
            comm.barrier()
        else:
            comm.allgather(np.ones(3))
    comm.barrier()
    usable(comm)


def test_mpi_transport_split(comm):
    """split over MPI: sub-groups ordered by (key, rank) reduce their own ranks; bad arguments
    on one rank raise the same error on every rank (they used to leave the others in
    MPI_Comm_split)."""
    from ringcomm.comm.base import Communicator

    t = comm.transport
    sub = Communicator(t.split(t.rank % 2, -t.rank))
    try:
        members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
        assert sub.size == len(members) and sub.rank == sorted(members, reverse=True).index(
            comm.rank)
        y = sub.allreduce(np.full(100_000, comm.rank + 1.0))
        assert np.all(y == sum(r + 1.0 for r in members))
    finally:
        sub.close()
    color = -1 if comm.rank == comm.size - 1 else 0
    with pytest.raises(ringcomm.InvalidArgumentError,
                       match=f"split failed on rank {comm.size - 1}: split color must be >= 0"):
        t.split(color, 0)
    usable(comm)


def test_a_call_without_compression_is_named_in_the_error(comm):
    """Compression on some ranks only: the ranks without any are shown as "none", never as a
    blank ("compression/name differs between ranks:  on rank 0")."""
    needs_two(comm)
    x = np.ones(100_000, np.float32)
    fp16 = comm.rank != 0
    with pytest.raises(ringcomm.ArgumentMismatchError) as err:
        comm.allreduce(x, compression=ringcomm.FP16() if fp16 else None,
                       feedback=ringcomm.ErrorFeedback() if fp16 else None,
                       name="f" if fp16 else None)
    assert "compression/name differs between ranks: none on rank 0; FP16()|f|feedback=True on " \
           "rank" in str(err.value), err.value
    usable(comm)


def test_an_invalid_setting_on_one_rank_meeting_another_call(comm):
    """A setter refused on rank 0 (an invalid topology) while the others make an allreduce:
    the same error on every rank (building it used to fail with a KeyError), and nothing
    changed."""
    needs_two(comm)
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match="collective calls differ between ranks: a change of topology=-1 on "
                             "rank 0; allreduce on rank"):
        if comm.rank == 0:
            comm.topology = -1
        else:
            comm.allreduce(np.ones(10, np.float32))
    assert comm.topology == "auto"
    usable(comm)


@pytest.mark.parametrize("repeats", [3, 70])
def test_a_timed_out_communicator_refuses_every_later_call(world, repeats):
    """After a wait timed out (``abort_on_timeout=False``) the requests it left posted would
    match a later call's messages: the communicator refuses every later call on that rank,
    repeats of calls it prepared too (small ones inlined, compiled after 64 repeats or not,
    medium ones through MPI's persistent allreduce, small reduce-scatters), instead of mixing
    data."""
    import time

    from ringcomm.backends.mpi import MPICommunicator
    if world.Get_size() != 2:
        pytest.skip("two ranks: one waits, the other does not come")
    c = MPICommunicator(world, abort_on_timeout=False, timeout=1)
    small, medium = np.ones(4, np.float32), np.ones(200_000, np.float32)
    try:
        for _ in range(repeats):
            c.allreduce(small)
            c.allreduce(medium)
            c.reduce_scatter(small)
        if c.rank == 0:
            with pytest.raises(ringcomm.CollectiveTimeoutError):
                c.allreduce(small)
            for call in (lambda: c.allreduce(small), lambda: c.allreduce(medium),
                         lambda: c.allreduce(np.ones(3)), c.barrier,
                         lambda: c.allgather(small), lambda: c.reduce_scatter(small)):
                with pytest.raises(RuntimeError, match="aborted after an earlier failure"):
                    call()
        else:
            time.sleep(1.5)
        world.Barrier()
    finally:
        c.close()


def test_a_timeout_in_a_two_level_phase_refuses_every_later_call(monkeypatch, world):
    """A wait that times out in the two-level allreduce's node-local or cross-node group (a
    transport of its own, split from the communicator's) fails the communicator: every later
    call on that rank is refused, as for a timeout of its own, instead of running on a
    group whose requests are still posted."""
    import time

    from ringcomm.algorithms import ring
    from ringcomm.backends.mpi import MPICommunicator
    if world.Get_size() != 2:
        pytest.skip("two ranks: one waits in the cross-node phase, the other comes late")
    c = MPICommunicator(world, abort_on_timeout=False, timeout=1, algorithm="hierarchical",
                        topology=1)
    x = np.ones(50_000, np.float32)
    try:
        np.testing.assert_array_equal(c.allreduce(x), 2 * x)  # the groups exist
        if c.rank == 1:  # late after the call's agreement: rank 0 waits in the cross phase
            local_phase = ring.reduce_scatter

            def late(*args, **kwargs):
                time.sleep(2.5)
                return local_phase(*args, **kwargs)
            monkeypatch.setattr(ring, "reduce_scatter", late)
        try:
            c.allreduce(x)
            raised = None
        except Exception as err:  # rank 1 may time out or finish
            raised = err
        if c.rank == 0:
            assert isinstance(raised, ringcomm.CollectiveTimeoutError), raised
            assert c.transport.failure is not None
            for call in (lambda: c.allreduce(x), lambda: c.allreduce(np.ones(3)), c.barrier):
                with pytest.raises(RuntimeError, match="aborted after an earlier failure"):
                    call()
        world.Barrier()
    finally:
        c.close()
