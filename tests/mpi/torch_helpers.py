"""Helpers of the PyTorch adapter tests: the process group, hvd, and a digits trainer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

# Ranks share the machine's cores: one thread each (torch's default of one per core makes
# several ranks spin against each other).
torch.set_num_threads(1)

#: Global batch of the digits runs (split over the ranks), and its training schedule.
DIGITS_BATCH = 64
DIGITS_EPOCHS = 8
DIGITS_WARMUP_EPOCHS = 2


def process_group() -> None:
    """torch.distributed's default group over MPI's ranks (created once per process)."""
    if not dist.is_initialized():
        from ringcomm.torch.process_group import init_process_group_from_mpi

        init_process_group_from_mpi(backend="gloo")


def gloo_communicator() -> Iterator[Any]:
    """A gloo-transport communicator over MPI's ranks, closed after its tests (as a
    module-scoped fixture: ``pytest.fixture(scope="module", name="comm")(gloo_communicator)``)."""
    from ringcomm.backends import gloo

    process_group()
    made = gloo.TorchDistCommunicator()
    yield made
    made.close()


def ringcomm_group() -> Iterator[Any]:
    """A group of every rank on torch.distributed's "ringcomm" backend, destroyed after its
    tests (as a module-scoped fixture: ``pytest.fixture(scope="module",
    name="group")(ringcomm_group)``)."""
    import ringcomm.torch  # noqa: F401  (registers "ringcomm")

    process_group()
    group = dist.new_group(backend="ringcomm")
    yield group
    dist.destroy_process_group(group)


def counting_gloo_allreduce(monkeypatch: Any) -> list[int]:
    """The element counts of the tensors the gloo transport hands to gloo's allreduce, counted
    by wrapping the real ``dist.all_reduce`` (as a fixture taking ``monkeypatch``)."""
    from ringcomm.backends import gloo

    seen: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(gloo.dist, "all_reduce", counting)
    return seen


def hvd() -> Any:
    """``ringcomm.torch`` after ``init()``, on a communicator that leaves failures to pytest
    (no MPI_Abort from an uncaught exception, as the session's ``comm`` fixture)."""
    import ringcomm
    import ringcomm.torch as hvd_module

    if not hvd_module.is_initialized():
        hvd_module.init(ringcomm.init("mpi", abort_on_exception=False))
    return hvd_module


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, concatenated (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_all_ranks(t: torch.Tensor) -> bool:
    """Whether ``t`` has the same bytes on every rank."""
    data = t.detach().contiguous().numpy().tobytes()
    first = MPI.COMM_WORLD.bcast(data, root=0)
    return bool(MPI.COMM_WORLD.allreduce(int(data == first), op=MPI.MIN))


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dimension 0, in rank order (reference data)."""
    return torch.cat([torch.from_numpy(a) for a in MPI.COMM_WORLD.allgather(t.numpy())])


@functools.cache
def digits() -> tuple[torch.Tensor, ...]:
    """Digits, standardized, split 80/20 with a fixed seed: x_train, y_train, x_test, y_test."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order]
    cut = int(0.8 * len(y))
    x = (x - x[:cut].mean(axis=0)) / (x[:cut].std(axis=0) + 1e-3)
    tensors = (x[:cut], y[:cut], x[cut:], y[cut:])
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in tensors)


def digits_mlp() -> torch.nn.Module:
    """The MLP of the digits runs (64-256-10), the same initial weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def train_digits(model: torch.nn.Module, opt: torch.optim.Optimizer,
                 on_epoch: Callable[[int], None] | None = None,
                 epochs: int = DIGITS_EPOCHS) -> float:
    """Train data-parallel on each global batch's shard of this rank; return test accuracy."""
    x, y, x_test, y_test = digits()
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    per_rank = DIGITS_BATCH // size
    for epoch in range(epochs):
        if on_epoch is not None:
            on_epoch(epoch)
        order = torch.from_numpy(np.random.default_rng(1 + epoch).permutation(len(y)))
        for step in range(len(y) // DIGITS_BATCH):
            batch = order[step * DIGITS_BATCH: (step + 1) * DIGITS_BATCH]
            mine = batch[rank * per_rank: (rank + 1) * per_rank]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
    with torch.no_grad():
        return float((model(x_test).argmax(dim=1) == y_test).float().mean())


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of the digits runs."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


class HalfCompressor:
    """A Horovod-style compressor of a user's own (Horovod's FP16Compressor, as scripts copy
    it): cast floating tensors to float16 and back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return (tensor.half() if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx) if ctx.is_floating_point else tensor
