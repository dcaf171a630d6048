"""Several threads on one communicator: calls run one at a time, and each is matched across
ranks by the calling thread's name. Calls that pair up from different threads raise
ArgumentMismatchError on every rank; no call ever returns another call's data."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mpi_helpers import same_on_all_ranks

import ringcomm

pytestmark = pytest.mark.timeout(120)


def run_threads(*targets: tuple[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each ``(name, fn)`` on a thread of that name; return each one's result or error."""
    outcome: dict[str, Any] = {}

    def wrap(name: str, fn: Callable[[], Any]) -> None:
        try:
            outcome[name] = fn()
        except Exception as err:  # kept for the test to look at
            outcome[name] = err

    threads = [threading.Thread(target=wrap, args=t, name=t[0]) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(100)
        assert not th.is_alive(), f"thread {th.name} still running"
    return outcome


def take_turns(calls: int, call: Callable[[int], Any]) -> dict[str, list[Any]]:
    """Threads "even" and "odd" make calls 0, 1, ..., ``calls - 1`` by turns, each waiting
    for the other's call before its next; returns each thread's results, in its call order."""
    turns = [threading.Event() for _ in range(calls + 1)]
    turns[0].set()

    def player(parity: int) -> list[Any]:
        got = []
        for i in range(parity, calls, 2):
            turns[i].wait(30)
            got.append(call(i))
            turns[i + 1].set()
        return got

    out = run_threads(("even", lambda: player(0)), ("odd", lambda: player(1)))
    for name in ("even", "odd"):
        assert not isinstance(out[name], Exception), out[name]
    return out


def value(comm, tag: int, n: int) -> np.ndarray:
    """A rank- and call-specific input whose sum over ranks identifies the call."""
    return np.full(n, tag * 1000 + comm.rank + 1, dtype=np.int64)


def expected(comm, tag: int, n: int) -> np.ndarray:
    return np.full(n, sum(tag * 1000 + r + 1 for r in range(comm.size)), dtype=np.int64)


def race(comm, tag: int, n_calls: int, refused: type[Exception],
         start: threading.Barrier | None = None) -> list[Any]:
    """``n_calls`` allreduces identified by ``tag`` (after ``start``, if given); each call's
    result, or its error of type ``refused``."""
    if start is not None:
        start.wait(30)
    got: list[Any] = []
    for i in range(n_calls):
        try:
            got.append(comm.allreduce(value(comm, tag, 1 + i % 3)))
        except refused as err:
            got.append(err)
    return got


def usable(comm) -> None:
    assert np.all(comm.allreduce(np.ones(100_000, np.float32)) == comm.size)


@pytest.mark.parametrize("n", [10, 200_000])  # within the agreement, and over the ring
def test_calls_handed_between_threads_work(comm, world, n):
    """The allowed use: the same-named thread makes each call on every rank."""
    first = comm.allreduce(value(comm, 1, n))
    worker = run_threads(("worker", lambda: comm.allreduce(value(comm, 2, n))))["worker"]
    again = comm.allreduce(value(comm, 3, n))
    for tag, got in ((1, first), (2, worker), (3, again)):
        assert not isinstance(got, Exception), got
        np.testing.assert_array_equal(got, expected(comm, tag, n))
    assert same_on_all_ranks(world, worker)


def test_threads_taking_turns_work(comm):
    """Two threads calling concurrently, in an order the program fixes, both get their own
    results (compressed calls included)."""
    def call(i: int) -> Any:
        x = value(comm, i, 5_000).astype(np.float32) / 1000
        return comm.allreduce(x, compression=ringcomm.FP16() if i % 4 else None)

    out = take_turns(40, call)
    for parity, name in ((0, "even"), (1, "odd")):
        for i, got in zip(range(parity, 40, 2), out[name], strict=True):
            want = expected(comm, i, 5_000).astype(np.float32) / 1000
            np.testing.assert_allclose(got, want, rtol=2e-3)


@pytest.mark.parametrize("n", [10, 200_000])
def test_calls_pairing_up_from_different_threads_raise_on_every_rank(comm, world, n):
    """The disallowed use: rank 0 makes A's call first, the others B's. Both calls raise the
    same ArgumentMismatchError on every rank, naming both threads; nothing is mixed."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    a_done = threading.Event()
    b_done = threading.Event()

    def call(tag: int, after: threading.Event | None, done: threading.Event) -> Any:
        if after is not None:
            after.wait(60)
        try:
            return comm.allreduce(value(comm, tag, n))
        finally:
            done.set()

    first_a = comm.rank == 0
    out = run_threads(("A", lambda: call(1, None if first_a else b_done, a_done)),
                      ("B", lambda: call(2, a_done if first_a else None, b_done)))
    for name in ("A", "B"):
        err = out[name]
        assert isinstance(err, ringcomm.ArgumentMismatchError), err
        assert "different threads" in str(err) and "'A'" in str(err) and "'B'" in str(err)
        assert set(err.differences["caller"]) == {"A", "B"}
    messages = world.allgather(sorted(str(out[k]) for k in ("A", "B")))
    assert all(m == messages[0] for m in messages)
    usable(comm)


def test_unordered_threads_never_mix_data(comm, world):
    """Two threads racing, 100 calls each: every call returns its own correct result or
    raises ArgumentMismatchError, as many on every rank; never another call's data."""
    n_calls = 100
    mismatch = ringcomm.ArgumentMismatchError
    out = run_threads(("left", lambda: race(comm, 1, n_calls, mismatch)),
                      ("right", lambda: race(comm, 2, n_calls, mismatch)))
    errors = 0
    for tag, name in ((1, "left"), (2, "right")):
        assert isinstance(out[name], list), out[name]
        for i, got in enumerate(out[name]):
            if isinstance(got, Exception):
                errors += 1
                continue
            np.testing.assert_array_equal(got, expected(comm, tag, 1 + i % 3))
    counts = world.allgather(errors)
    assert len(set(counts)) == 1, f"mismatch errors per rank differ: {counts}"
    usable(comm)


def test_unchecked_calls_are_still_serialized(comm):
    """With the consistency check off, calls from several threads still run one at a time
    (never interleaving their messages); matching them is then the program's task."""
    comm.consistency_check = False
    try:
        out = take_turns(20, lambda i: comm.allreduce(value(comm, i, 50_000)))
    finally:
        comm.consistency_check = True
    for parity, name in ((0, "even"), (1, "odd")):
        for i, got in zip(range(parity, 20, 2), out[name], strict=True):
            np.testing.assert_array_equal(got, expected(comm, i, 50_000))
    usable(comm)


def test_two_live_threads_of_one_name_are_refused(comm, world):
    """Two threads named "worker" racing on one communicator (they used to take each other's
    data: 220 of 600 results wrong). While both live, every call from either is refused on
    every rank, naming the rule; no call returns another call's data; afterwards a thread of
    that name (one at a time) calls again."""
    n_calls = 30
    start = threading.Barrier(2)  # both alive before either calls

    def racer(tag: int) -> None:
        out[tag] = race(comm, tag, n_calls, ringcomm.InvalidArgumentError, start)

    out: dict[int, Any] = {}
    threads = [threading.Thread(target=racer, args=(tag,), name="worker") for tag in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(100)
        assert not th.is_alive()
    errors = 0
    for tag in (1, 2):
        for i, got in enumerate(out[tag]):
            if isinstance(got, Exception):
                assert "another thread of its process bears the same name" in str(got), got
                errors += 1
            else:
                np.testing.assert_array_equal(got, expected(comm, tag, 1 + i % 3))
    assert errors == 2 * n_calls, f"{errors} of {2 * n_calls} calls refused"
    assert same_on_all_ranks(world, errors)
    again = run_threads(("worker", lambda: comm.allreduce(value(comm, 5, 10))))["worker"]
    np.testing.assert_array_equal(again, expected(comm, 5, 10))
    usable(comm)
