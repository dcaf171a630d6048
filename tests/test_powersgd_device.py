"""PowerSGD on device arrays, on the CPU emulator of tests/gpu_emulator.py, ranks as threads
(the threads backend takes the emulator's arrays, which are NumPy arrays underneath; on a GPU
the same checks run under MPI: tests/mpi/test_cuda_ring.py::test_powersgd_on_device_arrays).

Every rank gets the same bits, error feedback conserves what was not sent, a non-finite tensor
goes dense on every rank, the result is the host's bit for bit (the emulator's BLAS is NumPy's),
and warm start keeps Q on the device.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from thread_helpers import identical

import ringcomm
from ringcomm.backends.threads import run_ranks
from ringcomm.comm.base import Communicator

pytestmark = pytest.mark.timeout(300)
SHAPES = [(32, 24), (24,), (6, 2, 3, 3), (3, 3), (1,), (40, 7)]  # (3, 3): dense at rank 1..2
LENGTH = sum(int(np.prod(s)) for s in SHAPES)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _steps(n: int, xs: list[np.ndarray], put: Any, get: Any, comp: Any, op: str,
           name: str = "bucket") -> list[tuple[list[np.ndarray], np.ndarray]]:
    """Every rank reduces xs[step][rank] (placed by ``put``) with error feedback; per rank,
    (results, final residual) on the host."""
    def job(t: Any) -> tuple[list[np.ndarray], np.ndarray]:
        comm = Communicator(t)
        ef = ringcomm.ErrorFeedback()
        mine = comp.with_shapes(comp.shapes)
        mine.memory = ringcomm.PowerSGD().memory  # every rank its own, as processes have
        got = [get(comm.allreduce(put(x[t.rank]), op=op, compression=mine, feedback=ef,
                                  name=name)) for x in xs]
        return got, get(ef.residual(name))
    return run_ranks(n, job, timeout=120.0)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("n", [2, 3])
def test_device_results_identical_conserving_and_the_hosts(thread_device, rng, n, op):
    xs = [rng.standard_normal((n, LENGTH)).astype(np.float32) for _ in range(3)]
    comp = ringcomm.PowerSGD(rank=2, shapes=SHAPES)
    on_device = _steps(n, xs, thread_device.put, thread_device.get, comp, op)
    on_host = _steps(n, xs, np.asarray, np.asarray, comp, op)
    for step in range(len(xs)):
        assert identical([o[0][step] for o in on_device])
        got, want = on_device[0][0][step], on_host[0][0][step]
        assert got.tobytes() == want.tobytes(), step
    scale = n if op == "avg" else 1
    inputs = sum(x.astype(np.float64).sum(axis=0) for x in xs)
    results = sum(scale * r.astype(np.float64) for r in on_device[0][0])
    held = sum(o[1].astype(np.float64) for o in on_device)
    np.testing.assert_allclose(results + held, inputs, atol=1e-4 * np.abs(inputs).max())


def test_a_first_call_of_zeros_is_left_behind_as_on_the_host(thread_device, rng):
    """A first call of zeros, then ordinary ones: the kept Q's dropped rows are drawn afresh
    on the device path too (from the host copy it checks), the results the host's bit for
    bit and not zero (they stayed zero for good)."""
    n = 2
    xs = [np.zeros((n, LENGTH), np.float32)]
    xs += [rng.standard_normal((n, LENGTH)).astype(np.float32) for _ in range(2)]
    comp = ringcomm.PowerSGD(rank=2, shapes=SHAPES)
    on_device = _steps(n, xs, thread_device.put, thread_device.get, comp, "sum")
    on_host = _steps(n, xs, np.asarray, np.asarray, comp, "sum")
    first = int(np.prod(SHAPES[0]))
    for step in range(1, len(xs)):
        got, want = on_device[0][0][step], on_host[0][0][step]
        assert got.tobytes() == want.tobytes(), step
        assert np.abs(got[:first]).max() > 0.1 * np.abs(xs[step].sum(axis=0)[:first]).max()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_tensor_goes_dense_on_every_rank(thread_device, rng, bad):
    """One rank's NaN/Inf in the first matrix: that tensor is reduced dense (non-finite where
    the dense sum is), the others stay low-rank and finite, on every rank alike."""
    n = 2
    x = rng.standard_normal((n, LENGTH)).astype(np.float32)
    x[1, 5] = bad
    comp = ringcomm.PowerSGD(rank=1, shapes=SHAPES)
    out = _steps(n, [x], thread_device.put, thread_device.get, comp, "sum")
    assert identical([o[0][0] for o in out])
    got = out[0][0][0]
    first = int(np.prod(SHAPES[0]))
    dense = x.sum(axis=0)
    np.testing.assert_array_equal(np.isfinite(got[:first]), np.isfinite(dense[:first]))
    np.testing.assert_array_equal(got[:first][np.isfinite(dense[:first])],
                                  dense[:first][np.isfinite(dense[:first])])
    assert np.isfinite(got[first:]).all()


def test_warm_start_keeps_q_on_the_device(thread_device, rng):
    """A second call starts from the last Q, kept on the device (no host copy of it)."""
    comp = ringcomm.PowerSGD(rank=1, shapes=[(16, 12)])
    xs = [rng.standard_normal((2, 192)).astype(np.float32) for _ in range(2)]
    memory = []

    def job(t: Any) -> None:
        comm = Communicator(t)
        mine = comp.with_shapes(comp.shapes)
        mine.memory = ringcomm.PowerSGD().memory
        for x in xs:
            comm.allreduce(thread_device.put(x[t.rank]), compression=mine, name="w")
        if t.rank == 0:
            memory.append(mine.memory.entry("w").qs[0])

    run_ranks(2, job, timeout=120.0)
    assert type(memory[0]) is type(thread_device.put(np.zeros(1, np.float32)))
    assert memory[0].shape == (1, 12)


def test_passes_over_the_tensors_are_one_launch_each(thread_device, monkeypatch):
    """A bucket of 40 tensors launches the low-rank kernels as often as a bucket of 4: the
    dense tensors in and out, the non-finite marks, the residual and the result are one launch
    each for all the call's tensors (on a GPU, each launch costs the host tens of
    microseconds)."""
    from ringcomm.ops import _cuda_runtime

    launched: list[str] = []
    real = _cuda_runtime.launch

    def counted(name: str, *args: Any, **kwargs: Any) -> None:
        launched.append(name)
        real(name, *args, **kwargs)

    monkeypatch.setattr(_cuda_runtime, "launch", counted)

    def lowrank_launches(shapes: list[tuple[int, ...]]) -> dict[str, int]:
        length = sum(int(np.prod(s)) for s in shapes)
        xs = np.random.default_rng(5).standard_normal((2, length)).astype(np.float32)
        comp = ringcomm.PowerSGD(rank=1, shapes=shapes)

        def job(t: Any) -> None:
            mine = comp.with_shapes(comp.shapes)
            mine.memory = ringcomm.PowerSGD().memory
            Communicator(t).allreduce(thread_device.put(xs[t.rank]), op="avg", compression=mine,
                                      feedback=ringcomm.ErrorFeedback(), name="b")

        launched.clear()
        run_ranks(2, job, timeout=120.0)
        names = ("parts_kernel", "dense_runs", "outer_kernel", "outer_sum_kernel")
        return {n: launched.count(n) for n in set(launched) if any(k in n for k in names)}

    few = lowrank_launches([(16, 12), (16,), (8, 3, 3, 3), (8,)])
    many = lowrank_launches([(16, 12), (16,), (8, 3, 3, 3), (8,)] * 10)
    assert many == few
    # per rank: the dense tensors into the first ring's buffer and out of it (none went dense
    # in the second), one mark, one residual, one result
    assert few == {"rc::dense_runs_kernel": 2 * 2, "rc::mark_dense_parts_kernel": 2,
                   "rc::subtract_outer_parts_kernel": 2, "rc::outer_sum_parts_kernel": 2}


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_matrix_too_large_for_q_goes_dense(thread_device, where):
    """Every entry 2e37 in a 1024 x 4 matrix at 2 ranks: P stays finite, but Q = M^T P would
    overflow (1024 x 2 x 2e37), so the tensor goes dense: the exact sum 4e37, no residual, and
    the next call, of ones, is right too (an Inf residual would poison it)."""
    put, get = ((np.asarray, np.asarray) if where == "host"
                else (thread_device.put, thread_device.get))
    big = np.full(1024 * 4, 2e37, np.float32)

    def job(t: Any) -> list[np.ndarray]:
        comm = Communicator(t)
        comp = ringcomm.PowerSGD(rank=1, shapes=[(1024, 4)])
        ef = ringcomm.ErrorFeedback()
        got = [get(comm.allreduce(put(big), compression=comp, feedback=ef, name="b"))]
        got.append(get(ef.residual("b")))
        got.append(get(comm.allreduce(put(np.ones_like(big)), compression=comp, feedback=ef,
                                      name="b")))
        return got

    for first, residual, second in run_ranks(2, job, timeout=120.0):
        np.testing.assert_array_equal(first, np.float32(4e37))
        assert not residual.any()
        np.testing.assert_allclose(second, 2.0, rtol=1e-5)
