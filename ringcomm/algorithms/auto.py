"""``compression="auto"``: pick, per message size, the fastest compression the user allowed.

Each call's candidates are first ranked by a cost model of the ring: link latency and
bandwidth, and each candidate's per-hop compute (:mod:`ringcomm.algorithms.cost_model`, which
also measures those figures, once per communicator, on the first call that needs them).

The model sees the link and the codecs alone; in a training job they share the cores with
backward, and DDP's other buckets share the link. So, with measured figures, the model's choice
is then tried in the job itself: the first calls of each array size run, in turn, every
candidate the model puts within ``TRY_WITHIN`` of its best, each until ``trials`` of its calls
are timed, and once all have run the ranks agree, in one exchange, on the candidate whose
slowest rank's median was lowest (the same choice on every rank). A name's first call under a
candidate is not timed (:class:`Trial`): it pays for what the candidate before left it (with
error feedback, a dense call after a compressed one sends the residual in full, which later
dense calls do not). Small dense calls, which ride in the agreement exchange, are not tried.
A call's time is what it costs where calls follow one another; where they overlap other work
(a DDP hook's buckets overlap backward) it can favour a candidate whose work slows the rest
down, so the DDP hook tries candidates a whole iteration each instead
(ringcomm.torch._iteration_trials).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms.compressed import algorithm_of
from ringcomm.algorithms.cost_model import (
    LinkModel,
    candidate_key,
    measure_link,
    measure_throughput,
    predict,
    wire_bytes,
)
from ringcomm.codecs.base import Compressor, check_compressed_args
from ringcomm.codecs.cast import BF16
from ringcomm.codecs.int8 import Int8
from ringcomm.core.log import get_logger
from ringcomm.core.types import DEFAULT_INLINE_BYTES as INLINE_BYTES
from ringcomm.core.types import Array, ReduceOp, Transport, accumulation_dtype, check_dtype

__all__ = ["LEAD_CALLS", "TRY_WITHIN", "Auto", "AutoFigures", "Compression", "Decision",
           "LinkModel", "Trial", "measure_link", "measure_throughput", "predict", "wire_bytes"]

_LOG = get_logger("auto")
#: Candidates whose modelled time is within this factor of the best are tried in the job.
TRY_WITHIN = 3.0
#: Calls per tried candidate when the figures are measured (``Auto(trials=None)``).
DEFAULT_TRIALS = 3


#: Untimed trial calls a candidate makes at most before its calls are timed whatever their
#: names (calls that each pass a name of their own would otherwise never be timed).
LEAD_CALLS = 64


@dataclass
class Trial:
    """The calls of one array size that try candidates in the job: which runs on each call,
    and the seconds each timed call took on this rank.

    Each candidate in turn runs until ``rounds`` of its calls are timed. A call is timed only
    where its name (the residual's, or None) has already run this candidate: the first call
    of a name pays for what the candidate before left it (with error feedback, a dense call
    after a compressed one sends the name's residual in full, which later dense calls do
    not); after ``LEAD_CALLS`` untimed calls every call is timed. The names and their order
    are the same on every rank (each call is agreed on), so the calls are too.

    Attributes:
        candidates: the candidates tried, in order.
        rounds: timed calls per candidate.
        samples: seconds per timed call, keyed by ``Auto.key`` of the candidate.
        calls: the trial calls that have run.
    """

    candidates: tuple[Compressor | None, ...]
    rounds: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    calls: int = 0
    _at: int = 0  # the candidate running now
    _names: set[Any] = field(default_factory=set)  # names that have run it

    @property
    def done(self) -> bool:
        """Whether every candidate has run its timed calls."""
        return self._at >= len(self.candidates)

    def pick(self) -> Compressor | None:
        """The candidate of the next trial call."""
        return self.candidates[self._at]

    def record(self, key: str, seconds: float, name: Any = None) -> None:
        """Keep the time of the call of ``name`` that ran candidate ``key`` (the one ``pick``
        named), unless it was the name's first under it (see the class docstring)."""
        if name in self._names or len(self._names) >= LEAD_CALLS:
            timed = self.samples.setdefault(key, [])
            timed.append(seconds)
            if len(timed) >= self.rounds:
                self._at += 1
                self._names = set()
        else:
            self._names.add(name)
        self.calls += 1

    def medians(self) -> dict[str, float]:
        """This rank's median seconds per candidate."""
        return {k: float(np.median(v)) for k, v in self.samples.items()}


@dataclass
class AutoFigures:
    """What "auto" has measured on one communicator, per array kind ("host", "device").

    Attributes:
        links: the ring step's latency and bandwidth.
        throughput: bytes/s of each candidate's hop (keyed by ``Auto.key``).
        choices: the choice made per (Auto, array kind, length), with the Auto kept alive.
        trials: the calls trying candidates in the job, per (Auto, array kind, length), until
            a choice is made.
    """

    links: dict[str, LinkModel] = field(default_factory=dict)
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    choices: dict[tuple[int, str, int, int], tuple[Auto, Compressor | None]] = field(
        default_factory=dict)
    trials: dict[tuple[int, str, int, int], tuple[Auto, Trial]] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What an Auto chose for one call.

    Attributes:
        choice: the compressor the call runs (None: dense), not yet bound to the call.
        trial: for a call trying one of the candidates in the job, its trial and the
            candidate's key: the call's time is recorded there (``Trial.record``).
    """

    choice: Compressor | None
    trial: tuple[Trial, str] | None = None


class Auto:
    """Let ringcomm choose, per call, the fastest of ``candidates`` for the message's size.

    A policy, not a compressor: the Communicator asks it for a :class:`Decision` per call
    (``decide``, or ``decide_early`` before the call is agreed on) and runs the compressor
    chosen.

    Args:
        candidates: what the user allows; None stands for no compression. The default allows
            no compression, BF16 and Int8 (errors of at most about 1% per step, made up by
            error feedback); add ``TopK(...)`` to allow sparsification. Its 16-bit cast is
            BF16, not FP16: bfloat16 keeps float32's range, where FP16 turns a gradient above
            65504 into Inf (in every call that tries it, too), which training without a loss
            scaler would apply.
        link: fixed link figures (for tests or a known network) instead of measuring.
        throughput: fixed per-candidate throughputs (bytes/s, keyed by ``repr`` of the
            candidate, "none" for None) instead of measuring.
        trials: timed calls per candidate tried in the job (a name's first call under each is
            not timed: see :class:`Trial`) before choosing from their measured times; 0 chooses
            from the model alone. None: 3 where the figures are measured, 0 where ``link`` and
            ``throughput`` are both given.

    Every rank must pass an equal Auto; the choice is the same on every rank.
    """

    def __init__(self, candidates: tuple[Compressor | None, ...] = (None, BF16(), Int8()), *,
                 link: LinkModel | None = None,
                 throughput: dict[str, float] | None = None, trials: int | None = None) -> None:
        if not candidates:
            raise ValueError("Auto needs at least one candidate")
        for c in candidates:
            if c is not None and not isinstance(c, Compressor):
                raise TypeError(f"Auto candidates are compressors or None, got {c!r}")
        for c in candidates:
            if c is not None:
                try:
                    algorithm_of(c)
                except ValueError as err:
                    raise ValueError(f"candidate {err}") from None
        if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int)
                                   or trials < 0):
            raise ValueError(f"trials must be an integer >= 0 or None, got {trials!r}")
        self.candidates = tuple(candidates)
        self.trials = trials
        self.link = link
        self.throughput = dict(throughput) if throughput else None
        if self.throughput is not None:
            missing = [self.key(c) for c in self.candidates if self.key(c) not in self.throughput]
            if missing:
                raise ValueError(f"throughput has no figure for candidates {missing}; "
                                 f"expected keys {[self.key(c) for c in self.candidates]}")

    @staticmethod
    def key(comp: Compressor | None) -> str:
        """The candidate's name in the figures: its repr, "none" for None."""
        return candidate_key(comp)

    def choose(self, nbytes: int, n: int, inline_bytes: int = INLINE_BYTES,
               dense_nbytes: int | None = None) -> Compressor | None:
        """The candidate with the smallest modelled time for ``nbytes`` over ``n`` ranks.

        Raises:
            RuntimeError: the link or throughput figures are not known yet (``resolve``
                measures them).
        """
        if self.link is None or self.throughput is None:
            raise RuntimeError("Auto has no link/throughput figures yet; call resolve()")
        times = [predict(c, nbytes, n, self.link, self.throughput[self.key(c)], inline_bytes,
                         dense_nbytes) for c in self.candidates]
        return self.candidates[int(np.argmin(times))]

    def ready(self, figures: AutoFigures, x: Array) -> bool:
        """Whether ``resolve`` can choose for ``x`` without an exchange (measuring the
        figures, or deciding after the trial calls: both collective)."""
        kind = _kind(x)
        link = self.link is not None or kind in figures.links
        known = figures.throughput.get(kind, {})
        speed = self.throughput is not None or all(self.key(c) in known for c in self.candidates)
        trial = self._trial(figures, self._key(x))
        return link and speed and (trial is None or not trial.done)

    def _key(self, x: Array) -> tuple[int, str, int, int]:
        return (id(self), _kind(x), x.size, x.nbytes)  # nbytes: whether dense rides inline

    def resolve(self, t: Transport, figures: AutoFigures, x: Array,
                inline_bytes: int = INLINE_BYTES) -> Compressor | None:
        """The candidate chosen for array ``x`` (``decide``'s choice; collective where the
        figures are still to be measured or the trial calls to be decided)."""
        return self.decide(t, figures, x, inline_bytes).choice

    def decide(self, t: Transport, figures: AutoFigures, x: Array,
               inline_bytes: int = INLINE_BYTES) -> Decision:
        """Choose for array ``x``, measuring over ``t`` what ``figures`` lack first
        (collectively, once per communicator and array kind); during the trial calls, the
        candidate of the next one, with its trial to record the call's time in."""
        key = self._key(x)
        kind = key[1]
        memo = figures.choices.get(key)
        if memo is not None and memo[0] is self:
            return Decision(memo[1])
        link = self.link
        if link is None:
            if kind not in figures.links:
                figures.links[kind] = measure_link(t, x)
            link = figures.links[kind]
        throughput = self.throughput
        if throughput is None:
            known = figures.throughput.setdefault(kind, {})
            missing = [c for c in self.candidates if self.key(c) not in known]
            if missing:
                known.update(measure_throughput(t, missing, x))
            throughput = {self.key(c): known[self.key(c)] for c in self.candidates}
        trial = self._trial(figures, key)
        if trial is None:
            trial = self._model_choice(figures, key, t.size, x, link, throughput, inline_bytes)
            if trial is None:
                return Decision(figures.choices[key][1])
        if not trial.done:
            choice = trial.pick()
            return Decision(choice, (trial, self.key(choice)))
        return Decision(self._decide(t, figures, key, trial))

    def _trial(self, figures: AutoFigures, key: tuple[int, str, int, int]) -> Trial | None:
        memo = figures.trials.get(key)
        return memo[1] if memo is not None and memo[0] is self else None

    @property
    def rounds(self) -> int:
        """Timed trial calls per candidate this Auto makes in the job (0: the model alone)."""
        if self.trials is not None:
            return self.trials
        return 0 if self.link is not None and self.throughput is not None else DEFAULT_TRIALS

    def _model_choice(self, figures: AutoFigures, key: tuple[int, str, int, int], n: int,
                      x: Array, link: LinkModel, throughput: dict[str, float],
                      inline_bytes: int) -> Trial | None:
        """Choose from the model and keep the choice; or, where the model puts several
        candidates close, start the trial calls that choose among them (returned)."""
        nbytes = x.size * 4  # compressed calls compute in float32
        seconds = [predict(c, nbytes, n, link, throughput[self.key(c)], inline_bytes,
                           x.nbytes) for c in self.candidates]
        best = self.candidates[int(np.argmin(seconds))]
        if _LOG.isEnabledFor(logging.DEBUG):
            costs = ", ".join(f"{self.key(c)} {s:.3g} s"
                              for c, s in zip(self.candidates, seconds, strict=True))
            _LOG.debug("%d bytes over %d ranks: %s (predicted %s)", x.nbytes, n,
                       self.key(best), costs)
        close = [c for c, s in zip(self.candidates, seconds, strict=True)
                 if s <= TRY_WITHIN * min(seconds)]
        rounds = self.rounds
        if rounds == 0 or len(close) < 2 or x.nbytes <= inline_bytes:
            self._keep(figures, key, best)
            return None
        close.sort(key=lambda c: c is not best)  # the model's pick first
        trial = Trial(tuple(close), rounds)
        if len(figures.trials) > 4096:
            figures.trials.clear()
        figures.trials[key] = (self, trial)
        return trial

    def _decide(self, t: Transport, figures: AutoFigures, key: tuple[int, str, int, int],
                trial: Trial) -> Compressor | None:
        """Choose, from every rank's trial times (one exchange, collective), the candidate
        whose slowest rank's median was lowest: the same choice on every rank."""
        everyone = t.allgather_object(trial.medians())
        tried = list(trial.candidates)
        slowest = [max(m[self.key(c)] for m in everyone) for c in tried]
        choice = tried[int(np.argmin(slowest))]
        _LOG.info("%d elements over %d ranks: %s, chosen from calls in the job (slowest "
                  "rank's median: %s)", key[2], t.size, self.key(choice),
                  ", ".join(f"{self.key(c)} {s:.3g} s"
                            for c, s in zip(tried, slowest, strict=True)))
        del figures.trials[key]
        self._keep(figures, key, choice)
        return choice

    def _keep(self, figures: AutoFigures, key: tuple[int, str, int, int],
              choice: Compressor | None) -> None:
        if len(figures.choices) > 4096:
            figures.choices.clear()
        figures.choices[key] = (self, choice)  # keeps self alive, so its id stays its own

    def decide_early(self, t: Transport, figures: AutoFigures, x: Array, op: Any, feedback: Any,
                     name: Any, inline_bytes: int = INLINE_BYTES) -> Decision | None:
        """The decision for ``x`` made before the call is agreed on, so that the choice itself
        is agreed on (every rank chooses alike from the same figures, and a choice that
        differs because the arguments differ is caught there); None where it is made after
        the agreement (``decide``: the first call measures, together).

        None also where a dense choice meets a pending residual (the compressed path then
        sends it in full) or, with error feedback, a 16-bit float array (the compressed path
        then keeps the rounding of its result, as every compressor does), and for invalid
        arguments (the checked path raises their error on every rank). Never raises.
        """
        try:
            check_compressed_args(x, ReduceOp.parse(op), feedback, name)
            check_dtype(x.dtype)
            if not self.ready(figures, x):
                return None
            decision = self.decide(t, figures, x, inline_bytes)
        except (AttributeError, TypeError, ValueError):
            return None
        if decision.choice is None and feedback is not None and name is not None and (
                feedback.holds(name) or accumulation_dtype(np.dtype(x.dtype)) != x.dtype):
            return None
        return decision

    def with_shapes(self, shapes: Any) -> Auto:
        """Itself: a DDP hook tells its compressor the bucket's shapes, and the candidates
        (casts, Int8, TopK) treat every element alike."""
        return self

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        names = ", ".join(self.key(c) for c in self.candidates)
        # Everything that decides the choice or the calls that make it is part of what every
        # rank must agree on: fixed figures, and the number of trial calls (ranks that try
        # different numbers would meet the deciding exchange at different calls).
        trials = "" if self.trials is None else f", trials={self.trials}"
        fixed = "".join(f", {k}={v!r}" for k, v in (("link", self.link),
                                                      ("throughput", self.throughput)) if v)
        return f"Auto(candidates=({names}){trials}{fixed})"


#: What a call's ``compression`` may be besides None: a compressor, or the policy choosing one.
Compression = Compressor | Auto


def _kind(x: Array) -> str:
    return "device" if _ops.is_device_array(x) else "host"
