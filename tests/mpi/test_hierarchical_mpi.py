"""The hierarchical allreduce under mpiexec, on nodes of consecutive ranks (``topology=k``):
nodes of 2 ranks where the size is even (4 processes: 2 nodes x 2 ranks; 2 processes: one node
of 2), one node of every rank otherwise, and one node per rank.

Results match MPI's own Allreduce within the ring's tolerance and are bit-identical on every
rank; arguments that differ between ranks, and uneven nodes, raise the same error everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import gather_inputs, same_on_all_ranks, tolerance

import ringcomm

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


@pytest.fixture(scope="module", params=["pairs", "singles"])
def hcomm(request):
    """A communicator whose allreduces are hierarchical: over nodes of 2 ranks (of every rank
    where the size is odd), or of 1 rank."""
    size = MPI.COMM_WORLD.Get_size()
    per_node = 1 if request.param == "singles" else 2 if size % 2 == 0 else size
    comm = ringcomm.init("mpi", abort_on_exception=False, topology=per_node,
                         algorithm="hierarchical")
    yield comm
    comm.close()


def lengths(size: int) -> list[int]:
    """Empty, one element, fewer than ranks, uneven, past the inline slot, past 1 MiB."""
    return sorted({0, 1, max(size - 1, 1), size + 1, 10_007, 300_001})


def make(rng: np.random.Generator, n: int, dtype: str, op: str) -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        hi = 3 if op == "prod" else 1000
        return rng.integers(-hi, hi + 1, n).astype(dtype)
    scale = 0.5 if op == "prod" else 1.0
    return (rng.uniform(0.5, 1.5, n) * scale * rng.choice([-1, 1], n)).astype(dtype)


def mpi_allreduce(world, x: np.ndarray, op: str) -> np.ndarray:
    """MPI's own Allreduce, in float64 for floats (MPI has no float16 sum)."""
    wide = x.astype(np.float64) if x.dtype.kind == "f" else x.copy()
    out = np.empty_like(wide)
    world.Allreduce(wide, out, op=_MPI_OPS[op])
    return out / world.Get_size() if op == "avg" else out


def check(world, x: np.ndarray, y: np.ndarray, op: str) -> None:
    ref = mpi_allreduce(world, x, op)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert same_on_all_ranks(world, y)
    if x.dtype.kind == "i":
        np.testing.assert_array_equal(y, ref)
        return
    scale = np.abs(ref) if op == "prod" else mpi_allreduce(world, np.abs(x), "sum")
    if op == "avg":
        scale = scale / world.Get_size()
    bound = tolerance(x.dtype, world.Get_size(), op) * scale + np.finfo(x.dtype).tiny
    np.testing.assert_array_less(np.abs(y.astype(np.float64) - ref), bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_matches_mpi_allreduce(hcomm, world, rng, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers")
    for n in lengths(hcomm.size):
        x = make(rng, n, dtype, op)
        before = x.copy()
        y = hcomm.allreduce(x, op=op)
        np.testing.assert_array_equal(x, before)
        check(world, x, y, op)


@pytest.mark.parametrize("comp", [ringcomm.Int8(), ringcomm.FP16(), ringcomm.TopK(0.05),
                                  ringcomm.TopK(0.05, algorithm="allgather")],
                         ids=["int8", "fp16", "topk-ring", "topk-allgather"])
def test_compressed_conserves_and_is_identical(hcomm, world, rng, comp):
    n = 20_011
    ef = ringcomm.ErrorFeedback()
    inputs, results, magnitude = np.zeros(n), np.zeros(n), np.zeros(n)
    for _ in range(10):
        g = rng.standard_normal(n).astype(np.float32)
        y = hcomm.allreduce(g, op="avg", compression=comp, feedback=ef, name="w")
        assert same_on_all_ranks(world, y)
        everyone = gather_inputs(world, g).astype(np.float64)
        inputs += everyone.sum(axis=0)
        magnitude += np.abs(everyone).sum(axis=0)
        results += y * hcomm.size
    residuals = gather_inputs(world, ef.residual("w")).astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(results + residuals, inputs, rtol=0,
                               atol=1e-5 * magnitude.max())


def test_in_place_and_shapes(hcomm, world, rng):
    x = rng.standard_normal((257, 129)).astype(np.float32)
    expected = hcomm.allreduce(x, op="max")
    assert hcomm.allreduce(x, out=x, op="max") is x
    assert x.tobytes() == expected.tobytes() and same_on_all_ranks(world, x)


def test_same_as_flat_within_tolerance(hcomm, world, rng):
    x = rng.standard_normal(300_001).astype(np.float32)
    flat = hcomm.allreduce(x, op="avg", algorithm="flat")
    two = hcomm.allreduce(x, op="avg")
    auto = hcomm.allreduce(x, op="avg", algorithm="auto")
    assert same_on_all_ranks(world, two) and same_on_all_ranks(world, auto)
    np.testing.assert_allclose(two, flat, rtol=0, atol=1e-5)
    # "auto" runs two-level on several nodes of several ranks (the bits tell), flat otherwise.
    per_node = hcomm.topology
    several = 1 < per_node < hcomm.size
    assert auto.tobytes() == (two if several else flat).tobytes()


def test_repeats_stay_hierarchical(hcomm, world, rng):
    """Repeats of a medium call are prepared (the flat ones run MPI's allreduce straight from
    the plan); a hierarchical communicator's repeats still run the two-level allreduce."""
    from ringcomm.core import trace

    class Spans:
        def __init__(self):
            self.labels = []

        def begin(self, label):
            self.labels.append(label)

        def end(self, label):
            pass

    x = rng.standard_normal(100_007).astype(np.float32)  # above every inline default
    first = hcomm.allreduce(x)
    for _ in range(2):
        spans = Spans()
        trace.set_tracer(spans)
        try:
            again = hcomm.allreduce(x)
        finally:
            trace.set_tracer(None)
        assert again.tobytes() == first.tobytes() and same_on_all_ranks(world, again)
        if hcomm.size > 1:
            assert "LOCAL_REDUCE_SCATTER" in spans.labels, spans.labels


def test_algorithm_differing_between_ranks(hcomm, world):
    if hcomm.size < 2:
        pytest.skip("needs at least 2 ranks")
    x = np.ones(100_000, np.float32)
    mine = "flat" if hcomm.rank == 1 else "hierarchical"
    with pytest.raises(ringcomm.ArgumentMismatchError) as err:
        hcomm.allreduce(x, algorithm=mine)
    assert err.value.differences == {
        "algorithm": tuple("flat" if r == 1 else "hierarchical" for r in range(hcomm.size))}
    assert "algorithm differs between ranks" in str(err.value)
    assert same_on_all_ranks(world, np.frombuffer(str(err.value).encode(), np.uint8))
    unknown = "tree" if hcomm.rank == 0 else "flat"
    with pytest.raises(ringcomm.InvalidArgumentError, match="failed on rank 0: algorithm must"):
        hcomm.allreduce(x, algorithm=unknown)
    # Compressed calls too, and the communicator stays usable.
    with pytest.raises(ringcomm.ArgumentMismatchError, match="algorithm differs"):
        hcomm.allreduce(x, compression=ringcomm.Int8(), algorithm=mine)
    np.testing.assert_array_equal(hcomm.allreduce(x), np.full_like(x, hcomm.size))


def test_uneven_nodes_refuse_hierarchical(world):
    size = world.Get_size()
    if size < 3:
        pytest.skip("needs 3 or more ranks for nodes of different sizes")
    comm = ringcomm.init("mpi", abort_on_exception=False, topology=size - 1)
    try:
        x = np.ones(100_000, np.float32)
        with pytest.raises(ringcomm.InvalidArgumentError) as err:
            comm.allreduce(x, algorithm="hierarchical")
        message = str(err.value)
        assert f"got 2 nodes of {size - 1}, 1 ranks" in message
        assert same_on_all_ranks(world, np.frombuffer(message.encode(), np.uint8))
        # "auto" runs flat there, compressed or not; the communicator stays usable.
        np.testing.assert_array_equal(comm.allreduce(x), np.full_like(x, size))
        y = comm.allreduce(x, compression=ringcomm.Int8())
        assert same_on_all_ranks(world, y)
    finally:
        comm.close()


def test_topology_differing_between_ranks(world):
    """Refused when the communicator starts, on every rank."""
    size = world.Get_size()
    if size < 2:
        pytest.skip("needs at least 2 ranks")
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match="topology differs between ranks: 1 on rank 0; auto on rank"):
        ringcomm.init("mpi", abort_on_exception=False,
                      topology=1 if world.Get_rank() == 0 else "auto")


def test_topology_changed_on_one_rank_after_the_groups_exist(world):
    """Changing the topology is collective and agreed: changed on one rank alone after the
    two-level groups were made (the next hierarchical allreduce used to wait for the
    timeout), or to different values, it raises the same error on every rank and no rank's
    setting changes; changed on every rank alike, it takes effect."""
    size, rank = world.Get_size(), world.Get_rank()
    if size < 2:
        pytest.skip("needs at least 2 ranks")
    comm = ringcomm.init("mpi", abort_on_exception=False, timeout=30)
    others = "rank 1" if size == 2 else "ranks " + ", ".join(map(str, range(1, size)))
    try:
        x = np.ones(100_000, np.float32)
        np.testing.assert_array_equal(comm.allreduce(x, algorithm="hierarchical"),
                                      np.full_like(x, size))
        with pytest.raises(ringcomm.ArgumentMismatchError) as alone:
            if rank == 0:
                comm.topology = 1
            else:
                comm.allreduce(x, algorithm="hierarchical")
        assert str(alone.value) == ("collective calls differ between ranks: a change of "
                                    f"topology=1 on rank 0; allreduce on {others}")
        with pytest.raises(ringcomm.ArgumentMismatchError,
                           match=f"setting differs between ranks: topology=1 on rank 0; "
                                 f"topology='auto' on {others}"):
            comm.topology = 1 if rank == 0 else "auto"
        assert comm.topology == "auto"
        for topology in (1, "auto"):
            comm.topology = topology
            for algorithm in ("hierarchical", "flat"):
                np.testing.assert_array_equal(comm.allreduce(x, algorithm=algorithm),
                                              np.full_like(x, size))
    finally:
        comm.close()
