"""Timing side by side: every variant and baseline of one size timed in turn within each
iteration (the slowest rank's time), quartiles of the samples, and phase spans."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["PhaseTimes", "memcpy_fn", "phase_ms", "quartiles", "sync_for", "time_variants"]


def sync_for(x: Any) -> Callable[[], None]:
    """What waits for ``x``'s device work (CuPy's current stream), or a no-op for host arrays."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().synchronize
    return lambda: None


def warm_up_job(world: Any, comm: Any, baselines: dict[str, Callable[[], Any]],
                rounds: int) -> None:
    """``rounds`` untimed 8-byte allreduces of ``comm`` and of each baseline, each after a
    barrier, before anything is timed: the first few hundred calls of a job run slower (4
    ranks on 2 cores: 127 us a call in the first 300, 62 in the next 1500, at every size), and
    the first size timed would carry it (bench/results/sized_exchange.md)."""
    x = np.zeros(2, np.float32)
    for _ in range(rounds):
        world.Barrier()
        comm.allreduce(x)
        for fn in baselines.values():
            world.Barrier()
            fn()


def time_variants(world: Any, fns: dict[str, Callable[[], Any]], iters: int, warmup: int,
                  sync: Callable[[], None],
                  before: dict[str, Callable[[], Any]] | None = None) -> dict[str, np.ndarray]:
    """Each iteration's slowest-rank time of every variant, each variant timed in turn.

    The order rotates every iteration, so each variant follows each other one equally often
    (what ran just before, e.g. a memcpy that evicted the caches, changes the next timing).
    ``before[name]``, where given, runs untimed before each call of ``fns[name]`` (an in-place
    call's input restored, so that repeated sums do not grow without bound).
    """
    before = before or {}
    for _ in range(warmup):
        for name, f in fns.items():
            if name in before:
                before[name]()
            f()
        sync()
    names = list(fns)
    times = np.zeros((len(fns), iters))
    for i in range(iters):
        for j in range(len(names)):
            k = (i + j) % len(names)
            f, ready = fns[names[k]], before.get(names[k])
            if ready is not None:
                ready()
                sync()
            world.Barrier()
            t0 = time.perf_counter()
            f()
            sync()
            times[k, i] = time.perf_counter() - t0
    from mpi4py import MPI

    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: times[k] for k, name in enumerate(fns)}


def quartiles(values: np.ndarray) -> tuple[float, float, float]:
    """The first quartile, median and third quartile of ``values``."""
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return float(q1), float(q2), float(q3)


class PhaseTimes:
    """A tracer (``ringcomm.core.trace``) adding up the seconds each span label takes; nested
    spans count in their own label and in the enclosing one's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: dict[str, list[float]] = {}

    def begin(self, label: str) -> None:
        self._open.setdefault(label, []).append(time.perf_counter())

    def end(self, label: str) -> None:
        start = self._open[label].pop()
        self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start


def phase_ms(world: Any, fn: Callable[[], Any], calls: int,
             sync: Callable[[], None]) -> dict[str, float]:
    """Milliseconds per call of every span ``fn`` runs, the slowest rank's (collective)."""
    from ringcomm.core import trace

    tracer = PhaseTimes()
    trace.set_tracer(tracer)
    try:
        for _ in range(calls):
            world.Barrier()
            fn()
            sync()
    finally:
        trace.set_tracer(None)
    everyone = world.allgather(tracer.seconds)
    labels = sorted({label for mine in everyone for label in mine})
    return {label: 1e3 * max(m.get(label, 0.0) for m in everyone) / calls for label in labels}


def memcpy_fn(nbytes: int, rank: int) -> Callable[[], Any]:
    """A single-process copy of ``nbytes`` (NumPy, host memory) on rank 0; a no-op elsewhere.

    Timed in turn with the collectives, so it sees the same machine state.
    """
    if rank != 0:
        return lambda: None
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return lambda: np.copyto(dst, src)
