"""int8 and fp16/bf16 payloads on the GPU: the twins of ops/numpy.py int8_* and cast_*.

Payload layouts are those of ops/numpy.py: int8 is nb float32 scales then n int8 codes; casts
are one 16-bit word per element; both padded to 8 bytes (padding is left as it is). Kernels
need a payload at a 4-byte boundary (scales are float32 loads); the ring's payloads always are,
and any other is staged through an aligned copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.core.types import Array
from ringcomm.ops import _cuda_runtime as _rt
from ringcomm.ops import _cuda_source as _src

__all__ = ["cast_decode", "cast_encode", "cast_hop", "int8_decode", "int8_encode", "int8_hop"]

_F32 = np.float32
# Bits of the int8 kernels' `vec` argument (kernels/quantize.cu).
_VEC_F, _VEC_Q, _VEC_E = 1, 2, 4


#: Runs of 4 elements each lane of a quantization block's team holds (kernels/quantize.cu keeps
#: up to QREGS = 4 in registers between the absmax and the quantize pass). More runs per lane
#: means fewer lanes per block and more bytes in flight per warp; the bytes written are the
#: same whatever the team (absmax is order-free, codes are per element). bench/kernels_perf.py
#: compares 1, 2 and 4.
RUNS_PER_LANE = 4


def _team(block: int, runs: int | None = None) -> int:
    """Lanes per quantization block: a power of two up to a warp, each lane holding about
    ``runs`` (default RUNS_PER_LANE) of the block's runs of 4."""
    lanes = -(-block // (4 * (runs or RUNS_PER_LANE)))
    return min(32, 1 << (lanes - 1).bit_length())


def _f32(x: Array) -> Any:
    """``x`` as a contiguous float32 array (no copy when it already is one)."""
    return _rt.converted(x, _F32)  # not CuPy's cast: it flushes float32 subnormals


def _int8_vec(block: int, floats: Any, error: Any | None) -> int:
    if block % 4:
        return 0  # runs of 4 would straddle blocks at unaligned offsets
    vec = _VEC_Q | (_VEC_F if floats.data.ptr % 16 == 0 else 0)
    return vec | (_VEC_E if error is not None and error.data.ptr % 16 == 0 else 0)


def _staged(payload: Array, align: int) -> Any:
    """``payload`` itself when aligned to ``align`` bytes, else an aligned copy."""
    return payload if payload.data.ptr % align == 0 else payload.copy()


def _write_back(target: Any, payload: Array, used: int) -> None:
    if target is not payload:
        payload[:used] = target[:used]


def _quantize(kind: str, head: tuple[Any, ...], floats: Any, out: Array, block: int,
              stochastic: bool, seed: int, base: int, error: Any | None) -> None:
    n = floats.size
    if n == 0:
        return
    nb = -(-n // block)
    team = _team(block)
    target = _staged(out, 4)
    args = (*head, target, _rt.NULL if error is None else error, np.int64(n), np.int32(block),
            np.int32(team), _rt.u32(seed), _rt.u32(base),
            np.int32(_int8_vec(block, floats, error)))
    name = _src.int8_name(kind, bool(stochastic), error is not None)
    _rt.launch(name, _rt.grid(nb * team), args)
    _write_back(target, out, 4 * nb + n)


def int8_encode(src: Array, out: Array, block: int, *, stochastic: bool = False, seed: int = 0,
                base: int = 0, error: Any | None = None) -> None:
    """Quantize float32 ``src`` into the int8 payload ``out`` (one pass; see ops/numpy.py).

    Args:
        src: float32 values.
        out: uint8 payload of ``int8_nbytes(src.size, block)`` bytes.
        block: elements per scale.
        stochastic: round with the counter-based uniforms of (seed, base + i) instead of to
            nearest.
        seed: the uniforms' seed.
        base: the global index of src[0].
        error: float32 array of src's size that receives src - decode(out), or None.
    """
    src = _f32(src)
    _quantize("encode", (src,), src, out, block, stochastic, seed, base, error)


def int8_decode(payload: Array, out: Array, block: int) -> None:
    """``out = q * scale`` of each block of the int8 payload (``out`` is float32).

    Args:
        payload: uint8 payload of out.size elements.
        out: contiguous float32 result.
        block: elements per scale.
    """
    n = out.size
    if n == 0:
        return
    team = _team(block)
    vec = 0 if block % 4 else _VEC_Q | (_VEC_F if out.data.ptr % 16 == 0 else 0)
    _rt.launch("rc::int8_decode_kernel", _rt.grid(-(-n // block) * team),
               (_staged(payload, 4), out, np.int64(n), np.int32(block), np.int32(team),
                np.int32(vec)))


def int8_hop(payload: Array, own: Array, out: Array, block: int, *, stochastic: bool = False,
             seed: int = 0, base: int = 0, error: Any | None = None) -> None:
    """One reduce-scatter hop in one pass: decode ``payload``, add ``own``, re-quantize into
    ``out`` and write the requantization error into ``error`` (when given).

    Args:
        payload: the received int8 payload.
        own: this rank's float32 contribution.
        out: uint8 payload for the sum (may be ``payload``).
        block: elements per scale.
        stochastic: stochastic rounding, as in ``int8_encode``.
        seed: the uniforms' seed.
        base: the global index of own[0].
        error: float32 array that receives sum - decode(out), or None.
    """
    own = _f32(own)
    received = _staged(payload, 4)
    if received is payload and _rt.overlap(payload, out):
        received = payload.copy()  # long blocks are read twice: the first read must survive
    _quantize("hop", (received, own), own, out, block, stochastic, seed, base,
              error)


def _fmt(fmt: str) -> str:
    return "f16" if fmt == "f16" else "bf16"


def _cast_vec(words: Any, *floats: Any) -> int:
    return int(words.data.ptr % 8 == 0 and _rt.aligned(*floats))


def cast_encode(src: Array, out: Array, fmt: str, *, error: Any | None = None) -> None:
    """Round float32 ``src`` to ``fmt`` ("f16" or "bf16", nearest-even) into ``out``.

    Args:
        src: float32 values.
        out: uint8 payload of ``cast_nbytes(src.size)`` bytes.
        fmt: "f16" or "bf16".
        error: float32 array that receives src - decode(out) (0 where not finite), or None.
    """
    src = _f32(src)
    n = src.size
    if n == 0:
        return
    target = _staged(out, 2)
    vec = _cast_vec(target, src, error)
    _rt.launch(_src.cast_name("encode", _fmt(fmt)), _rt.grid(-(-n // 4) if vec else n),
               (target, src, _rt.NULL if error is None else error, np.int64(n), np.int32(vec)))
    _write_back(target, out, 2 * n)


def cast_decode(payload: Array, out: Array, fmt: str) -> None:
    """Widen a 16-bit payload to float32 ``out`` (contiguous)."""
    n = out.size
    if n == 0:
        return
    words = _staged(payload, 2)
    vec = _cast_vec(words, out)
    _rt.launch(_src.cast_name("decode", _fmt(fmt)), _rt.grid(-(-n // 4) if vec else n),
               (out, words, np.int64(n), np.int32(vec)))


def cast_hop(payload: Array, own: Array, out: Array, fmt: str, *, error: Any | None = None) -> None:
    """One reduce-scatter hop of a cast payload in one pass: decode, add ``own`` in float32,
    round again into ``out`` (may be ``payload``), the rounding error into ``error``."""
    own = _f32(own)
    n = own.size
    if n == 0:
        return
    words = _staged(payload, 2)
    target = _staged(out, 2)
    vec = int(_cast_vec(words, own, error) and target.data.ptr % 8 == 0)
    _rt.launch(_src.cast_name("hop", _fmt(fmt)), _rt.grid(-(-n // 4) if vec else n),
               (target, words, own, _rt.NULL if error is None else error, np.int64(n),
                np.int32(vec)))
    _write_back(target, out, 2 * n)
