"""``compression="auto"`` in the DDP hook: candidates tried a whole iteration each, timed by
the iteration.

Outside the hook, an ``Auto`` tries its candidates call by call and keeps each call's time
(ringcomm.algorithms.auto). In a training step that measures the wrong thing: a bucket's
allreduce overlaps backward, so what a candidate costs is what it adds to the step, not its
call's length. On one H200 (bench/results/gpu/README.md), Int8's calls were shorter than dense
ones, so the per-call trials chose it, while a step with Int8 took 44-45 ms against 42.5 ms
dense: its kernels and copies compete with backward where a dense bucket's transfer runs
beside it on gloo's threads.

So the hook gives every compressed bucket of an iteration the same candidate and times whole
iterations, from one iteration's first bucket to the next one's: each candidate in turn runs
one untimed iteration, then ``rounds`` timed ones. At the first bucket after them the ranks
agree, in one exchange, on the candidate whose slowest rank's median iteration was shortest;
every bucket that compresses then uses it. Each candidate runs as an ``Auto`` of that one
candidate (:func:`only`), so a dense one meeting a residual still sends it, and a dense one
is started on gloo's threads like an uncompressed bucket.

A candidate's iterations run one after another, its untimed one first, so that what it is
timed on is what it costs once chosen. The untimed iteration takes its one-off costs (codecs
compiled, scratch allocated) and what the candidate before it left: after a compressed
candidate every compressed bucket holds a residual, which the first dense iteration sends in
full, in the hook, where later dense iterations start their buckets on gloo's threads. Tried
in turn one iteration each, every timed dense iteration followed a compressed one and was
timed on that slower path: on one H200 (bench/results/gpu/README.md) the trials then chose
Int8, whose steps took 45.6 ms against 42.1 ms sent uncompressed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ringcomm.algorithms.auto import Auto, LinkModel
from ringcomm.codecs.base import Compressor
from ringcomm.core.log import get_logger

__all__ = ["IterationTrials", "only"]

_LOG = get_logger("auto")
# Figures an Auto of one candidate is given so that it neither measures nor tries: any will do.
_ANY_LINK = LinkModel(latency=1e-6, bandwidth=1e9)


class _Only(Auto):
    """An Auto of one candidate, named after the Auto whose trials run it: the ranks agree on
    that name at every call, so ranks whose Autos differ (their candidates, their number of
    trials) part at the first call that compresses, all in the same call, instead of at the
    decision, where one rank would exchange times while another reduces a bucket."""

    def __init__(self, candidate: Compressor | None, of: str) -> None:
        super().__init__((candidate,), link=_ANY_LINK,
                         throughput={Auto.key(candidate): 1e9}, trials=0)
        self._of = of

    def __repr__(self) -> str:
        return f"{self.key(self.candidates[0])} of {self._of}"


def only(candidate: Compressor | None, of: Auto) -> Auto:
    """An Auto whose one candidate is ``candidate``: it chooses it at once, on every rank;
    named after ``of``, the Auto whose trials run it."""
    return _Only(candidate, repr(of))


class IterationTrials:
    """The iterations of a DDP job that try ``auto``'s candidates, then its choice.

    Args:
        auto: the policy whose candidates are tried; ``auto.rounds`` timed iterations each.
        first: the iteration the trials start at (the first one that compresses).
    """

    def __init__(self, auto: Auto, first: int) -> None:
        self.first = first
        self._fixed = {Auto.key(c): only(c, auto) for c in auto.candidates}
        keys = list(self._fixed)
        #: Each trial iteration's candidate and whether it is timed: per candidate, one untimed
        #: iteration, then ``auto.rounds`` timed ones.
        self.schedule = tuple((key, timed) for key in keys
                              for timed in (False, *(True,) * auto.rounds))
        self.samples: dict[str, list[float]] = {}
        self.choice: str | None = None
        #: Once chosen: the slowest rank's median iteration (seconds) of each candidate.
        self.slowest: dict[str, float] | None = None
        self._current = keys[0]
        self._open: tuple[str, float] | None = None  # the timed iteration under way

    def compression(self) -> Auto:
        """What the compressed buckets of the current iteration run."""
        return self._fixed[self.choice if self.choice is not None else self._current]

    def iteration(self, it: int, comm: Any, now: float | None = None) -> None:
        """At the first bucket of iteration ``it`` (at ``now``, ``time.perf_counter``): end
        the timing of the one before, pick this one's candidate, or, after the last trial
        iteration, decide (collective: every rank calls it at the same iteration's first
        bucket, in the order of the communicator's calls)."""
        now = time.perf_counter() if now is None else now
        if self._open is not None:
            key, start = self._open
            self.samples.setdefault(key, []).append(now - start)
            self._open = None
        if self.choice is not None or it < self.first:
            return
        k = it - self.first
        if k < len(self.schedule):
            self._current, timed = self.schedule[k]
            if timed:
                self._open = (self._current, now)
            return
        self._decide(comm)

    def _decide(self, comm: Any) -> None:
        keys = list(self._fixed)
        medians = np.array([[np.median(self.samples[k]) if k in self.samples else np.inf
                             for k in keys]])
        slowest = comm.allgather(medians).max(axis=0)  # one row per rank
        self.choice = keys[int(np.argmin(slowest))]
        self.slowest = {k: float(s) for k, s in zip(keys, slowest, strict=True)}
        _LOG.info("DDP hook: %s, chosen from whole iterations (slowest rank's median: %s)",
                  self.choice, ", ".join(f"{k} {s * 1e3:.1f} ms"
                                         for k, s in zip(keys, slowest, strict=True)))
