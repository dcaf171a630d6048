"""The DDP hook's trials of ``compression="auto"`` (ringcomm.torch._iteration_trials): which
candidate each iteration runs, which iterations are timed, and the choice from every rank's
medians. The hook in a real DDP job: tests/mpi/test_started_allreduce.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import ringcomm
from ringcomm.torch._iteration_trials import IterationTrials, only

FP16, INT8 = ringcomm.FP16(), ringcomm.Int8()


class Ranks:
    """``allgather`` of this rank's row and the other ranks' rows (given)."""

    def __init__(self, *others: list[float]) -> None:
        self.others = [np.array([row]) for row in others]
        self.gathered: list[np.ndarray] = []

    def allgather(self, x: np.ndarray) -> np.ndarray:
        self.gathered.append(x)
        return np.concatenate([x, *self.others])


def _run(trials: IterationTrials, seconds: dict[str, float], comm: Ranks,
         iterations: int) -> list[str]:
    """Iterations 0.. at the times the candidate of each one takes; the key each one ran."""
    now, ran = 0.0, []
    for it in range(iterations):
        trials.iteration(it, comm, now)
        auto = trials.compression()
        key = ringcomm.Auto.key(auto.candidates[0])
        ran.append(key)
        now += seconds[key]
    return ran


def test_each_candidate_runs_an_untimed_iteration_then_its_rounds_then_the_choice():
    auto = ringcomm.Auto((None, FP16, INT8), trials=2)
    trials = IterationTrials(auto, first=2)
    comm = Ranks()
    took = {"none": 1.0, repr(FP16): 0.5, repr(INT8): 0.8}
    ran = _run(trials, took, comm, 14)
    # before `first` the first candidate (the iterations do not compress yet, see
    # RingcommState.compresses), then each candidate's block: one untimed iteration, 2 timed
    # ones; the decision; the choice
    assert ran[:2] == ["none", "none"]
    assert ran[2:11] == ["none"] * 3 + [repr(FP16)] * 3 + [repr(INT8)] * 3
    assert trials.choice == repr(FP16) and ran[11:] == [repr(FP16)] * 3
    assert {k: len(v) for k, v in trials.samples.items()} == {
        k: 2 for k in ("none", repr(FP16), repr(INT8))}
    assert trials.samples[repr(INT8)] == pytest.approx([0.8, 0.8])
    assert trials.slowest == pytest.approx({"none": 1.0, repr(FP16): 0.5, repr(INT8): 0.8})
    assert len(comm.gathered) == 1  # one exchange


def test_a_candidates_first_iteration_after_another_is_not_timed():
    """The iteration where a candidate takes over pays for what the one before left (a dense
    candidate then sends every residual in full, in the hook, instead of starting its buckets
    on gloo's threads): it is not timed, wherever it falls, so the dense candidate is timed on
    the iterations it runs once chosen. Tried in turn one iteration each, every dense
    iteration was a first one, and a compressor slower than dense was chosen."""
    auto = ringcomm.Auto((INT8, None), trials=3)  # dense after Int8's block
    trials = IterationTrials(auto, first=0)
    now, previous = 0.0, None
    for it in range(2 * 4):
        trials.iteration(it, Ranks(), now)
        key = ringcomm.Auto.key(trials.compression().candidates[0])
        if key == "none":  # 1.0 s, and 0.5 s more where it follows Int8 (the residuals)
            now += 1.5 if previous == repr(INT8) else 1.0
        else:
            now += 1.2
        previous = key
    trials.iteration(8, Ranks(), now)
    assert trials.choice == "none"
    assert trials.slowest == pytest.approx({repr(INT8): 1.2, "none": 1.0})


def test_the_slowest_rank_decides():
    """This rank found FP16 fastest; another rank's FP16 iterations took 2 s: Int8 wins on
    every rank's slowest median."""
    auto = ringcomm.Auto((None, FP16, INT8), trials=1)
    trials = IterationTrials(auto, first=0)
    took = {"none": 1.0, repr(FP16): 0.5, repr(INT8): 0.8}
    _run(trials, took, Ranks([1.0, 2.0, 0.9]), 8)
    assert trials.choice == repr(INT8)


def test_each_candidate_runs_as_an_auto_of_itself():
    """A candidate runs as an Auto of that one candidate with fixed figures and no trials: it
    chooses it at once, equal on every rank (its repr is what the ranks agree on)."""
    parent = ringcomm.Auto((None, FP16, INT8))
    for candidate in (None, FP16, INT8):
        auto = only(candidate, parent)
        assert auto.candidates == (candidate,) and auto.rounds == 0
        assert repr(auto) == repr(only(candidate, parent))


def test_each_candidate_is_named_after_the_auto_trying_it():
    """Ranks whose Autos differ (here their trials) pass differently named candidates at the
    first call that compresses: the agreement parts them there, all in the same call."""
    one, two = ringcomm.Auto((None, FP16), trials=1), ringcomm.Auto((None, FP16), trials=2)
    assert repr(only(FP16, one)) == f"FP16() of {one!r}"
    assert repr(only(FP16, one)) != repr(only(FP16, two))
    assert repr(IterationTrials(one, 0).compression()) == repr(only(None, one))
