"""What the Communicator does to the arrays it is given before they travel: flat, aligned,
plain views, and the checks of ``out``."""

from __future__ import annotations

import numpy as np

from ringcomm import ops as _ops
from ringcomm.core.types import Array

__all__ = ["check_overlap", "check_writeable", "flat", "is_subclass", "plain"]


def check_writeable(x: Array, label: str) -> None:
    flags = getattr(x, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        raise ValueError(f"{label} is read-only; the result is written into it")


def flat(x: Array) -> Array:
    """A contiguous, aligned 1-d view of ``x`` (a copy only when ``x`` is neither).

    Unaligned host arrays (``np.frombuffer(buf, offset=1)``) are copied: MPI cannot send
    their elements as typed data.
    """
    if not getattr(x.flags, "aligned", True):
        return x.reshape(-1).copy()
    return _ops.get(x).ascontiguous(x).reshape(-1)


def is_subclass(a: Array) -> bool:
    """Whether ``a`` is a host ndarray subclass (memmap, matrix, ...)."""
    return (type(a) is not np.ndarray and isinstance(a, np.ndarray)
            and not _ops.is_device_array(a))


def plain(a: Array) -> Array:
    """A host ndarray subclass as a plain ndarray view of its memory; anything else as is."""
    return a.view(np.ndarray) if is_subclass(a) else a


def check_overlap(x: Array, out: Array) -> None:
    """Refuse an ``out`` that shares memory with ``x`` other than as the same elements (in
    place): the ring would read elements it has already overwritten."""
    if out is x or type(x) is not np.ndarray or not np.may_share_memory(x, out):
        return
    if out.ctypes.data == x.ctypes.data and out.strides == x.strides:
        return  # another view of the very same elements: in place
    raise ValueError("out overlaps x without being x: the result would overwrite input "
                     "still to be read; pass out=x to reduce in place, or a separate array")
