"""The simulated-clock transport of bench/sim_transport.py and its model (bench/sim_model.py):
the clock of a ring against the textbook formula, results identical to the plain thread
backend, the NIC sharing model, compute charging, and the closed forms against the simulation."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import scale_sim_jobs  # noqa: E402
import sim_formulas  # noqa: E402
from sim_costs import cpu_costs, gpu_costs  # noqa: E402
from sim_model import CostModel, LinkModel, ring_time  # noqa: E402
from sim_transport import run_sim  # noqa: E402

import ringcomm  # noqa: E402
from ringcomm import ops as _ops  # noqa: E402
from ringcomm.algorithms import hierarchical, ring  # noqa: E402
from ringcomm.algorithms.compressed import ALGORITHMS  # noqa: E402
from ringcomm.backends.threads import run_ranks  # noqa: E402
from ringcomm.core.types import ReduceOp  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _dense(t, length, seg=1 << 30):
    x = np.arange(length, dtype=np.float32) * (t.rank + 1)
    out = np.empty_like(x)
    ring.allreduce(t, x, out, ReduceOp.SUM, segment_bytes=seg)
    return out


@pytest.mark.parametrize("n,per_node", [(3, 1), (5, 1), (8, 1), (6, 6)])
def test_flat_dense_ring_clock_matches_closed_form(n, per_node):
    alpha, bw, scale, length = 7e-6, 2e9, 500.0, 240 * n
    links = LinkModel(ranks_per_node=per_node, intra_bw=bw, intra_alpha=alpha, inter_bw=bw,
                      inter_alpha=alpha, scale=scale)
    sim = run_sim(n, lambda t: _dense(t, length), links)
    expected = ring_time(n, 4 * length * scale, alpha, bw)
    assert sim.time == pytest.approx(expected, rel=0.02)
    assert sim.time > 0.5 * expected  # not trivially satisfied by a zero clock
    exact = np.arange(length, dtype=np.float32) * sum(range(1, n + 1))
    assert all(np.array_equal(r, exact) for r in sim.results)


def _compressed_job(comp, hier, split):
    """Every rank's (result, residual) of one call of ``comp`` (flat or hierarchical)."""
    def job(t):
        x = scale_sim_jobs.gradients(t.rank, 1000, seed=3)
        out = np.empty_like(x)
        residual = np.zeros(x.size, np.float32) if comp is not None else None
        if hier:
            local, cross = split(t)
            hierarchical.allreduce(local, cross, x, out, ReduceOp.SUM, comp, residual, t.rank,
                                   segment_bytes=512)
        elif comp is None:
            ring.allreduce(t, x, out, ReduceOp.SUM, segment_bytes=512)
        else:
            ALGORITHMS[comp.allreduce_algorithm](t, x, out, ReduceOp.SUM, comp, residual,
                                                 t.rank, segment_bytes=512)
        return out, residual
    return job


def _split(t):
    node, local_rank = divmod(t.rank, 3)
    return t.split(node, t.rank), t.split(local_rank, t.rank)


@pytest.mark.parametrize("hier", [False, True])
@pytest.mark.parametrize("comp", [None, ringcomm.Int8(block_size=64), ringcomm.TopK(0.05),
                                  ringcomm.TopK(0.05, "allgather"), ringcomm.FP16()],
                         ids=["dense", "int8", "topk-ring", "topk-allgather", "fp16"])
def test_simulator_does_not_change_results(comp, hier):
    links = LinkModel(ranks_per_node=3, scale=1000.0)
    job = _compressed_job(comp, hier, _split)
    plain = run_ranks(6, job, timeout=30)
    sim = run_sim(6, job, links, gpu_costs(), timeout=30)
    assert sim.time > 0
    for (a, ra), (b, rb) in zip(plain, sim.results, strict=True):
        assert np.array_equal(a, b)
        assert (ra is None and rb is None) or np.array_equal(ra, rb)


def test_node_nic_is_shared_and_intra_links_are_not():
    """Four ranks of node 0 send to node 1 at once: their messages queue on the NIC (first
    come, first served); four intra-node messages at the same time do not queue."""
    nbytes, alpha, bw = 1000, 3e-6, 1e9
    links = LinkModel(ranks_per_node=4, intra_bw=10 * bw, intra_alpha=1e-6, inter_bw=bw,
                      inter_alpha=alpha)

    def job(t):
        buf = np.zeros(nbytes, np.uint8)
        if t.rank < 4:  # cross-node sends, then one intra-node exchange in a ring of 4
            t.isendrecv(buf, t.rank + 4, None, 0).wait()
        else:
            t.isendrecv(None, 0, buf, t.rank - 4).wait()
        arrived = t.now()
        node = 4 * (t.rank // 4)
        mine = node + (t.rank + 1) % 4
        left = node + (t.rank - 1) % 4
        t.barrier()
        start = t.now()
        t.isendrecv(buf, mine, buf.copy(), left).wait()
        return arrived, t.now() - start

    res = run_sim(8, job, links).results
    d = nbytes / bw
    cross = sorted(a for a, _ in res[4:])
    assert cross == pytest.approx([alpha + j * d for j in (1, 2, 3, 4)])
    intra = [dt for _, dt in res]
    assert intra == pytest.approx([1e-6 + nbytes / (10 * bw)] * 8)


def test_nic_is_full_duplex():
    links = LinkModel(ranks_per_node=1, inter_bw=1e9, inter_alpha=2e-6)

    def job(t):
        other = 1 - t.rank
        t.isendrecv(np.zeros(5000, np.uint8), other, np.zeros(5000, np.uint8), other).wait()
        return t.now()

    assert run_sim(2, job, links).results == pytest.approx([2e-6 + 5e-6] * 2)


def test_messages_into_one_node_queue_on_its_nic():
    """Two nodes send to a third at once: the receiving NIC takes one message after the
    other."""
    links = LinkModel(ranks_per_node=1, inter_bw=1e9, inter_alpha=2e-6)

    def job(t):
        buf = np.zeros(4000, np.uint8)
        if t.rank < 2:
            t.isendrecv(buf, 2, None, 0).wait()
            return None
        first, second = buf.copy(), buf.copy()
        a = t.isendrecv(None, 0, first, 0)
        b = t.isendrecv(None, 0, second, 1)
        a.wait()
        b.wait()
        return t.now()

    assert run_sim(3, job, links).results[2] == pytest.approx(2e-6 + 2 * 4e-6)


def test_compute_is_charged_per_operation():
    cost = CostModel({"reduce": 2e-9}, fixed=1e-6, scale=10.0)

    def job(t):
        xp = _ops.get(np.zeros(1, np.float32))
        a = xp.empty((1000,), np.float32)  # free
        a[...] = 1
        before = t.now()
        xp.reduce(ReduceOp.SUM, a, a, a)
        return t.now() - before, float(a[0])

    res = run_sim(2, job, LinkModel(), cost).results
    assert res == [(pytest.approx(1e-6 + 1000 * 10 * 2e-9), 2.0)] * 2


def test_collectives_end_at_the_latest_arrival_plus_their_cost():
    links = LinkModel(ranks_per_node=1, inter_alpha=4e-6)

    def job(t):
        if t.rank == 2:
            t.sim.charge(t.g, 1e-3)  # rank 2 arrives late
        t.barrier()
        return t.now()

    # a barrier costs 2 ceil(log2 n) alphas
    assert run_sim(4, job, links).results == pytest.approx([1e-3 + 4 * 4e-6] * 4)


def test_split_keeps_global_ranks_and_links():
    links = LinkModel(ranks_per_node=2)

    def job(t):
        node, cross = t.split(t.rank // 2, t.rank), t.split(t.rank % 2, t.rank)
        return node.members, node.local_size, cross.members, cross.local_size, cross.g

    res = run_sim(6, job, links).results
    assert res[3] == ([2, 3], 2, [1, 3, 5], 1, 3)
    assert res[4] == ([4, 5], 2, [0, 2, 4], 1, 4)


def test_runs_are_deterministic():
    cost = cpu_costs()
    cost.scale = 100.0
    links = LinkModel(ranks_per_node=2, inter_bw=1e8, scale=100.0)
    job = scale_sim_jobs.Job(2048, ringcomm.Int8(), hier=False, segment_bytes=1024)
    a = run_sim(8, lambda t: scale_sim_jobs.run_job(job, t), links, cost)
    b = run_sim(8, lambda t: scale_sim_jobs.run_job(job, t), links, cost)
    assert a.clocks == b.clocks and a.time > 0


def test_a_failing_rank_ends_the_run():
    def job(t):
        if t.rank == 1:
            raise ValueError("boom")
        t.barrier()

    with pytest.raises(ValueError, match="boom"):
        run_sim(4, job, LinkModel(), timeout=10)


@pytest.mark.parametrize("variant,hier", [(None, False), (ringcomm.Int8(), False),
                                          (ringcomm.TopK(0.01), False), (None, True),
                                          (ringcomm.Int8(), True)],
                         ids=["dense", "int8", "topk", "dense-hier", "int8-hier"])
def test_closed_forms_agree_with_the_simulation(variant, hier):
    """bench/sim_formulas.py extrapolates the simulator; at 16 ranks they agree within 10%."""
    n, length, nbytes = 16, 16384, 1 << 27
    scale = nbytes / (4 * length)
    cost = gpu_costs()
    links = LinkModel(ranks_per_node=8, inter_bw=50e9, scale=scale)
    cost.scale = scale
    job = scale_sim_jobs.Job(length, variant, hier, segment_bytes=int((2 << 20) / scale))
    sim = run_sim(n, lambda t: scale_sim_jobs.run_job(job, t), links, cost)
    simulated = max(r["time"] for r in sim.results)
    computed = sim_formulas.projected(n, nbytes, variant, hier,
                                      LinkModel(ranks_per_node=8, inter_bw=50e9), cost)
    assert computed == pytest.approx(simulated, rel=0.10)
