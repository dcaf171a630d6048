"""Refused all_reduce and broadcast calls on the "ringcomm" torch.distributed backend name the
tensors as given (their torch dtype and shape), also for the dtypes that travel as widened
copies (bool, uint8, int8, int16, bfloat16), where the communicator's agreement sees the
copies' int32/float32 and tagged shapes; the same error on every rank, and the group goes on
in step afterwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import ringcomm_group  # noqa: E402

from ringcomm.core.types import (  # noqa: E402
    ArgumentMismatchError,
    DtypeMismatchError,
    InvalidTypeError,
)

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()

pytestmark = pytest.mark.skipif(SIZE < 2, reason="needs two ranks")


group = pytest.fixture(scope="module", name="group")(ringcomm_group)


def _in_step(group):
    """The group goes on in step after a refusal."""
    t = torch.full((5,), float(RANK + 1))
    dist.all_reduce(t, group=group)
    assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 5


# (case, this rank's tensor, the error, the message's words)
CASES = [
    ("int8 shapes", lambda: torch.ones(3 + RANK, dtype=torch.int8), ArgumentMismatchError,
     "the tensors differ between ranks (shape): " + "; ".join(
         f"torch.int8 of shape ({3 + r},) on rank {r}" for r in range(SIZE))),
    ("int8 against int32",
     lambda: torch.ones(3, dtype=torch.int8 if RANK == 0 else torch.int32),
     DtypeMismatchError, "the tensors differ between ranks (dtype): torch.int8 of shape "
     "(3,) on rank 0; torch.int32 of shape (3,) on rank 1"),
    ("bfloat16 shapes", lambda: torch.ones(2, 3 if RANK == 0 else 4, dtype=torch.bfloat16),
     ArgumentMismatchError, "torch.bfloat16 of shape (2, 3) on rank 0; torch.bfloat16 of "
     "shape (2, 4) on rank 1"),
    ("float32 shapes", lambda: torch.ones(3 + RANK), ArgumentMismatchError,
     "shape differs between ranks: (3,) on rank 0; (4,) on rank 1"),
]


@pytest.mark.parametrize(("case", "make", "error", "words"), CASES, ids=[c[0] for c in CASES])
def test_all_reduce_refusals_name_the_tensors(group, case, make, error, words):
    with pytest.raises(error) as info:
        dist.all_reduce(make(), group=group)
    assert words in str(info.value), str(info.value)
    assert "1, 1, 1" not in str(info.value)         # no tag of a widened copy
    messages = WORLD.allgather(str(info.value))
    assert len(set(messages)) == 1, messages        # the same on every rank
    _in_step(group)


def test_an_average_of_bools_names_their_dtype(group):
    with pytest.raises(InvalidTypeError, match=r"op 'avg' needs a floating dtype, got torch.bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG, group=group)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.int64])
def test_integers_average_as_on_nccl(group, dtype):
    """AVG of integers: the sum, divided by the group's size rounding toward zero (NCCL's
    ncclAvg; PyTorch Lightning's "mean" of its int64 batch sizes asks for it on every backend
    but gloo), in all_reduce, and in reduce_scatter_tensor where it takes the dtype."""
    t = torch.tensor([3, -3, 7, 1 - 2 * (RANK % 2)], dtype=dtype) * (RANK + 1) \
        if dtype is not torch.uint8 else torch.tensor([3, 7, 9, 1], dtype=dtype) * (RANK + 1)
    rows = torch.stack([torch.tensor(r) for r in WORLD.allgather(t.tolist())]).to(torch.int64)
    want = torch.div(rows.sum(0), SIZE, rounding_mode="trunc").to(dtype)
    reduced = t.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.AVG, group=group)
    assert torch.equal(reduced, want), (reduced, want)
    if dtype not in (torch.int32, torch.int64):
        return  # reduce_scatter_tensor takes int32 and int64 through the communicator only
    chunks = torch.cat([t] * SIZE)
    out = torch.empty_like(t)
    dist.reduce_scatter_tensor(out, chunks, op=dist.ReduceOp.AVG, group=group)
    assert torch.equal(out, want), (out, want)


def test_an_average_of_integers_against_a_sum_elsewhere_fails_everywhere(group):
    """The integer average runs as a sum after a checkpoint, which a plain sum of the same
    tensor on another rank does not pass: the same error on every rank, no quotient on one
    rank and a sum on the other."""
    op = dist.ReduceOp.AVG if RANK == 0 else dist.ReduceOp.SUM
    with pytest.raises(ArgumentMismatchError, match="all_reduce averaging integers on rank 0"):
        dist.all_reduce(torch.ones(3, dtype=torch.int64), op=op, group=group)
    _in_step(group)


def test_broadcast_refusals_name_the_tensors(group):
    with pytest.raises(ArgumentMismatchError, match=r"broadcast: the tensors differ between "
                       r"ranks \(shape\): torch.bool of shape \(2,\) on rank 0; torch.bool of "
                       r"shape \(3,\) on rank 1"):
        dist.broadcast(torch.ones(2 + min(RANK, 1), dtype=torch.bool), src=0, group=group)


def test_crossed_calls_of_widened_tensors_fail_at_once(group):
    """Ranks in different collectives are refused as before (no exchange that only some
    ranks would come to)."""
    t = torch.ones(3, dtype=torch.int8)
    with pytest.raises(ArgumentMismatchError, match="collective calls differ between ranks"):
        if RANK == 0:
            dist.all_reduce(t, group=group)
        else:
            dist.all_gather([torch.empty_like(t) for _ in range(SIZE)], t, group=group)
    _in_step(group)


def test_other_arguments_keep_their_message(group):
    with pytest.raises(ArgumentMismatchError, match="root differs between ranks"):
        dist.broadcast(torch.ones(2, dtype=torch.bool), src=min(RANK, 1), group=group)
    _in_step(group)
