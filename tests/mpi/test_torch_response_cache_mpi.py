"""Negotiation's response cache and turns, across processes: repeats travel as cache slots,
reused names with other fields and fields that differ between ranks behave exactly as the first
time, small caches evict alike on every rank, and cycles run on whichever thread waits.

Results are checked against values any rank can compute (the inputs depend on the rank only).
"""

from __future__ import annotations

import random
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import hvd  # noqa: E402

from ringcomm.torch.horovod import _negotiate  # noqa: E402
from ringcomm.torch.horovod.functions import _reduce_op  # noqa: E402

SIZE, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
RANKS_SUM = float(sum(range(1, SIZE + 1)))  # what a sum of (rank + 1) gives

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def h():
    return hvd()


@pytest.fixture()
def coord(h):
    return _negotiate.coordinator_for(h.communicator())


class WholeCount:
    """Counts the cycles whose requests had to travel whole (the pickled exchange)."""

    def __init__(self, coordinator: _negotiate.Coordinator) -> None:
        self.control = coordinator._channel._control
        self.calls = 0

    def __enter__(self) -> WholeCount:
        real = self.control.allgather_object

        def counted(obj):
            self.calls += 1
            return real(obj)

        self.control.allgather_object = counted
        return self

    def __exit__(self, *exc: object) -> None:
        del self.control.allgather_object  # the class's method again


def needs_two() -> None:
    if SIZE < 2:
        pytest.skip("needs at least 2 ranks")


def ones(n: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), float(RANK + 1), dtype=dtype)


def test_repeated_steps_travel_as_cache_slots(h, coord):
    names = [f"step.{i}" for i in range(16)]
    for step in range(6):
        order = names[:]
        random.Random(step * 100 + RANK).shuffle(order)  # a different order on every rank
        with WholeCount(coord) as whole:
            handles = {n: h.allreduce_async(ones(5), name=n, op=h.Sum) for n in order}
            for n, handle in handles.items():
                assert torch.equal(h.synchronize(handle), torch.full((5,), RANKS_SUM)), n
        if step > 0:  # the first step taught every rank's cache
            assert whole.calls == 0, step


def test_a_name_reused_with_other_fields_runs_with_them(h, coord):
    for n, dtype in [(3, torch.float32), (3, torch.float32), (7, torch.float32),
                     (7, torch.float64), (3, torch.float32), (3, torch.int32)]:
        out = h.allreduce(ones(n, dtype), name="reused", op=h.Sum)
        assert out.dtype == dtype and torch.equal(out, torch.full((n,), RANKS_SUM, dtype=dtype))


@pytest.mark.parametrize("what", ["shape", "dtype", "op"])
def test_a_cached_name_with_a_field_that_differs_fails_on_every_rank(h, what):
    needs_two()
    for _ in range(2):  # cached on every rank
        h.allreduce(ones(3), name=f"cached_{what}", op=h.Sum)
    odd = RANK == 1
    shape = 4 if what == "shape" and odd else 3
    dtype = torch.float64 if what == "dtype" and odd else torch.float32
    op = h.Max if what == "op" and odd else h.Sum
    with pytest.raises(h.HorovodInternalError,
                       match=rf"'cached_{what}': {what} differs between ranks"):
        h.allreduce(ones(shape, dtype), name=f"cached_{what}", op=op)
    out = h.allreduce(ones(3), name=f"cached_{what}", op=h.Sum)  # and it is usable again
    assert torch.equal(out, torch.full((3,), RANKS_SUM))


def test_a_small_cache_evicts_alike_on_every_rank(h, monkeypatch):
    """Ten names in random orders through a cache of three: evictions every step."""
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "3")
    comm = h.communicator()
    small = _negotiate._make(comm)  # collective: every rank makes it here
    try:
        names = [f"evict.{i}" for i in range(10)]
        for step in range(8):
            order = random.Random(step + 10 * RANK).sample(names, len(names))
            length = {n: 2 + (i + step) % 3 for i, n in enumerate(names)}  # changes per step
            handles = {n: small.submit(_reduce_op(ones(length[n]), None, n, h.Sum, 1.0, 1.0,
                                                  None, None))
                       for n in order}
            for n, handle in handles.items():
                want = torch.full((length[n],), RANKS_SUM)
                assert torch.equal(handle.wait(), want), (step, n)
        assert len(small._channel.cache) == 3
    finally:
        small.close()


def test_a_capacity_that_differs_between_ranks_fails_on_every_rank(h, monkeypatch):
    needs_two()
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", str(10 + RANK))
    odd = _negotiate._make(h.communicator())
    try:
        handle = odd.submit(_reduce_op(ones(), None, "cap", h.Sum, 1.0, 1.0, None, None))
        with pytest.raises(RuntimeError, match=r"HOROVOD_CACHE_CAPACITY differs between ranks"):
            handle.wait()
    finally:
        odd.close()


def test_operations_nobody_waits_for_run_in_the_background(h):
    handles = [h.allreduce_async(ones(), name=f"bg.{i}", op=h.Sum) for i in range(4)]
    deadline = time.monotonic() + 30
    while not all(h.poll(x) for x in handles):  # polling never runs a cycle
        assert time.monotonic() < deadline, "the background thread never ran them"
        time.sleep(0.001)
    for x in handles:
        assert torch.equal(h.synchronize(x), torch.full((3,), RANKS_SUM))


def test_one_thread_waits_while_others_submit(h):
    """Synchronous calls on one thread (which runs the cycles) while two threads submit
    asynchronous operations in a different order on every rank."""
    errors: list[BaseException] = []
    results: dict[str, torch.Tensor] = {}

    def sync_worker() -> None:
        try:
            for i in range(20):
                results[f"sync.{i}"] = h.allreduce(ones(), name=f"sync.{i}", op=h.Sum)
        except BaseException as err:
            errors.append(err)

    def async_worker(k: int) -> None:
        try:
            names = [f"async.{k}.{i}" for i in range(20)]
            random.Random(RANK * 7 + k).shuffle(names)
            handles = [(n, h.allreduce_async(ones(), name=n, op=h.Sum)) for n in names]
            for n, handle in handles:
                results[n] = h.synchronize(handle)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=sync_worker, name="sync-worker")]
    threads += [threading.Thread(target=async_worker, args=(k,), name=f"async-worker-{k}")
                for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not errors, errors
    assert len(results) == 60
    for n, out in results.items():
        assert torch.equal(out, torch.full((3,), RANKS_SUM)), n


def test_a_duplicate_of_a_cached_name_raises_value_error(h):
    """Each rank submits its own name first and tries the duplicate while the others have not
    submitted that name yet (an MPI barrier holds them), so the first is surely in flight.
    (In one process nothing holds it: the background thread may finish it first.)"""
    if SIZE == 1:
        pytest.skip("needs another rank to hold the first call in flight")
    t = ones()
    names = [f"dup{r}" for r in range(SIZE)]
    for name in names:  # cached everywhere
        h.allreduce(t, name=name, op=h.Sum)
    mine = names[RANK]
    handles = {mine: h.allreduce_async(t, name=mine, op=h.Sum)}
    with pytest.raises(ValueError, match=rf"'{mine}'.*already in flight on this rank"):
        h.allreduce_async(t, name=mine, op=h.Sum)
    MPI.COMM_WORLD.Barrier()
    handles.update((n, h.allreduce_async(t, name=n, op=h.Sum)) for n in names if n != mine)
    for handle in handles.values():
        assert torch.equal(h.synchronize(handle), torch.full((3,), RANKS_SUM))


def test_a_waiting_thread_in_inference_mode_hands_out_ordinary_tensors(h):
    """The thread that runs a cycle may run another thread's operation: its result is made
    outside inference mode, as on the background thread."""
    submitted, waited = threading.Event(), threading.Event()
    out: list[torch.Tensor] = []

    def other() -> None:
        handle = h.allgather_async(ones(), name="gathered_elsewhere")
        submitted.set()
        waited.wait(30)  # the main thread's cycle takes this operation along
        out.append(h.synchronize(handle))

    worker = threading.Thread(target=other, name="other-thread")
    worker.start()
    assert submitted.wait(30)
    with torch.inference_mode():
        h.allreduce(ones(), name="waited_in_inference", op=h.Sum)
    waited.set()
    worker.join(timeout=60)
    assert out and not out[0].is_inference()
    assert torch.equal(out[0], torch.cat([torch.full((3,), float(r + 1)) for r in range(SIZE)]))
