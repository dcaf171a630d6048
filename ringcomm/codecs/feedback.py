"""Error feedback: what compression did not send is added to the next call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.core.types import Array

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residuals of lossy compression, one float32 vector per tensor (or bucket) name.

    A compressed allreduce with ``feedback=ef, name=n`` adds ``ef.residual(n)`` to its input,
    and stores back everything that did not reach the result: the first compression's error,
    each hop's re-compression error, the owner's final rounding, every dropped top-k entry. Over
    any number of calls, (sum of results) + (sum of all ranks' residuals) equals (sum of all
    inputs) to float rounding: no gradient mass is lost. A residual element that would be NaN or
    Inf is stored as 0 (the result already carries it), so a step skipped by a loss scaler does
    not poison the steps after it.

    Example::

        ef = ringcomm.ErrorFeedback()
        for step in range(steps):
            g = grad()
            g_avg = comm.allreduce(g, op="avg", compression=ringcomm.Int8(), feedback=ef,
                                   name="fc1.weight")
    """

    __slots__ = ("_residuals", "_within")

    def __init__(self) -> None:
        self._residuals: dict[str, Any] = {}
        # Where a residual may be nonzero, as an algorithm declared after writing it (the
        # hierarchical allreduce: this rank's shard); absent: anywhere.
        self._within: dict[str, tuple[int, int]] = {}

    def within(self, name: str) -> tuple[int, int] | None:
        """The span ``[lo, hi)`` outside which the residual of ``name`` is zero, as the last
        call that wrote it declared; (0, 0) before the first call; None: anywhere."""
        if name not in self._residuals:
            return (0, 0)
        return self._within.get(name)

    def declare_within(self, name: str, lo: int, hi: int) -> None:
        """Declare the residual of ``name`` zero outside ``[lo, hi)`` (by the algorithm that
        has just written it); ``take`` forgets the declaration."""
        self._within[name] = (lo, hi)

    def residual(self, name: str) -> Array | None:
        """The residual kept under ``name`` (a flat float32 array), or None before its first
        compressed call. It may be written by whoever it is handed to: the next call adds all
        of it (a declaration of where it is zero is forgotten)."""
        self._within.pop(name, None)
        return self._residuals.get(name)

    def holds(self, name: str) -> bool:
        """Whether a residual is kept under ``name`` (without handing it out)."""
        return name in self._residuals

    def length(self, name: str) -> int | None:
        """How many elements the residual kept under ``name`` has (without handing it out),
        or None where none is kept."""
        res = self._residuals.get(name)
        return None if res is None else int(res.size)

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name``, or all residuals."""
        if name is None:
            self._residuals.clear()
            self._within.clear()
        else:
            self._residuals.pop(name, None)
            self._within.pop(name, None)

    def names(self) -> list[str]:
        """Names that hold a residual."""
        return list(self._residuals)

    def __contains__(self, name: object) -> bool:
        return name in self._residuals

    def __iter__(self) -> Iterator[str]:
        return iter(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)

    def __repr__(self) -> str:
        return f"ErrorFeedback({len(self._residuals)} residuals)"

    def check(self, name: str, like: Array) -> None:
        """Raise ValueError if the residual kept under ``name`` cannot serve ``like``.

        Raises:
            ValueError: a residual of another length is stored under ``name`` (reset it when a
                tensor or bucket changes size), or it lives on another device.
        """
        res = self._residuals.get(name)
        if res is None:
            return
        if res.size != like.size:
            raise ValueError(
                f"residual {name!r} holds {res.size} elements but the tensor has {like.size}; "
                f"call feedback.reset({name!r}) when a tensor changes size")
        if _ops.is_device_array(res) != _ops.is_device_array(like):
            raise ValueError(f"residual {name!r} lives on another device than the tensor")

    def check_apart(self, name: str, **arrays: Array | None) -> None:
        """Raise ValueError if one of ``arrays`` (by their argument names) shares memory with
        the residual kept under ``name``: a call writes that residual while it reads its
        input and writes its result, so neither may be the residual (``residual(name)``)."""
        res = self._residuals.get(name)
        if res is None:
            return
        for label, a in arrays.items():
            if a is not None and _may_share_memory(res, a):
                raise ValueError(
                    f"{label} shares memory with the residual kept under {name!r} "
                    f"(feedback.residual({name!r})), which the call overwrites; pass a copy")

    def take(self, name: str, like: Array) -> Array:
        """The residual of ``name`` for a tensor like flat ``like``, created as zeros.

        Raises:
            ValueError: as ``check``.
        """
        self.check(name, like)
        self._within.pop(name, None)  # its taker may write anywhere
        res = self._residuals.get(name)
        if res is None:
            res = self._residuals[name] = _ops.get(like).zeros((like.size,), np.float32)
        return res


def _may_share_memory(a: Array, b: Array) -> bool:
    """Whether ``a`` and ``b`` may share memory (their bytes' bounds meet), host or device
    alike."""
    if _ops.is_device_array(a) != _ops.is_device_array(b):
        return False
    if not _ops.is_device_array(a):
        return bool(np.may_share_memory(a, b))
    (lo_a, hi_a), (lo_b, hi_b) = _device_bounds(a), _device_bounds(b)
    return lo_a < hi_b and lo_b < hi_a


def _device_bounds(a: Array) -> tuple[int, int]:
    """First byte and one past the last byte a device array's elements span."""
    start = int(a.data.ptr)
    if a.size == 0:
        return start, start
    low = sum(min(0, (n - 1) * s) for n, s in zip(a.shape, a.strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(a.shape, a.strides, strict=True))
    return start + low, start + high + a.itemsize
