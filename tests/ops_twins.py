"""Checks that every operation of ringcomm.ops.cuda computes what its NumPy twin computes.

One body per operation, run by tests/test_ops_cuda.py on a GPU (CuPy) and on the CPU emulator
(the same kernels and Python code, with CuPy replaced; see tests/gpu_emulator.py). Inputs are
fresh random data with NaN/Inf and subnormals mixed in; every output is poisoned with finite
garbage first, so an element a kernel forgets to write shows. Payloads (what goes on the wire)
must match byte for byte, NaN words included; float results value for value (NaN equal to NaN:
the payload of a NaN that arithmetic made is the hardware's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.core.types import ReduceOp
from ringcomm.ops import cuda as gpu
from ringcomm.ops import numpy as ref

try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BF16 = None

POISON = 0x7B  # bytes of a finite float (1.3e36), a valid int: a missed write never looks right


class Device:
    """How the checks reach the arrays under test.

    Args:
        put: NumPy array -> device array (a copy).
        get: device array -> NumPy array.
        empty: (shape, dtype) -> uninitialised device array.
        dtypes: the dtypes this device holds (bfloat16 needs ml_dtypes, and CuPy support).
    """

    def __init__(self, put: Callable[[np.ndarray], Any], get: Callable[[Any], np.ndarray],
                 empty: Callable[[Any, Any], Any], dtypes: list[Any]) -> None:
        self.put, self.get, self._empty, self.dtypes = put, get, empty, dtypes

    def poisoned(self, shape: Any, dtype: Any) -> Any:
        out = self._empty(shape, dtype)
        if out.size:
            out.view(np.uint8).fill(POISON)
        return out

    def floats(self) -> list[Any]:
        return [d for d in self.dtypes if d.kind == "f" or d == BF16]


def data(rng: np.random.Generator, n: int, dtype: Any = np.float32, scale: float = 1.0,
         nonfinite: bool = True) -> np.ndarray:
    """Random values of ``dtype``; when floating, a few subnormals of the dtype and both zeros
    (n > 8), and with ``nonfinite`` a few NaN and +-Inf."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(-1000, 1000, n).astype(dt)
    x = rng.standard_normal(n) * scale
    if nonfinite and n > 2:
        for value in (np.nan, np.inf, -np.inf):
            x[rng.integers(0, n)] = value
    with np.errstate(over="ignore", invalid="ignore"):
        x = x.astype(dt)
    if n > 8 and dt.kind == "f":  # a GPU built with flush-to-zero would make these zeros
        tiny = np.finfo(dt).smallest_normal
        x[rng.choice(n, 4, replace=False)] = [tiny / dt.type(3), -tiny / dt.type(5), 0.0, -0.0]
    return x


def nan_with_payload(sign: int, payload: int) -> np.float32:
    """A float32 quiet NaN of the given sign and low payload bits (not NumPy's own NaN)."""
    bits = (sign << 31) | 0x7FC00000 | (payload & 0x3FFFFF)
    return np.array([bits], np.uint32).view(np.float32)[0]


def assert_same(dev: Device, got: Any, want: np.ndarray) -> None:
    """Equal values (NaN equal to NaN), dtype and shape."""
    host = dev.get(got)
    assert host.dtype == want.dtype and host.shape == want.shape
    if want.dtype == BF16:
        host, want = host.astype(np.float32), want.astype(np.float32)
    np.testing.assert_array_equal(host, want)


def assert_bits(dev: Device, got: Any, want: np.ndarray) -> None:
    """The same bytes (NaN payloads included: the kernels cast NaNs as NumPy does)."""
    host = dev.get(got)
    assert host.dtype == want.dtype and host.shape == want.shape
    bits = f"u{want.dtype.itemsize}"
    np.testing.assert_array_equal(host.view(bits), want.view(bits))


def assert_payload(dev: Device, got: Any, want: np.ndarray, scales: int, used: int) -> None:
    """Equal payloads, byte for byte up to ``used`` (padding is nobody's business): the
    ``scales`` float32 words first (NaN scales included), then the codes or words."""
    host = dev.get(got)
    np.testing.assert_array_equal(host[: 4 * scales].view(np.uint32),
                                  want[: 4 * scales].view(np.uint32))
    np.testing.assert_array_equal(host[4 * scales: used], want[4 * scales: used])


# ------------------------------------------------------------------------ dense operations
def check_copy(dev: Device, rng: np.random.Generator, n: int) -> None:
    dtypes = [*dev.floats(), np.dtype(np.int32), np.dtype(np.int64)]
    for src_dt in dtypes:
        src = data(rng, n, src_dt, scale=1e5)  # beyond float16's range too
        for dst_dt in dtypes:
            if (src_dt.kind == "f" or src_dt == BF16) and dst_dt.kind == "i":
                continue  # NumPy leaves NaN/Inf/out-of-range to int undefined
            if BF16 in (src_dt, dst_dt) and "i" in (src_dt.kind, dst_dt.kind):
                continue  # ints and bfloat16: CuPy's cast, not a kernel of ours
            want = np.empty(n, dst_dt)
            with np.errstate(all="ignore"):
                ref.copy(want, src)
            out = dev.poisoned(n, dst_dt)
            gpu.copy(out, dev.put(src))
            assert_bits(dev, out, want)


def _reduce_cases(dev: Device) -> list[tuple[Any, Any, Any]]:
    cases = [(d, d, d) for d in dev.dtypes]
    f32 = np.dtype(np.float32)
    for half in (np.dtype(np.float16), BF16):
        if half in dev.dtypes:
            cases += [(f32, half, f32), (half, f32, f32), (f32, half, half)]
    return cases


def check_reduce(dev: Device, rng: np.random.Generator, n: int) -> None:
    for a_dt, b_dt, out_dt in _reduce_cases(dev):
        a, b = data(rng, n, a_dt, 100.0), data(rng, n, b_dt, 100.0)
        for op in ReduceOp:
            want = np.empty(n, out_dt)
            with np.errstate(all="ignore"):
                ref.reduce(op, a, b, want)
            out = dev.poisoned(n, out_dt)
            gpu.reduce(op, dev.put(a), dev.put(b), out)
            assert_same(dev, out, want)
        if a_dt == out_dt:  # in place, as the ring reduces into its partial sums
            inplace = dev.put(a)
            gpu.reduce(ReduceOp.SUM, inplace, dev.put(b), inplace)
            want = np.empty(n, out_dt)
            with np.errstate(all="ignore"):
                ref.reduce(ReduceOp.SUM, a, b, want)
            assert_same(dev, inplace, want)


def check_divide(dev: Device, rng: np.random.Generator, n: int) -> None:
    f32 = np.dtype(np.float32)
    pairs = [(d, d) for d in dev.floats()] + [(f32, d) for d in dev.floats() if d != f32]
    for src_dt, out_dt in pairs:
        x = data(rng, n, src_dt, 1e3)
        for divisor in (1, 3, 7):
            want = np.empty(n, out_dt)
            with np.errstate(all="ignore"):
                ref.divide(x, divisor, want)
            out = dev.poisoned(n, out_dt)
            gpu.divide(dev.put(x), divisor, out)
            assert_same(dev, out, want)


def check_compensate_and_residuals(dev: Device, rng: np.random.Generator, n: int) -> None:
    residual = data(rng, n, np.float32, nonfinite=False)
    for dt in dev.floats():
        x = data(rng, n, dt)
        for res in (None, residual):
            want = np.empty(n, np.float32)
            with np.errstate(all="ignore"):
                ref.compensate(x, res, want)
            out = dev.poisoned(n, np.float32)
            gpu.compensate(dev.put(x), None if res is None else dev.put(res), out)
            assert_same(dev, out, want)
        y = data(rng, n, dt)
        want_y = y.copy()
        ref.zero_nonfinite(want_y)
        got_y = dev.put(y)
        gpu.zero_nonfinite(got_y)
        assert_same(dev, got_y, want_y)
    acc = data(rng, n, np.float32)
    idx = ref.topk(acc, max(1, n // 10))[0]  # a selection: NumPy's residual counts on it
    want = np.empty(n, np.float32)
    ref.sparse_residual(acc, idx, want)
    out = dev.poisoned(n, np.float32)
    gpu.sparse_residual(dev.put(acc), dev.put(idx), out)
    assert_same(dev, out, want)
    base = data(rng, n, np.float32, nonfinite=False)
    want = base.copy()
    ref.scatter_add(want, idx, acc[idx])
    got = dev.put(base)
    gpu.scatter_add(got, dev.put(idx), dev.put(acc[idx]))
    assert_same(dev, got, want)


def check_uniform(dev: Device, n: int) -> None:
    for seed, base in ((0, 0), (2**32 - 1, 2**32 - 3), (123456789, 2**40 + 5)):
        assert_same(dev, gpu.uniform(seed, base, n), ref.uniform(seed, base, n))


def check_arrays(dev: Device, rng: np.random.Generator, n: int) -> None:
    x = data(rng, 2 * n, np.float32)
    strided = dev.put(x)[::2]
    assert_same(dev, gpu.ascontiguous(strided), x[::2])
    host = gpu.to_host(dev.put(x))
    assert type(host) is np.ndarray
    np.testing.assert_array_equal(host, x)
    out = dev.poisoned(n, np.float16)
    with np.errstate(all="ignore"):
        gpu.copy_from_host(out, x[:n])
        assert_same(dev, out, x[:n].astype(np.float16))
    assert gpu.zeros((n,), np.int64).shape == (n,)
    assert gpu.empty((2, n), np.float32).shape == (2, n)


# --------------------------------------------------------------------------- compression
def check_int8(dev: Device, rng: np.random.Generator, n: int, block: int,
               stochastic: bool) -> None:
    x = data(rng, n, np.float32, 10.0)
    if n > block:
        x[:block] = 1e-42  # a block too small to quantize (its scale is subnormal)
    if n > 2 * block + 1:
        x[block + 1] = nan_with_payload(1, 0x1234)  # its block's scale: the quiet NaN anyway
    own = data(rng, n, np.float32, 3.0, nonfinite=False)
    nb, size = -(-n // block), ref.int8_nbytes(n, block)
    kw = {"stochastic": stochastic, "seed": 99, "base": 2**32 - 2}
    want, want_err = np.zeros(size, np.uint8), np.empty(n, np.float32)
    ref.int8_encode(x, want, block, error=want_err, **kw)
    got, got_err = dev.poisoned(size, np.uint8), dev.poisoned(n, np.float32)
    gpu.int8_encode(dev.put(x), got, block, error=got_err, **kw)
    assert_payload(dev, got, want, nb, 4 * nb + n)
    assert_bits(dev, got_err, want_err)  # the sign of a zero error too (x = -0.0)
    decoded = dev.poisoned(n, np.float32)
    gpu.int8_decode(dev.put(want), decoded, block)
    want_decoded = np.empty(n, np.float32)
    ref.int8_decode(want, want_decoded, block)
    assert_same(dev, decoded, want_decoded)
    hop, hop_err = np.zeros(size, np.uint8), np.empty(n, np.float32)
    ref.int8_hop(want, own, hop, block, error=hop_err, **kw)
    got_hop = dev.poisoned(size, np.uint8)
    gpu.int8_hop(dev.put(want), dev.put(own), got_hop, block, error=got_err, **kw)
    assert_payload(dev, got_hop, hop, nb, 4 * nb + n)
    assert_bits(dev, got_err, hop_err)
    inplace = dev.put(want)  # the hop's output over its input, as a codec may reuse it
    gpu.int8_hop(inplace, dev.put(own), inplace, block, **kw)
    assert_payload(dev, inplace, hop, nb, 4 * nb + n)


def check_int8_paths(dev: Device, rng: np.random.Generator, n: int, block: int,
                     offset: int, stochastic: bool) -> None:
    """Encode and hop without an error array, their float32 inputs ``offset`` elements into
    their memory: at 0 a block the team holds whole takes the kernels' unconditional loads, at
    1 (no 16-byte loads) every block the general path; the twins' bytes either way, and the
    instantiations that write no error."""
    def placed(a: np.ndarray) -> Any:
        return dev.put(np.concatenate([np.zeros(offset, a.dtype), a]))[offset:]

    x = data(rng, n, np.float32, 10.0)
    own = data(rng, n, np.float32, 3.0, nonfinite=False)
    nb, size = -(-n // block), ref.int8_nbytes(n, block)
    kw = {"stochastic": stochastic, "seed": 7, "base": 3}
    want = np.zeros(size, np.uint8)
    ref.int8_encode(x, want, block, **kw)
    got = dev.poisoned(size, np.uint8)
    gpu.int8_encode(placed(x), got, block, **kw)
    assert_payload(dev, got, want, nb, 4 * nb + n)
    hop = np.zeros(size, np.uint8)
    ref.int8_hop(want, own, hop, block, **kw)
    got_hop = dev.poisoned(size, np.uint8)
    gpu.int8_hop(dev.put(want), placed(own), got_hop, block, **kw)
    assert_payload(dev, got_hop, hop, nb, 4 * nb + n)


def check_int8_unaligned(dev: Device, rng: np.random.Generator, n: int) -> None:
    """Payloads at odd addresses (a slice one byte in) give the same bytes."""
    x = data(rng, n, np.float32)
    size = ref.int8_nbytes(n, 64)
    want = np.zeros(size, np.uint8)
    ref.int8_encode(x, want, 64)
    backing = dev.poisoned(size + 1, np.uint8)
    gpu.int8_encode(dev.put(x), backing[1:], 64)
    nb = -(-n // 64)
    assert_payload(dev, backing[1:], want, nb, 4 * nb + n)
    out = dev.poisoned(n, np.float32)
    gpu.int8_decode(backing[1:], out, 64)
    want_out = np.empty(n, np.float32)
    ref.int8_decode(want, want_out, 64)
    assert_same(dev, out, want_out)


def check_cast(dev: Device, rng: np.random.Generator, n: int, fmt: str) -> None:
    x = data(rng, n, np.float32, 3e4)  # float16 overflows past 65504
    own = data(rng, n, np.float32, 3e4, nonfinite=False)
    if n > 8:  # NaN sums in the hop: a NaN with a payload of its own, and Inf + -Inf
        x[:2] = [nan_with_payload(1, 0x2345), np.inf]
        own[1] = -np.inf
    size = ref.cast_nbytes(n)
    want, want_err = np.zeros(size, np.uint8), np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        ref.cast_encode(x, want, fmt, error=want_err)
    got, got_err = dev.poisoned(size, np.uint8), dev.poisoned(n, np.float32)
    gpu.cast_encode(dev.put(x), got, fmt, error=got_err)
    assert_payload(dev, got, want, 0, 2 * n)
    assert_same(dev, got_err, want_err)
    decoded, want_decoded = dev.poisoned(n, np.float32), np.empty(n, np.float32)
    ref.cast_decode(want, want_decoded, fmt)
    gpu.cast_decode(dev.put(want), decoded, fmt)
    assert_same(dev, decoded, want_decoded)
    hop, hop_err = np.zeros(size, np.uint8), np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        ref.cast_hop(want, own, hop, fmt, error=hop_err)
    got_hop = dev.poisoned(size, np.uint8)
    gpu.cast_hop(dev.put(want), dev.put(own), got_hop, fmt, error=got_err)
    assert_payload(dev, got_hop, hop, 0, 2 * n)
    assert_same(dev, got_err, hop_err)


def distinct(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values with distinct magnitudes (no ties for top-k), random signs and order."""
    mags = (rng.permutation(n) + 1).astype(np.float32) * np.float32(1e-3)
    return np.where(rng.random(n) < 0.5, -mags, mags).astype(np.float32)


def check_topk(dev: Device, rng: np.random.Generator, n: int, k: int, approximate: bool,
               nonfinite: bool = False) -> None:
    x = distinct(rng, n)
    if nonfinite and n > 8:
        x[rng.choice(n, 3, replace=False)] = [np.nan, np.inf, -np.inf]
    want_idx, want_val = ref.topk(x, k, approximate=approximate, seed=5)
    idx, val = gpu.topk(dev.put(x), k, approximate=approximate, seed=5)
    assert_same(dev, idx, want_idx)
    assert_same(dev, val, want_val)


def check_topk_overflow(dev: Device, rng: np.random.Generator, n: int, k: int) -> None:
    """More NaN and Inf than a selection carries: the same mark (first pair -1, NaN) as NumPy's,
    added as "every entry NaN" and left out of the residual; none where they all fit."""
    for bad in sorted({0, k - 1, k, k + 1, n // 2, n}):
        if not 0 <= bad <= n:
            continue
        x = distinct(rng, n)
        x[rng.choice(n, bad, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], bad)
        want_idx, want_val = ref.topk(x, k)
        ref.topk_overflow(x, want_idx, want_val)
        assert (want_idx[:1] == -1).any() == (bad > k), (bad, k)
        idx, val = gpu.topk(dev.put(x), k)
        gpu.topk_overflow(dev.put(x), idx, val)
        assert_same(dev, idx, want_idx)
        assert_same(dev, val, want_val)
        want = data(rng, n, np.float32, nonfinite=False)
        got = dev.put(want)
        ref.scatter_add(want, want_idx, want_val)
        gpu.scatter_add(got, idx, val)
        assert_same(dev, got, want)
        want = np.empty(n, np.float32)
        ref.sparse_residual(x, want_idx, want)
        out = dev.poisoned(n, np.float32)
        gpu.sparse_residual(dev.put(x), idx, out)
        assert_same(dev, out, want)
        assert np.isfinite(want).all()


def check_topk_ties(dev: Device, rng: np.random.Generator, n: int, k: int) -> None:
    """Many equal magnitudes: the top k, ascending, ties at the k-th going to the lowest
    indices, exactly as NumPy selects them."""
    x = (rng.integers(-8, 9, n) * 0.5).astype(np.float32)
    k = min(k, n)
    idx, val = gpu.topk(dev.put(x), k)
    idx, val = dev.get(idx), dev.get(val)
    assert idx.size == k and np.all(np.diff(idx) > 0) and np.array_equal(val, x[idx])
    np.testing.assert_array_equal(idx, lowest_index_topk(x, k))
    want_idx, want_val = ref.topk(x, k)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(val, want_val)


def lowest_index_topk(x: np.ndarray, k: int) -> np.ndarray:
    """The exact top k by a full sort: magnitude keys descending (NaN above Inf, by payload),
    then index ascending; returned ascending."""
    keys = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    order = np.lexsort((np.arange(x.size), -keys.astype(np.int64)))
    return np.sort(order[:k]).astype(np.int32)


def check_topk_gradients(dev: Device, rng: np.random.Generator, n: int, k: int) -> None:
    """float32 gradient-like values, whose magnitudes repeat at large n: NumPy's selection."""
    x = (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)
    want_idx, want_val = ref.topk(x, k)
    idx, val = gpu.topk(dev.put(x), k)
    assert_same(dev, idx, want_idx)
    assert_same(dev, val, want_val)


def check_sample_threshold(dev: Device, rng: np.random.Generator, n: int) -> None:
    mag = np.abs(distinct(rng, n))
    for k, seed in ((1, 0), (max(1, n // 100), 7), (n, 3)):
        assert gpu.sample_threshold(dev.put(mag), k, seed) == ref.sample_threshold(mag, k, seed)


def check_unaligned_views(dev: Device, rng: np.random.Generator, n: int) -> None:
    """Arrays that start one element into their buffer (no vector loads) give the same bits."""
    a, b = data(rng, n + 1, np.float32), data(rng, n + 1, np.float16)
    want = np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        ref.reduce(ReduceOp.SUM, a[1:], b[1:], want)
    out = dev.poisoned(n + 1, np.float32)
    gpu.reduce(ReduceOp.SUM, dev.put(a)[1:], dev.put(b)[1:], out[1:])
    assert_same(dev, out[1:], want)
    size = ref.int8_nbytes(n, 256)
    payload, err = np.zeros(size, np.uint8), np.empty(n, np.float32)
    ref.int8_encode(a[1:], payload, 256, error=err)
    got, got_err = dev.poisoned(size, np.uint8), dev.poisoned(n + 1, np.float32)
    gpu.int8_encode(dev.put(a)[1:], got, 256, error=got_err[1:])
    nb = -(-n // 256)
    assert_payload(dev, got, payload, nb, 4 * nb + n)
    assert_same(dev, got_err[1:], err)
    words = np.zeros(ref.cast_nbytes(n), np.uint8)
    with np.errstate(all="ignore"):
        ref.cast_encode(a[1:], words, "f16")
    got_words = dev.poisoned(ref.cast_nbytes(n) + 2, np.uint8)
    gpu.cast_encode(dev.put(a)[1:], got_words[2:], "f16")
    assert_payload(dev, got_words[2:], words, 0, 2 * n)
