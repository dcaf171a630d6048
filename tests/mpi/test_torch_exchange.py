"""reducescatter, alltoall and grouped allgather of ringcomm.torch against NumPy references.

Every rank's inputs are gathered with mpi4py and the expected result is computed from them:
dtypes, uneven and zero rows, ops and scale factors, the async and grouped forms, gradients by
Horovod's rules, and errors that every rank raises alike (same type, same message) after which
the job goes on. The alltoall property test draws the same examples on every rank and agrees
on each example's outcome before it fails, so that no rank runs ahead of the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import hvd  # noqa: E402

import ringcomm.torch as ex  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8, torch.bool]
SETTINGS = {"derandomize": True, "database": None, "deadline": None,
            "phases": [Phase.explicit, Phase.generate],
            "suppress_health_check": list(HealthCheck), "print_blob": False}


@pytest.fixture(scope="module")
def h():
    return hvd()


def needs_two() -> None:
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")


def usable(h) -> None:
    """The job goes on after an error."""
    out = ex.reducescatter(torch.ones(SIZE, 2), op=h.Sum)
    assert torch.equal(out, torch.full((1, 2), float(SIZE)))


def values(t: torch.Tensor) -> np.ndarray:
    """``t`` as float64 (exact for the small values these tests use)."""
    return t.detach().to(torch.float64).numpy()


def everyone(t: torch.Tensor) -> list[np.ndarray]:
    """Every rank's ``t`` as float64, in rank order."""
    return WORLD.allgather(values(t))


def row_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s rows as raw bytes, one row of the result per row of ``t``."""
    width = math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:
        return np.zeros((t.shape[0], width), dtype=np.uint8)
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.reshape(t.shape[0], width)


def share(rows: int, rank: int = RANK) -> slice:
    """Horovod's split of ``rows`` over the job: the first ``rows % SIZE`` ranks get one more."""
    start = sum(rows // SIZE + (r < rows % SIZE) for r in range(rank))
    return slice(start, start + rows // SIZE + (rank < rows % SIZE))


def sample(rows: int, tail: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small rank-dependent values (0..6), so that sums are exact in every dtype."""
    n = rows * math.prod(tail)
    x = (torch.arange(n) * (RANK + 1 + salt) + RANK) % 7
    return x.reshape(rows, *tail).to(dtype)


def scatter_reference(inputs: list[np.ndarray], op: str, pre: float, post: float,
                      dtype: torch.dtype) -> np.ndarray:
    """Horovod's reducescatter of every rank's input before the split, in float64: integers
    scaled in float64 and truncated, an average as the sum scaled by 1/size."""
    exact = not dtype.is_floating_point
    scaled = [np.trunc(v * pre) if exact else v * pre for v in inputs]
    total = np.sum(scaled, axis=0)
    factor = post / SIZE if op == "Average" else post
    if dtype == torch.bool:
        return (total != 0).astype(np.float64)
    return np.trunc(total * factor) if exact else total * factor


def assert_scattered(out: torch.Tensor, x: torch.Tensor, op: str, pre: float = 1.0,
                     post: float = 1.0) -> None:
    ref = scatter_reference(everyone(x), op, pre, post, x.dtype)[share(x.shape[0])]
    assert out.dtype == x.dtype and out.shape == ref.shape
    rtol = 1e-2 if x.dtype in (torch.float16, torch.bfloat16) else 1e-6
    np.testing.assert_allclose(values(out), ref, rtol=rtol, atol=rtol)


# ----------------------------------------------------------------------------- reducescatter
@pytest.mark.parametrize("rows", [0, 1, 5, 8])
@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reducescatter_splits_rows_as_horovod(h, dtype, op, rows):
    x = sample(rows, (3,), dtype)
    before = x.clone()
    out = ex.reducescatter(x, op=getattr(h, op))
    assert_scattered(out, x, op)
    assert torch.equal(x, before)


@pytest.mark.parametrize(("pre", "post"), [(0.5, 1.0), (1.0, 3.0), (2.5, 0.5)])
@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32,
                                   torch.int64], ids=str)
def test_reducescatter_scale_factors(h, dtype, op, pre, post):
    x = sample(2 * SIZE + 1, (2, 2), dtype)
    out = ex.reducescatter(x, op=getattr(h, op), prescale_factor=pre, postscale_factor=post)
    assert_scattered(out, x, op, pre, post)


def test_reducescatter_default_op_is_average_and_async_forms(h):
    x = sample(7, (2,), torch.float64)
    handle = ex.reducescatter_async(x, name="rs.async", op=h.Sum)
    avg = ex.reducescatter(x)
    assert_scattered(h.synchronize(handle), x, "Sum")
    assert_scattered(avg, x, "Average")


def test_reducescatter_fp16_compression_reduces_in_half(h):
    x = sample(6, (4,), torch.float32)
    out = ex.reducescatter(x, op=h.Sum, compression=h.Compression.fp16)
    assert_scattered(out, x, "Sum")


def test_reducescatter_of_a_non_contiguous_tensor(h):
    x = sample(4, (5,), torch.float32).t()  # (5, 4), column-major
    assert_scattered(ex.reducescatter(x, op=h.Sum), x, "Sum")


def test_grouped_reducescatter_matches_one_by_one(h):
    tensors = [sample(5, (2,), torch.float32), sample(0, (3,), torch.float32, 1),
               sample(SIZE, (), torch.int64, 2), sample(3, (2, 2), torch.float16, 3),
               sample(1, (4,), torch.float32, 4)]
    outs = ex.grouped_reducescatter(tensors, op=h.Sum, postscale_factor=2.0)
    assert len(outs) == len(tensors)
    for out, x in zip(outs, tensors, strict=True):
        assert_scattered(out, x, "Sum", post=2.0)
    handle = ex.grouped_reducescatter_async(tensors, name="grs.async")
    for out, x in zip(h.synchronize(handle), tensors, strict=True):
        assert_scattered(out, x, "Average")
    assert ex.grouped_reducescatter([]) == []


@pytest.mark.parametrize(("op", "pre", "post"), [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0),
                                                 ("Sum", 0.5, 3.0), ("Average", 2.0, 0.25)])
def test_reducescatter_gradient_is_horovods(h, op, pre, post):
    """The allgather of the output gradients, times the size for Sum and the scale factors."""
    x = torch.randn(2 * SIZE + 1, 3, dtype=torch.float64, requires_grad=True)
    y = ex.reducescatter(x, op=getattr(h, op), prescale_factor=pre, postscale_factor=post)
    w = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + 10 * RANK
    (y * w).sum().backward()
    factor = (SIZE if op == "Sum" else 1) * pre * post
    np.testing.assert_allclose(values(x.grad), factor * np.concatenate(everyone(w)))


def test_grouped_reducescatter_gradient_is_horovods(h):
    xs = [torch.randn(SIZE + 1, 2, requires_grad=True), torch.randn(3, requires_grad=True)]
    ys = ex.grouped_reducescatter(xs, op=h.Sum)
    ws = [torch.full(y.shape, float(RANK + 1 + i)) for i, y in enumerate(ys)]
    sum((y * w).sum() for y, w in zip(ys, ws, strict=True)).backward()
    for x, w in zip(xs, ws, strict=True):
        np.testing.assert_allclose(values(x.grad), SIZE * np.concatenate(everyone(w)))


# ----------------------------------------------------------------------------- alltoall
def alltoall_reference(x: torch.Tensor, splits: list[int]) -> tuple[np.ndarray, list[int]]:
    """The bytes of the rows every rank sends this one, in rank order, and their counts."""
    rows, counts = [], []
    for data, sent in WORLD.allgather((row_bytes(x), splits)):
        start = sum(sent[:RANK])
        rows.append(data[start: start + sent[RANK]])
        counts.append(sent[RANK])
    return np.concatenate(rows), counts


def draw_splits(rng: np.random.Generator, rows: int, full: bool) -> list[int]:
    """Random counts (zeros likely) summing to ``rows``, or to fewer when not ``full``."""
    total = rows if full else int(rng.integers(0, rows + 1))
    cuts = np.sort(rng.integers(0, total + 1, size=SIZE - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()


@settings(max_examples=40, **SETTINGS)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES),
       tail=st.sampled_from([(), (3,), (2, 2), (4, 0)]), kind=st.sampled_from(
           ["list", "int32", "int64", "equal"]), full=st.booleans())
def test_alltoall_property(h, seed, dtype, tail, kind, full):
    rng = np.random.default_rng([seed, RANK])
    rows = SIZE * int(rng.integers(0, 4)) if kind == "equal" else int(rng.integers(0, 9))
    x = torch.from_numpy(rng.integers(0, 100, size=(rows, *tail))).to(dtype)
    counts = [rows // SIZE] * SIZE if kind == "equal" else draw_splits(rng, rows, full)
    splits = {"list": counts, "equal": None}.get(kind)
    if kind in ("int32", "int64"):
        splits = torch.tensor(counts, dtype=getattr(torch, kind))
    expected, expected_counts = alltoall_reference(x, counts)
    try:
        result = ex.alltoall(x, splits)
        out, received = (result, None) if splits is None else result
        ok = bool(out.dtype == dtype and tuple(out.shape[1:]) == tail
              and np.array_equal(row_bytes(out), expected)
              and (received is None or (received.tolist() == expected_counts and (
                  received.dtype == (splits.dtype if kind != "list" else torch.int32)))))
    except Exception as err:  # agreed on below, so that no rank goes on to the next example
        ok = repr(err)
    outcomes = WORLD.allgather(ok)
    assert all(o is True for o in outcomes), f"{x.shape} splits {counts}: {outcomes}"


def test_alltoall_uneven_splits_with_zeros_and_async(h):
    x = torch.arange(3 * SIZE, dtype=torch.float32) + 100 * RANK
    counts = [3 if d % 2 == RANK % 2 else 0 for d in range(SIZE)]  # whom it sends to
    counts[RANK] = 1
    expected, expected_counts = alltoall_reference(x, counts)
    out, received = h.synchronize(ex.alltoall_async(x, torch.tensor(counts), name="a2a"))
    assert np.array_equal(row_bytes(out), expected) and received.tolist() == expected_counts
    assert received.dtype == torch.int64
    out, received = h.synchronize(ex.alltoall_async(x[:SIZE]))  # equal split: a pair too
    assert out.shape == (SIZE,) and received.tolist() == [1] * SIZE


def test_alltoall_without_splits_returns_the_tensor_only(h):
    x = torch.arange(2 * SIZE).reshape(SIZE, 2) + 10 * RANK
    out = ex.alltoall(x)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, torch.stack([torch.arange(2 * RANK, 2 * RANK + 2) + 10 * r
                                         for r in range(SIZE)]))
    out, received = ex.alltoall(x, torch.tensor([], dtype=torch.int32))  # empty: equal too
    assert received.tolist() == [1] * SIZE


@pytest.mark.parametrize("full", [True, False])
def test_alltoall_gradient_goes_back_where_rows_came_from(h, full):
    rng = np.random.default_rng([7, RANK])
    x = torch.randn(int(rng.integers(2, 7)), 2, dtype=torch.float64, requires_grad=True)
    counts = draw_splits(rng, x.shape[0], full)
    y, received = ex.alltoall(x, counts)
    w = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + 100 * RANK
    (y * w).sum().backward()
    expected = np.zeros(x.shape)
    at = 0
    for d, (wd, got) in enumerate(WORLD.allgather((values(w), received.tolist()))):
        start = sum(got[:RANK])
        expected[at: at + counts[d]] = wd[start: start + counts[d]]
        at += counts[d]
    np.testing.assert_array_equal(values(x.grad), expected)


def test_one_element_tensors_of_any_stride(h):
    """A one-element tensor counts as contiguous whatever its stride (``x[::2]`` of two), and
    a flat view of it keeps that stride: the ranks holding one still take part, as the others
    (a byte view of it refused on that rank alone left the others waiting)."""
    lone = (torch.tensor([5.0, 6.0]) + 10 * RANK)[::2]  # stride 2 on every rank
    assert lone.is_contiguous() and lone.stride() == (2,)
    out, received = ex.alltoall(lone, torch.tensor([1 if d == 0 else 0 for d in range(SIZE)]))
    if RANK == 0:
        assert out.tolist() == [5.0 + 10 * r for r in range(SIZE)], out
    assert received.tolist() == ([1] * SIZE if RANK == 0 else [0] * SIZE)
    both = ex.grouped_allgather([lone, torch.arange(3.0) + RANK])
    assert both[0].tolist() == [5.0 + 10 * r for r in range(SIZE)], both
    assert both[1].tolist() == [float(j + r) for r in range(SIZE) for j in range(3)], both


def test_alltoall_equal_split_gradient(h):
    x = torch.ones(2 * SIZE, 3, requires_grad=True)
    (ex.alltoall(x) * (RANK + 1)).sum().backward()
    expected = torch.arange(1, SIZE + 1).repeat_interleave(2)[:, None].expand(-1, 3)
    assert torch.equal(x.grad, expected.float())


# ----------------------------------------------------------------------- grouped allgather
def test_grouped_allgather_gathers_every_dtype_and_shape(h):
    tensors = [sample(RANK + 1, (2,), dtype, i) for i, dtype in enumerate(DTYPES)]
    tensors += [sample(RANK % 2, (3, 2), torch.float32), sample(0, (4,), torch.int64),
                sample(2, (0,), torch.float64)]
    before = [t.clone() for t in tensors]
    outs = ex.grouped_allgather(tensors)
    asynced = h.synchronize(ex.grouped_allgather_async(tensors, name="gag.async"))
    for x, out, again, old in zip(tensors, outs, asynced, before, strict=True):
        expected = np.concatenate(WORLD.allgather(row_bytes(x)))
        assert out.dtype == x.dtype and out.shape[1:] == x.shape[1:]
        assert np.array_equal(row_bytes(out), expected)
        assert torch.equal(again, out) and torch.equal(x, old)
    assert ex.grouped_allgather([]) == []


def test_grouped_allgather_gradient_is_the_own_rows_of_the_average(h):
    xs = [torch.randn(RANK + 1, 2, requires_grad=True), torch.randn(2, requires_grad=True)]
    ys = ex.grouped_allgather(xs)
    ws = [torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) * (RANK + 1) + i
          for i, y in enumerate(ys)]
    sum((y * w).sum() for y, w in zip(ys, ws, strict=True)).backward()
    firsts = [sum(r + 1 for r in range(RANK)), 2 * RANK]
    for x, w, first in zip(xs, ws, firsts, strict=True):
        averaged = np.mean(everyone(w), axis=0)
        np.testing.assert_allclose(values(x.grad), averaged[first: first + x.shape[0]],
                                   rtol=1e-6)


# ----------------------------------------------------------------------------- errors
def _float_or_int(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32 if RANK % 2 == 0 else torch.int32)


# name: (call, error type, message pattern, needs two ranks)
ERRORS: dict[str, tuple[Callable[[Any], Any], type, str, bool]] = {
    "rs dtype": (lambda h: ex.reducescatter(_float_or_int(4)), RuntimeError,
                 "dtype differs between ranks", True),
    "rs shape": (lambda h: ex.reducescatter(torch.ones(3 + RANK)), RuntimeError,
                 "shape differs between ranks", True),
    "rs same numel, other rank": (lambda h: ex.reducescatter(
        torch.ones(2, 6) if RANK == 0 else torch.ones(2, 2, 3)), RuntimeError, "shape differs",
        True),
    "rs op": (lambda h: ex.reducescatter(torch.ones(2), op=h.Sum if RANK else h.Average),
              RuntimeError, "op differs between ranks", True),
    "rs prescale": (lambda h: ex.reducescatter(torch.ones(2), prescale_factor=1.0 + RANK),
                    RuntimeError, "prescale differs between ranks", True),
    "rs scalar": (lambda h: ex.reducescatter(torch.tensor(1.0)), ValueError,
                  "scalar inputs are not supported", False),
    "rs scalar on one rank": (lambda h: ex.reducescatter(
        torch.tensor(1.0) if RANK == 0 else torch.ones(1)), RuntimeError, "shape differs", True),
    "rs min": (lambda h: ex.reducescatter(torch.ones(2), op=h.Min), RuntimeError,
               "only hvd.Sum and hvd.Average are supported, got hvd.Min", False),
    "rs product": (lambda h: ex.reducescatter(torch.ones(2), op=h.Product), RuntimeError,
                   "got hvd.Product", False),
    "rs adasum": (lambda h: ex.reducescatter(torch.ones(2), op=h.Adasum), RuntimeError,
                  "got hvd.Adasum", False),
    "rs unknown op": (lambda h: ex.reducescatter(torch.ones(2), op=17), ValueError,
                      "unknown op 17", False),
    "rs async": (lambda h: h.synchronize(ex.reducescatter_async(_float_or_int(2))),
                 RuntimeError, "dtype differs", True),
    "grs scalar": (lambda h: ex.grouped_reducescatter([torch.zeros(3, 1), torch.tensor(1.0)]),
                   ValueError, r"scalar inputs are not supported \(tensor 1\)", False),
    "grs list": (lambda h: ex.grouped_reducescatter([torch.ones(2)] * (1 + (RANK == 0))),
                 RuntimeError, "tensors differs between ranks", True),
    "grs dtype of one": (lambda h: ex.grouped_reducescatter([torch.ones(2), _float_or_int(2)]),
                         RuntimeError, "dtype of tensor 1 differs", True),
    "a2a dtype": (lambda h: ex.alltoall(_float_or_int(SIZE)), RuntimeError,
                  "dtype differs between ranks", True),
    "a2a trailing shape": (lambda h: ex.alltoall(torch.ones(2 * SIZE, 1 + RANK)), RuntimeError,
                           "shape after the first dimension differs", True),
    "a2a scalar": (lambda h: ex.alltoall(torch.tensor(1.0)), ValueError,
                   "at least one dimension", False),
    "a2a sum on one rank": (lambda h: ex.alltoall(
        torch.ones(SIZE - (RANK == SIZE - 1)), [1] * SIZE), ValueError,
        f"rank {SIZE - 1}: the sum of splits \\({SIZE}\\) is greater than the first "
        f"dimension of the tensor \\({SIZE - 1}\\)", False),
    "a2a float splits": (lambda h: ex.alltoall(torch.ones(SIZE), torch.ones(SIZE)), ValueError,
                         "splits must be integers", False),
    "a2a splits length": (lambda h: ex.alltoall(torch.ones(SIZE + 1), [1] * (SIZE + 1)),
                          ValueError, f"splits has {SIZE + 1} entries", False),
    "a2a negative": (lambda h: ex.alltoall(torch.ones(2), [-1] + [1] * (SIZE - 1)), ValueError,
                     r"negative entry \(-1\)", False),
    "a2a 2-D splits": (lambda h: ex.alltoall(torch.ones(SIZE), torch.ones(1, SIZE,
                                                                           dtype=torch.int32)),
                       ValueError, "one-dimensional, got 2", False),
    "a2a indivisible": (lambda h: ex.alltoall(torch.ones(SIZE + 1)), ValueError,
                        "not a multiple of the number of ranks", True),
    "a2a bad on rank 0 only, async": (lambda h: h.synchronize(ex.alltoall_async(
        torch.ones(SIZE), [1] * SIZE if RANK else [2] * SIZE)), ValueError,
        "rank 0: the sum of splits", True),
    "gag trailing": (lambda h: ex.grouped_allgather([torch.ones(2), torch.ones(1, 2 + RANK)]),
                     RuntimeError, "shape after the first dimension of tensor 1 differs", True),
    "gag scalar": (lambda h: ex.grouped_allgather([torch.ones(2), torch.tensor(1.0)]),
                   RuntimeError, "tensor 1 is a scalar", False),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_raised_on_every_rank_alike(h, case):
    call, kind, pattern, two = ERRORS[case]
    if two:
        needs_two()
    with pytest.raises(kind, match=pattern) as info:
        call(h)
    if kind is RuntimeError and not isinstance(info.value, NotImplementedError):
        assert isinstance(info.value, h.HorovodInternalError)
    seen = WORLD.allgather((type(info.value).__name__, str(info.value)))
    assert all(s == seen[0] for s in seen), seen
    usable(h)


def test_a_duplicate_name_in_flight_is_refused(h):
    """Rank 0 submits twice while the others wait at a barrier: its first is still in flight."""
    needs_two()
    x = torch.ones(SIZE)
    if RANK == 0:
        first = ex.reducescatter_async(x, name="twice")
        with pytest.raises(ValueError, match="duplicate name"):
            ex.reducescatter_async(x, name="twice")
    WORLD.Barrier()
    if RANK != 0:
        first = ex.reducescatter_async(x, name="twice")
    assert torch.equal(h.synchronize(first), torch.ones(1))


def test_non_tensors_are_refused_before_submission(h):
    with pytest.raises(TypeError):
        ex.reducescatter([1, 2])
    with pytest.raises(TypeError):
        ex.grouped_allgather(torch.ones(2))
    with pytest.raises(TypeError):
        ex.alltoall_async(np.ones(2))
