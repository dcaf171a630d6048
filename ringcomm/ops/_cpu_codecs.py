"""Compiled int8 and 16-bit cast codecs: Numba kernels with the exact semantics of ops/numpy.py.

Each kernel does in one pass over memory what the NumPy reference does in five to ten: an int8
block is read once, its absmax taken, then quantized while still in the L1 cache; a 16-bit cast
rounds, writes and (with error feedback) decodes again element by element. The arithmetic is the
reference's, operation for operation in float32, so the results are the same bits:

- IEEE float32 arithmetic throughout (no fast-math: ops/_cpu_jit.py);
- float32 -> float16 rounds with float arithmetic (the same under flush-to-zero), NaN words
  built as NumPy builds them (payload kept, never quieted);
- integer work is truncated to 32 bits after every step, so LLVM vectorizes it on 32-bit lanes
  (Numba widens integer arithmetic to 64 bits);
- the per-element loops are specialized at compile time for stochastic rounding and error
  output, one kernel per combination: a flag tested inside them costs twice the time.

The kernels take the payload's views (int8: scales and q; casts: 16-bit words) from the
wrappers in ops/cpu.py, which check every array against the signature first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ringcomm.core.types import Array
from ringcomm.ops._cpu_jit import inline, kernel

__all__: list[str] = []  # kernels are reached through ops/_cpu_jit.py's registry

_U = np.uint32
_F = np.float32


if TYPE_CHECKING:
    # What the kernels call: Numba passes the typing context itself (numba's stubs give an
    # intrinsic's __call__ the definition's parameters, typingctx included).
    def _f32_from_bits(u: Any) -> Any: ...

    def _bits_of_f32(f: Any) -> Any: ...
else:
    @intrinsic
    def _f32_from_bits(typingctx: Any, u: Any) -> Any:
        """The float32 whose bits are the low 32 bits of integer ``u``."""
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            v = args[0]
            if v.type.width > 32:
                v = builder.trunc(v, ir.IntType(32))
            return builder.bitcast(v, ir.FloatType())
        return types.float32(u), codegen

    @intrinsic
    def _bits_of_f32(typingctx: Any, f: Any) -> Any:
        """The bits of float32 ``f`` as a uint32."""
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen


# ------------------------------------------------------------------------------ scalar helpers
_MAG = _U(0x7FFFFFFF)
_INF_BITS = _U(0x7F800000)
_QUIET_NAN = _U(0x7FC00000)
_Q = _F(127.0)
_TINY = _F(127) / np.finfo(_F).max
_HUGE = np.finfo(_F).max
_TO_INF = _F(2.0**112)
_TO_ZERO = _F(2.0**-110)
_HALF_SUBNORMAL = _F(2.0**-24)
# Below this scale (absmax < 2**127) q * scale cannot round past FLT_MAX.
_SCALE_MAY_OVERFLOW = _F(2.0**120)


@inline
def _uniform(seed: Any, base: Any, i: Any) -> Any:
    """ops.numpy.uniform's value for element ``i`` (32-bit hash of seed and base + i)."""
    h = _U(_U(_U(base + i) * _U(0x9E3779B1)) + seed)
    h = _U(h ^ _U(h >> _U(16)))
    h = _U(h * _U(0x7FEB352D))
    h = _U(h ^ _U(h >> _U(15)))
    h = _U(h * _U(0x846CA68B))
    h = _U(h ^ _U(h >> _U(16)))
    return _F(np.int32(h >> _U(8))) * _F(1.0 / (1 << 24))


@inline
def _f16_bits(f: Any) -> Any:
    """float32 -> IEEE half bits, nearest-even; a NaN as NumPy converts it (sign, then 0x7c00
    plus the top 10 payload bits, 0x7c01 if those are 0). Non-NaN values by float arithmetic
    (M. Dukhan's FP16 library); its only subnormal intermediates come from inputs that round
    to +-0 whatever happens to them, so flush-to-zero does not change the result."""
    w = _bits_of_f32(f)
    base = (abs(f) * _TO_INF) * _TO_ZERO
    shl1 = _U(w + w)
    bias = max(_U(shl1 & _U(0xFF000000)), _U(0x71000000))
    base = _f32_from_bits(_U(_U(bias >> _U(1)) + _U(0x07800000))) + base
    bits = _bits_of_f32(base)
    value = _U(_U(_U(bits >> _U(13)) & _U(0x7C00)) + _U(bits & _U(0x0FFF)))
    nan = _U(_U(0x7C00) + _U(_U(w & _U(0x007FFFFF)) >> _U(13)))
    nan = nan + _U(1) if nan == _U(0x7C00) else nan
    word = nan if shl1 > _U(0xFF000000) else value
    return np.uint16(_U(word | _U(_U(w >> _U(16)) & _U(0x8000))))


@inline
def _f16_value(h: Any) -> Any:
    """IEEE half bits -> float32, exactly; NaN payloads shifted up, never quieted (as NumPy)."""
    w = _U(h)
    exp = _U(w & _U(0x7C00))
    shifted = _U(_U(w & _U(0x7FFF)) << _U(13))
    bits = _U(shifted + _U(0x70000000)) if exp == _U(0x7C00) else _U(shifted + _U(0x38000000))
    # Zero or subnormal: the significand times 2**-24, exact.
    tiny = _bits_of_f32(_F(np.int32(w & _U(0x3FF))) * _HALF_SUBNORMAL)
    bits = tiny if exp == _U(0) else bits
    return _f32_from_bits(_U(bits | _U(_U(w & _U(0x8000)) << _U(16))))


@inline
def _bf16_bits(f: Any) -> Any:
    """float32 -> bfloat16 bits, nearest-even; a NaN keeps its top bits and is quieted."""
    b = _bits_of_f32(f)
    rounded = _U(_U(_U(b + _U(0x7FFF)) + _U(_U(b >> _U(16)) & _U(1))) >> _U(16))
    nan = _U(_U(b >> _U(16)) | _U(0x40))
    return np.uint16(nan if _U(b & _MAG) > _INF_BITS else rounded)


@inline
def _bf16_value(h: Any) -> Any:
    return _f32_from_bits(_U(_U(h) << _U(16)))


@inline
def _finite_or_zero(x: Array) -> Any:
    return x if np.isfinite(x) else _F(0)


# -------------------------------------------------------------------------------------- int8
# The per-element loops are specialized at compile time for stochastic rounding and error
# output (one entry point per combination): a flag tested inside them costs twice the time.
@inline
def _absmax_bits(x: Array) -> Any:
    """max |x| over the block, as bits: for non-negative floats the integer order is the float
    order, NaN above Inf, and an integer max vectorizes where a float one cannot (NaN)."""
    bits = x.view(np.uint32)
    m = _U(0)
    for i in range(bits.size):
        m = max(m, _U(bits[i] & _MAG))
    return m


@inline
def _block_scale(x: Array, scales: Any, b: Array) -> Any:
    """Write block ``b``'s scale (absmax / 127, the quiet NaN for a NaN block) and return the
    factor 127 / absmax, or 0 where absmax is 0, below 127 / FLT_MAX, Inf or NaN."""
    m = _absmax_bits(x)
    absmax = _f32_from_bits(m)
    scales[b] = _f32_from_bits(_QUIET_NAN) if m > _INF_BITS else absmax / _Q
    return _Q / absmax if absmax >= _TINY and absmax <= _HUGE else _F(0)


@inline
def _rounded(v: Any, stochastic: Any, seed: Any, base: Any, i: Any) -> Any:
    """rint(v), or floor(v + u) clipped to +-127 (u: element i's uniform)."""
    if stochastic:
        return min(max(np.floor(v + _uniform(seed, base, i)), -_Q), _Q)
    return np.rint(v)


@inline
def _quantize_block(x: Array, q: Any, inv: Any, scale: Any, stochastic: Any, seed: Any,
                    base: Any, error: Any, with_error: Any) -> Any:
    """q = rounded(x * inv) as ops.numpy.int8_encode; error = x - q * scale. ``base`` is the
    global index of x[0].

    Returns whether an error came out non-finite in a finite block (q * scale rounds past
    FLT_MAX when absmax is FLT_MAX itself), for the caller to zero (``_zero_overflowed``)."""
    n = x.size
    if inv == _F(0):  # 0, tiny, Inf or NaN: q = 0, non-finite errors zeroed
        for i in range(n):
            t = _rounded(_finite_or_zero(x[i] * inv), stochastic, seed, base, i)
            q[i] = np.int8(t)  # t is +-0, whose sign the error keeps
            if with_error:
                error[i] = _finite_or_zero(x[i] - t * scale)
        return False
    for i in range(n):  # x * inv is finite and within +-127
        t = _rounded(x[i] * inv, stochastic, seed, base, i)
        q[i] = np.int8(t)
        if with_error:
            error[i] = x[i] - t * scale
    overflow = False
    if with_error and scale >= _SCALE_MAY_OVERFLOW:
        for i in range(n):
            overflow |= not np.isfinite(error[i])
    return overflow


@inline
def _zero_overflowed(error: Any, overflow: Any) -> None:
    """The reference's ``zero_nonfinite(error)`` for the errors of finite blocks, where one
    overflowed (the other blocks' are zeroed already)."""
    if overflow:
        for i in range(error.size):
            error[i] = _finite_or_zero(error[i])


@inline
def _encode(src: Array, scales: Any, q: Any, block: Any, stochastic: Any, seed: Any, base: Any,
            error: Any, with_error: Any) -> None:
    n = src.size
    overflow = False
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        x = src[lo:hi]
        inv = _block_scale(x, scales, b)
        overflow |= _quantize_block(x, q[lo:hi], inv, scales[b], stochastic, seed,
                                    _U(base + lo), error[lo:hi], with_error)
    if with_error:
        _zero_overflowed(error, overflow)


@inline
def _hop(scales_in: Any, q_in: Any, own: Array, scales: Any, q: Any, block: Any, stochastic: Any,
         seed: Any, base: Any, error: Any, with_error: Any, acc: Array) -> None:
    """Decode + own into ``acc`` (one block long, stays in cache), then quantize it. A block is
    read before it is written, so ``q``/``scales`` may be the input payload's own views."""
    n = own.size
    overflow = False
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        x = acc[: hi - lo]
        _decode_block(q_in[lo:hi], scales_in[b], x)
        ow = own[lo:hi]
        for i in range(x.size):
            x[i] = x[i] + ow[i]
        inv = _block_scale(x, scales, b)
        overflow |= _quantize_block(x, q[lo:hi], inv, scales[b], stochastic, seed,
                                    _U(base + lo), error[lo:hi], with_error)
    if with_error:
        _zero_overflowed(error[:n], overflow)


@inline
def _decode_block(q: Any, scale: Any, out: Array) -> None:
    for i in range(q.size):
        out[i] = _F(q[i]) * scale


_F32 = "float32[::1]"
_ENC = f"{_F32}, {_F32}, int8[::1], int64"  # src, scales, q, block
_HOP = f"{_F32}, int8[::1], {_F32}, {_F32}, int8[::1], int64"  # + own, out's scales and q
_RNG = "uint32, uint32"  # seed, base


@kernel(f"void({_ENC})")
def int8_encode(src: Array, scales: Any, q: Any, block: Any) -> None:
    """ops.numpy.int8_encode into the payload's ``scales`` and ``q`` views."""
    _encode(src, scales, q, block, False, _U(0), _U(0), src, False)


@kernel(f"void({_ENC}, {_F32})")
def int8_encode_error(src: Array, scales: Any, q: Any, block: Any, error: Any) -> None:
    """int8_encode with the error-feedback output."""
    _encode(src, scales, q, block, False, _U(0), _U(0), error, True)


@kernel(f"void({_ENC}, {_RNG}, {_F32}, boolean)")
def int8_encode_stochastic(src: Array, scales: Any, q: Any, block: Any, seed: Any, base: Any,
                           error: Any, with_error: Any) -> None:
    """int8_encode with stochastic rounding (``error`` written when ``with_error``)."""
    _encode(src, scales, q, block, True, seed, base, error, with_error)


@kernel(f"void({_F32}, int8[::1], int64, {_F32})")
def int8_decode(scales: Any, q: Any, block: Any, out: Array) -> None:
    """ops.numpy.int8_decode from the payload's ``scales`` and ``q`` views."""
    n = out.size
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        _decode_block(q[lo:hi], scales[b], out[lo:hi])


@kernel(f"void({_HOP}, {_F32})")
def int8_hop(scales_in: Any, q_in: Any, own: Array, scales: Any, q: Any, block: Any,
             acc: Array) -> None:
    """ops.numpy.int8_hop, block by block in one pass (``acc``: a block of scratch)."""
    _hop(scales_in, q_in, own, scales, q, block, False, _U(0), _U(0), own, False, acc)


@kernel(f"void({_HOP}, {_F32}, {_F32})")
def int8_hop_error(scales_in: Any, q_in: Any, own: Array, scales: Any, q: Any, block: Any,
                   error: Any, acc: Array) -> None:
    """int8_hop with the error-feedback output."""
    _hop(scales_in, q_in, own, scales, q, block, False, _U(0), _U(0), error, True, acc)


@kernel(f"void({_HOP}, {_RNG}, {_F32}, boolean, {_F32})")
def int8_hop_stochastic(scales_in: Any, q_in: Any, own: Array, scales: Any, q: Any, block: Any,
                        seed: Any, base: Any, error: Any, with_error: Any, acc: Array) -> None:
    """int8_hop with stochastic rounding (``error`` written when ``with_error``)."""
    _hop(scales_in, q_in, own, scales, q, block, True, seed, base, error, with_error, acc)


# ------------------------------------------------------------------------------------- casts
@inline
def _cast_encode(src: Array, out: Array, f16: Any, error: Any, with_error: Any) -> None:
    for i in range(src.size):
        word = _f16_bits(src[i]) if f16 else _bf16_bits(src[i])
        out[i] = word
        if with_error:
            back = _f16_value(word) if f16 else _bf16_value(word)
            error[i] = _finite_or_zero(src[i] - back)


@inline
def _cast_hop(words: Any, own: Array, out: Array, f16: Any, error: Any, with_error: Any) -> None:
    """Widen, add ``own`` in float32, send a NaN sum as the quiet NaN, round again; ``out``
    may be ``words`` itself (each element is read before it is written)."""
    for i in range(own.size):
        acc = (_f16_value(words[i]) if f16 else _bf16_value(words[i])) + own[i]
        acc = _f32_from_bits(_QUIET_NAN) if np.isnan(acc) else acc
        word = _f16_bits(acc) if f16 else _bf16_bits(acc)
        out[i] = word
        if with_error:
            back = _f16_value(word) if f16 else _bf16_value(word)
            error[i] = _finite_or_zero(acc - back)


_W = "uint16[::1]"


@kernel(f"void({_F32}, {_W})")
def f16_encode(src: Array, out: Array) -> None:
    """ops.numpy.cast_encode to IEEE half."""
    _cast_encode(src, out, True, src, False)


@kernel(f"void({_F32}, {_W}, {_F32})")
def f16_encode_error(src: Array, out: Array, error: Any) -> None:
    """f16_encode with the error-feedback output."""
    _cast_encode(src, out, True, error, True)


@kernel(f"void({_F32}, {_W})")
def bf16_encode(src: Array, out: Array) -> None:
    """ops.numpy.cast_encode to bfloat16."""
    _cast_encode(src, out, False, src, False)


@kernel(f"void({_F32}, {_W}, {_F32})")
def bf16_encode_error(src: Array, out: Array, error: Any) -> None:
    """bf16_encode with the error-feedback output."""
    _cast_encode(src, out, False, error, True)


@kernel(f"void({_W}, {_F32})")
def f16_decode(words: Any, out: Array) -> None:
    """ops.numpy.cast_decode from IEEE half."""
    for i in range(out.size):
        out[i] = _f16_value(words[i])


@kernel(f"void({_W}, {_F32})")
def bf16_decode(words: Any, out: Array) -> None:
    """ops.numpy.cast_decode from bfloat16."""
    for i in range(out.size):
        out[i] = _bf16_value(words[i])


@kernel(f"void({_W}, {_F32}, {_W})")
def f16_hop(words: Any, own: Array, out: Array) -> None:
    """ops.numpy.cast_hop in IEEE half."""
    _cast_hop(words, own, out, True, own, False)


@kernel(f"void({_W}, {_F32}, {_W}, {_F32})")
def f16_hop_error(words: Any, own: Array, out: Array, error: Any) -> None:
    """f16_hop with the error-feedback output."""
    _cast_hop(words, own, out, True, error, True)


@kernel(f"void({_W}, {_F32}, {_W})")
def bf16_hop(words: Any, own: Array, out: Array) -> None:
    """ops.numpy.cast_hop in bfloat16."""
    _cast_hop(words, own, out, False, own, False)


@kernel(f"void({_W}, {_F32}, {_W}, {_F32})")
def bf16_hop_error(words: Any, own: Array, out: Array, error: Any) -> None:
    """bf16_hop with the error-feedback output."""
    _cast_hop(words, own, out, False, error, True)
