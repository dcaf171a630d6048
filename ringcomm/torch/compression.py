"""``hvd.Compression``: Horovod's compression names, mapped onto ringcomm's compressors.

Horovod compresses a tensor before the allreduce and decompresses the result (its fp16
compressor casts). Here the ring itself compresses what it sends (int8 re-quantized per hop,
sparse top-k, half-precision casts): passed to an allreduce or DistributedOptimizer, these
compressors hand their ringcomm compressor to the ring. Called directly, ``fp16`` and ``bf16``
cast as Horovod's do (``compress(t) -> (t.half(), t.dtype)``), so compressors of your own that
wrap or chain them work; ``int8`` and ``topk`` have no tensor-level form and pass the tensor
through. A Horovod-style compressor of your own (a class with ``compress``/``decompress``) is
applied around an uncompressed allreduce.
"""

from __future__ import annotations

from typing import Any

import torch

import ringcomm
from ringcomm.algorithms.auto import Compression as _RingCompression
from ringcomm.codecs.base import Compressor as _RingCompressor

__all__ = ["CastCompressor", "Compression", "Compressor", "RingCompressor", "as_compression",
           "ring_of"]


class Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to reduce and what ``decompress`` needs."""
        raise NotImplementedError("a Compressor must define compress()")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the reduced tensor in its original form."""
        raise NotImplementedError("a Compressor must define decompress()")


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class RingCompressor(NoneCompressor):
    """Compression applied by the ring to what it sends; the tensor itself passes unchanged.

    Args:
        ring: the ringcomm compressor (``ringcomm.Int8()``, ``ringcomm.TopK(0.01)``, ...), or
            a ``ringcomm.Auto`` choosing one per call.
        error_feedback: whether DistributedOptimizer keeps per-parameter residuals of what this
            compressor drops (on for int8 and top-k; the casts round like Horovod's fp16).

    Raises:
        TypeError: ``ring`` is not a ringcomm compressor.
    """

    def __init__(self, ring: _RingCompression, *, error_feedback: bool) -> None:
        if not isinstance(ring, _RingCompression):
            raise TypeError(f"expected a ringcomm compressor or ringcomm.Auto, got "
                            f"{type(ring).__name__}")
        self.ring = ring
        self.error_feedback = bool(error_feedback)

    def __repr__(self) -> str:
        return f"RingCompressor({self.ring!r}, error_feedback={self.error_feedback})"


class CastCompressor(RingCompressor):
    """A half-precision cast: in the ring when passed to a collective, and as Horovod's fp16
    compressor when called (floating tensors cast to ``dtype``, others unchanged).

    Args:
        ring: ``ringcomm.FP16()`` or ``ringcomm.BF16()``.
        dtype: the torch dtype it casts to.
    """

    def __init__(self, ring: _RingCompressor, dtype: torch.dtype) -> None:
        super().__init__(ring, error_feedback=False)
        self.dtype = dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        """``(tensor cast to dtype, its dtype)``; non-floating tensors pass unchanged."""
        cast = tensor.to(self.dtype) if tensor.dtype.is_floating_point else tensor
        return cast, tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        """``tensor`` back in the dtype ``compress`` saw (``ctx``)."""
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


def _cast(ring: _RingCompressor) -> CastCompressor:
    return CastCompressor(ring, torch.float16 if isinstance(ring, ringcomm.FP16)
                          else torch.bfloat16)


def _topk(ratio: float = 0.01, algorithm: str = "ring") -> RingCompressor:
    """Top-k sparsification with error feedback: send the ``ratio`` largest-magnitude entries.

    Raises:
        ValueError: ratio outside (0, 1], or unknown algorithm.
    """
    return RingCompressor(ringcomm.TopK(ratio=ratio, algorithm=algorithm), error_feedback=True)


def _powersgd(rank: int = 1, *, warm_start: bool = True, min_compression_rate: float = 2.0,
              seed: int = 0) -> RingCompressor:
    """PowerSGD rank-``rank`` compression of each gradient matrix, with error feedback; 1-D
    gradients and those it would not shrink go dense. Each call makes a new compressor with its
    own memory of Q (one per optimizer).

    Raises:
        ValueError: rank < 1 or min_compression_rate < 0.
    """
    return RingCompressor(ringcomm.PowerSGD(rank=rank, warm_start=warm_start,
                                            min_compression_rate=min_compression_rate,
                                            seed=seed), error_feedback=True)


class Compression:
    """The compression choices, as ``hvd.Compression.<name>``.

    Attributes:
        none: no compression.
        fp16: IEEE half precision on the wire (2x fewer bytes).
        bf16: bfloat16 on the wire (2x fewer bytes, float32's range).
        int8: int8 blocks with per-block scales (3.9x fewer bytes), with error feedback.
        topk: ``topk(ratio=0.01)`` returns top-k sparsification with error feedback.
        powersgd: ``powersgd(rank=1)`` returns PowerSGD low-rank compression with error
            feedback (each gradient matrix apart, in fused buckets too).

    Error feedback is kept per parameter by ``DistributedOptimizer``, and per operation name
    by ``allreduce`` and ``grouped_allreduce`` (give the call the same name at every step; an
    unnamed call keeps none).

    Example::

        opt = hvd.DistributedOptimizer(opt, model.named_parameters(),
                                       compression=hvd.Compression.int8)
    """

    none = NoneCompressor()
    fp16 = _cast(ringcomm.FP16())
    bf16 = _cast(ringcomm.BF16())
    int8 = RingCompressor(ringcomm.Int8(), error_feedback=True)
    topk = staticmethod(_topk)
    powersgd = staticmethod(_powersgd)


def as_compression(compression: Any) -> Any:
    """Return ``compression`` as something with Horovod's compress/decompress.

    Accepts None (no compression), a Horovod-style compressor (class or instance), or a ringcomm
    compressor or ``ringcomm.Auto`` (wrapped; lossy ones other than the casts get error
    feedback).

    Raises:
        TypeError: anything else.
    """
    if compression is None:
        return Compression.none
    if isinstance(compression, (ringcomm.FP16, ringcomm.BF16)):
        return _cast(compression)
    if isinstance(compression, _RingCompression):
        return RingCompressor(compression, error_feedback=True)
    if callable(getattr(compression, "compress", None)) and callable(
            getattr(compression, "decompress", None)):
        return compression
    raise TypeError(
        "compression must be hvd.Compression.<name>, a ringcomm compressor, or an object with "
        f"compress() and decompress(); got {type(compression).__name__}")


def ring_of(compression: Any) -> _RingCompression | None:
    """The ringcomm compressor that ``compression`` asks the ring to run (what the DDP hook
    takes): None for none (None, ``hvd.Compression.none``), the one ``hvd.Compression.<name>``
    wraps, an ``Auto`` for ``"auto"`` (as ``comm.allreduce`` takes it), a ringcomm compressor or
    an ``Auto`` as it is.

    Raises:
        TypeError: anything else (a Horovod-style compressor of torch tensors included: the
            ring compresses arrays, not tensors).
    """
    if isinstance(compression, str) and compression == "auto":
        return ringcomm.Auto()
    if isinstance(compression, RingCompressor):
        return compression.ring
    if compression is None or isinstance(compression, NoneCompressor):
        return None
    if isinstance(compression, _RingCompression):
        return compression
    raise TypeError(
        "compression must be a ringcomm compressor (ringcomm.Int8(), ringcomm.TopK(0.01), ...), "
        f"\"auto\" or hvd.Compression.<name>, got {compression!r}")
