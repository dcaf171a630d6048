"""Exchanges over torch.distributed's key-value store bounded by ringcomm's timeout
(ringcomm/backends/store_wait.py), with ranks as threads over one real store."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from ringcomm.backends.store_wait import allgather, wait_for
from ringcomm.core.types import CollectiveTimeoutError

dist = pytest.importorskip("torch.distributed")


def _store() -> object:
    """A store whose own timeout (an hour) is far above the ones the tests give."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(hours=1))
    return store


def _run_ranks(size: int, ranks: list[int], body) -> dict[int, object]:
    """``body(rank)`` on a thread per rank of ``ranks``; each one's result or exception."""
    out: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except Exception as err:  # the test looks at it
            out[rank] = err
    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_allgather_gives_every_value_in_rank_order_on_every_rank():
    store = _store()
    out = _run_ranks(3, [0, 1, 2], lambda r: allgather(store, "x/", r, 3, f"v{r}".encode(), 20))
    assert out == {r: [b"v0", b"v1", b"v2"] for r in range(3)}
    # A second exchange under another tag does not see the first's values.
    out = _run_ranks(3, [2, 0, 1], lambda r: allgather(store, "y/", r, 3, bytes([r]), 20))
    assert out == {r: [b"\0", b"\1", b"\2"] for r in range(3)}


def test_a_rank_that_never_comes_is_named_at_ringcomms_timeout():
    store = _store()
    start = time.monotonic()
    out = _run_ranks(3, [0, 2], lambda r: allgather(store, "x/", r, 3, b"v", 1.0, "a test"))
    assert time.monotonic() - start < 30  # the store's own timeout is an hour
    for rank in (0, 2):
        err = out[rank]
        assert isinstance(err, CollectiveTimeoutError), err
        assert err.peer == 1
        assert str(err).startswith(f"ringcomm's start-up timed out on rank {rank} of 3 after ")
        assert "waiting for rank 1 in a test over torch.distributed's store" in str(err)


def test_wait_for_names_the_peer_of_a_key_without_a_rank():
    with pytest.raises(CollectiveTimeoutError, match="waiting for rank 4 in its broadcast") as info:
        wait_for(_store(), ["bc0"], 1, 5, 0.2, "its broadcast", peer=4)
    assert info.value.peer == 4
    with pytest.raises(CollectiveTimeoutError, match="waiting for the other ranks in x"):
        wait_for(_store(), ["end"], 1, 5, 0.2, "x")
