"""compression="auto" under mpiexec: measured once, the same choice on every rank."""

from __future__ import annotations

import numpy as np
from mpi_helpers import gather_inputs, same_on_all_ranks

import ringcomm


def test_auto_measures_once_and_agrees(comm, world, rng):
    ef = ringcomm.ErrorFeedback()
    for n in (10, 100_000):
        g = rng.standard_normal(n).astype(np.float32)
        y = comm.allreduce(g, op="avg", compression="auto", feedback=ef, name=f"g{n}")
        assert same_on_all_ranks(world, y)
        exact = gather_inputs(world, g).astype(np.float64).mean(axis=0)
        assert np.linalg.norm(y - exact) <= 0.02 * np.linalg.norm(exact)
    figures = comm._auto_figures
    link = figures["link.host"]
    assert link.bandwidth > 0 and link.latency > 0
    assert world.allgather(link) == [link] * comm.size
    assert set(figures["host"]) == {"none", "FP16()", repr(ringcomm.Int8())}


def test_auto_with_topk_allowed(comm, world, rng):
    allowed = ringcomm.Auto((None, ringcomm.Int8(), ringcomm.TopK(0.01)))
    g = rng.standard_normal(50_000).astype(np.float32)
    choice = allowed.resolve(comm, g)
    assert world.allgather(repr(choice)) == [repr(choice)] * comm.size
    y = comm.allreduce(g, compression=allowed, feedback=ringcomm.ErrorFeedback(), name="g")
    assert same_on_all_ranks(world, y)
