"""SyncBatchNorm: every rank's slice of one torch BatchNorm over the concatenated batches."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import gathered, hvd, same_on_all_ranks  # noqa: E402

from ringcomm.torch.horovod.sync_batch_norm import SyncBatchNorm  # noqa: E402

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
CHANNELS = 3
# input dimensions -> the torch module of the reference, and the trailing (spatial) shape
LAYOUTS = {2: (torch.nn.BatchNorm1d, ()), 3: (torch.nn.BatchNorm1d, (5,)),
           4: (torch.nn.BatchNorm2d, (4, 3)), 5: (torch.nn.BatchNorm3d, (2, 3, 2))}
# per-rank batch sizes: rank -> rows
BATCHES = {"equal": lambda r: 3, "unequal": lambda r: r + 2,
           "one_empty": lambda r: 0 if r == 0 and SIZE > 1 else r + 2}
# float32: the weight gradient is a sum of about a hundred products that mostly cancel
TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-4},
             torch.float64: {"rtol": 1e-10, "atol": 1e-12}}


@pytest.fixture(scope="module")
def h():
    return hvd()


def make_pair(ndim: int, dtype: torch.dtype, **options) -> tuple[SyncBatchNorm, torch.nn.Module]:
    """A SyncBatchNorm and its torch reference with the same random affine parameters."""
    sync = SyncBatchNorm(CHANNELS, dtype=dtype, **options)
    ref = LAYOUTS[ndim][0](CHANNELS, dtype=dtype, **options)
    if sync.affine:
        gen = torch.Generator().manual_seed(7)  # the same parameters on every rank
        with torch.no_grad():
            for mine, theirs in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
                mine.copy_(torch.rand(CHANNELS, generator=gen, dtype=dtype) + 0.5)
                theirs.copy_(mine)
    return sync, ref


def local_batch(rng: np.random.Generator, ndim: int, rows: int,
                dtype: torch.dtype) -> torch.Tensor:
    """This rank's batch: a non-zero mean and a per-channel scale, different on every rank."""
    shape = (rows, CHANNELS, *LAYOUTS[ndim][1])
    x = rng.normal(loc=3.0, scale=2.0, size=shape) * (1.0 + np.arange(CHANNELS)).reshape(
        1, CHANNELS, *([1] * (ndim - 2)))
    return torch.from_numpy(x).to(dtype)


def output_grad(rng: np.random.Generator, ndim: int, rows: int,
                dtype: torch.dtype) -> torch.Tensor:
    """A gradient for this rank's output, standard normal."""
    shape = (rows, CHANNELS, *LAYOUTS[ndim][1])
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def my_rows(batches: str) -> slice:
    """This rank's rows in the concatenation of every rank's batch."""
    start = sum(BATCHES[batches](r) for r in range(RANK))
    return slice(start, start + BATCHES[batches](RANK))


def summed(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (reference reduction, with mpi4py)."""
    return torch.from_numpy(MPI.COMM_WORLD.allreduce(t.detach().numpy()))


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.detach(), b.detach(), **TOLERANCE[dtype])


def train_step(sync: SyncBatchNorm, ref: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
               rows: slice, *, input_grad: bool = True) -> None:
    """One forward and backward of both; outputs, gradients and running stats must agree."""
    sync.zero_grad()
    ref.zero_grad()
    mine, full = x.clone().requires_grad_(input_grad), gathered(x).requires_grad_(input_grad)
    out, ref_out = sync(mine), ref(full)
    (out * dy).sum().backward()
    (ref_out * gathered(dy)).sum().backward()
    close(out, ref_out[rows], x.dtype)
    if input_grad:
        close(mine.grad, full.grad[rows], x.dtype)
    if sync.affine:
        close(summed(sync.weight.grad), ref.weight.grad, x.dtype)
        close(summed(sync.bias.grad), ref.bias.grad, x.dtype)
    if sync.track_running_stats:
        close(sync.running_mean, ref.running_mean, x.dtype)
        close(sync.running_var, ref.running_var, x.dtype)
        assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked)
        assert same_on_all_ranks(sync.running_mean) and same_on_all_ranks(sync.running_var)


def eval_step(sync: SyncBatchNorm, ref: torch.nn.Module, x: torch.Tensor, rows: slice) -> None:
    sync.eval()
    ref.eval()
    with torch.no_grad():
        close(sync(x), ref(gathered(x))[rows], x.dtype)


@pytest.mark.parametrize("batches", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("ndim", sorted(LAYOUTS))
def test_matches_batch_norm_over_all_batches(h, rng, ndim, dtype, batches):
    sync, ref = make_pair(ndim, dtype)
    rows = BATCHES[batches](RANK)
    for _ in range(2):  # the second step also checks the momentum update of running stats
        x, dy = local_batch(rng, ndim, rows, dtype), output_grad(rng, ndim, rows, dtype)
        train_step(sync, ref, x, dy, my_rows(batches))
    eval_step(sync, ref, local_batch(rng, ndim, rows, dtype), my_rows(batches))


@pytest.mark.parametrize("options", [{"momentum": None}, {"affine": False},
                                     {"track_running_stats": False}], ids=str)
def test_options(h, rng, options):
    sync, ref = make_pair(4, torch.float64, **options)
    rows = BATCHES["unequal"](RANK)
    for _ in range(3):
        x = local_batch(rng, 4, rows, torch.float64)
        dy = output_grad(rng, 4, rows, torch.float64)
        train_step(sync, ref, x, dy, my_rows("unequal"))
    # Without running stats, evaluation normalizes with the global batch's statistics too.
    eval_step(sync, ref, local_batch(rng, 4, rows, torch.float64), my_rows("unequal"))


def test_input_without_gradient(h, rng):
    sync, ref = make_pair(3, torch.float64)
    rows = BATCHES["unequal"](RANK)
    x, dy = local_batch(rng, 3, rows, torch.float64), output_grad(rng, 3, rows, torch.float64)
    train_step(sync, ref, x, dy, my_rows("unequal"), input_grad=False)


def test_eval_with_running_stats_is_local(h, rng):
    sync, _ = make_pair(4, torch.float32)
    with torch.no_grad():
        sync.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
        sync.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    sync.eval()
    # Rank 0 calls the layer more often than the others: no collective may be involved.
    for _ in range(3 if RANK == 0 else 1):
        x = local_batch(rng, 4, RANK + 1, torch.float32)
        expected = torch.nn.functional.batch_norm(
            x, sync.running_mean, sync.running_var, sync.weight, sync.bias, eps=sync.eps)
        close(sync(x), expected, torch.float32)
    assert int(sync.num_batches_tracked) == 0


def test_rejects_a_1d_input(h):
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        SyncBatchNorm(CHANNELS)(torch.ones(CHANNELS))


def test_rejects_the_wrong_number_of_channels(h):
    with pytest.raises(ValueError, match=f"expected {CHANNELS} channels, got 4"):
        SyncBatchNorm(CHANNELS)(torch.ones(2, 4))


def test_one_value_per_channel_is_refused_on_every_rank(h):
    sync = SyncBatchNorm(CHANNELS)
    x = torch.ones(1 if RANK == 0 else 0, CHANNELS)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(x)
    assert sync(torch.ones(2, CHANNELS)).shape == (2, CHANNELS)  # the job goes on
