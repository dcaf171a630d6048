"""Device arrays over the gloo transport (torchrun jobs): the ring's messages go through pinned
host buffers lent from a pool, and their copies to the device are queued, not waited for.

Run on a GPU with CuPy (marker ``gpu``) and on the CPU emulator (tests/gpu_emulator.py), the
gloo group made from MPI's ranks. Every result must have the bits the same call on host arrays
gives over the same group, on every rank, error feedback's residuals too; the pinned buffers are
kept between calls, not allocated per message.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi_helpers import same_on_all_ranks  # noqa: E402
from test_cuda_ring import KINDS, Kind, device_kinds  # noqa: E402
from torch_helpers import gloo_communicator  # noqa: E402

import ringcomm  # noqa: E402
from ringcomm.backends import staging  # noqa: E402

pytestmark = pytest.mark.timeout(180)

comm = pytest.fixture(scope="module", name="comm")(gloo_communicator)

COMPRESSORS = {
    "int8": ringcomm.Int8(),
    "fp16": ringcomm.FP16(),
    "bf16": ringcomm.BF16(),
    "topk-ring": ringcomm.TopK(0.01),
    "topk-allgather": ringcomm.TopK(0.01, algorithm="allgather"),
}


@pytest.fixture(scope="module", params=KINDS)
def kind(request, comm, world):
    """Device arrays of a GPU, or of the CPU emulator; the transport's pinned buffers are this
    kind's (dropped before and after)."""

    def forget() -> None:
        comm.transport._copies = None

    yield from device_kinds(request.param, comm, world, forget)


def _same(kind: Kind, world: Any, got: Any, want: np.ndarray) -> None:
    assert type(got) is not np.ndarray, "a device call returned a host array"
    host = kind.get(got)
    assert host.dtype == want.dtype and host.shape == want.shape
    np.testing.assert_array_equal(host, want)
    assert same_on_all_ranks(world, host)


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_compressed_allreduce_matches_the_host_calls(comm, world, rng, kind, name, op):
    """Three steps with error feedback, a NaN at the second: the device results and residuals
    are the host's, on every rank."""
    comp = COMPRESSORS[name]
    host_ef, device_ef = ringcomm.ErrorFeedback(), ringcomm.ErrorFeedback()
    for step in range(3):
        g = rng.standard_normal(kind.large).astype(np.float32)
        if step == 1:
            g[rng.integers(0, g.size)] = np.nan
        calls = comm._allreduce.compressed_calls  # keys the random numbers alike for both
        want = comm.allreduce(g, op=op, compression=comp, feedback=host_ef, name="g")
        comm._allreduce.compressed_calls = calls
        got = comm.allreduce(kind.put(g), op=op, compression=comp, feedback=device_ef,
                             name="g")
        _same(kind, world, got, want)
        np.testing.assert_array_equal(kind.get(device_ef.residual("g")), host_ef.residual("g"))


@pytest.mark.parametrize("dtype", ["float16", "int32"])
@pytest.mark.parametrize("segment_bytes", [4096, 1 << 20])
def test_dense_ring_of_device_arrays(comm, world, rng, kind, dtype, segment_bytes):
    """Dtypes gloo's own allreduce does not take run ringcomm's ring: many segments in flight,
    in place and into a new array, the host's bits."""
    saved, comm.segment_bytes = comm.segment_bytes, segment_bytes
    try:
        x = (rng.standard_normal(kind.large) * 100).astype(dtype)
        want = comm.allreduce(x)
        y = kind.put(x)
        assert comm.allreduce(y, out=y) is y
        _same(kind, world, y, want)
        _same(kind, world, comm.allreduce(kind.put(x)), want)
    finally:
        comm.segment_bytes = saved


def test_pinned_buffers_are_kept_between_calls(comm, world, rng, kind, monkeypatch):
    """After a first compressed call, the same calls allocate no pinned memory, and the pool
    keeps a bounded number of buffers."""
    if comm.size == 1:
        pytest.skip("one rank sends no messages")
    made: list[int] = []
    real = kind.cupy.cuda.alloc_pinned_memory

    def counted(nbytes: int) -> Any:
        made.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(kind.cupy.cuda, "alloc_pinned_memory", counted)
    comm.transport._copies = None  # a pool of its own, empty
    x = rng.standard_normal(kind.large).astype(np.float32)
    ef = ringcomm.ErrorFeedback()
    comm.allreduce(kind.put(x), compression=ringcomm.Int8(), feedback=ef, name="p")
    first = len(made)
    assert first > 0, "device messages did not go through the pinned pool"
    for _ in range(3):
        comm.allreduce(kind.put(x), compression=ringcomm.Int8(), feedback=ef, name="p")
    assert len(made) == first
    pool = comm.transport._copies._pool
    assert 0 < len(pool._idle) <= staging._KEEP


def test_sendrecv_of_device_arrays(comm, kind):
    """A user's sendrecv between device arrays, and between a device and a host array."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    recv = kind.put(np.zeros(100, np.int64))
    comm.sendrecv(kind.put(np.arange(100, dtype=np.int64) + comm.rank), right, recv, left)
    np.testing.assert_array_equal(kind.get(recv), np.arange(100) + left)
    host = np.zeros(100, np.int64)
    comm.sendrecv(kind.put(np.arange(100, dtype=np.int64) * comm.rank), right, host, left)
    np.testing.assert_array_equal(host, np.arange(100) * left)


def test_a_chunk_of_device_arrays_is_one_segment(comm, kind):
    """gloo stages every message through host memory, waiting for its copy: a chunk of device
    arrays travels as one segment (up to the ring's cap), the same layout on every rank; host
    arrays keep the host's segments."""
    from ringcomm.algorithms import ring

    t = comm.transport
    n = 4 * kind.large
    device = ring._layout(t, kind.put(np.zeros(n, np.float32)), 4096)
    host = ring._layout(t, np.zeros(n, np.float32), 4096)
    assert device.nseg == 1
    assert host.nseg > 1
