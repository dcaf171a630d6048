"""``Communicator.start_allreduce`` over gloo: the call agreed like any allreduce, then gloo's
own allreduce started on gloo's threads, and the DDP hook's background path over it.

Over a gloo group (here made from MPI's ranks), a float32/float64 sum or average above the
inline slot returns a Future at once and gloo reduces the array in place; every other call
runs to the end in the call and returns None. Checked against every rank's inputs gathered
with mpi4py (integer-valued floats, so every order of summation gives the exact sum), with
calls in flight interleaved with the ring's own collectives, arguments that differ between
ranks, a peer that never comes (a timeout naming the collective), and DDP trained through
the hook against DDP's own allreduce, bit for bit, with the setting that picks the path
differing between ranks.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import (  # noqa: E402
    counting_gloo_allreduce,
    flat_params,
    gloo_communicator,
    process_group,
    same_on_all_ranks,
)

import ringcomm  # noqa: E402
from ringcomm.algorithms.auto import LinkModel  # noqa: E402
from ringcomm.backends import gloo  # noqa: E402
from ringcomm.comm.base import Communicator  # noqa: E402
from ringcomm.core.types import ArgumentMismatchError, CollectiveTimeoutError  # noqa: E402
from ringcomm.torch import RingcommState, ringcomm_hook  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()


comm = pytest.fixture(scope="module", name="comm")(gloo_communicator)
calls = pytest.fixture(name="calls")(counting_gloo_allreduce)


def _ints(n: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Integer-valued floats: their sums are exact in any order."""
    rng = np.random.default_rng(100 * RANK + n + salt)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _exact(x: np.ndarray, op: str) -> np.ndarray:
    everyone = WORLD.allgather(x)
    total = np.sum(np.stack(everyone).astype(np.float64), axis=0)
    return (total / SIZE if op == "avg" else total).astype(x.dtype)


def _same_everywhere(a: np.ndarray) -> bool:
    first = WORLD.bcast(a.tobytes(), root=0)
    return bool(WORLD.allreduce(int(a.tobytes() == first), op=MPI.MIN))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_started_allreduce_runs_on_gloos_threads_in_place(comm, calls, dtype, op):
    x = _ints(100_003, dtype)
    expected = _exact(x, op)
    pending = comm.start_allreduce(x, op=op)
    assert isinstance(pending, torch.futures.Future)
    result = pending.wait()
    assert result.data_ptr() == x.ctypes.data  # the tensor is x's memory, reduced in place
    assert calls == [x.size]
    np.testing.assert_array_equal(x, expected)
    assert _same_everywhere(x)


@pytest.mark.parametrize("case", ["float16", "int32", "max", "inline", "limit"])
def test_calls_gloo_does_not_take_are_left_to_allreduce(comm, calls, monkeypatch, case):
    dtype = {"float16": "float16", "int32": "int32"}.get(case, "float32")
    n = 16 if case == "inline" else 50_001
    op = "max" if case == "max" else "sum"
    if case == "limit":  # as RINGCOMM_GLOO_ALLREDUCE_BYTES below the call's size would set
        monkeypatch.setattr(comm.transport, "native_allreduce_bytes", 1024)
    x = _ints(n, dtype)
    before = x.copy()
    everyone = np.stack(WORLD.allgather(x))
    expected = (everyone.max(axis=0) if op == "max"  # float16: the exact sum, rounded once
                else everyone.astype(np.float64).sum(axis=0).astype(dtype))
    assert comm.start_allreduce(x, op=op) is None
    np.testing.assert_array_equal(x, before)  # nothing ran
    comm.allreduce(x, out=x, op=op)  # what the caller does then
    np.testing.assert_array_equal(x, expected)
    assert calls == []


def test_a_non_contiguous_array_is_reduced_through_a_copy(comm):
    base = _ints(2 * 40_000, "float64").reshape(40_000, 2)
    x = base[:, 0]  # every other element
    untouched = base[:, 1].copy()
    expected = _exact(x.copy(), "sum")
    comm.start_allreduce(x).wait()
    np.testing.assert_array_equal(base[:, 0], expected)
    np.testing.assert_array_equal(base[:, 1], untouched)


@pytest.mark.parametrize("reversed_on", ["every rank", "rank 0"])
def test_an_array_of_negative_strides_is_reduced_in_place(comm, reversed_on):
    """A reversed view, which allreduce takes and no torch tensor can be: reduced in place
    through a copy (the Future's tensor), on every rank. It failed on its rank alone, after
    the ranks agreed on the call, and left the others in gloo's allreduce (a timeout)."""
    base = _ints(2 * 40_000, "float32", salt=3)
    mine = RANK == 0 or reversed_on == "every rank"
    x = base[::-2] if mine else base[1::2]  # 40 000 elements, strides -8 or 8
    expected = _exact(x.copy(), "sum")
    untouched = (base[-2::-2] if mine else base[::2]).copy()
    result = comm.start_allreduce(x).wait()
    np.testing.assert_array_equal(x, expected)
    np.testing.assert_array_equal(result.numpy(), expected)
    np.testing.assert_array_equal(base[-2::-2] if mine else base[::2], untouched)
    assert _same_everywhere(x)


def test_calls_in_flight_interleave_with_the_rings_collectives(comm):
    arrays = [_ints(n, "float32", salt=i) for i, n in enumerate((70_001, 300_000, 9_999))]
    expected = [_exact(a, "avg") for a in arrays]
    pending = []
    for a in arrays:
        pending.append(comm.start_allreduce(a, op="avg"))
        # Between the starts: the ring's own messages (Int8) and a broadcast, same group.
        g = np.full(20_000, float(RANK + 1), np.float32)
        comm.allreduce(g, out=g, compression=ringcomm.Int8())
        b = np.arange(10, dtype=np.int64) * (RANK + 1)
        comm.broadcast(b, root=SIZE - 1)
        np.testing.assert_array_equal(b, np.arange(10) * SIZE)
    for p, a, e in zip(pending, arrays, expected, strict=True):
        p.wait()
        np.testing.assert_array_equal(a, e)
        assert _same_everywhere(a)


@pytest.mark.skipif(SIZE < 2, reason="needs another rank to differ from")
def test_arguments_that_differ_raise_on_every_rank(comm):
    x = np.ones(50_000 + (RANK == 0), np.float32)
    with pytest.raises(ArgumentMismatchError, match="shape differs between ranks"):
        comm.start_allreduce(x)
    y = np.ones(50_000, np.float32)
    comm.start_allreduce(y).wait()  # the communicator stays usable
    np.testing.assert_array_equal(y, np.full(50_000, SIZE, np.float32))


def test_a_read_only_array_is_refused_on_every_rank(comm):
    """The rank whose array is read-only starts nothing; the others' started call and its
    allreduce, run next as the caller does on None, raise the same error."""
    x = np.ones(50_000, np.float32)
    if RANK == 0:
        x.flags.writeable = False
    with pytest.raises(ValueError, match="writ"):
        if comm.start_allreduce(x) is None:
            comm.allreduce(x, out=x)
    y = np.ones(50_000, np.float32)
    comm.start_allreduce(y).wait()  # the communicator stays in step
    np.testing.assert_array_equal(y, np.full(50_000, SIZE, np.float32))


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that asks and one that does not")
@pytest.mark.parametrize("case", ["inline", "max", "hierarchical", "int32"])
def test_a_call_that_does_not_start_exchanges_nothing(comm, case):
    """A start_allreduce that returns None has exchanged nothing: a rank that asks first and
    then runs the allreduce makes the same collectives as one that runs the allreduce alone
    (an agreement made and not run paired with the others' next collective, and both waited
    until the timeout). A call gloo would start that turns out two-level once agreed runs in
    start_allreduce, to a completed result."""
    n = 16 if case == "inline" else 50_001
    op = "max" if case == "max" else "sum"
    algorithm = "hierarchical" if case == "hierarchical" else None
    x = _ints(n, "int32" if case == "int32" else "float32")
    everyone = np.stack(WORLD.allgather(x))
    expected = everyone.max(axis=0) if op == "max" else everyone.sum(axis=0).astype(x.dtype)
    pending = None
    if RANK == 0:
        pending = comm.start_allreduce(x, op=op, algorithm=algorithm)
        assert (pending is None) == (case != "hierarchical"), pending
    if pending is None:
        comm.allreduce(x, out=x, op=op, algorithm=algorithm)
    else:
        assert pending.done() and pending.wait().data_ptr() == x.ctypes.data
    np.testing.assert_array_equal(x, expected)


@pytest.mark.skipif(SIZE < 2, reason="needs a peer that does not come")
def test_a_peer_that_never_comes_times_out_naming_the_collective():
    process_group()
    # No agreement, so that rank 0's allreduce is started alone.
    lonely = gloo.TorchDistCommunicator(consistency_check=False, timeout=2,
                                        abort_on_timeout=False)
    try:
        if RANK == 0:
            pending = lonely.start_allreduce(np.ones(100_000, np.float32))
            with pytest.raises(CollectiveTimeoutError,
                               match=r"^allreduce timed out on rank 0 of \d+ after \d+\.\d s"):
                pending.wait()
    finally:
        WORLD.Barrier()
        lonely.close()


class _SlowFP16(ringcomm.FP16):
    """FP16 whose every encoding also waits 30 ms: clearly the slower candidate of a trial."""

    delay = 0.03

    def encode(self, src, out, *, seed=0, base=0, error=None):
        time.sleep(self.delay)
        super().encode(src, out, seed=seed, base=base, error=error)

    def __repr__(self) -> str:
        return "SlowFP16()"


class _SlowerFP16(_SlowFP16):
    """300 ms an encoding: where one timed call decides, a margin that a hiccup of one rank
    (the suite's other work on 2 cores) cannot outweigh, as it once outweighed 30 ms."""

    delay = 0.3


def _undecided_auto(*candidates) -> ringcomm.Auto:
    """An Auto whose model cannot tell its candidates apart: it tries each once in the job."""
    even = {ringcomm.Auto.key(c): 1e9 for c in candidates}
    return ringcomm.Auto(candidates, link=LinkModel(latency=50e-6, bandwidth=125e6),
                         throughput=even, trials=1)


@pytest.mark.skipif(SIZE < 2, reason="one rank encodes nothing (its allreduce is a copy): "
                    "SlowFP16 is no slower there")
@pytest.mark.parametrize("candidates, started", [((None, "slow"), True),
                                                 (("slow", ringcomm.FP16()), False)])
def test_auto_is_started_once_it_has_chosen_dense(comm, candidates, started):
    """``start_allreduce(compression=auto)`` starts nothing while the Auto tries its
    candidates or where it chose a compressor (the calls then run through ``allreduce``, the
    trials timed there), and starts gloo's allreduce once it has chosen to send uncompressed,
    on every rank at the same call; results identical on every rank throughout."""
    auto = _undecided_auto(*(_SlowerFP16() if c == "slow" else c for c in candidates))
    # A dense call of this size first: its one-off costs (gloo's, the ring's scratch) would
    # otherwise fall in the one timed dense trial call, and could outweigh SlowFP16's 30 ms.
    comm.allreduce(_ints(60_000, "float32", salt=99), op="avg")
    outcomes = []
    for step in range(8):
        x = _ints(60_000, "float32", salt=step)
        expected = _exact(x, "avg")
        pending = comm.start_allreduce(x, op="avg", compression=auto)
        if pending is None:
            comm.allreduce(x, out=x, op="avg", compression=auto)
        else:
            pending.wait()
            np.testing.assert_array_equal(x, expected)
        outcomes.append(pending is not None)
        assert _same_everywhere(x)
    # Two trial calls per candidate (an untimed one, a timed one), the call that decides (in
    # allreduce, together), then the choice: dense is started from the sixth call.
    assert outcomes == [False] * 5 + [started] * 3
    assert WORLD.allgather(outcomes) == [outcomes] * SIZE
    assert comm.start_allreduce(np.ones(60_000, np.float32), compression=ringcomm.FP16()) is None


def _train(state: RingcommState | None, steps: int = 4) -> torch.Tensor:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.1)
    if state is not None:
        model.register_comm_hook(state, ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).square().mean().backward()
        opt.step()
    return flat_params(model)


def test_buckets_gloo_does_not_take_are_reduced_in_the_hook(comm, monkeypatch):
    monkeypatch.setattr(comm.transport, "native_allreduce_bytes", 1024)  # the ring's, then
    expected = _train(None)
    got = _train(RingcommState(comm=comm, overlap=True))
    assert same_on_all_ranks(got)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("overlap", ["all", "rank 0"])
def test_the_hooks_background_path_trains_like_ddp_default(comm, monkeypatch, overlap):
    started: list[int] = []
    real = Communicator.start_allreduce

    def counting(self, x, **kwargs):
        started.append(x.size)
        return real(self, x, **kwargs)

    monkeypatch.setattr(Communicator, "start_allreduce", counting)
    expected = _train(None)
    background = overlap == "all" or RANK == 0  # the other ranks reduce inside the hook
    got = _train(RingcommState(comm=comm, overlap=background))
    assert same_on_all_ranks(got)
    if SIZE & (SIZE - 1) == 0:  # gloo's sum either way; halving commutes with it exactly
        assert torch.equal(got, expected)
    else:  # DDP divides each rank's gradient before the sum, the hook the sum
        torch.testing.assert_close(got, expected)
    assert bool(started) == background


class _LaggyFP16(ringcomm.FP16):
    """FP16 whose calls return at once but leave 150 ms of work that the next iteration waits
    for, as a GPU codec's kernels hold up the next step's compute."""

    busy_until = 0.0  # one per process: each rank is a process
    encodings = 0

    def encode(self, src, out, *, seed=0, base=0, error=None):
        super().encode(src, out, seed=seed, base=base, error=error)
        type(self).busy_until = time.perf_counter() + 0.15
        type(self).encodings += 1

    def __repr__(self) -> str:
        return "LaggyFP16()"


@pytest.mark.skipif(SIZE < 2, reason="one rank tries nothing: its allreduce is a copy")
def test_the_hook_chooses_auto_by_what_an_iteration_takes(comm):
    """Under ``compression="auto"`` the hook times whole iterations: LaggyFP16, whose calls
    are the quicker but whose iterations are 150 ms longer, loses to SlowFP16 (30 ms an
    encoding, about 60 ms an iteration here). Timing each call, as an Auto does outside the
    hook, chose LaggyFP16."""
    auto = _undecided_auto(_LaggyFP16(), _SlowFP16())
    auto = ringcomm.Auto(auto.candidates, link=auto.link, throughput=auto.throughput, trials=3)
    state = RingcommState(comm=comm, compression=auto, overlap=True, start_iter=0,
                          min_compress_bytes=0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    model.register_comm_hook(state, ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(RANK)
    # 2 untimed iterations, 3 timed ones per candidate, the deciding one, then the choice
    for step in range(11):
        time.sleep(max(0.0, _LaggyFP16.busy_until - time.perf_counter()))  # the leftover
        if step == 9:
            laggy_before = _LaggyFP16.encodings
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).square().mean().backward()
        opt.step()
    assert same_on_all_ranks(flat_params(model))
    assert state._trials.choice == "SlowFP16()"
    assert _LaggyFP16.encodings == laggy_before  # the last iterations ran the choice


@pytest.mark.skipif(SIZE < 2, reason="needs another rank to differ from")
def test_the_hooks_auto_trying_differently_between_ranks_raises_everywhere(comm):
    """Auto(trials=1) on rank 0 and Auto(trials=2) elsewhere: every rank raises the mismatch at
    the first call that compresses (each candidate runs under its Auto's name, which the ranks
    agree on), none hangs or trains on. Before, their iterations agreed until rank 0 decided
    (an exchange) while the others reduced a bucket, and rank 0 then hung closing."""
    trials = 1 if RANK == 0 else 2
    auto = _undecided_auto(None, ringcomm.FP16())
    auto = ringcomm.Auto(auto.candidates, link=auto.link, throughput=auto.throughput,
                         trials=trials)
    state = RingcommState(comm=comm, compression=auto, overlap=True, start_iter=0,
                          min_compress_bytes=0)
    with pytest.raises(Exception) as err:  # DDP re-raises a bucket's error as RuntimeError
        _train(state, steps=10)
    assert "differs between ranks" in str(err.value) and "trials=1" in str(err.value), (
        repr(err.value))
    assert state.iter <= 1  # in the first iteration (its last bucket may have counted it)
    assert WORLD.allgather(True) == [True] * SIZE  # every rank got here


@pytest.mark.skipif(SIZE < 2, reason="one rank tries nothing: its allreduce is a copy")
def test_the_hook_starts_the_buckets_auto_sends_uncompressed(comm, monkeypatch):
    """``compression="auto"`` in the hook: each iteration tries one candidate on every bucket
    (ringcomm.torch._iteration_trials): each candidate in turn one untimed iteration, then
    ``rounds`` timed ones, then the choice. The iterations that send uncompressed start their
    buckets on gloo's threads like uncompressed ones, the others reduce them in the hook;
    SlowFP16 (30 ms an encoding) loses, and every iteration after the choice starts its
    buckets. The dense candidate is timed on iterations that start their buckets, as it runs
    once chosen: the dense iteration right after SlowFP16's sends the residuals it left, in
    the hook, and is never timed (tried in turn one iteration each, every timed dense
    iteration did, and a compressor slower than dense could win). The same on every rank,
    parameters identical on every rank."""
    state = RingcommState(comm=comm, compression=_undecided_auto(_SlowFP16(), None),
                          overlap=True, start_iter=0, min_compress_bytes=0)
    started: list[bool] = []
    timed_dense: list[bool] = []
    real = Communicator.start_allreduce

    def counting(self, x, **kwargs):
        pending = real(self, x, **kwargs)
        if kwargs.get("compression") is not None:
            started.append(pending is not None)
            trials = state._trials  # on the thread that runs the calls, in their order
            if trials._open is not None and trials._open[0] == "none":
                timed_dense.append(pending is not None)
        return pending

    monkeypatch.setattr(Communicator, "start_allreduce", counting)
    # SlowFP16 (untimed, timed: trials=1), dense (untimed: it sends SlowFP16's residuals in
    # the hook; timed), then dense chosen, its buckets started
    got = _train(state, steps=8)
    assert same_on_all_ranks(got)
    assert WORLD.allgather(started) == [started] * SIZE
    assert state._trials.choice == "none"
    assert not all(started) and all(started[-4:]), started  # trials, then started
    assert timed_dense and all(timed_dense), timed_dense


@pytest.mark.gpu
def test_cuda_arrays_are_reduced_in_stream_order(comm):
    """CUDA tensors (every rank on GPU 0) written on a side stream behind a long kernel, read
    on that stream after ``wait()``: gloo copies them after the writes, and the average and
    a non-contiguous view's copy back come before the reads."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cupy = pytest.importorskip("cupy")
    device = torch.device("cuda", 0)
    side = torch.cuda.Stream(device)
    total = SIZE * (SIZE + 1) / 2
    for trial in range(10):
        with torch.cuda.device(device), torch.cuda.stream(side):
            busy = torch.randn(2048, 2048, device=device)
            for _ in range(8):
                busy = busy @ busy / 2048  # queued ahead of the writes
            flat = torch.full((100_003,), float(RANK + 1), device=device)
            pairs = torch.full((60_000, 2), float(RANK + 1), device=device)
            pending = [comm.start_allreduce(cupy.from_dlpack(flat), op="avg"),
                       comm.start_allreduce(cupy.from_dlpack(pairs[:, 0]), op="sum")]
            for p in pending:
                assert isinstance(p, torch.futures.Future)
                p.wait()  # orders this stream after the results
            got = (flat.clone(), pairs[:, 0].clone(), pairs[:, 1].clone())
        torch.cuda.synchronize(device)
        torch.testing.assert_close(got[0], torch.full_like(got[0], total / SIZE), msg=str(trial))
        assert torch.equal(got[1], torch.full_like(got[1], total)), trial
        assert torch.equal(got[2], torch.full_like(got[2], float(RANK + 1))), trial


@pytest.mark.gpu
def test_cuda_arrays_take_gloos_allreduce_started_or_not(comm, calls):
    """A dense float32 CUDA allreduce over gloo is gloo's allreduce whether it is started or
    runs in the call: ranks that do one and the other (the DDP hook with ``host_staging``
    None on some and False on others) meet in the same collective and get the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cupy = pytest.importorskip("cupy")
    with torch.cuda.device(0):
        x = cupy.asarray(_ints(70_001, "float32"))
        expected = _exact(x.get(), "avg")
        if RANK % 2 == 0:
            comm.start_allreduce(x, op="avg").wait()
        else:
            comm.allreduce(x, out=x, op="avg")
        torch.cuda.synchronize()
        got = x.get()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert _same_everywhere(got)
    assert calls == [x.size]
