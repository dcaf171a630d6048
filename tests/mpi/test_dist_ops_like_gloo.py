"""The "ringcomm" backend's all_reduce against gloo's, every dtype with every reduce op, in one
job: where gloo reduces, the backend's result has the same bits (integers wrapping alike, complex
numbers, 16-bit floats) and bools the same truth (logical or and and; gloo's SUM adds their
bytes, leaving a byte of 2 where two ranks said True, the backend's hold 0 or 1); where gloo
refuses, the backend refuses too, with one message on every rank, or reduces exactly (int16,
which gloo lacks). The bitwise ops (BAND, BOR, BXOR), which gloo has for integers, the backend
refuses on every rank, naming the ops it has.

The inputs are small integers (as every dtype), so that any order of additions and products
gives the same exact values at any number of ranks. NaN and signed zeros are left out: there
the backends differ by design (a NaN reaches every MIN and MAX on ringcomm, where gloo's may
drop it; which zero MIN returns).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import process_group, ringcomm_group  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()

pytestmark = pytest.mark.skipif(SIZE < 2, reason="needs two ranks")

group = pytest.fixture(scope="module", name="group")(ringcomm_group)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.complex128]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]
_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _input(dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: 13 small integers as ``dtype``; 8-bit ones past their range once
    summed or multiplied (they wrap), the 64-bit ones with an entry that overflows too."""
    base = torch.arange(-6, 7) + rank
    if dtype is torch.bool:
        return (base % 3) == 0
    if dtype.is_complex:
        return (base + 1j * (base - 2 * rank)).to(dtype)
    if dtype in (torch.int8, torch.uint8):
        wide = base * 37 + rank * 101  # e.g. 100 + 100: past int8's and uint8's range
        return wide.to(torch.int64).remainder(256).to(torch.uint8).view(dtype)
    if dtype is torch.int64:
        base[0] = 2**62 + rank  # sums past 2**63: wraps
    return base.to(dtype)


def _reduce(group: object, dtype: torch.dtype, op: str) -> torch.Tensor | str:
    """The reduced tensor, or the error raised, as ``"Type: message"``."""
    t = _input(dtype, RANK)
    try:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
    except Exception as err:  # what each backend raises is what is compared
        return f"{type(err).__name__}: {err}"
    return t


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _exact(dtype: torch.dtype, op: str) -> torch.Tensor:
    """The reduction of every rank's input computed here, in 64 bits, then cast back."""
    rows = torch.stack([_input(dtype, r).to(torch.int64) for r in range(SIZE)])
    if op == "AVG":  # of integers: the sum as the dtype holds it, divided rounding to 0
        return torch.div(_exact(dtype, "SUM"), SIZE, rounding_mode="trunc")
    if op == "SUM":
        out = rows.sum(0)
    elif op == "PRODUCT":
        out = rows.prod(0)
    else:
        out = rows.amin(0) if op == "MIN" else rows.amax(0)
    return out.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_as_gloo_reduces(group, dtype):
    process_group()
    for op in OPS:
        theirs, ours = _reduce(None, dtype, op), _reduce(group, dtype, op)
        # The same outcome on every rank, whichever it is.
        outcome = ours if isinstance(ours, str) else _bits(ours)
        assert WORLD.allgather(outcome) == [outcome] * SIZE, (dtype, op)
        where = f"{dtype} {op}: gloo {theirs!r}, ringcomm {ours!r}"
        if op in ("BAND", "BOR", "BXOR") and not isinstance(theirs, str):
            assert isinstance(ours, str) and ours.startswith(
                "ValueError: all_reduce: the ringcomm backend reduces with SUM, AVG, MIN, MAX, "
                "PRODUCT"), where
        elif not isinstance(theirs, str):
            assert not isinstance(ours, str), where
            if dtype is torch.bool:  # gloo's SUM adds the bytes: 2 where two ranks say True
                assert set(_bits(ours)) <= {0, 1}, where
                assert torch.equal(ours, theirs.view(torch.uint8) != 0), where
            else:
                assert _bits(ours) == _bits(theirs), where
        elif dtype is torch.int16 and op in ("SUM", "PRODUCT", "MIN", "MAX"):  # gloo lacks int16
            assert not isinstance(ours, str) and torch.equal(ours, _exact(dtype, op)), where
        elif op == "AVG" and dtype in _INTEGERS:  # gloo cannot write its quotient back; NCCL
            # averages integers (a sum, then a division rounding toward zero), and so does
            # this backend (PyTorch Lightning's "mean" asks for it on every backend but gloo)
            assert not isinstance(ours, str) and torch.equal(ours, _exact(dtype, op)), where
        else:
            assert isinstance(ours, str), where
