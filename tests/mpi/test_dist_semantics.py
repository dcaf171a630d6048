"""What torch.distributed's own backends let a program rely on, kept by the "ringcomm" backend
and the Horovod surface: tensors that went through a collective stay resizable, and
``async_op=True`` calls never wait at the call, however small (two groups' calls started in
one order on one rank and in the other order on another complete, as on gloo); and one it
cannot rely on there: views are read and written where they point."""

from __future__ import annotations

import datetime

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import ringcomm_group  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()

pytestmark = pytest.mark.skipif(SIZE < 2, reason="needs two ranks")

group = pytest.fixture(scope="module", name="group")(ringcomm_group)


def _calls(group):
    """(name, make) for each collective on ringcomm's path; ``make()`` returns the tensors
    the call is given and the call."""
    n = 4

    def gather_list():
        out = [torch.zeros(n) for _ in range(SIZE)]
        inp = torch.ones(n)
        return [inp, *out], lambda: dist.all_gather(out, inp, group=group)

    def gather_into():
        out, inp = torch.zeros(SIZE * n), torch.ones(n)
        return [inp, out], lambda: dist.all_gather_into_tensor(out, inp, group=group)

    def scatter_reduce():
        out, inp = torch.zeros(n), torch.ones(SIZE * n)
        return [inp, out], lambda: dist.reduce_scatter_tensor(out, inp, group=group)

    def all_to_all():
        out, inp = torch.zeros(SIZE * n), torch.ones(SIZE * n)
        return [inp, out], lambda: dist.all_to_all_single(out, inp, group=group)

    def reduce():
        t = torch.ones(n)
        return [t], lambda: dist.all_reduce(t, group=group)

    def broadcast():
        t = torch.ones(n)
        return [t], lambda: dist.broadcast(t, 0, group=group)

    big = torch.ones(1 << 16)  # 256 KiB: once the group's thread's, where small ones were not
    return [("all_reduce", reduce), ("broadcast", broadcast), ("all_gather", gather_list),
            ("all_gather_into_tensor", gather_into),
            ("reduce_scatter_tensor", scatter_reduce), ("all_to_all_single", all_to_all),
            ("all_reduce 256 KiB", lambda: ([big], lambda: dist.all_reduce(big, group=group)))]


def test_tensors_stay_resizable(group):
    """A collective's inputs and outputs can be resized afterwards, as on gloo: Tensor.numpy()
    marked their storage not resizable for good (PyTorch's batched PowerSGD hook, which
    resizes its bucket, failed on the ringcomm backend)."""
    stuck = []
    for name, make in _calls(group):
        tensors, call = make()
        call()
        for i, t in enumerate(tensors):
            if not t.untyped_storage().resizable():
                stuck.append(f"{name} tensor {i}")
            else:
                t.resize_(t.numel() + 3)
    assert not stuck, stuck


def test_horovod_allreduce_in_place_leaves_the_tensor_resizable():
    import ringcomm.torch as hvd

    hvd.init()
    try:
        t = torch.full((5,), float(RANK + 1))
        hvd.allreduce_(t, op=hvd.Sum)
        assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 5
        assert t.untyped_storage().resizable()
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("numel", [2, 1 << 15])
def test_async_calls_started_in_other_orders_on_two_groups_complete(numel):
    """Rank r starts a small async all_reduce on group A then B where the next rank starts
    B then A, then each waits for both: complete, exact, as on gloo. Small calls ran on the
    calling thread: each rank's first waited there for the other rank's first, on the other
    group (a hang until the groups' timeout)."""
    timeout = datetime.timedelta(seconds=30)
    first = dist.new_group(backend="ringcomm", timeout=timeout)
    second = dist.new_group(backend="ringcomm", timeout=timeout)
    try:
        for g in (first, second):  # each group's communicator made, in one order everywhere
            dist.all_reduce(torch.ones(1), group=g)
        order = (first, second) if RANK % 2 == 0 else (second, first)
        tensors = [torch.full((numel,), float(RANK + 1) * (10 if g is second else 1))
                   for g in order]
        works = [dist.all_reduce(t, group=g, async_op=True)
                 for t, g in zip(tensors, order, strict=True)]
        for work in works:
            work.wait()
        total = SIZE * (SIZE + 1) / 2
        for t, g in zip(tensors, order, strict=True):
            assert t.eq(total * (10 if g is second else 1)).all(), (t[:3], g is second)
    finally:
        dist.destroy_process_group(first)
        dist.destroy_process_group(second)


@pytest.mark.parametrize("numel", [4, 1 << 16])
def test_views_are_read_and_written_where_they_point(group, numel):
    """Tensors that are views (every other element of another, a transpose, a column) and
    outputs that hold their own input (FSDP's all_gather_into_tensor from its shard of the
    output, a reduce_scatter_tensor into a chunk of its input): each element read and written
    where the view points, as a contiguous copy of it would be. gloo's own all_reduce and
    broadcast of ``base[::2]`` treat it as ``base[:n]``, silently (torch 2.13)."""
    total, mine = SIZE * (SIZE + 1) / 2, RANK + 1
    base = torch.arange(2.0 * numel) * mine
    dist.all_reduce(base[::2], group=group)
    want = torch.arange(2.0 * numel)
    want[::2] *= total
    want[1::2] *= mine
    assert torch.equal(base, want)

    m = torch.arange(6.0 * numel).reshape(2, 3 * numel) * mine
    dist.all_reduce(m.t(), group=group)
    assert torch.equal(m, torch.arange(6.0 * numel).reshape(2, 3 * numel) * total)

    base = torch.arange(2.0 * numel) + 10 * RANK
    dist.broadcast(base[::2], 0, group=group)
    assert torch.equal(base[::2], torch.arange(0.0, 2.0 * numel, 2))
    assert torch.equal(base[1::2], torch.arange(1.0, 2.0 * numel, 2) + 10 * RANK)

    out = torch.zeros(SIZE * numel, 2)
    dist.all_gather_into_tensor(out[:, 0], torch.full((numel,), float(RANK)), group=group)
    assert torch.equal(out[:, 0], torch.arange(float(SIZE)).repeat_interleave(numel))
    assert not out[:, 1].any()

    mine_part = slice(RANK * numel, (RANK + 1) * numel)
    full = torch.zeros(SIZE * numel)
    full[mine_part] = mine
    dist.all_gather_into_tensor(full, full[mine_part], group=group)
    assert torch.equal(full, torch.arange(1.0, SIZE + 1).repeat_interleave(numel))

    inp = torch.arange(float(SIZE * numel)) + RANK
    dist.reduce_scatter_tensor(inp[mine_part], inp, group=group)
    assert torch.equal(inp[mine_part], SIZE * torch.arange(float(SIZE * numel))[mine_part]
                       + SIZE * (SIZE - 1) / 2)


def test_views_given_to_the_gloo_fallback_are_read_and_written_where_they_point(group):
    """reduce, gather and scatter (run on the group's gloo) and reduce-scatters of 8-bit
    integers (gloo's too) of views that are not contiguous: each element read and written
    where the view points. gloo (torch 2.13) took ``x[::2]`` for ``x[:n]``: a scatter from
    every other element sent the first ones, a reduce wrote the wrong elements of the base, a
    gather of such a view gave zeros."""
    n = 5
    base = torch.arange(2.0 * n) + RANK
    dist.reduce(base[::2], dst=0, group=group)
    if RANK == 0:  # (gloo leaves partial sums in the other ranks' tensors)
        assert torch.equal(base[::2], SIZE * torch.arange(0.0, 2.0 * n, 2) + SIZE * (SIZE - 1) / 2)
    assert torch.equal(base[1::2], torch.arange(1.0, 2.0 * n, 2) + RANK)

    sources = [(torch.arange(2 * n) + 100 * r)[::2] for r in range(SIZE)]
    out = torch.full((2 * n,), -1)
    dist.scatter(out[1::2], sources if RANK == 0 else None, src=0, group=group)
    assert torch.equal(out[1::2], torch.arange(0, 2 * n, 2) + 100 * RANK)
    assert torch.equal(out[::2], torch.full((n,), -1))

    mine = (torch.arange(2 * n) + 100 * RANK)[::2]
    rows = torch.zeros(SIZE, n, 2, dtype=torch.int64)
    dist.gather(mine, [rows[r, :, 1] for r in range(SIZE)] if RANK == 0 else None, dst=0,
                group=group)
    if RANK == 0:
        for r in range(SIZE):
            assert torch.equal(rows[r, :, 1], torch.arange(0, 2 * n, 2) + 100 * r)
    assert not rows[:, :, 0].any()

    base = torch.zeros(2 * n, dtype=torch.uint8)
    pieces = [(torch.arange(n) + 10 * r + RANK).to(torch.uint8) for r in range(SIZE)]
    dist.reduce_scatter(base[::2], pieces, group=group)
    assert torch.equal(base[::2], (SIZE * (torch.arange(n) + 10 * RANK)
                                   + SIZE * (SIZE - 1) // 2).to(torch.uint8))
    assert not base[1::2].any()


def test_roots_that_differ_between_ranks_are_refused_on_every_rank(group):
    """A reduce whose root differs between ranks raises the same error on every rank, naming
    each rank's call, and the group goes on (on gloo each rank waits for another exchange)."""
    import ringcomm

    t = torch.ones(3)
    with pytest.raises(ringcomm.ArgumentMismatchError,
                       match=r"reduce to rank 0 .* reduce to rank 1"):
        dist.reduce(t, dst=min(RANK, 1), group=group)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), float(SIZE)))
