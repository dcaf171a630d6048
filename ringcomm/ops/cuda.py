"""CuPy operations: the twins of :mod:`ringcomm.ops.numpy` for arrays on a CUDA GPU.

Every function has the signature of its NumPy twin and computes the same values, bit for bit
(the kernels in ``kernels/`` round explicitly, as NumPy does, and follow NumPy's NaN handling);
the GPU tests compare each pair. Kernels launch on the current CuPy stream and device, which
must hold the arrays (as for CuPy's own operations). CuPy is imported on first use: without it,
or without a GPU, every function raises RuntimeError saying what to install.

Contiguous arrays of the dtypes the ring and the compressors use run the kernels; other layouts
and rare dtype combinations fall back on CuPy's elementwise operations, which give the same
values except where NumPy's own result is undefined (NaN or out-of-range floats cast to ints).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.core.types import Array, ReduceOp
from ringcomm.ops import _cuda_runtime as _rt
from ringcomm.ops import _cuda_source as _src
from ringcomm.ops import _topk_plan as _plan
from ringcomm.ops._cuda_codecs import (
    cast_decode,
    cast_encode,
    cast_hop,
    int8_decode,
    int8_encode,
    int8_hop,
)
from ringcomm.ops._cuda_topk import sample_threshold, topk
from ringcomm.ops.numpy import cast_nbytes, dense_limit, int8_nbytes, pad8

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

_F32 = np.float32
_COPY = {pair: _src.copy_name(*pair) for pair in _src.COPY_PAIRS}
_REDUCE = {
    (op, *dtypes): _src.reduce_name(op.value, *dtypes)
    for op in ReduceOp
    for dtypes in (*((t, t, t) for t in _src.CTYPES), *_src.REDUCE_MIXED)
}
_DIVIDE = {pair: _src.divide_name(*pair) for pair in _src.DIVIDE_PAIRS}


def _contiguous(*arrays: Array) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


_elementwise = _rt.elementwise


def empty(shape: Any, dtype: Any) -> Array:
    """An uninitialised device array.

    Args:
        shape: the array's shape.
        dtype: its dtype.

    Returns:
        A CuPy array.

    Raises:
        RuntimeError: CuPy or a GPU is missing.
    """
    return _rt.cp().empty(shape, dtype=dtype)


def zeros(shape: Any, dtype: Any) -> Array:
    """A device array of zeros (see ``empty``)."""
    return _rt.cp().zeros(shape, dtype=dtype)


def ascontiguous(x: Array) -> Array:
    """``x`` itself when C-contiguous, else a contiguous copy."""
    return x if x.flags.c_contiguous else _rt.cp().ascontiguousarray(x)


def to_host(x: Array) -> np.ndarray:
    """``x`` copied into a NumPy array (waits for the work that produces it)."""
    return x.get()


def copy_from_host(dst: Array, src: np.ndarray) -> None:
    """Copy host array ``src`` into device array ``dst``, converting the dtype like ``copy``.

    Args:
        dst: the device array to write.
        src: a NumPy array of ``dst``'s size.
    """
    src = np.asarray(src)
    if dst.flags.c_contiguous and src.dtype == dst.dtype and src.shape == dst.shape:
        dst.set(np.ascontiguousarray(src))
    else:
        copy(dst, _rt.cp().asarray(src))


def copy(dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` (same length), converting the dtype if they differ.

    Values beyond the range of ``dst``'s dtype become infinities, as a cast does.

    Args:
        dst: the device array to write.
        src: a device array of the same size.
    """
    n = dst.size
    if n == 0:
        return
    cupy = _rt.cp()
    same_layout = src.size == n and _contiguous(dst, src)
    if src.dtype == dst.dtype and same_layout:
        if dst.data.ptr == src.data.ptr:
            return  # the same array
        if _rt.overlap(dst, src):
            src = src.copy()
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)
        return
    name = _COPY.get((dst.dtype.name, src.dtype.name))
    if name is None or not same_layout:
        # Converted by ringcomm's kernel into a contiguous copy, then moved (CuPy's casts
        # flush float32 subnormals).
        src = _rt.converted(src, dst.dtype)
        dst[...] = (src.copy() if cupy.may_share_memory(dst, src) else src).reshape(dst.shape)
        return
    if _rt.overlap(dst, src):  # elements of different sizes: a write could clobber a read
        src = src.copy()
    _elementwise(name, n, (dst, src), dst, src)


def reduce(op: ReduceOp, a: Array, b: Array, out: Array) -> None:
    """``out = a (op) b`` elementwise; ``out`` may alias ``a`` or ``b``.

    Mixed dtypes are computed in the wider one (a float32 partial sum plus a float16
    contribution is a float32 addition) and rounded once into ``out``'s dtype.

    Args:
        op: the reduction (AVG adds, like SUM; the ring divides once at the end).
        a: first operand.
        b: second operand, of a's size.
        out: result array of a's size.
    """
    n = out.size
    if n == 0:
        return
    name = _REDUCE.get((op, a.dtype.name, b.dtype.name, out.dtype.name))
    if name is None or a.size != n or b.size != n or not _contiguous(a, b, out):
        _reduce_fallback(op, a, b, out)
        return
    _elementwise(name, n, (out, a, b), out, a, b)


def _reduce_fallback(op: ReduceOp, a: Array, b: Array, out: Array) -> None:
    """A dtype mix or layout without a kernel of its own: both operands converted to the wider
    dtype (contiguous), reduced by its kernel, rounded once into ``out``. Never CuPy's ufuncs
    where a kernel exists (they flush float32 subnormals)."""
    wide = np.result_type(a.dtype, b.dtype)
    name = _REDUCE.get((op, wide.name, wide.name, wide.name))
    a, b = _rt.converted(a, wide), _rt.converted(b, wide)
    if name is None:
        copy(out, getattr(_rt.cp(), ReduceOp.parse(op).spec.ufunc)(a, b))
        return
    result = _rt.cp().empty(a.shape, wide)
    _elementwise(name, a.size, (result, a, b), result, a, b)
    copy(out, result)


def divide(x: Array, divisor: int, out: Array) -> None:
    """``out = x / divisor``, computed in float32 for 16-bit floats, else in ``x``'s dtype.

    Args:
        x: the dividend.
        divisor: an integer (the number of ranks, for an average).
        out: result array of x's size (may be x).
    """
    n = out.size
    if n == 0:
        return
    name = _DIVIDE.get((x.dtype.name, out.dtype.name))
    if name is None or x.size != n or not _contiguous(x, out):
        dt = np.dtype(_F32) if x.dtype.itemsize == 2 else x.dtype
        x = _rt.converted(x, dt)
        own = _DIVIDE.get((dt.name, dt.name))
        if own is None:  # an integer dtype (never averaged: AVG refuses integers)
            copy(out, _rt.cp().divide(x, dt.type(divisor)))
            return
        quotient = _rt.cp().empty(x.shape, dt)
        _elementwise(own, x.size, (quotient, x, np.float64(divisor)), quotient, x)
        copy(out, quotient)
        return
    _elementwise(name, n, (out, x, np.float64(divisor)), out, x)


def compensate(x: Array, residual: Array | None, out: Array) -> None:
    """``out = float32(x) + residual``: the error-feedback input of a compressed call.

    Args:
        x: the input, of a floating dtype.
        residual: float32 residual of x's size, or None (then out = float32(x)).
        out: float32 result of x's size.
    """
    if residual is None:
        copy(out, x)
        return
    n = out.size
    ctype = _src.CTYPES.get(x.dtype.name)
    if n == 0 or x.dtype.name not in _src.FLOATS or not _contiguous(x, residual, out):
        if n:
            total = _rt.cp().empty(n, _F32)
            reduce(ReduceOp.SUM, _rt.converted(x, _F32).reshape(-1),
                   _rt.converted(residual, _F32).reshape(-1), total)
            copy(out, total)
        return
    _elementwise(f"rc::compensate_kernel<{ctype}>", n, (out, x, residual), out, x, residual)


def zero_nonfinite(x: Array) -> None:
    """Set NaN and Inf entries of ``x`` to 0, in place."""
    n = x.size
    if n == 0:
        return
    if x.dtype.name not in _src.FLOATS or not x.flags.c_contiguous:
        x[~_rt.cp().isfinite(x)] = 0
        return
    _elementwise(f"rc::zero_nonfinite_kernel<{_src.CTYPES[x.dtype.name]}>", n, (x,), x)


def uniform(seed: int, base: int, n: int) -> Any:
    """Counter-based uniforms in [0, 1): element i gets hash(seed, base + i).

    Args:
        seed: the stream's seed (taken modulo 2**32).
        base: the counter of element 0 (modulo 2**32).
        n: how many.

    Returns:
        A float32 device array of n values, equal to ``ops.numpy.uniform``'s.
    """
    out = _rt.cp().empty(n, _F32)
    if n:
        _rt.launch("rc::uniform_kernel", _rt.grid(n), (out, np.int64(n), _rt.u32(seed),
                                                       _rt.u32(base)))
    return out


def _pairs(idx: Array, val: Array | None = None) -> tuple[Any, Any]:
    """int32 indices and float32 values, contiguous (payload views already are)."""
    cupy = _rt.cp()
    idx = cupy.ascontiguousarray(idx, dtype=np.int32)
    return idx, None if val is None else _rt.converted(val, _F32)


def scatter_add(out: Array, idx: Array, val: Array) -> None:
    """``out[idx] += val`` for unique ``idx`` (one payload's indices never repeat).

    Args:
        out: float32 device array.
        idx: indices into out, no two equal.
        val: values to add, one per index.
    """
    k = idx.size
    if k == 0:
        return
    if out.dtype != _F32 or not out.flags.c_contiguous:
        if bool(idx[0] == _plan.OVERFLOW):  # waits for the GPU: a path for other layouts
            out[...] = np.nan
        else:
            out[idx] += val
        return
    idx, val = _pairs(idx, val)
    _rt.launch("rc::scatter_add_kernel", _rt.grid(k),
               (out, np.int64(out.size), idx, val, np.int64(k)))


def topk_overflow(x: Array, idx: Array, val: Array) -> None:
    """Mark a selection ``topk(x, k)`` that left non-finite entries of ``x`` behind: when all its
    k values are non-finite and ``x`` holds more than k NaN or Inf, its first pair becomes
    (``OVERFLOW``, NaN), which :func:`scatter_add` reads as "every entry is NaN". Decided on the
    device (one block, which reads ``x`` only in that case).

    Args:
        x: the float32 device array the pairs were selected from.
        idx: the selection's int32 indices, in place.
        val: its float32 values, in place.
    """
    k = idx.size
    if k == 0 or k >= x.size:
        return
    x = _rt.converted(x, _F32).reshape(-1)
    _rt.launch("rc::topk_overflow_kernel", 1, (x, np.int64(x.size), idx, val, np.int64(k)),
               threads=256)


def sparse_residual(acc: Array, idx: Array, error: Any) -> None:
    """``error = acc`` with the selected entries zeroed (what a top-k selection did not send).

    Args:
        acc: the float32 values the selection was made from.
        idx: the selected indices.
        error: float32 output of acc's size (may be acc itself); NaN and Inf become 0 in it.
    """
    n = error.size
    if n == 0:
        return
    if acc.dtype != _F32 or error.dtype != _F32 or not _contiguous(acc, error):
        copy(error, acc)
        error[idx[idx != _plan.OVERFLOW]] = 0
        zero_nonfinite(error)
        return
    if error.data.ptr == acc.data.ptr and error.size == acc.size:
        # In place (the sparse ring's residual): only groups holding NaN or Inf are written.
        zero_nonfinite(error)
    else:
        _elementwise("rc::finite_copy_kernel", n, (error, acc), error, acc)
    if idx.size:
        idx, _ = _pairs(idx)
        _rt.launch("rc::scatter_zero_kernel", _rt.grid(idx.size),
                   (error, idx, np.int64(idx.size)))


# ------------------------------------------------------------------------- low rank
def matmul(a: Array, b: Array, out: Array) -> None:
    """``out = a @ b`` with cuBLAS (rank-local products: the bits may differ from NumPy's)."""
    _rt.cp().matmul(a, b, out=out)


def _lowrank_args(mat: Array, pt: Array, qt: Array) -> tuple[Any, ...] | None:
    """The kernel arguments of a low-rank product, or None where a kernel does not apply."""
    arrays = (mat, pt, qt)
    if any(a.dtype != _F32 or not a.flags.c_contiguous for a in arrays) or mat.size == 0:
        return None
    n, m = mat.shape
    return (np.int64(n), np.int64(m), np.int32(pt.shape[0]))


def outer_sum(pt: Array, qt: Array, out: Array) -> None:
    """``out = P Q^T`` (``pt``: r x n, ``qt``: r x m) as a sum of outer products, rounded as
    NumPy's twin rounds them."""
    dims = _lowrank_args(out, pt, qt)
    if dims is None:
        if out.size:
            out[...] = pt[0][:, None] * qt[0][None, :]
            for k in range(1, pt.shape[0]):
                out += pt[k][:, None] * qt[k][None, :]
        return
    _rt.launch("rc::outer_sum_kernel", _rt.grid(out.size), (out, pt, qt, *dims))


def subtract_outer(mat: Array, pt: Array, qt: Array) -> None:
    """``mat -= P Q^T`` in place, one outer product at a time in k order."""
    dims = _lowrank_args(mat, pt, qt)
    if dims is None:
        for k in range(pt.shape[0]):
            mat -= pt[k][:, None] * qt[k][None, :]
        return
    _rt.launch("rc::subtract_outer_kernel", _rt.grid(mat.size), (mat, pt, qt, *dims))


# Every low-rank tensor of a call in one launch (twins: ops/numpy.py *_parts, dense_runs).
#: Blocks a tensor (or a dense run) gets at most in the one-launch passes.
_PART_BLOCKS = 1024


def _per_part(longest: int) -> np.int32:
    return np.int32(max(1, min(-(-longest // _rt.BLOCK), _PART_BLOCKS)))


def _parts_launch(name: str, table: Array, fields: int, longest: int,
                  args: tuple[Any, ...], tail: tuple[Any, ...] = ()) -> None:
    rows = table.size // fields
    if rows == 0 or longest == 0:
        return
    per = _per_part(longest)
    _rt.launch(name, rows * int(per), (*args, table, per, *tail))


def outer_sum_parts(out: Array, p: Array, q: Array, parts: Array, longest: int) -> None:
    """``out[at:at + n m] = P Q^T`` for every tensor of ``parts``, one launch."""
    _parts_launch("rc::outer_sum_parts_kernel", parts, 6, longest, (out, p, q))


def subtract_outer_parts(mat: Array, p: Array, q: Array, parts: Array, longest: int) -> None:
    """``mat[at:at + n m] -= P Q^T`` for every tensor of ``parts``, one launch."""
    _parts_launch("rc::subtract_outer_parts_kernel", parts, 6, longest, (mat, p, q))


def mark_dense_parts(mat: Array, p: Array, parts: Array, longest: int, ranks: int) -> None:
    """P^T's first entry NaN where the tensor's matrix holds a NaN, an Inf or an entry above
    ``ops.numpy.dense_limit`` in magnitude, one launch; no wait for the GPU."""
    _parts_launch("rc::mark_dense_parts_kernel", parts, 6, longest, (mat, p),
                  (np.int32(ranks),))


def dense_runs(dst: Array, src: Array, runs: Array, longest: int, *, take: bool = False,
               divisor: int = 0) -> None:
    """Copy runs of float32 ``src`` into ``dst`` (maybe divided, maybe taken out of ``src``),
    one launch."""
    _parts_launch("rc::dense_runs_kernel", runs, 3, longest, (dst, src),
                  (np.int32(take), np.float32(divisor)))
