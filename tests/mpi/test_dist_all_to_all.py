"""all_to_all_single on the "ringcomm" torch.distributed backend, under mpiexec (ringcomm's
MPI communicator underneath): every rank's dtype and counts gathered and checked, then the
bytes moved pairwise.

Property: for split sizes, dtypes (bfloat16 and bool included: the bytes move as they are),
trailing shapes and layouts drawn alike on every rank, each rank's output equals what every
rank sent it, computed here from every rank's input. Arguments that differ between ranks, or
are wrong on one, raise the same error (type and message) on every rank before anything moves,
where gloo mixes the bytes of tensors of different dtypes without a word and ends the process
on counts that do not match; the group goes on in step afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import ringcomm_group  # noqa: E402

from ringcomm.core.types import (  # noqa: E402
    ArgumentMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
)

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
          torch.bool, torch.complex64)


group = pytest.fixture(scope="module", name="group")(ringcomm_group)


def _input(rank: int, rows: int, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: values that name the rank and the element."""
    n = rows * int(np.prod(trailing, dtype=np.int64))
    values = torch.arange(n, dtype=torch.float64) + 1000 * rank
    if dtype == torch.bool:
        return (values % 3 == rank % 2).reshape(rows, *trailing)
    if dtype == torch.int8:
        values = values % 127
    return values.to(dtype).reshape(rows, *trailing)


def _expected(table: list[list[int]], trailing: tuple[int, ...],
              dtype: torch.dtype) -> torch.Tensor:
    """What this rank receives: rows ``table[s][RANK]`` of rank s's input from each s."""
    parts = []
    for s in range(SIZE):
        x = _input(s, sum(table[s]), trailing, dtype)
        start = sum(table[s][:RANK])
        parts.append(x[start: start + table[s][RANK]])
    return torch.cat(parts)


def _same_on_every_rank(value: object) -> bool:
    return all(v == value for v in WORLD.allgather(value))


@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          phases=(Phase.explicit, Phase.generate),
          suppress_health_check=list(HealthCheck))
@given(table=st.lists(st.lists(st.integers(0, 5), min_size=SIZE, max_size=SIZE),
                      min_size=SIZE, max_size=SIZE),
       trailing=st.sampled_from([(), (3,), (2, 2)]),
       dtype=st.sampled_from(DTYPES),
       equal=st.booleans(),
       strided_output=st.booleans())
def test_every_rank_gets_what_every_rank_sent(group, table, trailing, dtype, equal,
                                              strided_output):
    if equal:  # no split sizes: equal parts
        table = [[2] * SIZE for _ in range(SIZE)]
    x = _input(RANK, sum(table[RANK]), trailing, dtype)
    want = _expected(table, trailing, dtype)
    if strided_output:  # written in place through a view whose rows are not adjacent
        base = torch.zeros((want.shape[0], 2, *trailing), dtype=dtype)
        out = base[:, 1]
    else:
        out = torch.zeros_like(want)
    sizes = {} if equal else {"output_split_sizes": [table[s][RANK] for s in range(SIZE)],
                              "input_split_sizes": table[RANK]}
    dist.all_to_all_single(out, x, group=group, **sizes)
    assert torch.equal(out, want), (out, want)
    if strided_output:
        assert not base[:, 0].any()  # the rows between were left alone


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except Exception as err:
        return type(err).__name__, str(err)
    return "ok", ""


def _still_in_step(group) -> None:
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t, group=group)
    assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 3


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that differ")
@pytest.mark.parametrize("case", ["dtypes", "counts", "splits_length", "negative", "sum",
                                  "indivisible", "scalar"])
def test_bad_calls_raise_the_same_error_on_every_rank(group, case):
    n = SIZE
    x, out = torch.arange(2.0 * n), torch.empty(2 * n)
    sizes: dict[str, list[int]] = {}
    last = RANK == n - 1
    if case == "dtypes":  # gloo: each rank gets another wrong answer, without a word
        x, out = x.to(torch.int32 if last else torch.float32), out.to(
            torch.int32 if last else torch.float32)
    elif case == "counts":  # gloo: the process ends
        sizes = {"input_split_sizes": [2] * n,
                 "output_split_sizes": [3] + [2] * (n - 2) + [1] if last else [2] * n}
    elif case == "splits_length":
        sizes = {"input_split_sizes": [2] * (n + (1 if last else 0)),
                 "output_split_sizes": [2] * n}
        if last:
            x = torch.arange(2.0 * (n + 1))
    elif case == "negative":
        sizes = {"input_split_sizes": [-1, 3] + [2] * (n - 2) if last else [2] * n,
                 "output_split_sizes": [2] * n}
    elif case == "sum":
        sizes = {"input_split_sizes": [2] * n, "output_split_sizes": [2] * n}
        if last:
            x = torch.arange(2.0 * n + 1)
    elif case == "indivisible" and last:
        x = torch.arange(2.0 * n + 1)
    elif case == "scalar" and last:
        x, out = torch.tensor(1.0), torch.tensor(0.0)
    kind, message = _outcome(lambda: dist.all_to_all_single(out, x, group=group, **sizes))
    want = {"dtypes": DtypeMismatchError, "counts": ArgumentMismatchError}.get(
        case, InvalidArgumentError)
    assert kind == want.__name__, (kind, message)
    assert message.startswith("all_to_all_single: "), message
    assert f"rank {n - 1}" in message, message
    assert _same_on_every_rank((kind, message))
    _still_in_step(group)


def test_empty_and_lone_rows(group):
    """Ranks that send nothing (every split 0) and zero-row tensors."""
    x = torch.empty((0, 4))
    out = torch.empty((0, 4))
    dist.all_to_all_single(out, x, [0] * SIZE, [0] * SIZE, group=group)
    one = torch.full((1, 2), float(RANK))  # rank 0 alone sends, its one row to the last rank
    to_last = [0] * SIZE
    to_last[-1] = 1 if RANK == 0 else 0
    got = torch.zeros((1 if RANK == SIZE - 1 else 0, 2))
    recvs = [1 if (s == 0 and RANK == SIZE - 1) else 0 for s in range(SIZE)]
    dist.all_to_all_single(got, one[: sum(to_last)], recvs, to_last, group=group)
    if RANK == SIZE - 1:
        assert got.tolist() == [[0.0, 0.0]]
    _still_in_step(group)


@pytest.mark.skipif(SIZE < 2, reason="needs another rank to send to")
@pytest.mark.parametrize("where", ["rank 0", "every rank"])
def test_one_element_tensors_of_any_stride(group, where):
    """A shift by one rank, one element each way, through an input and an output of stride
    2 (``x[::2]`` of two elements, which PyTorch calls contiguous) on one rank or on all: the
    same values as through dense tensors (a byte view of such a tensor was refused on its
    rank alone, after the counts were agreed, and the other ranks waited)."""
    strided = where == "every rank" or RANK == 0
    x = torch.tensor([1.0, 2.0]) + 10 * RANK
    x = x[::2] if strided else x[:1]
    base = torch.full((2,), -1.0)
    out = base[::2] if strided else base[:1]
    sends = [1 if d == (RANK + 1) % SIZE else 0 for d in range(SIZE)]
    recvs = [1 if s == (RANK - 1) % SIZE else 0 for s in range(SIZE)]
    dist.all_to_all_single(out, x, recvs, sends, group=group)
    _still_in_step(group)
    assert out.tolist() == [1.0 + 10 * ((RANK - 1) % SIZE)], out
    assert base[1].item() == -1.0  # the element between, left alone


def test_async_calls_complete_in_call_order(group):
    """Works started back to back (DDP and MoE layers start several) finish with the right
    values, an all_reduce between them included."""
    xs = [torch.arange(4.0 * SIZE) + 100 * RANK + k for k in range(3)]
    outs = [torch.empty(4 * SIZE) for _ in xs]
    works = [dist.all_to_all_single(o, x, group=group, async_op=True)
             for o, x in zip(outs, xs, strict=True)]
    t = torch.ones(2)
    works.append(dist.all_reduce(t, group=group, async_op=True))
    for w in works:
        w.wait()
    for k, o in enumerate(outs):
        want = torch.cat([torch.arange(4.0 * RANK, 4.0 * RANK + 4) + 100 * s + k
                          for s in range(SIZE)])
        assert torch.equal(o, want), (k, o, want)
    assert t.tolist() == [float(SIZE)] * 2


@pytest.mark.parametrize("uneven", [False, True])
def test_in_place(group, uneven):
    """Output and input in the same memory: every rank still gets what every rank sent
    (gloo's own all-to-all in place gives rank 2 of 3 another rank's rows, torch 2.13)."""
    # A symmetric table: each rank receives as many rows as it sends, so the tensor fits both.
    table = [[(s + d) % 3 + 1 if uneven else 2 for d in range(SIZE)] for s in range(SIZE)]
    t = _input(RANK, sum(table[RANK]), (2,), torch.float32)
    want = _expected(table, (2,), torch.float32)
    dist.all_to_all_single(t, t, table[RANK], table[RANK], group=group)
    assert torch.equal(t, want), (t, want)
    view = torch.zeros(2 * SIZE + 3)  # input and output overlapping views of one buffer
    view[1: 1 + 2 * SIZE] = torch.arange(2.0 * SIZE) + 100 * RANK
    dist.all_to_all_single(view[:2 * SIZE], view[1: 1 + 2 * SIZE], group=group)
    assert view[:2 * SIZE].tolist() == [100.0 * s + 2 * RANK + j for s in range(SIZE)
                                        for j in range(2)], view
