"""hvd.DistributedOptimizer against single-process training on every rank's data at once."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import (  # noqa: E402
    DIGITS_BATCH,
    HalfCompressor,
    digits_mlp,
    flat_params,
    gathered,
    hvd,
    same_on_all_ranks,
    sgd,
    train_digits,
)

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
F = torch.nn.functional


@pytest.fixture(scope="module")
def h():
    return hvd()


class Net(torch.nn.Module):
    """A small MLP with an optional branch (used by some ranks only in one test)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 16)
        self.extra = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, use_extra: bool = False):
        h = torch.relu(self.a(x))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def batch(step: int, rank: int = RANK, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def everyone(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of ``step``, concatenated (what a single process would train on)."""
    x, y = batch(step)
    return gathered(x), gathered(y)


def pair(h, make_opt, **kwargs):
    """(reference model and optimizer, distributed model and optimizer), same start."""
    ref, model = Net(), Net()
    opt = h.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                 **kwargs)
    return ref, make_opt(ref), model, opt


OPTIMIZERS = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
}


def step_both(step: int, model, opt, ref, ref_opt) -> None:
    """One distributed step on this rank's batch, one reference step on everyone's."""
    x, y = batch(step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    xs, ys = everyone(step)
    ref_opt.zero_grad()
    F.cross_entropy(ref(xs), ys).backward()
    ref_opt.step()


@pytest.mark.parametrize("fusion", [None, 256])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_single_process_on_concatenated_batch(h, name, fusion):
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS[name], fusion_threshold_bytes=fusion)
    for step in range(3):
        step_both(step, model, opt, ref, ref_opt)
    torch.testing.assert_close(flat_params(model), flat_params(ref))
    assert same_on_all_ranks(flat_params(model))


def test_names_that_sort_alike_naturally_still_give_one_order(h):
    """"a01" and "a1" are the same number after the same text: their names decide, so the
    buckets are the same whatever order each rank's optimizer holds them in."""
    class Twins(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            for name in ("a01", "a1", "b٣", "b3"):  # the third: an Arabic-Indic digit
                self.register_parameter(name, torch.nn.Parameter(torch.randn(4)))

    model = Twins()
    named = list(model.named_parameters())
    params = [p for _, p in (named[::-1] if RANK % 2 else named)]
    opt = h.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), named_parameters=named,
                                 op=h.Sum)
    (sum(p.sum() for _, p in named) * (RANK + 1)).backward()
    opt.synchronize()
    for _, p in named:
        assert torch.equal(p.grad, torch.full((4,), float(sum(range(1, SIZE + 1)))))


@pytest.mark.parametrize("order", ["reversed", "groups_swapped", "rotated"])
@pytest.mark.parametrize("fusion", [None, 256, 0])
def test_optimizer_order_that_differs_between_ranks(h, order, fusion):
    """The optimizer holds the same named parameters in another order on each rank (heads
    built from a ``set``, whose order follows each process's hash seed): trains as the
    single-process reference, as Horovod does (it reduces each parameter under its name).
    Buckets cut in each rank's own order held different parameters, paired with nothing and
    waited until the stall limit (30 minutes by default)."""
    ref, model = Net(), Net()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    if RANK % 2 and order == "reversed":
        params = params[::-1]
    elif RANK % 2 and order == "rotated":
        params = params[RANK:] + params[:RANK]
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    if RANK % 2 and order == "groups_swapped":
        groups = groups[::-1]
    opt = h.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1, momentum=0.9),
                                 named_parameters=named, fusion_threshold_bytes=fusion)
    ref_opt = OPTIMIZERS["sgd-momentum"](ref)
    for step in range(2):
        step_both(step, model, opt, ref, ref_opt)
    torch.testing.assert_close(flat_params(model), flat_params(ref))
    assert same_on_all_ranks(flat_params(model))


def test_two_backward_passes_per_step_match_accumulating_two_batches(h):
    make = OPTIMIZERS["sgd-momentum"]
    ref, ref_opt, model, opt = pair(h, make, backward_passes_per_step=2)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            x, y = batch(10 * step + micro)
            F.cross_entropy(model(x), y).backward()
            xs, ys = everyone(10 * step + micro)
            F.cross_entropy(ref(xs), ys).backward()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref))


def test_sum_and_predivide_factor(h):
    make = OPTIMIZERS["sgd-momentum"]
    ref, ref_opt, model, opt = pair(h, make, op=h.Sum)
    _, _, model2, opt2 = pair(h, make, gradient_predivide_factor=2.0)
    ref2 = Net()
    ref2_opt = make(ref2)
    for step in range(2):
        x, y = batch(step)
        xs, ys = everyone(step)
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        ref_opt.zero_grad()
        (F.cross_entropy(ref(xs), ys) * SIZE).backward()  # sum of the ranks' mean losses
        ref_opt.step()
        ref2_opt.zero_grad()
        F.cross_entropy(ref2(xs), ys).backward()
        ref2_opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref))
    torch.testing.assert_close(flat_params(model2), flat_params(ref2))


def test_rank_without_gradient_for_a_parameter(h):
    """Rank 0 runs a branch the others skip: no hang, and the gradient is rank 0's / size."""
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS["sgd-momentum"], fusion_threshold_bytes=512)
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x, use_extra=RANK == 0), y).backward()
        opt.step()
        ref_opt.zero_grad()
        losses = []
        for r in range(SIZE):
            xr, yr = batch(step, r)
            losses.append(F.cross_entropy(ref(xr, use_extra=r == 0), yr))
        (sum(losses) / SIZE).backward()
        ref_opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref))
    assert same_on_all_ranks(flat_params(model))


def test_requires_grad_switched_off_and_on(h):
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS["sgd-momentum"])
    frozen = {0: True, 1: False, 2: True, 3: False}  # layer a frozen at steps 0 and 2
    for step in range(4):
        for m in (model, ref):
            for p in m.a.parameters():
                p.requires_grad_(not frozen[step])
        step_both(step, model, opt, ref, ref_opt)
    torch.testing.assert_close(flat_params(model), flat_params(ref))


def test_clipping_between_synchronize_and_step(h):
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS["sgd-momentum"])
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
        xs, ys = everyone(step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(xs), ys).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref))


def test_warns_once_when_step_follows_synchronize(h):
    model = Net()
    opt = h.DistributedOptimizer(OPTIMIZERS["sgd-momentum"](model), model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            opt.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert sum("without optimizer.skip_synchronize()" in m for m in messages) == 1


@pytest.mark.parametrize("then", ["next_step", "another_collective"])
def test_synchronize_on_some_ranks_before_step(h, then):
    """Rank 0 alone calls synchronize() (to log the gradient norm), then every rank step():
    trains as the single-process reference, identical on every rank. Reduced again in step()
    (as Horovod's does), rank 0's second round paired with the other ranks' next step (their
    next gradients), or, where a metric's allreduce came first, waited for them until the
    stall limit."""
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS["sgd-momentum"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if RANK == 0:
                opt.synchronize()
            opt.step()
            if then == "another_collective":
                h.allreduce(torch.tensor([float(step)]), name="loss")
            xs, ys = everyone(step)
            ref_opt.zero_grad()
            F.cross_entropy(ref(xs), ys).backward()
            ref_opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref))
    assert same_on_all_ranks(flat_params(model))


def test_parameter_added_after_wrapping_is_reduced(h):
    """A parameter group added to the DistributedOptimizer (every rank): its gradients are
    averaged from then on (a KeyError before, on the bucket plan's missing name)."""
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS["sgd-momentum"])
    for m, o in ((model, opt), (ref, ref_opt)):
        m.scale = torch.nn.Parameter(torch.ones(3))
        o.add_param_group({"params": [m.scale]})
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x) * model.scale, y).backward()
        opt.step()
        xs, ys = everyone(step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(xs) * ref.scale, ys).backward()
        ref_opt.step()
    torch.testing.assert_close(model.scale.detach(), ref.scale.detach())
    assert same_on_all_ranks(flat_params(model))


@pytest.mark.parametrize("cast", ["half one layer", "double the model after a step"])
def test_parameters_cast_after_wrapping_are_reduced_in_their_dtype(h, cast):
    """A layer cast to float16, or the model to float64, after the optimizer was made (the
    Parameter objects stay): each gradient is averaged in its own dtype. The fused buckets
    were kept, so float32 gradients went through a float16 buffer (1e5 came back Inf) and
    float64 ones were rounded to float32, on every rank alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opt = h.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                 named_parameters=model.named_parameters())
    if cast == "double the model after a step":
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        model.double()
    else:
        model[1].half()
    dtype = model[0].weight.dtype
    x = torch.tensor([[1e5, 1.0 + 1e-12 * (RANK + 1), 3.0]], dtype=torch.float64)
    opt.zero_grad()
    model[0](x.to(dtype)).sum().backward()
    model[1](torch.ones(1, 3, dtype=model[1].weight.dtype)).sum().backward()
    opt.synchronize()
    got = model[0].weight.grad
    assert got.dtype == dtype and same_on_all_ranks(got.double().reshape(-1))
    exact = gathered(x.to(dtype)).double().mean(0)  # every rank's row, averaged in float64
    # float32: exact (the entries are); float64: within float64's rounding of the sum, where
    # float32's would be off by 1e-12
    torch.testing.assert_close(got[0].double(), exact, rtol=0, atol=1e-14)
    assert torch.isfinite(model[1].weight.grad).all()
    with opt.skip_synchronize():
        opt.step()


def test_a_parameter_resized_after_a_step_is_reduced_at_its_new_size(h):
    """A parameter whose ``.data`` is replaced by a larger tensor between steps (an embedding
    grown in place): its gradient is averaged at its new size (the kept plan raised a shape
    error on every rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))
    opt = h.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                 named_parameters=model.named_parameters())
    def loss() -> torch.Tensor:
        return (model(torch.full((1, 2), float(RANK + 1))) ** 2).sum()

    for step in range(2):
        if step == 1:
            model[0].weight.data = torch.arange(8.0).reshape(4, 2) / 8
            model[0].bias.data = torch.zeros(4)
            model[1].weight.data = torch.arange(12.0).reshape(3, 4) / 12
        local = torch.autograd.grad(loss(), list(model.parameters()))  # not accumulated
        opt.zero_grad()
        loss().backward()
        opt.step()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert same_on_all_ranks(grads)
    assert model[0].weight.grad.shape == (4, 2)
    expected = torch.cat([gathered(g.reshape(1, -1)).mean(0) for g in local])
    torch.testing.assert_close(grads, expected, rtol=1e-6, atol=1e-6)


def test_backward_passes_per_step_that_differs_between_ranks_fails_on_every_rank(h):
    """Rank 0 accumulates two backward passes a step, the others one: the first reduction
    fails on every rank, naming the setting (it paired one rank's two-batch gradients with
    the others' one-batch ones, or stalled)."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    model = Net()
    passes = 2 if RANK == 0 else 1
    opt = h.DistributedOptimizer(OPTIMIZERS["sgd-momentum"](model), model.named_parameters(),
                                 backward_passes_per_step=passes)
    opt.zero_grad()
    for micro in range(passes):
        x, y = batch(micro)
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(h.HorovodInternalError,
                       match=r"backward_passes_per_step differs between ranks: 2 on rank 0; "
                             r"1 on rank"):
        opt.step()
    opt.zero_grad()
    assert torch.equal(h.allreduce(torch.ones(2), op=h.Sum), torch.full((2,), float(SIZE)))


def test_zero_grad_before_step_is_refused(h):
    if SIZE == 1:
        pytest.skip("one process reduces nothing (as Horovod, no hooks at size 1)")
    model = Net()
    opt = h.DistributedOptimizer(OPTIMIZERS["sgd-momentum"](model), model.named_parameters())
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward"):
        opt.zero_grad()
    opt.step()


def test_more_passes_than_declared_are_refused(h):
    if SIZE == 1:
        pytest.skip("one process reduces nothing (as Horovod, no hooks at size 1)")
    model = Net()
    opt = h.DistributedOptimizer(OPTIMIZERS["sgd-momentum"](model), model.named_parameters(),
                                 overlap=True)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step times"):
        F.cross_entropy(model(x), y).backward()
    opt.step()




@pytest.mark.parametrize("follow", [True, False])
def test_residuals_follow_the_loss_scale_of_a_grad_scaler(h, follow):
    """With a GradScaler whose scale doubles every step and top-k's error feedback, the
    residuals (in the loss scale's units) are rescaled with it (``grad_scaler=``), so that in
    true units every rank's gradients add up to the averaged gradients applied plus the
    residuals; without it they do not (what the test shows it can tell apart)."""
    import numpy as np

    if SIZE < 2:
        pytest.skip("one rank compresses nothing")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    sent = {n: np.zeros(p.numel()) for n, p in net.named_parameters()}
    applied = {n: np.zeros(p.numel()) for n, p in net.named_parameters()}
    opt = h.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                 named_parameters=net.named_parameters(),
                                 compression=h.Compression.topk(0.05), overlap=False,
                                 grad_scaler=scaler if follow else None)
    def record(n):
        def hook(t):
            sent[n] += t.grad.double().reshape(-1).numpy() / scaler.get_scale()
        return hook

    for n, p in net.named_parameters():  # after the optimizer's: sees the local gradient
        p.register_post_accumulate_grad_hook(record(n))
    gen = torch.Generator().manual_seed(100 + RANK)
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        scaler.scale(net(torch.randn(8, 32, generator=gen)).pow(2).sum()).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        for n, p in net.named_parameters():
            applied[n] += p.grad.double().reshape(-1).numpy()
        last_scale = scaler.get_scale()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    worst = 0.0
    for n, p in net.named_parameters():
        held = opt._residuals.piece(n)
        held = np.zeros(p.numel()) if held is None else held.astype(np.float64) / last_scale
        total_in = MPI.COMM_WORLD.allreduce(sent[n])
        total_held = MPI.COMM_WORLD.allreduce(held)
        error = np.abs(SIZE * applied[n] + total_held - total_in).max()
        worst = max(worst, error / np.abs(total_in).max())
    assert (worst < 1e-5) == follow, worst


def test_a_step_the_grad_scaler_skips_adds_nothing_to_later_steps(h):
    """A step the GradScaler skips (Inf in one gradient, on rank 0) has moved the residuals
    of every tensor; its scale backing off drops them, so that in true units the other
    steps' gradients add up to the averaged gradients applied, the residuals kept and those
    held before the skipped step (lost with it), and nothing of the skipped step's."""
    import numpy as np

    if SIZE < 2:
        pytest.skip("one rank compresses nothing")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    extra = torch.nn.Parameter(torch.ones(4))
    named = [*net.named_parameters(), ("extra", extra)]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    opt = h.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.0),
                                 named_parameters=named, compression=h.Compression.topk(0.05),
                                 overlap=False, grad_scaler=scaler)
    sent = {n: np.zeros(p.numel()) for n, p in net.named_parameters()}
    applied = {n: np.zeros(p.numel()) for n, p in net.named_parameters()}
    dropped = {}
    skipped, poisoned = 3, [False]

    def record(n):
        def hook(t):
            if not poisoned[0]:
                sent[n] += t.grad.double().reshape(-1).numpy() / scaler.get_scale()
        return hook

    def residual(n, numel):
        held = opt._residuals.piece(n)
        return np.zeros(numel) if held is None else held.astype(np.float64) / scaler.get_scale()

    for n, p in net.named_parameters():  # after the optimizer's: sees the local gradient
        p.register_post_accumulate_grad_hook(record(n))
    gen = torch.Generator().manual_seed(100 + RANK)
    for step in range(7):
        poisoned[0] = step == skipped
        if poisoned[0]:
            dropped = {n: residual(n, p.numel()) for n, p in net.named_parameters()}
        bad = math.inf if poisoned[0] and RANK == 0 else 1.0
        opt.zero_grad(set_to_none=True)
        loss = net(torch.randn(8, 32, generator=gen)).pow(2).sum() + (extra * bad).sum()
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        if not poisoned[0]:
            for n, p in net.named_parameters():
                applied[n] += p.grad.double().reshape(-1).numpy()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == (512.0 if step >= skipped else 1024.0)
    for n, p in net.named_parameters():
        total_in = MPI.COMM_WORLD.allreduce(sent[n])
        total_held = MPI.COMM_WORLD.allreduce(residual(n, p.numel()) + dropped[n])
        np.testing.assert_allclose(SIZE * applied[n] + total_held, total_in,
                                   atol=1e-5 * np.abs(total_in).max())


@pytest.mark.parametrize("compression", ["fp16", "custom"])
def test_fp16_compression_stays_close(h, compression):
    comp = HalfCompressor if compression == "custom" else h.Compression.fp16
    ref, ref_opt, model, opt = pair(h, OPTIMIZERS["sgd-momentum"], compression=comp)
    for step in range(2):
        step_both(step, model, opt, ref, ref_opt)
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-3, atol=1e-3)
    assert same_on_all_ranks(flat_params(model))


@pytest.fixture(scope="module")
def digits_accuracy(h):
    """Final test accuracy of the digits MLP through DistributedOptimizer, per compression."""
    pytest.importorskip("sklearn")
    if DIGITS_BATCH % SIZE:
        pytest.skip(f"the global batch of {DIGITS_BATCH} does not split over {SIZE} ranks")
    import ringcomm

    settings = {"none": h.Compression.none, "int8": h.Compression.int8,
                "topk": h.Compression.topk(0.01),
                # A ringcomm.Auto as the compression (a policy, wrapped as a compressor is).
                "auto": ringcomm.Auto((None, ringcomm.FP16(), ringcomm.Int8()))}
    accuracy = {}
    for name, compression in settings.items():
        model = digits_mlp()
        opt = h.DistributedOptimizer(sgd(model), model.named_parameters(),
                                     compression=compression)
        accuracy[name] = train_digits(model, opt)
    return accuracy


@pytest.mark.slow
def test_digits_through_optimizer_dense_learns(digits_accuracy):
    assert digits_accuracy["none"] > 0.95


@pytest.mark.slow
def test_digits_through_optimizer_int8_within_one_point(digits_accuracy):
    assert digits_accuracy["int8"] >= digits_accuracy["none"] - 0.01


@pytest.mark.slow
def test_digits_through_optimizer_auto_within_one_point(digits_accuracy):
    assert digits_accuracy["auto"] >= digits_accuracy["none"] - 0.01


@pytest.mark.slow
def test_digits_through_optimizer_topk_within_two_points(digits_accuracy):
    # No dense warm-up here (the optimizer compresses from the first step): a harder setting.
    assert digits_accuracy["topk"] >= digits_accuracy["none"] - 0.02


TORCH_OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                    "RAdam", "RMSprop", "Rprop", "LBFGS"]


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_every_torch_optimizer_can_be_wrapped(h, name):
    """DistributedOptimizer over each of torch.optim's optimizers: its own attributes (LBFGS
    keeps a list in ``_params``) never clash with the wrapper's, and steps leave identical
    parameters on every rank. LBFGS runs one iteration per step on the gradients reduced
    before it (its closure returns the loss already computed: a closure that ran backward
    again would start a second reduction inside the step)."""
    model = Net()
    extra = {"max_iter": 1} if name == "LBFGS" else {}
    opt = h.DistributedOptimizer(getattr(torch.optim, name)(model.parameters(), lr=0.01, **extra),
                                 named_parameters=model.named_parameters())
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step((lambda loss=loss: loss) if name == "LBFGS" else None)
    assert same_on_all_ranks(flat_params(model))


class Lookup(torch.nn.Module):
    """A sparse embedding and a dense head: one sparse and one dense gradient per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(10, 3, sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, idx):
        return self.head(self.embedding(idx)).sum()


def lookup_indices(rank: int) -> torch.Tensor:
    """Rows this rank looks up: overlapping with other ranks', some repeated, some its own."""
    return torch.tensor([[1, 2, 4, rank % 10], [4, (rank + 7) % 10, 2, 9]])


@pytest.mark.parametrize("compression", [None, HalfCompressor], ids=["none", "script-fp16"])
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_average_and_stay_sparse(h, sparse_as_dense, compression):
    """Both ways of reducing a sparse gradient give every rank the average of everyone's
    gradient, handed back sparse, so SparseAdam (which takes sparse gradients only) steps;
    under a compressor of the script's own too (reduced dense, the result went into the dense
    copy after the gradient had turned sparse again: each rank kept its own gradient)."""
    model, ref = Lookup(), Lookup()
    sparse = [model.embedding.weight]
    opt = h.DistributedOptimizer(
        torch.optim.SparseAdam(sparse, lr=0.1), named_parameters=[("embedding.weight", sparse[0])],
        sparse_as_dense=sparse_as_dense, compression=compression or h.Compression.none)
    opt.zero_grad()
    model(lookup_indices(RANK)).backward()
    opt.synchronize()
    grad = model.embedding.weight.grad
    assert grad.is_sparse
    expected = torch.zeros(10, 3)
    for r in range(SIZE):
        ref.zero_grad()
        ref(lookup_indices(r)).backward()
        expected += ref.embedding.weight.grad.to_dense()
    torch.testing.assert_close(grad.to_dense(), expected / SIZE,
                               **({} if compression is None else {"rtol": 1e-3, "atol": 1e-3}))
    with opt.skip_synchronize():
        opt.step()
    assert same_on_all_ranks(model.embedding.weight.detach())
