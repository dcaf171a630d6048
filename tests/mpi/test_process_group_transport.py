"""The transport over a gloo group that torch.distributed does not hold (ProcessGroupTransport):
what the "ringcomm" torch.distributed backend runs a group of some of the job's ranks on under
torchrun, where torch makes the group, and calls its first collective, on its members only.

Here MPI's ranks make such groups over a TCP store, each group by its members alone (the
others do not take part), and ringcomm's Communicator runs on them: results checked against
every rank's inputs gathered with mpi4py, the same bits on every member, ranks numbered in the
members' order, and the two-level allreduce, whose splits make gloo groups of their own over
the store, equal to the flat ring's on integer-valued data.
"""

from __future__ import annotations

import datetime
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ringcomm.backends.gloo import ProcessGroupTransport  # noqa: E402
from ringcomm.comm.base import Communicator  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
TIMEOUT = datetime.timedelta(seconds=60)


@pytest.fixture(scope="module")
def store():
    port = None
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = WORLD.bcast(port, root=0)
    return dist.TCPStore("127.0.0.1", port, SIZE, is_master=RANK == 0, timeout=TIMEOUT)


def _communicator(store, name: str, members: list[int], **options) -> Communicator:
    """A Communicator over a gloo group of ``members`` (MPI ranks, in its order), made by them
    alone."""
    mine = dist.PrefixStore(name, store)
    group = dist.ProcessGroupGloo(dist.PrefixStore("group", mine), members.index(RANK),
                                  len(members), TIMEOUT)
    transport = ProcessGroupTransport(group, dist.PrefixStore("splits", mine), timeout=60,
                                      abort_on_timeout=False)
    return Communicator(transport, **options)


def _everyone(x: np.ndarray) -> list[np.ndarray]:
    return WORLD.allgather(x)


def _same_everywhere(comm_members: list[int], got: np.ndarray) -> bool:
    """Whether ``got`` has the same bytes on every member (gathered over MPI's world)."""
    rows = WORLD.allgather(got.tobytes() if RANK in comm_members else None)
    return len({rows[m] for m in comm_members}) == 1


def test_the_whole_job(store):
    comm = _communicator(store, "whole", list(range(SIZE)))
    try:
        assert (comm.rank, comm.size, comm.backend) == (RANK, SIZE, "gloo")
        rng = np.random.default_rng(RANK)
        for n in (3, 2_000, 300_001):  # inline, the ring, gloo's own allreduce
            x = rng.standard_normal(n).astype(np.float32)
            got = comm.allreduce(x)
            want = np.sum(np.stack(_everyone(x)).astype(np.float64), axis=0)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
            assert _same_everywhere(list(range(SIZE)), got)
            mean = comm.allreduce(x, op="avg")
            np.testing.assert_allclose(mean, want / SIZE, rtol=1e-5, atol=1e-4)
        i = np.arange(5_000, dtype=np.int64) * (RANK + 1)
        assert np.array_equal(comm.allreduce(i, op="max"), np.arange(5_000) * SIZE)
        h = np.full(4_000, RANK + 1, np.float16)  # 16-bit floats take the ring
        assert np.array_equal(comm.allreduce(h), np.full(4_000, SIZE * (SIZE + 1) // 2))
        rows = comm.allgather(np.array([[RANK, 10 * RANK]]))
        assert rows.tolist() == [[r, 10 * r] for r in range(SIZE)]
        b = np.full(7, float(RANK))
        comm.broadcast(b, root=SIZE - 1)
        assert b.tolist() == [float(SIZE - 1)] * 7
        comm.barrier()
    finally:
        comm.close()


def test_a_group_made_by_its_members_alone(store):
    """Members SIZE-1, ..., 1 in that order; rank 0 takes no part."""
    members = list(range(SIZE - 1, 0, -1))
    try:
        if RANK in members:
            comm = _communicator(store, "members", members)
            try:
                assert (comm.rank, comm.size) == (members.index(RANK), len(members))
                assert comm.allgather(np.array([RANK])).tolist() == members
                x = np.full(70_000, float(RANK), np.float32)
                assert np.array_equal(comm.allreduce(x), np.full(70_000, float(sum(members))))
            finally:
                comm.close()
    finally:
        WORLD.Barrier()  # rank 0 waits here for the members, whatever they met


@pytest.mark.skipif(SIZE % 2 != 0, reason="nodes of two ranks")
def test_two_levels_split_over_the_store(store):
    """The two-level allreduce splits the transport (within each block of two ranks, then
    across): each split a gloo group of its members, over the store."""
    comm = _communicator(store, "levels", list(range(SIZE)), topology=2)
    try:
        x = np.arange(1 << 18, dtype=np.float32) % 1000 * (RANK + 1)  # sums exact in float32
        two = comm.allreduce(x, algorithm="hierarchical")
        flat = comm.allreduce(x, algorithm="flat")
        assert np.array_equal(two, flat)
        assert np.array_equal(flat, np.arange(1 << 18, dtype=np.float32) % 1000
                              * (SIZE * (SIZE + 1) // 2))
    finally:
        comm.close()
