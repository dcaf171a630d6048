"""The two-level allreduce (ringcomm.algorithms.hierarchical) over the in-process threads Transport.

Jobs of C nodes x L ranks: rank r is local rank r % L of node r // L. Results are compared bit
for bit across ranks and against NumPy in float64 (``thread_helpers.assert_matches_reference``:
the two-level schedule adds partial sums in another order than the flat ring, within the same
bound); compressed calls conserve the gradient mass with error feedback; NaN/Inf stay.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thread_helpers import (
    SEGMENT,
    assert_conserved,
    assert_matches_reference,
    communicators,
    identical,
    on_grid,
    rank_inputs,
    reference,
)

import ringcomm
from ringcomm.algorithms import compressed as algorithms
from ringcomm.algorithms import hierarchical
from ringcomm.algorithms.compressed_ring import mix_seed
from ringcomm.backends.threads import run_ranks
from ringcomm.comm import _twolevel, topology
from ringcomm.core.types import ArgumentMismatchError, InvalidArgumentError, ReduceOp

pytestmark = pytest.mark.timeout(120)

#: (nodes, ranks per node)
SHAPES = ((1, 1), (1, 4), (4, 1), (2, 2), (2, 3), (3, 2))
OPS = ("sum", "avg", "min", "max", "prod")
DTYPES = ("float32", "float64", "float16", "int32", "int64")
COMPRESSORS = {
    "int8-b64": ringcomm.Int8(block_size=64),
    "int8-b32-stochastic": ringcomm.Int8(block_size=32, stochastic=True, seed=5),
    "fp16": ringcomm.FP16(),
    "bf16": ringcomm.BF16(),
    "topk-ring": ringcomm.TopK(0.1, algorithm="ring"),
    "topk-allgather": ringcomm.TopK(0.1, algorithm="allgather"),
}
STEPS = 4


def lengths(n: int) -> list[int]:
    """0, 1, fewer than the ranks, uneven, and several segments per shard (SEGMENT)."""
    return sorted({0, 1, max(n - 1, 0), 7 * n + 3, 3001})


def cases_for(n: int, seed: int) -> list[tuple[str, str, np.ndarray]]:
    """(op, dtype, every rank's input) for every op, dtype and length."""
    rng = np.random.default_rng(seed)
    return [(op, dt, rank_inputs(rng, n, length, dt, op))
            for op in OPS for dt in DTYPES if not (op == "avg" and dt.startswith("int"))
            for length in lengths(n)]


# ----------------------------------------------------------------------------------- dense
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{c}x{lr}" for c, lr in SHAPES])
def test_dense_every_op_dtype_and_length(shape):
    n = shape[0] * shape[1]
    cases = cases_for(n, seed=n)

    def body(local, cross, rank):
        outs = []
        for op, _, xs in cases:
            out = np.full(xs.shape[1], 7, xs.dtype)
            hierarchical.allreduce(local, cross, xs[rank], out, ReduceOp(op),
                                   segment_bytes=SEGMENT)
            outs.append(out)
        return outs

    per_rank = on_grid(shape, body)
    for i, (op, dtype, xs) in enumerate(cases):
        ys = [outs[i] for outs in per_rank]
        assert identical(ys), f"{op} {dtype} length {xs.shape[1]}: ranks differ"
        assert_matches_reference(ys[0], xs, op)


def test_dense_in_place_and_input_untouched():
    xs = rank_inputs(np.random.default_rng(1), 6, 1001, "float32", "sum")

    def body(local, cross, rank):
        x = xs[rank].copy()
        y = np.empty_like(x)
        hierarchical.allreduce(local, cross, x, y, ReduceOp.AVG, segment_bytes=SEGMENT)
        assert x.tobytes() == xs[rank].tobytes()
        hierarchical.allreduce(local, cross, x, x, ReduceOp.AVG, segment_bytes=SEGMENT)
        return x, y

    per_rank = on_grid((3, 2), body)
    assert identical([x for x, _ in per_rank] + [y for _, y in per_rank])
    assert_matches_reference(per_rank[0][0], xs, "avg")


def test_avg_divides_by_the_whole_job_and_sums_in_float32():
    """16-bit sums that overflow float16 still average to a finite result (the partial sums
    are float32), and "avg" divides by nodes x ranks per node."""
    xs = np.full((4, 64), 60000, np.float16)

    def body(local, cross, rank):
        out = np.empty(64, np.float16)
        hierarchical.allreduce(local, cross, xs[rank], out, ReduceOp.AVG)
        return out

    per_rank = on_grid((2, 2), body)
    assert identical(per_rank)
    np.testing.assert_array_equal(per_rank[0], xs[0])


@settings(max_examples=25, deadline=None)
@given(nodes=st.integers(1, 3), per_node=st.integers(1, 3), length=st.integers(0, 2000),
       segment=st.integers(8, 2048), dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       seed=st.integers(0, 2**16))
def test_dense_property(nodes, per_node, length, segment, dtype, op, seed):
    if op == "avg" and dtype.startswith("int"):
        op = "sum"
    n = nodes * per_node
    xs = rank_inputs(np.random.default_rng(seed), n, length, dtype, op)

    def body(local, cross, rank):
        out = np.empty(length, xs.dtype)
        hierarchical.allreduce(local, cross, xs[rank], out, ReduceOp(op), segment_bytes=segment)
        return out

    ys = on_grid((nodes, per_node), body)
    assert identical(ys)
    assert_matches_reference(ys[0], xs, op)


# ------------------------------------------------------------------------------ compressed
def feedback_steps(shape, comp, op: str, xs: np.ndarray) -> list:
    """``len(xs)`` error-feedback steps (xs: steps x ranks x length); per rank: (results,
    final residual)."""

    def body(local, cross, rank):
        ef = ringcomm.ErrorFeedback()
        results = []
        for step, x in enumerate(xs):
            out = np.empty(x.shape[1], x.dtype)
            before = x[rank].tobytes()
            hierarchical.allreduce_with_feedback(
                local, cross, x[rank], out, ReduceOp(op), comp, ef, "w",
                mix_seed(step, rank), segment_bytes=SEGMENT)
            assert x[rank].tobytes() == before, "the input changed"
            results.append(out)
        return results, ef.residual("w")

    return on_grid(shape, body)


@pytest.mark.parametrize("comp", list(COMPRESSORS), ids=list(COMPRESSORS))
@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2), (1, 4), (4, 1)],
                         ids=["2x2", "2x3", "3x2", "1x4", "4x1"])
def test_compressed_identical_and_conserving(shape, comp):
    n = shape[0] * shape[1]
    rng = np.random.default_rng(n)
    for op in ("sum", "avg"):
        for length in (1, n - 1, 1000 + n):
            xs = rng.standard_normal((STEPS, n, length)).astype(np.float32)
            per_rank = feedback_steps(shape, COMPRESSORS[comp], op, xs)
            for step in range(STEPS):
                assert identical([res[step] for res, _ in per_rank]), f"step {step} differs"
            assert_conserved(per_rank, xs, op)
            if shape[0] == 1:  # one node: nothing lossy travels, nothing is left over
                assert all(not res.any() for _, res in per_rank)


@pytest.mark.parametrize("comp", ["int8-b64", "fp16", "topk-ring", "topk-allgather"])
def test_compressed_float16_conserving(comp):
    """16-bit results: the rounding into float16 goes to the residuals, once."""
    xs = np.random.default_rng(3).standard_normal((STEPS, 6, 700)).astype(np.float16)
    per_rank = feedback_steps((3, 2), COMPRESSORS[comp], "avg", xs)
    for step in range(STEPS):
        assert identical([res[step] for res, _ in per_rank])
    assert_conserved(per_rank, xs, "avg")


def test_residual_is_zero_outside_the_shard():
    """A rank's residual holds what its own part of the cross-node phase did not send."""
    xs = np.random.default_rng(4).standard_normal((1, 6, 999)).astype(np.float32)
    per_rank = feedback_steps((2, 3), COMPRESSORS["int8-b64"], "sum", xs)
    bounds = hierarchical.shard_bounds(999, 3)
    for rank, (_, residual) in enumerate(per_rank):
        lo, hi = bounds[rank % 3], bounds[rank % 3 + 1]
        assert not residual[:lo].any() and not residual[hi:].any()
        assert residual[lo:hi].any()


def test_residual_declared_within_the_shard_and_forgotten_when_handed_out():
    """After a compressed two-level call the residual is declared zero outside the rank's shard
    (so the next call lets the cross-node phase add it, instead of three passes over the whole
    array); handing the residual out (``residual()``) or to another algorithm (``take``)
    forgets the declaration."""
    x = np.random.default_rng(5).standard_normal((6, 999)).astype(np.float32)
    bounds = hierarchical.shard_bounds(999, 3)

    def body(local, cross, rank):
        ef = ringcomm.ErrorFeedback()
        assert ef.within("w") == (0, 0)  # nothing kept yet: zero everywhere
        out = np.empty(999, np.float32)
        hierarchical.allreduce_with_feedback(local, cross, x[rank], out, ReduceOp.SUM,
                                             COMPRESSORS["int8-b64"], ef, "w", rank,
                                             segment_bytes=SEGMENT)
        declared = ef.within("w")
        ef.residual("w")
        return declared, ef.within("w"), ef.holds("w")

    for rank, (declared, after, holds) in enumerate(on_grid((2, 3), body)):
        assert declared == (bounds[rank % 3], bounds[rank % 3 + 1])
        assert after is None and holds


@pytest.mark.parametrize("comp", ["int8-b64", "topk-ring", "fp16"])
def test_residual_written_by_its_holder_is_added_in_full(comp):
    """Mass a caller writes into a residual anywhere (outside the shard too) between two-level
    calls is taken by the next call (the dense two-level path sends all of it outside the
    shard; the sparse one, top-k's, keeps what it did not select), and conservation counts
    it."""
    rng = np.random.default_rng(6)
    xs = rng.standard_normal((2, 6, 700)).astype(np.float32)
    extra = rng.standard_normal((6, 700)).astype(np.float32)

    def body(local, cross, rank):
        ef = ringcomm.ErrorFeedback()
        results = []
        for step, x in enumerate(xs):
            out = np.empty(700, np.float32)
            hierarchical.allreduce_with_feedback(local, cross, x[rank], out, ReduceOp.SUM,
                                                 COMPRESSORS[comp], ef, "w", step * 6 + rank,
                                                 segment_bytes=SEGMENT)
            results.append(out)
            if step == 0:
                ef.residual("w")[...] += extra[rank]  # everywhere, not only the shard
        return results, ef.residual("w")

    per_rank = on_grid((3, 2), body)
    assert all(identical([res[s] for res, _ in per_rank]) for s in range(2))
    assert_conserved(per_rank, np.concatenate([xs, extra[None]]), "sum")
    if comp == "topk-ring":
        return
    bounds = hierarchical.shard_bounds(700, 2)
    for rank, (_, residual) in enumerate(per_rank):
        lo, hi = bounds[rank % 2], bounds[rank % 2 + 1]
        assert not residual[:lo].any() and not residual[hi:].any(), "mass left behind"


@pytest.mark.parametrize("comp", ["int8-b64", "int8-b32-stochastic", "fp16", "topk-ring",
                                  "topk-allgather", None])
def test_nonfinite_stays_nonfinite(comp):
    n = 6
    xs = np.random.default_rng(5).standard_normal((2, n, 500)).astype(np.float32)
    poisoned = {3: np.nan, 100: np.inf, 257: -np.inf, 420: np.nan}
    for i, v in poisoned.items():
        xs[0, i % n, i] = v
    per_rank = feedback_steps((3, 2), None if comp is None else COMPRESSORS[comp], "avg", xs)
    first = [res[0] for res, _ in per_rank]
    assert identical(first)
    for i in poisoned:
        assert not np.isfinite(first[0][i]), f"element {i} became {first[0][i]}"
    for results, residual in per_rank:
        # A non-finite residual would poison every later step.
        assert residual is None or np.isfinite(residual).all()
        assert np.isfinite(results[1]).all()


@pytest.mark.parametrize("comp", ["topk-ring", "topk-allgather"])
def test_more_nonfinite_than_topk_sends_stays_nonfinite(comp):
    """120 NaN and Inf of 500 entries on one rank, more than any selection's k: the overflow
    mark makes each chunk that holds them NaN, in the node-local phases as in the cross-node
    ring, so every one of them is non-finite in the result, the same on every rank."""
    n = 6
    xs = np.random.default_rng(6).standard_normal((2, n, 500)).astype(np.float32)
    bad = np.arange(1, 500, 4)[:120]
    xs[0, 0, bad] = np.where(bad % 3 == 0, np.nan, np.inf)
    per_rank = feedback_steps((3, 2), COMPRESSORS[comp], "avg", xs)
    first = [res[0] for res, _ in per_rank]
    assert identical(first)
    assert not np.isfinite(first[0][bad]).any(), np.flatnonzero(np.isfinite(first[0][bad]))
    for results, residual in per_rank:
        assert np.isfinite(residual).all()
        assert np.isfinite(results[1]).all()


@pytest.mark.parametrize("shape", [(2, 2), (4, 2)], ids=["2x2", "4x2"])
def test_int8_error_lower_than_flat(shape):
    """Two levels re-quantize (nodes - 1) times instead of (ranks - 1): a smaller error than
    the flat int8 ring on the same inputs (measured: 0.75 of the flat ring's RMS error)."""
    n = shape[0] * shape[1]
    xs = np.random.default_rng(n).standard_normal((n, 8192)).astype(np.float32)
    comp = ringcomm.Int8(block_size=64)

    def body(local, cross, rank):
        two = np.empty(8192, np.float32)
        hierarchical.allreduce(local, cross, xs[rank], two, ReduceOp.SUM, comp, seed=rank)
        return two

    def flat_body(t):
        out = np.empty(8192, np.float32)
        algorithms.allreduce(t, xs[t.rank], out, ReduceOp.SUM, comp, None, None, t.rank)
        return out

    exact = reference(xs, "sum")
    two = on_grid(shape, body)[0]
    flat = run_ranks(n, flat_body)[0]

    def rms(y: np.ndarray) -> float:
        return float(np.sqrt(np.mean((y - exact) ** 2)))

    assert rms(two) < 0.9 * rms(flat), (rms(two), rms(flat))


def test_compressor_that_needs_shapes_is_refused():
    """What a compressor declares (``shardable``) decides, not the name of its allreduce."""
    for comp in (_WholeArrayOnly(), ringcomm.PowerSGD(rank=1)):
        with pytest.raises(ValueError, match="cannot compress"):
            hierarchical.check_compressor(comp)
    for comp in (ringcomm.Int8(), ringcomm.FP16(), ringcomm.BF16(), ringcomm.TopK(0.01),
                 ringcomm.TopK(0.01, algorithm="allgather"), None):
        hierarchical.check_compressor(comp)


class _WholeArrayOnly(ringcomm.FP16):
    """An FP16 whose payload would depend on the whole array (as a shape-aware one's does)."""

    shardable = False


# -------------------------------------------------------------------------------- topology
def test_topology_blocks_and_host_names():
    def body(t):
        blocks = topology.detect(t, 2)
        hosts = topology.detect(t, "auto")
        return blocks, hosts, blocks.node_of(t.rank), blocks.local_rank(t.rank)

    per_rank = run_ranks(5, body)
    blocks, hosts, _, _ = per_rank[0]
    assert blocks.nodes == ((0, 1), (2, 3), (4,)) and not blocks.uniform
    assert "3 nodes of 2, 2, 1 ranks (2 ranks per node)" == blocks.describe()
    assert [(node, lr) for _, _, node, lr in per_rank] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert hosts.nodes == ((0, 1, 2, 3, 4),) and hosts.uniform  # one host: one node
    assert all(p[0] == blocks and p[1] == hosts for p in per_rank)


def test_topology_differing_between_ranks_fails_alike():
    def body(t):
        with pytest.raises(ArgumentMismatchError) as err:
            topology.detect(t, 2 if t.rank else "auto")
        return str(err.value)

    messages = run_ranks(3, body)
    assert len(set(messages)) == 1 and "topology differs between ranks" in messages[0]


def test_topology_settings_and_environment(monkeypatch):
    monkeypatch.delenv(topology.RANKS_PER_NODE_ENV, raising=False)
    assert topology.resolve_topology("auto") == "auto"
    assert topology.resolve_topology(np.int64(4)) == 4
    for bad, error in ((0, ValueError), ("nodes", ValueError), (2.0, TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="topology"):
            topology.check_topology(bad)
    monkeypatch.setenv(topology.RANKS_PER_NODE_ENV, "8")
    assert topology.resolve_topology("auto") == 8
    assert topology.resolve_topology(2) == 2  # an explicit number wins
    monkeypatch.setenv(topology.RANKS_PER_NODE_ENV, "eight")
    with pytest.raises(ValueError, match=r"RINGCOMM_RANKS_PER_NODE must be .* got 'eight'"):
        topology.resolve_topology("auto")


def test_algorithm_settings_and_environment(monkeypatch):
    monkeypatch.delenv(_twolevel.ALGORITHM_ENV, raising=False)
    assert _twolevel.resolve_algorithm(None) == "auto"
    assert _twolevel.resolve_algorithm("flat") == "flat"
    monkeypatch.setenv(_twolevel.ALGORITHM_ENV, "Hierarchical")
    assert _twolevel.resolve_algorithm(None) == "hierarchical"
    monkeypatch.setenv(_twolevel.ALGORITHM_ENV, "tree")
    with pytest.raises(ValueError, match=r"RINGCOMM_ALGORITHM must be one of .* got 'tree'"):
        _twolevel.resolve_algorithm(None)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        _twolevel.check_algorithm("ring")
    with pytest.raises(TypeError, match="algorithm must be one of"):
        _twolevel.check_algorithm(2)


def test_init_options(monkeypatch):
    pytest.importorskip("mpi4py")
    for name in (_twolevel.ALGORITHM_ENV, topology.RANKS_PER_NODE_ENV):
        monkeypatch.delenv(name, raising=False)
    with ringcomm.init("mpi", abort_on_exception=False) as comm:
        assert (comm.algorithm, comm.topology) == ("auto", "auto")
    with ringcomm.init("mpi", abort_on_exception=False, algorithm="flat", topology=4) as comm:
        assert (comm.algorithm, comm.topology) == ("flat", 4)
    monkeypatch.setenv(_twolevel.ALGORITHM_ENV, "hierarchical")
    monkeypatch.setenv(topology.RANKS_PER_NODE_ENV, "2")
    with ringcomm.init("mpi", abort_on_exception=False) as comm:
        assert (comm.algorithm, comm.topology) == ("hierarchical", 2)
        x = np.arange(300_000, dtype=np.float32)
        np.testing.assert_array_equal(comm.allreduce(x, op="avg"), x)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        ringcomm.init("mpi", abort_on_exception=False, algorithm="ring")
    with pytest.raises(TypeError, match="topology must be"):
        ringcomm.init("mpi", abort_on_exception=False, topology=2.5)


def test_horovod_hierarchical_variable(monkeypatch):
    pytest.importorskip("torch")
    from ringcomm.torch.horovod import _lifecycle

    monkeypatch.delenv("HOROVOD_HIERARCHICAL_ALLREDUCE", raising=False)
    assert _lifecycle._algorithm_from_env() is None
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    assert _lifecycle._algorithm_from_env() == "hierarchical"
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "0")
    assert _lifecycle._algorithm_from_env() == "flat"
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe")
    with pytest.raises(ValueError, match="HOROVOD_HIERARCHICAL_ALLREDUCE"):
        _lifecycle._algorithm_from_env()


# ---------------------------------------------------------------------------- communicator
def test_communicator_algorithms_agree_with_flat():
    big = 300_000  # 1.2 MB: "auto" goes two-level
    xs = rank_inputs(np.random.default_rng(6), 4, big, "float32", "sum")

    def body(comm):
        return {algorithm: comm.allreduce(xs[comm.rank], op="avg", algorithm=algorithm)
                for algorithm in ("flat", "hierarchical", "auto")}

    per_rank = communicators(4, body, topology=2)
    for algorithm in ("flat", "hierarchical", "auto"):
        ys = [r[algorithm] for r in per_rank]
        assert identical(ys)
        assert_matches_reference(ys[0], xs, "avg")
    # The two schedules add in different orders (bits differ somewhere); "auto" is two-level.
    ys = per_rank[0]
    assert identical([ys["auto"], ys["hierarchical"]])
    assert not identical([ys["flat"], ys["hierarchical"]])


def test_communicator_default_algorithm_and_small_calls():
    """The default comes from the communicator; "auto" keeps small dense calls flat, without
    making the topology (no exchange beyond the call's own)."""
    xs = rank_inputs(np.random.default_rng(7), 4, 20_000, "float32", "sum")

    def body(comm):
        comm.stats.reset()
        y = comm.allreduce(xs[comm.rank])
        auto_bytes = comm.stats.bytes_sent
        made = comm._two_level.topology
        comm.algorithm = "flat"
        comm.stats.reset()
        z = comm.allreduce(xs[comm.rank])
        return y, z, auto_bytes, comm.stats.bytes_sent, made

    per_rank = communicators(4, body, topology=2)
    assert identical([r[0] for r in per_rank] + [r[1] for r in per_rank])
    assert all(r[2] == r[3] and r[4] is None for r in per_rank)


@pytest.mark.parametrize("comp, length, min_nodes, expect_two_level", [
    ("int8", 5000, 64, False),  # encoded, below HIERARCHICAL_MIN_BYTES: flat
    ("int8", 300_000, 64, True),  # encoded, 1.2 MB on 2 nodes: two-level
    ("topk", 300_000, 64, False),  # sparse: only from HIERARCHICAL_MIN_NODES_COMPRESSED
    ("topk", 5000, 2, True),  # sparse, that many nodes: two-level at any size
])
def test_communicator_auto_compressed_two_level_where_it_helps(monkeypatch, comp, length,
                                                                min_nodes, expect_two_level):
    """Under "auto" a call through a compressor that encodes every element goes two-level
    from HIERARCHICAL_MIN_BYTES on 2 nodes or more, as a dense call does; a sparse one only on
    HIERARCHICAL_MIN_NODES_COMPRESSED nodes or more (below that its flat ring measured and
    simulated faster)."""
    monkeypatch.setattr(_twolevel, "HIERARCHICAL_MIN_NODES_COMPRESSED", min_nodes)
    xs = rank_inputs(np.random.default_rng(12), 4, length, "float32", "sum")
    compressor = {"int8": ringcomm.Int8(), "topk": ringcomm.TopK(0.01)}[comp]

    def body(comm):
        return {algorithm: comm.allreduce(xs[comm.rank], compression=compressor,
                                          algorithm=algorithm)
                for algorithm in ("flat", "hierarchical", "auto")}

    per_rank = communicators(4, body, topology=2)
    ys = per_rank[0]
    assert identical([r["auto"] for r in per_rank])
    assert not identical([ys["flat"], ys["hierarchical"]])
    assert identical([ys["auto"], ys["hierarchical" if expect_two_level else "flat"]])


def test_communicator_auto_int8_on_device_arrays_stays_flat_below_64_nodes(thread_device):
    """On device arrays (the GPU emulator) "auto" keeps an Int8 call flat on 2 nodes, where it
    runs the same call on host arrays two-level (HIERARCHICAL_MIN_NODES_ENCODED_DEVICE)."""
    xs = rank_inputs(np.random.default_rng(13), 4, 300_000, "float32", "sum")

    def job(put):
        def body(comm):
            return {algorithm: thread_device.get(comm.allreduce(
                        put(xs[comm.rank]), compression=ringcomm.Int8(), algorithm=algorithm))
                    for algorithm in ("flat", "hierarchical", "auto")}
        return communicators(4, body, topology=2)

    on_device, on_host = job(thread_device.put), job(np.asarray)
    assert not identical([on_device[0]["flat"], on_device[0]["hierarchical"]])
    assert identical([r["auto"] for r in on_device] + [on_device[0]["flat"]])
    assert identical([r["auto"] for r in on_host] + [on_host[0]["hierarchical"]])


def test_communicator_compressed_hierarchical_conserves():
    rng = np.random.default_rng(8)
    xs = rng.standard_normal((STEPS, 6, 5000)).astype(np.float32)

    def body(comm):
        ef = ringcomm.ErrorFeedback()
        results = [comm.allreduce(x[comm.rank], op="avg", compression=ringcomm.Int8(),
                                  feedback=ef, name="w") for x in xs]
        return results, ef.residual("w")

    per_rank = communicators(6, body, topology=2, algorithm="hierarchical")
    for step in range(STEPS):
        assert identical([res[step] for res, _ in per_rank])
    assert_conserved(per_rank, xs, "avg")


def test_communicator_auto_compression_hierarchical():
    xs = np.random.default_rng(9).standard_normal((4, 50_000)).astype(np.float32)

    def body(comm):
        ef = ringcomm.ErrorFeedback()
        y = comm.allreduce(xs[comm.rank], op="avg", compression="auto", feedback=ef, name="w",
                           algorithm="hierarchical")
        return y, ef.residual("w")

    per_rank = communicators(4, body, topology=2)
    assert identical([y for y, _ in per_rank])
    assert_conserved([([y], res if res is not None else np.zeros(50_000, np.float32))
                      for y, res in per_rank], xs[None], "avg")


def test_changing_the_topology_makes_new_groups():
    xs = rank_inputs(np.random.default_rng(10), 4, 5000, "float32", "sum")

    def body(comm):
        results = []
        for per_node in (2, 1, 4):
            comm.topology = per_node  # every rank at the same point
            results.append(comm.allreduce(xs[comm.rank], algorithm="hierarchical"))
            topo = comm._two_level.topology
            assert topo is not None and topo.local_size == per_node
        return results

    per_rank = communicators(4, body)
    for i in range(3):
        assert identical([r[i] for r in per_rank])
        assert_matches_reference(per_rank[0][i], xs, "sum")


def test_mismatched_algorithm_fails_alike_and_the_communicator_survives():
    x = np.ones(5000, np.float32)

    def body(comm):
        with pytest.raises(ArgumentMismatchError) as err:
            comm.allreduce(x, algorithm="hierarchical" if comm.rank == 1 else "flat")
        with pytest.raises(InvalidArgumentError, match="algorithm must be one of"):
            comm.allreduce(x, algorithm="tree" if comm.rank == 2 else "auto")
        return str(err.value), err.value.differences, comm.allreduce(x, algorithm="auto")

    per_rank = communicators(4, body, topology=2)
    message, differences, _ = per_rank[0]
    assert all(m == message for m, _, _ in per_rank)
    assert "algorithm differs between ranks: flat on ranks 0, 2, 3; hierarchical on rank 1" \
        in message
    assert differences == {"algorithm": ("flat", "hierarchical", "flat", "flat")}
    assert all((y == 4).all() for _, _, y in per_rank)


def test_uneven_nodes_refuse_hierarchical_and_auto_goes_flat():
    x = np.ones(5000, np.float32)

    def body(comm):
        with pytest.raises(InvalidArgumentError) as err:
            comm.allreduce(x, algorithm="hierarchical")
        ef = ringcomm.ErrorFeedback()
        y = comm.allreduce(x, compression=ringcomm.Int8(), feedback=ef, name="w")  # auto
        return str(err.value), y

    per_rank = communicators(5, body, topology=2)
    messages = {m for m, _ in per_rank}
    assert len(messages) == 1
    assert "needs the same number of ranks on every node, got 3 nodes of 2, 2, 1" in \
        messages.pop()
    assert identical([y for _, y in per_rank]) and np.allclose(per_rank[0][1], 5, rtol=1e-2)
