"""Host-side helpers of the NumPy reference that its compiled build (:mod:`ringcomm.ops.cpu`)
shares: per-thread scratch buffers, the int8 payload's views, and the exact top-k selection.
They are not operations of the ops interface (no CUDA twin)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["int8_views", "scratch", "top"]

_F32 = np.float32


def int8_views(payload: np.ndarray, n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The (scales, values) views of an int8 payload of ``n`` elements in blocks of ``block``."""
    nb = -(-n // block)
    return payload[: 4 * nb].view(_F32), payload[4 * nb: 4 * nb + n].view(np.int8)


def scratch(tag: str, n: int, dtype: Any = _F32) -> np.ndarray:
    """A per-thread reusable buffer: the codecs run segment after segment, and fresh arrays
    would page-fault on every one."""
    cache = _SCRATCH.__dict__
    buf = cache.get(tag)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = cache[tag] = np.empty(max(n, 1), dtype)
    return buf[:n]


_SCRATCH = threading.local()


def top(keys: np.ndarray, k: int) -> np.ndarray:
    """Indices, ascending, of the ``k`` largest keys; of the entries tied at the k-th largest,
    those with the lowest indices (as the GPU's radix select takes them)."""
    n = keys.size
    if k >= n:
        return np.arange(n)
    kth = np.partition(keys, n - k)[n - k]
    cand = np.flatnonzero(keys >= kth)
    if cand.size > k:  # more ties at the k-th than fit: drop the last ones
        tie = keys[cand] == kth
        kept_ties = np.count_nonzero(tie) - (cand.size - k)
        cand = cand[~tie | (np.cumsum(tie) <= kept_ties)]
    return cand
