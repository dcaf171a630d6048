"""A Transport with a simulated clock: ringcomm's real algorithms on a virtual cluster.

The ranks are threads of one process (:mod:`ringcomm.backends.threads` carries the real bytes, so
results are exactly those of the plain thread backend); on top of that every rank keeps a
virtual clock, advanced by the cost model of :mod:`sim_model`:

- a message posted at the sender's time ``t`` arrives when its link says (latency, bytes times
  ``scale`` over bandwidth, queueing on the sender's port or on the nodes' shared NICs); a
  receive completes at ``max(own clock, arrival)``, and a request also waits until its send
  has left;
- every array operation the algorithms call through ``ringcomm.ops.get`` (reduce, int8 hop,
  top-k select, ...) advances the calling rank's clock by the cost model's time for it;
- the few collectives (barrier, allgather, broadcast, split) end for every member at the
  latest arrival plus a formula's time (:func:`sim_model.collective_seconds`).

Shared resources (the NICs) must see messages in virtual-time order, whatever order the
threads run in. So the ranks run one at a time, as a discrete-event simulation
(:mod:`sim_scheduler`): before every post and collective a rank hands the turn to the ready
rank with the smallest clock (at equal clocks it goes on), and a rank waiting for a message
that was not posted yet leaves the ready set until its sender posts it. Posts therefore
happen in nondecreasing virtual time, and a run is deterministic.

``split`` gives simulated sub-transports: sub-rank ``r`` is global rank ``members[r]``, whose
clock and links it uses, so a hierarchical algorithm's local and cross-node messages cross the
right links.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from sim_model import CostModel, LinkModel, NetworkState, collective_seconds
from sim_scheduler import Scheduler

import ringcomm.ops
from ringcomm.backends.threads import ThreadTransport, run_ranks
from ringcomm.comm.transport import TransportBase
from ringcomm.core.types import RING

__all__ = ["SimResult", "SimTransport", "SimWorld", "charged_ops", "run_sim"]

_CURRENT = threading.local()  # .sim, .g: the simulated rank this thread is


class SimWorld:
    """What the simulated ranks share: clocks, links, cost model, message arrival times."""

    def __init__(self, n: int, links: LinkModel, cost: CostModel, timeout: float) -> None:
        self.n, self.links, self.cost = n, links, cost
        self.sched = Scheduler(n, timeout)
        self.net = NetworkState(links)
        self.compute = [0.0] * n  # virtual seconds of array operations, per rank
        self._arrivals: dict[tuple[Any, ...], float] = {}
        self._waiters: dict[tuple[Any, ...], int] = {}
        self._meetings: dict[tuple[Any, ...], list[tuple[float, int]]] = {}
        self._proxies: dict[int, _ChargedOps] = {}

    def deliver_locked(self, key: tuple[Any, ...], arrival: float) -> None:
        """Record that message ``key`` arrives at ``arrival``; wake its receiver if waiting."""
        g = self._waiters.pop(key, None)
        if g is None:
            self._arrivals[key] = arrival
        else:
            self.sched.wake_locked(g, arrival)

    def await_message(self, g: int, key: tuple[Any, ...]) -> None:
        """Advance rank ``g``'s clock to the arrival of message ``key``, waiting (off the
        ready set) until its sender has posted it."""
        sched = self.sched
        with sched.lock:
            arrival = self._arrivals.pop(key, None)
            if arrival is not None:
                sched.clock[g] = max(sched.clock[g], arrival)
                return
            self._waiters[key] = g
            to = sched.release_locked()
        sched.hand_over(to, g)

    def meet_locked(self, key: tuple[Any, ...], members: list[int], g: int, nbytes: int,
                    cost: Callable[[int], float]) -> None:
        """Record ``g``'s arrival at collective ``key``; the last arrival makes every member
        ready at the latest arrival plus ``cost(largest part)``."""
        entry = self._meetings.setdefault(key, [])
        entry.append((self.sched.clock[g], nbytes))
        if len(entry) == len(members):
            del self._meetings[key]
            end = max(c for c, _ in entry) + cost(max(b for _, b in entry))
            for m in members:
                self.sched.wake_locked(m, end)

    def charge(self, g: int, seconds: float) -> None:
        """Add ``seconds`` of computing to rank ``g``'s clock (it holds the turn)."""
        self.sched.clock[g] += seconds
        self.compute[g] += seconds

    def proxy(self, module: ModuleType) -> _ChargedOps:
        """``module`` with its charged operations wrapped."""
        p = self._proxies.get(id(module))
        if p is None:
            p = self._proxies[id(module)] = _ChargedOps(module, self)
        return p


class _ChargedOps:
    """An operations module whose costed calls advance the calling rank's clock first."""

    def __init__(self, module: ModuleType, sim: SimWorld) -> None:
        self._module, self._sim = module, sim
        self.__name__ = module.__name__

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if callable(attr) and self._sim.cost.charges(name):
            attr = self._wrap(name, attr)
        setattr(self, name, attr)  # looked up once
        return attr

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sim, cost = self._sim, self._sim.cost

        def charged(*args: Any, **kwargs: Any) -> Any:
            g = getattr(_CURRENT, "g", None)
            if g is not None and getattr(_CURRENT, "sim", None) is sim:
                sim.charge(g, cost.seconds(name, args, kwargs))
            return fn(*args, **kwargs)

        return charged


@contextlib.contextmanager
def charged_ops() -> Iterator[None]:
    """Within the block, ``ringcomm.ops.get`` called from a simulated rank returns the
    operations wrapped to charge their cost to that rank's clock; other threads get the real
    ones."""
    real = ringcomm.ops.get

    def get(x: Any) -> Any:
        module = real(x)
        sim = getattr(_CURRENT, "sim", None)
        return module if sim is None else sim.proxy(module)

    ringcomm.ops.get = get
    try:
        yield
    finally:
        ringcomm.ops.get = real


class _SimRequest:
    """A posted exchange: its receive completes at the message's arrival, its send once
    sent."""

    __slots__ = ("_inner", "_key", "_sent", "_t")

    def __init__(self, t: SimTransport, inner: Any, key: tuple[Any, ...] | None,
                 sent: float) -> None:
        self._t, self._inner, self._key, self._sent = t, inner, key, sent

    def wait(self) -> None:
        """Advance the clock past the send and the receive, then take the bytes."""
        if self._inner is None:
            return
        t, inner, self._inner = self._t, self._inner, None
        if self._key is not None:
            t.sim.await_message(t.g, self._key)
        clock = t.sim.sched.clock
        clock[t.g] = max(clock[t.g], self._sent)
        inner.wait()


class SimTransport(TransportBase):
    """One rank of a simulated world: a ThreadTransport's messages with virtual time.

    Args:
        sim: the simulated world.
        inner: the thread transport that carries the bytes.
        members: the global rank of every rank of ``inner``'s group.
    """

    backend = "sim"

    def __init__(self, sim: SimWorld, inner: ThreadTransport, members: list[int]) -> None:
        g = members[inner.rank]
        node = sim.links.node(g)
        local = [m for m in members if sim.links.node(m) == node]
        super().__init__(inner.rank, inner.size, local_rank=local.index(g),
                         local_size=len(local))
        self.sim, self.inner, self.members, self.g = sim, inner, list(members), g
        self._sent: dict[tuple[int, int], int] = defaultdict(int)
        self._received: dict[tuple[int, int], int] = defaultdict(int)
        self._collectives = 0

    def now(self) -> float:
        """This rank's virtual clock, in seconds."""
        return self.sim.sched.clock[self.g]

    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int, *,
                  channel: int = RING) -> _SimRequest:
        """Post a send and a receive as ThreadTransport does, timed by the link model."""
        self.inner.check_arrays(send, recv)
        sim = self.sim
        sim.sched.yield_turn(self.g)  # posts happen in virtual-time order
        inner = self.inner.isendrecv(send, dest, recv, source, channel=channel)
        sent = self.now()
        world = self.inner.world
        if send is not None:
            seq = self._sent[channel, dest]
            self._sent[channel, dest] = seq + 1
            with sim.sched.lock:
                sent, arrival = sim.net.transmit(self.g, self.members[dest], send.nbytes,
                                                 self.now())
                sim.deliver_locked((id(world), channel, self.rank, dest, seq), arrival)
        key = None
        if recv is not None:
            seq = self._received[channel, source]
            self._received[channel, source] = seq + 1
            key = (id(world), channel, source, self.rank, seq)
        return _SimRequest(self, inner, key, sent)

    def _collective(self, what: str, nbytes: int, call: Callable[[], Any], *,
                    scaled: bool = True) -> Any:
        """Run the thread transport's collective ``call``; every member's clock ends at the
        latest arrival plus the formula's time for ``what``."""
        sim, g = self.sim, self.g
        sim.sched.yield_turn(g)
        key = (id(self.inner.world), self._collectives)
        self._collectives += 1
        links, members = sim.links, self.members

        def cost(largest: int) -> float:
            return collective_seconds(links, members, what, largest, scaled)

        with sim.sched.lock:
            sim.meet_locked(key, members, g, nbytes, cost)
            to = sim.sched.release_locked()
        sim.sched.hand_over(to)  # the others must run to arrive
        try:
            result = call()
        finally:
            sim.sched.wait_turn(g)
        return result

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Allgather equal-sized byte buffers (timed as a ring allgather)."""
        self._collective("allgather", send.nbytes,
                         lambda: self.inner.allgather_fixed(send, recv))

    def allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        """Gather every rank's ``x`` into ``out`` (timed as a ring allgather)."""
        self._collective("allgather", x.nbytes,
                         lambda: self.inner.allgatherv(x, counts, out))

    def broadcast(self, x: Any, root: int) -> None:
        """Overwrite ``x`` with root's (timed as a binomial tree)."""
        self._collective("broadcast", x.nbytes, lambda: self.inner.broadcast(x, root))

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank (its pickled bytes are not scaled)."""
        return self._collective("allgather", len(pickle.dumps(obj)),
                                lambda: self.inner.allgather_object(obj), scaled=False)

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""
        self._collective("barrier", 0, self.inner.barrier)

    def split(self, color: int, key: int) -> SimTransport:
        """A simulated transport over the ranks with the same ``color``, ordered by
        (key, rank); its ranks keep their global clocks and links (collective)."""
        sub = self._collective("barrier", 0, lambda: self.inner.split(color, key))
        everyone = self.allgather_object((int(color), int(key)))
        order = sorted((k, r) for r, (c, k) in enumerate(everyone) if c == color)
        members = [self.members[r] for _, r in order]
        if members[sub.rank] != self.g:
            raise RuntimeError(f"split: sub-rank {sub.rank} is global rank "
                               f"{members[sub.rank]}, expected {self.g}")
        return SimTransport(self.sim, sub, members)

    def check_arrays(self, *arrays: Any) -> None:
        """NumPy arrays only, as the thread transport."""
        self.inner.check_arrays(*arrays)

    def close(self) -> None:
        """Drop the scratch buffers."""
        self.release_scratch()
        self.inner.close()


@dataclass
class SimResult:
    """What a simulated run returns.

    Attributes:
        results: every rank's return value, in rank order.
        clocks: every rank's virtual clock at its end (seconds).
        compute: every rank's virtual seconds of array operations.
    """

    results: list[Any]
    clocks: list[float]
    compute: list[float]

    @property
    def time(self) -> float:
        """The simulated time of the whole run: the last rank's end."""
        return max(self.clocks)


def run_sim(n: int, fn: Callable[[SimTransport], Any], links: LinkModel,
            cost: CostModel | None = None, *, timeout: float = 600.0) -> SimResult:
    """Run ``fn(transport)`` on ``n`` simulated ranks, all starting at virtual time 0.

    Args:
        n: the number of ranks.
        fn: what every rank runs, given its SimTransport.
        links: the cluster's links.
        cost: the array operations' costs (None: computing is free).
        timeout: real seconds any wait may last.

    Raises:
        Exception: the first exception of any rank (as ``run_ranks``).
    """
    sim = SimWorld(n, links, cost or CostModel.free(), timeout)

    def main(inner: ThreadTransport) -> Any:
        _CURRENT.sim, _CURRENT.g = sim, inner.rank
        try:
            sim.sched.start(inner.rank)
            result = fn(SimTransport(sim, inner, list(range(n))))
            sim.sched.finish(inner.rank)
            return result
        except BaseException as exc:
            sim.sched.abort(f"rank {inner.rank} raised {type(exc).__name__}: {exc}")
            raise
        finally:
            _CURRENT.sim = _CURRENT.g = None

    with charged_ops():
        results = run_ranks(n, main, timeout=timeout)
    return SimResult(results, list(sim.sched.clock), list(sim.compute))
