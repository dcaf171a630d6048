"""The cost model of ``compression="auto"`` (:mod:`ringcomm.algorithms.auto`), and the
measuring of its figures over a transport.

The model (all times per allreduce of S bytes of float32 over n ranks in a ring):

    wire(c, S)    bytes one ring step moves: S/n dense, S/(n * ratio_c) compressed, and for
                  top-k the 8-byte pairs of its chunk's share of k
    T(c, S)     = 2(n-1) * (latency + wire(c, S) / bandwidth)      link time
                + 2(n-1) * (S/n) / throughput_c                     compute: one chunk per step
    T(none, S)  = ceil(log2 n) * latency + (n-1) * S / bandwidth   dense S <= inline_bytes
                                                                   (4 KiB), which rides in one
                                                                   allgather

``latency`` and ``bandwidth`` come from timing one ring step (every rank sends to its right
neighbour while receiving from its left, as the ring does) at 8 B and 4 MiB; ``throughput_c``
from timing candidate c's per-hop work (add, or decode + add + encode) on 1 MiB. Each figure is
the slowest rank's median, so every rank holds the same model and makes the same choice. The
figures are measured once per communicator, on the first call that needs them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.codecs.base import Compressor
from ringcomm.core.types import DEFAULT_INLINE_BYTES as INLINE_BYTES
from ringcomm.core.types import Array, ReduceOp, Transport

__all__ = ["LinkModel", "candidate_key", "measure_link", "measure_throughput", "predict",
           "wire_bytes"]

_PROBE_SMALL, _PROBE_LARGE = 8, 4 << 20
_WORK_ELEMS = 1 << 18


def candidate_key(comp: Compressor | None) -> str:
    """A candidate's name in the figures: its repr, "none" for None (no compression)."""
    return "none" if comp is None else repr(comp)


@dataclass(frozen=True)
class LinkModel:
    """One ring step's cost: ``latency`` seconds plus bytes / ``bandwidth`` (bytes/s)."""

    latency: float
    bandwidth: float

    def step(self, nbytes: float) -> float:
        """Seconds for one ring step moving ``nbytes``."""
        return self.latency + nbytes / self.bandwidth


def wire_bytes(comp: Compressor | None, nbytes: int, n: int) -> float:
    """Bytes one ring step moves for an allreduce of ``nbytes`` of float32 under ``comp``."""
    if comp is None:
        return nbytes / n
    return comp.wire_bytes(nbytes // 4, n)


def predict(comp: Compressor | None, nbytes: int, n: int, link: LinkModel,
            throughput: float, inline_bytes: int = INLINE_BYTES,
            dense_nbytes: int | None = None) -> float:
    """Modelled seconds of one allreduce of ``nbytes`` of float32 (see the module docstring);
    ``dense_nbytes`` is the array's own size, which decides whether dense rides inline."""
    if n == 1:
        return 0.0
    if comp is None and (nbytes if dense_nbytes is None else dense_nbytes) <= inline_bytes:
        # Small dense arrays ride in the agreement exchange: one allgather (recursive doubling).
        return math.ceil(math.log2(n)) * link.latency + (n - 1) * nbytes / link.bandwidth
    steps = 2 * (n - 1)
    return steps * link.step(wire_bytes(comp, nbytes, n)) + steps * (nbytes / n) / throughput


def _slowest_median(t: Transport, samples: list[float]) -> float:
    """The largest over ranks of this rank's median (the same on every rank)."""
    return max(t.allgather_object(float(np.median(samples))))


def measure_link(t: Transport, like: Array, reps: int = 5) -> LinkModel:
    """Time one ring step at 8 B and 4 MiB of ``like``'s array kind; fit latency and
    bandwidth (collective)."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    xp, sync = _ops.get(like), _synchronizer(like)
    times = {}
    for size in (_PROBE_SMALL, _PROBE_LARGE):
        send, recv = xp.zeros((size,), np.uint8), xp.empty((size,), np.uint8)
        t.isendrecv(send, right, recv, left).wait()  # warm-up: connections, registration
        sync()
        samples = []
        for _ in range(reps):
            t.barrier()
            start = time.perf_counter()
            t.isendrecv(send, right, recv, left).wait()
            sync()
            samples.append(time.perf_counter() - start)
        times[size] = _slowest_median(t, samples)
    latency = times[_PROBE_SMALL]
    bandwidth = (_PROBE_LARGE - _PROBE_SMALL) / max(times[_PROBE_LARGE] - latency, 1e-9)
    return LinkModel(latency, bandwidth)


def _hop_work(comp: Compressor | None, x: Array, own: Array) -> Callable[[], Any]:
    """One hop of ``comp`` (None: the dense ring's addition), for timing."""
    if comp is not None:
        return comp.hop_work(x, own)
    xp = _ops.get(x)
    out = xp.empty(x.shape, x.dtype)
    return lambda: xp.reduce(ReduceOp.SUM, x, own, out)


def _synchronizer(like: Array) -> Any:
    if _ops.is_device_array(like):
        import cupy

        return cupy.cuda.get_current_stream().synchronize
    return lambda: None


def measure_throughput(t: Transport, candidates: list[Compressor | None], like: Array,
                       reps: int = 5) -> dict[str, float]:
    """Bytes/s of each candidate's per-hop work on 1 MiB of float32 on ``like``'s device
    (collective)."""
    rng = np.random.default_rng(t.rank)
    xp = _ops.get(like)
    x, own = (xp.empty((_WORK_ELEMS,), np.float32) for _ in range(2))
    xp.copy_from_host(x, rng.standard_normal(_WORK_ELEMS).astype(np.float32))
    xp.copy_from_host(own, rng.standard_normal(_WORK_ELEMS).astype(np.float32))
    sync = _synchronizer(like)
    result = {}
    for comp in candidates:
        work = _hop_work(comp, x, own)
        work()
        samples = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            work()
            sync()
            samples.append(time.perf_counter() - start)
        result[candidate_key(comp)] = x.nbytes / _slowest_median(t, samples)
    return result
