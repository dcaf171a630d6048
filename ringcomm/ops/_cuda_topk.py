"""Top-k by magnitude on the GPU: the twins of ops/numpy.py topk and sample_threshold.

Exact selection is a radix select on the magnitudes' bits (three histogram passes find the k-th
largest magnitude T and how many entries equal to T are taken) followed by an order-preserving
compaction: the output indices come out ascending without a sort, and ties at T go to the
lowest indices. No step waits for the GPU. On large arrays both paths first select the
threshold of a strided ~1% sample the same way and count, in one pass, the entries reaching it
and its halvings; after one wait for those counts, the exact path compacts the candidates and
selects among them, and the approximate path (DGC) writes the non-finite entries and then the
earliest entries that reach the threshold. The exact path aims the sampled threshold at 1.5k,
as NumPy does (ops/_topk_plan.py), so that the candidates nearly always hold the top k; when
they do not, it selects from the whole array. Both paths return exactly what NumPy returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.comm.log import get_logger
from ringcomm.ops import _cuda_runtime as _rt
from ringcomm.ops import _topk_plan as _plan

__all__ = ["sample_threshold", "topk"]

_TILE = 256 * 16  # SEL_TILE of kernels/topk.cu: elements per block of the count/write passes
_PASSES = ((20, 11), (10, 10), (0, 10))  # (shift, bits) of the digits, most significant first
_F32 = np.float32
_ALL = np.int64(1 << 62)  # "every one of them"
_HALVINGS = 9  # rows 0..8 of sample_limits: the threshold, halved up to 8 times
_NONFINITE, _EVERY = 9, 10  # rows of sample_limits: keys >= Inf; every key
_LOG = get_logger("ops.topk")


def _select(x: Any, off: int, stride: int, m: int, k: int) -> Any:
    """Radix-select the k-th largest key of x[off::stride][:m]; returns the state (uint32[8]:
    key prefix, mask, ties to take as int64, limits T + 1 and T)."""
    cupy = _rt.cp()
    state = cupy.zeros(8, np.uint32)
    hist = cupy.zeros(2048, np.uint32)
    vec = int(stride == 1 and off == 0 and x.data.ptr % 16 == 0)
    blocks = _rt.grid(-(-m // 4) if vec else m)
    for i, (shift, bits) in enumerate(_PASSES):
        _rt.launch("rc::select_hist", blocks,
                   (x, np.int64(off), np.int64(stride), np.int64(m), state, np.int32(shift),
                    np.int32(bits), hist, np.int32(vec)))
        _rt.launch("rc::select_pick", 1,
                   (hist, state, np.int32(shift), np.int32(bits), np.int64(k), np.int32(i == 0)))
    return state


def _count(x: Any, lims: Any, nthr: int) -> tuple[Any, Any]:
    """Per-tile counts of the keys at or above each of the nthr limits, and their totals."""
    cupy = _rt.cp()
    ntiles = -(-x.size // _TILE)
    counts = cupy.empty(nthr * ntiles, np.uint32)
    totals = cupy.zeros(nthr, np.uint32)
    _rt.launch("rc::select_count", ntiles,
               (x, np.int64(x.size), lims, np.int32(nthr), counts, np.int64(ntiles), totals))
    return counts, totals


def _scan(x: Any, counts: Any, *rows: int) -> Any:
    """Turn the counts rows a compaction uses into per-tile offsets (one block per row)."""
    ntiles = -(-x.size // _TILE)
    _rt.launch("rc::select_scan", len(rows),
               (counts, np.int64(ntiles), np.int32(rows[0]), np.int32(rows[-1])), threads=1024)
    return counts


def _write(x: Any, ids: Any | None, lims: Any, ja: int, jb: int, ka: int, kb: int,
           state: Any | None, offsets: Any, idx: Any, val: Any) -> None:
    """Write the first ka entries of class A and kb of class B (select_write in
    kernels/topk.cu) in index order into idx, val."""
    m = x.size
    ntiles = -(-m // _TILE)
    _rt.launch("rc::select_write", ntiles,
               (x, _rt.NULL if ids is None else ids, np.int64(m), lims, np.int32(ja),
                np.int32(jb), np.int64(ka), np.int64(kb), _rt.NULL if state is None else state,
                offsets, np.int64(ntiles), idx, val))


def _exact(x: Any, ids: Any | None, k: int, idx: Any, val: Any) -> None:
    """The top k of x (its entries named by ids, when given) into idx, val; no host wait."""
    state = _select(x, 0, 1, x.size, k)
    lims = state[4:]  # T + 1, T
    offsets = _scan(x, _count(x, lims, 2)[0], 0, 1)
    _write(x, ids, lims, 0, 1, _ALL, 0, state, offsets, idx, val)


def _sampled(x: Any, k: int, seed: int) -> tuple[Any, Any, list[int]]:
    """The sampled limits, the per-tile counts of the keys reaching each, and their totals
    (read back: the one wait, as the totals decide what follows and size its buffers)."""
    off, stride, size, want = _plan.sample_plan(x.size, k, seed)
    sampled = _select(x, off, stride, size, want)
    lims = _rt.cp().empty(_EVERY + 1, np.uint32)
    _rt.launch("rc::sample_limits", 1, (sampled, lims), threads=32)
    counts, totals = _count(x, lims, _EVERY + 1)
    return lims, counts, [int(t) for t in totals.get()]


def _prefiltered(x: Any, k: int, idx: Any, val: Any, sampled: tuple[Any, Any, list[int]]) -> None:
    """Exact top k, selected among the entries reaching the sampled threshold when at least k
    do (NumPy's exact path on large arrays: the same entries, ties aside)."""
    lims, counts, passing = sampled
    count = passing[0]
    if count < k or count == x.size:
        _LOG.debug("top-k: %d of %d entries reach the sampled threshold, k = %d: selecting "
                   "from all of them", count, x.size, k)
        _exact(x, None, k, idx, val)
        return
    offsets = _scan(x, counts, 0)
    if count == k:
        _write(x, None, lims, 0, -1, _ALL, 0, None, offsets, idx, val)
        return
    cupy = _rt.cp()
    cand_idx, cand_val = cupy.empty(count, np.int32), cupy.empty(count, _F32)
    _write(x, None, lims, 0, -1, _ALL, 0, None, offsets, cand_idx, cand_val)
    _exact(cand_val, cand_idx, k, idx, val)


def _first_above(k: int, x: Any, idx: Any, val: Any, sampled: tuple[Any, Any, list[int]]) -> None:
    """DGC: every non-finite entry, then the earliest entries reaching the threshold (halved up
    to eight times while fewer than k do; else the earliest of all), k in all."""
    lims, counts, passing = sampled
    h = next((j for j in range(_HALVINGS) if passing[j] >= k), _EVERY)
    bad = min(passing[_NONFINITE], k)
    offsets = _scan(x, counts, _NONFINITE, h)
    _write(x, None, lims, _NONFINITE, h, bad, k - bad, None, offsets, idx, val)


def _float32(x: Any) -> Any:
    if x.dtype == _F32 and x.flags.c_contiguous:
        return x
    return _rt.cp().ascontiguousarray(x, dtype=_F32)


def topk(x: Any, k: int, *, approximate: bool = False, seed: int = 0) -> tuple[Any, Any]:
    """Select ``k`` entries of float32 ``x`` by magnitude (see ops/numpy.py topk).

    NaN ranks above Inf and Inf above every number, so non-finite entries are always sent.
    Exact: the k largest magnitudes, ties at the k-th going to the lowest indices. Approximate
    (DGC, on arrays of 4096 elements or more and more than 4k): the non-finite entries, then the
    earliest entries reaching a threshold sampled from ~1% of the array.

    Args:
        x: float32 device array.
        k: entries to keep (at most x.size).
        approximate: DGC's selection instead of the k largest.
        seed: picks the sample's offset.

    Returns:
        (int32 indices ascending, float32 values), device arrays of min(k, x.size) entries.

    Raises:
        ValueError: x has 2**31 elements or more (indices are int32).
    """
    cupy = _rt.cp()
    n = x.size
    k = min(k, n)
    if k <= 0:
        return cupy.empty(0, np.int32), cupy.empty(0, _F32)
    if n >= 2**31:
        raise ValueError(f"top-k indices are int32: at most 2**31 - 1 elements, got {n}")
    x = _float32(x).reshape(-1)
    if k == n:
        return cupy.arange(n, dtype=np.int32), x.copy()
    idx = cupy.empty(k, np.int32)
    val = cupy.empty(k, _F32)
    if not _plan.sampled(n, k):
        _exact(x, None, k, idx, val)
    elif approximate:
        _first_above(k, x, idx, val, _sampled(x, k, seed))
    else:
        _prefiltered(x, k, idx, val, _sampled(x, _plan.prefilter_rank(n, k), seed))
    return idx, val


def sample_threshold(mag: Any, k: int, seed: int) -> float:
    """Estimate the k-th largest magnitude from a strided sample of about 1% (DGC).

    Args:
        mag: float32 magnitudes (NaN ranks above every number).
        k: the rank wanted in the whole array.
        seed: picks the sample's offset.

    Returns:
        The sample's ceil(k * size / n)-th largest value, as ops/numpy.py computes it.

    Raises:
        ValueError: ``mag`` is empty.
    """
    n = mag.size
    if n == 0:
        raise ValueError("sample_threshold needs a non-empty array")
    off, stride, size, want = _plan.sample_plan(n, k, seed)
    state = _select(_float32(mag).reshape(-1), off, stride, size, want)
    return float(state[:1].get().view(_F32)[0])
