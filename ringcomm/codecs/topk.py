"""Top-k sparsification: send the k entries largest in magnitude as (index, value) pairs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.codecs.base import Compressor, check_float
from ringcomm.core.types import Array

__all__ = ["TopK"]

_ALGORITHMS = ("ring", "allgather")


class TopK(Compressor):
    """Keep the ``ceil(ratio * n)`` entries of largest magnitude; the rest go to the residual.

    Args:
        ratio: fraction of entries sent, in (0, 1].
        algorithm: "ring" re-sparsifies every hop's partial sum to its chunk's share of k, so
            each rank moves about 2k(n-1)/n pairs; chunks where pairs would outweigh the dense
            values travel dense. "allgather" gathers every rank's k pairs and sums them exactly
            on every rank ((n-1)k pairs received per rank).
        approximate: send the earliest entries that reach a threshold estimated from a 1%
            sample (Deep Gradient Compression) instead of exactly the k largest: no partition
            at all, so cheaper on large tensors; what is skipped stays in the residual.

    Use with error feedback: alone it drops (1 - ratio) of the gradient every step.

    Raises:
        ValueError: ratio outside (0, 1], or unknown algorithm.
    """

    ratio: float
    algorithm: str
    approximate: bool

    def __init__(self, ratio: float = 0.01, algorithm: str = "ring",
                 approximate: bool = False) -> None:
        if (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
                or not 0 < float(ratio) <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected 'ring' or 'allgather'")
        self.ratio = float(ratio)
        self.algorithm = algorithm
        self.approximate = bool(approximate)

    @property
    def allreduce_algorithm(self) -> str:
        return f"sparse-{self.algorithm}"

    def wire_bytes(self, length: int, n: int) -> int:
        return self.message_nbytes(length // n)

    def message_nbytes(self, length: int) -> int:
        """Bytes of the sparse ring's message for a chunk of ``length`` elements: its k pairs of
        8 bytes, or its float32 values where the pairs would not be smaller (it travels dense)."""
        return min(8 * self.k_for(length), 4 * length)

    def hop_work(self, x: Array, own: Array) -> Callable[[], Any]:
        k = self.k_for(x.size)
        return lambda: self.select(x, k)

    def k_for(self, n: int) -> int:
        """Entries kept of an array of ``n``: ceil(ratio * n), at least 1 when n > 0."""
        return min(n, max(1 if n else 0, math.ceil(self.ratio * n - 1e-9)))

    def select(self, x: Array, k: int, *, seed: int = 0) -> tuple[Any, Any]:
        """The ``k`` largest-magnitude entries of float32 ``x``: (int32 indices, float32 values).

        NaN and Inf rank first. Where ``x`` holds more than k of them, the first pair is the
        overflow mark (index ``-1``, NaN): whoever adds the pairs makes every entry NaN, so no
        NaN or Inf comes out finite.
        """
        xp = _ops.get(x)
        idx, val = xp.topk(x, k, approximate=self.approximate, seed=seed)
        xp.topk_overflow(x, idx, val)
        return idx, val

    @staticmethod
    def pack(idx: Array, val: Array, out: Array) -> Any:
        """Write pairs into the payload layout: k int32 indices, then k float32 values."""
        k = idx.size
        out[: 4 * k].view(np.int32)[:] = idx
        out[4 * k: 8 * k].view(np.float32)[:] = val
        return out

    @staticmethod
    def unpack(payload: Array) -> tuple[Any, Any]:
        """Split a payload into its (indices, values) views."""
        k = payload.size // 8
        return payload[: 4 * k].view(np.int32), payload[4 * k: 8 * k].view(np.float32)

    def compress(self, x: Array) -> tuple[Any, tuple[Any, ...]]:
        check_float(x.dtype)
        xp = _ops.get(x)
        flat = xp.empty((x.size,), np.float32)
        xp.copy(flat, xp.ascontiguous(x).reshape(-1))
        idx, val = self.select(flat, self.k_for(x.size))
        return self.pack(idx, val, xp.empty((8 * idx.size,), np.uint8)), (x.shape, x.dtype)

    def decompress(self, payload: Array, ctx: tuple[Any, ...]) -> Array:
        shape, dtype = ctx
        xp = _ops.get(payload)
        flat = xp.zeros((int(np.prod(shape, dtype=np.int64)),), np.float32)
        xp.scatter_add(flat, *self.unpack(payload))
        out = xp.empty(shape, dtype)
        xp.copy(out.reshape(-1), flat)
        return out

    def __repr__(self) -> str:
        return (f"TopK(ratio={self.ratio}, algorithm={self.algorithm!r}, "
                f"approximate={self.approximate})")
