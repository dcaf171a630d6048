"""What the Horovod-style functions hand to the coordinator: one named operation.

Every collective of ``ringcomm.torch`` becomes an :class:`Op`: its kind, its name (Horovod's
key: operations are matched across ranks by name, not by order), what must be equal on every
rank (``meta``), and the data step that runs once every rank has submitted it. The coordinator
(:mod:`ringcomm.torch.horovod._negotiate`) matches, orders, checks and runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ringcomm.codecs.cast import BF16, FP16
from ringcomm.codecs.int8 import Int8
from ringcomm.codecs.topk import TopK
from ringcomm.comm.base import Communicator

__all__ = ["JOINED_RUNS", "Op", "ReduceSpec", "describe", "ring_from_spec", "ring_spec"]

#: What a rank that has joined runs for a compressed allreduce the others make, by the
#: ``owner`` its meta names (``"allreduce"`` for hvd.allreduce, one per compressing
#: DistributedOptimizer) and the operation's name: ``run(comm, meta)`` contributes zeros
#: through the same compression, name and error feedback as the others (which every rank's
#: call must agree on). Set by the operations and optimizers that compress, on every rank
#: alike (a joined rank made them in the steps before it ran out of data); an allreduce whose
#: meta names no owner, or one not found here, gets plain zeros.
JOINED_RUNS: dict[tuple[str, str], Callable[[Communicator, dict[str, Any]], None]] = {}

#: The ring compressors that keep no state between calls, with the attributes that make them
#: (their constructor's arguments): a rank that has joined rebuilds one from an operation's
#: ``meta`` to take part in it, whether or not it ever made that operation itself.
_STATELESS: dict[type, tuple[str, ...]] = {
    FP16: (), BF16: (), Int8: ("block_size", "stochastic", "seed"),
    TopK: ("ratio", "algorithm", "approximate"),
}


def ring_spec(ring: Any) -> tuple[str, tuple[tuple[str, Any], ...]] | None:
    """What rebuilds ``ring`` (:func:`ring_from_spec`), comparable across ranks; None for a
    compressor that keeps state between calls (PowerSGD, Auto) or one of the user's own."""
    fields = _STATELESS.get(type(ring))
    if fields is None:
        return None
    return type(ring).__name__, tuple((f, getattr(ring, f)) for f in fields)


def ring_from_spec(spec: tuple[str, tuple[tuple[str, Any], ...]]) -> Any:
    """A compressor equal to the one :func:`ring_spec` described (the same repr)."""
    kinds = {kind.__name__: kind for kind in _STATELESS}
    return kinds[spec[0]](**dict(spec[1]))


@dataclasses.dataclass
class ReduceSpec:
    """An allreduce the coordinator may fuse with others, or run with zeros on joined ranks.

    Attributes:
        tensor: this rank's input.
        out: where the result goes (may be ``tensor``: in place).
        op: Horovod's ReduceOp.
        prescale, postscale: Horovod's scaling factors.
        ring: a ringcomm compressor for the ring, or None (compressed ops are never fused).
        feedback_name: where ``ring`` keeps error feedback, the name its residual goes by
            (the operation's own, the same on every rank); None: no error feedback.
    """

    tensor: torch.Tensor
    out: torch.Tensor
    op: Any
    prescale: float = 1.0
    postscale: float = 1.0
    ring: Any = None
    feedback_name: str | None = None


@dataclasses.dataclass
class Op:
    """One collective as submitted by one rank.

    Attributes:
        kind: "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
            "join", "object", ...: the name's prefix, so that kinds never share a name.
        name: the user's name, or None for Horovod's automatic one.
        meta: what must be equal on every rank, field by field (picklable, comparable):
            {"dtype": "torch.float32", "shape": (17, 3), "root": 0, ...}. A field that differs
            fails the operation on every rank with a message naming the field and the ranks.
        run: the data step, ``run(comm) -> result``, run on the coordinator's thread once the
            operation is ready on every rank, in the order every rank agreed on. None for an
            allreduce given by ``reduce``.
        reduce: an allreduce the coordinator may fuse (then ``run`` is None).
        nbytes: this rank's payload size, for the fusion threshold.
    """

    kind: str
    name: str | None
    meta: dict[str, Any]
    run: Callable[[Communicator], Any] | None = None
    reduce: ReduceSpec | None = None
    nbytes: int = 0
    process_set: Any = None


def describe(t: torch.Tensor, *, trailing: bool = False) -> dict[str, Any]:
    """The ``meta`` of a tensor: dtype, device type and shape (after dim 0 if ``trailing``).

    A sparse (or other non-strided) tensor's meta carries its refusal (``"error"``), so that
    the operation fails on every rank, whichever ranks passed one.

    Raises:
        TypeError: ``t`` is not a torch tensor (what was given is named).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    shape = tuple(t.shape[1:]) if trailing else tuple(t.shape)
    meta: dict[str, Any] = {"dtype": str(t.dtype), "device": t.device.type,
                            "shape after the first dimension" if trailing else "shape": shape}
    if t.layout != torch.strided:
        meta["error"] = layout_error(t)
    return meta


def layout_error(t: torch.Tensor) -> str:
    """What a collective of dense tensors says of the non-strided tensor ``t``."""
    return (f"TypeError: expected a dense (strided) tensor, got one of layout {t.layout}: "
            "reduce a sparse gradient with hvd.sparse_allreduce_async (what "
            "DistributedOptimizer does with sparse gradients), or pass t.to_dense()")
