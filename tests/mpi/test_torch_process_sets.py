"""Process sets: collectives among some ranks, registered alike on every rank."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import hvd  # noqa: E402

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
EVENS = [r for r in range(SIZE) if r % 2 == 0]
ODDS = [r for r in range(SIZE) if r % 2 == 1]


@pytest.fixture(scope="module")
def h():
    return hvd()


@pytest.fixture()
def sets(h):
    """The even and odd ranks' sets (the odd one only with 2 ranks or more)."""
    made = [h.add_process_set(EVENS)] + ([h.add_process_set(ODDS)] if ODDS else [])
    yield made
    for ps in reversed(made):
        assert h.remove_process_set(ps)


def mine(sets):
    return sets[RANK % 2]


def test_collectives_run_among_the_members(h, sets):
    ps = mine(sets)
    members = ps.ranks
    assert ps.included() and ps.size() == len(members) and ps.rank() == members.index(RANK)
    out = h.allreduce(torch.full((3,), float(RANK)), op=h.Sum, process_set=ps)
    assert torch.equal(out, torch.full((3,), float(sum(members))))
    gathered = h.allgather(torch.full((RANK + 1, 2), float(RANK)), process_set=ps)
    want = np.concatenate([np.full((r + 1, 2), float(r)) for r in members])
    np.testing.assert_array_equal(gathered.numpy(), want)
    root = members[-1]  # a global rank
    b = h.broadcast(torch.full((2,), float(RANK)), root_rank=root, process_set=ps)
    assert torch.equal(b, torch.full((2,), float(root)))
    assert h.broadcast_object(RANK, root_rank=root, process_set=ps) == root
    assert h.allgather_object(RANK, process_set=ps) == members
    h.barrier(process_set=ps)


def test_named_operations_match_by_name_within_a_set(h, sets):
    ps = mine(sets)
    names = ["x", "y", "z"]
    order = names if ps.rank() % 2 == 0 else names[::-1]
    handles = {n: h.allreduce_async(torch.full((2,), float(i + 10 * RANK)), name=n,
                                    op=h.Sum, process_set=ps)
               for n in order for i in [names.index(n)]}
    for i, n in enumerate(names):
        want = sum(i + 10 * r for r in ps.ranks)
        assert torch.equal(h.synchronize(handles[n]), torch.full((2,), float(want)))


def test_gradients_flow_within_the_set(h, sets):
    ps = mine(sets)
    x = torch.ones(3, requires_grad=True)
    h.allreduce(x, op=h.Sum, process_set=ps).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(len(ps.ranks))))


def test_a_set_without_this_rank_is_refused_here(h, sets):
    if len(sets) < 2:
        pytest.skip("needs at least 2 ranks")
    other = sets[1 - RANK % 2]
    assert other.included() is False and other.rank() is None
    with pytest.raises(ValueError, match=f"rank {RANK} is not in"):
        h.allreduce(torch.ones(2), process_set=other)


def test_root_outside_the_set_is_refused(h, sets):
    if len(sets) < 2:
        pytest.skip("needs at least 2 ranks")
    ps = mine(sets)
    outsider = sets[1 - RANK % 2].ranks[0]
    with pytest.raises(ValueError, match=f"root_rank {outsider} is not in"):
        h.broadcast(torch.ones(2), root_rank=outsider, process_set=ps)


def test_distributed_optimizer_on_a_set(h, sets):
    ps = sets[0]  # the even ranks reduce; the odd ranks step on their own gradients
    torch.manual_seed(RANK)
    model = torch.nn.Linear(4, 2)
    h.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = h.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), process_set=ps)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()
    weights = MPI.COMM_WORLD.allgather(model.weight.detach().numpy().copy())
    for r in EVENS:
        np.testing.assert_array_equal(weights[r], weights[0])
    for r in ODDS:
        assert not np.array_equal(weights[r], weights[0])


@pytest.mark.parametrize("bad", [[SIZE], [0, 0], []])
def test_bad_ranks_are_refused_on_every_rank(h, bad):
    with pytest.raises(ValueError, match="process set"):
        h.add_process_set(bad)


def test_duplicate_sets_are_refused(h, sets):
    with pytest.raises(ValueError, match="duplicate process set"):
        h.add_process_set(EVENS)


def test_ranks_that_differ_between_ranks_fail_everywhere(h):
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")
    with pytest.raises(h.HorovodInternalError, match="ranks differs between ranks"):
        h.add_process_set([RANK])


def test_removed_sets_can_no_longer_be_used(h):
    ps = h.add_process_set(list(range(SIZE)))
    assert h.remove_process_set(ps)
    assert ps.process_set_id is None and not h.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        h.allreduce(torch.ones(1), process_set=ps)


def test_init_registers_its_sets_and_refuses_lists_that_differ_between_ranks(h):
    """``init(process_sets=...)`` registers the sets in order; a list that differs between
    ranks fails init on every rank at once (the ranks given no set left the others' first
    registration waiting until the stall limit, 30 minutes by default)."""
    import ringcomm

    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")
    h.shutdown()
    comms = [ringcomm.init("mpi", abort_on_exception=False) for _ in range(2)]
    try:
        with pytest.raises(ringcomm.ArgumentMismatchError,
                           match=r"process_sets differs between ranks: \(\(0, 1\),\) on rank 0; "
                           r"\(\) on ranks? 1"):
            h.init(comms[0], process_sets=[[0, 1]] if RANK == 0 else [])
        assert not h.is_initialized()
        evens, pair = h.ProcessSet(EVENS), h.ProcessSet([0, 1])
        h.init(comms[1], process_sets=[evens, [0, 1]])
        assert evens.process_set_id is not None
        total = h.allreduce(torch.ones(2), op=h.Sum, process_set=evens) if RANK in EVENS \
            else None
        assert total is None or total.tolist() == [len(EVENS)] * 2
        with pytest.raises(ValueError, match="duplicate process set"):
            h.add_process_set(pair)  # [0, 1] is registered already
    finally:
        h.shutdown()
        for c in comms:
            c.close()
        hvd()  # the module's communicator again, for the tests after this one
