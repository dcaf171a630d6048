"""The kernels' scalar arithmetic (kernels/common.cuh) against the NumPy twins, without a GPU.

kernels/common.cuh also builds as host C++; tests/kernels_host.cpp wraps its conversions,
reduction ops, int8 and cast rounding in loops that do per element what the kernels do, and
these tests compare them bit for bit with ringcomm/ops/numpy.py. Skipped without a C++ compiler.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ringcomm.ops import numpy as ref

ROOT = Path(__file__).resolve().parent.parent
_P = np.ctypeslib.ndpointer(flags="C_CONTIGUOUS")
_I64 = ctypes.c_longlong
_SIGNATURES = {
    "f32_to_f16_n": [_P, _P, _I64], "f64_to_f16_n": [_P, _P, _I64],
    "f16_to_f32_n": [_P, _P, _I64], "f16_to_f64_n": [_P, _P, _I64],
    "f32_to_f64_n": [_P, _P, _I64], "f64_to_f32_n": [_P, _P, _I64],
    "f32_to_bf16_wire_n": [_P, _P, _I64], "f64_to_i32_n": [_P, _P, _I64],
    "f64_to_i64_n": [_P, _P, _I64], "uniform_n": [ctypes.c_uint32, ctypes.c_uint32, _P, _I64],
    "reduce_f16_n": [ctypes.c_int, _P, _P, _P, _I64],
    "reduce_f32_f16_n": [ctypes.c_int, _P, _P, _P, _I64],
    "divide_f32_to_f16_n": [_P, ctypes.c_double, _P, _I64],
    "int8_quantize_n": [ctypes.c_void_p, _P, _P, ctypes.c_void_p, _I64, ctypes.c_int,
                        ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32],
    "cast_round_n": [ctypes.c_int, ctypes.c_void_p, _P, _P, ctypes.c_void_p, _I64],
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """tests/kernels_host.cpp compiled into a shared library (skip without a compiler)."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("kernels_host") / "libkernels_host.so"
    # -ffp-contract=off: the host build must not fuse a * b + c either.
    cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
           f"-I{ROOT / 'kernels'}", str(ROOT / "tests" / "kernels_host.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    so = ctypes.CDLL(str(out))
    for name, argtypes in _SIGNATURES.items():
        getattr(so, name).argtypes = argtypes
        getattr(so, name).restype = None
    return so


def _bits(dtype: str, values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=dtype)


def _float32_patterns(rng: np.random.Generator) -> np.ndarray:
    """Every exponent and top mantissa bits, with low bits at and around the rounding points."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0xFFFF],
                   np.uint32)
    grid = (high[:, None] | low[None, :]).ravel()
    rand = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([grid, rand]).view(np.float32)


def _float64_patterns(rng: np.random.Generator) -> np.ndarray:
    """Random doubles around the half and float ranges, subnormals, ties, NaNs and Infs."""
    exps = rng.integers(990, 1045, 1 << 18).astype(np.uint64)  # 2^-33 .. 2^22
    sig = rng.integers(0, 1 << 52, 1 << 18, dtype=np.uint64)
    sig[::7] &= ~np.uint64((1 << 42) - 1)  # exact halves
    sig[1::7] = (sig[1::7] & ~np.uint64((1 << 42) - 1)) | np.uint64(1 << 41)  # ties
    sign = rng.integers(0, 2, 1 << 18).astype(np.uint64) << np.uint64(63)
    bits = sign | (exps << np.uint64(52)) | sig
    wide = rng.integers(0, 1 << 63, 1 << 16, dtype=np.uint64)
    special = np.array([0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
                        0x7FF0000000000001, 0x7FF4000000000000, 0xFFF0000020000001,
                        0x0000000000000001, 0x8000000000000000, 0x40EFFE0000000000,
                        0x40EFFE0000000001, 0x40EFFDFFFFFFFFFF], np.uint64)
    return np.concatenate([bits, wide, special]).view(np.float64)


def test_float_conversions_match_numpy(lib):
    rng = np.random.default_rng(0)
    f32 = _float32_patterns(rng)
    f64 = _float64_patterns(rng)
    half = np.arange(1 << 16, dtype=np.uint16)
    cases = [
        ("f32_to_f16_n", f32, np.uint16, lambda x: x.astype(np.float16).view(np.uint16)),
        ("f64_to_f16_n", f64, np.uint16, lambda x: x.astype(np.float16).view(np.uint16)),
        ("f16_to_f32_n", half, np.uint32, lambda h: h.view(np.float16).astype(np.float32)),
        ("f16_to_f64_n", half, np.uint64, lambda h: h.view(np.float16).astype(np.float64)),
        ("f32_to_f64_n", f32, np.uint64, lambda x: x.astype(np.float64)),
        ("f64_to_f32_n", f64, np.uint32, lambda x: x.astype(np.float32)),
    ]
    with np.errstate(all="ignore"):
        for name, src, bits, numpy_cast in cases:
            want = np.ascontiguousarray(numpy_cast(src)).view(bits)
            got = np.empty(src.size, bits)
            getattr(lib, name)(src, got, src.size)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (
                f"{name}: {bad.size} mismatches, e.g. input bits "
                f"{src.view(f'u{src.itemsize}')[bad[0]]:#x}: {got[bad[0]]:#x} != {want[bad[0]]:#x}")


def test_bf16_wire_matches_cast_encode(lib):
    x = _float32_patterns(np.random.default_rng(1))
    want = np.empty(ref.cast_nbytes(x.size), np.uint8)
    ref.cast_encode(x, want, "bf16")
    got = np.empty(x.size, np.uint16)
    lib.f32_to_bf16_wire_n(x, got, x.size)
    np.testing.assert_array_equal(got, want[: 2 * x.size].view(np.uint16))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="NumPy's out-of-range float-to-int casts are the CPU's")
def test_float_to_int_matches_numpy(lib):
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(1000) * 1e10, rng.standard_normal(1000) * 1e19,
                        [np.nan, np.inf, -np.inf, 2.0**31, -(2.0**31), 2.0**31 - 0.5,
                         -(2.0**31) - 0.5, -(2.0**31) - 1, 2.0**63, -(2.0**63), -0.0]])
    for name, dtype in (("f64_to_i32_n", np.int32), ("f64_to_i64_n", np.int64)):
        got = np.empty(x.size, dtype)
        getattr(lib, name)(x, got, x.size)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(got, x.astype(dtype))


def test_uniform_matches_numpy(lib):
    for seed, base in ((0, 0), (12345, 2**32 - 7), (2**32 - 1, 2**40 + 3)):
        got = np.empty(5000, np.float32)
        lib.uniform_n(seed & 0xFFFFFFFF, base & 0xFFFFFFFF, got, got.size)
        np.testing.assert_array_equal(got, ref.uniform(seed, base, got.size))


def _with_nonfinite(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[3::97] = np.nan
    x[5::89] = np.inf
    x[7::83] = -np.inf
    return x


def _with_payload_nans(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` with NaNs that are not NumPy's own (a sign and payload bits of their own):
    the twins agree on the quiet NaN wherever arithmetic on them reaches a payload."""
    x = x.copy()
    x[11::101] = np.array([0xFFC01234], np.uint32).view(np.float32)[0]
    return x


@pytest.mark.parametrize(("op", "code"), [("sum", 0), ("min", 1), ("max", 2), ("prod", 3)])
def test_reduce_and_divide_match_numpy(lib, op, code):
    rng = np.random.default_rng(3)
    a = _with_nonfinite(rng.standard_normal(20000) * 300).astype(np.float16)
    b = (rng.standard_normal(20000) * 300).astype(np.float16)
    want = np.empty_like(a)
    with np.errstate(all="ignore"):
        ref.reduce(op, a, b, want)
    got = np.empty(a.size, np.uint16)
    lib.reduce_f16_n(code, a.view(np.uint16), b.view(np.uint16), got, a.size)
    np.testing.assert_array_equal(got.view(np.float16), want)
    wide = (rng.standard_normal(20000) * 1e3).astype(np.float32)
    want32 = np.empty_like(wide)
    with np.errstate(all="ignore"):
        ref.reduce(op, wide, a, want32)
    got32 = np.empty_like(wide)
    lib.reduce_f32_f16_n(code, wide, a.view(np.uint16), got32, wide.size)
    np.testing.assert_array_equal(got32, want32)
    want16 = np.empty(wide.size, np.float16)
    with np.errstate(all="ignore"):
        ref.divide(wide * 40, 3, want16)
    got16 = np.empty(wide.size, np.uint16)
    lib.divide_f32_to_f16_n(wide * 40, 3.0, got16, wide.size)
    np.testing.assert_array_equal(got16.view(np.float16), want16)


def _assert_payload_equal(got: np.ndarray, want: np.ndarray, nb: int, n: int) -> None:
    np.testing.assert_array_equal(got[: 4 * nb].view(np.uint32), want[: 4 * nb].view(np.uint32))
    np.testing.assert_array_equal(got[4 * nb: 4 * nb + n], want[4 * nb: 4 * nb + n])


@pytest.mark.parametrize("block", [1, 3, 64, 256, 1000])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int8_matches_numpy(lib, block, stochastic):
    rng = np.random.default_rng(block)
    n = 5 * block + 3
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e30], n)).astype(np.float32)
    x[: block] = 1e-42  # a block too small to quantize: q = 0, all of it left in the residual
    x = _with_payload_nans(_with_nonfinite(x)) if n > 100 else x
    own = rng.standard_normal(n).astype(np.float32)
    nb = -(-n // block)
    size = ref.int8_nbytes(n, block)
    kw = {"stochastic": stochastic, "seed": 77, "base": 2**32 - 5}
    want, got = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    want_err, got_err = np.empty(n, np.float32), np.empty(n, np.float32)
    ref.int8_encode(x, want, block, error=want_err, **kw)
    lib.int8_quantize_n(None, x, got, got_err.ctypes.data, n, block, stochastic, 77, 2**32 - 5)
    _assert_payload_equal(got, want, nb, n)
    np.testing.assert_array_equal(got_err, want_err)
    hop_want, hop_got = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    ref.int8_hop(want, own, hop_want, block, error=want_err, **kw)
    lib.int8_quantize_n(want.ctypes.data, own, hop_got, got_err.ctypes.data, n, block,
                        stochastic, 77, 2**32 - 5)
    _assert_payload_equal(hop_got, hop_want, nb, n)
    np.testing.assert_array_equal(got_err, want_err)


@pytest.mark.parametrize(("fmt", "code"), [("f16", 0), ("bf16", 1)])
def test_cast_matches_numpy(lib, fmt, code):
    rng = np.random.default_rng(code)
    x = _with_payload_nans(_with_nonfinite((rng.standard_normal(30000) * 3e4).astype(np.float32)))
    own = (rng.standard_normal(30000) * 3e4).astype(np.float32)
    own[5::89] = -np.inf  # Inf + -Inf in the hop: x86's NaN is negative, the payload's is not
    size = ref.cast_nbytes(x.size)
    want, want_err = np.zeros(size, np.uint8), np.empty_like(x)
    got, got_err = np.zeros(x.size, np.uint16), np.empty_like(x)
    with np.errstate(all="ignore"):
        ref.cast_encode(x, want, fmt, error=want_err)
    lib.cast_round_n(code, None, x, got, got_err.ctypes.data, x.size)
    np.testing.assert_array_equal(got, want[: 2 * x.size].view(np.uint16))
    np.testing.assert_array_equal(got_err, want_err)
    hop_want = np.zeros(size, np.uint8)
    with np.errstate(all="ignore"):
        ref.cast_hop(want, own, hop_want, fmt, error=want_err)
    lib.cast_round_n(code, want.ctypes.data, own, got, got_err.ctypes.data, x.size)
    np.testing.assert_array_equal(got, hop_want[: 2 * x.size].view(np.uint16))
    np.testing.assert_array_equal(got_err, want_err)
