"""fp16 and bf16 casts: half the bytes of float32, rounded to nearest even."""

from __future__ import annotations

from typing import Any, ClassVar

from ringcomm import ops as _ops
from ringcomm.codecs.base import DenseCompressor
from ringcomm.core.types import Array

__all__ = ["BF16", "FP16"]


class _Cast(DenseCompressor):
    fmt: ClassVar[str] = ""

    def nbytes(self, n: int) -> int:
        return _ops.numpy_ops().cast_nbytes(n)

    def encode(self, src: Array, out: Array, *, seed: int = 0, base: int = 0,
               error: Any | None = None) -> None:
        _ops.get(src).cast_encode(src, out, self.fmt, error=error)

    def decode(self, payload: Array, out: Array) -> None:
        _ops.get(payload).cast_decode(payload, out, self.fmt)

    def hop(self, payload: Array, own: Array, out: Array, *, seed: int = 0, base: int = 0,
            error: Any | None = None) -> None:
        _ops.get(own).cast_hop(payload, own, out, self.fmt, error=error)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP16(_Cast):
    """Send IEEE half precision (11-bit significand, range +-65504; larger values become Inf).

    Use for gradients whose magnitudes fit fp16's range (mixed-precision training with loss
    scaling); 2x fewer bytes, relative error about 5e-4 per element.
    """

    fmt: ClassVar[str] = "f16"


class BF16(_Cast):
    """Send bfloat16 (8-bit significand, float32's exponent range): 2x fewer bytes, relative
    error about 4e-3 per element. Magnitudes from 3.3961775e38 (bfloat16's largest,
    3.3895314e38, and half its last step) round to Inf, and their error is not kept, as fp16's
    above 65504."""

    fmt: ClassVar[str] = "bf16"
