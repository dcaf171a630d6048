"""The gloo transport's dense float sums and averages run as gloo's own allreduce.

Over a gloo group (the transport of torchrun jobs; here made from MPI's ranks), float32 and
float64 sums and averages above the inline slot go to ``dist.all_reduce`` instead of
ringcomm's ring. Checked against every rank's inputs gathered with mpi4py: the result is the
same bits on every rank, within rounding of the exact sum, and an average is the sum divided
by the size as the ring divides it; 16-bit floats and MIN/MAX/PROD still take the ring (counted
by wrapping the real ``dist.all_reduce``); RINGCOMM_GLOO_ALLREDUCE_BYTES bounds the native
path, and a value that differs between ranks is refused on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import (  # noqa: E402
    counting_gloo_allreduce,
    gloo_communicator,
    process_group,
)

from ringcomm.backends import gloo  # noqa: E402
from ringcomm.core.types import ArgumentMismatchError  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
SIZES = [2_000, 65_537, 1_000_003]  # above the inline slot; odd lengths


def _data(rank: int, n: int, dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + n)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)


comm = pytest.fixture(scope="module", name="comm")(gloo_communicator)
calls = pytest.fixture(name="calls")(counting_gloo_allreduce)


def _near_exact(got: np.ndarray, everyone: list[np.ndarray], tol: float) -> bool:
    """``got`` within ``tol`` of the exact sum, relative to the sum of the magnitudes."""
    wide = [a.astype(np.float64) for a in everyone]
    scale = np.sum(np.abs(wide), axis=0)
    return bool(np.all(np.abs(got - np.sum(wide, axis=0)) <= tol * scale))


def _same_everywhere(a: np.ndarray) -> bool:
    first = WORLD.bcast(a.tobytes(), root=0)
    return bool(WORLD.allreduce(int(a.tobytes() == first), op=MPI.MIN))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", SIZES)
def test_native_sum_and_average(comm, calls, dtype, n):
    x = _data(RANK, n, np.dtype(dtype))
    everyone = WORLD.allgather(x)
    total = comm.allreduce(x, op="sum")
    average = comm.allreduce(x.copy(), op="avg")
    in_place = x.copy()
    comm.allreduce(in_place, out=in_place, op="sum")
    if SIZE > 1:
        assert calls == [n, n, n]  # gloo's allreduce ran each of them
    assert _same_everywhere(total) and _same_everywhere(average)
    assert _near_exact(total, everyone, 1e-6 if dtype == "float32" else 1e-14)
    assert in_place.tobytes() == total.tobytes()
    assert average.tobytes() == (total / np.array(SIZE, dtype)).astype(dtype).tobytes()
    assert x.tobytes() == _data(RANK, n, np.dtype(dtype)).tobytes()  # the input untouched


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype, op", [("float16", "sum"), ("float32", "max"),
                                       ("float32", "min"), ("float64", "prod")])
def test_others_take_the_ring(comm, calls, dtype, op):
    n = 50_001
    x = _data(RANK, n, np.dtype(dtype))
    if op == "prod":
        x = np.abs(x) % 2 + 0.5
    x[::7] = np.nan if op in ("min", "max") else x[::7]
    got = comm.allreduce(x, op=op)
    assert calls == []
    everyone = np.stack(WORLD.allgather(x))
    if op in ("min", "max"):  # NaN propagates, as in NumPy
        want = getattr(np, {"min": "minimum", "max": "maximum"}[op]).reduce(everyone)
        assert np.array_equal(got, want, equal_nan=True)
    else:
        want = (everyone.astype(np.float32).sum(axis=0).astype(dtype) if op == "sum"
                else np.prod(everyone, axis=0))
        np.testing.assert_allclose(got, want, rtol=1e-3 if dtype == "float16" else 1e-12)
    assert _same_everywhere(got)


@pytest.mark.timeout(120)
def test_byte_limit(monkeypatch, calls):
    """Above RINGCOMM_GLOO_ALLREDUCE_BYTES the ring runs; 0 turns the native path off."""
    process_group()
    monkeypatch.setenv(gloo.NATIVE_BYTES_ENV, "64K")
    limited = gloo.TorchDistCommunicator()
    try:
        small, large = _data(RANK, 16_384, np.dtype("float32")), _data(RANK, 16_385,
                                                                        np.dtype("float32"))
        got = [limited.allreduce(small), limited.allreduce(large)]
        if SIZE > 1:
            assert calls == [16_384]
        for x, y in zip((small, large), got, strict=True):
            assert _near_exact(y, WORLD.allgather(x), 1e-6)
            assert _same_everywhere(y)
    finally:
        limited.close()


@pytest.mark.timeout(120)
def test_limit_that_differs_between_ranks_is_refused_everywhere(monkeypatch):
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")
    process_group()
    monkeypatch.setenv(gloo.NATIVE_BYTES_ENV, "1M" if RANK == 0 else "2M")
    with pytest.raises(ArgumentMismatchError) as err:
        gloo.TorchDistCommunicator()
    assert f"{gloo.NATIVE_BYTES_ENV} differs between ranks" in str(err.value)
    monkeypatch.setenv(gloo.NATIVE_BYTES_ENV, "lots" if RANK == SIZE - 1 else "1M")
    with pytest.raises(ValueError, match="must be a byte count"):
        gloo.TorchDistCommunicator()
