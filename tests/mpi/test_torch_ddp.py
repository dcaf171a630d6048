"""DDP with ringcomm_hook: same training as DDP's own allreduce, compression, error feedback."""

from __future__ import annotations

import collections
import math
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import (  # noqa: E402
    DIGITS_BATCH,
    DIGITS_WARMUP_EPOCHS,
    digits,
    digits_mlp,
    flat_params,
    hvd,
    process_group,
    same_on_all_ranks,
    sgd,
    train_digits,
)

import ringcomm  # noqa: E402
from ringcomm.torch import RingcommState, ringcomm_hook  # noqa: E402

DDP = torch.nn.parallel.DistributedDataParallel
SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="module", autouse=True)
def _group():
    process_group()
    hvd()  # RingcommState() takes this communicator


@pytest.fixture
def fresh_comm():
    """A communicator of the test's own, whose calls the test may spy on."""
    c = ringcomm.init("mpi", abort_on_exception=False)
    yield c
    c.close()


class Shuffled(torch.nn.Module):
    """Layers registered in another order than forward uses them, so that DDP's bucket rebuild
    after the first iteration changes which parameters each bucket holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c = torch.nn.Linear(32, 8)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def train(model, steps: int, lr: float = 0.1) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + RANK)  # every rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 8, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return flat_params(model)


@pytest.mark.parametrize("overlap", [None, True])
def test_hook_trains_like_ddp_default_allreduce(overlap):
    expected = train(DDP(Shuffled(), bucket_cap_mb=0.002), 6)
    model = DDP(Shuffled(), bucket_cap_mb=0.002)
    model.register_comm_hook(RingcommState(overlap=overlap), ringcomm_hook)
    got = train(model, 6)
    torch.testing.assert_close(got, expected)
    assert same_on_all_ranks(got)


class Embedded(torch.nn.Module):
    """An embedding with sparse gradients (DDP gives each its own bucket, undivided), then a
    dense layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.emb(x))


def train_embedded(model, steps: int = 4, device: str = "cpu") -> torch.Tensor:
    """The parameters (on the host) after training ``model`` on ``device``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(200 + RANK)  # indices that repeat within and across ranks
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randint(0, 12, (10,), generator=gen).to(device)).pow(2).mean().backward()
        opt.step()
    return flat_params(model).cpu()


@pytest.mark.parametrize("overlap", [None, True])
@pytest.mark.parametrize("compression", [None, "int8"])
def test_sparse_gradients_average_like_ddp_default(overlap, compression):
    """A sparse gradient is averaged exactly, in call order with the dense buckets, and never
    compressed, whatever the state's compression (then the dense layer is frozen, so that
    the embedding alone is reduced)."""
    def model():
        net = Embedded()
        net.out.requires_grad_(compression is None)
        return DDP(net)

    expected = train_embedded(model())
    hooked = model()
    hooked.register_comm_hook(
        RingcommState(compression=ringcomm.Int8() if compression else None, start_iter=0,
                      min_compress_bytes=0, overlap=overlap), ringcomm_hook)
    got = train_embedded(hooked)
    # The embedding alone, or two ranks (a + b is b + a): bit for bit as DDP's own (each
    # rank's entries divided by the size, then summed in rank order, as there). Beyond two
    # ranks the dense layer's ring sums in another order than gloo's (as in the dense test),
    # and the embedding's later gradients follow it.
    if compression is not None or SIZE == 2:
        assert torch.equal(got, expected), (got - expected).abs().max()
    torch.testing.assert_close(got, expected)
    assert same_on_all_ranks(got)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_sparse_cuda_gradients_average_like_ddp_default_on_the_host():
    """A CUDA model's sparse gradient (every rank on the GPU it sees, which ranks may
    share): copied to the host, averaged there, its average back on the GPU; the embedding
    ends as DDP default's on the host does, within float32's rounding, and the same on
    every rank."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")

    def model(device):
        net = Embedded().to(device)
        net.out.requires_grad_(False)  # the embedding alone reduced
        return DDP(net, device_ids=[0] if device == "cuda" else None)

    expected = train_embedded(model("cpu"))
    hooked = model("cuda")
    hooked.register_comm_hook(RingcommState(), ringcomm_hook)
    got = train_embedded(hooked, device="cuda")
    assert hooked.module.emb.weight.device.type == "cuda"
    torch.testing.assert_close(got, expected)
    assert same_on_all_ranks(got)


def test_hook_is_zero_copy_and_in_place():
    seen = []

    def spy(state, bucket):
        buffer = bucket.buffer()
        future = ringcomm_hook(state, bucket)
        seen.append(future.wait() is buffer)
        return future

    model = DDP(Shuffled())
    model.register_comm_hook(RingcommState(), spy)
    train(model, 2)
    assert seen and all(seen)


def spy_compression(comm):
    """Record (elements, compressed?) of every allreduce ``comm`` makes."""
    calls = []
    allreduce = comm.allreduce

    def recording(x, *args, **kwargs):
        calls.append((x.size, kwargs.get("compression") is not None))
        return allreduce(x, *args, **kwargs)

    comm.allreduce = recording
    return calls


def test_dense_until_start_iter_and_for_small_buckets(fresh_comm):
    calls = spy_compression(fresh_comm)
    model = DDP(Shuffled(), bucket_cap_mb=0.002)
    state = RingcommState(fresh_comm, compression=ringcomm.Int8(), start_iter=3,
                          min_compress_bytes=4000)
    model.register_comm_hook(state, ringcomm_hook)
    per_step = []
    for _ in range(5):
        calls.clear()
        train(model, 1)
        per_step.append(list(calls))
    assert state.iter == 5
    for step, step_calls in enumerate(per_step):
        for n, compressed in step_calls:
            assert compressed == (step >= 3 and 4 * n >= 4000), (step, n)
    assert any(c for _, c in per_step[-1]) and not all(c for _, c in per_step[-1])


def test_error_feedback_follows_the_bucket_rebuild(fresh_comm):
    """Nothing compression held back is lost when DDP re-cuts its buckets: per parameter, the
    sum of every rank's gradients equals size x the averages received plus every rank's
    residual, across the rebuild after the first iteration."""
    model = DDP(Shuffled(), bucket_cap_mb=0.002)
    state = RingcommState(fresh_comm, compression=ringcomm.TopK(0.1), start_iter=0,
                          min_compress_bytes=0)
    sent = collections.defaultdict(float)
    received = collections.defaultdict(float)
    layouts = []

    def recording(state, bucket):
        layouts.append((bucket.index(), tuple(id(p) for p in bucket.parameters())))
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            sent[id(p)] = sent[id(p)] + g.double()

        def done(future):
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                received[id(p)] = received[id(p)] + g.double()
            return future.value()

        return ringcomm_hook(state, bucket).then(done)

    model.register_comm_hook(state, recording)
    train(model, 4)
    assert len(set(layouts)) > 2, "the buckets were not rebuilt; the test proves nothing"
    for p in model.parameters():
        residual = state.residual(p)
        held = np.zeros(p.numel()) if residual is None else residual.double().numpy()
        total_in = MPI.COMM_WORLD.allreduce(sent[id(p)].reshape(-1).numpy())
        total_held = MPI.COMM_WORLD.allreduce(held)
        total_out = SIZE * received[id(p)].reshape(-1).numpy()
        np.testing.assert_allclose(total_out + total_held, total_in, rtol=1e-5, atol=1e-5)


COMPRESSORS = {"topk": lambda: ringcomm.TopK(0.1), "int8": ringcomm.Int8,
               "powersgd": lambda: ringcomm.PowerSGD(rank=1), "fp16": ringcomm.FP16,
               "bf16": ringcomm.BF16}


def _recorded(model, comm, compression: str):
    """Register ringcomm's hook with ``compression`` (compressing from the first step) on
    ``model``, recording the gradients handed to it: (state, parameter id -> their sum)."""
    state = RingcommState(comm, compression=COMPRESSORS[compression](), start_iter=0,
                          min_compress_bytes=0)
    sent = collections.defaultdict(float)

    def recording(state, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            sent[id(p)] = sent[id(p)] + g.double().reshape(-1)
        return ringcomm_hook(state, bucket)

    model.register_comm_hook(state, recording)
    return state, sent


class SometimesUsed(torch.nn.Module):
    """``b`` takes part in forward on even steps only (on rank 0 also on odd steps when
    ``rank0_always``), so DDP (``find_unused_parameters=True``) zero-fills its gradient where a
    rank did not use it and drops its share of the result where no rank did."""

    def __init__(self, rank0_always: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.step, self.rank0_always = 0, rank0_always

    def forward(self, x):
        h = self.a(x)
        if self.step % 2 == 0 or (self.rank0_always and RANK == 0):
            h = self.b(torch.relu(h))
        return h


@pytest.mark.parametrize("rank0_always", [False, True])
@pytest.mark.parametrize("compression", ["topk", "int8", "powersgd"])
def test_error_feedback_kept_for_parameters_a_step_leaves_unused(fresh_comm, compression,
                                                                 rank0_always):
    """Per parameter, every rank's gradients add up to size x the averaged gradients DDP
    applied plus every rank's residual, also for a parameter no rank (or one rank) used at some
    steps. Before, the residual of a parameter that no rank used was sent and dropped by DDP
    with that parameter's share of the result (TopK lost 42% of it, PowerSGD 34%)."""
    if SIZE < 2:
        pytest.skip("one rank compresses nothing")
    net = SometimesUsed(rank0_always)
    model = DDP(net, find_unused_parameters=True)
    state, sent = _recorded(model, fresh_comm, compression)
    applied = collections.defaultdict(float)
    gen = torch.Generator().manual_seed(100 + RANK)
    held_b = []
    for step in range(7):
        net.step = step
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 16, generator=gen)).pow(2).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                applied[id(p)] = applied[id(p)] + p.grad.double().reshape(-1)
        residual = state.residual(net.b.weight)
        held_b.append(0.0 if residual is None else float(residual.abs().sum()))
    assert max(held_b) > 0, "nothing was held back for b: the test proves nothing"
    for p in model.parameters():
        residual = state.residual(p)
        held = np.zeros(p.numel()) if residual is None else residual.double().numpy()
        given = sent[id(p)]
        given = np.zeros(p.numel()) if isinstance(given, float) else given.numpy()
        got = applied[id(p)]
        got = np.zeros(p.numel()) if isinstance(got, float) else got.numpy()
        total_in = MPI.COMM_WORLD.allreduce(given)
        total_held = MPI.COMM_WORLD.allreduce(held)
        np.testing.assert_allclose(SIZE * got + total_held, total_in,
                                   atol=1e-5 * np.abs(total_in).max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compression", ["topk", "int8", "powersgd", "fp16", "bf16"])
def test_error_feedback_of_16_bit_buckets_keeps_the_result_rounding(fresh_comm, compression,
                                                                   dtype):
    """A model in float16 or bfloat16: every rank's gradients add up to size x the averages
    DDP applied plus every rank's residual, to float32 rounding. A bfloat16 bucket travels as
    float32; rounding its average back into the bucket was kept nowhere (1.7e-3 of the mass
    lost in 10 steps with Int8, 2.1e-3 with TopK)."""
    if SIZE < 2:
        pytest.skip("one rank compresses nothing")
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64).to(dtype)
    model = DDP(net)
    state, sent = _recorded(model, fresh_comm, compression)
    applied = collections.defaultdict(float)
    gen = torch.Generator().manual_seed(100 + RANK)
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 64, generator=gen).to(dtype)).float().pow(2).sum().backward()
        for p in net.parameters():
            applied[id(p)] = applied[id(p)] + p.grad.double().reshape(-1)
    for p in net.parameters():
        total_in = MPI.COMM_WORLD.allreduce(sent[id(p)].numpy())
        total_held = MPI.COMM_WORLD.allreduce(state.residual(p).double().numpy())
        np.testing.assert_allclose(SIZE * applied[id(p)].numpy() + total_held, total_in,
                                   atol=1e-6 * np.abs(total_in).max())


def test_powersgd_given_to_two_states_keeps_each_models_q(fresh_comm):
    """One PowerSGD object given to the states of two models (create the compressor once, as
    its docs advise): each state keeps its own Q, so model A's averaged gradients are the same
    bits with model B training beside it as alone (B's Q warm-started A's buckets before)."""
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 32))

    def run(with_b):
        psgd = ringcomm.PowerSGD(rank=1)
        models = [DDP(build(0))] + ([DDP(build(1))] if with_b else [])
        for m in models:
            m.register_comm_hook(RingcommState(fresh_comm, compression=psgd, start_iter=0,
                                               min_compress_bytes=0), ringcomm_hook)
        gens = [torch.Generator().manual_seed(10 * k + RANK) for k in (1, 5)]
        grads = []
        for _ in range(4):
            for m, gen in zip(models, gens, strict=False):
                m.zero_grad()
                m(torch.randn(8, 32, generator=gen)).pow(2).sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in models[0].parameters()]))
        return torch.stack(grads)

    assert torch.equal(run(False), run(True))


def _recording(sent: dict, scaler: torch.amp.GradScaler, counted=lambda: True):
    """ringcomm's hook, adding each gradient it is handed, in true units (divided by the loss
    scale), to ``sent`` by parameter, where ``counted()``."""
    def hook(state, bucket):
        if counted():
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                sent[id(p)] = sent[id(p)] + g.double().reshape(-1) / scaler.get_scale()
        return ringcomm_hook(state, bucket)
    return hook


def test_residuals_follow_the_loss_scale_of_a_grad_scaler(fresh_comm):
    """With a GradScaler whose scale doubles every step, the residuals (kept in the units of
    the loss scale) are rescaled with it, so that in true units every rank's gradients add up
    to the averaged gradients plus the residuals (without it: 62% off)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = DDP(net)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    state = RingcommState(fresh_comm, compression=ringcomm.TopK(0.05), start_iter=0,
                          min_compress_bytes=0, grad_scaler=scaler)
    sent = collections.defaultdict(float)
    applied = collections.defaultdict(float)

    model.register_comm_hook(state, _recording(sent, scaler))
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    gen = torch.Generator().manual_seed(100 + RANK)
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(torch.randn(8, 32, generator=gen)).pow(2).sum()).backward()
        scaler.unscale_(opt)
        for p in net.parameters():
            applied[id(p)] = applied[id(p)] + p.grad.double().reshape(-1)
        last_scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 1024.0 * 2 ** 6  # it grew at every step
    for p in net.parameters():
        held = state.residual(p).double().numpy() / last_scale
        total_in = MPI.COMM_WORLD.allreduce(sent[id(p)].numpy())
        total_held = MPI.COMM_WORLD.allreduce(held)
        np.testing.assert_allclose(SIZE * applied[id(p)].numpy() + total_held, total_in,
                                   atol=1e-5 * np.abs(total_in).max())


class _Poisoned(torch.nn.Module):
    """A small net and a parameter of its own bucket whose gradient is Inf on rank 0 at the
    step ``poison`` says (``extra``: no other gradient depends on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 8))
        self.extra = torch.nn.Parameter(torch.ones(4))
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bad = math.inf if self.poison and RANK == 0 else 1.0
        return self.net(x).pow(2).sum() + (self.extra * bad).sum()


def test_a_step_the_grad_scaler_skips_adds_nothing_to_later_steps(fresh_comm):
    """A step the GradScaler skips (Inf in one bucket, on one rank) has moved every bucket's
    residual: top-k's took in nearly all of the step's gradient, which the steps after it
    would apply. Its scale backing off drops them: in true units the other steps' gradients
    add up to the averaged gradients applied, the residuals kept and those held before the
    skipped step (lost with it), and nothing of the skipped step's."""
    torch.manual_seed(0)
    module = _Poisoned()
    model = DDP(module, bucket_cap_mb=0.001)  # Inf in extra's bucket alone
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    state = RingcommState(fresh_comm, compression=ringcomm.TopK(0.05), start_iter=0,
                          min_compress_bytes=0, grad_scaler=scaler)
    params = list(module.net.parameters())
    sent = collections.defaultdict(float)
    applied = collections.defaultdict(float)
    skipped = 3

    model.register_comm_hook(state, _recording(sent, scaler, lambda: not module.poison))
    opt = torch.optim.SGD(module.parameters(), lr=0.0)
    gen = torch.Generator().manual_seed(100 + RANK)
    dropped = {}
    for step in range(7):
        module.poison = step == skipped
        if module.poison:
            dropped = {id(p): state.residual(p).double().numpy() / scaler.get_scale()
                       for p in params}
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(torch.randn(8, 32, generator=gen))).backward()
        scaler.unscale_(opt)
        if not module.poison:
            for p in params:
                applied[id(p)] = applied[id(p)] + p.grad.double().reshape(-1)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == (512.0 if step >= skipped else 1024.0)
    for p in params:
        held = state.residual(p).double().numpy() / scaler.get_scale()
        total_in = MPI.COMM_WORLD.allreduce(sent[id(p)].numpy())
        total_held = MPI.COMM_WORLD.allreduce(held + dropped[id(p)])
        np.testing.assert_allclose(SIZE * applied[id(p)].numpy() + total_held, total_in,
                                   atol=1e-5 * np.abs(total_in).max())


def test_bad_state_arguments():
    with pytest.raises(ValueError, match="start_iter must be an integer >= 0, got -1"):
        RingcommState(start_iter=-1)
    with pytest.raises(ValueError, match="min_compress_bytes must be an integer >= 0"):
        RingcommState(min_compress_bytes=-5)
    with pytest.raises(TypeError, match="compression must be a ringcomm compressor"):
        RingcommState(compression="int8")
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
        RingcommState(grad_scaler=1024.0)
    with pytest.raises(TypeError, match="a RingcommState cannot be saved"):
        pickle.dumps(RingcommState())  # as torch.save(state) does


@pytest.mark.parametrize("sparse", [False, True])
def test_a_collective_that_fails_in_the_hook_reaches_backward_as_itself(fresh_comm, monkeypatch,
                                                                       sparse):
    """A bucket's collective that fails (here on every rank, before anything moves) raises
    in backward() with its own type and words; C++ read the hook's failed future as done and
    said "Unable to cast <the words> to Tensor". The communicator stays usable."""
    def failing(*args, **kwargs):
        raise ValueError("the bucket's collective failed here")

    monkeypatch.setattr(fresh_comm, "allgather" if sparse else "allreduce", failing)
    torch.manual_seed(0)
    net = torch.nn.Embedding(10, 4, sparse=True) if sparse else torch.nn.Linear(16, 4)
    model = DDP(net)
    model.register_comm_hook(RingcommState(comm=fresh_comm, error_feedback=False),
                             ringcomm_hook)
    x = torch.arange(3) if sparse else torch.ones(2, 16)
    with pytest.raises(RuntimeError, match=r"Error: .*the bucket's collective failed here") as got:
        model(x).sum().backward()
    assert "Unable to cast" not in str(got.value)
    monkeypatch.undo()
    assert fresh_comm.allreduce(np.ones(3)).tolist() == [float(SIZE)] * 3


def test_a_model_over_a_one_process_group_takes_a_one_process_communicator():
    """DDP over a sub-group of one rank (each rank its own) in a job of several, with
    register_ddp_hook and a communicator of that one process: the hook runs (it refused, as
    if the communicator had been made before torch.distributed was up) and leaves the
    gradient as it was; the same communicator for a model over the whole job is refused."""
    import torch.distributed as dist

    from ringcomm.torch import register_ddp_hook

    if SIZE == 1:
        pytest.skip("a job of several processes: at one, the whole job's group is one process")
    alone, groups = dist.new_subgroups(group_size=1)
    comm = ringcomm.init("mpi", mpi_comm=MPI.COMM_SELF, abort_on_exception=False)
    try:
        torch.manual_seed(RANK)
        model = DDP(torch.nn.Linear(4, 2), process_group=alone)
        state = register_ddp_hook(model, comm=comm)
        x = torch.randn(3, 4)
        model(x).sum().backward()
        reference = torch.nn.Linear(4, 2)
        reference.load_state_dict(model.module.state_dict())
        reference(x).sum().backward()
        assert torch.equal(model.module.weight.grad, reference.weight.grad)
        assert state.stats.calls == 1
        with pytest.raises(ValueError, match="the DDP model's process group has"):
            register_ddp_hook(DDP(torch.nn.Linear(4, 2)), comm=comm)
    finally:
        comm.close()
        for g in groups:
            dist.destroy_process_group(g)


@pytest.fixture(scope="module")
def digits_accuracy():
    """Final test accuracy of the digits MLP through the hook, per compression."""
    pytest.importorskip("sklearn")
    if DIGITS_BATCH % SIZE:
        pytest.skip(f"the global batch of {DIGITS_BATCH} does not split over {SIZE} ranks")
    steps = len(digits()[1]) // DIGITS_BATCH
    settings = {"none": (None, 0), "int8": (ringcomm.Int8(), 2),
                "topk": (ringcomm.TopK(0.01), DIGITS_WARMUP_EPOCHS * steps),
                # An Auto of the user's own candidates (a policy, not a compressor).
                "auto": (ringcomm.Auto((None, ringcomm.FP16(), ringcomm.Int8())), 2)}
    accuracy = {}
    for name, (compression, start) in settings.items():
        model = DDP(digits_mlp())
        model.register_comm_hook(RingcommState(compression=compression, start_iter=start,
                                               min_compress_bytes=0), ringcomm_hook)
        accuracy[name] = train_digits(model, sgd(model))
    return accuracy


@pytest.mark.slow
def test_digits_through_hook_dense_learns(digits_accuracy):
    assert digits_accuracy["none"] > 0.95


@pytest.mark.slow
def test_digits_through_hook_int8_within_one_point(digits_accuracy):
    assert digits_accuracy["int8"] >= digits_accuracy["none"] - 0.01


@pytest.mark.slow
def test_digits_through_hook_auto_within_one_point(digits_accuracy):
    assert digits_accuracy["auto"] >= digits_accuracy["none"] - 0.01


@pytest.mark.slow
def test_digits_through_hook_topk_within_two_points(digits_accuracy):
    assert digits_accuracy["topk"] >= digits_accuracy["none"] - 0.02


@pytest.mark.timeout(120)
def test_hook_hierarchical_algorithm_trains_like_ddp():
    """RingcommState(algorithm="hierarchical") runs every bucket two-level (nodes of 2 ranks
    here, or 1 at one rank): training matches DDP's own allreduce, identical on every rank."""
    comm = ringcomm.init("mpi", abort_on_exception=False, inline_bytes=0,  # no small path
                         topology=2 if SIZE % 2 == 0 else 1)
    try:
        expected = train(DDP(Shuffled(), bucket_cap_mb=0.002), 6)
        model = DDP(Shuffled(), bucket_cap_mb=0.002)
        model.register_comm_hook(RingcommState(comm, algorithm="hierarchical"), ringcomm_hook)
        got = train(model, 6)
        torch.testing.assert_close(got, expected)
        assert same_on_all_ranks(got)
        assert comm._two_level.topology is not None or SIZE == 1  # the groups were made
        with pytest.raises(ValueError, match="algorithm must be one of"):
            RingcommState(comm, algorithm="tree")
        # PowerSGD's matrices are per tensor, not per node shard: refused as the state is
        # made (it was refused at the first compressed bucket, start_iter steps into training).
        for algorithm, comm_algorithm in (("hierarchical", "auto"), (None, "hierarchical")):
            comm.algorithm = comm_algorithm
            if SIZE == 1:  # one process: nothing to reduce in two levels
                RingcommState(comm, compression=ringcomm.PowerSGD(), algorithm=algorithm)
                continue
            with pytest.raises(ValueError, match=r"the hierarchical allreduce reduces node "
                               r"shards of the array, which PowerSGD\(.*cannot compress"):
                RingcommState(comm, compression=ringcomm.PowerSGD(), algorithm=algorithm)
        RingcommState(comm, compression=ringcomm.Int8(), algorithm="hierarchical")
        RingcommState(comm, compression=ringcomm.PowerSGD(), algorithm="flat")
    finally:
        comm.close()


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(500))

    def forward(self, x):
        return (self.w * x).sum()  # the gradient is the input


@pytest.mark.parametrize("overlap", [False, True])
def test_two_models_on_two_threads_over_one_communicator_never_mix(overlap):
    """Two DDP models, each with its state (and its own gloo group for DDP's own
    collectives), trained on two threads over one communicator: each rank's engine runs the
    buckets as they come, in different orders on different ranks. Every gradient is its own
    model's average, or the step raises on every rank naming the two states' calls. Both
    states called as the engine before: 15-20 of 20 steps averaged one model's gradients with
    the other's, differently on each rank, without a word."""
    import threading

    if SIZE < 2:
        pytest.skip("needs two ranks")
    comm = ringcomm.init("mpi", abort_on_exception=False, timeout=20)
    groups = [torch.distributed.new_group(backend="gloo") for _ in range(2)]
    models = []
    for group in groups:
        model = DDP(_Scaled(), process_group=group)
        model.register_comm_hook(RingcommState(comm=comm, overlap=overlap,
                                               error_feedback=False), ringcomm_hook)
        models.append(model)
    wrong: list[tuple[int, int, float]] = []
    errors: list[str] = []
    start = threading.Barrier(2)

    def train(k: int) -> None:
        start.wait()
        model = models[k]
        for step in range(20):
            model.zero_grad(set_to_none=True)
            try:
                model(torch.full((500,), float((k + 1) * 1000 + 10 * step + RANK))).backward()
            except RuntimeError as err:
                errors.append(str(err))
                return
            want = (k + 1) * 1000 + 10 * step + (SIZE - 1) / 2
            if not torch.all(model.module.w.grad == want):
                wrong.append((k, step, model.module.w.grad[0].item()))

    threads = [threading.Thread(target=train, args=(k,), name=f"model-{k}") for k in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not wrong, wrong
        assert all("ringcomm-hook-" in e or "timed out" in e for e in errors), errors
    finally:
        comm.close()
        for group in groups:
            torch.distributed.destroy_process_group(group)


@pytest.mark.parametrize("differing", ["start_iter", "compression", "error_feedback"])
def test_states_made_otherwise_on_each_rank_are_named_in_the_error(differing):
    """RingcommStates whose arguments differ between the ranks send a bucket compressed
    otherwise (or not at all) at some iteration: every rank raises, saying that the states
    differ and must be made with the same arguments, not only what the call's compression
    was on each rank."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    comm = ringcomm.init("mpi", abort_on_exception=False, timeout=20)
    kwargs = {"comm": comm, "overlap": False, "start_iter": 0, "min_compress_bytes": 0,
              "compression": ringcomm.Int8()}
    kwargs[differing] = {"start_iter": 1 + RANK, "compression": [ringcomm.Int8(),
                                                                 ringcomm.FP16()][RANK % 2],
                         "error_feedback": RANK == 0}[differing]
    try:
        model = DDP(_Scaled())
        model.register_comm_hook(RingcommState(**kwargs), ringcomm_hook)
        with pytest.raises(RuntimeError) as info:
            for _ in range(2):
                model(torch.full((500,), 1.0)).backward()
        message = str(info.value)
        assert "compression/name differs between ranks" in message, message
        assert ("so the states differ between the ranks: make them with the same arguments "
                "on every rank") in message, message
    finally:
        comm.close()


def test_a_state_made_on_one_rank_only_is_named_in_the_error():
    """A RingcommState made on rank 0 alone (never used) numbers the next state's calls
    otherwise there: the model's first bucket raises on every rank, saying that the states
    must be made alike on every rank, not only that threads differ."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    comm = ringcomm.init("mpi", abort_on_exception=False, timeout=20)
    try:
        if RANK == 0:
            RingcommState(comm=comm)
        model = DDP(_Scaled())
        model.register_comm_hook(RingcommState(comm=comm, overlap=False), ringcomm_hook)
        with pytest.raises(RuntimeError) as info:
            model(torch.full((500,), 1.0)).backward()
        message = str(info.value)
        assert "ArgumentMismatchError" in message, message
        assert ("'ringcomm-hook-1' on rank 0; 'ringcomm-hook-0' on ranks 1" in message
                or "'ringcomm-hook-1' on rank 0; 'ringcomm-hook-0' on rank 1" in message), message
        assert "the k-th RingcommState made on this communicator" in message, message
    finally:
        comm.close()
