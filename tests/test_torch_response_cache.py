"""The response cache of negotiation cycles, and the turns of the threads that run them.

The cache only changes how requests travel, never what a cycle decides: ranks' requests
decode to exactly what they submitted, random cycles decide the same with and without it,
and ranks whose caches differ all fail alike. Ranks are threads here (ringcomm.backends.threads);
the last test is a 2-rank ``mpiexec`` job whose cached operations stall.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ringcomm.backends.threads import run_ranks  # noqa: E402
from ringcomm.torch._engine import Handle  # noqa: E402
from ringcomm.torch._errors import HorovodInternalError  # noqa: E402
from ringcomm.torch.horovod._control import (  # noqa: E402
    DEFAULT_CACHE_CAPACITY,
    ControlChannel,
    ResponseCache,
    cache_capacity,
)
from ringcomm.torch.horovod._table import PendingTable  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def request(name: str, shape: tuple[int, ...] = (3,), dtype: str = "torch.float32",
            fusable: bool = True) -> tuple[str, str, str, dict[str, Any], bool]:
    meta = {"dtype": dtype, "device": "cpu", "shape": shape, "op": "SUM", "prescale": 1.0,
            "postscale": 1.0, "compression": None}
    return (f"allreduce.{name}", "allreduce", name, meta, fusable)


# ----------------------------------------------------------------------------- the cache
def test_a_kept_request_is_found_only_with_the_same_fields():
    cache = ResponseCache(8)
    assert cache.slot_of(request("w")) == -1
    cache.learn(request("w"))
    slot = cache.slot_of(request("w"))
    assert slot == 0 and cache.request(slot) == request("w")
    assert cache.slot_of(request("w", shape=(4,))) == -1
    assert cache.slot_of(request("w", dtype="torch.float64")) == -1
    assert cache.slot_of(request("w", fusable=False)) == -1
    assert cache.slot_of(request("v")) == -1


def test_a_name_back_with_other_fields_takes_its_slot_over():
    cache = ResponseCache(8)
    cache.learn(request("w"))
    before = cache.generation
    cache.learn(request("w"))  # the same again: nothing changes
    assert cache.generation == before
    cache.learn(request("w", shape=(5,)))
    assert cache.generation != before
    assert cache.slot_of(request("w", shape=(5,))) == 0 and cache.slot_of(request("w")) == -1
    assert len(cache) == 1


def test_the_least_recently_decided_request_gives_its_slot_up():
    cache = ResponseCache(2)
    cache.learn(request("a"))
    cache.learn(request("b"))
    cache.learn(request("a"))  # a is now the more recent
    cache.learn(request("c"))  # evicts b, takes its slot
    assert cache.slot_of(request("b")) == -1
    assert cache.slot_of(request("c")) == 1 and cache.slot_of(request("a")) == 0
    assert len(cache) == 2


def test_automatic_names_and_a_capacity_of_zero_keep_nothing():
    cache = ResponseCache(8)
    cache.learn(("allreduce.noname.3", "allreduce", "allreduce.noname.3", {}, True))
    assert len(cache) == 0
    off = ResponseCache(0)
    off.learn(request("w"))
    assert len(off) == 0 and off.slot_of(request("w")) == -1


def test_an_unknown_slot_raises():
    with pytest.raises(RuntimeError, match="no slot 3"):
        ResponseCache(8).request(3)


def test_capacity_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("HOROVOD_CACHE_CAPACITY", raising=False)
    assert cache_capacity() == DEFAULT_CACHE_CAPACITY
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "0")
    assert cache_capacity() == 0
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", bad)
        with pytest.raises(ValueError, match="HOROVOD_CACHE_CAPACITY must be an integer >= 0"):
            cache_capacity()


# ----------------------------------------------------------------------------- the channel
def test_requests_arrive_as_submitted_cached_whole_and_past_the_header():
    """Every rank decodes every rank's requests exactly, in submission order: cached ones,
    whole ones, and more than the fixed-size header holds."""
    names = [f"p{i}" for i in range(300)]

    def job(t: Any) -> list[Any]:
        cache = ResponseCache(64)
        for n in names[:64]:  # the same on every rank, as cycles would have taught them
            cache.learn(request(n))
        channel = ControlChannel(t, t.size, cache)
        order = names[:]
        random.Random(t.rank).shuffle(order)
        mine = [request(n, shape=(3,) if i % 3 else (t.rank + 1,)) for i, n in enumerate(order)]
        seen = []
        for count in (0, 1, 5, 200, 300):
            got = channel.exchange(mine[:count], stop=count == 5)
            seen.append([(msgs, stop) for msgs, stop, _ in got])
        return [mine, seen]

    results = run_ranks(3, job)
    for rank, (_, seen) in enumerate(results):
        for i, count in enumerate((0, 1, 5, 200, 300)):
            for r, (msgs, stop) in enumerate(seen[i]):
                assert msgs == results[r][0][:count], (rank, r, count)
                assert stop == (count == 5)


def test_caches_that_differ_fail_on_every_rank():
    def job(t: Any) -> str:
        cache = ResponseCache(8)
        if t.rank == 1:
            cache.learn(request("only_here"))
        try:
            ControlChannel(t, t.size, cache).exchange([request("w")], stop=False)
        except RuntimeError as err:
            return str(err)
        return "no error"

    for message in run_ranks(3, job):
        assert "response caches differ between ranks" in message


def test_a_capacity_that_differs_fails_on_every_rank():
    def job(t: Any) -> str:
        try:
            ControlChannel(t, t.size, ResponseCache(8 + t.rank)).exchange([], stop=False)
        except RuntimeError as err:
            return str(err)
        return "no error"

    for message in run_ranks(2, job):
        assert message == ("HOROVOD_CACHE_CAPACITY differs between ranks ([8, 9]); set the "
                           "same value on every rank")


# ----------------------------------------------------------------------------- decisions
def _script(seed: int, size: int, cycles: int) -> list[list[list[Any]]]:
    """Per cycle and rank, the requests submitted: names reused step after step with the
    same fields, sometimes other fields (on every rank or on one), sometimes on some ranks
    only for a while (pending), never twice while pending on a rank."""
    gen = random.Random(seed)
    pool = [f"n{i}" for i in range(12)]
    pending: list[set[str]] = [set() for _ in range(size)]
    script = []
    for _ in range(cycles):
        shapes = {n: (gen.choice([3, 3, 3, 4]),) for n in pool}
        cycle = []
        for r in range(size):
            free = [n for n in pool if n not in pending[r]]
            picked = gen.sample(free, gen.randint(0, min(len(free), 6)))
            reqs = []
            for n in picked:
                shape = shapes[n] if gen.random() > 0.1 else (7 + r,)
                reqs.append(request(n, shape=shape))
            cycle.append(reqs)
        script.append(cycle)
        for r in range(size):
            pending[r].update(req[0][len("allreduce."):] for req in cycle[r])
        # A name every rank has submitted is decided in that cycle: free again.
        done = set.intersection(*pending)
        for p in pending:
            p -= done
    return script


def _decide(t: Any, script: list[list[list[Any]]], capacity: int) -> list[Any]:
    cache = ResponseCache(capacity)
    channel = ControlChannel(t, t.size, cache)
    table = PendingTable(t.size, t.rank, cache, stall_limit=float("inf"),
                         stall_warning=float("inf"))
    decided = []
    for cycle, per_rank in enumerate(script, 1):
        outcomes = table.absorb(channel.exchange(per_rank[t.rank], stop=False), cycle)
        decided.append([(o.entry.name, type(o.error).__name__, str(o.error or ""))
                        for o in outcomes])
        decided.append([[o.entry.name for o in g] for g in table.groups(outcomes, 1 << 20)])
    return decided


@pytest.mark.parametrize("seed", range(6))
def test_random_cycles_decide_the_same_with_and_without_the_cache(seed):
    script = _script(seed, 3, 40)
    plain = run_ranks(3, lambda t: _decide(t, script, 0))
    for capacity in (2, 5, DEFAULT_CACHE_CAPACITY):
        cached = run_ranks(3, lambda t, c=capacity: _decide(t, script, c))
        assert cached == plain, capacity
    assert plain[0] == plain[1] == plain[2]
    errors = [d for cycle in plain[0][::2] for d in cycle if d[1] != "NoneType"]
    assert any("shape differs between ranks" in e[2] for e in errors)  # the script has some


def test_a_cached_request_against_a_whole_one_fails_naming_the_field():
    """One rank's request travels as a cache slot, the other's whole with another shape."""
    def job(t: Any) -> list[Any]:
        cache = ResponseCache(8)
        channel = ControlChannel(t, t.size, cache)
        table = PendingTable(t.size, t.rank, cache, stall_limit=float("inf"),
                             stall_warning=float("inf"))
        first = table.absorb(channel.exchange([request("w")], stop=False), 1)
        assert first[0].error is None and cache.slot_of(request("w")) == 0
        mine = request("w", shape=(3,) if t.rank == 0 else (4,))
        return table.absorb(channel.exchange([mine], stop=False), 2)

    for outcomes in run_ranks(2, job):
        assert isinstance(outcomes[0].error, HorovodInternalError)
        assert str(outcomes[0].error) == ("allreduce 'w': shape differs between ranks: (3,) "
                                          "on rank 0; (4,) on rank 1")


# ----------------------------------------------------------------------------- handles
def test_a_handle_waits_through_on_wait_then_its_event():
    h = Handle()
    calls = []
    h.on_wait = lambda handle: (calls.append(handle), handle.finish(5, None))
    assert h.wait() == 5 and calls == [h]
    assert h.wait() == 5 and calls == [h]  # done: on_wait is not asked again

    late = Handle()
    late.on_wait = lambda handle: None  # cannot help: the event wait follows
    threading.Timer(0.05, lambda: late.finish(None, ValueError("boom"))).start()
    with pytest.raises(ValueError, match="boom"):
        late.wait()
    assert late.done()


# ----------------------------------------------------------------------------- turns
@pytest.fixture()
def coordinator():
    """A coordinator of its own over a one-rank communicator (closed afterwards)."""
    import ringcomm
    from ringcomm.torch.horovod import _negotiate

    comm = ringcomm.init("mpi", abort_on_exception=False)
    coord = _negotiate._make(comm)
    yield coord
    coord.close()


def _op(name: str, run: Any) -> Any:
    from ringcomm.torch.horovod._ops import Op

    return Op("object", name, {}, run)


def test_a_waiting_thread_runs_the_cycle_itself(coordinator):
    threads = []
    handle = coordinator.submit(
        _op("here", lambda comm: threads.append(threading.current_thread())), waited=True)
    handle.wait()
    assert threads == [threading.current_thread()]


def test_a_cycle_takes_a_synchronous_operation_before_its_thread_waits(coordinator):
    """A cycle (here this thread's turn, as the background thread's would be while other
    ranks' operations are pending) that finds a synchronous operation whose thread does not
    wait for it yet takes it at once: such an operation sets no burst time, and a cycle that
    waited for one raised OverflowError on the thread running cycles."""
    handle = coordinator.submit(_op("sync", lambda comm: 7), waited=True)
    with coordinator._lock:
        coordinator._turn(threading.current_thread())
    assert handle.done() and handle.wait() == 7


def test_a_wait_takes_the_waiting_threads_operations_and_no_others(coordinator):
    """A synchronous call takes its thread's new operations into the next cycle at once (one
    cycle for a burst and the wait that follows it), and leaves another thread's for their
    burst's time: taken at once, they could complete before that thread's next line, and a
    second submission of the name there went through on some ranks only."""
    coordinator._cycle_time = 60.0  # no burst falls due during the test
    theirs: list[Any] = []
    worker = threading.Thread(target=lambda: theirs.append(
        coordinator.submit(_op("theirs", lambda comm: 1))), name="another")
    worker.start()
    worker.join()
    early = coordinator.submit(_op("mine-async", lambda comm: 2))
    mine = coordinator.submit(_op("mine", lambda comm: 3), waited=True)
    with coordinator._lock:
        coordinator._turn(threading.current_thread())
    assert mine.wait() == 3 and early.done() and early.wait() == 2
    assert not theirs[0].done()
    assert [m.request[2] for m in coordinator._new] == ["theirs"]
    assert theirs[0].wait() == 1  # waited for: taken at once


def test_operations_nobody_waits_for_run_on_the_background_thread(coordinator):
    ran = threading.Event()
    threads = []

    def run(comm: Any) -> None:
        threads.append(threading.current_thread().name)
        ran.set()

    handle = coordinator.submit(_op("elsewhere", run))
    assert ran.wait(30)  # nobody waited: the background thread ran it, after a cycle time
    handle.wait()
    assert threads == ["ringcomm-coordinator"]


def test_an_interrupted_cycle_fails_what_follows(coordinator):
    """A cycle cut short on a waiting thread (Ctrl-C) leaves this rank's table unlike the
    others': every later operation fails instead of matching wrongly."""
    control = coordinator._channel._control

    def interrupted(send: Any, recv: Any) -> None:
        raise KeyboardInterrupt

    control.allgather_fixed = interrupted
    first = coordinator.submit(_op("cut", lambda comm: 1), waited=True)
    with pytest.raises(KeyboardInterrupt):
        first.wait()
    with pytest.raises(RuntimeError, match="negotiation was interrupted"):
        first.wait()
    with pytest.raises(RuntimeError, match="negotiation was interrupted"):
        coordinator.submit(_op("later", lambda comm: 2))


def test_an_interruption_between_groups_fails_what_did_not_run(coordinator, monkeypatch):
    from ringcomm.torch.horovod import _negotiate

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_negotiate, "run_group", interrupted)
    # Ctrl-C reaches the waiting thread: the background thread must not run the cycle first
    # (due one cycle time after "queued", which a loaded machine can let pass before the wait).
    monkeypatch.setattr(coordinator, "_cycle_time", 3600.0)
    other = coordinator.submit(_op("queued", lambda comm: 1))
    mine = coordinator.submit(_op("waited", lambda comm: 2), waited=True)
    with pytest.raises(KeyboardInterrupt):
        mine.wait()
    for handle in (other, mine):
        with pytest.raises(RuntimeError, match="negotiation was interrupted"):
            handle.wait()


# ----------------------------------------------------------------------------- a stall
JOB = r"""
import json, sys, time
import torch
import ringcomm.torch as hvd

hvd.init()
rank = hvd.rank()
for step in range(3):  # both names cached on both ranks
    hvd.allreduce(torch.ones(3), name="a")
    hvd.allreduce(torch.ones(3), name="b")
start = time.monotonic()
try:
    hvd.allreduce(torch.ones(3), name="a" if rank == 0 else "b")
    out = dict(ok=True)
except Exception as err:
    out = dict(ok=False, type=type(err).__name__, message=str(err))
out.update(rank=rank, elapsed=time.monotonic() - start)
after = hvd.allreduce(torch.ones(3), name="after", op=hvd.Sum)
out["after"] = after.tolist()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(out, f)
"""


def test_cached_operations_that_cross_stall_and_fail_on_both_ranks(mpiexec, subprocess_env,
                                                                   tmp_path):
    stall = 3.0
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(subprocess_env, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=str(stall))
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"job did not end: {proc.communicate()[0]}")
    seen = {r: json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)}
    for r, d in seen.items():
        assert not d["ok"] and d["type"] == "StalledOperationError", out
        name = "a" if r == 0 else "b"
        assert f"'{name}' was submitted by rank {r} but not by rank {1 - r}" in d["message"]
        # The stall is timed from the start of the cycle that first carried the operation,
        # which may begin a moment before a rank submits it (2.998 s seen for a 3 s stall).
        assert stall - 0.5 <= d["elapsed"] < stall + 10
        assert d["after"] == [2.0, 2.0, 2.0]


def test_a_handle_done_before_anyone_waits_makes_no_event():
    """A handle finished before anyone waits never makes an event."""
    h = Handle()
    h.finish(1, None)
    start = time.monotonic()
    assert h.wait() == 1 and h._event is None
    assert time.monotonic() - start < 1.0
