"""``compression="auto"``: pick, per message size, the fastest compression the user allowed.

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

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm.log import get_logger
from ringcomm.comm.types import DEFAULT_INLINE_BYTES as INLINE_BYTES
from ringcomm.comm.types import ReduceOp, Transport, check_dtype
from ringcomm.compress.algorithms import ALGORITHMS
from ringcomm.compress.base import Compressor, Wire, check_compressed_call
from ringcomm.compress.cast import FP16
from ringcomm.compress.int8 import Int8

__all__ = ["Auto", "AutoFigures", "LinkModel", "measure_link", "measure_throughput"]

_LOG = get_logger("auto")
_PROBE_SMALL, _PROBE_LARGE = 8, 4 << 20
_WORK_ELEMS = 1 << 18


@dataclass(frozen=True)
class LinkModel:
    """One ring step's cost: ``latency`` seconds plus bytes / ``bandwidth`` (bytes/s)."""

    latency: float
    bandwidth: float

    def step(self, nbytes: float) -> float:
        """Seconds for one ring step moving ``nbytes``."""
        return self.latency + nbytes / self.bandwidth


@dataclass
class AutoFigures:
    """What "auto" has measured on one communicator, per array kind ("host", "device").

    Attributes:
        links: the ring step's latency and bandwidth.
        throughput: bytes/s of each candidate's hop (keyed by ``Auto.key``).
        choices: the choice made per (Auto, array kind, length), with the Auto kept alive.
    """

    links: dict[str, LinkModel] = field(default_factory=dict)
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    choices: dict[tuple[int, str, int, int], tuple[Auto, Compressor | None]] = field(
        default_factory=dict)


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


class Auto(Compressor):
    """Let ringcomm choose, per call, the fastest of ``candidates`` for the message's size.

    Args:
        candidates: what the user allows; None stands for no compression. The default allows
            no compression, FP16 and Int8 (errors of at most about 1% per step, made up by
            error feedback); add ``TopK(...)`` to allow sparsification.
        link: fixed link figures (for tests or a known network) instead of measuring.
        throughput: fixed per-candidate throughputs (bytes/s, keyed by ``repr`` of the
            candidate, "none" for None) instead of measuring.

    Every rank must pass an equal Auto; the choice is the same on every rank.
    """

    wire = Wire.SUMMABLE  # never used as such: Auto resolves to one of its candidates

    def __init__(self, candidates: tuple[Compressor | None, ...] = (None, FP16(), Int8()), *,
                 link: LinkModel | None = None,
                 throughput: dict[str, float] | None = None) -> None:
        if not candidates:
            raise ValueError("Auto needs at least one candidate")
        for c in candidates:
            if c is not None and (not isinstance(c, Compressor) or isinstance(c, Auto)):
                raise TypeError(f"Auto candidates are compressors or None, got {c!r}")
        for c in candidates:
            if c is not None and c.allreduce_algorithm not in ALGORITHMS:
                raise ValueError(f"candidate {c!r} names allreduce algorithm "
                                 f"{c.allreduce_algorithm!r}; known: {', '.join(ALGORITHMS)}")
        self.candidates = tuple(candidates)
        self.link = link
        self.throughput = dict(throughput) if throughput else None
        if self.throughput is not None:
            missing = [self.key(c) for c in self.candidates if self.key(c) not in self.throughput]
            if missing:
                raise ValueError(f"throughput has no figure for candidates {missing}; "
                                 f"expected keys {[self.key(c) for c in self.candidates]}")

    @staticmethod
    def key(comp: Compressor | None) -> str:
        return "none" if comp is None else repr(comp)

    def choose(self, nbytes: int, n: int, inline_bytes: int = INLINE_BYTES,
               dense_nbytes: int | None = None) -> Compressor | None:
        """The candidate with the smallest modelled time for ``nbytes`` over ``n`` ranks.

        Raises:
            RuntimeError: the link or throughput figures are not known yet (``resolve``
                measures them).
        """
        if self.link is None or self.throughput is None:
            raise RuntimeError("Auto has no link/throughput figures yet; call resolve()")
        times = [predict(c, nbytes, n, self.link, self.throughput[self.key(c)], inline_bytes,
                         dense_nbytes) for c in self.candidates]
        return self.candidates[int(np.argmin(times))]

    def ready(self, figures: AutoFigures, x: Any) -> bool:
        """Whether ``resolve`` can choose for ``x`` without measuring (a collective)."""
        kind = _kind(x)
        link = self.link is not None or kind in figures.links
        known = figures.throughput.get(kind, {})
        speed = self.throughput is not None or all(self.key(c) in known for c in self.candidates)
        return link and speed

    def resolve(self, t: Transport, figures: AutoFigures, x: Any,
                inline_bytes: int = INLINE_BYTES) -> Compressor | None:
        """Choose for array ``x``, measuring over ``t`` what ``figures`` lack first
        (collectively, once per communicator and array kind)."""
        kind = _kind(x)
        key = (id(self), kind, x.size, x.nbytes)  # nbytes: whether dense rides inline
        memo = figures.choices.get(key)
        if memo is not None and memo[0] is self:
            return memo[1]
        link = self.link
        if link is None:
            if kind not in figures.links:
                figures.links[kind] = measure_link(t, x)
            link = figures.links[kind]
        throughput = self.throughput
        if throughput is None:
            known = figures.throughput.setdefault(kind, {})
            missing = [c for c in self.candidates if self.key(c) not in known]
            if missing:
                known.update(measure_throughput(t, missing, x))
            throughput = {self.key(c): known[self.key(c)] for c in self.candidates}
        nbytes = x.size * 4  # compressed calls compute in float32
        chooser = Auto(self.candidates, link=link, throughput=throughput)
        choice = chooser.choose(nbytes, t.size, inline_bytes, x.nbytes)
        if _LOG.isEnabledFor(logging.DEBUG):
            seconds = [predict(c, nbytes, t.size, link, throughput[self.key(c)], inline_bytes,
                               x.nbytes) for c in self.candidates]
            costs = ", ".join(f"{self.key(c)} {s:.3g} s"
                              for c, s in zip(self.candidates, seconds, strict=True))
            _LOG.debug("%d bytes over %d ranks: %s (predicted %s)", x.nbytes, t.size,
                       self.key(choice), costs)
        if len(figures.choices) > 4096:
            figures.choices.clear()
        figures.choices[key] = (self, choice)  # keeps self alive, so its id stays its own
        return choice

    def choose_early(self, t: Transport, figures: AutoFigures, x: Any, op: Any, feedback: Any,
                     name: Any, inline_bytes: int = INLINE_BYTES) -> tuple[Any, Any]:
        """The (compression, feedback) to agree on for ``x``: the choice itself when the
        figures are known, so that it is agreed on (every rank chooses alike from the same
        figures, and a choice that differs because the arguments differ is caught there);
        else this Auto, resolved after the agreement (the first call measures, together).

        A dense choice needs no feedback unless a residual is pending, which the compressed
        path then sends in full. Never raises: invalid arguments keep this Auto, so that the
        checked path raises their error on every rank.
        """
        try:
            check_compressed_call(self, x, ReduceOp.parse(op), feedback, name)
            check_dtype(x.dtype)
            if not self.ready(figures, x):
                return self, feedback
            choice = self.resolve(t, figures, x, inline_bytes)
        except (AttributeError, TypeError, ValueError):
            return self, feedback
        if choice is None and feedback is not None and name is not None and (
                feedback.residual(name) is not None):
            return self, feedback  # resolves to dense after the agreement
        return choice, (None if choice is None else feedback)

    @property
    def allreduce_algorithm(self) -> str:
        raise NotImplementedError("Auto chooses a compressor per call; use that one's")

    def wire_bytes(self, length: int, n: int) -> int:
        raise NotImplementedError("Auto chooses a compressor per call; use that one's")

    def hop_work(self, x: Any, own: Any) -> Callable[[], Any]:
        raise NotImplementedError("Auto chooses a compressor per call; use that one's")

    def compress(self, x: Any) -> tuple[Any, tuple[Any, ...]]:
        raise NotImplementedError("Auto chooses a compressor per call; compress with that one")

    def decompress(self, payload: Any, ctx: tuple[Any, ...]) -> Any:
        raise NotImplementedError("Auto chooses a compressor per call; decompress with that one")

    def __repr__(self) -> str:
        names = ", ".join(self.key(c) for c in self.candidates)
        # Fixed figures are part of what every rank must agree on: they decide the choice.
        fixed = "".join(f", {k}={v!r}" for k, v in (("link", self.link),
                                                      ("throughput", self.throughput)) if v)
        return f"Auto(candidates=({names}){fixed})"


def _kind(x: Any) -> str:
    return "device" if _ops.is_device_array(x) else "host"


def _slowest_median(t: Transport, samples: list[float]) -> float:
    """The largest over ranks of this rank's median (the same on every rank)."""
    return max(t.allgather_object(float(np.median(samples))))


def measure_link(t: Transport, like: Any, reps: int = 5) -> LinkModel:
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


def _hop_work(comp: Compressor | None, x: Any, own: Any) -> Callable[[], Any]:
    """One hop of ``comp`` (None: the dense ring's addition), for timing."""
    if comp is not None:
        return comp.hop_work(x, own)
    xp = _ops.get(x)
    out = xp.empty(x.shape, x.dtype)
    return lambda: xp.reduce(ReduceOp.SUM, x, own, out)


def _synchronizer(like: Any) -> Any:
    if _ops.is_device_array(like):
        import cupy

        return cupy.cuda.get_current_stream().synchronize
    return lambda: None


def measure_throughput(t: Transport, candidates: list[Compressor | None], like: Any,
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
        result[Auto.key(comp)] = x.nbytes / _slowest_median(t, samples)
    return result
