"""CPU operations: :mod:`ringcomm.ops.numpy` with its codecs compiled.

The int8 and 16-bit cast codecs (encode, decode and the fused hop, error feedback included) run
as Numba kernels (:mod:`ringcomm.ops._cpu_codecs`) that give the same bits as the NumPy
reference in one pass over memory instead of five to ten, and the exact top-k finds its
candidates in one compiled pass (:mod:`ringcomm.ops._cpu_topk`); every other operation is the
reference's own function. A call the kernels do not cover (an input that is not contiguous
float32, a 16-bit or float64 source) runs the reference, as does everything when Numba is
missing or its kernels fail to compile: that is logged once, as a warning, and the results stay
the same.

``ringcomm.ops.get`` returns this module for NumPy arrays unless ``RINGCOMM_CPU_KERNELS=numpy``
asks for the reference itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from ringcomm.core.log import get_logger
from ringcomm.core.types import Array
from ringcomm.ops import _topk_plan as _plan
from ringcomm.ops import numpy as _ref
from ringcomm.ops._host import int8_views, scratch, top
from ringcomm.ops.numpy import (
    ascontiguous,
    cast_nbytes,
    compensate,
    copy,
    copy_from_host,
    dense_limit,
    dense_runs,
    divide,
    empty,
    int8_nbytes,
    mark_dense_parts,
    matmul,
    outer_sum,
    outer_sum_parts,
    pad8,
    reduce,
    sample_threshold,
    scatter_add,
    sparse_residual,
    subtract_outer,
    subtract_outer_parts,
    to_host,
    topk_overflow,
    uniform,
    zero_nonfinite,
    zeros,
)

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
    "kernel",
    "kernels",
    "mark_dense_parts",
    "matmul",
    "outer_sum",
    "outer_sum_parts",
    "pad8",
    "prepare",
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

_LOG = get_logger("ops.cpu")
_F32 = np.dtype(np.float32)
_LOCK = threading.Lock()
# name -> compiled kernel, filled on first use of each.
_COMPILED: dict[str, Callable[..., Any]] = {}
# "module": the kernel registry once Numba is imported; None once the compiled path is off.
_STATE: dict[str, Any] = {}
# Passed where a kernel takes an error array but none is wanted (Numba's signatures are fixed).
_NO_ERROR = np.empty(0, np.float32)
_MASK = 0xFFFFFFFF  # seeds and counters are 32-bit, as in the reference
_MAG = np.uint32(0x7FFFFFFF)


def kernels() -> ModuleType | None:
    """The kernel registry (ops/_cpu_jit.py, Numba imported), or None when the compiled codecs
    are unusable: Numba missing, or a kernel failed to compile (logged once; the reference runs
    instead)."""
    if "module" not in _STATE:
        with _LOCK:
            if "module" not in _STATE:
                _STATE["module"] = _guarded("import Numba", _import)
    return _STATE["module"]


def kernel(name: str) -> Callable[..., Any] | None:
    """Compiled kernel ``name`` (compiled, or loaded from Numba's cache, on first use), or None
    when the compiled codecs are unusable."""
    fn = _COMPILED.get(name)
    if fn is not None:
        return fn
    module = kernels()
    if module is None:
        return None
    with _LOCK:
        if name not in _COMPILED and _STATE["module"] is not None:
            fn = _guarded(f"compile {name}", lambda: module.compile_kernel(name))
            if fn is None:  # one failure turns the whole compiled path off
                _STATE["module"] = None
                _COMPILED.clear()
            else:
                _COMPILED[name] = fn
    return _COMPILED.get(name)


def prepare(*names: str) -> bool:
    """Compile the kernels ``names`` (every kernel when none are given) now, rather than on
    first use; whether all of them are usable."""
    module = kernels()
    if module is None:
        return False
    return all(kernel(name) is not None for name in names or tuple(module.KERNELS))


def _import() -> ModuleType:
    """The kernel registry, with every kernel module imported (which registers its kernels)."""
    from ringcomm.ops import _cpu_codecs, _cpu_jit, _cpu_topk  # noqa: F401

    return _cpu_jit


def _guarded(what: str, step: Callable[[], Any]) -> Any:
    """``step()``, or None after logging why it failed (the first failure only: after it the
    compiled path is off for good)."""
    try:
        return step()
    # Whatever stops Numba (not installed, an llvmlite that does not load, a compiler error)
    # leaves the reference, which computes the same bits: a codec call never fails for it.
    except Exception as exc:
        _LOG.warning("compiled CPU codecs unavailable (%s failed: %s: %s); using the NumPy "
                     "reference, ringcomm.ops.numpy", what, type(exc).__name__, exc)
        return None


def _fits(a: Array, dtype: Any, size: int) -> bool:
    """Whether ``a`` is what a kernel's signature takes: a 1-D, contiguous, aligned, writeable
    NumPy array of ``dtype`` and ``size`` elements (anything else runs the reference, which
    raises where the arguments are wrong instead of writing past an array). Writeable even
    where the kernel only reads it: the signatures are of writeable arrays, and a read-only one
    (``np.frombuffer`` of bytes, a memory map, a caller's frozen array) would match none."""
    return (type(a) is np.ndarray and a.dtype == dtype and a.ndim == 1 and a.size == size
            and a.flags.c_contiguous and a.flags.aligned and a.flags.writeable)


def _bytes(payload: Array) -> bool:
    return type(payload) is np.ndarray and payload.dtype == np.uint8 and payload.ndim == 1


def _error_args(error: np.ndarray | None, n: int) -> tuple[np.ndarray, ...] | None:
    """A kernel's error argument: () without one, (error,) when it fits, None when it does
    not (the reference runs then)."""
    if error is None:
        return ()
    return (error,) if _fits(error, _F32, n) else None


def _stochastic_error(err: tuple[np.ndarray, ...]) -> tuple[np.ndarray, bool]:
    """The stochastic kernels' (error, with_error): their signatures always take an array."""
    return (err[0], True) if err else (_NO_ERROR, False)


def _int8_payload(payload: Array, n: int, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The (scales, q) views of an int8 payload of ``n`` elements, or None if they don't fit."""
    if not _bytes(payload):
        return None
    scales, q = int8_views(payload, n, block)
    ok = _fits(scales, _F32, -(-n // block)) and _fits(q, np.int8, n)
    return (scales, q) if ok else None


def _variant(name: str, stochastic: bool, error: np.ndarray | None) -> str:
    """The kernel specialized for the call: stochastic rounding, error output, or neither."""
    return f"{name}_stochastic" if stochastic else name if error is None else f"{name}_error"


def int8_encode(src: np.ndarray, out: np.ndarray, block: int, *, stochastic: bool = False,
                seed: int = 0, base: int = 0, error: np.ndarray | None = None) -> None:
    """Quantize float32 ``src`` into the int8 payload ``out`` (compiled
    :func:`ringcomm.ops.numpy.int8_encode`)."""
    n = src.size
    views = _int8_payload(out, n, block) if _fits(src, _F32, n) else None
    err = _error_args(error, n)
    fn = None if views is None or err is None else kernel(
        _variant("int8_encode", stochastic, error))
    if fn is None or views is None or err is None:
        _ref.int8_encode(src, out, block, stochastic=stochastic, seed=seed, base=base,
                         error=error)
    elif stochastic:
        fn(src, *views, block, seed & _MASK, base & _MASK, *_stochastic_error(err))
    else:
        fn(src, *views, block, *err)


def int8_decode(payload: np.ndarray, out: np.ndarray, block: int) -> None:
    """``out = q * scale`` of each block of the int8 payload (compiled
    :func:`ringcomm.ops.numpy.int8_decode`)."""
    n = out.size
    views = _int8_payload(payload, n, block) if _fits(out, _F32, n) else None
    fn = None if views is None else kernel("int8_decode")
    if fn is None or views is None:
        _ref.int8_decode(payload, out, block)
    else:
        fn(*views, block, out)


def int8_hop(payload: np.ndarray, own: np.ndarray, out: np.ndarray, block: int, *,
             stochastic: bool = False, seed: int = 0, base: int = 0,
             error: np.ndarray | None = None) -> None:
    """Decode ``payload``, add ``own``, re-quantize into ``out``, block by block in one pass
    (compiled :func:`ringcomm.ops.numpy.int8_hop`)."""
    n = own.size
    ok = _fits(own, _F32, n)
    received = _int8_payload(payload, n, block) if ok else None
    sent = _int8_payload(out, n, block) if ok else None
    err = _error_args(error, n)
    fn = None if received is None or sent is None or err is None else kernel(
        _variant("int8_hop", stochastic, error))
    if fn is None or received is None or sent is None or err is None:
        _ref.int8_hop(payload, own, out, block, stochastic=stochastic, seed=seed, base=base,
                      error=error)
        return
    acc = scratch("int8.block", min(n, block))
    if stochastic:
        fn(*received, own, *sent, block, seed & _MASK, base & _MASK, *_stochastic_error(err),
           acc)
    else:
        fn(*received, own, *sent, block, *err, acc)


def _words(payload: Array, n: int, fmt: str) -> np.ndarray | None:
    """The 16-bit words of a cast payload of ``n`` elements, or None if they don't fit."""
    if fmt not in ("f16", "bf16") or not _bytes(payload):
        return None
    words = payload[: 2 * n].view(np.uint16)
    return words if _fits(words, np.uint16, n) else None


def cast_encode(src: np.ndarray, out: np.ndarray, fmt: str, *,
                error: np.ndarray | None = None) -> None:
    """Round float32 ``src`` to ``fmt`` ("f16" or "bf16", nearest-even) into ``out`` (compiled
    :func:`ringcomm.ops.numpy.cast_encode`)."""
    n = src.size
    words = _words(out, n, fmt) if _fits(src, _F32, n) else None
    err = _error_args(error, n)
    fn = None if words is None or err is None else kernel(
        _variant(f"{fmt}_encode", False, error))
    if fn is None or words is None or err is None:
        _ref.cast_encode(src, out, fmt, error=error)
    else:
        fn(src, words, *err)


def cast_decode(payload: np.ndarray, out: np.ndarray, fmt: str) -> None:
    """Widen a 16-bit payload to float32 ``out`` (compiled
    :func:`ringcomm.ops.numpy.cast_decode`)."""
    n = out.size
    words = _words(payload, n, fmt) if _fits(out, _F32, n) else None
    fn = None if words is None else kernel(f"{fmt}_decode")
    if fn is None or words is None:
        _ref.cast_decode(payload, out, fmt)
    else:
        fn(words, out)


def cast_hop(payload: np.ndarray, own: np.ndarray, out: np.ndarray, fmt: str, *,
             error: np.ndarray | None = None) -> None:
    """Widen ``payload``, add ``own`` in float32, re-round into ``out`` in one pass (compiled
    :func:`ringcomm.ops.numpy.cast_hop`)."""
    n = own.size
    ok = _fits(own, _F32, n)
    received = _words(payload, n, fmt) if ok else None
    sent = _words(out, n, fmt) if ok else None
    err = _error_args(error, n)
    fn = None if received is None or sent is None or err is None else kernel(
        _variant(f"{fmt}_hop", False, error))
    if fn is None or received is None or sent is None or err is None:
        _ref.cast_hop(payload, own, out, fmt, error=error)
    else:
        fn(received, own, sent, *err)


def topk(x: np.ndarray, k: int, *, approximate: bool = False,
         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``k`` entries of float32 ``x`` as (int32 indices ascending, float32 values): what
    :func:`ringcomm.ops.numpy.topk` selects. The exact selection of a large array finds the
    entries at or above its sampled threshold in one compiled pass (the reference makes a keys
    array first, then three passes); the rest is the reference's."""
    n = x.size
    k = min(k, n)
    fn = None
    if not approximate and k > 0 and _plan.sampled(n, k) and _fits(x, _F32, n):
        fn = kernel("at_least")
    if fn is None:
        return _ref.topk(x, k, approximate=approximate, seed=seed)
    bits = x.view(np.uint32)
    rank = _plan.prefilter_rank(n, k)
    off, stride, size, want = _plan.sample_plan(n, rank, seed)
    # ops.numpy.sample_threshold, on the magnitudes of the sample only.
    sample = np.bitwise_and(bits[off::stride], _MAG).view(np.float32)
    threshold = np.partition(sample, size - want)[size - want]
    # A NaN threshold lets every entry through, as the reference's "not below" does.
    floor = 0 if np.isnan(threshold) else int(threshold.view(np.uint32))
    cand = scratch("topk.cand", 2 * rank + 64, np.int64)
    raw = scratch("topk.raw", 2 * rank + 64, np.uint32)
    count = fn(x, floor, cand, raw)
    if count > cand.size:
        cand, raw = np.empty(count, np.int64), np.empty(count, np.uint32)
        fn(x, floor, cand, raw)
    if count < k:  # too few passed: the reference selects from the whole array
        return _ref.topk(x, k, seed=seed)
    # The candidates' bits came with them: no scattered reads of x (two of them took a third
    # of the selection of 8 Mi floats).
    sel = top(np.bitwise_and(raw[:count], _MAG), k)
    return cand[sel].astype(np.int32), raw[sel].view(np.float32)
