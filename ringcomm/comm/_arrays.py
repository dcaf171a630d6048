"""What the Communicator does to the arrays it is given before they travel: flat, aligned,
plain views, and the checks of ``out``."""

from __future__ import annotations

import numpy as np

from ringcomm import ops as _ops
from ringcomm.core.types import Array

__all__ = ["apart", "check_overlap", "check_result_out", "check_writeable", "flat", "is_subclass",
           "plain"]


def check_writeable(x: Array, label: str) -> None:
    flags = getattr(x, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        raise ValueError(f"{label} is read-only; the result is written into it")


def check_result_out(x: Array, out: Array, size: int, what: str) -> None:
    """Refuse an ``out`` that cannot take a result of ``size`` elements of ``x``'s dtype,
    ``what`` (a gather's or a reduce-scatter's): another array kind or dtype, another
    element count, read-only, or not C-contiguous (the result is written as one block)."""
    if type(out) is not type(x):
        raise TypeError(f"out is a {type(out).__name__}, expected a {type(x).__name__}")
    if out.dtype != x.dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {x.dtype}")
    if out.size != size:
        raise ValueError(f"out has {out.size} elements {tuple(out.shape)}, expected {size} "
                         f"({what})")
    check_writeable(out, "out")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous: the result is written into it as one block")


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


def _span(a: Array) -> tuple[bool, int, int]:
    """(on a device, first byte, one past the last) of a contiguous array's memory."""
    if _ops.is_device_array(a):
        return True, int(a.data.ptr), int(a.data.ptr) + int(a.nbytes)
    start = int(a.__array_interface__["data"][0])
    return False, start, start + int(a.nbytes)


def apart(send: Array, recv: Array) -> Array:
    """``send``, or a copy of it where it shares memory with ``recv`` (both contiguous): a
    message received while the send still reads would overwrite what is still to be sent
    (``sendrecv(x, dest, x, source)``, a shift in place, gave wrong values from 1 MiB)."""
    if not send.nbytes or not recv.nbytes:
        return send
    (dev_s, lo_s, hi_s), (dev_r, lo_r, hi_r) = _span(send), _span(recv)
    if dev_s == dev_r and lo_s < hi_r and lo_r < hi_s:
        return send.copy()
    return send

