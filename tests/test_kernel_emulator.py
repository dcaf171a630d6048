"""The emulated GPU (tests/gpu_emulator.py, tests/cuda_emulation.h) computes and schedules as a
GPU does, so the twin tests see what a GPU would show them.

float32 arithmetic returns the canonical NaN and flushes subnormals exactly when the kernels are
compiled with -ftz=true: as CuPy's RawModule compiles them, the twin checks fail; as ringcomm
compiles them (``_cuda_source.OPTIONS``), they pass. Blocks run in a shuffled order and threads
leave each barrier in a shuffled order, replayed by the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gpu_emulator
import numpy as np
import ops_twins as twins
import pytest

from ringcomm.ops import _cuda_source
from ringcomm.ops import cuda as gpu

CUPY_DEFAULT = (*_cuda_source.OPTIONS, "-ftz=true")  # what cupy.RawModule compiles with

_PROBE = """\
#include "common.cuh"

namespace probe {
// Thread 0 of each block appends the block's index: the order the blocks ran in.
__global__ void block_order(unsigned* out, unsigned* count) {
  if (threadIdx.x == 0) out[atomicAdd(count, 1u)] = blockIdx.x;
}

// Each thread appends its index before the first barrier and after each of two: the orders the
// threads ran in, three times.
__global__ void thread_order(unsigned* out, unsigned* count) {
  out[atomicAdd(count, 1u)] = threadIdx.x;
  __syncthreads();
  out[atomicAdd(count, 1u)] = threadIdx.x;
  __syncthreads();
  out[atomicAdd(count, 1u)] = threadIdx.x;
}

// A bug that only in-order execution hides: block 0 clears the counter the others add to.
__global__ void first_block_clears(unsigned* counter) {
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) *counter = 0;
    else *counter += 1;
  }
}

// out[6 i .. 6 i + 5] = a + b, a - b, a * b, a / b, fmaxf(a, b), floorf(a), by the kernels'
// float32 helpers.
__global__ void arithmetic(float* out, const float* a, const float* b, long long n) {
  for (long long i = rc::global_thread(); i < n; i += rc::thread_count()) {
    out[6 * i] = rc::fadd(a[i], b[i]);
    out[6 * i + 1] = rc::fsub(a[i], b[i]);
    out[6 * i + 2] = rc::fmul(a[i], b[i]);
    out[6 * i + 3] = rc::fdiv(a[i], b[i]);
    out[6 * i + 4] = rc::fmax_f(a[i], b[i]);
    out[6 * i + 5] = rc::floor_f(a[i]);
  }
}
}  // namespace probe
"""
_NAMES = ["probe::block_order", "probe::thread_order", "probe::first_block_clears",
          "probe::arithmetic"]


@pytest.fixture(scope="module")
def probe() -> gpu_emulator.Emulator:
    """The probe kernels above, built for the emulator (skip without a C++ compiler)."""
    directory = gpu_emulator.cache_dir()
    source = directory / "emulator_probe.cu"
    if not source.exists() or source.read_text() != _PROBE:
        tmp = source.with_suffix(".tmp")
        tmp.write_text(_PROBE)
        tmp.replace(source)
    try:
        return gpu_emulator.build_kernels(directory, [source], _NAMES)
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")


def _u32(n: int) -> np.ndarray:
    return np.zeros(n, np.uint32)


def _block_order(emu: gpu_emulator.Emulator, grid: int) -> list[int]:
    out, count = _u32(grid), _u32(1)
    emu.launch("probe::block_order", grid, 32, (out, count))
    assert count[0] == grid
    return out.tolist()


def test_blocks_run_in_a_shuffled_order_that_a_seed_replays(probe):
    probe.reseed(1)
    first, second = _block_order(probe, 64), _block_order(probe, 64)
    assert sorted(first) == list(range(64)) and sorted(second) == list(range(64))
    assert first != list(range(64)) and first != second  # fresh order per launch
    probe.reseed(1)
    assert _block_order(probe, 64) == first
    probe.shuffle = False
    try:
        assert _block_order(probe, 64) == list(range(64))
    finally:
        probe.shuffle = True


def test_threads_leave_each_barrier_in_a_shuffled_order(probe):
    probe.reseed(2)
    out, count = _u32(3 * 128), _u32(1)
    probe.launch("probe::thread_order", 1, 128, (out, count))
    phases = out.reshape(3, 128).tolist()
    for phase in phases:
        assert sorted(phase) == list(range(128)) and phase != list(range(128))
    assert phases[0] != phases[1] != phases[2]


def test_an_order_dependent_bug_shows(probe):
    results = []
    for seed in range(8):
        probe.reseed(seed)
        counter = np.array([12345], np.uint32)
        probe.launch("probe::first_block_clears", 16, 32, (counter,))
        results.append(int(counter[0]))
    assert any(r != 15 for r in results), "every shuffled order hid the bug"
    probe.shuffle = False
    try:
        counter = np.array([12345], np.uint32)
        probe.launch("probe::first_block_clears", 16, 32, (counter,))
        assert counter[0] == 15  # in index order the bug is invisible
    finally:
        probe.shuffle = True


def _nan(bits: int) -> float:
    return np.array([bits], np.uint32).view(np.float32)[0]


def _arithmetic(probe: gpu_emulator.Emulator, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float32), b.astype(np.float32)
    out = np.full(6 * a.size, 7.0, np.float32)
    probe.launch("probe::arithmetic", 1, 32, (out, a, b, np.int64(a.size)))
    return out.reshape(-1, 6)


def test_float_nan_results_are_the_canonical_nan(probe):
    a = np.array([_nan(0x7FC01234), 1.0, _nan(0xFFC00042), np.inf], np.float32)
    b = np.array([1.0, _nan(0x7FC05678), _nan(0x7FC00001), np.inf], np.float32)
    got = _arithmetic(probe, a, b).view(np.uint32)
    assert np.all(got[:3, :4] == 0x7FFFFFFF), [hex(v) for v in got[:3, :4].ravel()]
    assert got[3, 1] == got[3, 3] == 0x7FFFFFFF  # Inf - Inf, Inf / Inf
    # fmaxf: a NaN operand gives the other; two NaNs the canonical NaN
    assert got[0, 4] == np.float32(1.0).view(np.uint32) and got[2, 4] == 0x7FFFFFFF
    assert got[0, 5] == 0x7FFFFFFF  # floorf(NaN)
    with np.errstate(invalid="ignore"):  # x86 keeps the first NaN's payload: NumPy differs
        assert (a[:1] + b[:1]).view(np.uint32)[0] == 0x7FC01234


def test_subnormals_flush_only_when_compiled_to(probe):
    tiny = np.finfo(np.float32).smallest_subnormal
    a = np.array([3 * tiny, np.finfo(np.float32).smallest_normal, -5 * tiny], np.float32)
    b = np.array([2 * tiny, np.float32(0.5), np.float32(1.0)], np.float32)
    probe.options, probe.ftz = _cuda_source.OPTIONS, False
    kept = _arithmetic(probe, a, b)
    np.testing.assert_array_equal(kept[:, 0], a + b)
    np.testing.assert_array_equal(kept[:, 2], a * b)
    assert kept[1, 2] == np.finfo(np.float32).smallest_normal / 2  # a subnormal product
    probe.options, probe.ftz = CUPY_DEFAULT, gpu_emulator.flushes_subnormals(CUPY_DEFAULT)
    try:
        flushed = _arithmetic(probe, a, b)
    finally:
        probe.options, probe.ftz = _cuda_source.OPTIONS, False
    assert flushed[0, 0] == 0 and flushed[1, 2] == 0  # subnormal inputs, a subnormal result
    assert flushed[2, 0] == 1.0  # -5 tiny + 1: the input flushed to -0
    assert np.signbit(flushed[2, 2])  # -5 tiny * 1 -> -0



@pytest.fixture(params=["ringcomm", "cupy-default"])
def compiled_as(request: pytest.FixtureRequest) -> Iterator[tuple[str, twins.Device]]:
    """ringcomm's kernels on the emulator, computing as compiled by ringcomm or by CuPy."""
    options = _cuda_source.OPTIONS if request.param == "ringcomm" else CUPY_DEFAULT
    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir(), options=options, seed=3)
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator) as fake:
        dtypes = [np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")]
        yield request.param, twins.Device(fake.asarray, lambda a: a.get(), fake.empty, dtypes)


_CHECKS: dict[str, Callable[[twins.Device, np.random.Generator], Any]] = {
    "int8": lambda dev, rng: twins.check_int8(dev, rng, 257, 8, False),
    "int8-stochastic": lambda dev, rng: twins.check_int8(dev, rng, 4099, 256, True),
    "cast": lambda dev, rng: twins.check_cast(dev, rng, 257, "f16"),
    "reduce": lambda dev, rng: twins.check_reduce(dev, rng, 255),
    "divide": lambda dev, rng: twins.check_divide(dev, rng, 255),
}


@pytest.mark.parametrize("check", sorted(_CHECKS))
def test_twins_fail_as_cupy_would_compile_and_pass_as_ringcomm_does(compiled_as, check):
    """Subnormal inputs (the int8 block of 1e-42, a few in every float array) keep their values
    in NumPy; kernels compiled with -ftz=true make them zeros, and the twin checks see it."""
    how, dev = compiled_as
    rng = np.random.default_rng(11)
    if how == "ringcomm":
        _CHECKS[check](dev, rng)
    else:
        with pytest.raises(AssertionError):
            _CHECKS[check](dev, rng)


def test_launches_are_recorded_with_their_scalars():
    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir())
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator):
        gpu.uniform(5, 7, 1000)
    (launch,) = emulator.launches
    assert launch.name == "rc::uniform_kernel" and launch.args[1:] == (1000, 5, 7)
    assert launch.args[0] == ("array", 1000)
