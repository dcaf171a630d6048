"""Fusion: several allreduces through one flat buffer, and DistributedOptimizer's buckets.

:func:`reduce_fused` runs the allreduces a negotiation cycle found ready together (or a
grouped allreduce): one collective per dtype, device, op and scaling.

Parameters are taken in a fixed order (the reverse of the optimizer's, which is roughly the
order backward produces their gradients) and cut into buckets of consecutive parameters of one
dtype and device, up to a byte threshold. Every rank cuts the same buckets and reduces them in
the same order, so no negotiation between ranks is needed; a bucket holding one parameter is
reduced in place in its gradient, larger ones through a persistent flat buffer.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, cast

import torch

from ringcomm.comm.base import Communicator
from ringcomm.torch._residuals import ResidualLayouts
from ringcomm.torch._tensors import Operand
from ringcomm.torch.horovod._basics import ReduceOp
from ringcomm.torch.horovod._ops import ReduceSpec
from ringcomm.torch.horovod._reduce import allreduce_tensor, feedback_of

__all__ = ["DEFAULT_FUSION_BYTES", "Bucket", "Reduction", "fusion_threshold", "plan_buckets",
           "reduce_fused"]

#: Fusion threshold when neither the argument nor HOROVOD_FUSION_THRESHOLD sets one: large
#: enough to amortize a collective's fixed cost, small enough that the first buckets leave
#: while backward is still computing the rest.
DEFAULT_FUSION_BYTES = 4 * 1024 * 1024
# One call that copies many tensors (a private name of torch's, used by its optimizers; the
# per-tensor loop stands in where it is missing).
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def fusion_threshold(value: int | None) -> int:
    """The fusion threshold in bytes: ``value``, else $HOROVOD_FUSION_THRESHOLD, else default.

    Raises:
        ValueError: negative, or the environment variable is not an integer.
    """
    if value is None:
        raw = os.environ.get("HOROVOD_FUSION_THRESHOLD", "")
        try:
            value = int(raw) if raw else DEFAULT_FUSION_BYTES
        except ValueError:
            raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {value}")
    return value


def reduce_fused(comm: Communicator, specs: list[ReduceSpec]) -> list[torch.Tensor]:
    """Run the allreduces ``specs``: one collective per dtype, device, op and scaling, through
    a flat buffer where there are several; return their outputs (written in place)."""
    if len(specs) == 1:  # a synchronous call's: no grouping to do
        _reduce_into(comm, specs[0], specs[0].tensor, specs[0].out)
        return [specs[0].out]
    groups: dict[tuple[Any, ...], list[ReduceSpec]] = {}
    for s in specs:
        key = (s.tensor.dtype, s.tensor.device, s.op, s.prescale, s.postscale, id(s.ring))
        groups.setdefault(key, []).append(s)
    for group in groups.values():
        if len(group) == 1:
            _reduce_into(comm, group[0], group[0].tensor, group[0].out)
            continue
        flat = torch.cat(_flat_views([s.tensor for s in group]))
        _reduce_into(comm, group[0], flat, flat)
        _scatter(flat, [s.out for s in group])
    return [s.out for s in specs]


def _reduce_into(comm: Communicator, spec: ReduceSpec, src: torch.Tensor,
                 dst: torch.Tensor) -> None:
    """``src`` reduced into ``dst`` with ``spec``'s op, scaling and compression."""
    name = spec.feedback_name
    feedback = None
    if name is not None:
        feedback = feedback_of(comm)
        if feedback.length(name) not in (None, src.numel()):
            feedback.reset(name)  # the name now names a tensor of another size: afresh
    allreduce_tensor(comm, src, dst, op=spec.op, prescale=spec.prescale,
                     postscale=spec.postscale, compression=spec.ring, feedback=feedback,
                     name=name)


def _flat_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # reshape costs a microsecond per call from Python: 1-d tensors go as they are.
    return [t if t.dim() == 1 else t.reshape(-1) for t in tensors]


def _scatter(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (one batched copy where torch has
    it: the per-tensor copies from Python cost more than the bytes at small sizes)."""
    # torch.split_with_sizes, not Tensor.split: the method's Python wrapper doubles the cost.
    pieces: Sequence[torch.Tensor] = torch.split_with_sizes(flat, [o.numel() for o in outs])
    if any(o.dim() != 1 for o in outs):
        pieces = [p.view(o.shape) for p, o in zip(pieces, outs, strict=True)]
    with torch.no_grad():
        if _FOREACH_COPY is not None:
            _FOREACH_COPY(outs, pieces)
            return
        for o, p in zip(outs, pieces, strict=True):
            o.copy_(p)


class Bucket:
    """Consecutive parameters of one dtype and device reduced by one collective."""

    __slots__ = ("buffer", "layout", "name", "numel", "params", "ready")

    def __init__(self, params: list[torch.Tensor], names: list[str]) -> None:
        self.params = params
        self.name = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        offsets, off = [], 0
        for p, n in zip(params, names, strict=True):
            offsets.append((n, off, p.numel()))
            off += p.numel()
        self.layout: tuple[tuple[str, int, int], ...] = tuple(offsets)  # a Layout
        self.numel = off
        self.buffer: torch.Tensor | None = None
        self.ready = 0


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """``name`` as a sort key that orders numbered parts by number ("layer2" before
    "layer10")."""
    return tuple((1, int(part)) if i % 2 else (0, part)
                 for i, part in enumerate(re.split(r"(\d+)", name)))


def plan_buckets(params: list[torch.Tensor], names: dict[torch.Tensor, str],
                 threshold: int) -> list[Bucket]:
    """Cut ``params`` into buckets of at most ``threshold`` bytes, the same buckets on every
    rank whose parameters have the same names.

    The parameters are taken by their names, not in the order given: the optimizer's order
    may differ between ranks where the names do not (heads of a model built from a ``set``,
    whose order follows each process's hash seed), and buckets cut in it would hold different
    parameters on each rank, pair with nothing, and wait until the stall limit (Horovod,
    which reduces each parameter under its name, runs them). By device and dtype, then names
    in descending natural order: for the usual names (``layer2.0.conv.weight``) close to the
    reverse of the model's order, the order in which backward produces the gradients. A
    parameter larger than the threshold gets a bucket of its own. Names are unique (checked
    where the optimizer is made), so the order is total.
    """
    ordered = sorted(params, reverse=True, key=lambda p: (
        p.device.type, -1 if p.device.index is None else p.device.index, str(p.dtype),
        _natural(names[p]), names[p]))  # the name itself last: "a01" and "a1" sort alike
    buckets: list[Bucket] = []
    run: list[torch.Tensor] = []
    nbytes = 0
    for p in ordered:
        size = p.numel() * p.element_size()
        if run and (p.dtype != run[0].dtype or p.device != run[0].device
                    or nbytes + size > threshold):
            buckets.append(Bucket(run, [names[q] for q in run]))
            run, nbytes = [], 0
        run.append(p)
        nbytes += size
    if run:
        buckets.append(Bucket(run, [names[q] for q in run]))
    return buckets


class Reduction:
    """How DistributedOptimizer reduces a bucket: op, scaling, compression, error feedback.

    ``compression``, a Horovod-style compressor (None for a ring's), applies around an
    ordinary allreduce that DistributedOptimizer submits itself; ``ring`` compresses in it.
    """

    __slots__ = ("comm", "compression", "op", "postscale", "prescale", "residuals", "ring")

    def __init__(self, comm: Communicator | None, op: ReduceOp, prescale: float,
                 postscale: float, compression: Any, ring: Any,
                 residuals: ResidualLayouts | None) -> None:
        self.comm, self.op = comm, op
        self.prescale, self.postscale = prescale, postscale
        self.compression, self.ring, self.residuals = compression, ring, residuals

    def __call__(self, bucket: Bucket) -> None:
        """Reduce the gradients of ``bucket`` in place (runs on the engine's thread)."""
        comm = self.comm
        if comm is None:
            raise RuntimeError("this rank is outside the optimizer's process set: it reduces "
                               "no gradients")
        # DistributedOptimizer gives every parameter of a bucket a gradient before submitting it.
        grads = cast("list[torch.Tensor]", [p.grad for p in bucket.params])
        fused = len(grads) > 1 or not grads[0].is_contiguous()
        if fused:
            if bucket.buffer is None:
                bucket.buffer = grads[0].new_empty(bucket.numel)
            flat = bucket.buffer
            torch.cat([g.reshape(-1) for g in grads], out=flat)
        else:  # flat, as every rank agrees on it (a joined rank's zeros are (numel,) too)
            flat = grads[0].reshape(-1)
        name = feedback = None
        if self.residuals is not None:
            name, feedback = bucket.name, self.residuals.feedback
            self.residuals.align(name, bucket.layout, lambda: Operand(flat).array.reshape(-1))
        # A compressor working per tensor (PowerSGD) needs the fused gradients' shapes.
        ring = self.ring
        if ring is not None and (fused or grads[0].dim() != 1):
            ring = ring.with_shapes([g.shape for g in grads])
        allreduce_tensor(comm, flat, flat, op=self.op, prescale=self.prescale,
                         postscale=self.postscale, compression=ring,
                         feedback=feedback if name else None, name=name)
        if fused:
            for g, (_, off, n) in zip(grads, bucket.layout, strict=True):
                g.copy_(flat[off: off + n].view(g.shape))
