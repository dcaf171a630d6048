"""Allreduce plans: what a checked call runs, and the one cache of plans for repeated calls.

A training loop reduces the same tensors every step. The first call of a dense allreduce is
checked in full and its plan kept (host arrays: keyed by dtype, shape and op); repeats skip the
local checks (the cross-rank agreement still runs every call). Small host arrays also get an
:class:`~ringcomm.comm._inline.InlinePlan`, which finishes the call within the agreement, and
medium ones a :class:`~ringcomm.comm._prepared.NativePlan` where the transport's own allreduce
runs them (:mod:`ringcomm.comm._prepared`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.comm import agree
from ringcomm.comm._inline import InlinePlan, ScatterPlan
from ringcomm.comm._prepared import NativePlan, fitting_out
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["AllreducePlan", "PlanCache"]

_LIMIT = 4096  # plans kept at most: shapes can be many


class AllreducePlan:
    """How one allreduce runs: its agreed spec, op, compression and error feedback."""

    __slots__ = ("compression", "feedback", "name", "op", "policy", "repeat", "spec", "trial")

    def __init__(self, spec: agree.CallSpec, op: ReduceOp, compression: Any, feedback: Any,
                 name: Any) -> None:
        self.spec, self.op = spec, op
        self.compression, self.feedback, self.name = compression, feedback, name
        #: The prepared call that runs this plan's repeats, where there is one.
        self.repeat: InlinePlan | NativePlan | None = None
        # compression="auto" decided after the agreement: its Auto (``compression`` is None).
        self.policy: Any = None
        # A call trying one of compression="auto"'s candidates: (trial, candidate key).
        self.trial: tuple[Any, str] | None = None

    @property
    def dense(self) -> bool:
        """Whether the data travels as it is (no compression, no error feedback, no
        compression still to be decided)."""
        return self.compression is None and self.feedback is None and self.policy is None


class PlanCache:
    """Checked plans of dense host allreduces, and of small host reduce-scatters, for their
    repeats."""

    __slots__ = ("_last", "_plans", "_scatters")

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], AllreducePlan] = {}
        self._scatters: dict[tuple[Any, ...], ScatterPlan] = {}
        # The last plan found, with its key's parts: a loop repeating one call finds it by
        # identity of dtype and op and equality of shape, without hashing a key.
        self._last: tuple[Any, Any, Any, AllreducePlan] | None = None

    def get(self, x: Array, op: Any) -> AllreducePlan | None:
        """The plan of a dense allreduce of ``x`` by ``op`` seen before, or None. Whether
        this call's ``out`` fits it is for the plan's repeat to say (``run``), or ``fits``."""
        if type(x) is not np.ndarray:  # device arrays: their device is checked every call
            return None
        last = self._last
        if last is not None and x.dtype is last[0] and op is last[2] and x.shape == last[1]:
            return last[3]
        try:
            plan = self._plans.get((x.dtype, x.shape, op))
        except TypeError:  # an unhashable op: the full check will say so
            return None
        if plan is not None:
            self._last = (x.dtype, x.shape, op, plan)
        return plan

    @staticmethod
    def fits(x: np.ndarray, out: Array | None) -> bool:
        """Whether ``out`` can take the result of a plan of ``x``'s call as it is: none
        given, or a writable host array of ``x``'s shape and dtype, ``x`` itself or apart
        from it (any strides: ``fitting_out``)."""
        return out is None or fitting_out(x, x.flags, out, contiguous=False)

    def put(self, x: Array, op: Any, plan: AllreducePlan, agreement: agree.Agreement,
            t: Transport, flat: bool) -> None:
        """Keep the checked plan of a dense allreduce of host array ``x``, which runs over
        ``t``; ``flat``: the call surely runs the flat ring (never the two-level allreduce)."""
        if type(x) is not np.ndarray:
            return
        self._last = None
        if len(self._plans) >= _LIMIT:
            self._plans.clear()
        if InlinePlan.applies(agreement, x):
            plan.repeat = InlinePlan(agreement, plan.spec, x, plan.op)
        elif flat:
            plan.repeat = NativePlan.prepare(agreement, t, plan.spec, x, plan.op)
        try:
            self._plans[(x.dtype, x.shape, op)] = plan
        except TypeError:
            pass

    def scatter(self, x: Any, op: Any) -> ScatterPlan | None:
        """The prepared reduce-scatter of host array ``x`` by ``op`` seen before, or None."""
        if type(x) is not np.ndarray:
            return None
        try:
            return self._scatters.get((x.dtype, x.shape, op))
        except TypeError:  # an unhashable op: the full check will say so
            return None

    def keep_scatter(self, x: Array, op: Any, spec: agree.CallSpec, rop: ReduceOp,
                     agreement: agree.Agreement) -> None:
        """Prepare the repeats of a checked reduce-scatter of ``x`` by ``op`` (``rop``
        once checked) that finished within the agreement, where a plan can serve them."""
        if not InlinePlan.applies(agreement, x):  # checked, host, contiguous, small
            return
        if len(self._scatters) >= _LIMIT:
            self._scatters.clear()
        try:
            self._scatters[(x.dtype, x.shape, op)] = ScatterPlan(agreement, spec, x, rop)
        except TypeError:
            pass

    def clear(self) -> None:
        """Forget every plan (settings that plans carry have changed)."""
        self._plans.clear()
        self._scatters.clear()
        self._last = None
