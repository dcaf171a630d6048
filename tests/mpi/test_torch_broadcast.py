"""broadcast_parameters and broadcast_optimizer_state make ranks that started differently equal."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import flat_params, hvd, same_on_all_ranks  # noqa: E402

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
ROOT = SIZE - 1


@pytest.fixture(scope="module")
def h():
    return hvd()


class Model(torch.nn.Module):
    """Parameters, a BatchNorm (float and int64 buffers) and a bool buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.rand(3) > 0.5)

    def forward(self, x):
        return self.bn(self.fc(x)) * self.mask


def state_bytes(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])


@pytest.mark.parametrize("form", ["state_dict", "named_parameters", "parameters"])
def test_broadcast_parameters_makes_ranks_equal(h, form):
    model = Model(seed=RANK)
    model.train()
    model(torch.randn(5, 4))  # running stats and num_batches_tracked differ too
    params = {"state_dict": model.state_dict(), "named_parameters": model.named_parameters(),
              "parameters": list(model.parameters())}[form]
    h.broadcast_parameters(params, root_rank=ROOT)
    assert same_on_all_ranks(flat_params(model))
    if form == "state_dict":
        assert same_on_all_ranks(state_bytes(model))


@pytest.mark.parametrize("form", ["state_dict", "named_parameters", "parameters"])
def test_broadcast_parameters_that_differ_between_ranks_fail_on_every_rank(h, form):
    """One more tensor on the last rank (a key of its state dict, a named or an unnamed
    parameter): HorovodInternalError on every rank at once, naming it (it was a broadcast the
    other ranks never submitted, waited for until the stall limit, 30 minutes by default)."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    model = Model(seed=RANK)
    extra = torch.full((3,), float(RANK))
    last = RANK == SIZE - 1
    if form == "state_dict":
        params = {**model.state_dict(), **({"extra": extra} if last else {})}
        expected = rf"'extra' on rank {SIZE - 1} only"
    elif form == "named_parameters":
        params = [*model.named_parameters(), *([("extra", extra)] if last else [])]
        expected = rf"'extra' on rank {SIZE - 1} only"
    else:
        params = [*model.parameters(), *([extra] if last else [])]
        n = len(list(model.parameters()))
        expected = rf"unnamed tensors: {n} on rank 0.* {n + 1} on rank {SIZE - 1}"
    with pytest.raises(h.HorovodInternalError, match="broadcast_parameters: the tensors "
                                                     "differ between ranks: " + expected):
        h.broadcast_parameters(params, root_rank=0)
    h.broadcast_parameters(model.state_dict(), root_rank=0)  # the next one runs
    assert same_on_all_ranks(state_bytes(model))


def test_named_parameters_in_another_order_on_each_rank(h):
    """Named tensors pair by name: another order on each rank is the same broadcast."""
    model = Model(seed=RANK)
    named = list(model.named_parameters())
    if RANK % 2:
        named = named[::-1]
    h.broadcast_parameters(named, root_rank=ROOT)
    assert same_on_all_ranks(flat_params(model))


def test_broadcast_parameters_rejects_other_types(h):
    with pytest.raises(ValueError, match="invalid params of type"):
        h.broadcast_parameters(3, root_rank=0)


def optimizer_classes() -> list[type]:
    return sorted((c for c in vars(torch.optim).values() if isinstance(c, type)
                   and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer),
                  key=lambda c: c.__name__)


def make(cls: type, params, rank: int) -> torch.optim.Optimizer:
    """An optimizer whose options differ per rank (learning rate, and betas where it has them)."""
    kwargs = {"lr": 0.01 * (rank + 1)}
    if "betas" in cls.__init__.__code__.co_varnames:
        kwargs["betas"] = (0.8 + 0.01 * rank, 0.99)
    return cls(params, **kwargs)


def take_step(opt: torch.optim.Optimizer, model: torch.nn.Linear, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=gen)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if isinstance(opt, torch.optim.SparseAdam):
            for p in model.parameters():
                p.grad = p.grad.to_sparse()
        return loss

    opt.step(closure) if isinstance(opt, torch.optim.LBFGS) else (closure(), opt.step())


def state_values(opt: torch.optim.Optimizer) -> list:
    out = []
    for p in (p for g in opt.param_groups for p in g["params"]):
        for k, v in sorted(opt.state.get(p, {}).items()):
            out.append((k, v.detach().clone() if isinstance(v, torch.Tensor) else v))
    return out


def identical(a, b) -> bool:
    """Same value and type, tensors (also inside lists: LBFGS's history) with the same dtype."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(identical, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("who_has_state", ["root", "others", "everyone", "nobody"])
@pytest.mark.parametrize("cls", optimizer_classes(), ids=lambda c: c.__name__)
def test_broadcast_optimizer_state_every_optimizer(h, cls, who_has_state):
    model = torch.nn.Linear(4, 3)
    torch.nn.init.constant_(model.weight, 0.1)
    # Muon takes matrices only.
    params = [model.weight] if cls.__name__ == "Muon" else list(model.parameters())
    opt = make(cls, params, RANK)
    has_state = {"root": RANK == ROOT, "others": RANK != ROOT, "everyone": True,
                 "nobody": False}[who_has_state]
    if has_state:
        take_step(opt, model, seed=RANK)
    h.broadcast_parameters(model.state_dict(), root_rank=ROOT)
    h.broadcast_optimizer_state(opt, root_rank=ROOT)
    # Options: root's values, with their types.
    options = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    root_options = MPI.COMM_WORLD.bcast(options, root=ROOT)
    assert options == root_options
    assert [[type(v) for v in g.values()] for g in options] == \
           [[type(v) for v in g.values()] for g in root_options]
    # State: root's, tensors and scalars alike (none where root has none).
    mine = state_values(opt)
    root_state = MPI.COMM_WORLD.bcast(mine, root=ROOT)
    assert [k for k, _ in mine] == [k for k, _ in root_state]
    for (_, a), (_, b) in zip(mine, root_state, strict=True):
        assert identical(a, b)
    # From here on every rank trains identically.
    take_step(opt, model, seed=0)
    assert same_on_all_ranks(flat_params(model))


def test_broadcast_optimizer_state_of_distributed_optimizer(h):
    model = torch.nn.Linear(4, 3)
    opt = h.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1)),
                                 named_parameters=model.named_parameters())
    h.broadcast_parameters(model.state_dict(), root_rank=0)
    h.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    take_step(opt, model, seed=RANK)
    assert same_on_all_ranks(flat_params(model))


@pytest.mark.parametrize("how", ["model given", "after a step"])
def test_broadcast_optimizer_state_with_sparse_momentum(h, how):
    """SGD with momentum on a sparse embedding holds a sparse momentum buffer (made by the
    ``model=`` path's sparse zero gradients, or by a step): every rank gets root's, indices
    and values as root holds them, and trains on identically (a broadcast refused the sparse
    tensor on every rank)."""
    torch.manual_seed(RANK)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if how == "after a step":
        model(torch.tensor([RANK, RANK + 2])).sum().backward()
        opt.step()
    h.broadcast_parameters(model.state_dict(), root_rank=ROOT)
    h.broadcast_optimizer_state(opt, root_rank=ROOT, model=model if how == "model given" else None)
    buffer = opt.state[model[0].weight]["momentum_buffer"]
    assert buffer.layout == torch.sparse_coo
    mine = (buffer._indices(), buffer._values(), opt.state[model[1].weight]["momentum_buffer"])
    root = MPI.COMM_WORLD.bcast(mine, root=ROOT)
    assert all(torch.equal(a, b) for a, b in zip(mine, root, strict=True))
    for step in range(2):
        opt.zero_grad()
        model(torch.tensor([step, 5])).sum().backward()
        opt.step()
    assert same_on_all_ranks(flat_params(model))


def test_broadcast_optimizer_state_refuses_other_parameters(h):
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")
    model = torch.nn.Linear(4, 3 + (RANK == 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer parameters differ between ranks"):
        h.broadcast_optimizer_state(opt, root_rank=0)
