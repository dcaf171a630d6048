"""PowerSGD under mpiexec: comm.allreduce over MPI, and DDP's default buckets through the hook."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import ringcomm

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()


def _everyone(a: np.ndarray) -> np.ndarray:
    return np.stack(MPI.COMM_WORLD.allgather(a))


def _same_everywhere(a: np.ndarray) -> bool:
    first = MPI.COMM_WORLD.bcast(a.tobytes(), root=0)
    return bool(MPI.COMM_WORLD.allreduce(int(a.tobytes() == first), op=MPI.MIN))


@pytest.mark.timeout(60)
def test_bucket_over_mpi_conserves_and_is_identical(comm):
    """A flat bucket of a matrix, a 1-D tensor and a 4-D one, several steps with error
    feedback: bit-identical results, and inputs = size * averages + final residuals."""
    shapes = [(48, 40), (40,), (8, 3, 5, 5)]
    psgd, ef = ringcomm.PowerSGD(rank=2).with_shapes(shapes), ringcomm.ErrorFeedback()
    rng = np.random.default_rng(7 + RANK)
    length = sum(int(np.prod(s)) for s in shapes)
    inputs, results = np.zeros(length), np.zeros(length)
    for _ in range(4):
        x = rng.standard_normal(length).astype(np.float32)
        y = comm.allreduce(x, op="avg", compression=psgd, feedback=ef, name="bucket")
        assert _same_everywhere(y)
        inputs += _everyone(x).astype(np.float64).sum(axis=0)
        results += SIZE * y.astype(np.float64)
    held = _everyone(ef.residual("bucket")).astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(results + held, inputs, atol=2e-4 * np.abs(inputs).max())
    # The 1-D tensor went dense: its residual is spent.
    assert not ef.residual("bucket")[1920:1960].any()


@pytest.mark.timeout(60)
def test_shapes_differing_between_ranks_raise_everywhere(comm):
    if SIZE < 2:
        pytest.skip("needs two ranks to differ")
    x = np.ones(24, np.float32)
    shape = (4, 6) if RANK == 0 else (6, 4)
    with pytest.raises(ringcomm.ArgumentMismatchError, match="PowerSGD"):
        comm.allreduce(x, compression=ringcomm.PowerSGD().with_shapes([shape]), name="w")
    assert comm.allreduce(np.ones(3, np.float32))[0] == SIZE  # still usable


# ------------------------------------------------------------------------------------ DDP
torch = pytest.importorskip("torch")


def _model() -> torch.nn.Module:
    """About 1.3 MiB of gradients: DDP's default layout cuts them into two buckets (its first
    bucket holds 1 MiB)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


@pytest.mark.timeout(90)
def test_ddp_default_buckets_train_with_powersgd():
    from torch_helpers import digits, flat_params, hvd, process_group, same_on_all_ranks

    from ringcomm.torch import RingcommState, ringcomm_hook

    process_group()
    hvd()
    model = torch.nn.parallel.DistributedDataParallel(_model())
    state = RingcommState(compression=ringcomm.PowerSGD(rank=1), start_iter=2)
    buckets: set[int] = set()

    def hook(s, bucket):
        buckets.add(bucket.index())
        return ringcomm_hook(s, bucket)

    hook.__annotations__ = ringcomm_hook.__annotations__
    model.register_comm_hook(state, hook)
    x_train, y_train, _, _ = digits()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(40):
        rows = np.random.default_rng(step).permutation(len(y_train))[:64 * SIZE]
        mine = torch.from_numpy(rows[RANK::SIZE])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert len(buckets) >= 2, buckets
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert same_on_all_ranks(flat_params(model))
    # PowerSGD compressed: the big matrices keep residuals.
    assert state.residual(model.module[2].weight) is not None


@pytest.mark.timeout(90)
def test_horovod_optimizer_with_powersgd_trains_and_sends_little():
    """hvd.Compression.powersgd through DistributedOptimizer (its fused buckets tell PowerSGD
    the gradients' shapes): digits trains, ranks stay identical, far fewer bytes than dense."""
    from torch_helpers import (
        digits,
        digits_mlp,
        flat_params,
        hvd,
        same_on_all_ranks,
        sgd,
        train_digits,
    )

    h = hvd()
    model = digits_mlp()
    h.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = h.DistributedOptimizer(sgd(model), model.named_parameters(),
                                 compression=h.Compression.powersgd(rank=1))
    comm = h.communicator()
    before = comm.stats.bytes_sent
    accuracy = train_digits(model, opt, epochs=2)
    assert accuracy > 0.85, accuracy
    assert same_on_all_ranks(flat_params(model))
    if SIZE > 1:
        dense = 4 * sum(p.numel() for p in model.parameters()) * 2 * (SIZE - 1) / SIZE
        steps = 2 * (len(digits()[1]) // 64)
        assert (comm.stats.bytes_sent - before) / steps < 0.2 * dense
