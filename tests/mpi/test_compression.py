"""Compressed allreduce: identical results, conservation of gradient mass, accuracy, NaN/Inf."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import gather_inputs, same_on_all_ranks

import ringcomm
from ringcomm.ops import numpy as ops

COMPRESSORS = {
    "fp16": ringcomm.FP16(),
    "bf16": ringcomm.BF16(),
    "int8": ringcomm.Int8(),
    "int8-b100-stoch": ringcomm.Int8(block_size=100, stochastic=True, seed=1),
    "topk-ring": ringcomm.TopK(0.01),
    "topk-ring-approx": ringcomm.TopK(0.05, approximate=True),
    "topk-ring-dense": ringcomm.TopK(0.6),  # every chunk dearer sparse than dense
    "topk-allgather": ringcomm.TopK(0.01, algorithm="allgather"),
}


def lengths(size: int) -> list[int]:
    return sorted({0, 1, max(size - 1, 1), size + 1, 255, 257, 10_007})


@pytest.fixture(params=list(COMPRESSORS), ids=list(COMPRESSORS))
def comp(request):
    return COMPRESSORS[request.param]


def total(world, a: np.ndarray) -> np.ndarray:
    """Sum of ``a`` over ranks, in float64."""
    return gather_inputs(world, np.asarray(a, dtype=np.float64)).sum(axis=0)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_conservation_over_30_steps(comm, world, rng, comp, op):
    """(sum of results) + (sum of residuals) == (sum of inputs): no gradient mass is lost."""
    n = 4099
    ef = ringcomm.ErrorFeedback()
    inputs = np.zeros(n)
    results = np.zeros(n)
    magnitude = np.zeros(n)
    for _ in range(30):
        g = rng.standard_normal(n).astype(np.float32)
        y = comm.allreduce(g, op=op, compression=comp, feedback=ef, name="w")
        assert y.dtype == np.float32 and same_on_all_ranks(world, y)
        inputs += total(world, g)
        results += y * (comm.size if op == "avg" else 1)
        magnitude += total(world, np.abs(g))
    lhs = results + total(world, ef.residual("w"))
    # float32 rounding of every addition along the way, and nothing more.
    np.testing.assert_allclose(lhs, inputs, rtol=0, atol=1e-5 * magnitude.max())
    if comm.size > 1:
        assert np.abs(ef.residual("w")).max() > 0 or isinstance(comp, ringcomm.TopK)


def test_every_length(comm, world, rng, comp):
    for n in lengths(comm.size):
        ef = ringcomm.ErrorFeedback()
        g = rng.standard_normal(n).astype(np.float32)
        y = comm.allreduce(g, compression=comp, feedback=ef, name=f"n{n}")
        assert y.shape == (n,)
        assert same_on_all_ranks(world, y)
        res = ef.residual(f"n{n}")
        np.testing.assert_allclose(y + total(world, res), total(world, g), rtol=0,
                                   atol=1e-5 * (1 + np.abs(total(world, g)).max(initial=0)))


def test_shapes_and_dtypes_kept(comm, world, rng, comp):
    for dtype in ("float16", "float32", "float64"):
        x = rng.standard_normal((31, 17)).astype(dtype)
        y = comm.allreduce(x, op="avg", compression=comp)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert same_on_all_ranks(world, y)
        out = np.empty_like(x)
        assert comm.allreduce(x, out=out, compression=comp) is out


def test_int8_one_step_error_below_two_percent(comm, world, rng):
    g = rng.standard_normal(1 << 18).astype(np.float32)
    y = comm.allreduce(g, compression=ringcomm.Int8())
    exact = total(world, g)
    rel = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert rel < 0.02, rel


@pytest.mark.parametrize("approximate", [False, True])
def test_topk_allgather_is_the_exact_sum_of_the_selected(comm, world, rng, approximate):
    n, comp = 50_000, ringcomm.TopK(0.01, algorithm="allgather", approximate=approximate)
    g = rng.standard_normal(n).astype(np.float32)
    ef = ringcomm.ErrorFeedback()
    y = comm.allreduce(g, compression=comp, feedback=ef, name="g")
    # What a rank selected is its input minus what it kept: exact, entry by entry.
    selected = g - ef.residual("g")
    if comm.size > 1:
        assert np.count_nonzero(selected) == comp.k_for(n)
    if not approximate and comm.size > 1:
        idx, _ = ops.topk(g, comp.k_for(n))
        np.testing.assert_array_equal(np.flatnonzero(selected), idx)
    expected = total(world, selected)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    if comm.size > 1:
        assert np.count_nonzero(y) <= comm.size * comp.k_for(n)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk-ring", "topk-allgather"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_never_becomes_finite(comm, world, rng, name, bad):
    comp = COMPRESSORS[name]
    ef = ringcomm.ErrorFeedback()
    g = rng.standard_normal(5000).astype(np.float32)
    if comm.rank == comm.size - 1:
        g[1234] = bad
    y = comm.allreduce(g, compression=comp, feedback=ef, name="w")
    assert not np.isfinite(y[1234])
    assert same_on_all_ranks(world, y)
    assert np.isfinite(ef.residual("w")).all()  # the next steps are not poisoned
    clean = comm.allreduce(rng.standard_normal(5000).astype(np.float32), compression=comp,
                           feedback=ef, name="w")
    assert np.isfinite(clean).all()


@pytest.mark.parametrize("name", ["topk-ring", "topk-ring-approx", "topk-allgather"])
@pytest.mark.parametrize("where", ["last-rank", "every-rank"])
def test_more_non_finite_entries_than_topk_sends_stay_non_finite(comm, world, rng, name, where):
    """454 NaN and Inf in 5000 entries, more than any chunk's k: a selection that cannot carry
    them all sends the overflow mark, so every one of them is non-finite in the result (its
    whole chunk is NaN), the same on every rank; the residuals stay finite."""
    comp = COMPRESSORS[name]
    ef = ringcomm.ErrorFeedback()
    g = rng.standard_normal(5000).astype(np.float32)
    bad = np.arange(7, 5000, 11)
    if where == "every-rank" or comm.rank == comm.size - 1:
        g[bad] = np.where(bad % 2 == 1, np.nan, -np.inf)
    y = comm.allreduce(g, compression=comp, feedback=ef, name="w")
    assert not np.isfinite(y[bad]).any(), np.flatnonzero(np.isfinite(y[bad]))[:10]
    assert same_on_all_ranks(world, y)
    assert np.isfinite(ef.residual("w")).all()
    clean = comm.allreduce(rng.standard_normal(5000).astype(np.float32), compression=comp,
                           feedback=ef, name="w")
    assert np.isfinite(clean).all() and same_on_all_ranks(world, clean)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk-ring", "topk-allgather"])
def test_float32_extremes_do_not_poison_the_next_steps(comm, world, rng, name):
    """+-FLT_MAX on one rank: whatever the call gives there (int8's codes +-127 of FLT_MAX /
    127 decode to Inf, as bf16 and fp16 round it to Inf), every residual stays finite and the
    next call, on ordinary values, is finite everywhere and the same on every rank."""
    comp = COMPRESSORS[name]
    ef = ringcomm.ErrorFeedback()
    g = np.zeros(64, np.float32)
    if comm.rank == 0:
        g[0] = -np.finfo(np.float32).max
    if comm.rank == comm.size - 1:
        g[33] = np.finfo(np.float32).max
    first = comm.allreduce(g, compression=comp, feedback=ef, name="w")
    residual_finite = bool(np.isfinite(ef.residual("w")).all())
    after = comm.allreduce(np.ones(64, np.float32), compression=comp, feedback=ef, name="w")
    assert same_on_all_ranks(world, first) and same_on_all_ranks(world, after)
    assert residual_finite and np.isfinite(after).all(), (first, after)


def test_wire_bytes(comm, world, rng):
    if comm.size == 1:
        pytest.skip("nothing goes on the wire in a single process")
    g = rng.standard_normal(1 << 20).astype(np.float32)

    def sent(**kw) -> int:
        comm.stats.reset()
        comm.allreduce(g, **kw)
        return world.allreduce(comm.stats.bytes_sent, op=MPI.SUM)

    dense = sent()
    assert dense / sent(compression=ringcomm.Int8()) >= 3.9
    assert dense / sent(compression=ringcomm.FP16()) >= 1.99
    assert dense / sent(compression=ringcomm.TopK(0.01)) >= 25
    # The sparse ring approaches 2k(n-1)/n pairs per rank; the allgather moves (n-1)k.
    ring = sent(compression=ringcomm.TopK(0.01))
    gather = sent(compression=ringcomm.TopK(0.01, algorithm="allgather"))
    assert ring <= gather or comm.size == 2


def test_compression_errors_on_every_rank(comm):
    x = np.ones(100, np.float32)
    with pytest.raises(TypeError, match="compression needs a floating dtype, got int32"):
        comm.allreduce(np.ones(100, np.int32), compression=ringcomm.Int8())
    with pytest.raises(ValueError, match="supports op 'sum' and 'avg', got 'max'"):
        comm.allreduce(x, op="max", compression=ringcomm.Int8())
    with pytest.raises(ValueError, match="feedback needs name="):
        comm.allreduce(x, compression=ringcomm.Int8(), feedback=ringcomm.ErrorFeedback())
    with pytest.raises(ValueError, match="feedback needs a lossy compression"):
        comm.allreduce(x, feedback=ringcomm.ErrorFeedback(), name="x")
    with pytest.raises(TypeError, match="compression must be a ringcomm compressor"):
        comm.allreduce(x, compression="int8")
    if comm.size > 1:
        comp = ringcomm.Int8() if comm.rank else ringcomm.FP16()
        with pytest.raises(ValueError, match="compression/name differs between ranks"):
            comm.allreduce(x, compression=comp)
        with pytest.raises(ValueError, match="compression/name differs"):
            comm.allreduce(x, compression=ringcomm.Int8(), feedback=ringcomm.ErrorFeedback(),
                           name=f"w{comm.rank}")
    np.testing.assert_array_equal(comm.allreduce(x, compression=ringcomm.FP16()),
                                  np.full(100, comm.size, np.float32))


@pytest.mark.parametrize("name", ["int8", "topk-ring", "topk-allgather", "bf16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_conservation_with_float16_tensors(comm, world, rng, name, op):
    """The owner's rounding of a 16-bit result into its dtype goes to the residual too."""
    comp, ef, n = COMPRESSORS[name], ringcomm.ErrorFeedback(), 3001
    inputs, results, magnitude = np.zeros(n), np.zeros(n), np.zeros(n)
    for _ in range(6):
        g = rng.standard_normal(n).astype(np.float16)
        y = comm.allreduce(g, op=op, compression=comp, feedback=ef, name="h")
        assert y.dtype == np.float16 and same_on_all_ranks(world, y)
        inputs += total(world, g)
        results += y.astype(np.float64) * (comm.size if op == "avg" else 1)
        magnitude += total(world, np.abs(g.astype(np.float64)))
    np.testing.assert_allclose(results + total(world, ef.residual("h")), inputs, rtol=0,
                               atol=1e-5 * magnitude.max())
