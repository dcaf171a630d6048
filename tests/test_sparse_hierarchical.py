"""Top-k's two-level allreduce (ringcomm.algorithms.sparse_hierarchical), ranks as threads.

test_hierarchical.py runs every compressor through the two-level entry point (results the same
on every rank, error feedback conserving, NaN and Inf kept); here: that top-k's node-local
phases move selected pairs, not float32, what the path does at its edges, and device arrays on
the CPU emulator of tests/gpu_emulator.py, where "auto" takes the path from two nodes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from thread_helpers import assert_conserved, communicators, identical, on_grid

import ringcomm
from ringcomm.algorithms import hierarchical, sparse_hierarchical
from ringcomm.algorithms.compressed_ring import mix_seed
from ringcomm.core.types import ReduceOp

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2)], ids=["2x2", "2x3", "3x2"])
def test_node_phases_move_pairs_and_conserve(shape):
    """Inside each node only pairs travel (a small fraction of the float32 array); every rank
    gets the same bits; results plus residuals hold every input's mass."""
    n, length = shape[0] * shape[1], 60_000
    per_node = shape[1]
    comp = ringcomm.TopK(0.01)
    xs = np.random.default_rng(n).standard_normal((3, n, length)).astype(np.float32)

    def body(local, cross, rank):
        assert sparse_hierarchical.applies(local, cross, length, comp)
        ef = ringcomm.ErrorFeedback()
        results = []
        for step, x in enumerate(xs):
            out = np.empty(length, np.float32)
            hierarchical.allreduce_with_feedback(local, cross, x[rank], out, ReduceOp.SUM,
                                                 comp, ef, "w", mix_seed(step, rank))
            results.append(out)
        return (results, ef.residual("w")), local.stats.bytes_sent

    per_rank = on_grid(shape, body, timeout=120.0)
    for step in range(len(xs)):
        assert identical([r[0][0][step] for r in per_rank])
        assert np.count_nonzero(per_rank[0][0][0][step]) <= 2 * comp.k_for(length) * per_node
    for _, node_bytes in per_rank:
        # Pairs of 8 bytes for 1% of the array, twice a call, against 4 bytes per element.
        assert node_bytes < 3 * 2 * 8 * comp.k_for(length) * 1.1
    assert_conserved([r[0] for r in per_rank], xs, "sum")


def test_in_place_float16_and_avg():
    """``out`` may be ``x``; a float16 result rounds its float32 sum once and keeps the
    rounding in the residual (conserved); "avg" divides by the whole job."""
    n, length = 4, 5000
    comp = ringcomm.TopK(0.05)
    xs = np.random.default_rng(7).standard_normal((2, n, length)).astype(np.float16)

    def body(local, cross, rank):
        ef = ringcomm.ErrorFeedback()
        results = []
        for step, x in enumerate(xs):
            buf = x[rank].copy()
            hierarchical.allreduce_with_feedback(local, cross, buf, buf, ReduceOp.AVG, comp,
                                                 ef, "w", mix_seed(step, rank))
            results.append(buf)
        return results, ef.residual("w")

    per_rank = on_grid((2, 2), body, timeout=120.0)
    for step in range(len(xs)):
        assert identical([r[0][step] for r in per_rank])
    assert_conserved(per_rank, xs, "avg")


def test_where_the_path_does_not_apply():
    """One node, one rank per node, arrays shorter than the job, ratios whose pairs outweigh
    the values, and top-k's allgather algorithm take the other paths."""
    comp = ringcomm.TopK(0.01)

    def body(local, cross, rank):
        return (sparse_hierarchical.applies(local, cross, 1000, comp),
                sparse_hierarchical.applies(local, cross, 3, comp),
                sparse_hierarchical.applies(local, cross, 1000, ringcomm.TopK(0.6)),
                sparse_hierarchical.applies(local, cross, 1000,
                                            ringcomm.TopK(0.01, algorithm="allgather")),
                sparse_hierarchical.applies(local, cross, 1000, ringcomm.Int8()))

    assert on_grid((2, 2), body) == [(True, False, False, False, False)] * 4
    assert on_grid((1, 4), body)[0][0] is False
    assert on_grid((4, 1), body)[0][0] is False


def test_message_offsets_match_the_sparse_ring():
    """The node's other ranks cut the cross-node messages where the ring laid them out."""
    comp = ringcomm.TopK(0.3)
    # 3 chunks of 3, 3 and 4 elements: k = 1, 1, 2; 8 bytes a pair, 4 a value dense (k=2 of 4
    # pairs weigh 16 bytes, as the 4 values: dense).
    assert sparse_hierarchical.message_offsets(comp, 10, 3) == [0, 8, 16, 32]


# --------------------------------------------------------------------------------- device
def test_device_arrays_go_two_level_under_auto_and_match_the_host(thread_device):
    """On device arrays "auto" runs top-k two-level from two nodes (host arrays stay flat
    below HIERARCHICAL_MIN_NODES_COMPRESSED); the device's bits are the host's."""
    n, length = 4, 20_000
    xs = np.random.default_rng(3).standard_normal((n, length)).astype(np.float32)

    def job(put: Any) -> list[dict[str, np.ndarray]]:
        def body(comm):
            return {algorithm: thread_device.get(comm.allreduce(
                        put(xs[comm.rank]), compression=ringcomm.TopK(0.01),
                        algorithm=algorithm))
                    for algorithm in ("flat", "hierarchical", "auto")}
        return communicators(n, body, topology=2)

    on_device, on_host = job(thread_device.put), job(np.asarray)
    for per_rank in (on_device, on_host):
        for algorithm in ("flat", "hierarchical", "auto"):
            assert identical([r[algorithm] for r in per_rank])
        assert not identical([per_rank[0]["flat"], per_rank[0]["hierarchical"]])
    assert identical([on_device[0]["auto"], on_device[0]["hierarchical"]])
    assert identical([on_host[0]["auto"], on_host[0]["flat"]])
    for algorithm in ("flat", "hierarchical"):
        assert on_device[0][algorithm].tobytes() == on_host[0][algorithm].tobytes()


def test_device_top_k_the_sparse_path_does_not_take_stays_flat_under_auto(thread_device):
    """Device top-k calls that the sparse two-level path does not take (top-k's allgather;
    a ratio whose pairs outweigh the float32 values) keep the flat algorithm under "auto" at
    two nodes: the float32 node phases they would run instead pay only on many nodes."""
    n, length = 4, 20_000
    xs = np.random.default_rng(4).standard_normal((n, length)).astype(np.float32)
    comps = {"allgather": ringcomm.TopK(0.01, algorithm="allgather"), "dense": ringcomm.TopK(0.6)}

    def body(comm):
        return {(name, algorithm): thread_device.get(comm.allreduce(
                    thread_device.put(xs[comm.rank]), compression=comp, algorithm=algorithm))
                for name, comp in comps.items() for algorithm in ("flat", "hierarchical", "auto")}

    per_rank = communicators(n, body, topology=2)
    for name in comps:
        assert not sparse_hierarchical.applies_to_shape(2, 2, length, comps[name])
        for algorithm in ("flat", "hierarchical", "auto"):
            assert identical([r[(name, algorithm)] for r in per_rank])
        assert not identical([per_rank[0][(name, "flat")], per_rank[0][(name, "hierarchical")]])
        assert identical([per_rank[0][(name, "auto")], per_rank[0][(name, "flat")]])
