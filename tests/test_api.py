"""Public API in one process: init, ReduceOp, compressor parameters, a size-1 communicator."""

from __future__ import annotations

import numpy as np
import pytest

import ringcomm
from ringcomm import ReduceOp


@pytest.fixture(scope="module")
def comm():
    c = ringcomm.init("mpi", abort_on_exception=False)
    yield c
    c.close()


def test_public_names():
    for name in ("init", "Communicator", "ReduceOp", "FP16", "BF16", "Int8", "TopK",
                 "ErrorFeedback", "CommStats"):
        assert name in ringcomm.__all__ and hasattr(ringcomm, name)


def test_init_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'gloo'; expected one of auto, mpi, nccl"):
        ringcomm.init("gloo")


def test_auto_picks_mpi_without_gpu():
    if ringcomm.nccl_available():
        pytest.skip("this machine has a GPU and NCCL")
    c = ringcomm.init(abort_on_exception=False)
    assert c.backend == "mpi" and c.size == 1 and c.rank == 0
    c.close()


def test_env_switches(monkeypatch):
    monkeypatch.setenv("RINGCOMM_CONSISTENCY_CHECK", "0")
    monkeypatch.setenv("RINGCOMM_SEGMENT_BYTES", "4096")
    c = ringcomm.init("mpi", abort_on_exception=False)
    assert not c.consistency_check and c.segment_bytes == 4096
    c.close()
    monkeypatch.setenv("RINGCOMM_CONSISTENCY_CHECK", "maybe")
    with pytest.raises(ValueError, match="RINGCOMM_CONSISTENCY_CHECK must be 0 or 1"):
        ringcomm.init("mpi")


def test_inline_bytes_option(monkeypatch):
    c = ringcomm.init("mpi", inline_bytes=0, abort_on_exception=False)
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(c.allreduce(x), x)
    assert c.inline_bytes == 0
    c.close()
    monkeypatch.setenv("RINGCOMM_INLINE_BYTES", "1024")
    c = ringcomm.init("mpi", abort_on_exception=False)
    assert c.inline_bytes == 1024
    c.close()
    with pytest.raises(ValueError, match="inline_bytes must be a multiple of 8 >= 0, got 5"):
        ringcomm.init("mpi", inline_bytes=5)


def test_segment_bytes_checked():
    with pytest.raises(ValueError, match="segment_bytes must be >= 64, got 8"):
        ringcomm.init("mpi", segment_bytes=8)


@pytest.mark.parametrize(("text", "op"), [("sum", ReduceOp.SUM), ("AVG", ReduceOp.AVG),
                                          (ReduceOp.MAX, ReduceOp.MAX), ("prod", ReduceOp.PROD)])
def test_reduce_op_parse(text, op):
    assert ReduceOp.parse(text) is op


def test_reduce_op_unknown():
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        ReduceOp.parse("mean")


def test_size_one(comm):
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_array_equal(comm.allreduce(x, op="avg"), x)
    np.testing.assert_array_equal(comm.reduce_scatter(x), x.reshape(-1))
    np.testing.assert_array_equal(comm.allgather(x), x)
    np.testing.assert_array_equal(comm.broadcast(x.copy()), x)
    y = comm.allreduce(x, compression=ringcomm.Int8(), feedback=ringcomm.ErrorFeedback(),
                       name="x")
    np.testing.assert_array_equal(y, x)  # nothing travels, nothing is lost


def test_repr_and_context_manager():
    with ringcomm.init("mpi", abort_on_exception=False) as c:
        assert "rank 0 of 1" in repr(c)
    assert "closed" in repr(c)
    assert "calls=0" in repr(ringcomm.CommStats())
