"""The horovod.torch surface over ringcomm: results, scaling rules, handles, errors, gradients."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import gathered, hvd, same_on_all_ranks  # noqa: E402

import ringcomm  # noqa: E402
from ringcomm.comm._mismatch import ranks_text  # noqa: E402
from ringcomm.torch.horovod._reduce import feedback_of  # noqa: E402

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="module")
def h():
    return hvd()


def needs_two() -> None:
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")


def usable(h) -> None:
    """The job goes on after an error."""
    out = h.allreduce(torch.ones(5), op=h.Sum)
    assert torch.equal(out, torch.full((5,), float(SIZE)))


def all_values(x: torch.Tensor) -> np.ndarray:
    """Every rank's ``x`` stacked (size x ...), as float64 (exact for these small values)."""
    return np.stack(MPI.COMM_WORLD.allgather(x.to(torch.float64).numpy()))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]


@pytest.mark.parametrize("op", ["Average", "Sum", "Min", "Max"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_ops_and_dtypes(h, dtype, op):
    x = (torch.arange(12).reshape(3, 4) % 5 + RANK).to(dtype)
    values = all_values(x)
    ref = {"Sum": values.sum(0), "Min": values.min(0), "Max": values.max(0),
           "Average": values.sum(0) / SIZE}[op]
    if op == "Average" and not dtype.is_floating_point:
        ref = np.trunc(ref)  # Horovod: the sum scaled by 1/size in float64, truncated
    before = x.clone()
    out = h.allreduce(x, op=getattr(h, op))
    assert out.dtype == dtype and out.shape == x.shape and torch.equal(x, before)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-2 if dtype in (
        torch.float16, torch.bfloat16) else 1e-6)
    h.allreduce_(x, op=getattr(h, op))
    assert torch.equal(x, out)
    assert same_on_all_ranks(out.double())


def test_async_in_place_and_out_of_place(h):
    x = torch.full((1000,), float(RANK))
    a = h.allreduce_async(x, name="a", op=h.Sum)
    b = h.allreduce_async_(x.clone(), name="b")
    c = h.broadcast_async(x, root_rank=SIZE - 1)
    d = h.allgather_async(x[:2])
    total = sum(range(SIZE))
    assert torch.equal(h.synchronize(a), torch.full((1000,), float(total)))
    assert torch.allclose(h.synchronize(b), torch.full((1000,), total / SIZE))
    assert torch.equal(h.synchronize(c), torch.full((1000,), float(SIZE - 1)))
    assert torch.equal(h.synchronize(d), torch.arange(SIZE).repeat_interleave(2).float())
    assert torch.equal(x, torch.full((1000,), float(RANK)))  # out-of-place left it alone


def test_poll_is_false_while_pending(h):
    x = torch.ones(10_000)
    if RANK == 1:
        time.sleep(0.5)  # rank 0 submits first and must see its operation pending
    handle = h.allreduce_async(x, name="late")
    if SIZE > 1 and RANK == 0:
        assert h.poll(handle) is False
    out = h.synchronize(handle)
    assert h.poll(handle) is True and torch.equal(out, torch.ones(10_000))


def test_prescale_postscale_are_exact_for_integers(h):
    x = torch.tensor([7, -7, 5, 3, -1, 1001, -999], dtype=torch.int32) * (RANK + 1)
    out = h.allreduce(x, op=h.Average, prescale_factor=0.5, postscale_factor=3.0)
    pre = np.trunc(all_values(x) * 0.5)  # each rank's scaling in float64, truncated
    expected = np.trunc(pre.sum(0) * (3.0 / SIZE)).astype(np.int32)
    np.testing.assert_array_equal(out.numpy(), expected)
    out = h.allreduce(x.long(), op=h.Sum, postscale_factor=0.3)
    np.testing.assert_array_equal(out.numpy(), np.trunc(all_values(x).sum(0) * 0.3))


def test_prescale_postscale_of_float16_are_computed_in_float32(h):
    gen = torch.Generator().manual_seed(RANK)
    x = (torch.rand(4096, generator=gen) * 8).half()
    out = h.allreduce(x, op=h.Average, prescale_factor=1 / 3, postscale_factor=0.7)
    pre = (x.float() * (1 / 3)).half()  # each rank: in float32, rounded once
    summed = torch.from_numpy(all_values(pre).sum(0)).float().half()  # the exact sum, rounded
    expected = (summed.float() * (0.7 / SIZE)).half()
    assert torch.equal(out, expected)


def test_allgather_first_dimension_may_differ(h):
    x = torch.full((RANK + 1, 3), RANK, dtype=torch.int64)
    out = h.allgather(x)
    rows = sum(r + 1 for r in range(SIZE))
    assert out.shape == (rows, 3)
    assert torch.equal(out[:, 0], torch.cat([torch.full((r + 1,), r) for r in range(SIZE)]))
    flags = h.allgather(torch.tensor([RANK % 2 == 0, True]))
    assert flags.dtype == torch.bool and flags.tolist() == [v for r in range(SIZE)
                                                            for v in (r % 2 == 0, True)]
    bf = h.allgather(torch.tensor([RANK + 0.5], dtype=torch.bfloat16))
    assert bf.dtype == torch.bfloat16 and bf.tolist() == [r + 0.5 for r in range(SIZE)]


WIDENED = (torch.bool, torch.int8, torch.uint8, torch.int16, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", WIDENED, ids=str)
def test_allgather_of_a_dtype_that_travels_widened_keeps_every_shape(h, dtype):
    """A dtype that travels as a wider one keeps the gathered shape where a dimension after
    the first is 0 (no elements: the rows cannot be inferred from them), and its 0-d
    tensors stay 0-d through allreduce and broadcast."""
    for shape_of in (lambda r: (1, 0), lambda r: (r + 1, 0, 3), lambda r: (0, 0),
                     lambda r: (r, 2)):
        out = h.allgather(torch.full(shape_of(RANK), RANK + 1).to(dtype))
        expected = torch.cat([torch.full(shape_of(r), r + 1).to(dtype) for r in range(SIZE)])
        assert out.dtype == dtype and out.shape == expected.shape, (out.shape, expected.shape)
        assert torch.equal(out, expected)
    op = h.Max if dtype == torch.bool else h.Sum
    assert h.allreduce(torch.ones((), dtype=dtype), op=op).shape == ()
    assert h.broadcast(torch.ones((), dtype=dtype), root_rank=0).shape == ()


def test_broadcast_in_place_and_objects(h):
    mask = torch.tensor([RANK == 0, RANK != 0, True])
    h.broadcast_(mask, root_rank=0)
    assert mask.tolist() == [True, False, True]
    w = torch.full((2, 3), float(RANK)).t()  # not contiguous
    h.broadcast_(w, root_rank=SIZE - 1)
    assert torch.equal(w, torch.full((3, 2), float(SIZE - 1)))
    obj = h.broadcast_object({"rank": RANK, "f": lambda v: v + 1}, root_rank=SIZE - 1)
    assert obj["rank"] == SIZE - 1 and obj["f"](1) == 2
    assert h.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]
    h.barrier()


def _loads_on_rank_0_only() -> str:
    if RANK != 0:
        raise ModuleNotFoundError("No module named 'only_on_rank_0'")
    return "loaded"


class LoadsOnRankZero:
    """What unpickles on rank 0 alone (a class whose module one node lacks)."""

    def __reduce__(self):
        return (_loads_on_rank_0_only, ())


@pytest.mark.parametrize("call", ["broadcast_object", "allgather_object"])
def test_object_that_does_not_unpickle_on_some_ranks_fails_on_every_rank(h, call):
    """Unpickled on rank 0 alone: a ValueError on every rank naming the others, and the next
    collective runs. Raised on those ranks alone, rank 0 went on with the object and waited
    at its next collective until the stall limit."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    others = ", ".join(map(str, range(1, SIZE)))
    with pytest.raises(ValueError, match=rf"{call}: ranks? {others} could not unpickle what it "
                                         r"received: ModuleNotFoundError: No module named"):
        if call == "broadcast_object":
            h.broadcast_object(LoadsOnRankZero() if RANK == 0 else None, root_rank=0)
        else:
            h.allgather_object(LoadsOnRankZero())
    assert h.allgather_object(RANK) == list(range(SIZE))
    assert h.broadcast_object({"r": RANK}, root_rank=SIZE - 1) == {"r": SIZE - 1}


def test_allgather_object_of_a_string_on_some_ranks_only(h):
    """A string on rank 0, None elsewhere (an optional error message): every rank gets the
    list. (Agreeing on the unpickling was skipped for a string, on those ranks alone: the
    others waited in a collective the string's rank never ran.)"""
    got = h.allgather_object("disk full" if RANK == 0 else None)
    assert got == ["disk full"] + [None] * (SIZE - 1)
    assert h.allgather_object(None if RANK == 0 else f"r{RANK}") == \
        [None] + [f"r{r}" for r in range(1, SIZE)]


def test_grouped_allreduce(h):
    xs = [torch.full((3,), float(RANK)), torch.full((2, 2), RANK, dtype=torch.int32)]
    outs = h.grouped_allreduce(xs, op=h.Sum)
    total = sum(range(SIZE))
    assert torch.equal(outs[0], torch.full((3,), float(total)))
    assert torch.equal(outs[1], torch.full((2, 2), total, dtype=torch.int32))
    h.synchronize(h.grouped_allreduce_async_(xs, op=h.Max))
    assert torch.equal(xs[0], torch.full((3,), float(SIZE - 1)))


@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8"])
def test_compressed_allreduce(h, compression):
    gen = torch.Generator().manual_seed(RANK)
    x = torch.randn(50_000, generator=gen)
    exact = torch.from_numpy(all_values(x).mean(0)).float()
    out = h.allreduce(x, compression=getattr(h.Compression, compression))
    assert float((out - exact).norm() / exact.norm()) < 0.02
    assert same_on_all_ranks(out)
    ints = torch.arange(10) * RANK  # integers pass uncompressed
    assert torch.equal(h.allreduce(ints, op=h.Sum, compression=h.Compression.int8),
                       torch.arange(10) * sum(range(SIZE)))


@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_named_compressed_allreduce_keeps_error_feedback(h, compression):
    """hvd.allreduce with a compression that keeps error feedback, under one name at every
    step: the results are those of the communicator's allreduce with an ErrorFeedback (bit for
    bit), and every rank's inputs add up to the results and what the residuals hold. Before,
    no residual was kept: top-k lost 81% of the mass over 20 steps."""
    comp = {"int8": h.Compression.int8, "topk": h.Compression.topk(0.05)}[compression]
    ef = ringcomm.ErrorFeedback()
    gen = torch.Generator().manual_seed(RANK)
    sent = np.zeros(5000)
    got = np.zeros(5000)
    for step in range(6):
        x = torch.randn(5000, generator=gen)
        out = h.allreduce(x, name=f"grad.{compression}", compression=comp)
        ref = h.communicator().allreduce(x.numpy(), op="avg", compression=comp.ring,
                                         feedback=ef, name="reference")
        assert np.array_equal(out.numpy(), ref), step
        assert same_on_all_ranks(out)
        sent += all_values(x).sum(0)
        got += out.double().numpy()
    held = sum(MPI.COMM_WORLD.allgather(ef.residual("reference").astype(np.float64)))
    np.testing.assert_allclose(SIZE * got + held, sent, atol=1e-4 * np.abs(sent).max())
    # The name for a tensor of another size (a last, partial batch): it starts afresh.
    out = h.allreduce(torch.ones(1000), name=f"grad.{compression}", compression=comp)
    assert out.shape == (1000,) and same_on_all_ranks(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_error_feedback_of_16_bit_tensors_keeps_the_result_rounding(h, compression, dtype):
    """hvd.allreduce of float16 and bfloat16 tensors under one name with error feedback: every
    rank's inputs add up to size x the results plus the residuals, to float32 rounding (a
    bfloat16 tensor travels as float32, and the rounding of its result back into bfloat16 was
    kept nowhere)."""
    comp = {"int8": h.Compression.int8, "topk": h.Compression.topk(0.05)}[compression]
    name = f"grad16.{compression}.{dtype}"
    gen = torch.Generator().manual_seed(RANK)
    sent = np.zeros(5000)
    got = np.zeros(5000)
    for _ in range(6):
        x = torch.randn(5000, generator=gen).to(dtype)
        out = h.allreduce(x, name=name, compression=comp)
        assert out.dtype == dtype and same_on_all_ranks(out.float())
        sent += all_values(x.double()).sum(0)
        got += out.double().numpy()
    residual = feedback_of(h.communicator()).residual(f"allreduce.{name}")
    held = sum(MPI.COMM_WORLD.allgather(residual.astype(np.float64)))
    np.testing.assert_allclose(SIZE * got + held, sent, atol=1e-6 * np.abs(sent).max())


CASES = {
    "shape": (lambda h: h.allreduce(torch.ones(3 + (RANK == 1))),
              r"shape differs between ranks: \(3,\) on rank"),
    "dtype": (lambda h: h.allreduce(torch.ones(3, dtype=torch.float64 if RANK == 1 else None)),
              "dtype differs between ranks: torch.float32 on rank"),
    "widened dtype": (lambda h: h.allreduce(torch.ones(3, dtype=torch.int8 if RANK == 1
                                                        else torch.int32), op=h.Sum),
                      "dtype differs between ranks: torch.int32 on rank.*torch.int8 on rank 1"),
    "root": (lambda h: h.broadcast(torch.ones(3), root_rank=RANK % 2), "root differs"),
    "allgather": (lambda h: h.allgather(torch.ones(2, 3 + (RANK == 1))),
                  "shape after the first dimension differs"),
    "async": (lambda h: h.synchronize(h.allreduce_async(torch.ones(4 + RANK))), "shape differs"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_raises_runtime_error_on_every_rank(h, case):
    needs_two()
    call, message = CASES[case]
    with pytest.raises(RuntimeError, match=message) as info:
        call(h)
    assert isinstance(info.value, h.HorovodInternalError)
    usable(h)


SPARSE_CALLS = {
    "allreduce": lambda h, t: h.allreduce(t),
    "allreduce_": lambda h, t: h.allreduce_(t),
    "allreduce_async": lambda h, t: h.synchronize(h.allreduce_async(t, name="sparse")),
    "grouped_allreduce": lambda h, t: h.grouped_allreduce([torch.ones(2), t]),
    "allgather": lambda h, t: h.allgather(t),
    "grouped_allgather": lambda h, t: h.grouped_allgather([t]),
    "broadcast": lambda h, t: h.broadcast(t, root_rank=0),
    "broadcast_": lambda h, t: h.broadcast_(t, root_rank=0),
    "alltoall": lambda h, t: h.alltoall(t),
    "reducescatter": lambda h, t: h.reducescatter(t),
}


@pytest.mark.parametrize("on", ["every rank", "rank 0"])
@pytest.mark.parametrize("call", sorted(SPARSE_CALLS))
def test_a_sparse_tensor_is_refused_on_every_rank(h, call, on):
    """A sparse tensor given to a collective of dense tensors, by every rank or by rank 0
    alone: the same error on every rank at once, saying what to do (rank 0 raised alone, and
    the others waited to the stall limit)."""
    sparse = on == "every rank" or RANK == 0
    t = (torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)) if sparse
         else torch.ones(4))
    ranks = ranks_text(list(range(SIZE)) if on == "every rank" else [0])
    with pytest.raises(h.HorovodInternalError, match=(
            f"invalid arguments on {ranks}: "
            r"TypeError: expected a dense \(strided\) tensor, got one of layout torch.sparse_coo: "
            r"reduce a sparse gradient with hvd.sparse_allreduce_async")):
        SPARSE_CALLS[call](h, t)
    usable(h)


def test_unsupported_dtype_and_bad_root_raise_on_every_rank(h):
    with pytest.raises(RuntimeError, match="unsupported dtype complex64"):
        h.allreduce(torch.ones(3, dtype=torch.complex64))
    if SIZE > 1:
        with pytest.raises(RuntimeError, match=r"dtype differs between ranks: torch.complex64 "
                                                r"on rank 0; torch.float32 on rank"):
            h.allreduce(torch.ones(3, dtype=torch.complex64 if RANK == 0 else torch.float32))
    with pytest.raises(RuntimeError, match=r"root must be a rank in \[0, "):
        h.broadcast_(torch.ones(3), root_rank=SIZE)
    usable(h)


def test_allreduce_gradient_is_the_allreduce_of_gradients(h):
    w = torch.arange(5.0) * (RANK + 1)  # each rank weighs the output differently
    for op, combine in ((h.Sum, np.sum), (h.Average, np.mean)):
        x = torch.randn(5, requires_grad=True)
        (h.allreduce(x, op=op) * w).sum().backward()
        torch.testing.assert_close(x.grad, torch.from_numpy(combine(all_values(w), 0)).float())


def test_allgather_gradient_is_the_own_slice_of_the_averaged_gradient(h):
    x = torch.randn(RANK + 1, 2, requires_grad=True)
    y = h.allgather(x)
    w = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) * (RANK + 1)
    (y * w).sum().backward()
    averaged = torch.from_numpy(all_values(w).mean(0)).float()
    offset = sum(r + 1 for r in range(RANK))
    torch.testing.assert_close(x.grad, averaged[offset: offset + RANK + 1])


def test_broadcast_gradient_reaches_the_root_only(h):
    x = torch.randn(4, requires_grad=True)
    w = torch.arange(4.0) + RANK
    (h.broadcast(x, root_rank=0) * w).sum().backward()
    averaged = torch.from_numpy(all_values(w).mean(0)).float()
    expected = averaged if RANK == 0 else torch.zeros(4)
    torch.testing.assert_close(x.grad, expected)


def test_gathered_helper_agrees_with_allgather(h):
    x = torch.arange(3) + 10 * RANK
    assert torch.equal(gathered(x), h.allgather(x))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)])
def test_zero_size_tensors_are_a_no_op(h, shape):
    """A zero-size tensor of any shape: the result has its shape, on every rank, and the job
    goes on (it used to fail before the agreement, leaving the other rank with wrong data)."""
    x = torch.ones(shape)
    assert h.allreduce(x, op=h.Sum).shape == shape
    assert h.synchronize(h.allreduce_async(x, op=h.Average)).shape == shape
    assert h.allgather(x).shape == (shape[0] * SIZE, *shape[1:])
    assert h.broadcast(x, root_rank=0).shape == shape
    usable(h)
