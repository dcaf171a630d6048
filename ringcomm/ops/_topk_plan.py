"""The sizes both top-k twins (ops/numpy.py and ops/_cuda_topk.py) compute the same way, so that
they select the same entries: when a threshold is sampled, the strided sample it is taken from,
and the rank the exact path's prefilter aims that threshold at.

Keys order entries by magnitude: ``|x|``'s float32 bits as an unsigned integer, which order like
the magnitudes, with Inf above every number and NaN above Inf (by payload among NaNs). Ties at
the k-th largest key go to the lowest indices on both sides.
"""

from __future__ import annotations

__all__ = ["OVERFLOW", "SMALL", "prefilter_rank", "sample_plan", "sampled"]

#: The index of the pair (first of a selection, its value NaN) that says a selection could not
#: carry every non-finite entry of what it was selected from (more than k of them): whoever
#: adds the pairs makes every entry NaN, so that no NaN or Inf comes out finite.
OVERFLOW = -1

#: Arrays shorter than this are selected exactly, without a sampled threshold.
SMALL = 4096


def sampled(n: int, k: int) -> bool:
    """Whether top-k of ``n`` entries goes through a sampled threshold (large arrays, k < n/4)."""
    return n >= SMALL and n > 4 * k


def sample_plan(n: int, k: int, seed: int) -> tuple[int, int, int, int]:
    """DGC's strided sample of about 1% of ``n`` entries, aimed at the k-th largest.

    Returns:
        (offset, stride, size, want): the sample is ``x[offset::stride]`` (``size`` entries) and
        its ``want``-th largest magnitude estimates the k-th largest of the whole array.
    """
    stride = max(1, n // max(1024, n // 100))
    off = seed % stride
    size = len(range(off, n, stride))
    return off, stride, size, min(size, max(1, -(-k * size // n)))


def prefilter_rank(n: int, k: int) -> int:
    """The rank the exact path's sampled threshold aims at: 1.5k (plus a few), so that at least
    k entries pass it on all but rare samples; fewer cost a full select of the array."""
    return min(n, k + k // 2 + 8)
