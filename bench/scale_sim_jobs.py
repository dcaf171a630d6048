"""What every simulated rank of bench/scale_sim.py runs: gradients, one allreduce, its clock.

A job is flat (ringcomm's dense ring or the compressed algorithm the compressor names, over
the whole job) or hierarchical (:func:`ringcomm.algorithms.hierarchical.allreduce` over the
node-local and cross-node transports that ``split`` gives). The allreduce is timed on the
virtual clock from a barrier that lines every rank up.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sim_transport import SimTransport

from ringcomm.algorithms import hierarchical, ring
from ringcomm.algorithms.compressed import ALGORITHMS
from ringcomm.codecs.base import Compressor
from ringcomm.core.types import ReduceOp

__all__ = ["BLOCK", "Job", "exact_sum", "gradients", "run_job"]

#: Elements sharing one magnitude in the synthetic gradients (a "layer" of its own scale).
BLOCK = 256


def gradients(rank: int, length: int, seed: int = 0) -> np.ndarray:
    """Synthetic float32 gradients of ``rank``: ``s * (c + e_r)``.

    ``c`` (the part every rank shares, as minibatches of one model share the true gradient) and
    ``e_r`` (this rank's own noise) are standard normal; ``s`` is lognormal(0, 1), one value
    per block of 256 elements, so magnitudes are heavy-tailed across the array as across a
    model's layers.
    """
    common = np.random.default_rng([seed, 0])
    blocks = math.ceil(length / BLOCK)
    s = np.repeat(common.lognormal(0.0, 1.0, blocks), BLOCK)[:length]
    c = common.standard_normal(length)
    e = np.random.default_rng([seed, rank + 1]).standard_normal(length)
    return (s * (c + e)).astype(np.float32)


def exact_sum(n: int, length: int, seed: int = 0) -> np.ndarray:
    """The float64 sum of every rank's :func:`gradients`."""
    total = np.zeros(length, np.float64)
    for r in range(n):
        total += gradients(r, length, seed)
    return total


@dataclass(frozen=True)
class Job:
    """One allreduce of every rank's gradients.

    Attributes:
        length: real elements per rank.
        comp: the compressor (None: dense).
        hier: hierarchical (node-local, cross-node, node-local) instead of flat.
        segment_bytes: the rings' segment size, in real bytes.
        feedback: keep an error-feedback residual (zeros before the call).
        agreement: charge one small allgather first, as the Communicator's argument check.
        seed: of the gradients.
        keep_result: rank 0 returns its result array.
    """

    length: int
    comp: Compressor | None = None
    hier: bool = False
    segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES
    feedback: bool = True
    agreement: bool = False
    seed: int = 0
    keep_result: bool = False


def _allreduce(job: Job, t: SimTransport, groups: tuple[SimTransport, SimTransport] | None,
               x: np.ndarray, out: np.ndarray, residual: np.ndarray | None) -> None:
    op, seg = ReduceOp.SUM, job.segment_bytes
    if groups is not None:
        hierarchical.allreduce(groups[0], groups[1], x, out, op, job.comp, residual, t.rank,
                               segment_bytes=seg)
    elif job.comp is None:
        ring.allreduce(t, x, out, op, segment_bytes=seg)
    else:
        ALGORITHMS[job.comp.allreduce_algorithm](t, x, out, op, job.comp, residual, t.rank,
                                                 segment_bytes=seg)


def run_job(job: Job, t: SimTransport) -> dict[str, Any]:
    """Run ``job`` on this rank; return its virtual time, a digest of its result (and the
    result on rank 0 when asked)."""
    x = gradients(t.rank, job.length, job.seed)
    out = np.empty_like(x)
    residual = np.zeros(job.length, np.float32) if job.feedback and job.comp else None
    groups = None
    if job.hier:
        node, local_rank = divmod(t.g, t.sim.links.ranks_per_node)
        groups = (t.split(node, t.rank), t.split(local_rank, t.rank))
    t.barrier()
    start, compute = t.now(), t.sim.compute[t.g]
    if job.agreement:
        t.allgather_object(("allreduce", job.length, "float32"))
    _allreduce(job, t, groups, x, out, residual)
    result: dict[str, Any] = {"time": t.now() - start,
                              "compute": t.sim.compute[t.g] - compute,
                              "digest": hashlib.sha1(out.tobytes()).hexdigest()}
    if job.keep_result and t.rank == 0:
        result["out"] = out
    return result
