"""Operations matched by name, as Horovod's coordinator matches them: any order, any thread.

Every result is checked against NumPy over every rank's inputs. The inputs depend on the
operation's name and the rank only, so any rank can compute every rank's contribution.
"""

from __future__ import annotations

import random
import threading
import time
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import HalfCompressor, hvd, same_on_all_ranks  # noqa: E402

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
FUSION = 4 * 1024 * 1024  # the default threshold (bytes)


@pytest.fixture(scope="module")
def h():
    return hvd()


def needs_two() -> None:
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")


def data(name: str, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of the operation ``name``: small integers, exact in any dtype."""
    gen = np.random.default_rng(zlib.crc32(f"{name}/{rank}".encode()))
    return torch.from_numpy(gen.integers(-8, 9, n).astype(np.float64)).to(dtype)


def reference(name: str, n: int, op: str) -> np.ndarray:
    values = np.stack([data(name, r, n, torch.float64).numpy() for r in range(SIZE)])
    return {"sum": values.sum(0), "average": values.sum(0) / SIZE, "max": values.max(0)}[op]


OPS = {"sum": "Sum", "average": "Average", "max": "Max"}
SIZES = [1, 17, 1000, FUSION // 4 + 3]  # the last one is over the fusion threshold alone


def plan(seed: int, count: int) -> list[tuple[str, int, torch.dtype, str]]:
    """``count`` operations (the same on every rank): name, length, dtype, op."""
    gen = random.Random(seed)
    dtypes = [torch.float32, torch.float64, torch.int32, torch.float16]
    return [(f"op{seed}.{i}", gen.choice(SIZES), gen.choice(dtypes), gen.choice(list(OPS)))
            for i in range(count)]


def check(results: dict[str, torch.Tensor], ops: list[tuple[str, int, torch.dtype, str]]):
    for name, n, dtype, op in ops:
        got = results[name]
        assert got.dtype == dtype, name
        want = reference(name, n, op)
        if op == "average" and not dtype.is_floating_point:
            want = np.trunc(want)
        # Exact where the average divides by a power of two; rounded to the dtype elsewhere.
        rtol = {torch.float16: 1e-3, torch.float32: 1e-6}.get(dtype, 1e-12)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol, err_msg=name)
        assert same_on_all_ranks(got.double()), name


def test_two_named_operations_in_opposite_orders(h):
    a = torch.full((3,), 1.0 + 100 * RANK)
    b = torch.full((3,), 10.0 + 1000 * RANK)
    pairs = [("a", a), ("b", b)] if RANK % 2 == 0 else [("b", b), ("a", a)]
    handles = {n: h.allreduce_async(t, name=n, op=h.Sum) for n, t in pairs}
    out = {n: h.synchronize(hd) for n, hd in handles.items()}
    assert torch.equal(out["a"], torch.full((3,), sum(1.0 + 100 * r for r in range(SIZE))))
    assert torch.equal(out["b"], torch.full((3,), sum(10.0 + 1000 * r for r in range(SIZE))))


@pytest.mark.parametrize("seed", range(4))
def test_random_submission_orders(h, seed):
    ops = plan(seed, 24)
    order = list(ops)
    random.Random(1000 * seed + RANK).shuffle(order)  # a different order on every rank
    handles = {}
    for name, n, dtype, op in order:
        handles[name] = h.allreduce_async(data(name, RANK, n, dtype), name=name,
                                          op=getattr(h, OPS[op]))
    check({n: h.synchronize(hd) for n, hd in handles.items()}, ops)


def test_random_orders_from_several_threads(h):
    ops = plan(99, 30)
    results: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(part: list, seed: int) -> None:
        try:
            random.Random(seed).shuffle(part)
            handles = [(name, h.allreduce_async(data(name, RANK, n, dtype), name=name,
                                                op=getattr(h, OPS[op])))
                       for name, n, dtype, op in part]
            for name, handle in handles:
                results[name] = h.synchronize(handle)
        except BaseException as err:
            errors.append(err)

    # Three threads, each taking a different share of the operations on every rank.
    shares = [[] for _ in range(3)]
    for i, item in enumerate(ops):
        shares[(i + RANK) % 3].append(item)
    threads = [threading.Thread(target=worker, args=(share, 7 * RANK + k))
               for k, share in enumerate(shares)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    check(results, ops)


def test_unnamed_operations_match_per_thread(h):
    """Unnamed operations are matched in submission order within each (same-named) thread."""
    out: dict[int, torch.Tensor] = {}

    def worker(k: int) -> None:
        out[k] = h.allreduce(torch.full((4,), float(k + 10 * RANK)), op=h.Sum)

    threads = [threading.Thread(target=worker, args=(k,), name=f"worker-{k}") for k in range(3)]
    for t in threads[::-1 if RANK % 2 else 1]:  # started in different orders on the ranks
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k in range(3):
        assert torch.equal(out[k], torch.full((4,), float(SIZE * k + 10 * sum(range(SIZE)))))


@pytest.mark.parametrize("where", ["every rank", "rank 0"])
def test_unnamed_operations_of_two_threads_of_one_name_fail_on_every_rank(h, where):
    """Two live threads of one name submit unnamed allreduces: the names are counted per
    thread name, so which twin's call paired with which on another rank was a race (16 in 30
    results were another thread's data, silently). Each fails on every rank, where the twins
    live on every rank or on rank 0 only (the other ranks' one thread of that name makes
    the same calls); a named operation of theirs runs."""
    twins = RANK < (SIZE if where == "every rank" else 1)
    go = threading.Barrier(2)
    outcomes: dict[int, list[object]] = {0: [], 1: []}

    def unnamed(k: int) -> None:
        for _ in range(5):
            try:
                out = h.allreduce(torch.full((8,), 1000.0 * k + RANK + 1), op=h.Sum)
                outcomes[k].append(out[0].item())
            except Exception as err:  # the test looks at it
                outcomes[k].append(err)

    def named(k: int) -> None:
        out = h.allreduce(torch.full((3,), float(RANK + 1)), op=h.Sum, name=f"twin{k}")
        outcomes[k].append(out[0].item())

    def twin(k: int) -> None:
        go.wait(timeout=60)  # both alive before either calls
        unnamed(k)
        named(k)

    def alone() -> None:
        unnamed(0), unnamed(1), named(0), named(1)

    threads = ([threading.Thread(target=twin, args=(k,), name="twin") for k in (0, 1)] if twins
               else [threading.Thread(target=alone, name="twin")])
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    total = float(sum(range(1, SIZE + 1)))
    for k in (0, 1):
        *calls, last = outcomes[k]
        assert last == total and len(calls) == 5, outcomes
        for got in calls:
            assert isinstance(got, ValueError), outcomes
            assert "bears the same name" in str(got) and "name the operation" in str(got), got


def test_small_operations_are_fused(h):
    comm = h.communicator()
    ops = [(f"fuse.{i}", 10, torch.float32, "sum") for i in range(64)]
    h.barrier()
    before = comm.stats.calls
    handles = {n: h.allreduce_async(data(n, RANK, k, d), name=n, op=h.Sum)
               for n, k, d, _ in ops}
    results = {n: h.synchronize(hd) for n, hd in handles.items()}
    calls = comm.stats.calls - before
    check(results, ops)
    assert calls < len(ops), f"{len(ops)} small allreduces took {calls} collectives"


def test_grouped_allreduce_is_one_operation(h):
    tensors = [data(f"g{i}", RANK, 5 + i, torch.float64) for i in range(4)]
    out = h.grouped_allreduce(tensors, name="group", op=h.Sum)
    for i, t in enumerate(out):
        np.testing.assert_array_equal(t.numpy(), reference(f"g{i}", 5 + i, "sum"))


def test_duplicate_name_while_other_ranks_wait_in_a_barrier(h):
    """Horovod's own scenario: one rank's operation waits while the others pass a barrier."""
    needs_two()
    t = torch.ones(3)
    handle = None
    if RANK == 0:
        handle = h.allreduce_async(t, name="late", op=h.Sum)
        for _ in range(3):
            with pytest.raises(ValueError, match=r"'late'.*already in flight on this rank"):
                h.allreduce_async(t, name="late", op=h.Sum)
    h.barrier()
    if RANK != 0:
        handle = h.allreduce_async(t, name="late", op=h.Sum)
    assert torch.equal(h.synchronize(handle), torch.full((3,), float(SIZE)))
    # Once done, the name is free again.
    assert torch.equal(h.allreduce(t, name="late", op=h.Sum), torch.full((3,), float(SIZE)))



def test_an_asynchronous_operation_is_in_flight_for_a_cycle_while_cycles_run(h):
    """Horovod's duplicate-name test, its second half: the ranks already run cycles (an
    operation of rank 0 waits for the others) when each submits an operation asynchronously
    and at once the same name again. The second submission must find the first in flight:
    a cycle that took the first at once could run it to its end first, and the second then
    went through on some ranks and waited for the others for good (55 of 200 in a
    reproducer). Asynchronous submissions are negotiated a cycle time after the first of
    their burst, cycles running or not."""
    needs_two()
    from ringcomm.torch.horovod import _negotiate

    # 50 ms, not 1: a rank held back between its two submissions for longer than a cycle time
    # (a loaded machine) sees its first operation complete, as in Horovod.
    coordinators = list(_negotiate._COORDINATORS.values())
    cycle_times = [c._cycle_time for c in coordinators]
    for c in coordinators:
        c._cycle_time = 0.05
    try:
        _submit_twice_while_cycles_run(h)
    finally:
        for c, cycle_time in zip(coordinators, cycle_times, strict=True):
            c._cycle_time = cycle_time


def _submit_twice_while_cycles_run(h):
    t = torch.ones(17, 17)
    late = h.allreduce_async(t, name="keeps-cycles-running", op=h.Sum) if RANK == 0 else None
    accepted = []
    for i in range(60):
        first = h.allreduce_async(t, name=f"twice{i}", op=h.Sum)
        try:
            accepted.append((i, h.allreduce_async(t, name=f"twice{i}", op=h.Sum)))
        except ValueError:
            pass
        h.synchronize(first)
    # Whatever went through twice pairs with the same name from every other rank, so that
    # no operation is left waiting, whatever the outcome.
    went_through = MPI.COMM_WORLD.allgather([i for i, _ in accepted])
    for i in sorted({i for mine in went_through for i in mine} - {i for i, _ in accepted}):
        accepted.append((i, h.allreduce_async(t, name=f"twice{i}", op=h.Sum)))
    for _, handle in accepted:
        h.synchronize(handle)
    if RANK != 0:
        late = h.allreduce_async(t, name="keeps-cycles-running", op=h.Sum)
    assert torch.equal(h.synchronize(late), torch.full((17, 17), float(SIZE)))
    assert went_through == [[]] * SIZE

@pytest.mark.parametrize("what", ["shape", "dtype", "op"])
def test_mismatch_fails_that_operation_on_every_rank(h, what):
    needs_two()
    shape = (3 + (RANK if what == "shape" else 0),)
    dtype = torch.float64 if what == "dtype" and RANK == 1 else torch.float32
    op = h.Max if what == "op" and RANK == 1 else h.Sum
    good = h.allreduce_async(torch.ones(2), name="good", op=h.Sum)
    bad = h.allreduce_async(torch.ones(shape, dtype=dtype), name="bad", op=op)
    with pytest.raises(h.HorovodInternalError, match=rf"'bad': {what} differs between ranks"):
        h.synchronize(bad)
    assert torch.equal(h.synchronize(good), torch.full((2,), float(SIZE)))


@pytest.mark.parametrize("other", ["allgather", "broadcast"])
def test_one_name_for_different_operations_fails_at_once_on_every_rank(h, other):
    """An allreduce named "a" on rank 0 and another operation named "a" elsewhere (a
    ``sparse_as_dense`` that differs between ranks does it): every rank raises at once, naming
    both, as Horovod does; each used to wait for the other's ranks until the stall limit (the
    communicator's timeout, 30 minutes by default)."""
    needs_two()
    t = torch.ones(3)
    start = time.monotonic()
    with pytest.raises(h.HorovodInternalError,
                       match=rf"operation 'a' differs between ranks: (allreduce|{other}) on"):
        if RANK == 0:
            h.allreduce(t, name="a", op=h.Sum)
        elif other == "allgather":
            h.allgather(t, name="a")
        else:
            h.broadcast(t, root_rank=0, name="a")
    assert time.monotonic() - start < 20
    assert torch.equal(h.allreduce(t, name="a", op=h.Sum), torch.full((3,), float(SIZE)))


@pytest.mark.parametrize("bad", ["op", "average", "prescale"])
@pytest.mark.parametrize("form", ["sync", "async", "inplace", "grouped", "grouped_inplace",
                                  "grouped_fp16"])
@pytest.mark.parametrize("name", [None, "loss"])
def test_arguments_one_rank_refuses_fail_that_operation_on_every_rank(h, bad, form, name):
    """An op, ``average`` with ``op``, or a scale that rank 1 alone gets wrong (a typo,
    ``op="sum"``): the operation fails on every rank (a ValueError, as Horovod's check
    raises) and runs nowhere; the next ones pair as before. Raised on rank 1 alone, it left
    rank 0's operation pending to pair with rank 1's next one of that name, unnamed ones
    included: every later result one step off, silently."""
    needs_two()
    wrong = RANK == 1
    kwargs = {"op": h.Sum, "name": name}
    if wrong and bad == "op":
        kwargs["op"] = "sum"
    elif wrong and bad == "average":
        kwargs["average"] = True
    elif wrong:
        kwargs["prescale_factor"] = "two"
    call = {"sync": h.allreduce,
            "async": lambda t, **kw: h.synchronize(h.allreduce_async(t, **kw)),
            "inplace": lambda t, **kw: h.synchronize(h.allreduce_async_(t, **kw)),
            "grouped": lambda t, **kw: h.grouped_allreduce([t, t.clone()], **kw)[1],
            "grouped_inplace": lambda t, **kw: h.synchronize(
                h.grouped_allreduce_async_([t.clone(), t], **kw))[1],
            "grouped_fp16": lambda t, **kw: h.grouped_allreduce(
                [t, t.clone()], compression=h.Compression.fp16, **kw)[1]}[form]
    with pytest.raises(ValueError, match="invalid arguments on rank 1"):
        call(torch.full((4,), float(RANK)), **kwargs)
    for step in range(3):  # the next calls of that name (or the next unnamed) pair as before
        got = call(torch.full((4,), float(10 * step + RANK)), op=h.Sum, name=name)
        assert torch.equal(got, torch.full((4,), float(sum(10 * step + r for r in range(SIZE)))))


@pytest.mark.parametrize("name", [None, "emb"])
def test_sparse_op_one_rank_refuses_fails_on_every_rank(h, name):
    """``sparse_allreduce_async`` with an op only Average and Sum may be (hvd.Max) on rank 1
    alone: the operation fails on every rank and runs nowhere; the next ones pair as before.
    Raised on rank 1 alone, it left rank 0's pending to pair with rank 1's next one."""
    needs_two()

    def sparse(value: float) -> torch.Tensor:
        return torch.sparse_coo_tensor([[RANK]], [value], (SIZE,))

    op = h.Max if RANK == 1 else h.Sum
    with pytest.raises(ValueError, match=r"invalid arguments on rank 1: ValueError: sparse "
                                         r"allreduce supports hvd\.Average and hvd\.Sum, got MAX"):
        h.sparse_allreduce_async(sparse(1.0), name=name, op=op)()
    for step in range(3):
        got = h.sparse_allreduce_async(sparse(10.0 * step + RANK), name=name, op=h.Sum)()
        want = torch.tensor([10.0 * step + r for r in range(SIZE)])
        assert torch.equal(got.to_dense(), want), (step, got)


def test_broadcast_object_with_differing_roots_raises_on_every_rank(h):
    needs_two()
    with pytest.raises(RuntimeError, match="root differs between ranks"):
        h.broadcast_object({"x": 1}, root_rank=RANK)
    assert h.broadcast_object(RANK, root_rank=1) == 1


@pytest.mark.parametrize("bad", [[1.0, 2.0], None, 3.0])
def test_non_tensors_raise_type_error_naming_what_came(h, bad):
    with pytest.raises(TypeError, match=f"expected a torch.Tensor, got {type(bad).__name__}"):
        h.allreduce(bad)
    with pytest.raises(TypeError, match=f"expected a torch.Tensor, got {type(bad).__name__}"):
        h.broadcast(bad, root_rank=0)
    with pytest.raises(TypeError, match=f"expected a torch.Tensor, got {type(bad).__name__}"):
        h.allgather(bad)


def test_a_barrier_never_pairs_with_an_allreduce(h):
    """Rank 0 reaches its barrier with an allreduce pending that the others submit later:
    the barrier waits for theirs, the allreduce for theirs, and both run."""
    needs_two()
    if RANK != 0:
        time.sleep(0.3)  # rank 0 is in its barrier by now
    handle = h.allreduce_async(torch.ones(2), name="r", op=h.Sum)
    h.barrier()
    assert torch.equal(h.synchronize(handle), torch.full((2,), float(SIZE)))


@pytest.mark.parametrize("first", range(2))
def test_join_with_uneven_steps(h, first):
    """Ranks run different numbers of steps; joined ranks contribute zeros."""
    needs_two()
    steps = 3 if RANK == first else 5
    outs = []
    for step in range(steps):
        outs.append(h.allreduce(torch.full((4,), float(RANK + 1)), name=f"step{step}",
                                op=h.Sum))
    last = h.join()
    for step, out in enumerate(outs):
        want = sum(r + 1 for r in range(SIZE) if step < (3 if r == first else 5))
        assert torch.equal(out, torch.full((4,), float(want))), step
    assert last != first or SIZE == 1
    assert same_on_all_ranks(torch.tensor([float(last)]))


def test_join_average_divides_by_the_whole_job(h):
    needs_two()
    if RANK == 0:
        last = h.join()
    else:
        out = h.allreduce(torch.full((3,), 6.0), name="avg_join")
        assert torch.allclose(out, torch.full((3,), 6.0 * (SIZE - 1) / SIZE))
        last = h.join()
    assert last != 0


def test_unnamed_operations_after_a_join_pair_up(h):
    """Rank 0 runs unnamed allreduces while the others have joined (they count none of them);
    after the join every rank numbers its unnamed operations afresh, so the next ones pair
    with their own kind (two of the same shape used to pair crossed: silent wrong sums)."""
    needs_two()
    if RANK == 0:
        for _ in range(2):
            h.allreduce(torch.full((1,), 4.0), op=h.Sum)
    h.join()
    loss = torch.full((2,), 100.0 * (RANK + 1))
    acc = torch.full((2,), 1.0 * (RANK + 1))
    handles = [h.allreduce_async(loss, op=h.Sum), h.allreduce_async(acc, op=h.Sum)]
    total = SIZE * (SIZE + 1) / 2
    assert torch.equal(h.synchronize(handles[0]), torch.full((2,), 100.0 * total))
    assert torch.equal(h.synchronize(handles[1]), torch.full((2,), total))
    assert torch.equal(h.allreduce(torch.ones(3), op=h.Sum), torch.full((3,), float(SIZE)))


def test_join_with_an_optimizer_bucket_of_one_matrix(h):
    """DistributedOptimizer's bucket of one 2-D parameter on a rank whose peers have joined:
    they contribute zeros of the bucket's agreed (flat) shape, which the bucket is reduced in
    (it was reduced in the parameter's own shape: a shape mismatch on the stepping rank, a
    hang on the joined ones)."""
    needs_two()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    opt = h.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                 named_parameters=model.named_parameters())
    before = model.weight.detach().clone()
    if RANK == 0:
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        grad = model.weight.grad.clone()
        opt.step()  # the average over the job: the others' zeros count
        assert torch.allclose(model.weight.detach(), before - grad / SIZE)
    assert h.join() == 0


@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_join_with_a_compressed_optimizer_keeps_the_mass(h, compression):
    """DistributedOptimizer with int8 or top-k (error feedback) while rank 1 has run out of
    data and joined: the joined rank takes part through the same compression, name and error
    feedback (its zeros went uncompressed: every rank raised "compression/name differs"), and
    every rank's gradients add up to the steps applied plus the residuals."""
    needs_two()
    comp = {"int8": h.Compression.int8, "topk": h.Compression.topk(0.1)}[compression]
    w = torch.nn.Parameter(torch.zeros(4096))
    opt = h.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                 compression=comp)
    # A second model whose parameter has the same name (a GAN's, a teacher's): its buckets
    # go by the same name, and a joined rank must tell them apart (its residual, 100x larger,
    # went into the first one's average).
    other = torch.nn.Parameter(torch.zeros(4096))
    opt2 = h.DistributedOptimizer(torch.optim.SGD([other], lr=1.0),
                                  named_parameters=[("w", other)], compression=comp)
    gen = torch.Generator().manual_seed(5 + RANK)
    sent = np.zeros(4096)
    for _ in range(4 if RANK != 1 else 2):
        opt.zero_grad()
        c = torch.randn(4096, generator=gen)
        sent += c.double().numpy()
        (w * c).sum().backward()
        opt.step()
        opt2.zero_grad()
        (other * 100 * torch.randn(4096, generator=gen)).sum().backward()
        opt2.step()
    h.join()
    piece = opt._residuals.piece("w")
    held = MPI.COMM_WORLD.allreduce(np.zeros(4096) if piece is None else piece.astype(float))
    total_in = MPI.COMM_WORLD.allreduce(sent)
    if RANK == 0:  # a rank that stepped every time: w = -(sum of the averages applied)
        np.testing.assert_allclose(-SIZE * w.detach().double().numpy() + held, total_in,
                                   atol=1e-5 * np.abs(total_in).max())


def test_named_compressed_allreduce_with_a_joined_rank(h):
    """A named int8 allreduce that every rank made at a first step, made again by the ranks
    that have not joined: the joined one takes part with zeros through the same compression
    and error feedback (every rank raised "compression/name differs" before)."""
    needs_two()
    x = torch.full((4096,), 6.0)
    h.allreduce(x, name="compressed_join", compression=h.Compression.int8)
    if RANK != 1:
        out = h.allreduce(x, name="compressed_join", compression=h.Compression.int8)
        assert torch.allclose(out, torch.full((4096,), 6.0 * (SIZE - 1) / SIZE), rtol=1e-2)
    h.join()


@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8"])
def test_compressed_allreduce_the_joined_rank_never_made(h, compression):
    """Compressed allreduces that rank 1, joined from the start, never made (unnamed, and
    named): it rebuilds their compressor from what the others submit and takes part with
    zeros, as Horovod's joined ranks do (every rank raised "compression/name differs")."""
    needs_two()
    comp = getattr(h.Compression, compression)
    outs = []
    if RANK != 1:
        for name in (None, "never_made_here"):
            outs.append(h.allreduce(torch.full((4096,), 6.0), name=name, compression=comp))
    h.join()
    for out in outs:
        assert torch.allclose(out, torch.full((4096,), 6.0 * (SIZE - 1) / SIZE), rtol=1e-2)
    everyone = MPI.COMM_WORLD.allgather(b"".join(o.numpy().tobytes() for o in outs))
    assert len({everyone[r] for r in range(SIZE) if r != 1}) == 1


def test_grouped_allreduce_with_a_joined_rank(h):
    """A grouped allreduce (two dtypes, fused) while rank 1 has joined: the joined rank takes
    part with zeros of each collective the others' fusion makes, as Horovod runs a grouped
    allreduce as allreduces (it was refused: "only allreduce runs with joined ranks")."""
    needs_two()
    outs = []
    if RANK != 1:
        outs = h.grouped_allreduce([torch.ones(2), torch.ones(3, 2),
                                    torch.ones(4, dtype=torch.float64), torch.ones(1)],
                                   op=h.Sum)
    h.join()
    for out in outs:
        assert torch.equal(out, torch.full_like(out, float(SIZE - 1)))
    assert [tuple(o.shape) for o in outs] == ([(2,), (3, 2), (4,), (1,)] if RANK != 1 else [])


def test_join_with_a_horovod_style_compressor_in_the_optimizer(h):
    """DistributedOptimizer with a compressor of the script's own while rank 1 has joined: each
    gradient is compressed before it is submitted, as in Horovod, so the joined rank's zeros
    have the compressed tensor's dtype and shape (they were the flat float32 bucket's: every
    step of the others failed, "dtype differs between ranks")."""
    needs_two()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = h.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 compression=HalfCompressor)
    grads = []
    for _ in range(3 if RANK != 1 else 1):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        grads.append(model.bias.grad.clone())
    h.join()  # before any assertion: a rank that raised would leave the joined one waiting
    for step, grad in enumerate(grads):
        active = SIZE if step == 0 else SIZE - 1
        want = torch.full((3,), 2.0 * active / SIZE)
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, want, rtol=1e-3, atol=0, msg=f"step {step}")


def test_a_name_used_compressed_then_plain_with_a_joined_rank(h):
    """A name first used for an int8 allreduce, then for a plain one while a rank has joined:
    the joined rank sends plain zeros (it sent int8 ones: the others raised)."""
    needs_two()
    h.allreduce(torch.ones(8), name="reused", compression=h.Compression.int8)
    if RANK != 1:
        out = h.allreduce(torch.full((8,), 3.0), name="reused", op=h.Sum)
        assert torch.equal(out, torch.full((8,), 3.0 * (SIZE - 1)))
    h.join()


def test_allgather_with_a_joined_rank_fails_on_the_others(h):
    needs_two()
    if RANK == 0:
        h.join()
    else:
        with pytest.raises(RuntimeError, match="joined"):
            h.allgather(torch.ones(2, 2), name="while_joined")
        h.join()
