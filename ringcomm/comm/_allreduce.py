"""How one allreduce runs: its arguments checked into a plan, ``compression="auto"`` decided,
the call agreed on across ranks, then the flat ring, a compressed algorithm or the two-level
allreduce over the transport.

The Communicator owns one :class:`Allreduce` and hands it every allreduce call; the plans of
dense host calls are kept for their repeats (:mod:`ringcomm.comm._plan`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import compressed as algorithms
from ringcomm.algorithms import hierarchical, ring
from ringcomm.algorithms.auto import Auto, AutoFigures, Decision
from ringcomm.algorithms.compressed_ring import mix_seed
from ringcomm.codecs.base import Compressor, check_compressed_args, check_compressed_call
from ringcomm.comm import _arrays, _twolevel, agree
from ringcomm.comm._inline import allreduce_inline
from ringcomm.comm._plan import AllreducePlan, PlanCache
from ringcomm.core.types import Array, ReduceOp, Transport, check_op

__all__ = ["Allreduce"]


class Allreduce:
    """The allreduce of one communicator: plans, the "auto" policy's figures, and the runs.

    Args:
        transport: the communicator's transport.
        agreement: its agreement (the cross-rank check of every call).
        two_level: its two-level allreduce setting and groups.
    """

    def __init__(self, transport: Transport, agreement: agree.Agreement,
                 two_level: _twolevel.TwoLevel) -> None:
        self._transport = transport
        self._agreement = agreement
        self._two_level = two_level
        # Which transport moves which kind of array (NCCL's host transport): looked up per
        # call only where the backend routes at all (the host path stays one attribute).
        self._router: Callable[[Any], Transport] | None = (
            transport.transport_for if transport.routes_arrays else None)
        self.plans = PlanCache()
        self.figures = AutoFigures()
        self._default_auto: Auto | None = None
        #: Compressed calls made: with the rank, the seed of a call's stochastic rounding.
        self.compressed_calls = 0

    def route(self, x: Array) -> Transport:
        """The transport that moves arrays like ``x`` (the backend's own, or NCCL's host
        transport for host arrays)."""
        router = self._router
        return self._transport if router is None else router(x)

    # ------------------------------------------------------------------------------ plan
    def plan(self, x: Array, out: Array | None, op: Any, compression: Any, feedback: Any,
             name: Any, algorithm: Any = None) -> AllreducePlan:
        """Check the arguments of an allreduce and decide how it runs (before the agreement;
        an argument error is kept in the plan's spec, to be raised on every rank)."""
        policy = self.policy(compression)
        decision = None
        if policy is not None:
            decision = policy.decide_early(self.route(x), self.figures, x, op, feedback, name,
                                           self._agreement.inline_bytes)
            compression = None if decision is None else decision.choice
            if decision is not None and compression is None:
                feedback = None  # a dense choice: nothing dropped, nothing to keep
        spec = agree.CallSpec("allreduce")
        try:
            spec.algorithm = self._two_level.call_algorithm(algorithm, compression)
            rop, compression = self._check(spec, x, out, op, compression, feedback, name,
                                           decided=policy is None or decision is not None)
        except (TypeError, ValueError) as err:
            spec.error, rop = err, ReduceOp.SUM
        if decision is not None:
            # The policy itself is agreed on too, not only what it chose (equal choices from
            # unequal Autos would part at a later call).
            spec.extra = f"{policy!r} chose {spec.extra or 'none'}"
        elif policy is not None:
            spec.extra = _compressed_text(policy, name, feedback)
        plan = AllreducePlan(spec, rop, compression, feedback, name)
        if decision is None:
            plan.policy = policy  # decided after the agreement
        else:
            plan.trial = decision.trial
        if (plan.dense and spec.error is None and algorithm is None and policy is None):
            self.plans.put(x, op, plan, self._agreement, self.route(x),
                           self._two_level.surely_flat(spec.algorithm, x))
        return plan

    def policy(self, compression: Any) -> Auto | None:
        """The Auto that ``compression`` names ("auto": the communicator's), or None."""
        if isinstance(compression, Auto):
            return compression
        if isinstance(compression, str) and compression == "auto":
            if self._default_auto is None:
                self._default_auto = Auto()
            return self._default_auto
        return None

    def _check(self, spec: agree.CallSpec, x: Array, out: Array, op: Any, compression: Any,
               feedback: Any, name: Any, decided: bool) -> tuple[ReduceOp, Compressor | None]:
        """Check an allreduce's arguments, recording them in ``spec``; return the op and the
        compressor bound to this call (``Compressor.bind``: once per call). ``decided``:
        False for an Auto decided after the agreement (its choice is bound then)."""
        self._transport.check_arrays(x, out)
        dt = spec.set_array(x)
        rop = spec.set_op(check_op(op, dt))
        if out is not None:
            _check_out(x, out)
        if not decided:
            check_compressed_args(x, rop, feedback, name)
            _check_apart(feedback, name, x, out)
            return rop, None
        if compression is not None:
            bound = check_compressed_call(compression, x, rop, feedback, name)
            _check_apart(feedback, name, x, out)
            algorithms.algorithm_of(compression)
            spec.extra = _compressed_text(compression, name, feedback)
            return rop, bound
        if feedback is not None:
            raise ValueError("feedback needs a lossy compression; got compression=None")
        return rop, None

    # ------------------------------------------------------------------------------- run
    def run(self, plan: AllreducePlan, x: Array, out: Array | None) -> Array:
        """Agree on the call, then run its algorithm into ``out`` (a new array when None)."""
        spec = plan.spec
        if plan.dense and spec.error is None and x.nbytes <= self._agreement.inline_bytes:
            if type(x) is not np.ndarray:
                # The inline path copies x to the host: wait for the device first, within the
                # timeout (NCCL: a dead peer's kernel could hold the copy forever).
                self._transport.wait_gpu("allreduce")
            return allreduce_inline(self._agreement, spec, x, out, plan.op)
        self._agreement.agree(spec)
        return self._run_agreed(plan, x, out)

    def start(self, plan: AllreducePlan, x: Array) -> Any | None:
        """Start a dense allreduce of ``x`` in place where the transport runs it on threads of
        its own (``start_native_allreduce``), after agreeing on the call, and return what the
        transport returns; None where nothing was started, nor exchanged (the caller then
        runs the call through ``run``, agreeing on it there).

        Whether to start is decided before the agreement, from the call (size, dtype, op)
        and settings every rank holds alike: a rank that decides otherwise passed another
        call, which the exchange of whichever call it makes next refuses on every rank.
        Returning None after it would leave a call agreed and not run, whose allreduce then
        agrees again, paired on other ranks with their next collective: a call that turns
        out two-level once agreed runs here, to its end (a completed result). A call whose
        arguments failed their checks starts nothing: the allreduce run next raises, on every
        rank.
        """
        spec = plan.spec
        if (spec.error is not None or not plan.dense or plan.trial is not None
                or x.nbytes <= self._agreement.inline_bytes):
            return None
        t = self.route(x)
        if not t.takes_native_start(x, plan.op):
            return None
        self._agreement.agree(spec)
        if self._two_level.groups(spec.algorithm, x, None) is not None:
            # Two-level (known once the nodes are): run here, the call being agreed.
            self._run_agreed(plan, x, x)
            return t.finished_allreduce(x)
        return t.start_native_allreduce(x, plan.op)

    def _run_agreed(self, plan: AllreducePlan, x: Array, out: Array | None) -> Array:
        """Run an allreduce the ranks have agreed on into ``out`` (a new array when None)."""
        t = self.route(x)
        xp = _ops.get(x)
        result = out if out is not None else xp.empty(x.shape, x.dtype)
        if x.size == 0:
            return result
        direct = result.flags.c_contiguous and getattr(result.flags, "aligned", True)
        flat_out = result.reshape(-1) if direct else xp.empty((x.size,), x.dtype)
        if plan.dense and plan.trial is None:
            self._reduce(t, plan, _arrays.flat(x), flat_out, None, 0)
        else:  # compressed, or compression="auto" deciding (a dense trial call is timed too)
            self._run_compressed(t, plan, x, flat_out)
        if not direct:
            result[...] = flat_out.reshape(x.shape)
        return result

    def _run_compressed(self, t: Transport, plan: AllreducePlan, x: Array,
                        flat_out: Array) -> None:
        comp, trial = plan.compression, plan.trial
        if plan.policy is not None:
            decision = self._decide(plan.policy, t, x, plan.name)
            comp, trial = decision.choice, decision.trial
        start = time.perf_counter()  # after any measuring of the figures
        self.compressed_calls += 1
        seed = mix_seed(self.compressed_calls, self._transport.rank)
        self._reduce(t, plan, _arrays.flat(x), flat_out, comp, seed)
        if trial is not None:  # a call trying one of auto's candidates: keep its time
            if type(x) is not np.ndarray:
                self._transport.wait_gpu("allreduce")  # the call's device work is done
            trial[0].record(trial[1], time.perf_counter() - start, plan.name)

    def _decide(self, policy: Auto, t: Transport, x: Array, name: Any) -> Decision:
        """The decision of an Auto made after the agreement (collective: it may measure the
        figures, or end the trial calls), its choice bound to this call."""
        decision = policy.decide(t, self.figures, x, self._agreement.inline_bytes)
        if decision.choice is None:
            return decision
        return Decision(decision.choice.bind(x, name), decision.trial)

    def _reduce(self, t: Transport, plan: AllreducePlan, x: Array, out: Array,
                comp: Compressor | None, seed: int) -> None:
        """Run an agreed allreduce of flat ``x`` into flat ``out``: the flat ring over ``t``,
        or the two-level allreduce where the call's algorithm picks it."""
        segment = self._agreement.segment_bytes
        groups = self._two_level.groups(plan.spec.algorithm, x, comp)
        if groups is None:
            if plan.dense:
                ring.allreduce(t, x, out, plan.op, segment_bytes=segment)
            else:
                algorithms.allreduce(t, x, out, plan.op, comp, plan.feedback, plan.name, seed,
                                     segment_bytes=segment)
            return
        local, cross = (_twolevel.route(g, x) for g in groups)
        local.operation = cross.operation = self._transport.operation  # for their errors
        hierarchical.allreduce_with_feedback(local, cross, x, out, plan.op, comp, plan.feedback,
                                             plan.name, seed, segment_bytes=segment)
        stats = self._transport.stats
        for sub in (local, cross):  # the groups' traffic is this communicator's
            stats.add(sub.stats.bytes_sent, sub.stats.bytes_received)
            sub.stats.reset()


def _compressed_text(compression: Compressor | Auto, name: Any, feedback: Any) -> str:
    """What every rank agrees on of a compressed call besides its array: the compression,
    the name, and whether feedback is kept (on some ranks only, residuals would stay there
    alone)."""
    return f"{compression!r}|{name}|feedback={feedback is not None}"


def _check_apart(feedback: Any, name: Any, x: Array, out: Array | None) -> None:
    """Refuse an input or output that is (part of) the residual this call overwrites."""
    if feedback is not None:
        feedback.check_apart(name, x=x, out=out)


def _check_out(x: Array, out: Array) -> None:
    if type(out) is not type(x):
        raise TypeError(f"out is a {type(out).__name__}, expected a {type(x).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"out has shape {out.shape}, expected {x.shape}")
    if out.dtype != x.dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {x.dtype}")
    _arrays.check_writeable(out, "out")
    _arrays.check_overlap(x, out)
