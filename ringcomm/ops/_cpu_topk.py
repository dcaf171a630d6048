"""The compiled candidate pass of the exact top-k: one read of the array, no keys array.

``ringcomm.ops.cpu.topk`` selects what ops/numpy.py's ``topk`` selects; only the pass that finds
the entries at or above the sampled threshold runs here, on the magnitudes' bits: for
non-negative floats the integer order is the float order, NaN above Inf.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.core.types import Array
from ringcomm.ops._cpu_jit import kernel

__all__: list[str] = []  # reached through ops/_cpu_jit.py's registry

_MAG = np.uint32(0x7FFFFFFF)


@kernel("int64(float32[::1], uint32, int64[::1], uint32[::1])")
def at_least(x: Array, threshold: Any, out: Array, raw: Array) -> Any:
    """The indices, ascending, where |x|'s bits are at least ``threshold`` (the bits of a
    magnitude; 0 takes every entry): ops.numpy._at_least of |x|, NaN included, with those
    entries' bits in ``raw`` (so that the selection among them reads no more of ``x``). The
    first ``out.size`` are written; returns how many there are in all (more than ``out.size``:
    call again with room)."""
    bits = x.view(np.uint32)
    count = 0
    for i in range(bits.size):
        b = bits[i]
        if np.uint32(b & _MAG) >= threshold:
            if count < out.size:
                out[count] = i
                raw[count] = b
            count += 1
    return count
