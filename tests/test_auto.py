"""The "auto" selector's decisions on synthetic link and throughput figures."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import ringcomm
from ringcomm.algorithms.auto import Auto, LinkModel, Trial, predict, wire_bytes
from ringcomm.backends.threads import run_ranks
from ringcomm.codecs.base import Compressor, check_compressed_call
from ringcomm.comm.base import Communicator
from ringcomm.core.types import ReduceOp

INT8, FP16, BF16, TOPK = ringcomm.Int8(), ringcomm.FP16(), ringcomm.BF16(), ringcomm.TopK(0.01)
CPU = {"none": 10e9, repr(FP16): 0.7e9, repr(BF16): 0.7e9, repr(INT8): 2.5e9, repr(TOPK): 1.0e9}
GBIT = LinkModel(latency=50e-6, bandwidth=125e6)          # 1 Gbit/s Ethernet
FAST = LinkModel(latency=2e-6, bandwidth=40e9)           # shared memory


def auto(link: LinkModel, candidates=(None, FP16, INT8)) -> Auto:
    return Auto(candidates, link=link, throughput=CPU)


def test_slow_link_large_messages_compress():
    assert auto(GBIT).choose(64 << 20, 4) == INT8
    assert auto(GBIT, (None, FP16, INT8, TOPK)).choose(64 << 20, 4) == TOPK


def test_small_messages_stay_dense():
    assert auto(GBIT).choose(4 << 10, 4) is None


def test_fast_link_stays_dense():
    for nbytes in (4 << 10, 1 << 20, 64 << 20, 256 << 20):
        assert auto(FAST).choose(nbytes, 4) is None


def test_choice_is_the_cheapest_prediction():
    a = auto(GBIT, (None, FP16, INT8, TOPK))
    for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28):
        times = {a.key(c): predict(c, nbytes, 8, GBIT, CPU[a.key(c)]) for c in a.candidates}
        assert a.key(a.choose(nbytes, 8)) == min(times, key=times.get)


def test_wire_model():
    assert wire_bytes(None, 4096, 4) == 1024
    assert wire_bytes(INT8, 4096, 4) == INT8.nbytes(256)
    assert wire_bytes(TOPK, 4 << 20, 4) == 8 * TOPK.k_for((1 << 20) // 4)
    assert GBIT.step(125e6) == pytest.approx(1 + 50e-6)


def test_allowed_only():
    """Auto never picks what the user did not allow."""
    assert auto(GBIT, (None, FP16)).choose(64 << 20, 4) == FP16
    assert auto(GBIT, (None,)).choose(64 << 20, 4) is None


def test_bad_candidates():
    with pytest.raises(ValueError, match="at least one candidate"):
        Auto(())
    with pytest.raises(TypeError, match="compressors or None"):
        Auto((None, "int8"))
    with pytest.raises(RuntimeError, match="no link/throughput figures"):
        Auto().choose(1 << 20, 2)
    with pytest.raises(TypeError, match="compressors or None"):
        Auto((None, Auto()))  # a policy, not a compressor


def test_auto_is_a_policy_not_a_compressor():
    """Auto is decided per call into one of its candidates; it compresses nothing itself."""
    assert not isinstance(Auto(), Compressor)
    with pytest.raises(TypeError, match="must be a ringcomm compressor"):
        check_compressed_call(Auto(), np.ones(4, np.float32), ReduceOp.SUM, None, None)


def test_fixed_throughput_must_cover_every_candidate():
    """A missing figure is refused when the Auto is made, not as a KeyError inside a call on
    one rank (where the others would wait for it)."""
    link = LinkModel(1e-5, 1e9)
    with pytest.raises(ValueError, match=r"no figure for candidates \['Int8"):
        Auto((None, ringcomm.Int8()), link=link, throughput={"none": 1e9})


def test_candidates_must_name_a_known_algorithm():
    class Unknown(ringcomm.Int8):
        @property
        def allreduce_algorithm(self) -> str:
            return "no-such-algorithm"

    with pytest.raises(ValueError, match="names allreduce algorithm 'no-such-algorithm'"):
        Auto((None, Unknown()))


def test_auto_choice_is_logged_at_debug(caplog):
    """RINGCOMM_LOG_LEVEL=DEBUG (here: the logger's level) shows each choice of auto with the
    predicted cost of every candidate."""
    def job(t):
        comm = Communicator(t)
        comm.allreduce(np.ones(200_000, np.float32), compression="auto")
        return True

    with caplog.at_level(logging.DEBUG, logger="ringcomm.auto"):
        assert run_ranks(2, job) == [True, True]
    lines = [r.getMessage() for r in caplog.records if r.name == "ringcomm.auto"]
    assert lines, "no DEBUG record from ringcomm.auto"
    assert "800000 bytes over 2 ranks:" in lines[0] and "(predicted none " in lines[0], lines


class SlowFP16(ringcomm.FP16):
    """FP16 whose every encoding also waits 20 ms: clearly the slower candidate in a job."""

    def encode(self, src, out, *, seed=0, base=0, error=None):
        time.sleep(0.02)
        super().encode(src, out, seed=seed, base=base, error=error)

    def hop(self, payload, own, out, *, seed=0, base=0, error=None):
        time.sleep(0.02)
        super().hop(payload, own, out, seed=seed, base=base, error=error)

    def __repr__(self) -> str:
        return "SlowFP16()"


# Link and codecs the model cannot tell apart: every candidate is tried in the job.
EVEN = {"none": 1e9, "FP16()": 1e9, "SlowFP16()": 1e9}


def _trial_job(candidates, calls, length=20_000, feedback=True):
    """Every rank's choices over ``calls`` allreduces, its results, and the final choice."""
    choices = Auto(candidates, link=GBIT, throughput=EVEN, trials=2)

    def job(t):
        comm = Communicator(t)
        ef = ringcomm.ErrorFeedback() if feedback else None
        rng = np.random.default_rng(t.rank)
        results, sent = [], np.zeros(length)
        for _ in range(calls):
            g = rng.standard_normal(length).astype(np.float32)
            sent += g
            results.append(comm.allreduce(g, compression=choices, feedback=ef,
                                          name="g" if ef is not None else None))
        figures = comm.auto_figures
        key = (id(choices), "host", length, length * 4)
        left = ef.residual("g") if ef is not None and ef.residual("g") is not None else 0
        return results, figures.choices.get(key, (None, "undecided"))[1], sent, left

    return run_ranks(2, job)


@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("candidates, expected", [((None, SlowFP16()), None),
                                                  ((SlowFP16(), None), None),
                                                  ((SlowFP16(), FP16), FP16)])
def test_trials_choose_the_candidate_measured_faster(candidates, expected, feedback):
    """With the model unable to choose, each candidate runs ``trials`` calls in the job and
    the ranks agree on the one whose slowest rank was fastest; the dense candidate's trial
    calls are timed too, with error feedback or without (without, they once ran as plain
    dense calls, never counted, so the trials never ended)."""
    per_rank = _trial_job(candidates, calls=7, feedback=feedback)
    finals = [repr(r[1]) for r in per_rank]
    assert finals == [repr(expected)] * 2
    for a, b in zip(per_rank[0][0], per_rank[1][0], strict=True):
        np.testing.assert_array_equal(a, b)  # bit-identical during and after the trials


def test_trials_end_where_dense_is_tried_first_with_error_feedback():
    """The model's first pick dense (a fast link): its trial calls, with error feedback and no
    residual pending yet, are timed and the trials end (they once ran as plain dense calls,
    uncounted, and every call went dense without the other candidate ever timed)."""
    auto = Auto((None, SlowFP16()), link=LinkModel(latency=50e-6, bandwidth=1e12),
                throughput={"none": 1e9, "SlowFP16()": 0.6e9}, trials=2)

    def job(t):
        comm = Communicator(t)
        ef = ringcomm.ErrorFeedback()
        for _ in range(8):
            comm.allreduce(np.ones(20_000, np.float32), compression=auto, feedback=ef, name="g")
        key = (id(auto), "host", 20_000, 80_000)
        return comm.auto_figures.choices.get(key, (None, "undecided"))[1]

    assert run_ranks(2, job) == [None, None]


def test_each_candidate_runs_until_its_calls_are_timed_a_names_first_call_untimed():
    """Each candidate's trial calls follow one another until ``trials`` of them are timed, and
    a name's first call under a candidate is not: it pays for what the candidate before left
    that name (with error feedback, a dense call after a compressed one sends the residual in
    full, which later dense calls do not). Names a, b and c of one size share the trial: tried
    in turn one call each, every timed dense call came after a compressed one; timing all but
    a block's first call, 2 of dense's 3 timed calls were still a name's first."""
    trial = Trial((None, FP16), 3)
    ran, timed = [], []
    seconds = {"none": 1.0, "FP16()": 2.0}
    names = ["a", "b", "c"] * 10
    for call in range(12):
        key = Auto.key(trial.pick())
        name = names[call]
        first = (key, name) not in ran
        ran.append((key, name))
        before = len(trial.samples.get(key, []))
        trial.record(key, seconds[key] + (9.0 if first else 0.0), name)
        timed.append(len(trial.samples.get(key, [])) > before)
    assert trial.done and trial.calls == 12
    assert [k for k, _ in ran] == ["none"] * 6 + ["FP16()"] * 6
    assert timed == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert trial.medians() == {"none": 1.0, "FP16()": 2.0}


def test_calls_that_each_pass_a_name_of_their_own_are_timed_after_a_while():
    """Names that never come back would leave every call a first one: after LEAD_CALLS untimed
    calls a candidate's calls are timed whatever their names, so the trials end."""
    from ringcomm.algorithms.auto import LEAD_CALLS

    trial = Trial((None, FP16), 2)
    calls = 0
    while not trial.done:
        trial.record(Auto.key(trial.pick()), 1.0, f"step{calls}")
        calls += 1
    assert calls == 2 * (LEAD_CALLS + 2)


def test_the_trials_choice_is_the_same_on_every_rank_with_several_names():
    """Three names of one size under error feedback, in the same order on every rank: the
    trial calls and the choice are the same on every rank, results bit-identical."""
    def job(t):
        comm = Communicator(t)
        auto = Auto((None, FP16), link=GBIT, throughput=EVEN, trials=2)
        ef = ringcomm.ErrorFeedback()
        rng = np.random.default_rng(t.rank)
        results = []
        for _ in range(6):
            for name in ("a", "b", "c"):
                g = rng.standard_normal(20_000).astype(np.float32)
                results.append(comm.allreduce(g, compression=auto, feedback=ef, name=name))
        key = (id(auto), "host", 20_000, 80_000)
        return results, repr(comm.auto_figures.choices.get(key, (None, "undecided"))[1])

    per_rank = run_ranks(2, job)
    assert per_rank[0][1] == per_rank[1][1] != repr("undecided")
    for a, b in zip(per_rank[0][0], per_rank[1][0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_trials_keep_error_feedback_conserving():
    """Trial calls switch between dense (which spends the residual) and compressed ones;
    results plus residuals still equal the inputs."""
    per_rank = _trial_job((None, FP16), calls=9)
    total_results = sum(per_rank[0][0])  # every rank holds the same sums
    inputs = per_rank[0][2] + per_rank[1][2]
    residuals = per_rank[0][3] + per_rank[1][3]
    np.testing.assert_allclose(total_results + residuals, inputs, rtol=0, atol=1e-3)


def test_trials_undecided_until_every_trial_ran():
    # 2 candidates x (1 untimed + 2 timed): 6 trial calls, and the 7th decides
    per_rank = _trial_job((None, FP16), calls=6)
    assert [r[1] for r in per_rank] == ["undecided"] * 2


def test_trials_argument_checked():
    with pytest.raises(ValueError, match="trials must be an integer >= 0"):
        Auto(trials=-1)
    with pytest.raises(ValueError, match="trials must be an integer >= 0"):
        Auto(trials=True)
    assert Auto(link=GBIT, throughput=CPU).rounds == 0
    assert Auto().rounds == 3
