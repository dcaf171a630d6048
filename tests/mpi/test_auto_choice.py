"""compression="auto" under mpiexec: measured once, the same choice on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import gather_inputs, same_on_all_ranks

import ringcomm
from ringcomm.compress import LinkModel


def test_auto_measures_once_and_agrees(comm, world, rng):
    ef = ringcomm.ErrorFeedback()
    for n in (10, 100_000):
        g = rng.standard_normal(n).astype(np.float32)
        y = comm.allreduce(g, op="avg", compression="auto", feedback=ef, name=f"g{n}")
        assert same_on_all_ranks(world, y)
        exact = gather_inputs(world, g).astype(np.float64).mean(axis=0)
        assert np.linalg.norm(y - exact) <= 0.02 * np.linalg.norm(exact)
    figures = comm.auto_figures
    link = figures.links["host"]
    assert link.bandwidth > 0 and link.latency > 0
    assert world.allgather(link) == [link] * comm.size
    assert set(figures.throughput["host"]) == {"none", "BF16()", repr(ringcomm.Int8())}


def test_auto_with_topk_allowed(comm, world, rng):
    allowed = ringcomm.Auto((None, ringcomm.Int8(), ringcomm.TopK(0.01)))
    g = rng.standard_normal(50_000).astype(np.float32)
    choice = allowed.resolve(comm.transport, comm.auto_figures, g)
    assert world.allgather(repr(choice)) == [repr(choice)] * comm.size
    y = comm.allreduce(g, compression=allowed, feedback=ringcomm.ErrorFeedback(), name="g")
    assert same_on_all_ranks(world, y)


def test_auto_checks_do_not_depend_on_history(comm, rng):
    g = rng.standard_normal(1000)
    comm.allreduce(g.astype(np.float32), compression="auto")  # figures measured by now
    for _ in range(2):
        with pytest.raises(TypeError, match="compression needs a floating dtype"):
            comm.allreduce(np.ones(10, np.int32), op="max", compression="auto")


def test_auto_dense_choice_keeps_the_input_precision(comm, world):
    x = np.full(10, 1 + 1e-12)  # float64; "auto" picks dense for 80 bytes
    first = comm.allreduce(x, compression="auto", feedback=ringcomm.ErrorFeedback(), name="x")
    second = comm.allreduce(x, compression="auto")
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, comm.allreduce(x))


def test_auto_probes_are_not_counted(comm, rng):
    c = ringcomm.init("mpi", abort_on_exception=False)
    try:
        c.allreduce(rng.standard_normal(100).astype(np.float32), compression="auto")
        assert c.stats.calls == 1
    finally:
        c.close()


@pytest.mark.parametrize("figures", ["measured", "fixed"])
def test_auto_trials_differing_between_ranks_raise_on_every_rank(comm, world, rng, figures):
    """Auto(trials=1) on rank 0 and Auto(trials=5) elsewhere: the first call raises the same
    ArgumentMismatchError on every rank (it used to pass the agreement and deadlock when a
    trial call met the deciding exchange), whether the Auto resolves before the agreement
    (fixed figures) or after it (measured ones); then equal Autos work."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    fixed = {}
    if figures == "fixed":
        link = LinkModel(latency=1e-5, bandwidth=1e9)
        fixed = {"link": link, "throughput": {"none": 4e9, "FP16()": 3e9,
                                              repr(ringcomm.Int8()): 3.5e9}}

    def auto(trials: int) -> ringcomm.Auto:
        return ringcomm.Auto((None, ringcomm.FP16(), ringcomm.Int8()), trials=trials, **fixed)

    g = rng.standard_normal(200_000).astype(np.float32)
    mine = auto(1 if comm.rank == 0 else 5)
    with pytest.raises(ringcomm.ArgumentMismatchError, match="trials=1") as err:
        comm.allreduce(g, compression=mine, feedback=ringcomm.ErrorFeedback(), name="g")
    assert "trials=5" in str(err.value)
    messages = world.allgather(str(err.value))
    assert messages == [messages[0]] * comm.size
    same = auto(2)
    for _ in range(8):
        y = comm.allreduce(g, compression=same, feedback=ringcomm.ErrorFeedback(), name="h")
        assert same_on_all_ranks(world, y)


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_auto_dense_choice_keeps_a_16_bit_results_rounding(world, rng, dtype, op, algorithm):
    """A dense choice with error feedback keeps what rounding the 16-bit result lost, as
    every compressor does: results plus residuals equal the inputs to float32 rounding."""
    dt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else (
        np.dtype(dtype))
    size = world.Get_size()
    comm = ringcomm.init("mpi", abort_on_exception=False, algorithm=algorithm,
                         topology=2 if size % 2 == 0 and size > 2 else 1)
    try:
        dense = ringcomm.Auto((None,))  # its only candidate: send uncompressed
        ef = ringcomm.ErrorFeedback()
        sent = results = 0.0
        for _ in range(4):
            g = (rng.standard_normal(10_007) * 3).astype(dt)
            y = comm.allreduce(g, op=op, compression=dense, feedback=ef, name="g")
            assert y.dtype == dt and same_on_all_ranks(world, y)
            sent = sent + gather_inputs(world, g).astype(np.float64).sum(axis=0)
            results = results + y.astype(np.float64) * (size if op == "avg" else 1)
        kept = gather_inputs(world, ef.residual("g").astype(np.float64)).sum(axis=0)
        scale = np.abs(sent).max()
        assert np.abs(sent - results).max() > 1e-4 * scale  # rounding 16-bit results loses
        assert np.abs(sent - results - kept).max() <= 1e-6 * scale
    finally:
        comm.close()


def test_auto_never_turns_a_finite_gradient_into_inf(comm, world):
    """Gradients far beyond float16's range (65504) stay finite through every call of the
    default Auto, the calls that try its candidates included: its 16-bit cast is bfloat16,
    of float32's range (an FP16 trial call gave Inf, and NaN parameters after it)."""
    x = np.full(300_000, 1e5, np.float32) * (comm.rank + 1)
    exact = 1e5 * (comm.size + 1) / 2
    auto, ef = ringcomm.Auto(), ringcomm.ErrorFeedback()
    for _ in range(12):
        y = comm.allreduce(x, op="avg", compression=auto, feedback=ef, name="big")
        assert same_on_all_ranks(world, y)
        np.testing.assert_allclose(y, exact, rtol=0.02)
