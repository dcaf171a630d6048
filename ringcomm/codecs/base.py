"""The Compressor interface, and what a compressor lets the ring do with its payload."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ringcomm import ops as _ops
from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.core.types import Array, ReduceOp

__all__ = ["Compressor", "DenseCompressor", "check_compressed_args", "check_compressed_call"]


class Compressor(abc.ABC):
    """A stateless compressor: ``compress(x) -> (payload, ctx)``, ``decompress(payload, ctx)``.

    ``payload`` is what travels (one contiguous uint8 array); ``ctx`` stays on the rank that
    compressed (shape and dtype). Compressors keep no state between calls; what they lose is
    kept by an :class:`~ringcomm.ErrorFeedback`. Values are computed in float32.

    A compressor also says how the library uses it: which compressed allreduce reduces its
    payloads (``allreduce_algorithm``, a name in ``ringcomm.algorithms.compressed``), what one
    ring step puts on the wire (``wire_bytes``), what one hop costs (``hop_work``, which
    ``compression="auto"`` times), and whether it may compress a shard of an array as well as
    the whole (``shardable``).
    """

    #: Whether the compressed allreduce of a part of an array gives that part's result, so
    #: the two-level allreduce can reduce each node's shard through it (codecs that treat every
    #: element alike); False where the payload depends on the tensors' shapes (PowerSGD).
    shardable: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def allreduce_algorithm(self) -> str:
        """The name of the compressed allreduce that reduces this compressor's payloads."""

    @abc.abstractmethod
    def wire_bytes(self, length: int, n: int) -> int:
        """Bytes one ring step moves in an allreduce of ``length`` float32 elements over ``n``
        ranks (one chunk's payload)."""

    @abc.abstractmethod
    def hop_work(self, x: Array, own: Array) -> Callable[[], Any]:
        """A function doing one hop's work on float32 ``x`` (a received partial) and ``own``
        (this rank's contribution), for timing; it may reuse buffers between calls."""

    @abc.abstractmethod
    def compress(self, x: Array) -> tuple[Any, tuple[Any, ...]]:
        """Compress floating array ``x``; returns (payload bytes, ctx)."""

    @abc.abstractmethod
    def decompress(self, payload: Array, ctx: tuple[Any, ...]) -> Array:
        """Rebuild an array of ``x``'s shape and dtype from what ``compress`` returned."""

    def with_shapes(self, shapes: Any) -> Compressor:
        """This compressor for a flat buffer holding tensors of ``shapes``, in order; those
        that treat every element alike ignore the shapes and return themselves."""
        return self

    def bind(self, x: Array, name: str | None) -> Compressor:
        """The compressor serving one call on array ``x`` under ``name`` (itself, unless it
        depends on the tensor's shape or name); raises TypeError or ValueError for an ``x`` it
        cannot serve."""
        return self

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))


class DenseCompressor(Compressor):
    """A compressor whose payload encodes every element (casts, int8): the ring can cut it into
    segments of whole ``align``-element blocks and re-encode it at every hop."""

    #: Chunks and segments are cut at multiples of this many elements.
    align: int = 1

    @property
    def allreduce_algorithm(self) -> str:
        return "ring"

    def wire_bytes(self, length: int, n: int) -> int:
        return self.nbytes(length // n)

    def hop_work(self, x: Array, own: Array) -> Callable[[], Any]:
        xp = _ops.get(x)
        payload = xp.empty((self.nbytes(x.size),), np.uint8)
        out = xp.empty((payload.size,), np.uint8)
        error = xp.empty(x.shape, x.dtype)
        self.encode(x, payload)
        return lambda: self.hop(payload, own, out, error=error)

    @abc.abstractmethod
    def nbytes(self, n: int) -> int:
        """Payload bytes for ``n`` elements."""

    @abc.abstractmethod
    def encode(self, src: Array, out: Array, *, seed: int = 0, base: int = 0,
               error: Any | None = None) -> None:
        """Encode float32 ``src`` into ``out``; ``error`` receives src - decode(out).

        ``seed`` and ``base`` (the global index of ``src[0]``) key the random numbers of
        stochastic rounding, so any segmentation of an array draws the same ones.
        """

    @abc.abstractmethod
    def decode(self, payload: Array, out: Array) -> None:
        """Decode ``payload`` into float32 ``out``."""

    @abc.abstractmethod
    def hop(self, payload: Array, own: Array, out: Array, *, seed: int = 0, base: int = 0,
            error: Any | None = None) -> None:
        """Decode ``payload``, add float32 ``own``, encode the sum into ``out`` (one fused pass on
        the GPU); ``error`` receives the sum minus its decoded encoding."""

    def compress(self, x: Array) -> tuple[Any, tuple[Any, ...]]:
        check_float(x.dtype)
        xp = _ops.get(x)
        flat = xp.empty((x.size,), np.float32)
        xp.copy(flat, xp.ascontiguous(x).reshape(-1))
        out = xp.empty((self.nbytes(x.size),), np.uint8)
        self.encode(flat, out)
        return out, (x.shape, x.dtype)

    def decompress(self, payload: Array, ctx: tuple[Any, ...]) -> Array:
        shape, dtype = ctx
        xp = _ops.get(payload)
        n = int(np.prod(shape, dtype=np.int64))
        flat = xp.empty((n,), np.float32)
        self.decode(payload, flat)
        out = xp.empty(shape, dtype)
        xp.copy(out.reshape(-1), flat)
        return out


def check_float(dtype: Any) -> None:
    """Raise TypeError unless ``dtype`` is a floating dtype (bfloat16 included)."""
    dt = np.dtype(dtype)
    if dt.kind != "f" and dt.name != "bfloat16":
        raise TypeError(f"compression needs a floating dtype, got {dt.name}")


def check_compressed_call(compression: Any, x: Array, op: ReduceOp,
                          feedback: ErrorFeedback | None, name: str | None) -> Compressor:
    """Check the arguments of a compressed allreduce of ``x``.

    Returns:
        The compressor bound to this call (``compression.bind(x, name)``).

    Raises:
        TypeError: ``compression`` is no Compressor, ``feedback`` no ErrorFeedback, or the
            dtype is not floating.
        ValueError: op other than sum/avg, feedback without a name, or a residual kept under
            ``name`` that does not fit ``x``.
    """
    if not isinstance(compression, Compressor):
        raise TypeError(
            f"compression must be a ringcomm compressor (FP16, BF16, Int8, TopK) or \"auto\", "
            f"got {type(compression).__name__}"
        )
    check_compressed_args(x, op, feedback, name)
    return compression.bind(x, name)


def check_compressed_args(x: Array, op: ReduceOp, feedback: ErrorFeedback | None,
                          name: str | None) -> None:
    """Check what a compressed allreduce of ``x`` needs whatever its compressor: a floating
    dtype, op sum or avg, and ``feedback`` with a ``name`` its residual fits.

    Raises:
        TypeError, ValueError: as ``check_compressed_call``.
    """
    check_float(x.dtype)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"compressed allreduce supports op 'sum' and 'avg', got {op.value!r}")
    if feedback is not None:
        if not isinstance(feedback, ErrorFeedback):
            raise TypeError(f"feedback must be an ErrorFeedback, got {type(feedback).__name__}")
        if not name:
            raise ValueError("feedback needs name=... to key the residual of this tensor")
        feedback.check(name, x)
