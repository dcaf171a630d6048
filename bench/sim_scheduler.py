"""The turn-taking of the simulated ranks: one runs at a time, the earliest in virtual time.

Shared resources (the nodes' NICs) must see messages in virtual-time order whatever order the
threads run in, so the simulated ranks take turns as in a discrete-event simulation: the ready
rank with the smallest clock runs until it posts a message or enters a collective, then hands
the turn on; a rank waiting for a message not posted yet leaves the ready set until its sender
posts it.
"""

from __future__ import annotations

import contextlib
import heapq
import threading

from ringcomm.backends.threads import WorldAbortedError

__all__ = ["Scheduler"]


def _turn_lock() -> threading.Lock:
    """A lock held until the rank's turn comes (a binary semaphore that any thread may
    release, cheaper than threading.Semaphore)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class Scheduler:
    """Lets one rank run at a time: the ready rank with the smallest (clock, rank).

    A running rank keeps the turn while no ready rank's clock is smaller (messages posted at
    equal times may go in either order, as in a real network). Methods ending in ``_locked``
    expect ``lock`` held; ``wait_turn`` and ``hand_over`` must be called without it.
    """

    def __init__(self, n: int, timeout: float) -> None:
        self.clock = [0.0] * n
        self.lock = threading.Lock()
        self.timeout = timeout
        self._sems = [_turn_lock() for _ in range(n)]
        self._ready = [(0.0, r) for r in range(n)]  # every rank starts ready at time 0
        self._holder: int | None = None
        self._aborted: str | None = None

    def _dispatch_locked(self) -> int | None:
        if self._holder is None and self._ready:
            _, r = heapq.heappop(self._ready)
            self._holder = r
            return r
        return None

    def release_locked(self) -> int | None:
        """The running rank gives up the turn (it is ready again only once woken); returns
        the rank that gets it, for ``hand_over`` once the lock is released."""
        self._holder = None
        return self._dispatch_locked()

    def hand_over(self, to: int | None, rank: int | None = None) -> None:
        """Wake rank ``to`` (None: nobody), then wait for ``rank``'s turn (None: don't).

        Waking last, right before blocking, lets the woken thread take the interpreter at
        once instead of contending with a waker that still runs.
        """
        if to is not None:
            self._sems[to].release()
        if rank is not None:
            self.wait_turn(rank)

    def wake_locked(self, rank: int, t: float) -> None:
        """Make blocked ``rank`` ready at ``max(its clock, t)``."""
        self.clock[rank] = max(self.clock[rank], t)
        heapq.heappush(self._ready, (self.clock[rank], rank))

    def wait_turn(self, rank: int) -> None:
        """Block until ``rank`` holds the turn.

        Raises:
            WorldAbortedError: another rank failed.
            TimeoutError: no turn came within the timeout (a deadlock).
        """
        if self._aborted is None and not self._sems[rank].acquire(timeout=self.timeout):
            self.abort(f"rank {rank} waited {self.timeout:g} s for its turn")
            raise TimeoutError(f"simulated rank {rank}: no turn within {self.timeout:g} s")
        if self._aborted is not None:
            raise WorldAbortedError(f"rank {rank}: simulation aborted: {self._aborted}")

    def start(self, rank: int) -> None:
        """Wait for ``rank``'s first turn."""
        with self.lock:
            to = self._dispatch_locked()
        self.hand_over(to, rank)

    def yield_turn(self, rank: int) -> None:
        """Let every ready rank with a smaller clock run first."""
        with self.lock:
            if not self._ready or self._ready[0][0] >= self.clock[rank]:
                return  # no ready rank is earlier: keep the turn
            heapq.heappush(self._ready, (self.clock[rank], rank))
            to = self.release_locked()
        self.hand_over(to, rank)

    def finish(self, rank: int) -> None:
        """``rank`` is done: hand the turn on for good."""
        with self.lock:
            to = self.release_locked()
        self.hand_over(to)

    def abort(self, reason: str) -> None:
        """Wake every waiting rank with WorldAbortedError."""
        with self.lock:
            if self._aborted is None:
                self._aborted = reason
        for sem in self._sems:
            with contextlib.suppress(RuntimeError):  # already released
                sem.release()
