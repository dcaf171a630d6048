"""Collectives on device arrays: the dense ring, int8, casts and top-k through the MPI backend.

Run on a GPU with CuPy (marker ``gpu``: the ranks of one host share the devices, rank r on
device local_rank % count), and on the CPU emulator (tests/gpu_emulator.py: the same kernels,
ops and MPI staging, with CuPy replaced), which runs everywhere. Every result must have the
bits the NumPy path gives for the same inputs (the kernels round as NumPy does), the same bits
on every rank, and the residuals of error feedback must match too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from mpi_helpers import same_on_all_ranks

import ringcomm
from ringcomm.backends import cuda_device, staging
from ringcomm.comm.agree import INLINE_BYTES


class Kind:
    """A kind of device array: how to make one from NumPy and back, the test sizes, and the
    CuPy (real or the emulator's) the MPI transport must stage it with."""

    def __init__(self, name: str, put: Callable[[np.ndarray], Any],
                 get: Callable[[Any], np.ndarray], large: int, cupy: Any) -> None:
        self.name, self.put, self.get, self.large = name, put, get, large
        self.cupy = cupy

    def lengths(self, size: int) -> list[int]:
        """Empty, tiny, fewer than ranks, uneven, just past the inline limit, multi-segment."""
        return sorted({0, 1, size + 1, 1000, INLINE_BYTES // 4 + 1, self.large})


def _forget_device_arrays(comm) -> None:
    """Make the MPI transport start afresh with device arrays: no staging (it holds the CuPy of
    the kind that made it, whose buffers and copies another kind must never use) and no device
    selected yet."""
    t = comm.transport
    t._device_stage = None
    t.device_choice = cuda_device.DeviceChoice(t.local_rank)


def _cuda(comm) -> Kind:
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        pytest.skip(f"no CUDA GPU ({err})")
    if count < 1:
        pytest.skip("no CUDA GPU")
    cupy.cuda.Device(comm.local_rank % count).use()
    return Kind("cuda", cupy.asarray, cupy.asnumpy, 1_000_003, cupy)


class _EmulatedDevice:
    """cupy.cuda.Device of the emulator: one device, 0, whose context changes nothing."""

    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else int(device)

    def __enter__(self) -> _EmulatedDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def use(self) -> None:
        pass


def _forbid_real_cuda(patch: pytest.MonkeyPatch) -> None:
    """Make the real CuPy's copies and pinned allocations fail the test (the emulated case
    passes NumPy pointers: a real cudaMemcpyAsync on them is a bug of the test set-up)."""
    try:
        import cupy
    except ImportError:
        return

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the emulated case called the real CUDA runtime")

    patch.setattr(cupy.cuda.runtime, "memcpyAsync", forbidden)
    patch.setattr(cupy.cuda, "alloc_pinned_memory", forbidden)


def device_kinds(name: str, comm, world, forget: Callable[[], None]) -> Iterator[Kind]:
    """The body of a module's ``kind`` fixture: device arrays of a GPU (``name`` "cuda") or of
    the CPU emulator (built by rank 0, loaded by all), ``forget`` called before and after, so
    that the transport keeps nothing (staging, a device) of another kind."""
    forget()
    if name == "cuda":
        try:
            yield _cuda(comm)
        finally:
            forget()
        return
    import gpu_emulator

    missing = None
    if world.Get_rank() == 0:
        try:
            gpu_emulator.build(gpu_emulator.cache_dir())
        except FileNotFoundError as err:
            missing = str(err)
    missing = world.bcast(missing, root=0)
    if missing:
        pytest.skip(f"emulated kernels: {missing}")
    emulator = gpu_emulator.build(gpu_emulator.cache_dir())  # rank 0's build, now cached
    with gpu_emulator.installed(emulator) as fake, pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(fake.cuda), "Device", _EmulatedDevice, raising=False)
        _forbid_real_cuda(patch)
        try:
            yield Kind("emulated", fake.asarray, lambda a: a.get(), 20_011, fake)
        finally:
            forget()


#: The parameters of a ``kind`` fixture: a GPU (marker ``gpu``) and the emulator.
KINDS = [pytest.param("cuda", marks=pytest.mark.gpu), "emulated"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request, comm, world):
    """Device arrays of a GPU, or of the CPU emulator. Each case starts and ends with no
    staging and no device selected on the transport."""
    yield from device_kinds(request.param, comm, world, lambda: _forget_device_arrays(comm))


@pytest.fixture(autouse=True)
def host_ring(comm):
    """The host results the device ones are compared with come from the ring too: MPI's own
    allreduce, which the MPI backend runs for small host arrays, adds in another order from 3
    ranks on (device arrays always take the ring)."""
    t = comm.transport
    saved = t.native_allreduce_bytes
    t.native_allreduce_bytes = 0
    try:
        yield
    finally:
        t.native_allreduce_bytes = saved


def _data(rng: np.random.Generator, n: int, dtype: str, op: str = "sum") -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        return rng.integers(-3 if op == "prod" else -1000, 4 if op == "prod" else 1000,
                            n).astype(dtype)
    scale = 0.5 if op == "prod" else 1.0
    return (rng.uniform(0.5, 1.5, n) * scale * rng.choice([-1, 1], n)).astype(dtype)


def _same(kind: Kind, world, got: Any, want: np.ndarray, everywhere: bool = True) -> None:
    """``got`` is a device array with ``want``'s bits (and, ``everywhere``, on every rank)."""
    assert type(got) is not np.ndarray, "a device call returned a host array"
    host = kind.get(got)
    assert host.dtype == want.dtype and host.shape == want.shape
    np.testing.assert_array_equal(host, want)
    assert not everywhere or same_on_all_ranks(world, host)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_dense_allreduce_matches_numpy(comm, world, rng, kind, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is refused for integers")
    for n in kind.lengths(comm.size):
        x = _data(rng, n, dtype, op)
        want = comm.allreduce(x, op=op)
        _same(kind, world, comm.allreduce(kind.put(x), op=op), want)


@pytest.mark.parametrize("segment_bytes", [4096, 1 << 20])
def test_pipelined_segments_and_in_place(comm, world, rng, kind, segment_bytes):
    """Many segments per chunk, staged exchanges in flight, in place and into out=."""
    saved = comm.segment_bytes
    comm.segment_bytes = segment_bytes
    try:
        x = rng.standard_normal(kind.large).astype(np.float32)
        want = comm.allreduce(x)
        y = kind.put(x)
        assert comm.allreduce(y, out=y) is y
        _same(kind, world, y, want)
        h = x.astype(np.float16)
        _same(kind, world, comm.allreduce(kind.put(h), op="avg"), comm.allreduce(h, op="avg"))
    finally:
        comm.segment_bytes = saved


def test_other_collectives_match_numpy(comm, world, rng, kind):
    x = rng.standard_normal(3001).astype(np.float32)
    _same(kind, world, comm.reduce_scatter(kind.put(x)), comm.reduce_scatter(x), False)
    rows = rng.standard_normal((comm.rank + 1, 7))
    _same(kind, world, comm.allgatherv(kind.put(rows)), comm.allgatherv(rows))
    _same(kind, world, comm.allgather(kind.put(rows[:1])), comm.allgather(rows[:1]))
    b = rng.standard_normal(5000)
    want = comm.broadcast(b.copy(), root=comm.size - 1)
    _same(kind, world, comm.broadcast(kind.put(b), root=comm.size - 1), want)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    recv = kind.put(np.zeros(100, np.int64))
    comm.sendrecv(kind.put(np.arange(100, dtype=np.int64) + comm.rank), right, recv, left)
    np.testing.assert_array_equal(kind.get(recv), np.arange(100) + left)


COMPRESSORS = {
    "int8": ringcomm.Int8(),
    "int8-b100-stoch": ringcomm.Int8(block_size=100, stochastic=True, seed=3),
    "fp16": ringcomm.FP16(),
    "bf16": ringcomm.BF16(),
    "topk-ring": ringcomm.TopK(0.01),
    "topk-ring-approx": ringcomm.TopK(0.02, approximate=True),
    "topk-allgather": ringcomm.TopK(0.01, algorithm="allgather"),
    "topk-allgather-approx": ringcomm.TopK(0.01, algorithm="allgather", approximate=True),
}


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_compressed_allreduce_matches_numpy(comm, world, rng, kind, name, op):
    """Three steps with error feedback: the results and the residuals of the device path are
    the NumPy path's, on every rank."""
    comp = COMPRESSORS[name]
    host_ef, device_ef = ringcomm.ErrorFeedback(), ringcomm.ErrorFeedback()
    n = kind.large
    for step in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        if step == 1:
            g[rng.integers(0, n)] = np.nan  # a skipped step: never a finite result, nor residual
        if step == 2 and comm.rank == 0:
            g[::13] = -np.inf  # more than top-k's k: the selections' overflow marks
        calls = comm._allreduce.compressed_calls  # keys the random numbers: the same for both calls
        want = comm.allreduce(g, op=op, compression=comp, feedback=host_ef, name="w")
        comm._allreduce.compressed_calls = calls
        got = comm.allreduce(kind.put(g), op=op, compression=comp, feedback=device_ef, name="w")
        _same(kind, world, got, want)
        np.testing.assert_array_equal(kind.get(device_ef.residual("w")), host_ef.residual("w"))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_powersgd_on_device_arrays(comm, world, rng, kind, op):
    """PowerSGD of a bucket of matrices (one dense, one with a NaN at the second step), three
    steps with error feedback, a memory per path: the same bits on every rank and error
    feedback conserving what was not sent; on the emulator the bits of the NumPy path, on a GPU
    its values to float32 rounding (cuBLAS sums the rank-local projections in its own order)."""
    shapes = [(48, 40), (40,), (8, 3, 5, 5), (3, 3), (200, 30)]
    n = sum(int(np.prod(s)) for s in shapes)
    host_c, device_c = (ringcomm.PowerSGD(rank=2).with_shapes(shapes) for _ in range(2))
    device_c.memory = ringcomm.PowerSGD().memory
    host_ef, device_ef = ringcomm.ErrorFeedback(), ringcomm.ErrorFeedback()
    inputs, results = np.zeros(n), np.zeros(n)
    scale = comm.size if op == "avg" else 1
    for step in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        if step == 1 and comm.rank == comm.size - 1:
            g[5] = np.nan  # the first matrix goes dense this step, on every rank
        want = comm.allreduce(g, op=op, compression=host_c, feedback=host_ef, name="p")
        got = comm.allreduce(kind.put(g), op=op, compression=device_c, feedback=device_ef,
                             name="p")
        assert type(got) is not np.ndarray, "a device call returned a host array"
        host = kind.get(got)
        assert same_on_all_ranks(world, host)
        np.testing.assert_array_equal(np.isfinite(host), np.isfinite(want))
        if kind.name == "emulated":
            np.testing.assert_array_equal(host, want)
        else:
            # (NaN where the NaN went: nanmax, so that the tolerance itself is not NaN)
            np.testing.assert_allclose(host, want, rtol=1e-3,
                                       atol=1e-5 * np.nanmax(np.abs(want)))
        if step != 1:
            inputs += np.sum(world.allgather(g.astype(np.float64)), axis=0)
            results += scale * host.astype(np.float64)
        else:  # the NaN step: nothing to compare; the books start again from what is held
            results[:] = 0
            inputs[:] = np.sum(world.allgather(kind.get(device_ef.residual("p"))
                                               .astype(np.float64)), axis=0)
    held = np.sum(world.allgather(kind.get(device_ef.residual("p")).astype(np.float64)), axis=0)
    np.testing.assert_allclose(results + held, inputs, atol=2e-4 * np.abs(inputs).max())


def test_float64_input_compresses_like_numpy(comm, world, rng, kind):
    """A float64 gradient: compensation casts it to float32, the result comes back float64."""
    g = rng.standard_normal(kind.large)
    comp = ringcomm.Int8(block_size=64)
    want = comm.allreduce(g, compression=comp)
    _same(kind, world, comm.allreduce(kind.put(g), compression=comp), want)


@pytest.mark.parametrize("direct", [False, True])
def test_staging_modes_agree(comm, world, rng, kind, direct):
    """Host staging through pinned buffers, and device buffers handed to MPI as they are (a
    CUDA-aware MPI), move the same bytes; pinned buffers are reused, not piled up."""
    if kind.name == "cuda" and direct and not comm.cuda_aware:
        pytest.skip("this MPI is not CUDA-aware")
    transport = comm.transport
    saved = transport._device_stage
    transport._device_stage = staging.DeviceStaging(transport._MPI, direct)
    try:
        comp = ringcomm.Int8()
        saved_seg, comm.segment_bytes = comm.segment_bytes, 8192
        x = rng.standard_normal(kind.large).astype(np.float32)
        for _ in range(3):
            _same(kind, world, comm.allreduce(kind.put(x)), comm.allreduce(x))
            calls = comm._allreduce.compressed_calls
            want = comm.allreduce(x, compression=comp)
            comm._allreduce.compressed_calls = calls
            _same(kind, world, comm.allreduce(kind.put(x), compression=comp), want)
        assert len(transport._device_stage._pool._idle) <= staging._KEEP
    finally:
        comm.segment_bytes = saved_seg
        transport._device_stage = saved


def test_each_kind_stages_with_its_own_cupy(comm, rng, kind):
    """The staging and the device of the transport are this kind's: a staging left by the
    other kind (real CuPy for the emulator, or the emulator's for a GPU) would copy with the
    wrong runtime; the device is local_rank % device count."""
    x = rng.standard_normal(4 * INLINE_BYTES).astype(np.float32)  # past the inline limit
    np.testing.assert_array_equal(kind.get(comm.allreduce(kind.put(x))), comm.allreduce(x))
    transport = comm.transport
    assert transport._device_stage is not None
    assert transport._device_stage._cupy is kind.cupy
    count = kind.cupy.cuda.runtime.getDeviceCount()
    assert comm.cuda_device == comm.local_rank % count
