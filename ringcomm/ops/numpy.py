"""NumPy operations: the CPU implementation and the reference for the CUDA kernels.

Every function here has a twin of the same name and signature in :mod:`ringcomm.ops.cuda`
that must compute the same values (bit for bit where the arithmetic is exact, to float32
rounding otherwise). Outputs are written into caller-provided arrays so the ring can reuse
buffers and keep peak memory down.

Why one module past 400 lines: ``ringcomm.ops.get(x)`` returns one module per array kind, and
this is NumPy's: its functions are the interface every kind implements, kept side by side with
their twins' names so that a missing or mismatched one shows (:mod:`ringcomm.ops.cpu` is this
module with its codecs compiled).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ringcomm.core.types import ReduceOp
from ringcomm.ops import _topk_plan as _plan
from ringcomm.ops._host import int8_views, scratch, top

__all__ = [
    "ascontiguous",
    "cast_decode",
    "cast_encode",
    "cast_hop",
    "cast_nbytes",
    "compensate",
    "copy",
    "copy_from_host",
    "dense_limit",
    "dense_runs",
    "divide",
    "empty",
    "int8_decode",
    "int8_encode",
    "int8_hop",
    "int8_nbytes",
    "mark_dense_parts",
    "matmul",
    "outer_sum",
    "outer_sum_parts",
    "pad8",
    "reduce",
    "sample_threshold",
    "scatter_add",
    "sparse_residual",
    "subtract_outer",
    "subtract_outer_parts",
    "to_host",
    "topk",
    "topk_overflow",
    "uniform",
    "zero_nonfinite",
    "zeros",
]

_UFUNCS = {op: getattr(np, op.spec.ufunc) for op in ReduceOp}


def empty(shape: Any, dtype: Any) -> np.ndarray:
    """An uninitialised array."""
    return np.empty(shape, dtype=dtype)


def zeros(shape: Any, dtype: Any) -> np.ndarray:
    """An array of zeros."""
    return np.zeros(shape, dtype=dtype)


def ascontiguous(x: np.ndarray) -> np.ndarray:
    """``x`` itself when C-contiguous, else a contiguous copy."""
    return np.ascontiguousarray(x)


def to_host(x: np.ndarray) -> np.ndarray:
    """``x`` as a host array (NumPy arrays already are)."""
    return x


def copy_from_host(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy host array ``src`` into ``dst`` (converting the dtype like ``copy``)."""
    copy(dst, src)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same length), converting the dtype if they differ.

    Values beyond the range of ``dst``'s dtype become infinities, as a cast does; no warning.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, src, casting="unsafe")


def reduce(op: ReduceOp, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a (op) b`` elementwise; ``out`` may alias ``a`` or ``b``.

    Mixed dtypes are computed in the wider one (a float32 partial sum plus a float16
    contribution is a float32 addition) and rounded once into ``out``'s dtype.
    """
    ufunc = _UFUNCS[op]
    if out.dtype == a.dtype == b.dtype:
        ufunc(a, b, out=out)
    else:
        ufunc(a, b, out=out, casting="unsafe", dtype=np.result_type(a.dtype, b.dtype))


def divide(x: np.ndarray, divisor: int, out: np.ndarray) -> None:
    """``out = x / divisor``, computed in float32 for 16-bit floats, else in ``x``'s dtype."""
    dt = np.dtype(np.float32) if x.dtype.itemsize == 2 else x.dtype
    np.divide(x, dt.type(divisor), out=out, dtype=dt, casting="unsafe")


# ------------------------------------------------------------------------- compression
# Payload layouts (shared with kernels/*.cu):
#   int8:  float32 scale per block, then one int8 per element, padded to 8 bytes
#   f16/bf16: one 16-bit word per element, padded to 8 bytes
#   top-k: k int32 indices (ascending), then k float32 values
_F32 = np.float32
_Q = np.float32(127.0)


def pad8(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 8, so the next payload starts aligned."""
    return (nbytes + 7) & ~7


def int8_nbytes(n: int, block: int) -> int:
    """Payload bytes of ``n`` elements quantized in blocks of ``block``."""
    return pad8(4 * (-(-n // block)) + n)


def _blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as (full blocks x block) and its partial tail block."""
    full = x.size // block * block
    return x[:full].reshape(-1, block), x[full:]


def _per_block(values: np.ndarray, x: np.ndarray, block: int, ufunc: np.ufunc,
               out: np.ndarray) -> None:
    """``out = ufunc(x, values[block of each element])``."""
    xb, xt = _blocks(x, block)
    ob, ot = _blocks(out, block)
    ufunc(xb, values[: xb.shape[0], None], out=ob)
    if xt.size:
        ufunc(xt, values[-1], out=ot)


def uniform(seed: int, base: int, n: int) -> np.ndarray:
    """Counter-based uniforms in [0, 1): element i gets hash(seed, base + i) (as the kernels)."""
    idx = np.arange(n, dtype=np.uint32) + np.uint32(base & 0xFFFFFFFF)
    h = idx * np.uint32(0x9E3779B1) + np.uint32(seed & 0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x7FEB352D)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x846CA68B)
    h ^= h >> np.uint32(16)
    return (h >> np.uint32(8)).astype(_F32) * _F32(1.0 / (1 << 24))


# The NaN a payload word carries for a NaN that arithmetic produced (a sum in a cast hop, an int8
# block's scale): the quiet NaN, as the kernels write it. The hardware's own NaN differs (x86
# keeps an operand's payload, a GPU returns 0x7fffffff), so both sides replace it.
_QUIET_NAN = np.uint32(0x7FC00000)


def _quiet_nans(x: np.ndarray) -> None:
    """Replace every NaN in float32 ``x`` by the quiet NaN 0x7fc00000, in place."""
    nan = np.isnan(x)
    if nan.any():
        x.view(np.uint32)[nan] = _QUIET_NAN


def _finite_error(src: np.ndarray, decoded: np.ndarray, error: np.ndarray) -> None:
    """``error = src - decoded``, with 0 where that is not finite (a NaN/Inf never becomes a
    residual that would poison the following steps; the result already carries it)."""
    with np.errstate(invalid="ignore"):
        np.subtract(src, decoded, out=error)
    zero_nonfinite(error)


# Blocks whose absmax lies outside [_TINY, _HUGE] (zero, subnormal-small, Inf, NaN) quantize to
# q = 0; 127 / absmax is finite for every block inside.
_TINY = np.float32(127) / np.finfo(np.float32).max
_HUGE = np.finfo(np.float32).max
# Below this scale (absmax < 2**127) q * scale cannot round past FLT_MAX; above it (absmax
# FLT_MAX itself) the codes +-127 decode to +-Inf, whose error is zeroed as a non-finite one.
_SCALE_MAY_OVERFLOW = np.float32(2.0**120)


def _block_absmax(src: np.ndarray, block: int, out: np.ndarray, tmp: np.ndarray) -> None:
    """``out[b] = max |src|`` over block b (NaN if the block holds one)."""
    np.abs(src, out=tmp)
    # reduceat runs twice as fast as max(axis=1) over rows of a few hundred elements.
    np.maximum.reduceat(tmp, _block_starts(src.size, block), out=out)


@functools.lru_cache(maxsize=64)
def _block_starts(n: int, block: int) -> np.ndarray:
    return np.arange(0, n, block)


def int8_encode(src: np.ndarray, out: np.ndarray, block: int, *, stochastic: bool = False,
                seed: int = 0, base: int = 0, error: np.ndarray | None = None) -> None:
    """Quantize float32 ``src`` into the int8 payload ``out``.

    Per block: scale = absmax / 127; q = rint(x * (127 / absmax)), or floor(x * (127 / absmax)
    + u) clipped to [-127, 127] with counter-based uniforms u when ``stochastic``. A block whose
    absmax is 0, below 127 / FLT_MAX, Inf or NaN gets q = 0: it decodes to 0 (tiny blocks, whose
    values then stay in the residual) or to NaN (q * Inf, q * NaN: a non-finite input never
    turns finite); a NaN block's scale is the quiet NaN 0x7fc00000, whatever the input NaN's
    payload. Subnormal values are kept, never flushed (the kernels are compiled without
    flush-to-zero). ``error``, when given, receives ``src - decode(out)`` (0 where not finite:
    also where the block's absmax is FLT_MAX, whose codes +-127 decode to +-Inf).
    """
    n = src.size
    scales, q = int8_views(out, n, block)
    t = scratch("int8.t", n)
    absmax = scratch("int8.absmax", scales.size)
    _block_absmax(src, block, absmax, t)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        np.divide(absmax, _Q, out=scales)
        good = (absmax >= _TINY) & (absmax <= _HUGE)
        clean = bool(good.all())
        if not clean:
            _quiet_nans(scales)
        inv = np.divide(_Q, absmax, out=np.zeros_like(absmax), where=good)
        _per_block(inv, src, block, np.multiply, t)
        if not clean:  # x * 0 is NaN for x = +-Inf or NaN
            np.nan_to_num(t, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        if stochastic:
            t += uniform(seed, base, n)
            np.floor(t, out=t)
            np.clip(t, -_Q, _Q, out=t)
        else:
            np.rint(t, out=t)  # |x * inv| <= 127 rounds to at most 127: no clip needed
        np.copyto(q, t, casting="unsafe")
        if error is not None:
            _per_block(scales, t, block, np.multiply, t)  # t holds q exactly: this is decode
            np.subtract(src, t, out=error)
            if not clean or (scales.size and scales.max() >= _SCALE_MAY_OVERFLOW):
                zero_nonfinite(error)


def int8_decode(payload: np.ndarray, out: np.ndarray, block: int) -> None:
    """``out = q * scale`` of each block of the int8 payload (``out`` is float32)."""
    scales, q = int8_views(payload, out.size, block)
    np.copyto(out, q, casting="unsafe")
    with np.errstate(invalid="ignore"):
        _per_block(scales, out, block, np.multiply, out)


def int8_hop(payload: np.ndarray, own: np.ndarray, out: np.ndarray, block: int, *,
             stochastic: bool = False, seed: int = 0, base: int = 0,
             error: np.ndarray | None = None) -> None:
    """One reduce-scatter hop: decode ``payload``, add ``own``, re-quantize into ``out``."""
    acc = scratch("int8.acc", own.size)
    int8_decode(payload, acc, block)
    np.add(acc, own, out=acc)
    int8_encode(acc, out, block, stochastic=stochastic, seed=seed, base=base, error=error)


def cast_nbytes(n: int) -> int:
    """Payload bytes of ``n`` elements cast to a 16-bit float."""
    return pad8(2 * n)


def _to_bf16_bits(src: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(src, dtype=_F32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(src)
    if nan.any():
        rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    return rounded.astype(np.uint16)


def cast_encode(src: np.ndarray, out: np.ndarray, fmt: str, *,
                error: np.ndarray | None = None) -> None:
    """Round float32 ``src`` to ``fmt`` ("f16" or "bf16", nearest-even) into ``out``."""
    words = out[: 2 * src.size]
    if fmt == "f16":
        with np.errstate(over="ignore"):
            words.view(np.float16)[:] = src
    else:
        words.view(np.uint16)[:] = _to_bf16_bits(src)
    if error is not None:
        decoded = np.empty(src.size, _F32)
        cast_decode(out, decoded, fmt)
        _finite_error(src, decoded, error)


def cast_decode(payload: np.ndarray, out: np.ndarray, fmt: str) -> None:
    """Widen a 16-bit payload to float32 ``out``."""
    words = payload[: 2 * out.size]
    if fmt == "f16":
        out[:] = words.view(np.float16)
    else:
        out.view(np.uint32)[:] = words.view(np.uint16).astype(np.uint32) << np.uint32(16)


def cast_hop(payload: np.ndarray, own: np.ndarray, out: np.ndarray, fmt: str, *,
             error: np.ndarray | None = None) -> None:
    """One reduce-scatter hop of a cast payload: decode, add ``own`` in float32, re-round.

    A NaN sum is sent as the quiet NaN (0x7e00 in f16, 0x7fc0 in bf16), whatever the payloads
    of the NaNs it came from: the GPU's addition would not keep them.
    """
    acc = np.empty(own.size, _F32)
    cast_decode(payload, acc, fmt)
    np.add(acc, own, out=acc)
    _quiet_nans(acc)
    cast_encode(acc, out, fmt, error=error)


_MAG_BITS = np.uint32(0x7FFFFFFF)


def _keys(x: np.ndarray) -> np.ndarray:
    """|x|'s float32 bits in a reused buffer: the keys the GPU's select ranks (ops/_topk_plan.py).
    Viewed as float32 they are the magnitudes, NaN (positive) included."""
    bits = np.ascontiguousarray(x, dtype=_F32).reshape(-1).view(np.uint32)
    return np.bitwise_and(bits, _MAG_BITS, out=scratch("topk.keys", bits.size, np.uint32))


def _at_least(mag: np.ndarray, thr: float) -> np.ndarray:
    """Indices where ``mag >= thr`` or NaN, in one comparison pass."""
    below = np.less(mag, thr, out=scratch("topk.mask", mag.size, np.bool_))
    np.logical_not(below, out=below)
    return np.flatnonzero(below)


def sample_threshold(mag: np.ndarray, k: int, seed: int) -> float:
    """DGC's estimate of the k-th largest magnitude from a strided sample of about 1%."""
    off, stride, size, want = _plan.sample_plan(mag.size, k, seed)
    sample = mag[off::stride]
    return float(np.partition(sample, size - want)[size - want])


def _first_above(mag: np.ndarray, k: int, thr: float) -> np.ndarray:
    """Every non-finite entry, then the earliest entries whose magnitude reaches ``thr`` (halved
    while fewer than ``k`` do), ``k`` in all."""
    above = _at_least(mag, thr)
    for _ in range(8):
        if above.size >= k:
            break
        thr /= 2
        above = _at_least(mag, thr)
    if above.size < k:
        above = np.arange(mag.size)
    finite = np.isfinite(mag[above])
    if finite.all():
        return above[:k]
    bad = above[~finite]
    return bad[:k] if bad.size >= k else np.concatenate([bad, above[finite][: k - bad.size]])


def topk(x: np.ndarray, k: int, *, approximate: bool = False,
         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``k`` entries of float32 ``x`` as (int32 indices ascending, float32 values).

    NaN ranks above Inf, and Inf above every number, so non-finite entries are always sent.
    Exact: the ``k`` largest magnitudes; of the entries tied at the k-th largest, those with the
    lowest indices (so the GPU selects the same ones). On large arrays the entries are first
    filtered with a threshold estimated from a 1% strided sample (Deep Gradient Compression),
    aimed at 1.5k, and only those are selected from: exact whenever at least ``k`` pass, else
    the whole array is selected from. Approximate (DGC): the earliest entries whose magnitude
    reaches the sampled threshold (halved while fewer than ``k`` do), without any partition:
    large entries, not necessarily the largest; what is skipped stays in the residual.
    """
    n = x.size
    k = min(k, n)
    if k <= 0:
        return np.empty(0, np.int32), np.empty(0, _F32)
    keys = _keys(x)
    mag = keys.view(_F32)
    if not _plan.sampled(n, k):
        idx = top(keys, k)
    elif approximate:
        idx = np.sort(_first_above(mag, k, sample_threshold(mag, k, seed)))
    else:
        cand = _at_least(mag, sample_threshold(mag, _plan.prefilter_rank(n, k), seed))
        idx = cand[top(keys[cand], k)] if cand.size >= k else top(keys, k)
    idx = idx.astype(np.int32)
    return idx, x.reshape(-1)[idx].astype(_F32)


def topk_overflow(x: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
    """Mark a selection ``topk(x, k)`` that left non-finite entries of ``x`` behind: when all
    its k values are non-finite and ``x`` holds more than k NaN or Inf, its first pair becomes
    (``OVERFLOW``, NaN), which :func:`scatter_add` reads as "every entry is NaN"."""
    k = idx.size
    if k == 0 or k == x.size or np.isfinite(val).any():
        return
    if k < x.size - int(np.count_nonzero(np.isfinite(x))):
        idx[0], val[0] = _plan.OVERFLOW, np.nan


def _overflowed(idx: np.ndarray) -> bool:
    return bool(idx.size) and bool(idx[0] == _plan.OVERFLOW)


def scatter_add(out: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
    """``out[idx] += val`` for unique ``idx`` (one payload's indices never repeat); every entry
    of ``out`` becomes NaN where the first pair is :func:`topk_overflow`'s mark."""
    if _overflowed(idx):
        out[...] = np.nan
    else:
        out[idx] += val


def compensate(x: np.ndarray, residual: np.ndarray | None, out: np.ndarray) -> None:
    """``out = float32(x) + residual``: the error-feedback input of a compressed call."""
    if residual is None:
        np.copyto(out, x, casting="unsafe")
    else:
        np.add(x, residual, out=out, dtype=_F32, casting="unsafe")


def zero_nonfinite(x: np.ndarray) -> None:
    """Set NaN and Inf entries of ``x`` to 0, in place."""
    bad = ~np.isfinite(x)
    if bad.any():
        x[bad] = 0


def sparse_residual(acc: np.ndarray, idx: np.ndarray, error: np.ndarray) -> None:
    """``error = acc`` with the entries ``topk`` selected zeroed (what it did not send); NaN
    and Inf left over become 0. ``idx`` must be what ``topk(acc, ...)`` returned; ``error``
    may be ``acc`` itself (no copy then)."""
    if _overflowed(idx):  # every selected entry is non-finite; the mark is not an entry
        idx = idx[1:]
    # Non-finite entries rank above every number, so they are all selected unless every selected
    # entry is non-finite: only then can one remain.
    clean = idx.size > 0 and bool(np.isfinite(acc[idx]).any())
    if error is not acc:
        np.copyto(error, acc)
    error[idx] = 0
    if not clean:
        zero_nonfinite(error)


# ------------------------------------------------------------------------- low rank
# PowerSGD's products (algorithms/powersgd.py). The result P Q^T and the residual M - P Q^T are
# sums of outer products, each product and sum rounded on its own (the same bits on every rank
# and device: kernels/lowrank.cu); the projections M Q and P^T M, which are rank-local and
# summed by the ring, are BLAS products.
def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ b`` (float32; the summation order is the library's, not fixed)."""
    np.matmul(a, b, out=out)


def outer_sum(pt: np.ndarray, qt: np.ndarray, out: np.ndarray) -> None:
    """``out = P Q^T`` (``pt``: r x n, ``qt``: r x m, float32, contiguous) as a sum of outer
    products in k order, a block of rows at a time (temporaries that stay in cache)."""
    for lo, hi in _row_blocks(out):
        block = out[lo:hi]
        np.multiply(pt[0, lo:hi, None], qt[0][None, :], out=block)
        for k in range(1, pt.shape[0]):
            block += pt[k, lo:hi, None] * qt[k][None, :]


def subtract_outer(mat: np.ndarray, pt: np.ndarray, qt: np.ndarray) -> None:
    """``mat -= P Q^T`` in place, one outer product at a time in k order (BLAS is slower at
    inner dimension r)."""
    blocks = _row_blocks(mat)
    for k in range(pt.shape[0]):
        for lo, hi in blocks:
            mat[lo:hi] -= np.multiply.outer(pt[k, lo:hi], qt[k])


# Every low-rank tensor of a call at once (PowerSGD): ``parts`` is int64 (k, 6), a row per
# tensor: its offset in the flat buffer, rows n, cols m, rank r, and where its P^T (r x n) and
# Q^T (r x m) start in their buffers. ``longest`` (the most elements of one tensor or run) sizes
# the GPU's launch; the host twins loop over the rows.
def _low_rank_parts(parts: np.ndarray, p: np.ndarray, q: np.ndarray
                    ) -> list[tuple[slice, int, int, np.ndarray, np.ndarray]]:
    out = []
    for at, n, m, r, po, qo in parts.tolist():
        pt = p[po: po + r * n].reshape(r, n)
        qt = q[qo: qo + r * m].reshape(r, m) if q.size else q
        out.append((slice(at, at + n * m), n, m, pt, qt))
    return out


def outer_sum_parts(out: np.ndarray, p: np.ndarray, q: np.ndarray, parts: np.ndarray,
                    longest: int) -> None:
    """``out[at:at + n m] = P Q^T`` for every tensor of ``parts`` (as :func:`outer_sum`)."""
    for span, n, m, pt, qt in _low_rank_parts(parts, p, q):
        outer_sum(pt, qt, out[span].reshape(n, m))


def subtract_outer_parts(mat: np.ndarray, p: np.ndarray, q: np.ndarray, parts: np.ndarray,
                         longest: int) -> None:
    """``mat[at:at + n m] -= P Q^T`` for every tensor of ``parts`` (as :func:`subtract_outer`)."""
    for span, n, m, pt, qt in _low_rank_parts(parts, p, q):
        subtract_outer(mat[span].reshape(n, m), pt, qt)


#: float32's largest finite value (a double, exactly).
_FLT_MAX = float(np.finfo(np.float32).max)


def dense_limit(rows: int, ranks: int, rank: int) -> float:
    """The largest magnitude of an entry of an n x m matrix that PowerSGD at rank r over
    ``ranks`` ranks reduces low-rank: Q = M^T P (P's entries at most 1) is at most n ranks
    times M's largest entry, the result r times Q's largest, so below FLT_MAX / (n ranks r)
    nothing overflows."""
    return _FLT_MAX / (float(rows) * float(ranks) * float(rank))


def mark_dense_parts(mat: np.ndarray, p: np.ndarray, parts: np.ndarray, longest: int,
                     ranks: int) -> None:
    """Set the first entry of a tensor's P^T to NaN where its matrix in ``mat`` holds a NaN,
    an Inf or an entry above :func:`dense_limit` in magnitude, for every tensor of
    ``parts``; leave the others."""
    for span, n, _, pt, _ in _low_rank_parts(parts, p, p[:0]):
        largest = float(np.max(np.abs(mat[span])))  # NaN where any is NaN
        if pt.size and not largest <= dense_limit(n, ranks, pt.shape[0]):
            pt.reshape(-1)[0] = np.nan


def dense_runs(dst: np.ndarray, src: np.ndarray, runs: np.ndarray, longest: int, *,
               take: bool = False, divisor: int = 0) -> None:
    """Copy runs of float32 ``src`` into ``dst`` (``runs``: int64 (k, 3), a row per run: its
    offset in src, its offset in dst, its length); ``take``: zero them in ``src`` afterwards;
    ``divisor`` > 0: ``dst = src / divisor`` (float32)."""
    for at, to, length in runs.tolist():
        values = src[at: at + length]
        if divisor > 0:
            np.divide(values, _F32(divisor), out=dst[to: to + length])
        else:
            dst[to: to + length] = values
        if take:
            values[...] = 0


def _row_blocks(mat: np.ndarray, block_bytes: int = 1 << 18) -> list[tuple[int, int]]:
    rows = max(1, block_bytes // max(1, 4 * mat.shape[1]))
    return [(lo, min(lo + rows, mat.shape[0])) for lo in range(0, mat.shape[0], rows)]
