"""Reduction ops, dtype rules, wire statistics: the vocabulary every backend shares."""

from __future__ import annotations

import enum
from typing import Any, Protocol

import numpy as np

__all__ = [
    "SUPPORTED_DTYPES",
    "CommStats",
    "ReduceOp",
    "Request",
    "accumulation_dtype",
    "check_dtype",
    "check_movable",
    "check_op",
]


class ReduceOp(str, enum.Enum):
    """Reduction applied elementwise across ranks."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    # Hash like the plain string, so that "sum" and ReduceOp.SUM find the same dict entry.
    __hash__ = str.__hash__

    @classmethod
    def parse(cls, op: str | ReduceOp) -> ReduceOp:
        """Return the ReduceOp named by ``op`` ("sum", "avg", "min", "max", "prod").

        Raises:
            ValueError: ``op`` names no reduction.
        """
        try:
            return _OPS[op]
        except (KeyError, TypeError):
            pass
        if isinstance(op, str) and op.lower() in _OPS:
            return _OPS[op.lower()]
        names = ", ".join(repr(o.value) for o in cls)
        raise ValueError(f"unknown op {op!r}; expected one of {names}") from None


_OPS: dict[Any, ReduceOp] = {**{o.value: o for o in ReduceOp}, **{o: o for o in ReduceOp}}


# Order matters: the position is the dtype's code in the cross-rank consistency check.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")
)
# Dtypes already accepted, for a check that costs one dict lookup. bfloat16 (ml_dtypes on the
# host, CuPy/DLPack on the device) joins on first sight.
_ACCEPTED: dict[Any, np.dtype] = {dt: dt for dt in SUPPORTED_DTYPES}


def check_dtype(dtype: Any) -> np.dtype:
    """Return ``dtype`` as a NumPy dtype if ringcomm can reduce it.

    Raises:
        TypeError: complex, bool, object, string or any other dtype outside SUPPORTED_DTYPES.
    """
    dt = _ACCEPTED.get(dtype)
    if dt is not None:
        return dt
    dt = np.dtype(dtype)
    if dt in SUPPORTED_DTYPES or dt.name == "bfloat16":
        _ACCEPTED[dtype] = dt
        return dt
    names = ", ".join(d.name for d in SUPPORTED_DTYPES)
    raise TypeError(f"unsupported dtype {dt.name}; expected one of {names} or bfloat16")


def check_movable(dtype: Any) -> np.dtype:
    """Return ``dtype`` if collectives that only move bytes (broadcast, allgather) can carry it:
    any dtype but object (bool, int8, uint8, complex and bfloat16 included).

    Raises:
        TypeError: an object dtype (its elements are pointers, meaningless on another rank).
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"cannot send arrays of dtype {dt.name}: they hold Python objects")
    return dt


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype partial sums are kept in: float32 for 16-bit floats, the dtype itself otherwise."""
    return _FLOAT32 if dtype.itemsize == 2 and dtype.kind in "fV" else dtype


_FLOAT32 = np.dtype(np.float32)


def check_op(op: str | ReduceOp, dtype: np.dtype) -> ReduceOp:
    """Parse ``op`` and check it suits ``dtype``.

    Raises:
        ValueError: unknown op.
        TypeError: "avg" on an integer dtype (an integer mean would silently truncate).
    """
    rop = ReduceOp.parse(op)
    if rop is ReduceOp.AVG and dtype.kind in ("i", "u"):
        raise TypeError(
            f"op 'avg' needs a floating dtype, got {dtype.name}; use op='sum' and divide"
        )
    return rop


class CommStats:
    """What a communicator put on the wire since its creation or last ``reset()``.

    Bytes are counted where they are handed to the transport: every point-to-point message of
    ringcomm's own algorithms, and every agreement header. Collectives that are handed whole to
    the backend's library (allgather, allgatherv, broadcast) count the data each rank must
    receive and its own data once per peer that receives it, whatever algorithm the library
    picks. ``calls`` counts collective and point-to-point calls, not barriers.
    """

    __slots__ = ("bytes_received", "bytes_sent", "calls")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        self.bytes_sent = self.bytes_received = self.calls = 0

    def add(self, sent: int, received: int) -> None:
        """Count ``sent`` and ``received`` bytes."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def __repr__(self) -> str:
        return (
            f"CommStats(calls={self.calls}, bytes_sent={self.bytes_sent}, "
            f"bytes_received={self.bytes_received})"
        )


class Request(Protocol):
    """A posted point-to-point exchange; ``wait()`` returns once its buffers may be reused."""

    def wait(self) -> None: ...
