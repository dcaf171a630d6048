"""Top-k by magnitude on the GPU: the twins of ops/numpy.py topk and sample_threshold.

Exact selection is a radix select on the magnitudes' bits (three histogram passes find the k-th
largest magnitude T and how many entries equal to T are taken) followed by an order-preserving
compaction: the output indices come out ascending without a sort, and ties at T go to the
lowest indices. On large arrays both paths first select the threshold of a strided ~1% sample
the same way and count, in one pass, the entries reaching it and its halvings. The exact path
aims that threshold at 1.5k, as NumPy does (ops/_topk_plan.py), compacts the entries reaching it
into a candidate buffer of bounded size and selects among them; when fewer than k reach it, or
more than the buffer holds, or all do, it selects from the whole array. The approximate path
(DGC) writes the non-finite entries and then the earliest entries that reach the threshold or
the first halving that k entries reach. Both return exactly what NumPy returns. With
``SINGLE_PASS`` (the default) the exact path counts and writes its candidates in one pass over
the array (select_compact, a decoupled look-back) instead of a counting pass and a writing pass.

No step waits for the GPU: which of those branches is taken depends on counts that only the
GPU knows, so the kernels decide it there (``select_scan`` writes a plan that the kernels after
it read; kernels/topk.cu), and every buffer is sized by what the host knows in advance (the
candidates' room below). The host enqueues the same launches whichever branch the data takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.core.types import Array
from ringcomm.ops import _cuda_runtime as _rt
from ringcomm.ops import _topk_plan as _plan

__all__ = ["candidate_room", "sample_threshold", "topk"]

_THREADS = 256  # SEL_THREADS of kernels/topk.cu: a block of select_pick's or select_compact's
_TILE = _THREADS * 16  # SEL_TILE: elements per block of the count/write passes
_PASSES = ((20, 11), (10, 10), (0, 10))  # (shift, bits) of the digits, most significant first
_BINS = 2048
_F32 = np.float32
_ALL = 1 << 62  # "every one of them"
_LIMITS = 11  # rows of sample_limits: the threshold halved 0..8 times, the non-finite, every key
_SCAN_ROWS, _PLAN_PREFILTER, _PLAN_DGC = 0, 1, 2  # select_scan's modes
_HIST_VEC_X, _HIST_VEC_CAND = 1, 2  # bits of select_hist's vec
#: Whether select_hist adds a warp's keys of one digit with one atomic (kernels/topk.cu). Off:
#: on an H200 (bench/results/gpu/gpu_check.md) plain shared-memory atomics took 74 us per pass
#: over 64 Mi gradients against 422 us aggregated (96 against 75 us on mostly-zero keys). The
#: kernel benchmark compares both.
AGGREGATE = False
#: Whether select_count over the whole array runs as one wave of blocks that loop over the
#: tiles (as it does where a plan decides the entries) instead of one block per tile. The
#: kernel benchmark compares both.
COUNT_WAVE = False
#: Whether the exact path compacts its candidates in one pass over the array (select_compact:
#: each tile finds where its entries go by looking back over the counts the tiles before it
#: published) instead of a pass that counts them and one that writes them; the two write the
#: same candidates. On an H200 (bench/results/gpu/gpu_check.md, 2026-12-04) one pass took an
#: exact top-k of 1% of 64 Mi float32 from 549 to 412 us; the kernel benchmark keeps timing both.
SINGLE_PASS = True
#: Whether select_hist's last block picks the digit itself (one launch a radix pass instead of
#: select_hist and select_pick: six fewer launches a call); the same state either way. With
#: SINGLE_PASS, 412 -> 402 us on the H200 (11 launches a call instead of 17).
FUSED_PICK = True
#: select_compact's ``prefixes``: 0 (tests only) makes every look-back walk to the first tile.
_LOOK_BACK_PREFIXES = 1
_NULL = _rt.NULL


def candidate_room(n: int, k: int) -> int:
    """Entries the exact path's candidate buffer holds: 4x the 1.5k the sampled threshold aims
    at, plus 64 sample strides (when k is tiny the threshold is the sample's maximum, and about
    one stride of entries reach it, with an exponential tail); beyond that, the whole array is
    selected from (a rare, slower path with the same result)."""
    _, stride, _, _ = _plan.sample_plan(n, k, 0)
    return min(n, 4 * _plan.prefilter_rank(n, k) + 64 * stride)


class _Scratch:
    """What the selections of one top-k call share, zeroed together (one memset): a histogram
    and the counter of select_hist's blocks that are done (each pass leaves both zero for the
    next), and, for a one-pass compaction of ``tiles`` tiles, its tiles' states and the next
    tile's number. The radix-select states need no zeroing: the first pass ignores them."""

    __slots__ = ("done", "hist", "next_tile", "states")

    def __init__(self, tiles: int = 0) -> None:
        at = _BINS // 2  # uint64 words: the histogram's uint32 bins, then the counter
        zeroed = _rt.cp().zeros(at + 1 + (tiles + 1 if tiles else 0), np.uint64)
        self.hist = zeroed[:at].view(np.uint32)
        self.done = zeroed[at: at + 1].view(np.uint32)
        self.states = zeroed[at + 1: at + 1 + tiles] if tiles else None
        self.next_tile = zeroed[at + 1 + tiles:].view(np.uint32) if tiles else None


def _i64(v: int) -> np.int64:
    return np.int64(v)


def _select(scratch: _Scratch, x: Array, off: int, stride: int, m: int, k: int,
            cand: Any | None = None, plan: Any | None = None) -> Any:
    """Radix-select the k-th largest key of x[off::stride][:m], or of the candidates ``cand``
    when ``plan`` says so; returns the state (uint32[8]: key prefix, mask, ties to take as int64,
    limits T + 1 and T)."""
    state = _rt.cp().empty(8, np.uint32)
    vec = _HIST_VEC_X if stride == 1 and off == 0 and x.data.ptr % 16 == 0 else 0
    if cand is not None and cand.data.ptr % 16 == 0:
        vec |= _HIST_VEC_CAND
    blocks = _rt.grid(-(-m // 4) if vec & _HIST_VEC_X else m)
    for i, (shift, bits) in enumerate(_PASSES):
        _rt.launch("rc::select_hist", blocks,
                   (x, _i64(off), _i64(stride), _i64(m), _NULL if cand is None else cand,
                    _NULL if plan is None else plan, state, np.int32(shift), np.int32(bits),
                    np.int32(i == 0), scratch.hist, np.int32(vec), np.int32(AGGREGATE),
                    _i64(k), scratch.done if FUSED_PICK else _NULL), threads=_THREADS)
        if not FUSED_PICK:
            _rt.launch("rc::select_pick", 1,
                       (scratch.hist, state, np.int32(shift), np.int32(bits), _i64(k),
                        np.int32(i == 0)), threads=_THREADS)
    return state


def _tile_blocks(m: int, decided: bool) -> int:
    """Blocks of the count/write passes over up to m entries: one per tile, or, when the plan
    decides on the device how many entries there are, a full wave that loops over the tiles."""
    tiles = max(1, -(-m // _TILE))
    return _rt.grid(tiles, 1) if decided else tiles


def _count(x: Array, lims: Any, nthr: int, totals: Any | None = None, cand: Any | None = None,
           plan: Any | None = None) -> Any:
    """Per-tile counts of the keys at or above each of the nthr limits (rows of x.size / tile
    entries), and their totals into ``totals`` when given."""
    ntiles = -(-x.size // _TILE)
    counts = _rt.cp().empty(nthr * ntiles, np.uint32)
    _rt.launch("rc::select_count", _tile_blocks(x.size, plan is not None or COUNT_WAVE),
               (x, _i64(x.size), _NULL if cand is None else cand, _NULL if plan is None else plan,
                lims, np.int32(nthr), counts, _i64(ntiles), _NULL if totals is None else totals))
    return counts


def _scan(x: Array, counts: Any, rows: tuple[int, ...], *, plan: Any | None = None,
          mode: int = _SCAN_ROWS, totals: Any | None = None, k: int = 0,
          room: int = 0) -> None:
    """Turn the counts rows a compaction uses into per-tile offsets (one block per row); in a
    PLAN_ mode the rows come from the plan that this launch decides and stores in ``plan``."""
    ntiles = -(-x.size // _TILE)
    deciding = mode != _SCAN_ROWS
    _rt.launch("rc::select_scan", len(rows),
               (counts, _i64(ntiles), _i64(x.size), _NULL if deciding or plan is None else plan,
                np.int32(rows[0]), np.int32(rows[-1]), np.int32(mode),
                _NULL if totals is None else totals, _i64(k), _i64(room),
                plan if deciding else _NULL), threads=1024)


def _write(x: Array, lims: Any, offsets: Any, idx: Array, val: Array, *, ja: int = 0, jb: int = -1,
           ka: int = _ALL, kb: int = 0, state: Any | None = None,
           cand: tuple[Any, Any] | None = None, src: Array | None = None,
           rows: Any | None = None) -> None:
    """Write the first ka entries of class A and kb of class B (select_write in
    kernels/topk.cu) in index order into idx, val: of x, or of the candidates (values, indices)
    ``cand`` when the plan ``src`` chose them; ``rows`` (a plan) replaces ja, jb, ka, kb."""
    m = x.size
    cval, cidx = cand if cand is not None else (_NULL, _NULL)
    _rt.launch("rc::select_write", _tile_blocks(m, src is not None),
               (x, _NULL, _i64(m), cval, cidx, _NULL if src is None else src,
                _NULL if rows is None else rows, lims, np.int32(ja), np.int32(jb), _i64(ka),
                _i64(kb), _NULL if state is None else state, offsets, _i64(-(-m // _TILE)), idx,
                val))


def _exact(scratch: _Scratch, x: Array, k: int, idx: Array, val: Array,
           cand: tuple[Any, Any] | None = None, plan: Any | None = None) -> None:
    """The top k of x, or of the candidates (values, indices) when ``plan`` chose them, into
    idx, val."""
    cval = None if cand is None else cand[0]
    state = _select(scratch, x, 0, 1, x.size, k, cval, plan)
    lims = state[4:]  # T + 1, T
    counts = _count(x, lims, 2, cand=cval, plan=plan)
    _scan(x, counts, (0, 1), plan=plan)
    _write(x, lims, counts, idx, val, ja=0, jb=1, state=state, cand=cand, src=plan)


def _limits(scratch: _Scratch, x: Array, k: int, seed: int,
            counted: bool = True) -> tuple[Any, Any]:
    """The limits of the sampled threshold (and its halvings), and the totals a count adds to
    (zeroed; None when not ``counted``), on the device."""
    off, stride, size, want = _plan.sample_plan(x.size, k, seed)
    sampled = _select(scratch, x, off, stride, size, want)
    cupy = _rt.cp()
    lims = cupy.empty(_LIMITS, np.uint32)
    totals = cupy.empty(_LIMITS, np.uint32) if counted else None
    _rt.launch("rc::sample_limits", 1, (sampled, lims, _NULL if totals is None else totals),
               threads=32)
    return lims, totals


def _sampled(scratch: _Scratch, x: Array, k: int, seed: int, nthr: int) -> tuple[Any, Any, Any]:
    """The limits of the sampled threshold (and its halvings), the per-tile counts of the keys
    reaching the first ``nthr`` of them, and their totals (all on the device)."""
    lims, totals = _limits(scratch, x, k, seed)
    return lims, _count(x, lims, nthr, totals), totals


def _prefiltered(scratch: _Scratch, x: Array, k: int, idx: Array, val: Array, seed: int) -> None:
    """Exact top k, selected among the entries reaching the sampled threshold when at least k
    and at most the candidates' room do (NumPy's exact path on large arrays: the same entries,
    ties aside), else from the whole array; decided on the device."""
    n = x.size
    cupy = _rt.cp()
    room = candidate_room(n, k)
    plan = cupy.empty(4, np.int64)
    cand = (cupy.empty(room, _F32), cupy.empty(room, np.int32))
    if scratch.states is not None:
        lims, _ = _limits(scratch, x, _plan.prefilter_rank(n, k), seed, counted=False)
        _rt.launch("rc::select_compact", scratch.states.size,
                   (x, _i64(n), lims, _i64(room), _i64(k), scratch.states, scratch.next_tile,
                    np.int32(_LOOK_BACK_PREFIXES), plan, cand[1], cand[0]), threads=_THREADS)
    else:
        lims, counts, totals = _sampled(scratch, x, _plan.prefilter_rank(n, k), seed, 1)
        _scan(x, counts, (0,), plan=plan, mode=_PLAN_PREFILTER, totals=totals, k=k, room=room)
        _write(x, lims, counts, cand[1], cand[0], rows=plan)
    _exact(scratch, x, k, idx, val, cand, plan)


def _first_above(scratch: _Scratch, x: Array, k: int, idx: Array, val: Array, seed: int) -> None:
    """DGC: every non-finite entry, then the earliest entries reaching the threshold (halved up
    to eight times while fewer than k do; else the earliest of all), k in all."""
    lims, counts, totals = _sampled(scratch, x, k, seed, _LIMITS)
    plan = _rt.cp().empty(4, np.int64)
    _scan(x, counts, (0, 1), plan=plan, mode=_PLAN_DGC, totals=totals, k=k)
    _write(x, lims, counts, idx, val, rows=plan)


def _float32(x: Array) -> Any:
    return _rt.converted(x, _F32)  # not CuPy's cast: it flushes float32 subnormals


def topk(x: Array, k: int, *, approximate: bool = False, seed: int = 0) -> tuple[Any, Any]:
    """Select ``k`` entries of float32 ``x`` by magnitude (see ops/numpy.py topk).

    NaN ranks above Inf and Inf above every number, so non-finite entries are always sent.
    Exact: the k largest magnitudes, ties at the k-th going to the lowest indices. Approximate
    (DGC, on arrays of 4096 elements or more and more than 4k): the non-finite entries, then the
    earliest entries reaching a threshold sampled from ~1% of the array. The host does not wait
    for the GPU.

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
        _exact(_Scratch(), x, k, idx, val)
    elif approximate:
        _first_above(_Scratch(), x, k, idx, val, seed)
    else:
        _prefiltered(_Scratch(-(-n // _TILE) if SINGLE_PASS else 0), x, k, idx, val, seed)
    return idx, val


def sample_threshold(mag: Array, k: int, seed: int) -> float:
    """Estimate the k-th largest magnitude from a strided sample of about 1% (DGC).

    Args:
        mag: float32 magnitudes (NaN ranks above every number).
        k: the rank wanted in the whole array.
        seed: picks the sample's offset.

    Returns:
        The sample's ceil(k * size / n)-th largest value, as ops/numpy.py computes it (read
        back from the GPU: the one function here that waits for it).

    Raises:
        ValueError: ``mag`` is empty.
    """
    n = mag.size
    if n == 0:
        raise ValueError("sample_threshold needs a non-empty array")
    off, stride, size, want = _plan.sample_plan(n, k, seed)
    state = _select(_Scratch(), _float32(mag).reshape(-1), off, stride, size, want)
    return float(state[:1].get().view(_F32)[0])
